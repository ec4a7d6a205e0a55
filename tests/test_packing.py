"""Sequence packing (train.pack_sequences): rows packed on one token axis with no pad token
give the padded forward's log-probs and gradients (fp32, 1e-5), shared prefix on and off,
LoRA and full, single and multi-turn; labels never cross a row boundary; attention costs the
sum of the rows' own squares, not the square of their sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import live_lora
from test_shared_prefix import logprobs_and_grads, multiturn, rollout

from grpo.algo.logprobs import CompletionLogprobs, completion_logprobs
from grpo.distributed import SINGLE
from grpo.models import load_model
from grpo.models.packed_rows import pack_rows, packed_overhead
from grpo.models.varlen import PackedSegments, plan_buckets


def packed_logprobs_and_grads(model, r, shared: bool):
    model.zero_grad(set_to_none=True)
    packed = pack_rows(
        r.attention_mask(),
        r.prompt_width,
        r.generated_mask,
        r.group_size if shared else None,
        packed_overhead(model),
    )
    lp = completion_logprobs(model, r.ids, None, r.prompt_width, None, 0.7, packed=packed)
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)  # the padded test's loss
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads, packed


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("turns", ["single", "multi"])
@pytest.mark.parametrize("shared", [False, True])
def test_packed_equals_padded(tiny_checkpoints, lora, turns, shared):
    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        live_lora(model, ["q_proj", "v_proj", "down_proj"], std=0.05, seed=0)
    r = rollout(model) if turns == "single" else multiturn(model)
    model.train()
    pad_lp, pad_g = logprobs_and_grads(model, r, shared=False, holes=turns == "multi")
    lp, g, packed = packed_logprobs_and_grads(model, r, shared)
    m = r.generated_mask
    assert (lp - pad_lp)[m].abs().max().item() <= 1e-5
    assert (lp[~m] == 0).all()
    assert pad_g.keys() == g.keys() and g
    for n in pad_g:
        scale = pad_g[n].abs().max().clamp(min=1e-12)
        assert ((g[n] - pad_g[n]).abs().max() / scale).item() <= 1e-5, n
    # only real tokens ran: the prompt once per group with a shared prefix
    attn = r.attention_mask()
    real = (
        int(attn.sum())
        if not shared
        else (
            int(attn[:: r.group_size, : r.prompt_width].sum())
            + int(attn[:, r.prompt_width :].sum())
        )
    )
    assert packed.real_tokens == real < attn.numel()


@pytest.mark.parametrize("shared", [False, True])
def test_no_label_crosses_a_row_boundary(tiny_checkpoints, shared):
    """Changing every token of one row (its prompt too, without a shared prefix) leaves the
    next row's log-probs, its first completion token's included, unchanged."""
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model, G=3)
    G, w = r.group_size, r.prompt_width
    attn = r.attention_mask()
    packed = pack_rows(attn, w, r.generated_mask, G if shared else None, packed_overhead(model))
    with torch.no_grad():
        before = completion_logprobs(model, r.ids, None, w, None, packed=packed)
        ids = r.ids.clone()
        prev = G - 1  # the last row of the first group; the next row opens the second group
        cols = slice(w, None) if shared else slice(None)  # a shared prompt is the group's own
        old = ids[prev, cols]
        ids[prev, cols] = torch.where(attn[prev, cols], (old + 7) % 256, old)
        after = completion_logprobs(model, ids, None, w, None, packed=packed)
    m = r.generated_mask
    assert (before[prev] - after[prev])[m[prev]].abs().max() > 1e-3  # the row itself changed
    assert torch.equal(before[prev + 1], after[prev + 1])
    assert torch.equal(before[:prev], after[:prev]) and torch.equal(
        before[prev + 1 :], after[prev + 1 :]
    )


def test_attention_scores_scale_with_each_rows_square():
    """A layout of rows of lengths 3..200: the scores computed are within 1.5x of the sum of
    each row's len x len (plus its prefix), far under the square of the total, and each query
    sees exactly its causal own keys plus its whole prefix (checked against a dense mask)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 200, size=40)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    segs = [(int(s), int(n), 0, 0) for s, n in zip(starts, lens)]
    pos = np.concatenate([np.arange(n) for n in lens])
    layout = PackedSegments(segs, pos, overhead=256)
    own = int((lens * lens).sum())
    assert own <= layout.score_elements <= 1.5 * own
    assert layout.score_elements < lens.sum() ** 2 / 10
    # a prefix layout: 2 prompts of 5 and 9, each with 3 completions
    segs = [
        (0, 5, 0, 0),
        (5, 9, 0, 0),
        (14, 4, 0, 5),
        (18, 1, 0, 5),
        (19, 6, 0, 5),
        (25, 2, 5, 9),
        (27, 7, 5, 9),
        (34, 3, 5, 9),
    ]
    N = 37
    layout = PackedSegments(segs, np.zeros(N, dtype=np.int64), overhead=1)
    dense = np.zeros((N, N), dtype=bool)
    for s, n, p0, pn in segs:
        for t in range(n):
            dense[s + t, p0 : p0 + pn] = True
            dense[s + t, s : s + t + 1] = True
    seen = np.zeros((N, N), dtype=bool)
    for bk in layout.buckets:
        keep = bk.keep[:, 0].numpy()  # (b, T, S)
        b, T, S = keep.shape
        q, k = bk.q_index.view(b, T).numpy(), bk.k_index.view(b, S).numpy()
        valid = set(bk.valid.tolist())
        for i in range(b):
            for t in range(T):
                if i * T + t in valid:
                    seen[q[i, t], k[i][keep[i, t]]] = True
    assert (seen == dense).all()


def test_buckets_trade_padding_against_calls():
    """Equal lengths take one bucket; with a large per-call cost everything is one bucket;
    with none, each distinct length is its own."""
    lens = np.array([50, 50, 50, 50])
    assert len(plan_buckets(lens, lens, 100)) == 1
    lens = np.array([100, 60, 30, 10])
    assert len(plan_buckets(lens, lens, 10**9)) == 1
    assert len(plan_buckets(lens, lens, 0)) == 4
    assert sorted(np.concatenate(plan_buckets(lens, lens, 500)).tolist()) == [0, 1, 2, 3]


def test_packed_under_bf16_autocast_matches_padded(tiny_checkpoints):
    """The precision path a GPU run takes: bf16 autocast, packed vs padded within the bf16
    error budget of the same-dtype padded forward against fp32."""
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    m = r.generated_mask
    packed = pack_rows(r.attention_mask(), r.prompt_width, m, r.group_size, packed_overhead(model))
    with torch.no_grad():
        ref = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width, m)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pad = completion_logprobs(model, r.ids, r.attention_mask(), r.prompt_width, m)
            lp = completion_logprobs(model, r.ids, None, r.prompt_width, None, packed=packed)
    budget = (pad - ref)[m].abs().max().item()
    assert budget > 0
    assert (lp - ref)[m].abs().max().item() <= 2 * budget + 1e-3


def test_bad_layouts_are_refused(tiny_checkpoints):
    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        pack_rows(r.attention_mask(), r.prompt_width, r.generated_mask, 4)
    holes = multiturn(model)  # holes between turns are no real token
    with pytest.raises(ValueError, match="not a real token"):
        every = torch.ones_like(holes.completion_mask)
        pack_rows(holes.attention_mask(), holes.prompt_width, every)
    # a row with no prompt token: its first token's predictor would be the previous row's
    attn = torch.tensor([[True, True, True, True], [False, False, True, True]])
    for groups in (None, 1):
        with pytest.raises(ValueError, match="a row with scored tokens has an empty prompt"):
            pack_rows(attn, 2, attn[:, 2:], groups)
    packed = pack_rows(r.attention_mask(), r.prompt_width, r.generated_mask)
    with pytest.raises(ValueError, match="packed layout is of 9 rows"):
        completion_logprobs(model, r.ids[:3], None, r.prompt_width, None, packed=packed)


def update_weights(
    tiny_checkpoints, tmp_path, overrides, lora=True, turns="single", checkpointing=False
):
    """The trainable weights after step_batch + update_phase on one fixed 9-row rollout (3
    prompts x 3, or multi-turn 3 x 2) from the same start, as configured."""
    from grpo.config import load_config
    from grpo.experience.batch import RolloutBatch, outcome_token_rewards, turn_token_rewards
    from grpo.lora import apply_lora
    from grpo.policy import Policy
    from grpo.run.optim import build_optimizer, build_scheduler
    from grpo.train.grpo import step_batch, update_phase

    model = load_model(tiny_checkpoints("qwen3"))
    if lora:
        apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=0)
    model.gradient_checkpointing = checkpointing  # what build_policy sets from the config
    r = rollout(model) if turns == "single" else multiturn(model, G=3)
    B, G = r.ids.shape[0], r.group_size
    rewards = torch.randn(B, generator=torch.Generator().manual_seed(0))
    multi = ["loss.advantage=grpo_turn", "rollout.turn_discount=0.9"] if turns == "multi" else []
    cfg = load_config(
        base={"model": {"path": str(tmp_path)}},
        overrides=[
            f"train.batch_size={B}",
            f"rollout.group_size={G}",
            "rollout.temperature=0.7",
            "loss.num_iterations=2",
            "loss.beta=0.04",
            "optim.lr=1e-3",
            *multi,
            *overrides,
            # Adam's first step is about g / (|g| + eps): a gradient near eps (full weights: rows
            # of tokens barely used), whose last bits depend on the summation order, moves its
            # weight by a visible fraction of lr either way; eps 1e-6 bounds that (ddp_worker.py)
            "optim.eps=1e-6",
        ],
    )
    policy = Policy(model, None, [3], None, tmp_path, lora=lora)
    token = (
        turn_token_rewards(rewards, r, 0.9)
        if turns == "multi"
        else outcome_token_rewards(rewards, r.completion_mask)
    )
    batch = RolloutBatch(
        rollout=r,
        rows=[{}] * B,
        texts=[""] * B,
        rewards=rewards,
        token_rewards=token,
        per_fn={},
        policy_version=0,
        frac_zero_std=0.0,
    )
    inputs = step_batch(cfg, policy, batch, step=1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)
    stats = update_phase(cfg, policy, inputs, opt, build_scheduler(opt, 10, cfg.optim), params)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return weights, stats, inputs


def assert_same_update(a, b, tol=1e-6):
    assert a.keys() == b.keys() and a
    for n in a:
        assert (a[n] - b[n]).abs().max().item() <= tol, n


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
)
@pytest.mark.parametrize("shared", ["on", "off"])
def test_packed_update_equals_padded(tiny_checkpoints, tmp_path, aggregation, shared):
    """A whole step (reference log-probs, advantages, mu = 2 updates with KL, micro-batches
    of one group) moves the LoRA weights the same packed and padded, for every aggregation,
    and reports the same loss and on-policy numbers."""
    common = [
        f"loss.aggregation={aggregation}",
        f"train.shared_prefix={shared}",
        "train.micro_batch_size=3",
    ]
    padded, s_pad, i_pad = update_weights(
        tiny_checkpoints, tmp_path, [*common, "train.pack_sequences=off"]
    )
    packed, s_pack, i_pack = update_weights(
        tiny_checkpoints, tmp_path, [*common, "train.pack_sequences=on"]
    )
    assert all(mb.packed is None for mb in i_pad.plan)
    assert all(mb.packed is not None for mb in i_pack.plan)
    m = i_pad.counted_mask
    assert (i_pack.ref_logprobs - i_pad.ref_logprobs)[m].abs().max().item() <= 1e-5
    assert_same_update(padded, packed)
    for k in ("train/loss", "train/policy_loss", "train/kl", "rollout/logprob_diff_max"):
        assert s_pack[k] == pytest.approx(s_pad[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize("case", ["full", "multi_turn", "checkpointing"])
def test_packed_update_equals_padded_full_weights_and_turns(tiny_checkpoints, tmp_path, case):
    """Full fine-tuning; multi-turn rows (observation tokens scored by nobody, holes between
    turns); gradient checkpointing (each block recomputed through the same layout)."""
    kw = {
        "lora": case != "full",
        "turns": "multi" if case == "multi_turn" else "single",
        "checkpointing": case == "checkpointing",
    }
    runs = {}
    for mode in ("off", "on"):
        over = [f"train.pack_sequences={mode}", "train.micro_batch_size=3"]
        runs[mode] = update_weights(tiny_checkpoints, tmp_path, over, **kw)[0]
    # full weights: Adam normalizes each gradient entry, so an embedding row a token barely
    # touches (gradient ~1e-7, its last bits summed in another order) moves by ~1e-3 of lr
    # differently; the gradients themselves agree within 1e-5 (test_packed_equals_padded)
    assert_same_update(runs["off"], runs["on"], tol=5e-6 if case == "full" else 1e-6)


def test_micro_batch_tokens_equal_row_micro_batches(tiny_checkpoints, tmp_path):
    """Micro-batches cut by tokens (uneven rows per micro-batch) give the update of
    micro-batches cut by rows: the loss normalizers do not depend on the cut."""
    off = "train.shared_prefix=off"
    rows, _, _ = update_weights(tiny_checkpoints, tmp_path, ["train.micro_batch_size=3", off])
    toks, _, i_toks = update_weights(
        tiny_checkpoints, tmp_path, ["train.micro_batch_tokens=24", off]
    )
    sizes = [mb.rows.stop - mb.rows.start for mb in i_toks.plan]
    assert sum(sizes) == 9 and len(set(sizes)) > 1  # not the row cut
    assert all(mb.packed.real_tokens <= 24 for mb in i_toks.plan)
    assert_same_update(rows, toks)


def test_token_slices_cut_even_and_within_budget(caplog):
    """Hand-checked cuts: the fewest micro-batches under the budget, the largest as small as
    it can be, a forced count split at the middle of the heaviest, a unit over the budget alone
    with one log line naming both numbers."""
    import logging

    from grpo.experience.batch import micro_batch_count, token_slices

    assert micro_batch_count([10] * 8, 40) == 2
    assert token_slices([10] * 8, 40) == [slice(0, 4), slice(4, 8)]
    # 3 slices of [10]*8 under 40: the greedy at cap 30 gives 30/30/20 (not 40/40/0)
    assert token_slices([10] * 8, 40, count=3) == [slice(0, 3), slice(3, 6), slice(6, 8)]
    costs = [5, 100, 3, 3, 40, 40, 7, 1, 1]
    with caplog.at_level(logging.INFO, logger="grpo.experience.batch"):
        cuts = token_slices(costs, 64)
    assert cuts == [slice(0, 1), slice(1, 2), slice(2, 5), slice(5, 9)]
    assert "a row of 100 tokens exceeds train.micro_batch_tokens (64)" in caplog.text
    assert token_slices(costs, 64, count=9) == [slice(i, i + 1) for i in range(9)]
    with pytest.raises(ValueError, match="cannot cut 3 rows into 4"):
        token_slices([1, 2, 3], 10, count=4)


@pytest.mark.parametrize("budget", [None, 12])
def test_sft_packed_step_equals_padded(tiny_checkpoints, tmp_path, budget):
    """One SFT step (LoRA, micro-batches accumulated) moves the weights the same packed and
    padded; with train.micro_batch_tokens the rows are cut by tokens, same update."""
    from grpo.config import load_config
    from grpo.lora import apply_lora
    from grpo.policy import Policy
    from grpo.run.optim import build_optimizer, build_scheduler
    from grpo.train.sft import sft_slices, sft_update

    g = torch.Generator().manual_seed(1)
    rows = [
        {
            "prompt_ids": torch.randint(4, 250, (2 + i % 3,), generator=g).tolist(),
            "completion_ids": torch.randint(4, 250, (1 + 3 * (i % 4),), generator=g).tolist(),
        }
        for i in range(8)
    ]
    moved = {}
    for mode in ("off", "on"):
        model = load_model(tiny_checkpoints("qwen3"))
        apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=0)
        size = (
            [f"train.micro_batch_tokens={budget}"]
            if budget and mode == "on"
            else ["train.micro_batch_size=2"]
        )
        cfg = load_config(
            base={"model": {"path": str(tmp_path)}},
            overrides=[
                "train.batch_size=8",
                "optim.lr=1e-3",
                f"train.pack_sequences={mode}",
                *size,
            ],
        )
        policy = Policy(model, type("T", (), {"pad_token_id": 0})(), [3], None, tmp_path, lora=True)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(params, cfg.optim)
        scorer = CompletionLogprobs(model)
        if budget and mode == "on":
            cuts = sft_slices(cfg, rows, SINGLE)
            assert len({c.stop - c.start for c in cuts}) > 1  # uneven rows, even tokens
        sched = build_scheduler(opt, 10, cfg.optim)
        total, tokens, _ = sft_update(cfg, policy, scorer, rows, opt, sched, params, SINGLE)
        moved[mode] = (
            {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
            total,
            tokens,
        )
    assert moved["on"][2] == moved["off"][2]
    assert moved["on"][1] == pytest.approx(moved["off"][1], rel=1e-6)
    assert_same_update(moved["off"][0], moved["on"][0])


def test_assign_groups_longest_first_to_the_emptiest_rank():
    """Hand-checked: 10 -> r0, 9 -> r1, 8 -> r1 (9 < 10), 1 -> r0 (10 < 17), 1 -> r0 (11),
    r0 is full (3 groups), 1 -> r1: tokens 12 and 18 (sampled as is: 27 and 3)."""
    from grpo.experience.balance import assign_groups

    assert assign_groups([10, 9, 8, 1, 1, 1], 2) == [[0, 3, 4], [1, 2, 5]]
    assert assign_groups([5, 5, 5, 5], 4) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="5 groups do not split over 2 ranks"):
        assign_groups([1] * 5, 2)


def test_packing_costs_are_recorded_per_device_type_and_decide_auto(monkeypatch, tmp_path):
    """Each device type's bucket cost and packed/padded ratio come with a source; auto packs
    exactly where the recorded ratio is below 1, and a bucket cost decides how many buckets
    the GSM8K spread gets (many on a CPU, one or two on CUDA at Qwen3-0.6B's heads)."""
    from grpo.config import load_config
    from grpo.models import varlen

    for device_type, cost in varlen.PACKING_COSTS.items():
        assert cost.bucket_macs > 0 and cost.source and "benchmarks/results/" in cost.source
        want = cost.packed_vs_padded is not None and cost.packed_vs_padded < 1
        assert varlen.packs_by_default(device_type) == want
    mode = load_config(base={"model": {"path": str(tmp_path)}}).train.pack_sequences  # auto
    assert varlen.packs_sequences(mode, "cpu") and not varlen.packs_sequences(mode, "cuda")
    monkeypatch.setitem(
        varlen.PACKING_COSTS, "cuda", varlen.PackingCost(10**9, 0.8, "a later measurement")
    )
    assert (
        varlen.packs_sequences(mode, "cuda:1")
        and varlen.bucket_overhead(16, 128, "cuda") == 10**9 // 2048
    )
    monkeypatch.undo()
    # 16 rows of the benchmark's GSM8K spread (lognormal, median 90, capped at 256), own
    # prompts of 139 tokens as their prefix spans: buckets at Qwen3-0.6B's heads
    rng = np.random.default_rng(0)
    q = np.clip(rng.lognormal(np.log(90), 0.41, 16), 8, 256).astype(np.int64)
    k = q + 139
    cpu = len(plan_buckets(q, k, varlen.bucket_overhead(16, 128, "cpu")))
    cuda = len(plan_buckets(q, k, varlen.bucket_overhead(16, 128, "cuda")))
    assert cpu >= 8 and cuda <= 2, (cpu, cuda)
    assert varlen.bucket_overhead(16, 128, "xpu") == varlen.bucket_overhead(16, 128, "cpu")


def test_config_says_where_packing_runs(tmp_path):
    """auto packs where it was measured faster (a CPU) and wherever a token budget is set;
    a budget with micro_batch_size, or with packing off, is one line naming the field."""
    from grpo.config import load_config
    from grpo.models.varlen import packs_sequences
    from grpo.settings import ConfigError

    def cfg(*over):
        return load_config(base={"model": {"path": str(tmp_path)}}, overrides=list(over))

    def packs(c, device) -> bool:  # what the trainers ask
        return packs_sequences(c.train.pack_sequences, device, c.train.micro_batch_tokens)

    auto = cfg()
    assert auto.train.pack_sequences == "auto"
    assert packs(auto, "cpu") and not packs(auto, "cuda:0")
    assert packs(cfg("train.micro_batch_tokens=4096"), "cuda")
    assert packs(cfg("train.pack_sequences=on"), "cuda")
    assert not packs(cfg("train.pack_sequences=off"), "cpu")
    assert not packs(auto, "mps")  # nothing measured there: padded
    with pytest.raises(
        ConfigError, match="train.micro_batch_tokens: set it or train.micro_batch_size, not both"
    ):
        cfg("train.micro_batch_tokens=64", "train.micro_batch_size=4")
    with pytest.raises(ConfigError, match="train.micro_batch_tokens: cuts packed"):
        cfg("train.micro_batch_tokens=64", "train.pack_sequences=off")
    with pytest.raises(ConfigError, match="train.micro_batch_tokens: must be > 0"):
        cfg("train.micro_batch_tokens=0")


def test_packed_with_cuda_attention_arrangement(tiny_checkpoints):
    """The arrangement memory-efficient attention needs (grouped key/value heads repeated for a
    masked call, `sdpa_choice.REPEAT`), run on the CPU: packed = padded, forward and gradients."""
    from grpo.models import sdpa_choice

    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    model.train()
    with sdpa_choice.forced(queries=sdpa_choice.REPEAT):
        pad_lp, pad_g = logprobs_and_grads(model, r, shared=False)
        lp, g, _ = packed_logprobs_and_grads(model, r, shared=True)
    m = r.generated_mask
    assert (lp - pad_lp)[m].abs().max().item() <= 1e-5
    for n in pad_g:
        scale = pad_g[n].abs().max().clamp(min=1e-12)
        assert ((g[n] - pad_g[n]).abs().max() / scale).item() <= 1e-5, n


def test_balance_in_one_process_round_trips_and_names_a_bad_row(tiny_checkpoints):
    """One rank: the batch comes back bitwise (through the wire format); a dataset row JSON
    cannot carry is one error naming the setting to turn off."""
    from grpo.errors import GrpoError
    from grpo.experience.balance import balance_ranks
    from grpo.experience.batch import RolloutBatch, outcome_token_rewards

    model = load_model(tiny_checkpoints("qwen3"))
    r = rollout(model)
    rewards = torch.randn(9, generator=torch.Generator().manual_seed(0))
    batch = RolloutBatch(
        rollout=r,
        rows=[{"q": i} for i in range(9)],
        texts=["t"] * 9,
        rewards=rewards,
        token_rewards=outcome_token_rewards(rewards, r.completion_mask),
        per_fn={},
        policy_version=3,
        frac_zero_std=0.0,
    )
    out, moved = balance_ranks(batch, SINGLE, 0)
    assert moved["perf/rank_tokens_max_ratio"] == moved["perf/rank_tokens_max_ratio_before"] == 1
    assert torch.equal(out.rollout.ids, r.ids) and torch.equal(out.rewards, rewards)
    assert out.rows == batch.rows and out.policy_version == 3
    bad = RolloutBatch(**{**batch.__dict__, "rows": [{"q": {1, 2}}] * 9})
    with pytest.raises(GrpoError, match="train.balance_ranks: .*set train.balance_ranks=false"):
        balance_ranks(bad, SINGLE, 0)
