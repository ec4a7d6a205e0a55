"""The decoder: embed -> L x (attention + MLP) -> norm -> lm_head, for Llama / Qwen2 / Qwen3.

Module names follow the Hugging Face layout (`layers.0.self_attn.q_proj`, ...) so that
checkpoint loading and LoRA adapter files need no renaming beyond the `model.` prefix.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from grpo.models import sdpa_choice
from grpo.models.config import ModelConfig
from grpo.models.kv_cache import GroupedKVCache, KVCache
from grpo.models.varlen import PackedSegments

# rotary table rows kept whole (cos and sin, float32): at D=128, 64 MiB
ROPE_TABLE_MAX = 65536


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as the HF families do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm is x * rsqrt(mean(x^2) + eps), bit for bit, in one call instead of five.
        dtype = x.dtype
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) of rotary embeddings, with optional llama3 scaling."""
    D = cfg.head_dim
    # on the CPU whatever the default device (the caller moves the table): on the meta device
    # these few ops would run Python reference kernels (see `meta_decoder`)
    steps = torch.arange(0, D, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / D))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, the middle blended.
    factor = rs["factor"]
    low, high = rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def softmax_dtype(x: torch.Tensor) -> torch.dtype:
    """The attention softmax's dtype: float32 for 16-bit inputs, else theirs (float64 stays)."""
    return torch.promote_types(x.dtype, torch.float32)


def decode_attention(q, k, v, mask):
    """Attention of one query per row: two small batched matmuls and a float32 softmax.

    Same math as SDPA (GQA included); on CPU it costs ~25% less than SDPA's flash kernel at
    decode shapes, where the whole step is a few hundred microseconds.

    Args:
        q: (B, H, 1, D); k, v: (B, H_kv, S, D); mask: (B, 1, 1, S) additive.

    Returns:
        (B, H, 1, D).
    """
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    q = q.reshape(B, H_kv, H // H_kv, D)  # the query heads that share each kv head
    scores = (q @ k.transpose(-1, -2)).to(softmax_dtype(q)) * D**-0.5 + mask  # (B, H_kv, g, S)
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, 1, D)


def decode_sdpa(q, k, v, mask):
    """`decode_attention` through SDPA's fused kernels (the CUDA decode step), grouped-query
    heads kept: the g = H / H_kv query heads that share a kv head become g queries of that one
    head, so keys and values stay H_kv heads (no repeat) and the mask broadcasts over the g
    queries. Memory-efficient attention takes this layout with a mask; the mask and
    `enable_gqa` together fall to the math kernel, which repeats K and V to H heads (at B=128,
    S=1280 for Qwen3-0.6B, ~90 GB of traffic per decode step).

    Args:
        q: (B, H, 1, D); k, v: (B, H_kv, S, D); mask: (B, 1, 1, S) additive, q's dtype.

    Returns:
        (B, H, 1, D).
    """
    B, H, _, D = q.shape
    H_kv = k.shape[1]
    y = F.scaled_dot_product_attention(q.reshape(B, H_kv, H // H_kv, D), k, v, attn_mask=mask)
    return y.reshape(B, H, 1, D)


def grouped_decode_attention(q, k_p, v_p, k, v, mask):
    """`decode_attention` over a `GroupedKVCache`: each group's G rows attend over their shared
    prompt's keys (read once for the G rows) and over their own tokens, in one softmax.

    The scores of a prompt's keys are one batched matmul of its G rows' queries together, so
    each prompt key and value is read once per group, not once per row; the softmax is taken
    over the concatenated scores, as `decode_attention` over the G-fold copied cache would.

    Args:
        q: (B, H, 1, D) with B = P*G, a group's rows adjacent.
        k_p, v_p: (P, H_kv, T_p, D) the prompts' keys and values.
        k, v: (B, H_kv, S_c, D) each row's own keys and values.
        mask: (B, 1, 1, T_p + S_c) additive, over the prompt's slots then the row's.

    Returns:
        (B, H, 1, D).
    """
    B, H, _, D = q.shape
    P, H_kv, T_p, _ = k_p.shape
    G, g = B // P, H // H_kv
    q = q.reshape(B, H_kv, g, D)  # the query heads that share each kv head
    q_grouped = q.reshape(P, G, H_kv, g, D).transpose(1, 2).reshape(P, H_kv, G * g, D)
    s_prompt = q_grouped @ k_p.transpose(-1, -2)  # (P, H_kv, G*g, T_p)
    s_prompt = s_prompt.view(P, H_kv, G, g, T_p).transpose(1, 2).reshape(B, H_kv, g, T_p)
    s_own = q @ k.transpose(-1, -2)  # (B, H_kv, g, S_c)
    # scaled, masked and normalized in float32 (16-bit inputs), as `decode_attention` does
    scores = torch.cat([s_prompt, s_own], dim=-1).to(softmax_dtype(q)) * D**-0.5 + mask
    w = scores.softmax(-1).to(v.dtype)
    w_prompt = w[..., :T_p].reshape(P, G, H_kv, g, T_p).transpose(1, 2).reshape(P, H_kv, G * g, T_p)
    y_prompt = (w_prompt @ v_p).view(P, H_kv, G, g, D).transpose(1, 2).reshape(B, H_kv, g, D)
    y_own = w[..., T_p:] @ v  # (B, H_kv, g, D)
    # the two partial sums add up in float32 (under autocast each comes out of a 16-bit
    # matmul; adding them in 16 bits would round a third time)
    y = y_prompt.to(scores.dtype) + y_own.to(scores.dtype)
    return y.to(y_own.dtype).reshape(B, H, 1, D)  # reshape: strides vary with G, g = 1


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's when autocast is on for x's device, else x's.

    Under autocast q, k and v arrive in mixed dtypes (rotary tables are float32, values come
    out of a 16-bit matmul, the KV cache holds `kv_dtype`); SDPA's autocast would cast them all,
    and the mask too, once per layer. Casting up front lets the mask be built once, already in
    this dtype, and decides the kernel below on the dtype the kernel will see.
    """
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def attention(q, k, v, mask):
    """Attention of T queries over S keys through SDPA, arranged so that a fused kernel runs.

    `grpo.models.sdpa_choice` asks SDPA's selector which arrangement gets a fused kernel for
    this kind of call: one call with grouped-query heads (`enable_gqa`, K and V read as H_kv
    heads), else K and V repeated to H heads (memory-efficient attention takes a mask and
    float32 but not grouped heads); with neither fused, the grouped call on the math kernel.

    Args:
        q: (B, H, T, D); k, v: (B, H_kv, S, D); all three in the dtype attention runs in.
        mask: (B, 1, T, S) additive in that dtype, or None for plain causal attention (T == S).

    Returns:
        (B, H, T, D).
    """
    H, H_kv = q.shape[1], k.shape[1]
    heads = (H, H_kv, q.shape[-1])
    arrangement = sdpa_choice.choose(
        "queries", q.device, q.dtype, heads, masked=mask is not None, is_causal=mask is None
    )
    if H != H_kv and arrangement == sdpa_choice.REPEAT:
        # kv head j serves query heads j*H/H_kv ... (j+1)*H/H_kv - 1, as enable_gqa does
        k = k.repeat_interleave(H // H_kv, dim=1)  # (B, H, S, D)
        v = v.repeat_interleave(H // H_kv, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != H
    )


def decode_step_attention(q, k, v, mask):
    """One query per row over the cache with an additive mask, in the arrangement
    `grpo.models.sdpa_choice` picks for decode: SDPA with grouped heads, `decode_sdpa` (the
    query heads of a kv head as its queries), or `decode_attention` (two matmuls).

    Args:
        q: (B, H, 1, D); k, v: (B, H_kv, S, D); mask: (B, 1, 1, S) additive, the compute dtype.

    Returns:
        (B, H, 1, D).
    """
    heads = (q.shape[1], k.shape[1], q.shape[-1])
    arrangement = sdpa_choice.choose("decode", q.device, mask.dtype, heads)
    if arrangement == sdpa_choice.MATMUL:
        return decode_attention(q, k, v, mask)
    q, k, v = q.to(mask.dtype), k.to(mask.dtype), v.to(mask.dtype)
    if arrangement == sdpa_choice.FOLD:
        return decode_sdpa(q, k, v, mask)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.H_kv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        C, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(C, self.H * self.D, bias=bias)
        self.k_proj = nn.Linear(C, self.H_kv * self.D, bias=bias)
        self.v_proj = nn.Linear(C, self.H_kv * self.D, bias=bias)
        self.o_proj = nn.Linear(self.H * self.D, C, bias=False)
        if cfg.qk_norm:  # qwen3: RMSNorm over each head's D features, before RoPE
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, kv_cache: KVCache | None):
        B, T, _ = x.shape
        fused = self.__dict__.get("_fused_qkv")  # a sampler's stacked copy (decode_weights)
        q, k, v = (
            fused(x) if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        )
        q = q.view(B, T, self.H, self.D)
        k = k.view(B, T, self.H_kv, self.D)
        v = v.view(B, T, self.H_kv, self.D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|H_kv, T, D)
        q = q * cos + rotate_half(q) * sin  # cos/sin: (B, 1, T, D)
        k = k * cos + rotate_half(k) * sin
        if isinstance(mask, PackedSegments):  # rows packed on one token axis (B = 1)
            dtype = compute_dtype(x)
            y = mask.attend(q.to(dtype), k.to(dtype), v.to(dtype), attention)  # (1, N, H*D)
            return self.o_proj(y)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H_kv, S, D), S = pos + T
        # mask: (B, 1, T, S) additive, 0 = attend, -inf = not; None = causal with T == S.
        if isinstance(kv_cache, GroupedKVCache):  # prompt keys held once per group
            if T != 1:
                raise ValueError(f"a GroupedKVCache takes one token per row, got {T}")
            k_p, v_p = kv_cache.prefix_kv(self.layer_idx)
            y = grouped_decode_attention(q, k_p, v_p, k, v, mask)
        elif T == 1 and mask is not None:  # decode: the arrangement SDPA's selector allows
            y = decode_step_attention(q, k, v, mask)
        else:
            dtype = compute_dtype(x) if mask is None else mask.dtype
            y = attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.H * self.D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, I, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(C, I, bias=bias)
        self.up_proj = nn.Linear(C, I, bias=bias)
        self.down_proj = nn.Linear(I, C, bias=bias)

    def forward(self, x):
        fused = self.__dict__.get("_fused_gate_up")  # a sampler's stacked copy (decode_weights)
        gate, up = fused(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A causal decoder-only transformer for the Llama / Qwen2 / Qwen3 families."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.num_labels:  # a sequence classifier (a reward model): `score`, never tied
            self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
        inv_freq = rope_inv_freq(cfg).to(torch.get_default_device())  # (D/2,) where we build
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.gradient_checkpointing = False
        self._rope: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # `rotary`'s table

    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init (normal(0, std) for matrices, ones for norms, zeros for biases)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rotary(self, position_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos and sin (B, 1, T, D) float32 of `position_ids` (B, T), looked up in a
        table built once (not per forward: a decode step would rebuild them from its positions
        every token) and rebuilt only when it is too short, on another device, or `inv_freq`
        changed (a load). Every position must be below `length` (the forward's key slots S:
        a real token's position never exceeds its slot). The table holds every position up to
        max_position_embeddings when that is at most ROPE_TABLE_MAX (else a power of two >= S),
        built in one call whatever the forward, so a position's value never depends on which
        forward built the table. A compiled forward reads the table its eager prefill built."""
        if not torch.compiler.is_compiling():
            f = self.inv_freq
            key = (f.device, f.data_ptr(), f._version)
            n = max(length, self.config.max_position_embeddings)
            if n > ROPE_TABLE_MAX:  # a long context: the powers of two up to what is needed
                n = max(length, 1 << (length - 1).bit_length())
            if self._rope is None or self._rope[0] != key or self._rope[1].shape[0] < length:
                pos = torch.arange(n, device=f.device, dtype=torch.float32)
                freqs = pos[:, None] * f.float()  # (n, D/2)
                emb = torch.cat((freqs, freqs), dim=-1)  # (n, D)
                self._rope = (key, emb.cos(), emb.sin())
        _, cos, sin = self._rope
        return cos[position_ids][:, None], sin[position_ids][:, None]  # (B, 1, T, D)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_hidden: bool = False,
        packed: PackedSegments | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the decoder.

        Args:
            input_ids: (B, T) token ids.
            position_ids: (B, T) rotary positions; by default counted over the attention mask
                (so left padding does not shift positions).
            attention_mask: (B, S) bool, True = real token, over all key positions: S = T
                without a cache, S >= kv_cache.pos + T with one (S >= kv_cache.max_len for a
                static cache). Default: all True. Or a float (B, 1, T, >= S) additive mask
                (0 = attend, -inf = not) in the dtype attention runs in, used as it is (its
                first S columns; causality is then the caller's: a sampler's decode step,
                whose one query sees every written slot, builds it once per rollout);
                `position_ids` must then be given.
            kv_cache: a `KVCache`; the T new positions are written at kv_cache.pos and the
                cache is advanced by T. A static cache attends over all its slots (fixed
                shapes, for a compiled decode step).
            return_hidden: return the final-norm hidden states instead of logits.
            packed: rows packed on one token axis (`grpo.models.varlen`): input_ids is (1, N),
                positions and attention come from the layout (no attention_mask, no cache).
            select: (B,) one position per row: only those are normed and go through the head,
                (B, out) returned (a classifier's scored tokens, `grpo.models.classifier`;
                inside the forward, so an FSDP-sharded head is gathered for it); packed: (K,)
                positions on the token axis, (K, out) returned.

        Returns:
            logits (B, T, V) (a classifier's: (B, T, num_labels)) or hidden states (B, T, C),
            in the model's dtype.
        """
        B, T = input_ids.shape
        dev = input_ids.device
        if packed is not None:
            extra = kv_cache is not None or attention_mask is not None
            if (B, T) != (1, packed.num_tokens) or extra:
                raise ValueError(
                    f"a packed forward takes (1, {packed.num_tokens}) ids and no "
                    f"attention mask or cache, got {tuple(input_ids.shape)}"
                )
            position_ids = packed.position_ids[None]  # (1, N)
        elif kv_cache is not None and kv_cache.static:
            # Static shapes: queries sit at a tensor position, keys span the whole buffer.
            S = kv_cache.attend_len  # every slot, or the caller's bound on the filled ones
            q_pos = kv_cache.pos_tensor + torch.arange(T, device=dev)  # (T,)
        else:
            start = kv_cache.pos if kv_cache is not None else 0
            S = start + T  # number of key positions attended over
            q_pos = torch.arange(start, S, device=dev)  # (T,)
        # No padding and no cache offset: plain causal attention, no mask at all (SDPA's
        # is_causal, which CUDA's flash kernel takes). Decided from the arguments on the host:
        # a caller passes attention_mask=None when it knows every token is real. Reading the
        # mask to find out (.all()) would cost a device sync per forward, and a mask with
        # padding still runs a fused kernel (memory-efficient attention, `attention`).
        plain_causal = (
            packed is None
            and attention_mask is None
            and (kv_cache is None or (not kv_cache.static and kv_cache.pos == 0))
        )
        additive = attention_mask is not None and attention_mask.dtype.is_floating_point
        if additive:
            if attention_mask.dim() != 4 or position_ids is None or packed is not None:
                raise ValueError(
                    "an additive attention_mask is (B, 1, T, >= S) and needs "
                    "position_ids (and no packed layout)"
                )
        elif packed is None:
            if attention_mask is None:
                attention_mask = torch.ones(B, S, dtype=torch.bool, device=dev)
            attention_mask = attention_mask[:, :S].bool()
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, q_pos]

        # Rotary cos / sin (B, 1, T, D), float32 from the table, in the residual's dtype.
        cos, sin = self.rotary(position_ids, packed.num_tokens if packed is not None else S)
        x = self.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)

        mask = packed  # a packed forward: each layer attends through the layout
        if additive:  # the caller's (B, 1, T, >= S) additive mask, as it is
            mask = attention_mask[..., :S]
        elif not plain_causal and packed is None:
            # Causal + padding mask (B, 1, T, S). Every query keeps its own key so that rows of
            # pure padding never see an all-False row (which would make softmax NaN).
            k_pos = torch.arange(S, device=dev)
            keep = (k_pos[None, :] <= q_pos[:, None])[None] & attention_mask[:, None, :]
            keep = (keep | (k_pos[None, :] == q_pos[:, None])[None])[:, None]  # (B, 1, T, S)
            # Additive, built once in the dtype attention runs in: SDPA would otherwise convert
            # a bool mask, or cast a float one, per layer. Rows padded to a multiple of 8
            # elements (a view of the first S): memory-efficient attention copies a mask
            # whose strides are not (`preprocess_mask`), per layer and kept for backward.
            S_8 = -(-S // 8) * 8
            mask = torch.zeros(B, 1, T, S_8, dtype=compute_dtype(x), device=dev)[..., :S]
            mask.masked_fill_(~keep, float("-inf"))

        for block in self.layers:
            # Checkpointing recomputes a block in backward, so its cache must not write in place
            # (a `KVCache` would write the same slots again, and later steps overwrite what the
            # block read). The shared-prefix caches (grpo.algo.logprobs) write nothing: the
            # recompute reads the same prefix keys/values, held by reference till backward.
            caching = isinstance(kv_cache, (KVCache, GroupedKVCache))
            if self.gradient_checkpointing and self.training and not caching:
                x = checkpoint(block, x, cos, sin, mask, kv_cache, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        if select is not None:  # packed: (K,) positions on the token axis
            x = x[0, select] if packed is not None else x[torch.arange(B, device=dev), select]
        x = self.norm(x)
        return x if return_hidden else self.head(x)

    @property
    def head(self) -> nn.Linear:
        """The output head: `lm_head` (V logits), or a classifier's `score` (num_labels)."""
        return self.score if self.config.num_labels else self.lm_head


# in-place fills an initializer runs: on a meta tensor there is nothing to fill
_FILLS = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_)


class _SkipInit(TorchFunctionMode):
    """Initializers (`torch.nn.init.*`, the in-place fills) of meta tensors do nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by keyword
        if (
            isinstance(x, torch.Tensor)
            and x.is_meta
            and (func in _FILLS or getattr(func, "__module__", None) == "torch.nn.init")
        ):
            return x
        return func(*args, **kwargs)


def meta_decoder(cfg: ModelConfig) -> Decoder:
    """`cfg`'s module tree on the meta device (shapes, no memory), its initializers skipped.

    A fill of a meta tensor runs a Python reference kernel, and the first one imports
    `torch._dynamo` (over a second of every command's cold start when nothing compiles); a
    module built here is filled by its loader (`inv_freq` included).
    """
    with torch.device("meta"), _SkipInit():
        return Decoder(cfg)
