"""Typed settings: frozen dataclasses built from untrusted nested dicts (a config section, tool
JSON, an HTTP body), with coercion by annotation and one clear error per bad field.

    @dataclass(frozen=True)
    class Job(Settings):  # Settings runs each field's check on every construction
        prompts: tuple[str, ...] = setting(check=non_empty)  # a YAML/JSON list becomes a tuple
        temperature: float = setting(1.0, check=between(0, 2))  # an int becomes a float
    job = build_settings(Job, {"prompts": ["2+2?"], "temperature": 3}, prefix="job")

raises a `ConfigError` (a `FieldError`) of one line, `job.temperature: must be in [0, 2], got
3.0`, with `.field == "job.temperature"`. Unknown keys (listing the valid ones), wrong types,
missing required fields and failed checks all fail the same way: one line naming the dotted
field and what was expected. The run config (`grpo.config`) and the applications' settings
(demo, sweep, pipeline, tool, serve) are all read by `build_settings`.

For a reader of its own (the run config's dotted overrides): `require(ok, field, problem)`
(a rule across fields, in `__post_init__`), `coerce(value, tp, field)` (one value as a field
of annotation `tp` reads it) and `type_hints(cls)` (a settings class's resolved annotations).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo.errors import GrpoError


class ConfigError(GrpoError):
    """A bad configuration value or key; the message names the dotted field (`field`, where
    known: what `build_settings` and the field checks raise)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def problem(self) -> str:
        """The message without its leading ``field: ``."""
        text, head = str(self), f"{self.field}: "
        return text[len(head) :] if self.field and text.startswith(head) else text


class FieldError(ConfigError):
    """A field check failed; `field` is relative to the dataclass that checked it, and
    `build_settings` puts the dotted path of a nested one in front."""


def require(ok: bool, name: str, problem: str) -> None:
    """A rule across fields, or one `setting(check=)` cannot say: unless `ok`, a `ConfigError`
    of one line, ``name: problem``, naming the dotted field (`.field == name`)."""
    if not ok:
        raise ConfigError(f"{name}: {problem}", field=name)


def brief_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut short: an error line never echoes a whole prompt back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- field checks


def setting(
    default: Any = dataclasses.MISSING,
    *,
    check: Callable[[Any], str | None] | None = None,
    factory: Any = dataclasses.MISSING,
    **metadata: Any,
) -> Any:
    """A settings field whose value `check(value) -> problem or None` approves; the dataclass
    runs the checks by deriving from `Settings` (or calling `check_fields(self)`). Other
    metadata (e.g. the config field a tool parameter sets) is kept for whoever reads it."""
    return field(default=default, default_factory=factory, metadata={"check": check, **metadata})


def setting_key(f: dataclasses.Field) -> str:
    """The key a field is read from and written as: its name, or `setting(key=...)` where the
    key cannot be a Python name (`rollout.async` is the field `async_`)."""
    return f.metadata.get("key", f.name)


def check_fields(obj: Any) -> None:
    """Run each field's `setting(check=...)` on its value (None is "not set" and passes); the
    first problem raises a `FieldError` naming the field."""
    for f in dataclasses.fields(obj):
        check, value = f.metadata.get("check"), getattr(obj, f.name)
        if check is not None and value is not None:
            check_value(setting_key(f), value, check)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Base of a settings dataclass whose fields carry checks (`setting(check=...)`): they run
    on every construction. A subclass with checks across fields extends `__post_init__`."""

    def __post_init__(self):
        check_fields(self)


def check_value(name: str, value: Any, check: Callable[[Any], str | None]) -> None:
    """`check` on a plain argument: a `FieldError` naming it."""
    problem = check(value)
    if problem:
        raise FieldError(f"{name}: {problem}", field=name)


def between(lo=None, hi=None, *, lo_open: bool = False, hi_open: bool = False):
    """A check: lo <= value <= hi (< with `*_open`; a bound of None is no bound)."""

    def check(v):
        if (lo is None or (v > lo if lo_open else v >= lo)) and (
            hi is None or (v < hi if hi_open else v <= hi)
        ):
            return None
        if hi is None:
            return f"must be {'>' if lo_open else '>='} {lo}, got {brief_repr(v)}"
        if lo is None:
            return f"must be {'<' if hi_open else '<='} {hi}, got {brief_repr(v)}"
        left, right = "(["[not lo_open], ")]"[not hi_open]
        return f"must be in {left}{lo}, {hi}{right}, got {brief_repr(v)}"

    return check


def one_of(choices):
    """A check: the value is one of `choices` (names known only at run time; else `Literal`)."""
    return lambda v: (
        None if v in choices else f"must be one of {sorted(choices)}, got {brief_repr(v)}"
    )


def only(*allowed):
    """A check for a value accepted only where it changes nothing (e.g. an OpenAI field)."""
    return lambda v: None if v in allowed else f"not supported (only {allowed[0]!r})"


def non_empty(v) -> str | None:
    """A check: a string with more than white space, or a list with something in it."""
    empty = not v.strip() if isinstance(v, str) else len(v) == 0
    return "must not be empty" if empty else None


# --------------------------------------------------------------------------- building


def _expected(tp: Any) -> str:
    """What a value of annotation `tp` looks like, in words."""
    words = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true/false",
        dict: "a mapping",
        tuple: "a list",
        list: "a list",
    }
    origin = typing.get_origin(tp) or tp
    if origin is Literal:
        return f"one of {list(typing.get_args(tp))}"
    if dataclasses.is_dataclass(origin):
        return "a mapping"
    if origin is Callable:
        return "a function"
    return words.get(origin) or getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _expect(ok: bool, name: str, what: str, value: Any) -> None:
    """Raise "name: what, got value" unless ok (the message is built only on failure)."""
    if not ok:
        raise ConfigError(f"{name}: {what}, got {brief_repr(value)}", field=name)


def coerce(value: Any, tp: Any, name: str, nulls: bool = False) -> Any:
    """One value read as a field annotated `tp` would be (what `build_settings` does to each
    field): checked against the annotation, lists converted to tuples and ints to floats,
    nested dataclasses built; a mismatch is a `ConfigError` naming `name` (the dotted field).
    `nulls`: `build_settings`'s null_is_default, for nested settings."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        errors = []
        for arg in args:
            try:
                return coerce(value, arg, name, nulls)
            except ConfigError as e:
                errors.append(e)
        deeper = [e for e in errors if e.field != name]  # got past an alternative's outer type
        if len(errors) == 1 or deeper:
            raise (deeper or errors)[0]
        expected = " or ".join(_expected(a) for a in args)
        raise ConfigError(f"{name}: expected {expected}, got {brief_repr(value)}", field=name)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool) and {"on", "off"} <= set(allowed):  # YAML 1.1 reads on/off
            value = "on" if value else "off"  # as booleans: `shared_prefix: on` means "on"
        _expect(value in allowed, name, f"must be one of {list(allowed)}", value)
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        _expect(isinstance(value, (list, tuple)), name, "expected a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{name}[{i}]", nulls) for i, v in enumerate(value))
        require(len(value) == len(args), name, f"expected {len(args)} values, got {len(value)}")
        items = enumerate(zip(value, args))
        return tuple(coerce(v, a, f"{name}[{i}]", nulls) for i, (v, a) in items)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        _expect(isinstance(value, dict), name, "expected a mapping", value)
        return _build(tp, value, name, nulls)
    if tp is dict or origin is dict:
        _expect(isinstance(value, dict), name, "expected a mapping", value)
        return dict(value)
    if tp is Callable or origin is Callable:
        _expect(callable(value), name, "expected a function", value)
        return value
    if tp is bool:
        _expect(isinstance(value, bool), name, "expected true/false", value)
        return value
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        _expect(ok, name, "expected an integer", value)
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _expect(ok, name, "expected a number", value)
        try:
            value = float(value)
        except OverflowError:  # an integer beyond float's range (JSON allows it)
            raise ConfigError(
                f"{name}: beyond a float's range: {brief_repr(value)}", field=name
            ) from None
        # .inf / .nan would pass or dodge the range checks and surface mid-run
        _expect(math.isfinite(value), name, "must be a finite number", value)
        return value
    if tp is str:
        _expect(isinstance(value, str), name, "expected a string", value)
        return value
    raise ConfigError(f"{name}: unsupported type {_expected(tp)}", field=name)


def build_settings(cls, data: dict, prefix: str = "", *, null_is_default: bool = False):
    """A frozen settings dataclass `cls` from an untrusted mapping (a config section, tool
    JSON, an HTTP body): unknown keys, wrong types, missing required fields and failed checks
    (`setting(check=)`, `__post_init__`) are one `ConfigError` line naming the dotted field
    (`prefix.key`, also in `.field`) and what was expected.

    With `null_is_default`, a null given for a field that cannot hold one means "the default"
    (what JSON clients send for "not set"), at every level; elsewhere null is a value or a
    type error.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {brief_repr(data)}")
    return _build(cls, data, prefix, null_is_default)


@functools.cache
def type_hints(cls) -> dict[str, Any]:
    """The resolved annotations of a settings class, field name -> type (evaluated once:
    strings under `from __future__ import annotations`); what `coerce` takes as `tp`."""
    return typing.get_type_hints(cls)


def _admits_none(tp: Any) -> bool:
    return tp is Any or type(None) in typing.get_args(tp)


def _build(cls, data: dict, prefix: str = "", nulls: bool = False):
    hints = type_hints(cls)
    if nulls:  # a null for a field that cannot hold one: the default (unknown keys stay)
        data = {k: v for k, v in data.items() if v is not None or _admits_none(hints.get(k, Any))}
    fields = {setting_key(f): f for f in dataclasses.fields(cls) if f.init}
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key; valid keys{' of ' + prefix if prefix else ''}: "
            f"{', '.join(sorted(fields)) or 'none'}",
            field=f"{where}{unknown[0]}",
        )
    kwargs = {}
    for key, value in data.items():
        name = fields[key].name
        kwargs[name] = coerce(value, hints[name], f"{where}{key}", nulls)
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in kwargs
    ]
    if required:
        raise ConfigError(f"{where}{required[0]}: is required", field=f"{where}{required[0]}")
    try:
        return cls(**kwargs)
    except FieldError as e:  # a field check: relative to cls, so put the path in front
        if not prefix:
            raise
        raise FieldError(f"{where}{e}", field=f"{where}{e.field}") from None
    except TypeError as e:  # should not happen after the checks above
        raise ConfigError(f"{prefix or 'config'}: {e}") from None
