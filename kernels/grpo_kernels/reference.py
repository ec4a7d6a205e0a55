"""Torch twins of the fused log-prob kernels: the executable spec (naive) and a bounded-memory path.

Both compute, for every token n, the log-probability of its target id under a linear head:

    z = (hidden @ weight.T) / temperature        (N, V), logits in the input dtype, then fp32
    logprobs[n] = z[n, ids[n]] - logsumexp(z[n])
    entropy[n]  = logsumexp(z[n]) - sum_v softmax(z[n])_v * z[n, v]

The entropy is detached (metrics) unless `entropy_grad=True`, which makes it differentiable too,
for an entropy bonus: d entropy[n] / d z[n, v] = -p_v * (z[n, v] - logsumexp(z[n]) + entropy[n]).

`naive_logprobs` materializes the (N, V) logits; `chunked_logprobs` never holds more than one
(block_n, block_v) tile of them and has a hand-written backward (see `_ChunkedLogprobs`).
"""

import contextlib

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for softmax math: float32, or float64 when the inputs are float64 (gold references)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def _matmul_precision(value: str):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def tf32_matmuls(device: torch.device | str, enabled: bool = True):
    """A region where float32 torch matmuls on a CUDA `device` multiply in TF32 (tensor cores,
    10-bit mantissa operands, float32 accumulation): `torch.set_float32_matmul_precision("high")`,
    the previous setting restored on exit. Everywhere else a no-op: a CPU device (TF32 is a CUDA
    format, so float32 stays exact there), `enabled=False`, and inside a `torch.compile`d
    function (dynamo cannot trace the switch; a compiled region multiplies as torch is set
    globally)."""
    if not enabled or torch.device(device).type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _matmul_precision("high")


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 `x` rounded to the nearest TF32 value (10 mantissa bits, ties away from zero),
    as a float32 tensor: what the Triton kernels feed their TF32 dots (`_round_tf32`), so a
    float32 matmul of rounded operands is what a TF32 dot computes, up to summation order.
    Infinities and NaNs pass unchanged."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_tf32 takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    rounded = (bits + 0x1000) & -0x2000  # -0x2000 = 0xFFFFE000: clear the 13 low bits
    special = (bits & 0x7F800000) == 0x7F800000
    return torch.where(special, bits, rounded).view(torch.float32)


# device type -> whether torch.mm(bf16, bf16, out_dtype=float32) exists there (CUDA, torch >=
# 2.8); a plain dict, not functools.cache, so that a compiled caller reads it without tracing
_MM_OUT_DTYPE: dict[str, bool] = {}


def _mm_out_dtype_ok(device_type: str) -> bool:
    if device_type not in _MM_OUT_DTYPE:
        if torch.compiler.is_compiling():  # no probe inside a trace (an eager call made it)
            return device_type == "cuda"
        try:
            a = torch.ones(16, 16, dtype=torch.bfloat16, device=device_type)
            ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            ok = False
        _MM_OUT_DTYPE[device_type] = ok
    return _MM_OUT_DTYPE[device_type]


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N), float32 or 16-bit operands of one dtype, returned in float32.
    16-bit operands: products accumulate in float32, and the result is not rounded to 16 bits
    where torch can avoid it (`torch.mm(..., out_dtype=torch.float32)`: CUDA); elsewhere (CPU)
    it is rounded to the operands' dtype and upcast, as `naive_logprobs` and the chunked tiles
    round their 16-bit logits."""
    if a.dtype == torch.float32:
        return a @ b
    if _mm_out_dtype_ok(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def check_operands(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    *,
    require_contiguous: bool = False,
) -> None:
    """Raise one clear error if the operands of a log-prob kernel are malformed.

    Args:
        hidden: (N, C) floating tensor.
        weight: (V, C) tensor of the same dtype and device as `hidden`.
        ids: (N,) int32/int64 target ids on the same device.
        temperature: positive float.
        require_contiguous: also demand contiguous `hidden`, `weight`, `ids` (Triton launchers).

    Raises:
        ValueError: bad shape, device, temperature or contiguity.
        TypeError: bad dtype.
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (N, C), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, C), got shape {tuple(weight.shape)}")
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (N,), got shape {tuple(ids.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden (N, C)={tuple(hidden.shape)} and weight (V, C)={tuple(weight.shape)} "
            "disagree on C"
        )
    if ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"ids has {ids.shape[0]} entries but hidden has N={hidden.shape[0]} rows")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be a floating tensor, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids must be int32 or int64, got {ids.dtype}")
    if not (hidden.device == weight.device == ids.device):
        raise ValueError(
            f"hidden, weight and ids must share a device, got {hidden.device}, "
            f"{weight.device}, {ids.device}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if require_contiguous:
        for name, t in (("hidden", hidden), ("weight", weight), ("ids", ids)):
            if not t.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous (call .contiguous()), got {t.stride()}"
                )


def naive_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `ids` the obvious way: full logits, fp32 log-softmax, gather (the spec).

    Memory: the (N, V) logits in the input dtype, their fp32 copy and the fp32 log-softmax are
    all alive at once; autograd keeps the log-softmax for backward.

    Args:
        hidden: (N, C) final hidden states.
        weight: (V, C) lm_head weight.
        ids: (N,) target token ids.
        temperature: logits are divided by it before the softmax.
        return_entropy: also return the per-token entropy (detached).
        entropy_grad: return the entropy (implies `return_entropy`) differentiable in hidden and
            weight, through the same autograd graph as the log-probs.

    Returns:
        logprobs (N,) float32 (float64 for float64 inputs), differentiable in hidden and weight;
        with `return_entropy` or `entropy_grad`, a tuple (logprobs, entropy).
    """
    logits = hidden @ weight.t()  # (N, V) input dtype, like nn.Linear
    z = logits.to(_acc_dtype(hidden.dtype)) / temperature  # (N, V) fp32
    logz = torch.log_softmax(z, dim=-1)  # (N, V)
    logprobs = logz.gather(1, ids.long().unsqueeze(1)).squeeze(1)  # (N,)
    if entropy_grad:
        return logprobs, -(logz.exp() * logz).sum(-1)  # (N,) differentiable
    if not return_entropy:
        return logprobs
    with torch.no_grad():
        entropy = -(logz.exp() * logz).sum(-1)  # (N,)
    return logprobs, entropy


def default_blocks(n: int, v: int, tile_elems: int = 2**23) -> tuple[int, int]:
    """Token and vocab block sizes of the chunked path: one fp32 tile of at most `tile_elems`.

    2**23 elements is a 32 MiB fp32 tile: big enough for full-speed CPU/GPU matmuls, small next
    to the (N, V) logits (2.3 GiB at N=4096, V=151936).
    """
    block_n = max(1, min(n, 4096))
    block_v = max(256, tile_elems // block_n)
    return block_n, min(block_v, max(v, 1))


def _tile_logits(buf: torch.Tensor, h: torch.Tensor, w: torch.Tensor, temperature: float):
    """(h @ w.T) / T written into the front of the flat buffer `buf`; returns the (n, v) view.

    Reusing one buffer matters on CPU: a fresh 32 MiB tile per step is mmapped and page-faulted
    anew by the allocator, which costs as much as the naive path's big allocations.
    """
    out = buf[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])  # (n, v)
    if h.dtype == buf.dtype:
        torch.mm(h, w.t(), out=out)
    else:
        out.copy_(h @ w.t())  # 16-bit logits, rounded like naive's, then upcast
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _add_onehot(d_h, d_w, g, ids, hidden, weight):
    """Add the one-hot part of d logits, +g/T at (n, ids[n]), to the fp32 accumulators and cast
    them to the input dtypes (either may be None when not needed)."""
    ids = ids.long()
    if d_h is not None:
        d_h.add_(g.unsqueeze(1) * weight[ids].to(d_h.dtype))
        d_h = d_h.to(hidden.dtype)
    if d_w is not None:
        d_w.index_add_(0, ids, g.unsqueeze(1) * hidden.to(d_w.dtype))
        d_w = d_w.to(weight.dtype)
    return d_h, d_w


class _ChunkedLogprobs(torch.autograd.Function):
    """Tiled log-probs with an online logsumexp and a backward that never stores the logits.

    Forward walks (block_n tokens) x (block_v vocab) tiles and keeps per token only the running max
    m, the running sum s of exp(z - m) and the target logit. The backward has three modes:

    - weight frozen (LoRA elsewhere, or a frozen lm_head): d_hidden = g/T * (W[id] - sum_v p_v W_v)
      and the softmax-weighted average of W rows is accumulated online in the forward (rescaled by
      exp(m_old - m_new) like flash attention), so backward is O(N*C): 4NCV flops in all, the same
      as naive's, with no recompute.
    - weight trainable: the forward stores only lse (N,); the backward recomputes each logit tile,
      p = exp(z - lse), and accumulates d_hidden += G @ W_tile and d_weight += G^T @ h with
      G = -g/T * p; the one-hot part of G is added once at the end by an index_add. 8NCV flops.
    - entropy_grad: the recompute mode, whatever is frozen (the folded average covers only the
      log-prob term); the forward also saves the entropy H (N,), and each recomputed tile gets
      G = -p * (g/T + g_H/T * (z - lse + H)) with g_H the entropy's upstream gradient. One more
      (block_n, block_v) tile buffer; a backward whose entropy got no gradient runs the plain
      recompute loop.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, ids, temperature, block_n, block_v, return_entropy, entropy_grad
    ):
        n_tok, c = hidden.shape
        v_total = weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # frozen weight: no recompute in backward (log-prob gradient only)
        fold_dh = need_dh and not need_dw and not entropy_grad
        return_entropy = return_entropy or entropy_grad

        logprobs = torch.empty(n_tok, dtype=acc, device=hidden.device)  # (N,)
        lse = torch.empty(n_tok, dtype=acc, device=hidden.device)  # (N,)
        entropy = torch.empty(n_tok if return_entropy else 0, dtype=acc, device=hidden.device)
        w_diff = torch.empty(n_tok, c, dtype=acc, device=hidden.device) if fold_dh else None
        z_buf = torch.empty(
            min(block_n, n_tok) * min(block_v, v_total), dtype=acc, device=hidden.device
        )
        p_buf = torch.empty_like(z_buf)
        for n0 in range(0, n_tok, block_n):
            n1 = min(n0 + block_n, n_tok)
            h = hidden[n0:n1]  # (n, C)
            tid = ids[n0:n1].long()  # (n,)
            m = torch.full((n1 - n0,), float("-inf"), dtype=acc, device=hidden.device)
            s = torch.zeros_like(m)  # running sum of exp(z - m)
            zp = torch.zeros_like(m)  # running sum of exp(z - m) * (z - m) (entropy)
            target = torch.zeros_like(m)
            a = torch.zeros(n1 - n0, c, dtype=acc, device=hidden.device) if fold_dh else None
            for v0 in range(0, v_total, block_v):
                v1 = min(v0 + block_v, v_total)
                w = weight[v0:v1]  # (v, C)
                z = _tile_logits(z_buf, h, w, temperature)  # (n, v) fp32
                in_tile = (tid >= v0) & (tid < v1)
                col = (tid - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)  # (n, 1)
                target = torch.where(in_tile, z.gather(1, col).squeeze(1), target)
                m_new = torch.maximum(m, z.amax(dim=1))  # (n,)
                alpha = torch.exp(m - m_new)  # (n,) rescales the running sums; 0 on the 1st tile
                z.sub_(m_new.unsqueeze(1))  # (n, v) shifted logits, <= 0
                p = torch.exp(z, out=p_buf[: z.numel()].view_as(z))  # (n, v) unnormalized probs
                if return_entropy:
                    # sum p * (z - m) re-based on m_new; all terms <= 0, so nothing cancels
                    carry = torch.where(s > 0, (m - m_new) * s, 0.0)
                    zp = (zp + carry) * alpha + (p.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
                s = s * alpha + p.sum(dim=1)
                if fold_dh:
                    a.mul_(alpha.unsqueeze(1)).addmm_(p, w.to(acc))  # (n, C)
                m = m_new
            lse_c = m + torch.log(s)  # (n,)
            lse[n0:n1] = lse_c
            logprobs[n0:n1] = target - lse_c
            if return_entropy:
                entropy[n0:n1] = torch.log(s) - zp / s  # lse - E_p[z], without cancellation
            if fold_dh:
                # W[id] - E_p[W]: all that d_hidden needs, so hidden and weight are not saved
                a.div_(s.unsqueeze(1)).neg_().add_(weight[tid].to(acc))
                w_diff[n0:n1] = a

        ctx.temperature = temperature
        ctx.blocks = (block_n, block_v)
        ctx.fold_dh = fold_dh
        ctx.entropy_grad = entropy_grad
        ctx.hidden_dtype = hidden.dtype
        if fold_dh:
            ctx.save_for_backward(w_diff)
        elif entropy_grad and (need_dh or need_dw):
            ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        elif need_dh or need_dw:
            ctx.save_for_backward(hidden, weight, ids, lse)
        if entropy_grad:
            ctx.set_materialize_grads(False)  # an unused entropy gets no (N,) zeros to multiply
        else:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t = ctx.temperature
        if ctx.fold_dh:
            (w_diff,) = ctx.saved_tensors  # (N, C) W[id] - E_p[W]
            g = grad_logprobs.to(w_diff.dtype) / t  # (N,)
            d_h = (g.unsqueeze(1) * w_diff).to(ctx.hidden_dtype)  # (N, C)
            return d_h, None, None, None, None, None, None, None
        if grad_entropy is not None and ctx.entropy_grad:
            return _ChunkedLogprobs._backward_with_entropy(ctx, grad_logprobs, grad_entropy)

        # log-prob gradient only (with entropy_grad, an entropy that got no upstream gradient)
        hidden, weight, ids, lse = ctx.saved_tensors[:4]
        acc = lse.dtype
        block_n, block_v = ctx.blocks
        n_tok, v_total = hidden.shape[0], weight.shape[0]
        g = grad_logprobs.to(acc) / t  # (N,) d logprobs / d z[id]
        d_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_dh else None
        d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        z_buf = torch.empty(
            min(block_n, n_tok) * min(block_v, v_total), dtype=acc, device=hidden.device
        )
        for n0 in range(0, n_tok, block_n):
            n1 = min(n0 + block_n, n_tok)
            h = hidden[n0:n1]  # (n, C)
            h_acc = h.to(acc)
            neg_g = -g[n0:n1].unsqueeze(1)  # (n, 1)
            lse_c = lse[n0:n1].unsqueeze(1)  # (n, 1)
            for v0 in range(0, v_total, block_v):
                v1 = min(v0 + block_v, v_total)
                w = weight[v0:v1]  # (v, C)
                grad_z = _tile_logits(z_buf, h, w, t)  # (n, v) recomputed logits
                grad_z.sub_(lse_c).exp_().mul_(neg_g)  # (n, v) -g/T * softmax
                if need_dh:
                    d_h[n0:n1].addmm_(grad_z, w.to(acc))
                if need_dw:
                    d_w[v0:v1].addmm_(grad_z.t(), h_acc)
        d_h, d_w = _add_onehot(d_h, d_w, g, ids, hidden, weight)
        return d_h, d_w, None, None, None, None, None, None

    @staticmethod
    def _backward_with_entropy(ctx, grad_logprobs, grad_entropy):
        """The recompute backward with the entropy term; grad_logprobs may be None (unused)."""
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        t = ctx.temperature
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        acc = lse.dtype
        block_n, block_v = ctx.blocks
        n_tok, v_total = hidden.shape[0], weight.shape[0]
        if grad_logprobs is None:
            g = torch.zeros(n_tok, dtype=acc, device=hidden.device)
        else:
            g = grad_logprobs.to(acc) / t  # (N,) d logprobs / d z[id]
        g_ent = grad_entropy.to(acc) / t  # (N,) d entropy / d z, before the softmax factor
        d_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_dh else None
        d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_dw else None
        z_buf = torch.empty(
            min(block_n, n_tok) * min(block_v, v_total), dtype=acc, device=hidden.device
        )
        p_buf = torch.empty_like(z_buf)
        for n0 in range(0, n_tok, block_n):
            n1 = min(n0 + block_n, n_tok)
            h = hidden[n0:n1]  # (n, C)
            h_acc = h.to(acc)
            g_c = g[n0:n1].unsqueeze(1)  # (n, 1)
            lse_c = lse[n0:n1].unsqueeze(1)  # (n, 1)
            g_ent_c = g_ent[n0:n1].unsqueeze(1)  # (n, 1)
            ent_c = entropy[n0:n1].unsqueeze(1)  # (n, 1)
            for v0 in range(0, v_total, block_v):
                v1 = min(v0 + block_v, v_total)
                w = weight[v0:v1]  # (v, C)
                grad_z = _tile_logits(z_buf, h, w, t).sub_(lse_c)  # (n, v) log p
                p = torch.exp(grad_z, out=p_buf[: grad_z.numel()].view_as(grad_z))  # (n, v)
                # -p * (g/T + g_H/T * (log p + H)), log p = z - lse
                grad_z.add_(ent_c).mul_(g_ent_c).add_(g_c).mul_(p).neg_()
                if need_dh:
                    d_h[n0:n1].addmm_(grad_z, w.to(acc))
                if need_dw:
                    d_w[v0:v1].addmm_(grad_z.t(), h_acc)
        d_h, d_w = _add_onehot(d_h, d_w, g, ids, hidden, weight)
        return d_h, d_w, None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    block_n: int | None = None,
    block_v: int | None = None,
    *,
    entropy_grad: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `ids` tile by tile with an online logsumexp; never holds the (N, V) logits.

    Memory beyond inputs and outputs: a few (block_n, block_v) fp32 tiles (32 MiB each by default),
    plus (N, C) fp32 when the weight is frozen (not with `entropy_grad`, which saves hidden and
    weight and recomputes the tiles in backward), plus the fp32 (V, C) d_weight accumulator when
    it is trainable (reused as the output for fp32 weights). See `_ChunkedLogprobs` for the math.

    Args:
        hidden: (N, C) final hidden states.
        weight: (V, C) lm_head weight.
        ids: (N,) target token ids.
        temperature: logits are divided by it before the softmax.
        return_entropy: also return the per-token entropy (no grad).
        block_n: tokens per tile (default from `default_blocks`).
        block_v: vocab entries per tile (default from `default_blocks`).
        entropy_grad: return the entropy (implies `return_entropy`) differentiable in hidden and
            weight, for an entropy bonus in the loss.

    Returns:
        logprobs (N,) float32 (float64 for float64 inputs); with `return_entropy` or
        `entropy_grad`, a tuple (logprobs, entropy).
    """
    d_n, d_v = default_blocks(hidden.shape[0], weight.shape[0])
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden,
        weight,
        ids,
        float(temperature),
        block_n or d_n,
        block_v or d_v,
        return_entropy,
        entropy_grad,
    )
    return (logprobs, entropy) if return_entropy or entropy_grad else logprobs
