"""Token log-probs of completions from the decoder's hidden states, never the full logits.

The decoder returns hidden states (B, T, C); only the positions whose next token counts are
gathered, and `grpo_kernels.fused_logprobs` turns them into log p(token) at a temperature
(chunked torch on CPU, Triton on CUDA), so no (B, T, V) logits tensor is ever built.
"""

from __future__ import annotations

import torch

import grpo_kernels

# pack_rows and packed_overhead live in grpo.models.packed_rows; importable from here too
from grpo.models.packed_rows import PackedRows, pack_rows, packed_overhead  # noqa: F401
from grpo.plugins import named_errors, no_exit
from grpo.precision import Precision, head_operands, no_autocast


def head_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "auto",
    return_entropy: bool = False,
    entropy_grad: bool = False,
    head_precision: str = "float32",
):
    """log softmax(lm_head(hidden) / T)[targets] through the fused path, with the operands of
    `grpo.precision.head_operands` (the sampler's logits come from the same ones).

    Args:
        lm_head: an `nn.Linear` (no bias) or a `LoRALinear` around one.
        hidden: (N, C) final-norm hidden states.
        targets: (N,) token ids.
        temperature: T > 0.
        impl: grpo_kernels implementation ("auto", "chunked", "naive", "triton").
        return_entropy: also return the (N,) entropy (no grad unless `entropy_grad`).
        entropy_grad: make the entropy differentiable too (an entropy bonus in the loss).
        head_precision: "float32", "tf32" or "bf16" (`grpo.precision.Precision.head`).

    Returns:
        (N,) float32 log-probs, differentiable in hidden and the trainable head weights
        [and (N,) entropy].
    """
    hidden, weight = head_operands(lm_head, hidden, head_precision)  # (N, C'), (V, C')
    what = f"log-prob kernel {impl!r}"
    # a plug-in kernel's error is one line naming it; a built-in's keeps its traceback (ours)
    builtin = not callable(impl) and grpo_kernels.get_logprob_impl(impl) is None
    with no_autocast(hidden.device.type), no_exit(what), named_errors(what, builtin=builtin):
        return grpo_kernels.fused_logprobs(
            hidden.contiguous(),
            weight.contiguous(),
            targets.contiguous(),
            temperature=temperature,
            impl=impl,
            return_entropy=return_entropy or entropy_grad,
            entropy_grad=entropy_grad,
            tf32=head_precision == "tf32",
        )


def completion_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "auto",
    return_entropy: bool = False,
    entropy_grad: bool = False,
    has_holes: bool = False,
    group_size: int | None = None,
    head_precision: str = "float32",
    packed: PackedRows | None = None,
):
    """Log-probs of the completion tokens of a prompt+completion batch.

    Args:
        model: a `Decoder` (possibly with LoRA).
        ids: (B, T_p + T_c) left-padded prompts followed by completions.
        attention_mask: (B, T_p + T_c) bool, True = real token.
        prompt_width: T_p, the column where completions start.
        completion_mask: (B, T_c) bool: which completion tokens to score.
        temperature: the sampling temperature the log-probs are taken at.
        impl: grpo_kernels implementation.
        return_entropy: also return (B, T_c) per-token entropy (no grad unless `entropy_grad`).
        entropy_grad: differentiable entropy (for loss.entropy_coef > 0).
        has_holes: the completion region has holes (multi-turn rollouts): each token is then
            scored from the last real position before it rather than the one next to it.
        group_size: G when rows b*G .. b*G + G - 1 share one prompt: the prompt then runs once
            per group (`shared_prefix_hidden`); None runs every row in full.
        head_precision: the lm_head's precision (`head_logprobs`).
        packed: the rows packed on one token axis (`pack_rows`, train.pack_sequences): the
            layout then says which tokens run and which are scored; attention_mask,
            prompt_width, completion_mask, has_holes and group_size are not read.

    Returns:
        (B, T_c) float32 log-probs, 0 where completion_mask is False [and the entropy].
    """
    if packed is not None:
        return packed_completion_logprobs(
            model, ids, packed, temperature, impl, return_entropy, entropy_grad, head_precision
        )
    w = prompt_width
    if group_size is None:
        hidden = model(ids, attention_mask=attention_mask, return_hidden=True)  # (B, T, C)
        tail = hidden[:, w - 1 :]  # (B, 1 + T_c, C): positions T_p - 1 ... T - 1
    else:
        tail = shared_prefix_hidden(model, ids, attention_mask, w, group_size)
    targets = ids[:, w:]  # (B, T_c)
    mask = completion_mask.bool()
    if not has_holes:
        h = tail[:, :-1]  # (B, T_c, C): position t predicts token t + 1
        h_scored = h[mask]  # (N, C)
    else:
        # multi-turn: holes between turns; a token is predicted by the last *real* position
        # before it (the one the sampler's logits came from), not by the hole next to it; that
        # is never before the prompt's last position (prompts are left-padded)
        rows, prev = _previous_real(attention_mask)
        h_scored = tail[rows[:, w:][mask], prev[:, w:][mask] - (w - 1)]  # (N, C)
    return_entropy = return_entropy or entropy_grad
    out = head_logprobs(
        model.lm_head,
        h_scored,
        targets[mask],
        temperature,
        impl,
        return_entropy,
        entropy_grad,
        head_precision,
    )  # (N,)
    logprobs, entropy = out if return_entropy else (out, None)
    full = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)
    full = full.masked_scatter(mask, logprobs)  # (B, T_c)
    if not return_entropy:
        return full
    ent = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)
    entropy = entropy.float() if entropy_grad else entropy.detach().float()
    return full, ent.masked_scatter(mask, entropy)


def packed_completion_logprobs(
    model,
    ids,
    packed: PackedRows,
    temperature=1.0,
    impl="auto",
    return_entropy=False,
    entropy_grad=False,
    head_precision="float32",
):
    """`completion_logprobs` of packed rows: one forward over the stream's N real tokens, the
    head at the scored positions only. Same arguments and result; `ids` (B, T) are the rows
    the layout was built from."""
    B, T_c = packed.shape
    if ids.shape[0] != B:
        raise ValueError(f"the packed layout is of {B} rows, got ids of {ids.shape[0]}")
    flat = ids.reshape(-1)
    tokens = flat[packed.src][None]  # (1, N)
    hidden = model(tokens, packed=packed.segments, return_hidden=True)[0]  # (N, C)
    return_entropy = return_entropy or entropy_grad
    h = hidden.index_select(0, packed.pred)  # (N_s, C): each scored token's predictor
    out = head_logprobs(
        model.lm_head,
        h,
        flat[packed.target],
        temperature,
        impl,
        return_entropy,
        entropy_grad,
        head_precision,
    )  # (N_s,)
    logprobs, entropy = out if return_entropy else (out, None)
    full = torch.zeros(B * T_c, dtype=torch.float32, device=ids.device)
    full = full.index_copy(0, packed.dst, logprobs.float()).view(B, T_c)
    if not return_entropy:
        return full
    entropy = entropy.float() if entropy_grad else entropy.detach().float()
    ent = torch.zeros(B * T_c, dtype=torch.float32, device=ids.device)
    return full, ent.index_copy(0, packed.dst, entropy).view(B, T_c)


class _RecordKV:
    """A KV 'cache' for one forward from position 0 that keeps each layer's keys and values
    (with their autograd history) instead of writing them into a buffer.

    Under gradient checkpointing backward recomputes each block, which calls `update` again:
    the first (forward) tensors are kept, the ones the completion pass attended over; the
    recomputed copies are not stored, so they do not outlive their block's backward."""

    static = False

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, T: int) -> None:
        self.pos += T


class _PrefixKV:
    """Per-layer keys and values of P shared prefixes (P, H_kv, T_p, D), possibly requiring
    grad, each serving G rows: a forward of B = P*G rows at positions T_p ... attends over its
    row's prefix and its own tokens (concatenated, not written in place, so gradients flow back
    into the prefix's computation, and a checkpointed block can be recomputed).

    The G-fold copy is made per layer inside `update`, not up front: only the P-row tensors
    live across the forward (and, under gradient checkpointing, until backward); each layer's
    (B, H_kv, T_p, D) copy is transient (`repeat_interleave` keeps nothing for backward, and
    its backward sums the G rows' gradients into the one prompt computation)."""

    static = False

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], group_size: int):
        self.k, self.v, self.G = k, v, group_size
        self.pos = k[0].shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k_p = self.k[layer].repeat_interleave(self.G, dim=0)  # (B, H_kv, T_p, D)
        v_p = self.v[layer].repeat_interleave(self.G, dim=0)
        return torch.cat([k_p, k], dim=2), torch.cat([v_p, v], dim=2)  # (B, H_kv, T_p + T, D)

    def advance(self, T: int) -> None:
        self.pos += T


def shared_prefix_hidden(model, ids, attention_mask, prompt_width: int, group_size: int):
    """Hidden states of positions T_p - 1 ... T - 1 with each group's prompt run once.

    The P = B / G prompts (rows 0, G, 2G, ...) run with gradient; their per-layer keys and
    values are repeated to the group's G rows (`repeat_interleave`, whose backward sums the G
    rows' gradients into the one prompt computation), and the completions run against them
    through the decoder's KV-cache path (causal within the completion, full over the prompt,
    positions from the attention mask), the same attention code the sampler uses.

    With `model.gradient_checkpointing` on (in training mode) both passes checkpoint every
    block, as the full-row forward does: what stays from forward to backward is each block's
    input plus the P prompts' keys and values of every layer (L x 2 x (P, H_kv, T_p, D)).

    Returns:
        (B, 1 + T_c, C): the prompt's last position (which predicts the first completion token),
        then every completion position.
    """
    B, w, G = ids.shape[0], prompt_width, group_size
    if B % G:
        raise ValueError(f"{B} rows do not split into groups of {G}")
    record = _RecordKV(len(model.layers))
    prompt_hidden = model(
        ids[::G, :w], attention_mask=attention_mask[::G, :w], kv_cache=record, return_hidden=True
    )  # (P, T_p, C)
    prefix = _PrefixKV(record.k, record.v, G)  # repeated to the G rows layer by layer
    completion_hidden = model(
        ids[:, w:], attention_mask=attention_mask, kv_cache=prefix, return_hidden=True
    )  # (B, T_c, C)
    last = prompt_hidden[:, -1:].repeat_interleave(G, dim=0)  # (B, 1, C)
    return torch.cat([last, completion_hidden], dim=1)


def _previous_real(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index pair (rows, cols) (B, T) of the last real position strictly before each position
    (0 where there is none), for gathering hidden states across holes."""
    B, T = attention_mask.shape
    cols = torch.arange(T, device=attention_mask.device).expand(B, T)
    last_real = torch.where(attention_mask.bool(), cols, -1).cummax(dim=1).values  # (B, T)
    prev = torch.cat([last_real.new_full((B, 1), -1), last_real[:, :-1]], dim=1).clamp(min=0)
    rows = torch.arange(B, device=attention_mask.device)[:, None].expand(B, T)
    return rows, prev


class CompletionLogprobs(torch.nn.Module):
    """`completion_logprobs` as a module, so that DDP wraps the whole computation (decoder and
    lm_head) in one forward and syncs every trainable parameter's gradient; the decoder runs
    under the precision policy's autocast, the head in its `head` precision (float32 logits
    whatever the autocast)."""

    def __init__(self, model: torch.nn.Module, precision: Precision | None = None):
        super().__init__()
        self.model = model
        self.precision = precision or Precision.of_model(model)

    def forward(
        self,
        ids,
        attention_mask,
        prompt_width,
        completion_mask,
        temperature=1.0,
        return_entropy=False,
        entropy_grad=False,
        has_holes=False,
        group_size=None,
        packed=None,
    ):
        with self.precision.autocast(ids.device):
            return completion_logprobs(
                self.model,
                ids,
                attention_mask,
                prompt_width,
                completion_mask,
                temperature,
                return_entropy=return_entropy,
                entropy_grad=entropy_grad,
                has_holes=has_holes,
                group_size=group_size,
                head_precision=self.precision.head,
                impl=self.precision.logprob_impl,
                packed=packed,
            )
