"""What the benchmarks share: the model shapes they time (`CASES`), the random-init checkpoints
of those shapes with the ci tokenizer (`make_checkpoint`) and the prompt sources (`DATA`).

One module below every benchmark, so no benchmark imports another for them.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpo.models import Decoder, ModelConfig, save_pretrained
from grpo.tiny import make_tiny_model

CASES = {
    "tiny": dict(
        config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
        target=2.0,
        threads=1,
        hf_caches="dynamic,static",
        rounds=7,
        warmup=1,
    ),
    "qwen3-0.6b": dict(
        config=dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        target=1.2,
        threads=0,
        hf_caches="dynamic",  # a static-cache generate costs another ~10 min here
        rounds=3,  # one generate call takes minutes on a 2-core CPU
        warmup=0,
    ),
}
QWEN3_06B = CASES["qwen3-0.6b"]["config"]  # the shape every benchmark here uses


# Prompts: mini-math (~57 tokens with the tiny tokenizer) or real GSM8K questions (~200 tokens,
# 85-358: the prompt lengths the shared prefix is for), from the repo's shared data directory.
# gsm8k-test: the GSM8K test split the repository carries (tests/data/gsm8k), for machines
# without the shared data directory.
GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
GSM8K_TEST_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k"
DATA = {
    "minimath": [],
    "gsm8k": ["data.dataset=gsm8k", f"data.source={GSM8K_DIR}", "data.max_prompt_len=440"],
    "gsm8k-test": [
        "data.dataset=gsm8k",
        f"data.source={GSM8K_TEST_DIR}",
        "data.split=test",
        "data.max_prompt_len=512",  # its longest question is 472 tokens with the ci tokenizer
    ],
}


def make_checkpoint(root: Path, shape: str) -> Path:
    """HF-format checkpoint + the ci tokenizer: `ci` as written by make_tiny_model, or a
    random-init Qwen3-0.6B-shape model (the tokenizer's ids are < its vocab)."""
    out = make_tiny_model(root / shape, size="ci")
    if shape == "ci":
        return out
    if shape != "qwen3-0.6b":
        raise SystemExit(f"--shapes: unknown shape {shape!r} (expected ci or qwen3-0.6b)")
    hf = json.loads((out / "config.json").read_text())
    hf.update(QWEN3_06B, model_type="qwen3", tie_word_embeddings=True)
    model = Decoder(ModelConfig.from_hf(hf))
    model.init_weights(std=0.02, seed=0)
    save_pretrained(model, out)
    del model
    return out
