"""On-policy distillation from a config alone (issue 65, item 3): the `teacher` frozen scorer
(grpo/modules/teacher.py) attaches a frozen checkpoint's log-probs of the sampled tokens, equal
to a float64 recompute, under the trainer's padded and packed micro-batches; the `distill`
estimator drives a run with `rewards: []` and the reverse KL to the teacher falls; `rewards: []`
is refused with an estimator that reads rewards; a teacher with another vocabulary is refused
in one line; the teacher's identity is in the run's metadata and its checkpoints, and a resume
with other teacher weights is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo.checks import check_config
from grpo.config import load_config
from grpo.errors import GrpoError
from grpo.experience.scoring import Scoring
from grpo.models import load_model, save_pretrained
from grpo.modules.teacher import teacher
from grpo.policy import build_policy
from grpo.rollout import sample
from grpo.settings import ConfigError
from grpo.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
DISTILL = REPO / "configs" / "distill_tiny.yaml"


@pytest.fixture(scope="module")
def digit_teacher(shared_tiny_model, tmp_path_factory):
    """A tiny checkpoint other than the student: the student's weights trained (plain torch,
    a few Adam steps) to put its mass on the digit tokens in every context; the student's
    tokenizer. A teacher far from the student, that a student can learn to follow."""
    out = tmp_path_factory.mktemp("teacher")
    tok = load_tokenizer(shared_tiny_model)
    model = load_model(shared_tiny_model)
    digits = torch.tensor(sorted({tok.convert_tokens_to_ids(str(d)) for d in range(10)}))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(8):  # P(a digit) ~0.57 in every context (a random model's: ~0.03)
        ids = torch.randint(0, len(tok), (8, 24), generator=g)
        h = model(ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), return_hidden=True)
        logp = torch.log_softmax(model.lm_head(h).float(), -1)  # (8, 24, V)
        loss = -torch.logsumexp(logp[..., digits], -1).mean()  # -log P(a digit)
        opt.zero_grad()
        loss.backward()
        opt.step()
    save_pretrained(model, out)
    tok.save_pretrained(str(out))
    return out


def distill_cfg(student, teacher_path, out, *overrides):
    """configs/distill_tiny.yaml with the student, the teacher (its only module's path: the
    rest of that entry as written) and the output replaced."""
    import yaml

    entry = yaml.safe_load(DISTILL.read_text())["modules"][0]
    entry["kwargs"]["path"] = str(teacher_path)
    return check_config(
        load_config(
            DISTILL,
            [
                f"model.path={student}",
                f"modules=[{json.dumps(entry)}]",
                f"train.output_dir={out}",
                "train.progress=false",
                *overrides,
            ],
        ),
        "grpo",
    )


def reference_teacher_logprobs(path, r) -> torch.Tensor:
    """log p_teacher of each generated token (B, T_c) float64, by definition: the teacher in
    float64, each row's real tokens alone (no padding, no packing), a full log-softmax."""
    model = load_model(path, dtype=torch.float64)
    attn = r.attention_mask()
    out = torch.zeros(r.completion_ids.shape, dtype=torch.float64)
    T_p = r.prompt_width
    for b in range(r.ids.shape[0]):
        cols = attn[b].nonzero().flatten()  # the row's real columns
        ids = r.ids[b, cols][None]
        with torch.no_grad():
            h = model(
                ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), return_hidden=True
            )
            logp = torch.log_softmax(model.lm_head(h)[0].double(), -1)  # (n, V)
        for i, c in enumerate(cols.tolist()):
            t = c - T_p
            if t >= 0 and r.generated_mask[b, t]:
                out[b, t] = logp[i - 1, r.ids[b, c]]  # position i - 1 predicts column c
    return out


@pytest.mark.parametrize("pack", ["off", "on"])
def test_teacher_logprobs_equal_a_float64_recompute(shared_tiny_model, digit_teacher, pack):
    """The teacher's attached log-probs (the trainer's micro-batches of 2 rows, padded or packed
    with each group's prompt once, at rollout.temperature 1) equal the float64 recompute."""
    cfg = distill_cfg(
        shared_tiny_model,
        digit_teacher,
        "unused",
        "rollout.group_size=2",
        "train.batch_size=6",
        "train.micro_batch_size=2",
        f"train.pack_sequences={pack}",
    )
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    tok = policy.tokenizer
    prompts = [tok.encode(q) for q in ("What is 2 + 3?", "Add 10 and 7.", "7 times 6")]
    r = sample(
        policy.model,
        prompts,
        group_size=2,
        max_new_tokens=7,
        temperature=1.0,
        stop_ids=policy.stop_ids,
        seed=0,
        pad_id=tok.pad_token_id,
    )
    assert r.prompt_lens.min() < r.prompt_width  # left padding, to be dropped
    module = teacher(cfg, policy, Scoring(cfg, policy), path=str(digit_teacher))
    assert not any(p.requires_grad for p in module.parameters())
    got = module.attach(SimpleNamespace(rollout=r))["teacher_logprobs"]
    want = reference_teacher_logprobs(digit_teacher, r)
    m = r.generated_mask
    assert got.dtype == torch.float32 and got.shape == m.shape
    assert bool((got[~m] == 0).all())
    # float32 against float64 through 2 layers of C = 64: rounding ~1e-6; a wrong position or
    # model would be off by ~1
    torch.testing.assert_close(got[m].double(), want[m], rtol=0, atol=1e-4)
    # the student's own log-probs differ: the teacher is another model
    assert (got[m] - r.logprobs[m]).abs().max() > 0.5


def test_distillation_from_the_config_lowers_the_reverse_kl(
    shared_tiny_model, digit_teacher, tmp_path
):
    """configs/distill_tiny.yaml (rewards: [], the teacher module, loss.advantage: distill) on
    the tiny model: the reverse KL to the teacher on the step's samples (advantage/reverse_kl)
    falls, the health check never calls it solved (every reward is 0 = its maximum) nor stops it
    (train.stop_on_stall); its metadata and checkpoints identify the teacher; a resume with
    other teacher weights is refused."""
    import shutil

    from grpo.train.grpo import train_grpo

    out, teacher_dir = tmp_path / "run", tmp_path / "teacher"
    shutil.copytree(digit_teacher, teacher_dir)
    cfg = distill_cfg(
        shared_tiny_model,
        teacher_dir,
        out,
        "train.max_steps=10",
        "rollout.max_new_tokens=8",
        "train.stall_steps=3",
        "train.stop_on_stall=true",
        "train.save_every=5",
    )
    assert cfg.rewards == () and cfg.loss.advantage == "distill"
    summary = train_grpo(cfg)
    assert summary["step"] == 10 and "converged" not in summary and summary["health"] == {}
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    kl = [r["advantage/reverse_kl"] for r in recs if "advantage/reverse_kl" in r]
    assert len(kl) == 10 and all(r["rollout/reward_mean"] == 0 for r in recs if "step" in r)
    # seen here: 1.33, 1.48, 1.36, ... 0.37, 0.14, 0.13 (the student puts its mass on the digits)
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:3]) / 3, kl
    # the teacher in the run's metadata and in the checkpoint; nothing of it trains
    header = recs[0]["run/modules"]
    assert header.startswith("teacher (grpo.modules.teacher.Teacher, frozen, path=")
    ident = json.loads((out / "checkpoints/step_000005/modules/teacher/identity.json").read_text())
    assert ident["path"] == str(teacher_dir) and f"sha256={ident['sha256']}" in header
    assert not (out / "checkpoints/step_000005/modules/teacher/optimizer.pt").exists()
    assert not any(k.startswith("module/teacher/") for r in recs for k in r)
    # other weights at the teacher's path: a resume is refused, naming the module and hashes
    model = load_model(teacher_dir)
    with torch.no_grad():
        model.norm.weight.mul_(2)
    save_pretrained(model, teacher_dir)
    later = distill_cfg(shared_tiny_model, teacher_dir, out, "train.max_steps=11")
    with pytest.raises(GrpoError, match=rf"module 'teacher' was run with sha256={ident['sha256']}"):
        train_grpo(later, resume=True)


def test_no_rewards_needs_an_estimator_that_reads_none(shared_tiny_model, tmp_path):
    tiny = REPO / "configs" / "tiny_ci.yaml"
    with pytest.raises(ConfigError) as e:
        check_config(load_config(tiny, ["model.path=m", "rewards=[]"]), "grpo")
    assert str(e.value).startswith("rewards: [] leaves loss.advantage 'grpo' nothing to learn")
    assert "\n" not in str(e.value) and e.value.field == "rewards"
    ok = load_config(tiny, ["model.path=m", "rewards=[]", "loss.advantage=distill"])
    assert check_config(ok, "grpo").rewards == ()
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling drops groups"):
        check_config(
            load_config(
                tiny,
                [
                    "model.path=m",
                    "rewards=[]",
                    "loss.advantage=distill",
                    "rollout.dynamic_sampling=true",
                ],
            ),
            "grpo",
        )


def test_a_teacher_with_another_vocabulary_is_refused(shared_tiny_model, tiny_checkpoints):
    cfg = distill_cfg(shared_tiny_model, tiny_checkpoints("qwen3"), "unused")
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    with pytest.raises(GrpoError) as e:
        teacher(cfg, policy, Scoring(cfg, policy), path=str(tiny_checkpoints("qwen3")))
    msg = str(e.value)
    assert msg.startswith("modules[teacher].kwargs.path: ") and "\n" not in msg
    assert "policy's tokenizer" in msg


def test_a_trainable_module_without_parameters_is_refused_a_frozen_scorer_is_not(
    shared_tiny_model,
):
    """ModuleSet: a TrainedModule with nothing to train is named (and pointed at FrozenScorer);
    a FrozenScorer gets no optimizer, and an `optim` section for it is refused."""
    from grpo.distributed import SINGLE
    from grpo.modules import FrozenScorer, TrainedModule
    from grpo.modules.base import TRAINED_MODULES
    from grpo.modules.module_set import ModuleSet

    class Empty(TrainedModule):
        pass

    class Constant(FrozenScorer):
        def attach(self, batch):
            return {"one": torch.ones(batch.size)}

    TRAINED_MODULES._fns["test_empty"] = lambda: Empty()
    TRAINED_MODULES._fns["test_constant"] = lambda: Constant()
    try:
        base = ["model.path=" + str(shared_tiny_model)]
        cfg = load_config(None, [*base, "modules=[{name: test_empty}]"])
        policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
        with pytest.raises(GrpoError, match="has no trainable parameters .*FrozenScorer"):
            ModuleSet(cfg, policy, SINGLE, torch.device("cpu"), 1)
        cfg = load_config(None, [*base, "modules=[{name: test_constant}]"])
        modules = ModuleSet(cfg, policy, SINGLE, torch.device("cpu"), 1)
        assert modules.items[0].frozen and modules.step(None, None) == {}
        cfg = load_config(None, [*base, "modules=[{name: test_constant, optim: {lr: 0.1}}]"])
        with pytest.raises(GrpoError, match=r"modules\[0\].optim: 'test_constant' is a frozen"):
            ModuleSet(cfg, policy, SINGLE, torch.device("cpu"), 1)
    finally:
        del TRAINED_MODULES._fns["test_empty"], TRAINED_MODULES._fns["test_constant"]


def test_the_docs_frozen_scorer_saves_and_restores_its_state(
    shared_tiny_model, tmp_path, monkeypatch
):
    """docs/extending.md's RunningBaseline (a FrozenScorer with state): no optimizer, no
    trainable parameter; its state in the checkpoint (no optimizer or schedule files), back on
    load into a fresh module; the metadata names it frozen."""
    import sys

    from conftest import docs_example, write_package

    from grpo.distributed import SINGLE
    from grpo.modules.module_set import ModuleSet

    write_package(tmp_path, {"frozen.py": docs_example("# my_pkg/frozen.py")})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_pkg", raising=False)
    monkeypatch.delitem(sys.modules, "my_pkg.frozen", raising=False)
    spec = "modules=[{name: my_pkg.frozen:RunningBaseline, kwargs: {momentum: 0.5}}]"
    cfg = check_config(load_config(None, [f"model.path={shared_tiny_model}", spec]), "grpo")
    policy = build_policy(cfg, torch.device("cpu"), need_ref=False)
    modules = ModuleSet(cfg, policy, SINGLE, torch.device("cpu"), 2)
    assert modules.header()["run/modules"] == (
        "RunningBaseline (my_pkg.frozen.RunningBaseline, frozen)"
    )
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Batch:  # what the scorer reads of a RolloutBatch
        size: int
        rewards: torch.Tensor
        extras: dict

    batch = Batch(2, torch.tensor([1.0, 3.0]), {})
    first = modules.attach(batch).extras["baseline"]
    second = modules.attach(batch).extras["baseline"]
    assert first.tolist() == [0.0, 0.0] and second.tolist() == [1.0, 1.0]  # 0.5 * 0 + 0.5 * 2
    modules.save(tmp_path / "ckpt")
    saved = tmp_path / "ckpt" / "modules" / "RunningBaseline"
    assert {p.name for p in saved.iterdir()} == {"weights.safetensors", "identity.json"}
    fresh = ModuleSet(cfg, policy, SINGLE, torch.device("cpu"), 2)
    fresh.load(tmp_path / "ckpt")
    assert fresh.attach(batch).extras["baseline"].tolist() == [1.5, 1.5]  # 0.5 * 1 + 0.5 * 2


@pytest.mark.parametrize("name", ["gae", "distill"])
def test_an_estimator_missing_its_extra_names_the_module_to_add(name):
    """gae reads a critic's values and distill a teacher's log-probs from the batch's extras:
    without them (or with the wrong shape) one line names the extra and the module to add."""
    from grpo.algo.advantages import ADVANTAGES, EstimatorRollout

    mask = torch.ones(2, 3, dtype=torch.bool)
    zeros = torch.zeros(2, 3)

    def rollout(**extras):
        ids = torch.zeros(2, 3, dtype=torch.long)
        return EstimatorRollout(ids, mask, mask, ids, zeros, torch.ones(2), extras)

    key, module = ("values", "critic") if name == "gae" else ("teacher_logprobs", "teacher")
    inputs = {"token_rewards": zeros, "scores": torch.zeros(2), "mask": mask, "group_size": 2}
    inputs |= {"gamma": 1.0, "gae_lambda": 1.0, "eps": 1e-6}
    with pytest.raises(GrpoError, match=rf"{name} reads .*'{key}'; extras here: none.*{module}"):
        ADVANTAGES.call(name, {**inputs, "rollout": rollout()})
    with pytest.raises(GrpoError, match=rf"extras\['{key}'\] has shape \(2, 1\), expected"):
        ADVANTAGES.call(name, {**inputs, "rollout": rollout(**{key: torch.zeros(2, 1)})})
