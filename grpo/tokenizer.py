"""Tokenizers: load (over `transformers.AutoTokenizer`), render chat prompts, stop ids, and
train a small ChatML BPE tokenizer for offline runs and tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from grpo.errors import GrpoError

# ChatML, as the Qwen families use it; `enable_thinking=False` closes an empty think block
# the way Qwen3's template does.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def load_tokenizer(path_or_id: str | Path):
    """Load a tokenizer from a local directory or hub id (never with remote code).

    A tokenizer without a pad token gets eos as pad: masks are built from lengths, so the
    two are never confused.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=False)
    except Exception as e:
        raise GrpoError(f"could not load a tokenizer from {str(path_or_id)!r}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def render_prompt(
    tokenizer,
    question: str,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
) -> str:
    """The chat-template rendering of one user turn, ending with the assistant header."""
    if not getattr(tokenizer, "chat_template", None):
        raise GrpoError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "use an instruct/chat tokenizer or set one with tokenizer.chat_template"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )


def stop_ids(tokenizer, model_dir: str | Path | None = None) -> list[int]:
    """Token ids that end a completion: the tokenizer's eos plus generation_config's eos."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise GrpoError("the tokenizer has no eos token and no generation_config eos_token_id")
    return sorted(ids)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    split_digits: bool = True,
):
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template.

    Args:
        texts: the training corpus.
        vocab_size: target vocabulary size (special tokens included).
        out_dir: if given, the tokenizer is saved there (loadable by `load_tokenizer`).
        split_digits: one token per digit, which makes arithmetic far easier to learn.

    Returns:
        a `transformers.PreTrainedTokenizerFast` with eos `<|im_end|>`, pad `<|endoftext|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
