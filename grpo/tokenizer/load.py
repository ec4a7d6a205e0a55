"""Load a tokenizer (over `transformers.AutoTokenizer`), its stop ids, and a math question as a
chat prompt (`render_prompt` text, `encode_prompt` ids through `grpo.tokenizer.chat`)."""

from __future__ import annotations

from pathlib import Path

from grpo.errors import GrpoError
from grpo.io import read_json, read_text
from grpo.tokenizer.chat import encode_chat


def check_same_vocabulary(path: str | Path, tokenizer, field: str) -> None:
    """A model loaded from `path` that reads ids `tokenizer` encoded (a critic from its own
    checkpoint) must give them the same meaning: its tokenizer's vocabulary (token -> id) must
    be `tokenizer`'s, else a GrpoError naming `field`. A checkpoint without tokenizer files
    is checked by its vocabulary size alone (config.json): it must hold every id."""
    path = Path(path)
    theirs = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        theirs = load_tokenizer(path).get_vocab()
    ours = tokenizer.get_vocab()
    if theirs is not None:
        if theirs == ours:
            return
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])
        token, at = differ[0]
        raise GrpoError(
            f"{field}: {path} has another tokenizer than the policy ({len(theirs)} tokens "
            f"against {len(ours)}; first difference: {token!r} at id {at}): it would read the "
            "policy's token ids as other tokens; start it from a checkpoint with the policy's "
            "tokenizer"
        )
    config = read_json(path / "config.json", "a model's config.json")
    size = config.get("vocab_size") if isinstance(config, dict) else None
    needed = max(ours.values(), default=-1) + 1
    if isinstance(size, int) and size < needed:
        raise GrpoError(
            f"{field}: {path} has a vocabulary of {size} tokens and no tokenizer files; the "
            f"policy's tokenizer has ids up to {needed - 1}: start it from a checkpoint with "
            "the policy's tokenizer"
        )


def load_tokenizer(path_or_id: str | Path):
    """Load a tokenizer from a local directory or hub id (never with remote code).

    A tokenizer without a pad token gets eos as pad: masks are built from lengths, so the
    two are never confused.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=False)
    except Exception as e:
        _check_tokenizer_files(Path(path_or_id))  # a broken file is named, if it is one
        raise GrpoError(f"could not load a tokenizer from {str(path_or_id)!r}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


_JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


def _check_tokenizer_files(path: Path) -> None:
    """After a failed load: raise a FileError naming the first unreadable tokenizer file."""
    if not path.is_dir():
        return
    for name in _JSON_FILES:
        if (path / name).is_file():
            read_json(path / name, f"a tokenizer file ({name})")
    if (path / "merges.txt").is_file():
        read_text(path / "merges.txt", "BPE merges (UTF-8 text)")


def render_prompt(
    tokenizer,
    question: str,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The chat-template rendering of one user turn, ending with the assistant header (with
    `tools`, the tool schemas as the template renders them). Encode it with `encode_prompt`,
    not `tokenizer(text)`: that would parse special-token text in the question as chat
    structure."""
    messages, kwargs = _prompt_messages(tokenizer, question, system_prompt, enable_thinking)
    if tools:
        kwargs["tools"] = tools
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )


def encode_prompt(
    tokenizer,
    question: str,
    system_prompt: str | None = None,
    enable_thinking: bool | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """`render_prompt`'s text as token ids (`encode_chat`): the question and the system prompt
    as plain text, the template's own tags as special tokens. Without special-token text in
    them, the ids of `tokenizer(render_prompt(...), add_special_tokens=False)`."""
    messages, kwargs = _prompt_messages(tokenizer, question, system_prompt, enable_thinking)
    return encode_chat(tokenizer, messages, tools=tools or None, **kwargs)


def _prompt_messages(tokenizer, question, system_prompt, enable_thinking) -> tuple[list, dict]:
    """The messages and template kwargs of `render_prompt`."""
    if not getattr(tokenizer, "chat_template", None):
        raise GrpoError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "use an instruct/chat tokenizer or set one with tokenizer.chat_template"
        )
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return messages, kwargs


def stop_ids(tokenizer, model_dir: str | Path | None = None) -> list[int]:
    """Token ids that end a completion: the tokenizer's eos plus generation_config's eos."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        gen = Path(model_dir) / "generation_config.json"
        if gen.is_file():
            config = read_json(gen, "a generation_config.json object")
            eos = config.get("eos_token_id") if isinstance(config, dict) else None
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise GrpoError("the tokenizer has no eos token and no generation_config eos_token_id")
    return sorted(ids)
