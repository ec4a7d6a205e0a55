"""Smoke test of benchmarks/bench_multiturn.py: both multi-turn paths, same greedy streams."""

import json

from benchmarks import bench_multiturn as bm
from grpo.rollout import Sampler


def small_workload(vocab_size: int, turns: int = 3):
    return bm.build_workload(
        vocab_size, prompts=2, group_size=2, prompt_len=8, turns=turns, turn_len=4, obs_len=3
    )


def test_kv_continuation_and_reprefill_give_identical_greedy_streams():
    sampler = Sampler(bm.build_model("tiny"))  # L=2, C=64, V=256
    w = small_workload(sampler.model.config.vocab_size)
    ours, baseline = bm.run_ours(sampler, w), bm.run_baseline(sampler, w)
    assert len(ours) == w.rows == 4
    assert all(len(s) == 3 * 4 + 2 * 3 for s in ours)  # 3 turns of 4 tokens, 2 observations
    assert ours[0][4:7] == w.obs_ids  # the observation sits after the first turn
    assert bm.first_mismatch(ours, baseline, w) is None
    assert bm.check_streams(sampler, w) is None

    changed = [list(s) for s in baseline]
    changed[1][5] += 1  # row 1, second observation token
    msg = bm.first_mismatch(ours, changed, w)
    assert msg is not None and msg.startswith("row 1, stream position 5 (turn 1, observation)")


def test_main_writes_table_and_json(tmp_path):
    bm.main(
        [
            "--sizes",
            "tiny",
            "--turns",
            "2",
            "--prompts",
            "1",
            "--prompt-len",
            "8",
            "--turn-len",
            "4",
            "--obs-len",
            "3",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--out-dir",
            str(tmp_path),
            "--name",
            "mt",
        ]
    )
    payload = json.loads((tmp_path / "mt.json").read_text())
    rows = {r["impl"]: r for r in payload["rows"]}
    assert set(rows) == {"baseline", "ours"} and rows["ours"]["streams_equal"]
    assert rows["ours"]["speedup"] > 0 and rows["ours"]["generated_tokens"] == 2 * 2 * 4
    assert payload["env"]["git_sha"] and (tmp_path / "mt.md").exists()
