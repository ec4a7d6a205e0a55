"""GRPO step-time split (rollout / reference log-probs / update) and peak memory.

    python -m benchmarks.bench_step                 # tiny models on CPU
    python -m benchmarks.bench_step --sizes demo --repeats 5
    python -m benchmarks.bench_step --sizes qwen3-0.6b --device cuda --out-dir DIR  # gpu_check.sh
    python -m benchmarks.bench_step --lengths gsm8k,uniform --sizes ci,qwen3-0.6b  # packing
    python -m benchmarks.bench_step --reward-model --sizes ci,qwen3-0.6b  # reward-model scoring
    python -m benchmarks.bench_step --critic --sizes ci,qwen3-0.6b  # PPO's step beside GRPO's

Each phase of `grpo.train.grpo` is timed on its own with the shared harness, for LoRA and
full fine-tuning, on tiny random-init Qwen3 models written by `grpo.tiny.make_tiny_model`, or
(`qwen3-0.6b`) a random-init model of Qwen3-0.6B's shape with the same tokenizer
(`benchmarks.models.make_checkpoint`). Results are written after each case, so a run stopped
by a timeout keeps the cases that finished.

`--critic` adds PPO's work on the same rolled-out batch: the critic (`modules: [{name:
critic}]`, a value model of the policy's size on its shared base under LoRA) computing values
(attach), GAE, and its update (loss.num_iterations optimizer steps); `ppo_step_ms` is the GRPO
step plus those, `ppo_vs_grpo` their ratio, with the peak memory of both.

`--lengths` compares the padded and the packed training passes (train.pack_sequences off / on,
reference log-probs + the update, interleaved in one run) on rollouts of controlled lengths:
`gsm8k`, completion lengths drawn from a lognormal fitted to GSM8K's reference solutions
(median 90 tokens, sigma 0.41, clipped to [8, T_c]) with 5% of the rows at the cap, prompts the
real GSM8K questions in the chat template; `uniform`, every prompt and completion of one length
(the mean of the gsm8k draw: no padding at all, packing's worst case); `sft`, one SFT step
(`sft_update`) on the dataset's own worked solutions. It reports the padding share (pad tokens
/ tokens the padded forward runs), both times, their ratio, peak memory and the floor.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness import (
    add_output_args,
    comma_list,
    matmul_ceiling_tflops,
    measure,
    measure_interleaved,
    write_results,
)
from benchmarks.models import DATA, make_checkpoint
from grpo.algo.logprobs import CompletionLogprobs
from grpo.config import load_config
from grpo.distributed import SINGLE
from grpo.experience.batch import RolloutBatch, outcome_token_rewards
from grpo.experience.collect import rollout_phase
from grpo.loading import load_rows
from grpo.policy import build_policy
from grpo.rewards import build_rewards
from grpo.rollout import Rollout, Sampler
from grpo.rollout.sampler import resolve_compile
from grpo.run.optim import build_optimizer, build_scheduler
from grpo.run.state import TrainState
from grpo.tiny import SIZES, make_tiny_model
from grpo.train.grpo import reference_phase, step_batch, update_phase
from grpo.train.sft import sft_update, tokenize_sft

GSM8K_LENGTHS = {"median": 90.0, "sigma": 0.41, "at_cap": 0.05}  # see the module docstring


ALL_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def build_case(
    model_dir: Path, lora: bool, args, shared: str = "off", extra=(), sample: bool = True
) -> dict:
    """Policy, optimizer, sampler and one rolled-out batch (with reference log-probs and
    advantages) for the bench's settings (plus `extra` overrides); `rollout` samples a fresh
    batch. `sample` False: no sampler and no batch."""
    cfg = load_config(
        base={"model": {"path": str(model_dir), "device": args.device}},
        overrides=[
            f"lora.enabled={str(lora).lower()}",
            f"lora.targets=[{getattr(args, 'lora_targets', ALL_TARGETS)}]",
            f"rollout.group_size={args.group_size}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"train.batch_size={args.prompts * args.group_size}",
            f"train.micro_batch_size={args.micro_batch_size}",
            "loss.beta=0.04",
            "data.max_samples=256",
            f"train.shared_prefix={shared}",
            *DATA[args.data],
            f"rollout.compile={getattr(args, 'rollout_compile', 'auto')}",
            *getattr(args, "overrides", ()),
            *extra,
        ],
    )
    device = torch.device(args.device)
    policy = build_policy(cfg, device, need_ref=True)
    rows = load_rows(cfg.data, cfg.data.split, 256, "rl", policy.tokenizer)
    rewards = build_rewards([{"name": "accuracy"}])
    params = policy.trainable_parameters()
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 1000, cfg.optim)
    if not sample:
        return dict(cfg=cfg, policy=policy, rows=rows, params=params, opt=opt, sched=sched)
    sampler = Sampler(
        policy.model, compile=resolve_compile(cfg.rollout.compile, device), fallback=True
    )  # what `grpo train` builds (rollout.compile: auto)
    state = TrainState()
    step = [0]

    def rollout():
        step[0] += 1
        return rollout_phase(cfg, policy, sampler, rows, state, rewards, step[0])

    batch = step_batch(cfg, policy, rollout())  # reference log-probs, advantages
    return dict(
        cfg=cfg,
        policy=policy,
        rows=rows,
        params=params,
        opt=opt,
        sched=sched,
        sampler=sampler,
        rollout=rollout,
        batch=batch,
    )


def bench_case(model_dir: Path, size: str, lora: bool, args, shared: str = "off") -> dict:
    case = build_case(model_dir, lora, args, shared)
    cfg, policy, batch, rollout = case["cfg"], case["policy"], case["batch"], case["rollout"]
    opt, sched, params = case["opt"], case["sched"], case["params"]
    device = torch.device(args.device)
    t_roll = measure(rollout, warmup=1, repeats=args.repeats, device=device)
    ref = lambda: reference_phase(cfg, policy, batch.rollout, batch.counted_mask, batch.plan)  # noqa: E731
    t_ref = measure(ref, repeats=args.repeats, device=device)
    t_upd = measure(
        lambda: update_phase(cfg, policy, batch, opt, sched, params),
        warmup=1,
        repeats=args.repeats,
        device=device,
    )
    tokens = int(batch.rollout.completion_mask.sum())
    total = t_roll.median_ms + t_ref.median_ms + t_upd.median_ms
    scoring = {}
    if args.reward_model:
        scoring = reward_model_case(model_dir, case, t_roll.median_ms, args)
    peak = max(t_roll.peak_mem_mib, t_ref.peak_mem_mib, t_upd.peak_mem_mib)
    if args.critic:  # PPO's peak: the GRPO phases' and the critic's
        scoring.update(critic_case(case, total, args))
        scoring["ppo_peak_mem_mib"] = max(scoring["ppo_peak_mem_mib"], round(peak, 1))
    return {
        "size": size,
        "mode": "lora r16" if lora else "full",
        "shared_prefix": shared,
        "prompt_len": round(float(batch.rollout.prompt_lens.float().mean()), 1),
        "trainable_params": sum(p.numel() for p in params),
        "rollout_ms": round(t_roll.median_ms, 1),
        "ref_logprob_ms": round(t_ref.median_ms, 1),
        "update_ms": round(t_upd.median_ms, 1),
        "step_ms": round(total, 1),
        "rollout_frac": round(t_roll.median_ms / total, 3),
        "tokens_per_s": round(tokens / (total / 1e3), 1),
        "peak_mem_mib": round(peak, 1),
        "spread_ms": f"{t_upd.p20_ms:.0f}-{t_upd.p80_ms:.0f}",
        **scoring,
    }


def reward_model_case(model_dir: Path, case: dict, rollout_ms: float, args) -> dict:
    """--reward-model: the `reward_model` reward scoring the case's rolled-out rows with a
    classifier of the policy's own size (its checkpoint, a random score head), timed like the
    phases: rows/s and its time over the rollout's (the rollout phase already includes the
    rule rewards)."""
    from grpo.models import load_model
    from grpo.precision import Precision
    from grpo.rewards.model import score_completions

    cfg, policy, batch = case["cfg"], case["policy"], case["rollout"]()  # rows and texts
    device = torch.device(args.device)
    rm = load_model(
        model_dir, cfg.model.dtype, device, num_labels=1, pad_token_id=policy.tokenizer.pad_token_id
    )
    with torch.no_grad():
        rm.score.weight.normal_(0, 0.02, generator=torch.Generator(device).manual_seed(0))
    rm.requires_grad_(False)
    questions = [r["question"] for r in batch.rows]
    precision = Precision.from_config(cfg.model, training=False)
    t = measure(
        lambda: score_completions(
            rm, policy.tokenizer, questions, batch.texts, args.rm_batch_size, 1024, None, precision
        ),
        warmup=1,
        repeats=args.repeats,
        device=device,
    )
    return {
        "rm_score_ms": round(t.median_ms, 1),
        "rm_rows_per_s": round(len(questions) / (t.median_ms / 1e3), 1),
        "rm_vs_rollout": round(t.median_ms / rollout_ms, 3),
    }


def critic_case(case: dict, grpo_step_ms: float, args) -> dict:
    """--critic: PPO's extra work on a rolled-out batch of the case: the critic's values
    (`attach`), the step's phases with the `gae` estimator, and the critic's update."""
    import dataclasses

    from grpo.config import ModuleConfig
    from grpo.modules.module_set import ModuleSet

    cfg, policy = case["cfg"], case["policy"]
    device = torch.device(args.device)
    ppo = dataclasses.replace(
        cfg,
        loss=dataclasses.replace(cfg.loss, advantage="gae"),
        modules=(ModuleConfig(name="critic"),),
    )
    modules = ModuleSet(ppo.check_grpo(), policy, SINGLE, device, 1000)
    batch = case["rollout"]()
    t_attach = measure(lambda: modules.attach(batch), warmup=1, repeats=args.repeats, device=device)
    batch = modules.attach(batch)
    inputs = step_batch(ppo, policy, batch)  # reference log-probs, GAE
    t_fit = measure(
        lambda: modules.step(batch, inputs), warmup=1, repeats=args.repeats, device=device
    )
    ppo_ms = grpo_step_ms + t_attach.median_ms + t_fit.median_ms
    return {
        "critic_values_ms": round(t_attach.median_ms, 1),
        "critic_update_ms": round(t_fit.median_ms, 1),
        "ppo_step_ms": round(ppo_ms, 1),
        "ppo_vs_grpo": round(ppo_ms / grpo_step_ms, 3),
        "ppo_peak_mem_mib": round(max(t_attach.peak_mem_mib, t_fit.peak_mem_mib), 1),
    }


def controlled_rollout(
    prompts: list[list[int]],
    G: int,
    T_c: int,
    spread: str,
    vocab: int,
    eos: int,
    device,
    seed: int = 0,
) -> Rollout:
    """A rollout of P prompts x G completions of random tokens whose lengths follow `spread`
    (module docstring); rows below the cap end in `eos` (finished)."""
    rng = np.random.default_rng(seed)
    B = len(prompts) * G
    if spread == "gsm8k":
        lens = gsm8k_lengths(rng, B, T_c)
    else:  # uniform: prompts cut to one length, completions the gsm8k draw's mean
        n = min(len(p) for p in prompts)
        prompts = [p[-n:] for p in prompts]
        lens = np.full(B, round(gsm8k_lengths(np.random.default_rng(1), 100_000, T_c).mean()))
    T_p = max(len(p) for p in prompts)
    ids = torch.zeros(B, T_p + T_c, dtype=torch.long)
    cmask = torch.zeros(B, T_c, dtype=torch.bool)
    for b in range(B):
        p, n = prompts[b // G], int(lens[b])
        ids[b, T_p - len(p) : T_p] = torch.tensor(p)
        ids[b, T_p : T_p + n] = torch.from_numpy(rng.integers(4, vocab, n))
        if n < T_c:
            ids[b, T_p + n - 1] = eos
        cmask[b, :n] = True
    lens_t = torch.from_numpy(lens)
    return Rollout(
        ids=ids.to(device),
        prompt_lens=torch.tensor([len(prompts[b // G]) for b in range(B)], device=device),
        prompt_width=T_p,
        completion_ids=ids[:, T_p:].to(device),
        completion_mask=cmask.to(device),
        completion_lens=lens_t.to(device),
        finished=(lens_t < T_c).to(device),
        logprobs=torch.zeros(B, T_c, device=device),
        group_size=G,
    )


def gsm8k_lengths(rng, n: int, T_c: int) -> np.ndarray:
    """n completion lengths of the gsm8k spread (module docstring) at cap T_c."""
    g = GSM8K_LENGTHS
    lens = np.exp(rng.normal(np.log(g["median"]), g["sigma"], n)).round().astype(np.int64)
    lens = lens.clip(8, T_c)
    lens[rng.choice(n, max(1, round(g["at_cap"] * n)), replace=False)] = T_c  # 5%, at least one
    return lens


def padded_tokens(r: Rollout, plan, groups: int | None) -> int:
    """Tokens the padded forward runs: each micro-batch's rows x its columns, or with a shared
    prefix its prompts once (P_mb x prompt columns) and its rows x completion columns."""
    total = 0
    for mb in plan:
        rows, (lo, hi), w = mb.rows.stop - mb.rows.start, mb.cols, r.prompt_width
        total += rows * (hi - lo) if not groups else rows // groups * (w - lo) + rows * (hi - w)
    return total


def floor_ms(model, real_tokens: int, scored: int, lora: bool, tflops: float) -> float:
    """The training passes' matmul floor from real tokens only: the reference forward and the
    update's forward + backward (backward = 2 forwards with full weights, 1 with LoRA: no
    weight gradients but the adapters'), 2 FLOPs per weight per token in the blocks and per
    head weight per scored token, at the measured matmul rate (attention scores left out)."""
    block = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    cfg = model.config
    forward = 2 * block * real_tokens + 2 * cfg.vocab_size * cfg.hidden_size * scored
    flops = forward + forward * (2 if lora else 3)  # reference, then forward + backward
    return flops / (tflops * 1e12) * 1e3


def packing_case(model_dir: Path, size: str, lora: bool, spread: str, args, tflops: float) -> dict:
    """Padded vs packed training passes (reference + update) on one controlled rollout."""
    cases = {
        mode: build_case(
            model_dir, lora, args, "auto", [f"train.pack_sequences={mode}"], sample=False
        )
        for mode in ("off", "on")
    }
    policy, cfg, rows = cases["off"]["policy"], cases["off"]["cfg"], cases["off"]["rows"]
    G, P = args.group_size, args.prompts
    prompts = [rows[i]["prompt_ids"] for i in range(P)]
    vocab = min(policy.model.config.vocab_size, len(policy.tokenizer))
    r = controlled_rollout(
        prompts, G, args.max_new_tokens, spread, vocab, policy.stop_ids[0], args.device
    )
    rewards = torch.randn(P * G, generator=torch.Generator().manual_seed(0)).to(args.device)
    batch = RolloutBatch(
        rollout=r,
        rows=[rows[i // G] for i in range(P * G)],
        texts=[""] * (P * G),
        rewards=rewards,
        token_rewards=outcome_token_rewards(rewards, r.completion_mask),
        per_fn={},
        policy_version=0,
        frac_zero_std=0.0,
    )
    first = step_batch(cfg, policy, batch)
    # the sampler's log-probs: the policy's own (a first-pass ratio of 1, as in a run)
    r.logprobs = reference_phase(cfg, policy, r, first.counted_mask, first.plan)
    inputs = {m: step_batch(c["cfg"], c["policy"], batch) for m, c in cases.items()}
    fns = {}
    for m, c in cases.items():
        inp = inputs[m]
        fns[f"{m}_ref"] = lambda c=c, inp=inp: reference_phase(
            c["cfg"], c["policy"], r, inp.counted_mask, inp.plan
        )
        fns[f"{m}_update"] = lambda c=c, inp=inp: update_phase(
            c["cfg"], c["policy"], inp, c["opt"], c["sched"], c["params"]
        )
    t = measure_interleaved(fns, warmup=1, repeats=args.repeats, device=args.device)
    padded = padded_tokens(r, inputs["off"].plan, cfg.shared_prefix_groups)
    packed = sum(mb.packed.real_tokens for mb in inputs["on"].plan)
    ms = {m: t[f"{m}_ref"].median_ms + t[f"{m}_update"].median_ms for m in ("off", "on")}
    lens = r.completion_lens.float()
    floor = floor_ms(policy.model, packed, int(inputs["on"].counted_mask.sum()), lora, tflops)
    peak = {m: max(t[f"{m}_ref"].peak_mem_mib, t[f"{m}_update"].peak_mem_mib) for m in ms}
    return {
        "size": size,
        "mode": "lora r16" if lora else "full",
        "lengths": spread,
        "completion_len": f"{lens.mean():.0f} (max {int(lens.max())})",
        "prompt_len": round(float(r.prompt_lens.float().mean()), 1),
        "pad_share": round(1 - packed / padded, 3),
        "padded_ms": round(ms["off"], 1),
        "packed_ms": round(ms["on"], 1),
        "packed_vs_padded": round(ms["on"] / ms["off"], 3),
        "ref_ratio": round(t["on_ref"].median_ms / t["off_ref"].median_ms, 3),
        "update_ratio": round(t["on_update"].median_ms / t["off_update"].median_ms, 3),
        "padded_peak_mib": round(peak["off"], 1),
        "packed_peak_mib": round(peak["on"], 1),
        "real_tokens_per_s": round(packed / (ms["on"] / 1e3), 1),
        "floor_ms": round(floor, 1),
        "packed_vs_floor": round(ms["on"] / floor, 2),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", default="ci,demo", help="comma list of grpo.tiny.SIZES keys or qwen3-0.6b"
    )
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument(
        "--data",
        choices=sorted(DATA),
        default="minimath",
        help="prompt source (gsm8k: ~200-token prompts)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_output_args(p, None)
    p.add_argument(
        "--rollout-compile",
        default="auto",
        choices=("auto", "on", "off"),
        help="rollout.compile (auto: compiled decode step where inductor works)",
    )
    p.add_argument(
        "--shared-prefix",
        default="off",
        help="train.shared_prefix settings side by side (e.g. off,on); "
        "ref_update_speedup = off's (ref + update) / this one's",
    )
    p.add_argument(
        "--lengths",
        default=None,
        help="compare padded and packed training passes at these completion-length "
        "spreads instead (gsm8k, uniform); see the module docstring",
    )
    p.add_argument("--modes", default="lora,full", help="lora, full or both")
    p.add_argument(
        "--lora-targets",
        default=ALL_TARGETS,
        help="lora.targets of the lora mode (the tutorial's: q_proj,k_proj,v_proj,o_proj)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every case (repeatable), e.g. model.autocast_bf16=true",
    )
    p.add_argument(
        "--reward-model",
        action="store_true",
        help="also time a same-size reward model (the reward_model reward) scoring "
        "each case's rollout: rows/s and its time over the rollout's",
    )
    p.add_argument("--rm-batch-size", type=int, default=32, help="--reward-model: rows/forward")
    p.add_argument(
        "--critic",
        action="store_true",
        help="also time PPO's critic (values, GAE, its update) on each case's "
        "batch: the PPO step beside GRPO's",
    )
    args = p.parse_args(argv)
    sizes = comma_list(p, "--sizes", args.sizes, [*SIZES, "qwen3-0.6b"])
    if args.lengths is not None:
        return packing_main(args, sizes, argv)
    cols = [
        "size",
        "mode",
        "shared_prefix",
        "prompt_len",
        "trainable_params",
        "rollout_ms",
        "ref_logprob_ms",
        "update_ms",
        "step_ms",
        "ref_update_speedup",
        "rollout_frac",
        "tokens_per_s",
        "peak_mem_mib",
        "spread_ms",
    ]
    if args.reward_model:
        cols += ["rm_score_ms", "rm_rows_per_s", "rm_vs_rollout"]
    if args.critic:
        cols += [
            "critic_values_ms",
            "critic_update_ms",
            "ppo_step_ms",
            "ppo_vs_grpo",
            "ppo_peak_mem_mib",
        ]
    meta = {
        "command": "python -m benchmarks.bench_step "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": f"P={args.prompts} G={args.group_size} T_c<={args.max_new_tokens} "
        f"micro={args.micro_batch_size}, beta=0.04 (reference forward included), "
        f"prompts: {args.data}",
        "note": "rollouts stop at eos, so completion lengths vary with the random weights",
        "rollout.compile": args.rollout_compile,
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, model_dir in model_dirs(sizes, Path(tmp)):
            for lora in [m == "lora" for m in args.modes.split(",")]:
                for shared in args.shared_prefix.split(","):
                    rows.append(bench_case(model_dir, size, lora, args, shared))
                    add_speedups(rows)  # written after every case: a timeout keeps the rest
                    write_results(
                        args.name or f"step_{args.device}",
                        rows,
                        cols,
                        out_dir=args.out_dir,
                        meta=meta,
                    )


def sft_packing_case(model_dir: Path, size: str, lora: bool, args, tflops: float) -> dict:
    """One SFT step (`sft_update`), padded vs packed, on the dataset's own worked solutions
    (their real length spread): P x G rows, micro-batches of --micro-batch-size rows."""
    cases = {
        mode: build_case(
            model_dir, lora, args, "auto", [f"train.pack_sequences={mode}"], sample=False
        )
        for mode in ("off", "on")
    }
    cfg, policy = cases["off"]["cfg"], cases["off"]["policy"]
    B = args.prompts * args.group_size
    rows = load_rows(cfg.data, cfg.data.split, B, "sft", policy.tokenizer)
    rows = tokenize_sft(rows, policy.tokenizer, args.max_new_tokens)
    fns = {
        m: (
            lambda c=c: sft_update(
                c["cfg"],
                c["policy"],
                CompletionLogprobs(c["policy"].model),
                rows,
                c["opt"],
                c["sched"],
                c["params"],
                SINGLE,
            )
        )
        for m, c in cases.items()
    }
    t = measure_interleaved(fns, warmup=1, repeats=args.repeats, device=args.device)
    lens = [len(r["completion_ids"]) for r in rows]
    real = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    mb = args.micro_batch_size
    padded = sum(  # `collate`: prompts left-padded to the longest, completions right-padded
        len(part)
        * (max(len(r["prompt_ids"]) for r in part) + max(len(r["completion_ids"]) for r in part))
        for part in (rows[i : i + mb] for i in range(0, B, mb))
    )
    floor = floor_ms(policy.model, real, sum(lens), lora, tflops) * 3 / 4  # no reference pass
    on, off = t["on"].median_ms, t["off"].median_ms
    return {
        "size": size,
        "mode": "lora r16" if lora else "full",
        "lengths": "sft (dataset's)",
        "completion_len": f"{np.mean(lens):.0f} (max {max(lens)})",
        "prompt_len": round(float(np.mean([len(r["prompt_ids"]) for r in rows])), 1),
        "pad_share": round(1 - real / padded, 3),
        "padded_ms": round(off, 1),
        "packed_ms": round(on, 1),
        "packed_vs_padded": round(on / off, 3),
        "update_ratio": round(on / off, 3),
        "padded_peak_mib": round(t["off"].peak_mem_mib, 1),
        "packed_peak_mib": round(t["on"].peak_mem_mib, 1),
        "real_tokens_per_s": round(real / (on / 1e3), 1),
        "floor_ms": round(floor, 1),
        "packed_vs_floor": round(on / floor, 2),
    }


def packing_main(args, sizes: list[str], argv) -> None:
    """--lengths: padded vs packed, each size x mode x spread, written after every case."""
    spreads = [x for x in args.lengths.split(",") if x]
    bad = [x for x in spreads if x not in ("gsm8k", "uniform", "sft")]
    if bad:
        raise SystemExit(f"--lengths: unknown spread {bad[0]!r} (expected gsm8k, uniform or sft)")
    cols = [
        "size",
        "mode",
        "lengths",
        "completion_len",
        "prompt_len",
        "pad_share",
        "padded_ms",
        "packed_ms",
        "packed_vs_padded",
        "ref_ratio",
        "update_ratio",
        "padded_peak_mib",
        "packed_peak_mib",
        "real_tokens_per_s",
        "floor_ms",
        "packed_vs_floor",
    ]
    dtype = torch.float32  # the passes' default precision (model.dtype float32, no autocast)
    tflops = matmul_ceiling_tflops(args.device, dtype)
    meta = {
        "command": "python -m benchmarks.bench_step "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": f"P={args.prompts} G={args.group_size} T_c<={args.max_new_tokens} "
        f"micro={args.micro_batch_size} rows, beta=0.04, train.shared_prefix auto, "
        f"prompts: {args.data}",
        "lengths": f"gsm8k: lognormal {GSM8K_LENGTHS}, clipped to [8, T_c]; uniform: one "
        "prompt length and one completion length (the gsm8k mean)",
        "timed": "reference log-probs + update (mu=1), padded and packed interleaved; the "
        "rollout is the same either way and not timed",
        "floor": "floor_ms: matmul FLOPs of the real tokens only (floor_ms docstring) at the "
        f"measured float32 matmul rate, {tflops:.3f} TFLOP/s",
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, model_dir in model_dirs(sizes, Path(tmp)):
            for mode in args.modes.split(","):
                for spread in spreads:
                    lora = mode == "lora"
                    if spread == "sft":
                        rows.append(sft_packing_case(model_dir, size, lora, args, tflops))
                    else:
                        rows.append(packing_case(model_dir, size, lora, spread, args, tflops))
                    write_results(
                        args.name or f"packing_{args.device}",
                        rows,
                        cols,
                        out_dir=args.out_dir,
                        meta=meta,
                    )


def model_dirs(sizes: list[str], tmp: Path):
    """(size, checkpoint dir) of each size, written under `tmp` one at a time."""
    for size in sizes:
        if size == "qwen3-0.6b":
            yield size, make_checkpoint(tmp, size)
        else:
            yield size, make_tiny_model(tmp / size, size=size)


def add_speedups(rows: list[dict]) -> None:
    """ref_update_speedup: the shared prefix's saving on the training-side passes, against the
    same size and mode with shared_prefix off (None until that row exists)."""
    for row in rows:
        off = [
            r
            for r in rows
            if (r["size"], r["mode"], r["shared_prefix"]) == (row["size"], row["mode"], "off")
        ]
        ref_upd = row["ref_logprob_ms"] + row["update_ms"]
        row["ref_update_speedup"] = (
            round((off[0]["ref_logprob_ms"] + off[0]["update_ms"]) / ref_upd, 2) if off else None
        )


if __name__ == "__main__":
    main()
