"""`grpo rm`: the Bradley-Terry loss against float64 by hand, pair accuracy rising on a
separable toy set, the exported checkpoint scoring alike in transformers, exact resume, and
2 torchrun ranks (DDP and FSDP2) equal to one process on the same pairs."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.config import load_config
from grpo.train.rm import pair_loss, train_rm

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["apple", "river", "stone", "cloud", "green", "seven", "light", "table", "music"]


def toy_pairs(n: int, seed: int) -> list[dict]:
    """Separable pairs: the chosen answer ends 'good', the rejected one 'bad', after the same
    random words; a margin on some rows."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        row = {
            "prompt": f"Question {i}: {words}?",
            "chosen": f" {words} good",
            "rejected": f" {words} bad",
        }
        if i % 3 == 0:
            row["margin"] = 0.5
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_config(model: Path, data: Path, out: Path, *overrides: str):
    base = {"model": {"path": str(model), "device": "cpu"}, "data": {"dataset": str(data)}}
    return load_config(
        base=base,
        overrides=[
            "data.split=train[:48]",
            "data.eval_split=train[48:]",
            "data.eval_samples=16",
            "train.batch_size=8",
            "train.max_steps=40",
            "train.log_every=1",
            "train.eval_every=20",
            "train.progress=false",
            "optim.lr=3e-3",
            "optim.warmup_ratio=0",
            "lora.rank=8",
            f"train.output_dir={out}",
            "rm.max_length=64",
            *overrides,
        ],
    )


def test_pair_loss_against_float64_by_hand():
    rc = [1.5, -0.25, 0.0, 2.0]
    rr = [0.5, 0.75, 0.0, -3.0]
    m = [0.0, 0.5, 1.0, 0.25]
    coef = 0.1

    def by_hand(c, r, mm):  # -log(1 / (1 + exp(-(c - r - m)))) + coef (c + r)^2
        return math.log1p(math.exp(-(c - r - mm))) + coef * (c + r) ** 2

    got = pair_loss(
        torch.tensor(rc, dtype=torch.float64),
        torch.tensor(rr, dtype=torch.float64),
        torch.tensor(m, dtype=torch.float64),
        coef,
    )
    want = [by_hand(c, r, mm) for c, r, mm in zip(rc, rr, m)]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-15)
    plain = pair_loss(torch.tensor(rc, dtype=torch.float64), torch.tensor(rr, dtype=torch.float64))
    assert plain.tolist() == pytest.approx(
        [math.log1p(math.exp(r - c)) for c, r in zip(rc, rr)], rel=1e-12
    )


def test_pair_accuracy_rises_and_the_export_scores_alike(shared_tiny_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = write_jsonl(tmp_path / "pairs.jsonl", toy_pairs(64, 0))
    seen = {}
    cfg = rm_config(shared_tiny_model, data, tmp_path / "run")
    summary = train_rm(cfg, on_step=lambda step, m: seen.update({step: m}))
    first, last = seen[1], seen[40]
    assert first["train/accuracy"] == 0.0  # a zero head: every pair tied
    # every score 0: a pair's loss is log(1 + e^m), m = 0 or 0.5 (k of the 8 pairs)
    k = (8 * first["train/loss"] - 8 * math.log(2)) / (math.log1p(math.exp(0.5)) - math.log(2))
    assert k == pytest.approx(round(k), abs=1e-4) and 0 <= round(k) <= 8
    assert last["eval/accuracy"] >= 0.95 and seen[20]["eval/accuracy"] > 0.5
    assert last["eval/loss"] < 0.3 * math.log(2)
    final = Path(summary["final"])
    cfg_json = json.loads((final / "config.json").read_text())
    assert cfg_json["architectures"] == ["Qwen3ForSequenceClassification"]
    # transformers reads final/ and scores the held-out pairs as the trainer's evaluation did
    from grpo.data.preferences import load_preference_rows, preference_pairs
    from grpo.tokenizer import load_tokenizer

    tok = load_tokenizer(final)
    pairs, _ = preference_pairs(load_preference_rows(str(data), "train[48:]"), tok, 64)
    hf = AutoModelForSequenceClassification.from_pretrained(str(final), dtype=torch.float32)
    correct = 0
    for p in pairs:
        c = hf(input_ids=torch.tensor([p.prompt_ids + p.chosen_ids])).logits[0, 0]
        r = hf(input_ids=torch.tensor([p.prompt_ids + p.rejected_ids])).logits[0, 0]
        correct += int(c > r)
    assert correct / len(pairs) == pytest.approx(last["eval/accuracy"])


def test_resume_is_exact(shared_tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", toy_pairs(64, 1))
    straight = train_rm(
        rm_config(
            shared_tiny_model, data, tmp_path / "a", "train.max_steps=4", "data.eval_samples=0"
        )
    )
    cut = rm_config(
        shared_tiny_model,
        data,
        tmp_path / "b",
        "train.max_steps=4",
        "train.save_every=2",
        "data.eval_samples=0",
    )
    stop = {}

    def interrupt(step, metrics):
        if step == 3:  # after step 2's checkpoint
            stop["at"] = step
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_rm(cut, on_step=interrupt)
    resumed = train_rm(cut, resume=True)
    a = load_file(Path(straight["final"]) / "model.safetensors")
    b = load_file(Path(resumed["final"]) / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.process
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_equal_one_process(shared_tiny_model, tmp_path, parallel):
    data = write_jsonl(tmp_path / "pairs.jsonl", toy_pairs(32, 2))
    common = [
        f"model.path={shared_tiny_model}",
        f"data.dataset={data}",
        "model.device=cpu",
        "data.eval_samples=8",
        "data.eval_split=train[24:]",
        "data.split=train[:24]",
        "train.max_steps=2",
        "train.progress=false",
        "optim.lr=1e-2",
        "lora.rank=4",
        "optim.eps=1.0",  # an update linear in the gradient (tests/ddp_worker.py's EPS)
        "rm.max_length=64",
        "rm.center_coef=0.01",
        "train.micro_batch_size=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(out: str, ranks: int, *extra: str) -> Path:
        launch = (
            [sys.executable, "-m", "grpo"]
            if ranks == 1
            else [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                "-m",
                "grpo",
            ]
        )
        cmd = [
            *launch,
            "rm",
            "--config",
            str(ROOT / "configs" / "tiny_ci.yaml"),
            *common,
            f"train.output_dir={tmp_path / out}",
            *extra,
        ]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return tmp_path / out

    one = run("one", 1, "train.batch_size=8")
    two = run("two", 2, "train.batch_size=4", f"train.parallel={parallel}")
    a = load_file(one / "final" / "model.safetensors")
    b = load_file(two / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    ma = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip([r for r in ma if "train/loss" in r], [r for r in mb if "train/loss" in r]):
        for key in ("train/loss", "train/accuracy", "train/margin", "eval/loss", "eval/accuracy"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), key


def test_a_pad_id_outside_the_vocabulary_is_one_line_before_loading(shared_tiny_model, tmp_path):
    """rm.pad_token_id past the model's vocabulary: refused by the checks `grpo rm` runs
    before anything loads, naming the setting (it was a 59-line IndexError at the first
    forward)."""
    from grpo.run.preflight import PreflightError
    from grpo.train.rm import check_rm

    data = write_jsonl(tmp_path / "pairs.jsonl", toy_pairs(8, 0))
    cfg = rm_config(shared_tiny_model, data, tmp_path / "out", "rm.pad_token_id=1000000")
    with pytest.raises(PreflightError, match=r"rm.pad_token_id: 1000000 is not a token"):
        check_rm(cfg)
    check_rm(rm_config(shared_tiny_model, data, tmp_path / "out", "rm.pad_token_id=0"))


def test_a_reward_model_is_not_served_nor_merged_into(shared_tiny_model, tmp_path, capfd):
    """A `grpo rm` output (LoRA run: its config.yaml reads like a policy run's) given to `grpo
    serve` or `grpo merge`: one line saying it is a reward model, what it is for, exit 2. Serving
    said "no adapter_config.json"; merging a policy adapter into it wrote a classifier with the
    policy's deltas, rc 0."""
    from grpo.apps.cli import main
    from grpo.lora import apply_lora, save_adapter
    from grpo.models import load_model

    data = write_jsonl(tmp_path / "pairs.jsonl", toy_pairs(56, 0))
    cfg = rm_config(shared_tiny_model, data, tmp_path / "rm", "train.max_steps=1")
    final = Path(train_rm(cfg)["final"])
    policy = load_model(shared_tiny_model)
    apply_lora(policy, rank=4, alpha=8, targets=["q_proj"], seed=0)
    save_adapter(policy, tmp_path / "adapter", base_model_name_or_path=str(shared_tiny_model))
    capfd.readouterr()
    for model in (tmp_path / "rm", final):
        assert main(["serve", "--model", str(model), "--port", "0"]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "no adapter_config.json" not in err, err
        assert f"{model} is a reward model (Qwen3ForSequenceClassification" in err, err
        assert f"name: reward_model, kwargs: {{path: {final}}}" in err, err
    argv = ["merge", "--model", str(final), "--adapter", str(tmp_path / "adapter")]
    assert main([*argv, "--out", str(tmp_path / "merged")]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and f"--model {final} is a reward model" in err, err
    assert not (tmp_path / "merged").exists()
