"""The distillation teacher: a frozen scorer (grpo.modules.base.FrozenScorer) that attaches a
frozen model's log-probs of the tokens the policy sampled.

    modules:
      - name: teacher
        kwargs: {path: runs/quickstart/final}   # a checkpoint, a run directory or an adapter
    rewards: []                                  # the estimator drives learning
    loss: {advantage: distill}                   # A_t = log p_teacher - log pi_old

Each step, after the rollout, `attach` puts log p_teacher(y_t | prompt, y_<t) of every generated
token y_t into the batch's extras (``teacher_logprobs``, (B, T_c) float32, 0 off the generated
tokens), computed as the policy's own log-probs are (`grpo.experience.scoring.Scoring`: the
step's micro-batches, packing and shared prompts, the policy's precision and log-prob kernel,
at rollout.temperature). The teacher is loaded once, in model.dtype, on every rank (replicated,
under train.parallel: fsdp too), without gradient. It reads the policy's token ids as they are,
so it must have the policy's tokenizer (`grpo.tokenizer.check_same_vocabulary`: one line
naming the first token that differs otherwise). Its identity (the path and a hash of its
weights) goes into the run's metadata and its checkpoints; a resume with another teacher is
refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.errors import GrpoError
from grpo.loading import TrainedModel, load_trained_model, resolve_trained
from grpo.modules.base import FrozenScorer, register_trained_module
from grpo.tokenizer import check_same_vocabulary

if TYPE_CHECKING:
    from grpo.experience.scoring import Scoring
    from grpo.policy import Policy

FIELD = "modules[teacher].kwargs.path"


class Teacher(FrozenScorer):
    """A frozen causal LM scoring the policy's samples (module docstring).

    Args:
        model: the teacher `Decoder` (frozen, eval mode).
        scoring: the trainer's `Scoring` (plan, precision, kernel).
        key: the extras key its log-probs go under.
        identity: what identifies it (path, sha256).
    """

    def __init__(self, model: torch.nn.Module, scoring: Scoring, key: str, identity: dict):
        super().__init__()
        self.model = model
        self.scoring = scoring
        self.key = key
        self._identity = dict(identity)

    def attach(self, batch) -> dict[str, torch.Tensor]:
        return {self.key: self.scoring.logprobs(self.model, batch.rollout)}  # (B, T_c)

    def identity(self) -> dict[str, str]:
        return dict(self._identity)


def weights_digest(spec: TrainedModel) -> str:
    """sha256 (16 hex digits) of what a loaded model is made of: the base checkpoint's
    config.json and *.safetensors, then each adapter's, by name and bytes, in order."""
    h = hashlib.sha256()
    for root in (spec.path, *spec.adapters):
        root = Path(root)
        files = [root / "config.json", *sorted(root.glob("*.safetensors"))]
        for f in (f for f in files if f.is_file()):
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()[:16]


@register_trained_module("teacher")
def teacher(
    config, policy: Policy, scoring: Scoring, *, path: str, key: str = "teacher_logprobs"
) -> Teacher:
    """The distillation teacher (module docstring).

    Args:
        path: the teacher: an HF-format checkpoint directory, a run directory or its final/,
            or a LoRA adapter directory (folded into the base its adapter_config names).
        key: the extras key of its log-probs (the `distill` estimator's ``teacher_key``).
    """
    if not isinstance(path, str) or not path:
        raise GrpoError(f"{FIELD} must be a checkpoint path, got {path!r}")
    if not Path(path).expanduser().exists():
        raise GrpoError(f"{FIELD}: {path} does not exist")
    if not isinstance(key, str) or not key:
        raise GrpoError(f"modules[teacher].kwargs.key must be a name, got {key!r}")
    spec = resolve_trained(Path(path).expanduser())
    # it reads the policy's token ids as they are: they must mean the same tokens
    check_same_vocabulary(spec.tokenizer_path, policy.tokenizer, FIELD)
    model = load_trained_model(spec, config.model.dtype, policy.device).model
    model.requires_grad_(False)
    ident = {"path": str(path), "sha256": weights_digest(spec)}
    return Teacher(model.eval(), scoring, key, ident)
