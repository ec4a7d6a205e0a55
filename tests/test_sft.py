"""SFT's optimizer step: its loss is summed on the device and read once per step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import grpo.train.sft as sft
from grpo.algo.logprobs import CompletionLogprobs
from grpo.config import load_config
from grpo.distributed import SINGLE
from grpo.models import load_model
from grpo.policy import Policy
from grpo.run.optim import build_optimizer, build_scheduler

# the conversions the step's loss sum used per micro-batch (sft_loss's token count, an int()
# per micro-batch, is left to a later change)
LOSS_READS = ("item", "tolist", "__float__")


class _Tok:
    pad_token_id = 0


def sft_rows() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "prompt_ids": torch.randint(4, 250, (2 + i % 3,), generator=g).tolist(),
            "completion_ids": torch.randint(4, 250, (3 + i % 4,), generator=g).tolist(),
        }
        for i in range(8)
    ]


def sft_step(ckpt: Path, micro: int, monkeypatch):
    """One `sft_update` over `sft_rows` in micro-batches of `micro` rows: its result, the loss
    of each micro-batch (read afterwards) and the counts of LOSS_READS during the step."""
    model = load_model(ckpt)
    cfg = load_config(
        base={"model": {"path": str(ckpt)}},
        overrides=["optim.lr=1e-3", "train.batch_size=8", f"train.micro_batch_size={micro}"],
    )
    policy = Policy(model, _Tok(), [3], None, Path(ckpt), lora=False)
    params = policy.trainable_parameters()
    opt = build_optimizer(params, cfg.optim)
    sched = build_scheduler(opt, 10, cfg.optim)
    rows, losses, counts = sft_rows(), [], dict.fromkeys(LOSS_READS, 0)
    real_loss = sft.sft_loss

    def loss_spy(*args, **kwargs):
        loss, n = real_loss(*args, **kwargs)
        losses.append(loss.detach().clone())
        return loss, n

    with monkeypatch.context() as m:
        m.setattr(sft, "sft_loss", loss_spy)
        for name in LOSS_READS:
            real = getattr(torch.Tensor, name)

            def counted(self, *args, _real=real, _name=name, **kwargs):
                counts[_name] += 1
                return _real(self, *args, **kwargs)

            m.setattr(torch.Tensor, name, counted)
        out = sft.sft_update(
            cfg, policy, CompletionLogprobs(model), rows, opt, sched, params, SINGLE
        )
    return out, losses, counts


def test_sft_update_reads_its_loss_once(tiny_checkpoints, monkeypatch):
    """8 rows in 1 or 4 micro-batches: the returned loss equals the float sum of the
    micro-batch losses (to 1e-12), and the loss reads do not grow with the micro-batches."""
    ckpt = tiny_checkpoints("qwen3")
    totals, reads = {}, {}
    for micro in (8, 2):
        (total, tokens, grad_norm), losses, reads[micro] = sft_step(ckpt, micro, monkeypatch)
        assert len(losses) == 8 // micro
        assert tokens == sum(len(r["completion_ids"]) for r in sft_rows())
        want = 0.0
        for loss in losses:  # what sft_update summed before: total + loss.item()
            want += loss.item()
        assert total == pytest.approx(want, rel=1e-12, abs=0)
        assert isinstance(total, float) and isinstance(grad_norm, float) and grad_norm > 0
        totals[micro] = total
    assert reads[2] == reads[8], reads
    assert totals[2] == pytest.approx(totals[8], rel=1e-5)  # the same mean loss
