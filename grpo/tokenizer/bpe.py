"""A small byte-level BPE tokenizer with ChatML special tokens and chat template, trained on a
corpus, for offline runs and tests (`train_bpe_tokenizer`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

# ChatML, as the Qwen families use it; `enable_thinking=False` closes an empty think block
# the way Qwen3's template does. Like Qwen3's, it renders `tools` (the schemas, one JSON line
# each, in the system message) and an assistant's `tool_calls` (one Hermes block each, exactly
# what `grpo.envs.tool_calls.tool_call_text` writes and what a trained model generates); a
# conversation without them renders as plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
    "{%- endif %}"
    '{{- \'Tools (call one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>):\' }}'
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 512,
    out_dir: str | Path | None = None,
    split_digits: bool = True,
    extra_special_tokens: tuple[str, ...] = (),
):
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template.

    Args:
        texts: the training corpus.
        vocab_size: target vocabulary size (special tokens included).
        out_dir: if given, the tokenizer is saved there (loadable by `load_tokenizer`).
        split_digits: one token per digit, which makes arithmetic far easier to learn.
        extra_special_tokens: more tokens kept whole (e.g. "<tool_call>", "</tool_call>").

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
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", *extra_special_tokens],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast
