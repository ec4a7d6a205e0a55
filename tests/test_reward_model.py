"""Reward models as sequence classifiers: our `Decoder` with a `score` head reads and writes
`transformers`' *ForSequenceClassification checkpoints and scores every row alike (left and
right padding, and a row whose last real token is the pad id, pad = eos as in Qwen bases)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_hf_checkpoint, tiny_hf_config

from grpo.errors import GrpoError
from grpo.loading import TrainedModel, load_trained_model
from grpo.models import load_model, save_pretrained
from grpo.models.classifier import score_positions, sequence_scores

PAD = 2  # = eos_token_id of the tiny configs: pad = eos, as in Qwen base models
FAMILIES = ("llama", "qwen2", "qwen3")


def padded_rows(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Four rows of different lengths, padded on `side`; row 2 ends with the pad id (a real
    eos token), row 3 has a pad-id token inside."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 5, 7, 3)]
    rows[2][-1] = PAD
    rows[3][1] = PAD
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        at = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
        ids[b, at], mask[b, at] = torch.tensor(r), True
    return ids, mask


def hf_scores(path, ids, mask) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask.long()).logits.float()


def test_score_positions_hand_checked():
    ids = torch.tensor([[5, 6, 2, 2], [2, 2, 7, 8], [5, 6, 7, 2], [2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]]).bool()
    assert score_positions(ids, mask, 2).tolist() == [1, 3, 2, 0]  # row 2: its eos is skipped
    assert score_positions(ids, mask, None).tolist() == [1, 3, 3, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_our_export_scores_like_transformers(tmp_path, family):
    base = make_hf_checkpoint(tmp_path / "base", family, seed=1)
    model = load_model(base, num_labels=1, pad_token_id=PAD)
    assert model.config.num_labels == 1 and float(model.score.weight.detach().abs().sum()) == 0
    with torch.no_grad():  # a trained head
        model.score.weight.copy_(torch.randn(1, 64, generator=torch.Generator().manual_seed(3)))
    out = save_pretrained(model, tmp_path / "rm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [f"{family.capitalize()}ForSequenceClassification"]
    assert cfg["pad_token_id"] == PAD and cfg["num_labels"] == 1
    for side in ("left", "right"):
        ids, mask = padded_rows(side)
        with torch.no_grad():
            ours = sequence_scores(model, ids, mask, PAD)
        theirs = hf_scores(out, ids, mask)
        assert ours.shape == theirs.shape == (4, 1)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # row 2 ends with the pad id: scored one token earlier, in both (not its eos)
    ids, mask = padded_rows("right")
    short = ids[2:3, :6].clone()
    with torch.no_grad():
        assert torch.allclose(
            sequence_scores(model, ids[2:3], mask[2:3], PAD),
            sequence_scores(model, short, mask[2:3, :6], PAD),
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_classifier_loads_and_scores_alike(tmp_path, family):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(4)
    cfg = tiny_hf_config(family, num_labels=1, pad_token_id=PAD)
    hf = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path / "hf_rm"), safe_serialization=True)
    model = load_model(tmp_path / "hf_rm")
    assert model.config.num_labels == 1 and model.config.pad_token_id == PAD
    for side in ("left", "right"):
        ids, mask = padded_rows(side)
        with torch.no_grad():
            ours = sequence_scores(model, ids, mask, PAD)
        torch.testing.assert_close(
            ours, hf_scores(tmp_path / "hf_rm", ids, mask), rtol=1e-5, atol=1e-5
        )


def test_a_classifier_is_not_a_policy(tmp_path):
    base = make_hf_checkpoint(tmp_path / "base", "qwen3")
    save_pretrained(load_model(base, num_labels=1, pad_token_id=PAD), tmp_path / "rm")
    (tmp_path / "rm" / "tokenizer.json").write_text("{}")
    with pytest.raises(GrpoError, match="sequence classifier"):
        load_trained_model(TrainedModel(str(tmp_path / "rm")), device="cpu")
    with pytest.raises(GrpoError, match="1 outputs, not 2"):
        load_model(tmp_path / "rm", num_labels=2)
