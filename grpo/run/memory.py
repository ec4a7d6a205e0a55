"""The memory model of a run: its estimated peak memory by part, before anything loads, and the
memory the machine has for it (`grpo.run.preflight.check_memory` compares the two).

Memory estimate, in bytes, by the precision policy (docs/precision.md; e = bytes per element of
model.dtype: 4 float32, 2 bf16/fp16; k = 2 under autocast (bf16 compute), else e; trainable
weights are float32 master weights; shapes from config.json: L layers, C width, I MLP width,
H / H_kv heads of D, V vocabulary):

    weights     N * e                    N: the checkpoint's parameters (full fine-tuning: N * 4)
    reference   N * e                    GRPO with full fine-tuning and a KL reference only
    optimizer   N_t * 4 * 3 (+ N_t * 4)  gradient + AdamW's two moments (+ the LoRA weights);
                                         N_t trainable: r * (in + out) per LoRA layer, or N
    rollout     B * S * 2*L*H_kv*D * k   the sampler's KV cache, B = train.batch_size rows
              + B * V * 4 * 2            (P*G per rank); fp32 logits and probabilities of a step
    training    M * L * A * e            activations kept for backward over M tokens of one
              + 2**23 * 4                micro-batch (train.micro_batch_size rows of S tokens;
                                         a shared prefix counts each group's prompt once; or
                                         train.micro_batch_tokens, at least one row or group),
                                         A = 2C + 2H*D + 2H_kv*D + 3I per token and layer (with
                                         gradient checkpointing C, plus one layer's A, plus
                                         2*H_kv*D per shared prompt token and layer); one
                                         32 MiB fp32 tile of the fused log-prob kernel
    evaluation  as rollout with B = eval.batch_size (x eval.k in the pipeline) and S = prompt
                + the evaluation's budget

    total = weights + reference + optimizer + producer + max(rollout, training, evaluation)

With rollout.async on and a producer thread (rollout.ranks: 0), sampling runs while training
does: producer = the rollout part above + N_t * 4 * (k + 2) (the producer's copy of the
trainable weights and up to k + 1 published snapshots, k = rollout.max_staleness), and the
rollout part leaves the max; on trainer ranks of a job with producer ranks nothing samples
(rollout = 0). Otherwise producer = 0.

Under train.parallel: fsdp with W ranks, weights, reference and optimizer are each rank's 1/W
shard; a rollout and an evaluation gather the whole weights (+ weights * (W - 1) / W), and a
training pass gathers the root (embeddings, head, final norm) and one block at a time.

S counts the prompt at data.max_prompt_len (capped by the context) plus the completion budget:
the estimate is of the worst case the settings allow, and it leaves out allocator slack and
framework overhead. The preflight compares it with the free CUDA memory of the run's device,
or with MemAvailable of /proc/meminfo on CPU (`available_memory`; the estimate times the world
size: a CPU torchrun job's ranks share it); where neither can be read the check is skipped.
When the estimate is too pessimistic for your data (short prompts), lower data.max_prompt_len
to fit them or set train.skip_memory_check: true.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grpo.config import Config
from grpo.models import Decoder, ModelConfig
from grpo.models.decoder import meta_decoder
from grpo.precision import Precision
from grpo.run.budgets import Evaluation, rollout_budget

LOGPROB_TILE_BYTES = 2**23 * 4  # kernels/grpo_kernels/reference.py default_blocks: one fp32 tile


@dataclass(frozen=True)
class MemoryEstimate:
    """The parts of a run's estimated peak memory, in bytes (see the module docstring)."""

    weights: int
    reference: int
    optimizer: int
    rollout: int
    training: int
    evaluation: int
    producer: int = 0  # asynchronous rollouts in the trainer's process (rollout.async)

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.reference
            + self.optimizer
            + self.producer
            + max(self.rollout, self.training, self.evaluation)
        )


def estimate_memory(
    cfg: Config,
    mc: ModelConfig,
    kind: str,
    evaluations: Sequence[Evaluation] = (),
    meta: Decoder | None = None,
    world_size: int = 1,
) -> MemoryEstimate:
    """The run's estimated peak memory by part, per rank (the formula is in the module
    docstring).

    Args:
        cfg: the run's config.
        mc: the checkpoint's config.
        kind: "grpo" or "sft".
        evaluations: the run's evaluations (budget and rows).
        meta: the model on the meta device (built from `mc` if not given).
        world_size: ranks of the job (train.parallel: fsdp shards over them).
    """
    meta = meta if meta is not None else meta_decoder(mc)
    prec = Precision.from_config(cfg.model, training=False)  # the dtypes the run will use
    e = prec.param_dtype.itemsize
    n_params = sum(p.numel() for p in meta.parameters())  # a tied head counts once
    weights = n_params * e
    if cfg.lora.enabled:
        layers = lora_layers(cfg, meta)
        n_train = sum(cfg.lora.rank * (m.in_features + m.out_features) for m in layers.values())
        optimizer = n_train * 4 * 4  # float32 LoRA weights, their gradients, two AdamW moments
    else:
        n_train = n_params
        weights = n_params * 4  # every weight trains: float32 master weights
        optimizer = n_params * 4 * 3
    full_ref = kind == "grpo" and not cfg.lora.enabled
    needs_ref = cfg.loss.needs_reference or cfg.log.kl_every > 0
    reference = n_params * e if full_ref and needs_ref else 0

    ctx = mc.max_position_embeddings
    L, C, I = mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size  # noqa: E741
    H, H_kv, D = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim

    def prompt(budget: int) -> int:
        return max(1, min(cfg.data.max_prompt_len, ctx - budget))

    kv = prec.kv_dtype.itemsize

    def sampling(rows: int, budget: int) -> int:
        return sampling_bytes(mc, rows, prompt(budget) + budget, kv)

    _, budget = rollout_budget(cfg, kind)
    rollout = sampling(cfg.train.batch_size, budget) if kind == "grpo" else 0
    mb = cfg.train.micro_batch_size or cfg.train.batch_size
    groups = cfg.shared_prefix_groups if kind == "grpo" else None
    prompt_rows = mb // groups if groups else mb  # a shared prefix runs once per group
    tokens = prompt_rows * prompt(budget) + mb * budget  # M
    if cfg.train.micro_batch_tokens is not None:  # packed micro-batches of at most this many
        unit = prompt(budget) + (groups or 1) * budget  # but a longer row or group runs alone
        tokens = max(cfg.train.micro_batch_tokens, unit)
    per_layer = 2 * C + 2 * H * D + 2 * H_kv * D + 3 * I  # A
    act = prec.compute_dtype.itemsize  # activations are bf16 under autocast
    if cfg.model.gradient_checkpointing:
        activations = tokens * (L * C + per_layer) * act
        if groups:  # the shared prompt's keys and values stay for the recompute
            activations += prompt_rows * prompt(budget) * L * 2 * H_kv * D * act
    else:
        activations = tokens * L * per_layer * act
    training = activations + LOGPROB_TILE_BYTES
    evaluation = max((sampling(ev.rows, ev.budget) for ev in evaluations), default=0)
    if cfg.train.parallel == "fsdp" and world_size > 1:
        whole = weights
        weights, reference, optimizer = (x // world_size for x in (weights, reference, optimizer))
        gathered = whole - weights  # what a rollout or an evaluation adds to this rank's shard
        rollout = rollout + gathered if rollout else 0
        evaluation = evaluation + gathered if evaluation else 0
        per_param = whole // max(n_params, 1)
        root = sum(p.numel() for n, p in meta.named_parameters() if not n.startswith("layers."))
        block = sum(p.numel() for p in meta.layers[0].parameters())
        training += (root + block) * per_param  # gathered while a training pass runs them
    producer = 0
    if kind == "grpo" and cfg.rollout.asynchronous:
        if cfg.rollout.ranks == 0:  # sampling alongside training, on a copy + snapshots
            producer = rollout + n_train * 4 * (cfg.rollout.max_staleness + 2)
        rollout = 0  # (producer ranks sample; these trainer ranks do not)
    return MemoryEstimate(
        weights=weights,
        reference=reference,
        optimizer=optimizer,
        rollout=rollout,
        training=training,
        evaluation=evaluation,
        producer=producer,
    )


def sampling_bytes(mc: ModelConfig, rows: int, tokens: int, e: int) -> int:
    """The sampler's memory for `rows` rows of `tokens` positions: the KV cache (keys and
    values of every layer) and one decode step's fp32 logits and probabilities (rows, V)."""
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * e
    return rows * tokens * kv_per_token + rows * mc.vocab_size * 4 * 2


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for the run, where that was read): free CUDA memory of `device`, else
    MemAvailable of /proc/meminfo; (None, why) when neither can be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    return None, "no /proc/meminfo"


def memory_fields(cfg: Config) -> dict[str, str]:
    """The setting that sizes each part of the estimate."""
    return {
        "weights": "model.dtype" if cfg.model.dtype == "float32" else "model.path",
        "reference": "lora.enabled",
        "optimizer": "lora.rank" if cfg.lora.enabled else "lora.enabled",
        "rollout": "train.batch_size",
        "training": "train.micro_batch_tokens"
        if cfg.train.micro_batch_tokens is not None
        else "train.micro_batch_size",
        "evaluation": "eval.batch_size",
        "producer": "rollout.max_staleness",
    }


def lora_layers(cfg: Config, meta: Decoder) -> dict[str, nn.Linear]:
    """The linear layers lora.targets select (PEFT's rule, as `apply_lora`)."""
    from grpo.lora.layers import _matches

    return {
        name: m
        for name, m in meta.named_modules()
        if type(m) is nn.Linear and _matches(name, cfg.lora.targets)
    }
