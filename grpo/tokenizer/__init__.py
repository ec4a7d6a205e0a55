"""Tokenizers: load (over `transformers.AutoTokenizer`), render and encode chat prompts (message
contents as plain text, only the template's own tags special), stop ids, the chat template's
deltas for multi-turn rollouts, and a small ChatML BPE tokenizer for offline runs and tests.

    load     load_tokenizer, stop_ids, render_prompt, encode_prompt
    chat     encode_chat (the injection-safe encoding), message_delta(_ids), end_of_turn_text
    bpe      train_bpe_tokenizer, CHATML_TEMPLATE
"""

from grpo.tokenizer.bpe import CHATML_TEMPLATE, SPECIAL_TOKENS, train_bpe_tokenizer
from grpo.tokenizer.chat import (
    ChatStructureError,
    check_chat_fields,
    encode_chat,
    encode_pieces,
    end_of_turn_text,
    message_delta,
    message_delta_ids,
    plain_ids,
)
from grpo.tokenizer.load import (
    check_same_vocabulary,
    encode_prompt,
    load_tokenizer,
    render_prompt,
    stop_ids,
)

__all__ = [
    "check_same_vocabulary",
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "ChatStructureError",
    "check_chat_fields",
    "encode_chat",
    "encode_pieces",
    "encode_prompt",
    "end_of_turn_text",
    "load_tokenizer",
    "message_delta",
    "message_delta_ids",
    "plain_ids",
    "render_prompt",
    "stop_ids",
    "train_bpe_tokenizer",
]
