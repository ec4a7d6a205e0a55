"""Fused linear + log-softmax + gather in Triton (forward and backward); never the (N, V) logits.

Forward, `_fwd_kernel`: each program owns BLOCK_N tokens and one contiguous split of the vocab. It
walks the split in BLOCK_V tiles; for each tile it computes z = (h @ W_tile^T) / T with `tl.dot`
on the tensor cores (fp32 accumulation over C in BLOCK_C steps) and folds the tile into an online
logsumexp kept in fp32: running max m, running sum s = sum exp(z - m), the target logit (picked out
of the tile where the column equals the token's id) and, for the entropy, sum exp(z - m) * (z - m).
The per-split partials (S, N) are merged in torch; only lse (N,) fp32 is saved for backward (and
the entropy H (N,) fp32 with `entropy_grad`).

Backward, `_grad_logits_kernel`: for one vocab chunk at a time, recompute the logit tiles and write
G = g/T * (onehot(id) - softmax(z)) in the input dtype into a bounded (N, v_chunk) buffer; with an
entropy gradient g_H (`entropy_grad`), G = g/T * onehot - p * (g/T + g_H/T * (z - lse + H)), since
d H / d z_v = -p_v * (z_v - lse + H). Then
two cuBLAS GEMMs finish the chunk: d_weight[chunk] = G^T @ hidden (one GEMM over all N, fp32
accumulation inside, one rounding, written straight into the output) and
d_hidden += G @ W[chunk] (fp32 result accumulated in an fp32 (N, C) buffer). Why not fuse the two
reductions into the kernel: their accumulators are (BLOCK_N, C) and (BLOCK_V, C), far too large for
registers at C=1024..4096, so a fused kernel must either re-do the logit tile for every C block or
push every tile through fp32 atomics (2 * (BLOCK_N + BLOCK_V) * C atomics per 6 * BLOCK_N * BLOCK_V
* C flops); writing G once in bf16 (N * V * 2 bytes, about 1 ms of HBM traffic at N=16384) and
reading it from two tensor-core GEMMs is cheaper and simpler to get right.

Tile order: program ids walk the token blocks fastest, so the programs resident at one moment work
on the same weight tiles: each (BLOCK_V, BLOCK_C) weight tile is read from HBM once and served to
the other token blocks from L2, and the (N, C) hidden block stays L2-resident (32 MiB at N=16384).

Memory against the naive path (bf16, N=16384, V=151936): naive holds (N, V) logits in bf16 plus
two fp32 copies (about 25 GB); here the forward stores 2 * S * N floats of partials and the
backward one (N, v_chunk) grad buffer (512 MiB by default) plus an fp32 (N, C) accumulator.

Input precision: 16-bit inputs multiply on the tensor cores; float32 inputs in IEEE float32 on the
CUDA cores (exact, an order of magnitude slower), or in TF32 on the tensor cores with the
`tf32=True` config key (the dots and the backward's two GEMMs). The accumulation is float32 in
every case. For TF32 the kernels round their float32 operands to the nearest TF32 value first
(`_round_tf32`): the tensor cores truncate what they are given, cuBLAS rounds, and the sampler's
head (cuBLAS) and the trainer's (these kernels) must agree.
"""

import contextlib

import torch
import triton
import triton.language as tl

from grpo_kernels.reference import check_operands, matmul_fp32, tf32_matmuls

_TL_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}
_CONFIG_KEYS = (
    "block_n",
    "block_v",
    "block_c",
    "num_warps",
    "num_stages",
    "num_splits",
    "grad_buffer_mib",
    "tf32",
)


@triton.jit
def _round_tf32(x):
    """float32 -> the nearest TF32 value (10 mantissa bits; ties away from zero), still a
    float32. A TF32 `tl.dot` on the tensor cores reads only the operands' top 19 bits, i.e. it
    truncates, where cuBLAS's TF32 GEMMs round (an emulation at N=300, C=512, V=32003: 8.4x
    the float64 error of rounded operands). Rounding first makes the truncation exact, so the
    kernel's TF32 equals the sampler's cuBLAS TF32 head up to summation order. Infinities and
    NaNs pass unchanged; the torch twin is `grpo_kernels.reference.round_to_tf32`."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x1000) & 0xFFFFE000
    special = (bits & 0x7F800000) == 0x7F800000
    return tl.where(special, bits, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _fwd_kernel(
    hidden_ptr,  # (N, C)
    weight_ptr,  # (V, C)
    ids_ptr,  # (N,)
    m_ptr,  # (S, N) fp32 out: running max per vocab split
    s_ptr,  # (S, N) fp32 out: sum exp(z - m)
    target_ptr,  # (S, N) fp32 out: z[id] where id falls in the split, else 0
    zp_ptr,  # (S, N) fp32 out: sum exp(z - m) * (z - m) (entropy), only when WITH_ENTROPY
    N,
    V,
    C,
    v_per_split,
    temperature,
    stride_hn,
    stride_wv,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n = pid % num_n_blocks  # token blocks fastest: concurrent programs share weight tiles
    split = pid // num_n_blocks
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1).to(tl.int64)  # (BN,)
    v_begin = split * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, V)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    target = tl.zeros((BLOCK_N,), tl.float32)
    zp = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)  # (BV,)
        col_mask = cols < v_end
        cols64 = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + tl.arange(0, BLOCK_C)  # (BC,)
            c_mask = cc < C
            h = tl.load(
                hidden_ptr + rows64[:, None] * stride_hn + cc[None, :],
                mask=row_mask[:, None] & c_mask[None, :],
                other=0.0,
            )  # (BN, BC)
            w = tl.load(
                weight_ptr + cols64[None, :] * stride_wv + cc[:, None],
                mask=col_mask[None, :] & c_mask[:, None],
                other=0.0,
            )  # (BC, BV) = W_tile^T
            if ROUND_TF32:
                h, w = _round_tf32(h), _round_tf32(w)
            acc = tl.dot(h, w, acc, input_precision=PRECISION)
        z = tl.where(col_mask[None, :], acc / temperature, float("-inf"))  # (BN, BV) fp32
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)  # rescale of the running sums, 0 on the first tile
        zs = z - m_new[:, None]  # (BN, BV) shifted logits, <= 0 (-inf on masked columns)
        p = tl.exp(zs)  # 0 on masked columns
        if WITH_ENTROPY:
            # sum p * (z - m) re-based on m_new; all terms <= 0, so nothing cancels
            carry = tl.where(s > 0, (m - m_new) * s, 0.0)
            zp = (zp + carry) * alpha + tl.sum(p * tl.where(col_mask[None, :], zs, 0.0), axis=1)
        s = s * alpha + tl.sum(p, axis=1)
        hit = (cols64[None, :] == ids[:, None]) & col_mask[None, :]
        target += tl.sum(tl.where(hit, z, 0.0), axis=1)
        m = m_new

    out = split.to(tl.int64) * N + rows64
    tl.store(m_ptr + out, m, mask=row_mask)
    tl.store(s_ptr + out, s, mask=row_mask)
    tl.store(target_ptr + out, target, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(zp_ptr + out, zp, mask=row_mask)


@triton.jit
def _grad_logits_kernel(
    hidden_ptr,  # (N, C)
    weight_ptr,  # (V, C)
    ids_ptr,  # (N,)
    lse_ptr,  # (N,) fp32
    gscale_ptr,  # (N,) fp32: upstream grad / T
    gent_ptr,  # (N,) fp32: entropy's upstream grad / T, only when WITH_ENTROPY_GRAD
    entropy_ptr,  # (N,) fp32: entropy H from the forward, only when WITH_ENTROPY_GRAD
    grad_ptr,  # (N, v_len) out, row stride stride_gn: G for vocab columns [v_begin, v_begin+v_len)
    N,
    v_begin,
    v_len,
    C,
    temperature,
    stride_hn,
    stride_wv,
    stride_gn,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_C: tl.constexpr,
    WITH_ENTROPY_GRAD: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_TF32: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n = pid % num_n_blocks  # token blocks fastest: concurrent programs share weight tiles
    pid_v = pid // num_n_blocks
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    row_mask = rows < N
    rows64 = rows.to(tl.int64)
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # (BV,) column inside the chunk
    col_mask = local < v_len
    cols64 = v_begin + local.to(tl.int64)  # (BV,) vocab id

    acc = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        c_mask = cc < C
        h = tl.load(
            hidden_ptr + rows64[:, None] * stride_hn + cc[None, :],
            mask=row_mask[:, None] & c_mask[None, :],
            other=0.0,
        )  # (BN, BC)
        w = tl.load(
            weight_ptr + cols64[None, :] * stride_wv + cc[:, None],
            mask=col_mask[None, :] & c_mask[:, None],
            other=0.0,
        )  # (BC, BV)
        if ROUND_TF32:
            h, w = _round_tf32(h), _round_tf32(w)
        acc = tl.dot(h, w, acc, input_precision=PRECISION)
    ids = tl.load(ids_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    gscale = tl.load(gscale_ptr + rows, mask=row_mask, other=0.0)
    log_p = acc / temperature - lse[:, None]  # (BN, BV) log softmax, fp32
    p = tl.exp(log_p)
    onehot = (cols64[None, :] == ids[:, None]).to(tl.float32)
    if WITH_ENTROPY_GRAD:
        gent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
        # d (g . logprobs + g_H . entropy) / d logits, with d H / d z = -p * (log p + H)
        grad = gscale[:, None] * onehot - p * (
            gscale[:, None] + gent[:, None] * (log_p + entropy[:, None])
        )
    else:
        grad = gscale[:, None] * (onehot - p)  # d logprobs / d logits
    tl.store(
        grad_ptr + rows64[:, None] * stride_gn + local[None, :],
        grad.to(grad_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def default_config(dtype: torch.dtype) -> dict:
    """Fixed (autotune-free) tiles: 128x128x64 for 16-bit inputs (tensor cores), smaller fp32."""
    if dtype == torch.float32:
        return dict(block_n=64, block_v=64, block_c=32, num_warps=4, num_stages=2)
    return dict(block_n=128, block_v=128, block_c=64, num_warps=8, num_stages=3)


def _input_precision(dtype: torch.dtype, tf32: bool) -> str:
    """`tl.dot`'s input precision: IEEE float32 (CUDA cores) unless `tf32` asks for TF32 tensor
    cores; 16-bit inputs multiply natively on the tensor cores (the value is ignored). The
    accumulator is float32 in every case."""
    return "tf32" if tf32 else _TL_PRECISION[dtype]


def _rounds_tf32(dtype: torch.dtype, tf32: bool) -> bool:
    """Whether the kernels round float32 operands to TF32 before `tl.dot` (`_round_tf32`): with
    `tf32` on float32 inputs, so that the tensor cores' truncation changes nothing."""
    return tf32 and dtype == torch.float32


def _num_splits(n_tok: int, v_total: int, block_n: int, block_v: int, device: torch.device) -> int:
    """Vocab splits so that about 4 programs per SM are in flight even at small N."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    n_blocks = triton.cdiv(n_tok, block_n)
    return max(1, min(triton.cdiv(4 * sms, n_blocks), triton.cdiv(v_total, block_v)))


def _on_device(t: torch.Tensor):
    """Triton launches on the *current* CUDA device and its stream, not the tensors': make the
    tensors' device current for the launch (on a rank whose current device is another, the
    kernel would otherwise run on that device with pointers it cannot use). No-op off CUDA
    (TRITON_INTERPRET=1 on CPU)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _assert_launch(hidden, weight, ids):
    """The launchers' own asserts: shape, dtype and contiguity (metadata only, no host sync).
    Devices, temperature and the id range are checked once, at the entry point
    (`grpo_kernels.fused_logprobs` / `triton_logprobs`, via `check_operands`)."""
    if hidden.dim() != 2 or weight.dim() != 2 or ids.dim() != 1:
        raise ValueError(
            f"hidden (N, C), weight (V, C), ids (N,) expected, got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(ids.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"ids {tuple(ids.shape)}"
        )
    if hidden.dtype not in _TL_PRECISION:
        raise TypeError(f"triton log-probs support float16/bfloat16/float32, got {hidden.dtype}")
    if weight.dtype != hidden.dtype or ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"weight dtype {weight.dtype} must equal hidden dtype {hidden.dtype}, ids int32/int64 "
            f"(got {ids.dtype})"
        )
    for name, t in (("hidden", hidden), ("weight", weight), ("ids", ids)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), got {t.stride()}")


def logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    num_splits: int | None = None,
    **config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel and merge the per-split partials.

    Args:
        hidden: (N, C) contiguous, float16/bfloat16/float32.
        weight: (V, C) contiguous, same dtype.
        ids: (N,) int32/int64 target ids in [0, V).
        temperature: logits are divided by it.
        return_entropy: also compute the per-token entropy.
        num_splits: vocab splits S (default: enough programs for about 4 per SM).
        **config: overrides of `default_config` (block_n, block_v, block_c, num_warps,
            num_stages), and `tf32=True`: float32 inputs multiply in TF32 (`_input_precision`).

    Returns:
        (logprobs (N,) fp32, lse (N,) fp32, entropy (N,) fp32 or an empty tensor).
    """
    _assert_launch(hidden, weight, ids)
    cfg = {**default_config(hidden.dtype), **config}
    n_tok, c = hidden.shape
    v_total = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    if n_tok == 0:
        empty = torch.empty(0, **f32)
        return empty, empty, empty
    splits = num_splits or _num_splits(
        n_tok, v_total, cfg["block_n"], cfg["block_v"], hidden.device
    )
    v_per_split = triton.cdiv(triton.cdiv(v_total, splits), cfg["block_v"]) * cfg["block_v"]
    splits = triton.cdiv(v_total, v_per_split)  # no empty split
    m, s, target = (torch.empty(splits, n_tok, **f32) for _ in range(3))  # (S, N) each
    zp = torch.empty(splits, n_tok, **f32) if return_entropy else m
    grid = (triton.cdiv(n_tok, cfg["block_n"]) * splits,)
    with _on_device(hidden):
        _fwd_kernel[grid](
            hidden,
            weight,
            ids,
            m,
            s,
            target,
            zp,
            n_tok,
            v_total,
            c,
            v_per_split,
            float(temperature),
            hidden.stride(0),
            weight.stride(0),
            BLOCK_N=cfg["block_n"],
            BLOCK_V=cfg["block_v"],
            BLOCK_C=cfg["block_c"],
            WITH_ENTROPY=return_entropy,
            PRECISION=_input_precision(hidden.dtype, cfg.get("tf32", False)),
            ROUND_TF32=_rounds_tf32(hidden.dtype, cfg.get("tf32", False)),
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
    lse = torch.logsumexp(m + torch.log(s), dim=0)  # (N,) merge of the splits
    logprobs = target.sum(dim=0) - lse
    entropy = torch.empty(0, **f32)
    if return_entropy:
        # H = sum_v p_v (lse - z_v) = sum_k exp(m_k - lse) * (s_k (lse - m_k) - zp_k), terms >= 0
        entropy = (torch.exp(m - lse) * (s * (lse - m) - zp)).sum(dim=0)
    return logprobs, lse, entropy


def logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logprobs: torch.Tensor,
    temperature: float = 1.0,
    need_hidden_grad: bool = True,
    need_weight_grad: bool = True,
    *,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    grad_buffer_mib: float = 512,
    **config,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Recompute logit tiles chunk by chunk of vocab, and reduce G with two GEMMs per chunk.

    Args:
        hidden, weight, ids: as in `logprobs_forward`.
        lse: (N,) fp32 from the forward.
        grad_logprobs: (N,) upstream gradient.
        temperature: the forward's temperature.
        need_hidden_grad / need_weight_grad: which gradients to compute.
        grad_entropy: (N,) upstream gradient of the entropy, or None (no entropy term).
        entropy: (N,) fp32 entropy from the forward; required with `grad_entropy`.
        grad_buffer_mib: size cap of the (N, v_chunk) G buffer in the input dtype.
        **config: tile overrides as in `logprobs_forward`; with `tf32=True` the kernel and the
            two GEMMs (`tf32_matmuls`) multiply float32 inputs in TF32.

    Returns:
        (d_hidden (N, C) or None, d_weight (V, C) or None), in the input dtype.
    """
    _assert_launch(hidden, weight, ids)
    cfg = {**default_config(hidden.dtype), **config}
    n_tok, c = hidden.shape
    v_total = weight.shape[0]
    if n_tok == 0:
        d_h = torch.zeros_like(hidden) if need_hidden_grad else None
        return d_h, (torch.zeros_like(weight) if need_weight_grad else None)
    bv = cfg["block_v"]
    budget = int(grad_buffer_mib * 2**20) // hidden.element_size()
    v_chunk = max(bv, budget // n_tok // bv * bv)
    v_chunk = min(v_chunk, triton.cdiv(v_total, bv) * bv)
    gscale = (grad_logprobs.float() / temperature).contiguous()  # (N,)
    lse = lse.float().contiguous()
    with_entropy = grad_entropy is not None
    if with_entropy:
        if entropy is None:
            raise ValueError("logprobs_backward: grad_entropy needs the forward's entropy (N,)")
        gent = (grad_entropy.float() / temperature).contiguous()  # (N,)
        entropy = entropy.float().contiguous()  # (N,)
    else:
        gent = entropy = gscale  # placeholders, never read
    grad_buf = torch.empty(n_tok, v_chunk, dtype=hidden.dtype, device=hidden.device)  # (N, vc)
    one_chunk = v_chunk >= v_total
    d_h = None
    if need_hidden_grad and not one_chunk:
        d_h = torch.zeros(n_tok, c, dtype=torch.float32, device=hidden.device)  # fp32 accumulator
    d_w = torch.empty_like(weight) if need_weight_grad else None
    tf32 = cfg.get("tf32", False)
    for v0 in range(0, v_total, v_chunk):
        v_len = min(v_chunk, v_total - v0)
        grad = grad_buf[:, :v_len]  # (N, v_len), row stride v_chunk
        grid = (triton.cdiv(n_tok, cfg["block_n"]) * triton.cdiv(v_len, bv),)
        with _on_device(hidden):
            _grad_logits_kernel[grid](
                hidden,
                weight,
                ids,
                lse,
                gscale,
                gent,
                entropy,
                grad,
                n_tok,
                v0,
                v_len,
                c,
                float(temperature),
                hidden.stride(0),
                weight.stride(0),
                grad.stride(0),
                BLOCK_N=cfg["block_n"],
                BLOCK_V=bv,
                BLOCK_C=cfg["block_c"],
                WITH_ENTROPY_GRAD=with_entropy,
                PRECISION=_input_precision(hidden.dtype, tf32),
                ROUND_TF32=_rounds_tf32(hidden.dtype, tf32),
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
        w_chunk = weight[v0 : v0 + v_len]  # (v_len, C)
        with tf32_matmuls(hidden.device, tf32):
            if need_weight_grad:
                torch.mm(grad.t(), hidden, out=d_w[v0 : v0 + v_len])  # (v_len, C), reduces all N
            if need_hidden_grad:
                if one_chunk:
                    d_h = grad @ w_chunk  # (N, C), one GEMM over all V
                else:
                    d_h += matmul_fp32(grad, w_chunk)
    if d_h is not None:
        d_h = d_h.to(hidden.dtype)
    return d_h, d_w


class TritonLogprobs(torch.autograd.Function):
    """autograd.Function over `logprobs_forward` / `logprobs_backward`; saves only lse (N,) fp32,
    plus the entropy (N,) fp32 when it is differentiable (`entropy_grad`)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, return_entropy, entropy_grad, config):
        logprobs, lse, entropy = logprobs_forward(
            hidden, weight, ids, temperature, return_entropy or entropy_grad, **config
        )
        ctx.temperature = temperature
        ctx.config = {k: v for k, v in config.items() if k != "num_splits"}
        ctx.entropy_grad = entropy_grad
        if entropy_grad:
            ctx.save_for_backward(hidden, weight, ids, lse, entropy)
            ctx.set_materialize_grads(False)  # an unused entropy adds no term to the kernel
        else:
            ctx.save_for_backward(hidden, weight, ids, lse)
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, ids, lse = ctx.saved_tensors[:4]
        entropy_kw = {}
        if ctx.entropy_grad:
            if grad_logprobs is None:  # only the entropy is in the loss
                grad_logprobs = torch.zeros_like(lse)
            entropy_kw = dict(grad_entropy=grad_entropy, entropy=ctx.saved_tensors[4])
        d_h, d_w = logprobs_backward(
            hidden,
            weight,
            ids,
            lse,
            grad_logprobs,
            ctx.temperature,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            **entropy_kw,
            **ctx.config,
        )
        return d_h, d_w, None, None, None, None, None


def triton_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    entropy_grad: bool = False,
    **config,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable fused log-probs on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    Args:
        hidden: (N, C) contiguous float16/bfloat16/float32.
        weight: (V, C) contiguous, same dtype.
        ids: (N,) int32/int64 target ids.
        temperature: logits are divided by it.
        return_entropy: also return the per-token entropy (no grad).
        entropy_grad: return the entropy (implies `return_entropy`) differentiable in hidden and
            weight; its gradient joins G in the same backward kernel.
        **config: tile overrides (block_n, block_v, block_c, num_warps, num_stages, num_splits,
            grad_buffer_mib), mainly for tests; `tf32=True` multiplies float32 inputs in TF32
            (forward and backward; the accumulation stays float32).

    Returns:
        logprobs (N,) fp32, or (logprobs, entropy) with `return_entropy` or `entropy_grad`.
    """
    check_operands(hidden, weight, ids, temperature, require_contiguous=True)
    return _triton_logprobs(hidden, weight, ids, temperature, return_entropy, entropy_grad, config)


def _triton_logprobs(hidden, weight, ids, temperature, return_entropy, entropy_grad, config):
    """`triton_logprobs` on operands its caller has checked (`grpo_kernels.fused_logprobs`
    checks them once; the launchers only assert shape, dtype and contiguity)."""
    unknown = sorted(set(config) - set(_CONFIG_KEYS))
    if unknown:
        raise TypeError(f"unknown triton config keys {unknown}; valid: {list(_CONFIG_KEYS)}")
    logprobs, entropy = TritonLogprobs.apply(
        hidden, weight, ids, float(temperature), return_entropy, entropy_grad, config
    )
    return (logprobs, entropy) if return_entropy or entropy_grad else logprobs
