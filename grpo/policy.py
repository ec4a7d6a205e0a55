"""The policy being trained: the model (with LoRA or all weights trainable), its tokenizer and
stop ids, the frozen reference for full fine-tuning, and the run's precision; `build_policy`
loads it as a config says and `save_final` writes the trained weights."""

from __future__ import annotations

import copy
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo.config import Config
from grpo.distributed import shard_model
from grpo.errors import GrpoError
from grpo.io import writing
from grpo.loading import config_model, load_trained_model
from grpo.lora import apply_lora, load_adapter, lora_modules, save_adapter
from grpo.models import Decoder, save_pretrained
from grpo.precision import Precision

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """The model being trained and what goes with it."""

    model: Decoder
    tokenizer: object
    stop_ids: list[int]
    ref_model: Decoder | None  # a frozen copy for full fine-tuning with beta > 0
    model_dir: Path
    lora: bool
    precision: Precision = field(default_factory=Precision)  # the run's dtypes (grpo.precision)
    compute_device: torch.device | None = None  # where it computes (build_policy's `device`)

    @property
    def device(self) -> torch.device:
        """Where the forward and backward run: the rank's device, also when FSDP keeps the
        weights' shards in CPU memory (train.fsdp_offload) and the model reports the CPU."""
        return self.compute_device or self.model.device

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build_policy(cfg: Config, device: torch.device, need_ref: bool, adapter: str | None = None):
    """Load the checkpoint and tokenizer, add LoRA (or unfreeze all), make the reference.

    Args:
        cfg: the run config (model, lora sections).
        device: where the model lives.
        need_ref: a reference policy is needed (beta > 0). LoRA runs use the base model through
            `disabled_lora`; full fine-tuning gets a frozen deep copy.
        adapter: start from this LoRA adapter directory (overrides cfg.lora.adapter).
    """
    precision = Precision.from_config(cfg.model)  # float16 is refused here, before any load
    # model.adapter (e.g. SFT's) is folded in, so it is also the reference policy
    model, tokenizer, ids, _ = load_trained_model(config_model(cfg), cfg.model.dtype, device)
    adapter = adapter or cfg.lora.adapter
    if cfg.lora.enabled:
        if adapter:
            load_adapter(model, adapter)
            for m in lora_modules(model).values():  # an adapter to continue training
                m.lora_a.requires_grad_(True)
                m.lora_b.requires_grad_(True)
        else:
            apply_lora(
                model,
                rank=cfg.lora.rank,
                alpha=cfg.lora.alpha,
                dropout=cfg.lora.dropout,
                targets=cfg.lora.targets,
                seed=cfg.train.seed,
            )
    else:
        if adapter:
            raise GrpoError("lora.adapter is set but lora.enabled is false")
        for p in model.parameters():
            p.requires_grad_(True)
    model.gradient_checkpointing = cfg.model.gradient_checkpointing
    ref = None
    if need_ref and not cfg.lora.enabled:  # frozen: kept in model.dtype
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    precision.prepare(model)  # trainable weights to float32: the master weights
    log.info("precision: %s", precision.describe(device))
    return Policy(
        model,
        tokenizer,
        ids,
        ref,
        Path(cfg.model.path),
        cfg.lora.enabled,
        precision,
        torch.device(device),
    )


def save_final(policy: Policy, out_dir: Path, cfg: Config) -> Path:
    """Write the trained weights: a PEFT-format adapter for LoRA, a full HF checkpoint else,
    plus the tokenizer, into out_dir/final. A reward model (a sequence classifier) is always
    a full `*ForSequenceClassification` checkpoint, its LoRA merged in."""
    final = out_dir / "final"
    tmp = out_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if policy.model.config.num_labels:
        from grpo.lora import merge_lora, unmerge_lora

        merge_lora(policy.model)  # the end of the run: unmerged again after the write
        try:
            save_pretrained(policy.model, tmp)
        finally:
            unmerge_lora(policy.model)
    elif policy.lora:
        save_adapter(policy.model, tmp, base_model_name_or_path=str(cfg.model.path))
    else:
        save_pretrained(policy.model, tmp)
    with writing(tmp):  # transformers raises a bare OSError on a full disk
        policy.tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def shard_policy(policy: Policy, cfg: Config, dist) -> bool:
    """With train.parallel: fsdp in a job of several ranks, shard the model (and a frozen
    reference copy) over the ranks (`grpo.distributed.shard_model`); returns whether it did.
    Gradients, optimizer states and checkpoints then follow the shards (grpo.run.state)."""
    if cfg.train.parallel != "fsdp":
        return False
    if not dist.enabled:
        log.info("train.parallel=fsdp with one process: nothing to shard, training unsharded")
        return False
    dtype, offload = policy.precision.compute_dtype, cfg.train.fsdp_offload
    shard_model(policy.model, dist, dtype, offload)
    if policy.ref_model is not None:
        shard_model(policy.ref_model, dist, dtype, offload)
    return True
