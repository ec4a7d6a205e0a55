"""Tiny offline models: a BPE tokenizer trained on mini-math text and a random-init Qwen3.

Used by `grpo demo`, `grpo tiny-model` and the CI configs, so that everything runs with no
network and no downloaded weights; `digit_share` is the reward a random-init model can climb
(configs/quickstart.yaml).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.data import minimath
from grpo.data.formats import sft_solution, split_solution
from grpo.models import Decoder, ModelConfig, save_pretrained
from grpo.rewards.bounds import bounded
from grpo.tokenizer import train_bpe_tokenizer

SIZES = {
    # name: (hidden, layers, heads, kv heads, intermediate)
    "ci": (64, 2, 4, 2, 128),
    "demo": (192, 3, 6, 2, 512),
}


def minimath_corpus(n: int = 2000, seed: int = 0, difficulty: int = 0) -> list[str]:
    """Questions and SFT-format solutions of mini-math problems, for tokenizer training."""
    texts = []
    for row in minimath(n, seed, split="train", difficulty=difficulty):
        steps, final = split_solution(row["answer"])
        texts += [row["question"], sft_solution(steps, final)]
    return texts


def make_tiny_model(
    out_dir: str | Path,
    size: str = "ci",
    vocab_size: int = 384,
    seed: int = 0,
    max_position_embeddings: int = 512,
    difficulty: int = 0,
    corpus: list[str] | None = None,
    extra_special_tokens: tuple[str, ...] = (),
) -> Path:
    """Write a tokenizer + random-init Qwen3-architecture checkpoint to `out_dir`.

    Args:
        out_dir: target directory (HF format: config.json, model.safetensors, tokenizer files).
        size: a key of SIZES.
        vocab_size: BPE vocabulary size (digits are one token each).
        seed: init seed.
        max_position_embeddings: context length.
        difficulty: mini-math difficulty of the tokenizer corpus.
        corpus: the tokenizer's training texts instead of mini-math's.
        extra_special_tokens: tokens the tokenizer keeps whole (e.g. tool-call tags).

    Returns:
        out_dir.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus if corpus is not None else minimath_corpus(difficulty=difficulty)
    tok = train_bpe_tokenizer(
        texts, vocab_size, out_dir=out, extra_special_tokens=extra_special_tokens
    )
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    cfg = ModelConfig(
        family="qwen3",
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(std=0.02, seed=seed)
    save_pretrained(model, out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}) + "\n"
    )
    return out


@bounded(0.0, 1.0)  # all digits: a solved quickstart, not a stalled one (grpo.run.health)
def digit_share(completions: list[str], **columns) -> list[float]:
    """The quickstart's reward (configs/quickstart.yaml): the share of each completion's
    characters that are digits, in [0, 1] (``"x 12"`` -> 0.5; empty -> 0).

    A dense toy signal, not a skill: a random-init model already writes a digit now and then,
    so the rewards of a group differ from the first step and GRPO has something to climb
    (towards all-digit completions). `columns` (the dataset's) are ignored.
    """
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]
