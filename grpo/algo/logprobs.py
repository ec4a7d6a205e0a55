"""Token log-probs of completions from the decoder's hidden states, never the full logits.

The decoder returns hidden states (B, T, C); only the positions whose next token counts are
gathered, and `kernels.fused_logprobs` turns them into log p(token) at a temperature
(chunked torch on CPU, Triton on CUDA), so no (B, T, V) logits tensor is ever built.
"""

from __future__ import annotations

import torch

import kernels
from grpo.lora import LoRALinear


def head_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    impl: str = "auto",
    return_entropy: bool = False,
    entropy_grad: bool = False,
):
    """log softmax(lm_head(hidden) / T)[targets] through the fused path.

    Args:
        lm_head: an `nn.Linear` (no bias) or a `LoRALinear` around one.
        hidden: (N, C) final-norm hidden states.
        targets: (N,) token ids.
        temperature: T > 0.
        impl: kernels implementation ("auto", "chunked", "naive", "triton").
        return_entropy: also return the (N,) entropy (no grad unless `entropy_grad`).
        entropy_grad: make the entropy differentiable too (an entropy bonus in the loss).

    Returns:
        (N,) float32 log-probs, differentiable in hidden and the trainable head weights
        [and (N,) entropy].
    """
    weight = lm_head.weight  # (V, C)
    if isinstance(lm_head, LoRALinear) and not (lm_head.merged or lm_head.disabled):
        # [h, s * dropout(h) A^T] @ [W, B]^T == h W^T + s * dropout(h) A^T B^T  (LoRA head)
        lora_h = lm_head.scale * (lm_head.dropout(hidden) @ lm_head.lora_a.t())  # (N, r)
        hidden = torch.cat([hidden, lora_h.to(hidden.dtype)], dim=-1)  # (N, C + r)
        weight = torch.cat([weight, lm_head.lora_b.to(weight.dtype)], dim=-1)  # (V, C + r)
    hidden = hidden.to(weight.dtype).contiguous()
    return kernels.fused_logprobs(
        hidden,
        weight.contiguous(),
        targets.contiguous(),
        temperature=temperature,
        impl=impl,
        return_entropy=return_entropy or entropy_grad,
        entropy_grad=entropy_grad,
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
):
    """Log-probs of the completion tokens of a prompt+completion batch.

    Args:
        model: a `Decoder` (possibly with LoRA).
        ids: (B, T_p + T_c) left-padded prompts followed by completions.
        attention_mask: (B, T_p + T_c) bool, True = real token.
        prompt_width: T_p, the column where completions start.
        completion_mask: (B, T_c) bool: which completion tokens to score.
        temperature: the sampling temperature the log-probs are taken at.
        impl: kernels implementation.
        return_entropy: also return (B, T_c) per-token entropy (no grad unless `entropy_grad`).
        entropy_grad: differentiable entropy (for loss.entropy_coef > 0).

    Returns:
        (B, T_c) float32 log-probs, 0 where completion_mask is False [and the entropy].
    """
    hidden = model(ids, attention_mask=attention_mask, return_hidden=True)  # (B, T, C)
    h = hidden[:, prompt_width - 1 : -1]  # (B, T_c, C): position t predicts token t + 1
    targets = ids[:, prompt_width:]  # (B, T_c)
    mask = completion_mask.bool()
    return_entropy = return_entropy or entropy_grad
    out = head_logprobs(
        model.lm_head, h[mask], targets[mask], temperature, impl, return_entropy, entropy_grad
    )  # (N,) for the N counted tokens only
    logprobs, entropy = out if return_entropy else (out, None)
    full = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)
    full = full.masked_scatter(mask, logprobs)  # (B, T_c)
    if not return_entropy:
        return full
    ent = torch.zeros(mask.shape, dtype=torch.float32, device=ids.device)
    entropy = entropy.float() if entropy_grad else entropy.detach().float()
    return full, ent.masked_scatter(mask, entropy)


class CompletionLogprobs(torch.nn.Module):
    """`completion_logprobs` as a module, so that DDP wraps the whole computation (decoder and
    lm_head) in one forward and syncs every trainable parameter's gradient."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, attention_mask, prompt_width, completion_mask, temperature=1.0,
                return_entropy=False, entropy_grad=False):  # fmt: skip
        return completion_logprobs(
            self.model, ids, attention_mask, prompt_width, completion_mask, temperature,
            return_entropy=return_entropy, entropy_grad=entropy_grad,
        )  # fmt: skip
