"""Which arrangement of an attention call the decoder makes, decided by SDPA's own selector.

`F.scaled_dot_product_attention` picks a kernel per call: flash, memory-efficient, cuDNN, a
backend's own (the CPU's flash kernel), or the math fallback, which materialises the scores.
Which kernels take grouped-query heads together with a mask differs between PyTorch releases and
GPUs (recent releases prefer cuDNN attention on Hopper, which does; memory-efficient attention
does not), so the decoder does not guess by device type. For each kind of call it asks the
selector (`torch._fused_sdp_choice`, under the `sdpa_kernel` context in force) about each
arrangement, best first, and takes the first that gets a fused kernel:

- T queries (training, prefill): `GROUPED` (one call with `enable_gqa`: K and V stay H_kv heads),
  then `REPEAT` (K and V repeated to H heads, one (B, H, S, D) copy each; memory-efficient
  attention needs it). When neither is fused, `GROUPED` on the math kernel (no copy of ours).
- one query per row with an additive mask (decode): `GROUPED`, then `FOLD` (the g = H / H_kv
  query heads of a kv head as g queries of that head, `decode_sdpa`: K and V read once, the
  mask broadcast over the g queries), then `MATMUL` (two batched matmuls, `decode_attention`),
  never SDPA's math kernel. A device type in `MATMUL_DECODE` decodes with `MATMUL` whatever its
  selector says: on a CPU two matmuls cost ~25% less than its flash kernel for one query
  (docs/sampler.md, decode attention).

Without grouped heads (H == H_kv) `GROUPED` is the plain call. The selector is asked once per
kind of call (device, dtypes, heads, head dim, mask or causal, the enabled backends) on small
probe tensors, never on the call's own tensors (`REPEAT` would have to be built to be asked
about); B, T and S do not enter, so one answer serves every batch and cache length. Inside a
`torch.compile` trace nothing is asked: the answer must be there already (`prepare` fills it
for a model; the sampler calls it before compiling), else the safe arrangement is used
(`MATMUL` for decode, `GROUPED` otherwise).

Seams: `sdpa_backend` (the selector; tests replace it with mocked choices), `MATMUL_DECODE`,
and `forced` (a block with the arrangements fixed, e.g. to count what each launches).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend

GROUPED, REPEAT, FOLD, MATMUL = "grouped", "repeat", "fold", "matmul"
ARRANGEMENTS = {"queries": (GROUPED, REPEAT), "decode": (GROUPED, FOLD, MATMUL)}
FUSED = frozenset(
    {
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.OVERRIDEABLE,
    }
)
# device types whose decode step attends with two matmuls whatever the selector says (measured)
MATMUL_DECODE = frozenset({"cpu"})

_PROBE_T, _PROBE_S = 16, 64  # query rows and key slots of the probe tensors (mask rows: 64)
_CHOICES: dict[tuple, tuple[str, SDPBackend]] = {}  # full key (with the enabled backends)
_LAST: dict[tuple, str] = {}  # key without the enabled backends -> last answer (compiled reads)
_FORCED: dict[str, str] = {}


def sdpa_backend(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
) -> SDPBackend:
    """The kernel `F.scaled_dot_product_attention` would run for these arguments (its own),
    as its selector decides (the `sdpa_kernel` context included); `SDPBackend.ERROR` if none
    can."""
    choice = torch._fused_sdp_choice(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return SDPBackend(choice)


def _key(base: tuple) -> tuple:
    """The cache key of a kind of call (`base`: kind, device, dtype, heads, masked, causal):
    on CUDA with the backends `sdpa_kernel` leaves enabled, which change the selector's answer."""
    if base[1].type != "cuda":
        return base
    b = torch.backends.cuda
    enabled = (
        b.flash_sdp_enabled(),
        b.mem_efficient_sdp_enabled(),
        b.cudnn_sdp_enabled(),
        b.math_sdp_enabled(),
    )
    return (base, enabled)


def _probe(kind, arrangement, device, dtype, heads, masked, is_causal):
    """The selector's kernel for one arrangement, on probe tensors of the call's kind."""
    H, H_kv, D = heads
    T = 1 if kind == "decode" else _PROBE_T
    S = _PROBE_S if kind == "decode" or masked else T
    kw = dict(device=device, dtype=dtype)
    q = torch.zeros(1, H, T, D, **kw)
    kv_heads = H if arrangement == REPEAT else H_kv
    k = torch.zeros(1, kv_heads, S, D, **kw)
    if arrangement == FOLD:
        q = q.reshape(1, H_kv, H // H_kv, D)
    mask = torch.zeros(1, 1, T, S, **kw) if masked else None
    gqa = arrangement == GROUPED and H != H_kv
    return sdpa_backend(q, k, k, mask, is_causal=is_causal and mask is None, enable_gqa=gqa)


def choose(
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    heads: tuple[int, int, int],
    masked: bool = True,
    is_causal: bool = False,
) -> str:
    """The arrangement for a call of `kind` ("queries" or "decode") on `device` with q, k, v
    and the mask in `dtype`, `heads` = (H, H_kv, D); see the module docstring for the rules."""
    if _FORCED and kind in _FORCED:
        return _FORCED[kind]
    if not isinstance(device, torch.device):
        device = torch.device(device)
    base = (kind, device, dtype, heads, masked, is_causal)
    if torch.compiler.is_compiling():  # no selector inside a trace: `prepare` asked before
        return _LAST.get(base, MATMUL if kind == "decode" else GROUPED)
    key = _key(base)
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _decide(kind, device, dtype, heads, masked, is_causal)
        _LAST[base] = choice[0]
    elif _LAST.get(base) != choice[0]:  # the enabled backends changed since
        _LAST[base] = choice[0]
    return choice[0]


def _decide(kind, device, dtype, heads, masked, is_causal) -> tuple[str, SDPBackend]:
    if kind == "decode" and device.type in MATMUL_DECODE:
        return MATMUL, SDPBackend.MATH
    H, H_kv, _ = heads
    backend = SDPBackend.MATH
    for arrangement in ARRANGEMENTS[kind]:
        if arrangement == MATMUL:
            return MATMUL, SDPBackend.MATH
        if arrangement in (REPEAT, FOLD) and H == H_kv:
            continue  # the same call as GROUPED without grouped heads
        backend = _probe(kind, arrangement, device, dtype, heads, masked, is_causal)
        if backend in FUSED:
            return arrangement, backend
    return GROUPED, backend  # no fused kernel: the math kernel, with no copy of ours


def chosen_backend(kind: str, device, dtype, heads, masked=True, is_causal=False) -> SDPBackend:
    """The kernel the arrangement `choose` returns gets (what the GPU check reports): the
    selector's fused kernel, or `SDPBackend.MATH` for the math kernel and for `MATMUL`."""
    choose(kind, device, dtype, heads, masked, is_causal)
    choice = _CHOICES.get(_key((kind, torch.device(device), dtype, heads, masked, is_causal)))
    return SDPBackend.MATH if choice is None else choice[1]


def prepare(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Ask the selector, ahead of a `torch.compile` trace, about every kind of call `model` (a
    `Decoder`) makes with q, k, v and masks in `dtype`: decode, masked queries, causal queries."""
    cfg = model.config
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    device = next(model.parameters()).device
    choose("decode", device, dtype, heads)
    choose("queries", device, dtype, heads, masked=True)
    choose("queries", device, dtype, heads, masked=False, is_causal=True)


def clear() -> None:
    """Forget every answer (after replacing `sdpa_backend` or `MATMUL_DECODE`)."""
    _CHOICES.clear()
    _LAST.clear()


@contextlib.contextmanager
def forced(queries: str | None = None, decode: str | None = None):
    """A block in which every call of a kind takes the given arrangement (`queries`: GROUPED or
    REPEAT; `decode`: GROUPED, FOLD or MATMUL), whatever the selector says; restored after."""
    saved = dict(_FORCED)
    for kind, value in (("queries", queries), ("decode", decode)):
        if value is not None:
            if value not in ARRANGEMENTS[kind]:
                raise ValueError(f"{kind}: {value!r} is not one of {ARRANGEMENTS[kind]}")
            _FORCED[kind] = value
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(saved)
