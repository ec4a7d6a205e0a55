"""Tests of kernels/: the torch twins and the Triton kernels against float64, errors.

The Triton kernels run on CPU under TRITON_INTERPRET=1, which triton reads when a kernel module is
imported; so the interpreted checks run in one subprocess (`interpret_report`) started with the
variable set, and the tests here assert on its report. On CUDA the same checks run compiled, in
bf16 under the error-budget rule: error vs float64 <= 2x the same-dtype naive torch error.
"""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels
from grpo_kernels.reference import check_operands, chunked_logprobs, naive_logprobs

REPO = Path(__file__).resolve().parents[1]
SHAPES = [(37, 64, 1003), (19, 72, 517)]  # (N, C, V): ragged token / vocab tiles; ragged C too
TEMPS = [1.0, 0.7]
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
CHUNKED_SMALL = dict(block_n=16, block_v=128)  # several tiles in both directions
# interpreted Triton: 3 vocab splits, 4 backward vocab chunks, ragged edges everywhere
TRITON_SMALL = dict(block_n=16, block_v=64, block_c=32, num_splits=3)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_inputs(n, c, v, seed=0, dtype=torch.float32, device="cpu"):
    """hidden (N, C), weight (V, C) (logits ~ N(0, 4): a peaked softmax), ids (N,), grad (N,)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=gen)
    weight = torch.randn(v, c, generator=gen) * 2 / c**0.5
    ids = torch.randint(0, v, (n,), generator=gen)
    grad = torch.randn(n, generator=gen)
    return hidden.to(device, dtype), weight.to(device, dtype), ids.to(device), grad.to(device)


def run(fn, hidden, weight, ids, grad, temperature, weight_grad=True, upcast=None, **kw):
    """(logprobs, entropy, d_hidden, d_weight or None) of fn, inputs optionally upcast first."""
    h = hidden.detach().to(upcast or hidden.dtype).requires_grad_(True)
    w = weight.detach().to(upcast or weight.dtype).requires_grad_(weight_grad)
    logprobs, entropy = fn(h, w, ids, temperature, return_entropy=True, **kw)
    inputs = (h, w) if weight_grad else (h,)
    grads = torch.autograd.grad(logprobs, inputs, grad.to(logprobs.dtype))
    return logprobs, entropy, grads[0], (grads[1] if weight_grad else None)


def gold(hidden, weight, ids, grad, temperature, weight_grad=True):
    """The float64 naive path on the (already rounded) inputs."""
    return run(naive_logprobs, hidden, weight, ids, grad, temperature, weight_grad, torch.float64)


def entropy_coefs(n, seed=1):
    """(a, b) (N,) each: the entropy-bonus tests differentiate loss = sum(a * logprobs + b * H)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def run_entropy(fn, hidden, weight, ids, coefs, temperature, weight_grad=True, upcast=None, **kw):
    """(logprobs, entropy, d_hidden, d_weight or None) of sum(a * logprobs + b * entropy) under
    fn(..., entropy_grad=True); a coefficient given as None leaves that output out of the loss."""
    h = hidden.detach().to(upcast or hidden.dtype).requires_grad_(True)
    w = weight.detach().to(upcast or weight.dtype).requires_grad_(weight_grad)
    logprobs, entropy = fn(h, w, ids, temperature, entropy_grad=True, **kw)
    loss = sum(
        (c.to(out.device, out.dtype) * out).sum()
        for c, out in zip(coefs, (logprobs, entropy))
        if c is not None
    )
    inputs = (h, w) if weight_grad else (h,)
    grads = torch.autograd.grad(loss, inputs)
    return logprobs, entropy, grads[0], (grads[1] if weight_grad else None)


def gold_entropy(hidden, weight, ids, coefs, temperature, weight_grad=True):
    """float64 autograd through torch.distributions.Categorical, independent of our kernels."""
    h = hidden.detach().cpu().double().requires_grad_(True)
    w = weight.detach().cpu().double().requires_grad_(weight_grad)
    dist = torch.distributions.Categorical(logits=(h @ w.t()) / temperature)
    logprobs, entropy = dist.log_prob(ids.cpu().long()), dist.entropy()  # (N,) each
    loss = sum(
        (c.cpu().double() * out).sum()
        for c, out in zip(coefs, (logprobs, entropy))
        if c is not None
    )
    grads = torch.autograd.grad(loss, (h, w) if weight_grad else (h,))
    return logprobs, entropy, grads[0], (grads[1] if weight_grad else None)


def close_errors(actual, expected, names=("logprobs", "entropy", "d_hidden", "d_weight")):
    """Messages of every output that misses float32 tolerance against float64 (empty if none)."""
    errors = []
    for name, a, e in zip(names, actual, expected):
        if e is None:
            continue
        try:
            torch.testing.assert_close(a.double().cpu(), e.double().cpu(), **FP32_TOL)
        except AssertionError as err:
            errors.append(f"{name}: {str(err).splitlines()[2:4]}")
    return errors


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_error_budget(ours, ref, expected, factor=2.0, floor=1e-6):
    """bf16 rule: each output's relative L2 error vs float64 <= factor x the reference's + floor.
    Every output's errors are printed (pytest -rA shows them for a pass too) and a failure
    names all of them, so one run on a GPU tells which output misses and by how much."""
    names = ("logprobs", "entropy", "d_hidden", "d_weight")
    lines, missed = [], []
    for name, o, r, e in zip(names, ours, ref, expected):
        if e is None:
            continue
        err_ours, err_ref = rel_err(o, e), rel_err(r, e)
        ok = err_ours <= factor * err_ref + floor
        ratio = err_ours / max(err_ref, 1e-300)
        lines.append(
            f"{name}: ours {err_ours:.3g}, reference {err_ref:.3g}, ratio {ratio:.3g} "
            f"(budget {factor}x){'' if ok else ' MISSED'}"
        )
        missed += [] if ok else [name]
    print("relative L2 error vs float64:\n  " + "\n  ".join(lines))
    assert not missed, "; ".join(lines)


# ---------------------------------------------------------------- torch twins vs float64


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
def test_naive_fp32_matches_float64(shape, temperature):
    args = make_inputs(*shape)
    assert not close_errors(run(naive_logprobs, *args, temperature), gold(*args, temperature))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
@pytest.mark.parametrize("blocks", [CHUNKED_SMALL, {}], ids=["small_tiles", "default_tiles"])
def test_chunked_matches_float64(shape, temperature, weight_grad, blocks):
    args = make_inputs(*shape)
    ours = run(chunked_logprobs, *args, temperature, weight_grad, **blocks)
    assert ours[0].dtype == torch.float32
    assert not close_errors(ours, gold(*args, temperature, weight_grad))


class CountMatmuls(TorchDispatchMode):
    """Counts aten matmul-family calls (mm, addmm, addmm_, bmm, ...) made inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "mm" in func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def test_chunked_frozen_weight_backward_does_no_recompute():
    hidden, weight, ids, grad = make_inputs(37, 64, 1003)
    h = hidden.clone().requires_grad_(True)
    with CountMatmuls() as fwd:
        logprobs = chunked_logprobs(h, weight, ids, 0.7, **CHUNKED_SMALL)
    with CountMatmuls() as bwd:
        (d_h,) = torch.autograd.grad(logprobs, h, grad)
    tiles = 3 * 8  # ceil(37 / 16) x ceil(1003 / 128)
    assert fwd.count == 2 * tiles  # logits and the online softmax-weighted W average
    assert bwd.count == 0  # d_hidden = g/T * (W[id] - E_p[W]) from the forward's average
    # with a trainable weight the backward recomputes each tile: logits, d_hidden, d_weight
    w = weight.clone().requires_grad_(True)
    logprobs = chunked_logprobs(h, w, ids, 0.7, **CHUNKED_SMALL)
    with CountMatmuls() as bwd:
        torch.autograd.grad(logprobs, (h, w), grad)
    assert bwd.count == 3 * tiles


@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
def test_chunked_bf16_within_error_budget_of_naive_bf16(weight_grad):
    args = make_inputs(37, 64, 1003, dtype=torch.bfloat16)
    ours = run(chunked_logprobs, *args, 0.7, weight_grad, **CHUNKED_SMALL)
    ref = run(naive_logprobs, *args, 0.7, weight_grad)
    assert ours[2].dtype == torch.bfloat16
    assert_error_budget(ours, ref, gold(*args, 0.7, weight_grad))


def test_chunked_empty_batch():
    hidden, weight, ids, _ = make_inputs(0, 8, 11)
    h = hidden.requires_grad_(True)
    logprobs = chunked_logprobs(h, weight, ids)
    assert logprobs.shape == (0,)
    (d_h,) = torch.autograd.grad(logprobs.sum(), h)
    assert d_h.shape == (0, 8)


# ---------------------------------------------------------------- differentiable entropy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
def test_naive_entropy_grad_matches_float64(shape, temperature, weight_grad):
    args = make_inputs(*shape)[:3]
    coefs = entropy_coefs(shape[0])
    ours = run_entropy(naive_logprobs, *args, coefs, temperature, weight_grad)
    assert not close_errors(ours, gold_entropy(*args, coefs, temperature, weight_grad))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
@pytest.mark.parametrize("blocks", [CHUNKED_SMALL, {}], ids=["small_tiles", "default_tiles"])
def test_chunked_entropy_grad_matches_float64(shape, temperature, weight_grad, blocks):
    args = make_inputs(*shape)[:3]
    coefs = entropy_coefs(shape[0])
    ours = run_entropy(chunked_logprobs, *args, coefs, temperature, weight_grad, **blocks)
    assert ours[1].dtype == torch.float32
    assert not close_errors(ours, gold_entropy(*args, coefs, temperature, weight_grad))


@pytest.mark.parametrize("impl", ["naive", "chunked"])
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
@pytest.mark.parametrize("used", ["entropy_only", "logprobs_only"])
def test_entropy_grad_with_one_output_in_the_loss(impl, weight_grad, used):
    # the other output gets no upstream gradient at all (None in the chunked backward)
    args = make_inputs(37, 64, 1003)[:3]
    a, b = entropy_coefs(37)
    coefs = (None, b) if used == "entropy_only" else (a, None)
    fn = (
        functools.partial(chunked_logprobs, **CHUNKED_SMALL)
        if impl == "chunked"
        else naive_logprobs
    )
    ours = run_entropy(fn, *args, coefs, 0.7, weight_grad)
    assert not close_errors(ours, gold_entropy(*args, coefs, 0.7, weight_grad))


@pytest.mark.parametrize("impl", ["naive", "chunked"])
def test_entropy_grad_false_keeps_entropy_detached(impl):
    hidden, weight, ids, _ = make_inputs(37, 64, 1003)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    for kw in ({}, {"entropy_grad": False}):
        logprobs, entropy = grpo_kernels.fused_logprobs(h, w, ids, 0.7, impl, True, **kw)
        assert logprobs.grad_fn is not None
        assert entropy.grad_fn is None and not entropy.requires_grad
    out = grpo_kernels.fused_logprobs(h, w, ids, 0.7, impl, entropy_grad=True)  # implies the tuple
    assert isinstance(out, tuple) and out[1].grad_fn is not None
    assert torch.equal(out[1].detach(), entropy)  # same forward values


def test_chunked_frozen_weight_entropy_grad_recomputes():
    # the folded frozen-weight backward carries no entropy term: entropy_grad recomputes tiles
    hidden, weight, ids, _ = make_inputs(37, 64, 1003)
    h = hidden.clone().requires_grad_(True)
    logprobs, entropy = chunked_logprobs(h, weight, ids, 0.7, entropy_grad=True, **CHUNKED_SMALL)
    with CountMatmuls() as bwd:
        torch.autograd.grad((logprobs + entropy).sum(), h)
    assert bwd.count == 2 * 3 * 8  # logits and d_hidden per (16, 128) tile


@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
def test_chunked_bf16_entropy_grad_within_error_budget_of_naive_bf16(weight_grad):
    args = make_inputs(37, 64, 1003, dtype=torch.bfloat16)[:3]
    coefs = entropy_coefs(37)
    ours = run_entropy(chunked_logprobs, *args, coefs, 0.7, weight_grad, **CHUNKED_SMALL)
    ref = run_entropy(naive_logprobs, *args, coefs, 0.7, weight_grad)
    assert ours[2].dtype == torch.bfloat16
    assert_error_budget(ours, ref, gold_entropy(*args, coefs, 0.7, weight_grad))


# ---------------------------------------------------------------- public entry point


def test_fused_logprobs_dispatch_on_cpu():
    hidden, weight, ids, _ = make_inputs(37, 64, 1003)
    assert grpo_kernels.resolve_impl("auto", hidden.device) == "chunked"
    auto = grpo_kernels.fused_logprobs(hidden, weight, ids, 0.7)
    assert torch.equal(auto, grpo_kernels.fused_logprobs(hidden, weight, ids, 0.7, impl="chunked"))
    naive = grpo_kernels.fused_logprobs(hidden, weight, ids.int(), 0.7, impl="naive")
    torch.testing.assert_close(auto, naive, **FP32_TOL)
    logprobs, entropy = grpo_kernels.fused_logprobs(hidden, weight, ids, 0.7, return_entropy=True)
    assert torch.equal(logprobs, auto) and entropy.shape == (37,) and not entropy.requires_grad
    assert logprobs.dtype == entropy.dtype == torch.float32
    # entropy of the tempered distribution, by hand
    p = torch.softmax((hidden.double() @ weight.double().t()) / 0.7, dim=-1)
    torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1), **FP32_TOL)


# ---------------------------------------------------------------- operand errors


def _bad_cases():
    h, w, ids, _ = make_inputs(5, 8, 11)
    return [
        ("hidden must be 2-D", (h[None], w, ids), {}),
        ("weight must be 2-D", (h, w[0], ids), {}),
        ("ids must be 1-D", (h, w, ids[:, None]), {}),
        ("disagree on C", (h, w[:, :4], ids), {}),
        ("ids has 4 entries", (h, w, ids[:4]), {}),
        ("ids must be int32 or int64", (h, w, ids.float()), {}),
        ("hidden must be a floating tensor", (h.long(), w.long(), ids), {}),
        ("weight dtype torch.float64 must equal", (h, w.double(), ids), {}),
        ("temperature must be > 0", (h, w, ids), {"temperature": 0.0}),
        ("ids must lie in", (h, w, ids + 11), {}),
        ("unknown log-prob impl 'cuda'", (h, w, ids), {"impl": "cuda"}),
    ]


@pytest.mark.parametrize("message,args,kwargs", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_fused_logprobs_rejects_bad_operands(message, args, kwargs):
    with pytest.raises((ValueError, TypeError), match=message):
        grpo_kernels.fused_logprobs(*args, **kwargs)


def test_contiguity_and_triton_device_errors(monkeypatch):
    h, w, ids, _ = make_inputs(5, 8, 11)
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        check_operands(h.t().contiguous().t(), w, ids, 1.0, require_contiguous=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        grpo_kernels.fused_logprobs(h, w, ids, impl="triton")


# ---------------------------------------------------------------- Triton, interpreted on CPU

INTERPRET_CASES = [
    (shape, temperature, weight_grad)
    for shape in SHAPES
    for temperature in TEMPS
    for weight_grad in (True, False)
]


def _case_id(shape, temperature, weight_grad):
    return f"{'x'.join(map(str, shape))}-T{temperature}-{'d_weight' if weight_grad else 'frozen'}"


def _fix_interpreter_index() -> None:
    """triton 3.6's interpreter makes a scalar tensor (a (1,) array, e.g. `tl.program_id`) a
    Python int with `int(array)`, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be
    converted"): `range(v_begin, v_end, ...)` in the kernels fails. triton 3.9 squeezes first;
    do the same where it does not (the interpreter only: compiled kernels never run it)."""
    import inspect

    import triton.runtime.interpreter as ti

    patch = getattr(ti, "_patch_lang_tensor", None)
    if patch is None or "squeeze()" in inspect.getsource(patch):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    ti._patch_lang_tensor = patched


def interpret_report() -> dict:
    """Run every interpreted Triton check; called in a subprocess with TRITON_INTERPRET=1."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _fix_interpreter_index()
    from grpo_kernels.logprobs import triton_logprobs

    report = {}
    for shape, temperature, weight_grad in INTERPRET_CASES:
        args = make_inputs(*shape)
        n = shape[0]
        small = dict(TRITON_SMALL, grad_buffer_mib=n * 256 * 4 / 2**20)  # 256-column chunks
        ours = run(triton_logprobs, *args, temperature, weight_grad, **small)
        report[_case_id(shape, temperature, weight_grad)] = close_errors(
            ours, gold(*args, temperature, weight_grad)
        )
        # entropy bonus: the WITH_ENTROPY_GRAD kernel variant
        coefs = entropy_coefs(n)
        ours = run_entropy(triton_logprobs, *args[:3], coefs, temperature, weight_grad, **small)
        report["entropy-" + _case_id(shape, temperature, weight_grad)] = close_errors(
            ours, gold_entropy(*args[:3], coefs, temperature, weight_grad)
        )
    # the fp32 default tiles (64 x 64 x 32) as compiled on a GPU; one vocab chunk in backward
    args = make_inputs(37, 64, 1003)
    ours = run(triton_logprobs, *args, 0.7, True)
    report["default_config"] = close_errors(ours, gold(*args, 0.7, True))
    # 16-bit path (G stored in the input dtype, fp32 d_hidden accumulation) under the error
    # budget; fp16 stands in for bf16, whose tl.dot the interpreter gets wrong (numpy has no bf16)
    for chunks, mib in (("one_chunk", 512), ("many_chunks", 37 * 256 * 2 / 2**20)):
        args = make_inputs(37, 64, 1003, dtype=torch.float16)
        ours = run(triton_logprobs, *args, 0.7, True, **TRITON_SMALL, grad_buffer_mib=mib)
        ref = run(naive_logprobs, *args, 0.7, True)
        try:
            assert_error_budget(ours, ref, gold(*args, 0.7, True))
            report[f"fp16_{chunks}"] = []
        except AssertionError as err:
            report[f"fp16_{chunks}"] = [str(err)]
    # entropy_grad with one output left out of the loss; entropy_grad=False keeps it detached
    args = make_inputs(37, 64, 1003)[:3]
    a, b = entropy_coefs(37)
    for used, coefs in (("entropy_only", (None, b)), ("logprobs_only", (a, None))):
        ours = run_entropy(triton_logprobs, *args, coefs, 0.7, True, **TRITON_SMALL)
        report[f"entropy_grad_{used}"] = close_errors(ours, gold_entropy(*args, coefs, 0.7))
    h = args[0].clone().requires_grad_(True)
    _, entropy = triton_logprobs(h, args[1], args[2], 0.7, True, **TRITON_SMALL)
    _, entropy_g = triton_logprobs(h, args[1], args[2], 0.7, entropy_grad=True, **TRITON_SMALL)
    report["entropy_grad_false_detached"] = (
        [] if entropy.grad_fn is None and entropy_g.grad_fn is not None else ["grad_fn wrong"]
    )
    args = make_inputs(37, 64, 1003, dtype=torch.float16)[:3]
    ours = run_entropy(triton_logprobs, *args, (a, b), 0.7, True, **TRITON_SMALL)
    ref = run_entropy(naive_logprobs, *args, (a, b), 0.7, True)
    try:
        assert_error_budget(ours, ref, gold_entropy(*args, (a, b), 0.7))
        report["fp16_entropy_grad"] = []
    except AssertionError as err:
        report["fp16_entropy_grad"] = [str(err)]
    h, w, ids, _ = make_inputs(5, 8, 11)
    for name, call, exc in [
        ("noncontiguous", lambda: triton_logprobs(h.t().contiguous().t(), w, ids), ValueError),
        ("bad_config", lambda: triton_logprobs(h, w, ids, block_m=16), TypeError),
        ("float64", lambda: triton_logprobs(h.double(), w.double(), ids), TypeError),
    ]:
        try:
            call()
            report[name] = ["no error raised"]
        except exc as err:
            report[name] = [] if str(err) else ["empty message"]
    return report


@pytest.fixture(scope="module")
def interpreted():
    code = (
        "import json, runpy, sys; ns = runpy.run_path(sys.argv[1]); "
        "print('REPORT ' + json.dumps(ns['interpret_report']()))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", code, __file__],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT ") :])


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[_case_id(*c) for c in INTERPRET_CASES])
def test_triton_interpreted_matches_float64(interpreted, case):
    assert interpreted[_case_id(*case)] == []


@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[_case_id(*c) for c in INTERPRET_CASES])
def test_triton_interpreted_entropy_grad_matches_float64(interpreted, case):
    assert interpreted["entropy-" + _case_id(*case)] == []


@pytest.mark.parametrize(
    "check",
    [
        "default_config",
        "fp16_one_chunk",
        "fp16_many_chunks",
        "noncontiguous",
        "bad_config",
        "float64",
        "entropy_grad_entropy_only",
        "entropy_grad_logprobs_only",
        "entropy_grad_false_detached",
        "fp16_entropy_grad",
    ],
)
def test_triton_interpreted_launcher_checks(interpreted, check):
    assert interpreted[check] == []


# ---------------------------------------------------------------- Triton, compiled on CUDA

CUDA_SHAPES = SHAPES + [(1000, 512, 32003)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
@pytest.mark.parametrize("chunks", ["one_chunk", "many_chunks"])
def test_triton_cuda_bf16_within_error_budget(shape, temperature, weight_grad, chunks):
    from grpo_kernels.logprobs import triton_logprobs

    args = make_inputs(*shape, dtype=torch.bfloat16, device="cuda")
    config = {"grad_buffer_mib": shape[0] * 256 * 2 / 2**20} if chunks == "many_chunks" else {}
    ours = run(triton_logprobs, *args, temperature, weight_grad, **config)
    ref = run(naive_logprobs, *args, temperature, weight_grad)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == torch.bfloat16
    assert_error_budget(ours, ref, gold(*args, temperature, weight_grad))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
def test_triton_cuda_fp32_matches_float64(shape, temperature):
    from grpo_kernels.logprobs import triton_logprobs

    args = make_inputs(*shape, device="cuda")
    ours = run(triton_logprobs, *args, temperature, True)
    assert not close_errors(ours, gold(*args, temperature, True))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
def test_triton_cuda_fp32_entropy_grad_matches_float64(shape, temperature, weight_grad):
    from grpo_kernels.logprobs import triton_logprobs

    args = make_inputs(*shape, device="cuda")[:3]
    coefs = entropy_coefs(shape[0])
    ours = run_entropy(triton_logprobs, *args, coefs, temperature, weight_grad)
    assert not close_errors(ours, gold_entropy(*args, coefs, temperature, weight_grad))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
@pytest.mark.parametrize("chunks", ["one_chunk", "many_chunks"])
def test_triton_cuda_bf16_entropy_grad_within_error_budget(weight_grad, chunks):
    from grpo_kernels.logprobs import triton_logprobs

    shape = CUDA_SHAPES[-1]
    args = make_inputs(*shape, dtype=torch.bfloat16, device="cuda")[:3]
    coefs = entropy_coefs(shape[0])
    config = {"grad_buffer_mib": shape[0] * 256 * 2 / 2**20} if chunks == "many_chunks" else {}
    ours = run_entropy(triton_logprobs, *args, coefs, 0.7, weight_grad, **config)
    ref = run_entropy(naive_logprobs, *args, coefs, 0.7, weight_grad)
    expected = gold_entropy(*args, coefs, 0.7, weight_grad)
    # this case failed on an H200 (torch 2.11, triton 3.6) for a reason not seen on a CPU (the
    # interpreter, fp16 for bf16, passes at this shape): the chunked twin, which also stores G
    # in bf16, printed beside, tells a kernel defect from a reference that is more exact on
    # CUDA (`matmul_fp32` keeps naive's logits in float32 there)
    chunked = run_entropy(chunked_logprobs, *args, coefs, 0.7, weight_grad)
    names = ("logprobs", "entropy", "d_hidden", "d_weight")
    print(
        "chunked twin vs float64: "
        + ", ".join(
            f"{n} {rel_err(c, e):.3g}" for n, c, e in zip(names, chunked, expected) if e is not None
        )
    )
    assert_error_budget(ours, ref, expected)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("weight_grad", [True, False], ids=["d_weight", "frozen"])
def test_chunked_and_auto_cuda_bf16_within_error_budget(weight_grad):
    args = make_inputs(1000, 512, 32003, dtype=torch.bfloat16, device="cuda")
    ref = run(naive_logprobs, *args, 0.7, weight_grad)
    expected = gold(*args, 0.7, weight_grad)
    assert_error_budget(run(chunked_logprobs, *args, 0.7, weight_grad), ref, expected)
    assert grpo_kernels.resolve_impl("auto", args[0].device) == "triton"
    fused = run(grpo_kernels.fused_logprobs, *args, 0.7, weight_grad)  # impl="auto" -> triton
    assert_error_budget(fused, ref, expected)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_triton_runs_on_the_tensors_device_not_the_current_one():
    """Triton launches on the current CUDA device: a rank whose tensors live on another GPU than
    the current one (here the last GPU while cuda:0 is current) must still get correct results,
    forward and backward (both kernels), on its tensors' device."""
    from grpo_kernels.logprobs import triton_logprobs

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    args = make_inputs(37, 64, 1003, device=last)
    coefs = entropy_coefs(37)
    with torch.cuda.device(0):
        ours = run(triton_logprobs, *args, 0.7, True)
        ours_entropy = run_entropy(triton_logprobs, *args[:3], coefs, 0.7, True)
        assert torch.cuda.current_device() == 0
    assert all(t.device == last for t in (*ours, *ours_entropy))
    assert not close_errors(ours, gold(*args, 0.7, True))
    assert not close_errors(ours_entropy, gold_entropy(*args[:3], coefs, 0.7, True))
