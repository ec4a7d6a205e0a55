"""CUDA-only paths checked on the CPU (issue #41): what a GPU run would do differently is
decided by code that runs here too, with the device faked where it is asked for."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import torch

from grpo.config import load_config
from grpo.experience import inline, producer
from grpo.experience.batch import RolloutBatch
from grpo.models import load_model
from grpo.models.decoder import Decoder
from grpo.precision import Precision
from grpo.rollout import Sampler, sample
from grpo.rollout import sampler as sampler_mod

REPO = Path(__file__).resolve().parents[1]


def test_a_producer_thread_compiles_without_cuda_graphs(monkeypatch, shared_tiny_model):
    """CUDA-graph trees belong to the thread that records them: the colocated producer
    thread's sampler compiles with mode "default", the trainer's with "reduce-overhead"."""
    seen = []
    monkeypatch.setattr(
        sampler_mod.torch, "compile", lambda fn, **kw: seen.append(kw.get("mode")) or fn
    )
    monkeypatch.setattr(Decoder, "device", property(lambda self: torch.device("cuda")))
    cfg = load_config(
        REPO / "configs" / "tiny_ci.yaml", [f"model.path={shared_tiny_model}", "rollout.compile=on"]
    )
    model = load_model(shared_tiny_model)
    policy = types.SimpleNamespace(precision=Precision())
    for thread in (False, True):
        s = inline.make_sampler(cfg, policy, model, producer_thread=thread)
        assert s.compile and s._cuda
    # three compiled callables each: `decode`'s step, `sample`'s whole iteration, refill's
    assert seen == ["reduce-overhead"] * 3 + ["default"] * 3


def test_a_produced_batch_is_marked_used_on_the_trainers_stream(monkeypatch, shared_tiny_model):
    """Every tensor of a batch the producer allocated on its stream is recorded on the stream
    that consumes it (`record_stream`), so the caching allocator cannot recycle its memory
    while the consumer's kernels are queued."""
    model = load_model(shared_tiny_model)
    r = sample(model, [[5, 6, 7], [8, 9]], group_size=2, max_new_tokens=4, stop_ids=[], seed=0)
    B = r.ids.shape[0]
    batch = RolloutBatch(
        r,
        [{}] * B,
        [""] * B,
        torch.zeros(B),
        torch.zeros(B, 4),
        {"accuracy": torch.ones(B), "format": torch.ones(B)},
        0,
        0.0,
    )
    want = [getattr(r, f.name) for f in dataclasses.fields(r)]
    want = [t for t in want if isinstance(t, torch.Tensor)]
    want += [batch.rewards, batch.token_rewards, *batch.per_fn.values()]
    recorded = []
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, s: recorded.append((t, s)), raising=False
    )
    stream = types.SimpleNamespace(device=torch.device("cpu"))  # the consumer's stream
    producer.used_on(batch, stream)
    assert len(recorded) == len(want) > 8
    assert {id(t) for t, _ in recorded} == {id(t) for t in want}
    assert all(s is stream for _, s in recorded)
    other = types.SimpleNamespace(device=torch.device("meta"))  # tensors on another device
    recorded.clear()
    producer.used_on(batch, other)
    assert recorded == []


def test_release_caches_frees_the_compiled_steps_cache(shared_tiny_model):
    model = load_model(shared_tiny_model)
    s = Sampler(model, compile=True, compile_options={"backend": "eager"})
    s.sample([[5, 6, 7]], group_size=2, max_new_tokens=3, stop_ids=[], seed=0)
    kept = s.kept_cache_bytes
    assert kept > 0 and s.release_caches() == kept and s.kept_cache_bytes == 0


def test_training_rollouts_free_the_compiled_cache_before_the_update(monkeypatch):
    """The compiled step's KV cache (17.5 GiB at B=128, 1280 slots for Qwen3-0.6B in bf16) is
    freed once the step's rollouts are sampled, not held through the reference and update
    passes; its size during the rollout is what perf/sampler_cache_mib reports."""
    calls = []

    class Compiled:
        kept_cache_bytes = 1234

        def release_caches(self):
            calls.append("release")
            freed, self.kept_cache_bytes = self.kept_cache_bytes, 0
            return freed

    def rollout_phase(*args, **kwargs):
        calls.append("rollout")
        return "batch"

    monkeypatch.setattr(inline, "rollout_phase", rollout_phase)
    policy = types.SimpleNamespace(model=torch.nn.Linear(2, 2))
    source = inline.InlineRollouts(None, policy, Compiled(), [], [], None)
    assert source.next(types.SimpleNamespace(step=0)) == "batch"
    assert calls == ["rollout", "release"] and source.cache_bytes == 1234
    assert source.sampler.kept_cache_bytes == 0
