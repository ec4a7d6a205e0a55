"""The file boundary: every file the library reads or writes goes through these functions, so
a missing, unreadable, malformed or wrongly encoded file, or a full disk, becomes one `FileError`
line that names the file and what was expected, never a traceback from json, safetensors or
torch.

Reads: `read_text` / `open_text` (UTF-8; a leading byte-order mark is dropped), `read_json`,
`load_safetensors` / `safetensors_file` (lazy, tensor by tensor), `torch_load`
(`weights_only=True`: nothing beyond tensors and plain containers is unpickled).
Writes: `write_text` (optionally atomic), `open_text(mode="w" | "a")`, `save_safetensors`,
`torch_save`, or any block under `writing(path)`. A full disk (ENOSPC), an exhausted quota
(EDQUOT) or the file-size limit (EFBIG) is named as such, whichever layer hit it: Python's
file objects raise OSError, the safetensors Rust writer a SafetensorError carrying
"(os error N)", torch's zip writer a RuntimeError whose context is the OSError of the file
object it writes through.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from grpo.errors import GrpoError

# errno -> what the one-line message says: the disk-is-full family gets a plain name.
_FULL = {
    errno.ENOSPC: "no space left on device (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EFBIG: "file too large for the filesystem or the file-size limit (EFBIG)",
}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust (safetensors) formats an errno
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class FileError(GrpoError):
    """A file could not be read, parsed or written; the message names it (one line)."""

    def __init__(self, message: str, path: str | Path | None = None):
        super().__init__(message)  # args == (message,): pickles like any exception
        self.path = Path(path) if path is not None else None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _errno(exc: BaseException) -> int | None:
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        match = _OS_ERROR.search(str(e))
        if match:
            return int(match.group(1))
    return None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = _ANSI.sub("", str(exc)).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _reason(exc: BaseException) -> str:
    """A short cause: the disk-full family by name, else the OS's words, else the first line."""
    code = _errno(exc)
    if code in _FULL:
        return _FULL[code]
    for e in _chain(exc):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror[0].lower() + e.strerror[1:]
    return _first_line(exc)


def _read_error(path: Path, expected: str, exc: BaseException) -> FileError:
    if isinstance(exc, FileNotFoundError):
        why = "no such file"
    elif isinstance(exc, IsADirectoryError):
        why = "is a directory"
    elif isinstance(exc, UnicodeDecodeError):
        data = exc.object if isinstance(exc.object, bytes) else b""
        line = data[: exc.start].count(b"\n") + 1
        bad = data[exc.start : exc.start + 1].hex()
        why = f"not UTF-8 text (byte 0x{bad} on line {line}, offset {exc.start})"
    elif isinstance(exc, json.JSONDecodeError):
        why = f"invalid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg})"
    elif isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc):
        why = "holds objects other than tensors and plain containers (refused: weights_only)"
    elif isinstance(exc, OSError):
        why = f"cannot be read ({_reason(exc)})"
    else:
        why = f"is corrupt or truncated ({_first_line(exc)})"
    return FileError(f"{path}: {why}; expected {expected}", path)


_READ_ERRORS = (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError)


@contextmanager
def reading(path: str | Path, expected: str) -> Iterator[None]:
    """Turn a failure to read, decode or parse `path` inside the block into one FileError.

    Args:
        path: the file being read (named in the message).
        expected: what the file should be, e.g. "a Hugging Face config.json".
    """
    try:
        yield
    except GrpoError:
        raise
    except _READ_ERRORS as e:
        raise _read_error(Path(path), expected, e) from None


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn a failed write of `path` inside the block (full disk, quota, file-size limit,
    permissions, a directory in the way) into one FileError naming the file and the cause."""
    try:
        yield
    except GrpoError:
        raise
    except (OSError, SafetensorError) as e:
        raise FileError(f"could not write {path}: {_reason(e)}", path) from None
    except RuntimeError as e:  # torch's zip writer; only an I/O failure underneath is ours
        if not any(isinstance(c, OSError) for c in _chain(e)):
            raise
        raise FileError(f"could not write {path}: {_reason(e)}", path) from None


# --------------------------------------------------------------------------- reads


def read_text(path: str | Path, expected: str = "UTF-8 text") -> str:
    """The file's text, decoded as UTF-8 (a leading byte-order mark is dropped)."""
    with reading(path, expected):
        return Path(path).read_bytes().decode("utf-8-sig")


def read_json(path: str | Path, expected: str = "a JSON file") -> Any:
    """The parsed JSON of `path` (UTF-8, with or without a byte-order mark)."""
    with reading(path, expected):
        return json.loads(Path(path).read_bytes().decode("utf-8-sig"))


@contextmanager
def open_text(path: str | Path, mode: str = "r", expected: str = "UTF-8 text"):
    """A text file for streaming: "r" reads UTF-8 (byte-order mark dropped), "w" / "a" write
    UTF-8. Failures inside the block, including the close, are one FileError."""
    if mode not in ("r", "w", "a"):
        raise ValueError(f"open_text: mode must be r, w or a, got {mode!r}")
    guard = reading(path, expected) if mode == "r" else writing(path)
    encoding = "utf-8-sig" if mode == "r" else "utf-8"
    with guard, open(path, mode, encoding=encoding, newline="" if mode == "r" else None) as f:
        yield f


def load_safetensors(path: str | Path) -> dict:
    """Every tensor of a safetensors file, on the CPU."""
    from safetensors.torch import load_file

    with reading(path, "a safetensors file"):
        return load_file(str(path))


class _SafetensorsFile:
    """`safe_open`'s handle with each access checked (a truncated file fails on the tensor)."""

    def __init__(self, handle, path: Path):
        self._f, self.path = handle, path

    def keys(self) -> list[str]:
        with reading(self.path, "a safetensors file"):
            return list(self._f.keys())

    def get_tensor(self, key: str):
        with reading(self.path, f"a safetensors file (tensor {key!r})"):
            return self._f.get_tensor(key)


@contextmanager
def safetensors_file(path: str | Path) -> Iterator[_SafetensorsFile]:
    """A safetensors file opened lazily (tensors are read one by one), errors checked."""
    from safetensors import safe_open

    path = Path(path)
    with reading(path, "a safetensors file"):
        handle = safe_open(str(path), framework="pt", device="cpu")
    with handle:
        yield _SafetensorsFile(handle, path)


def torch_load(path: str | Path, expected: str = "a torch state file", map_location=None) -> Any:
    """`torch.load(weights_only=True)`: tensors and plain containers only, never code."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except GrpoError:
        raise
    except (*_READ_ERRORS, RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise _read_error(Path(path), expected, e) from None


# --------------------------------------------------------------------------- writes


def write_text(path: str | Path, text: str, atomic: bool = False) -> Path:
    """Write UTF-8 text. `atomic`: through a temporary file renamed over `path`, so a reader
    (or a later run) sees the old file or the new one, never half of one."""
    path = Path(path)
    if not atomic:
        with writing(path):
            path.write_text(text, encoding="utf-8")
        return path
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(path: str | Path, data: Any, atomic: bool = True, indent: int | None = 2) -> Path:
    """`data` as JSON (atomic by default; see `write_text`)."""
    return write_text(path, json.dumps(data, indent=indent) + "\n", atomic=atomic)


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> Path:
    """`safetensors.torch.save_file`, its write failures as one FileError."""
    from safetensors.torch import save_file

    with writing(path):
        save_file(tensors, str(path), metadata=metadata)
    return Path(path)


def torch_save(obj: Any, path: str | Path) -> Path:
    """`torch.save` through a Python file object, so that a failed write surfaces its errno
    (torch's own path writer reports only "unexpected pos")."""
    import torch

    with writing(path), open(path, "wb") as f:
        torch.save(obj, f)
    return Path(path)


def check_output_file(path: str | Path, flag: str) -> Path:
    """Fail at once (before any work) if `path` cannot become a file: it is a directory, or
    the nearest existing parent is not a directory.

    Args:
        path: the output file to be written later.
        flag: the option or field that named it, e.g. "--out".
    """
    p = Path(path)
    if p.is_dir():
        raise FileError(f"{flag} {p}: is a directory; expected a file path", p)
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise FileError(f"{flag} {p}: {parent} is a file, not a directory", p)
    if not os.access(parent, os.W_OK):
        raise FileError(f"{flag} {p}: directory {parent} is not writable", p)
    return p


_HUB_PROBES: dict[tuple[str, int], str | None] = {}


def hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be reached, in a few words, or None when it answers a
    TCP connect within `timeout_s` (checked once per process). With HF_HUB_OFFLINE set the
    libraries read their caches and fail fast on their own: None. Offline, the libraries'
    own calls retry for half a minute before failing; this lets a hub id fail in seconds."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("", "0", "false", "no", "off"):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    key = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    if key not in _HUB_PROBES:
        try:
            socket.create_connection(key, timeout=timeout_s).close()
            _HUB_PROBES[key] = None
        except OSError as e:
            _HUB_PROBES[key] = f"{key[0]}:{key[1]}: {e.strerror or e}"
    return _HUB_PROBES[key]
