"""The settings engine: a section is a dataclass whose fields carry their own declaration.

A field is declared once, with :func:`setting`: its default, its kind (integer, number, duration,
size, boolean, string, choice), its bounds, its unit and a one-line doc. From that one declaration
the engine parses the TOML table (every problem reported at once, in one wording), writes the
value back as TOML, rebuilds the section from the JSON a worker receives, and writes the reference
page ``docs/configuration-reference.md`` (:mod:`rmqfast.settings.reference`). Adding a field is
adding one ``name: type = setting(...)`` line to its section::

    @section("log", "How the proxy logs.")
    @dataclass
    class LogSection:
        format: str = setting("json", choices=("json", "human"), doc="one JSON object per line, or text")

A feature declares its section in its own package and registers it with :func:`section`; this
module imports no feature. Durations are written ``"250ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"1d"``
and sizes ``"512B"``, ``"64KiB"``, ``"16MiB"``, ``"1GiB"`` everywhere; a plain number still means
seconds or bytes, so configurations written before keep working.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rmqfast.errors import ConfigError
from rmqfast.settings.base import Errors, check_keys, table, toml_value

__all__ = ["Setting", "SectionSpec", "section", "setting", "sections", "parse_section", "revive", "parse_duration",
           "parse_size", "format_duration", "format_size", "render"]

T = TypeVar("T")
KINDS = ("int", "float", "duration", "size", "bool", "str", "choice", "custom")


@dataclass(frozen=True)
class Setting:
    """What one field is: read by the parser, the renderer and the reference generator."""

    doc: str
    kind: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    unit: str = ""
    #: a duration or timeout where 0 means "off" and anything else must be at least ``lo``
    zero_off: bool = False
    #: the TOML key when it differs from the field name (``[[replicate.topic]]`` fills ``topics``)
    key: str = ""
    #: ``parse(dotted_key, value) -> field value`` for the kinds the engine does not know
    parse: Callable[[str, Any], Any] | None = None
    #: how the kind is described in the reference when ``parse`` is custom
    expect: str = ""
    #: what the bounds mean at the low end, e.g. " (one per CPU)"
    what: str = ""
    #: a key the table must have (its absence is reported as its default being refused)
    required: bool = False


def setting(default: Any = dataclasses.MISSING, *, doc: str, kind: str = "", lo: float | None = None,
            hi: float | None = None, choices: tuple[str, ...] = (), unit: str = "", zero_off: bool = False,
            key: str = "", parse: Callable[[str, Any], Any] | None = None, expect: str = "", what: str = "",
            required: bool = False, factory: Callable[[], Any] | None = None) -> Any:
    """One field's whole declaration; ``kind`` is guessed from the default when left out."""
    if not kind:
        if parse is not None:
            kind = "custom"
        elif choices:
            kind = "choice"
        elif isinstance(default, bool):
            kind = "bool"
        elif isinstance(default, int):
            kind = "int"
        elif isinstance(default, float):
            kind = "float"
        elif isinstance(default, str):
            kind = "str"
        else:
            raise TypeError(f"setting(doc={doc!r}): give kind= or parse= (default {default!r} says nothing)")
    if kind not in KINDS:
        raise TypeError(f"setting(doc={doc!r}): kind {kind!r} is not one of {', '.join(KINDS)}")
    meta = {"setting": Setting(doc, kind, lo, hi, choices, unit, zero_off, key, parse, expect, what, required)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class SectionSpec:
    name: str
    cls: type
    doc: str
    #: ``parse(raw_table) -> section`` for sections with their own parser (the engine's otherwise)
    parse: Callable[[Any], Any] | None = None


_REGISTRY: dict[str, SectionSpec] = {}


def section(name: str, doc: str, parse: Callable[[Any], Any] | None = None) -> Callable[[type[T]], type[T]]:
    """Class decorator: register ``cls`` as the section ``[name]`` (its feature's own declaration)."""

    def register(cls: type[T]) -> type[T]:
        old = _REGISTRY.get(name)
        if old is not None and old.cls.__qualname__ != cls.__qualname__:
            raise TypeError(f"section [{name}] is declared twice: {old.cls.__module__} and {cls.__module__}")
        _REGISTRY[name] = SectionSpec(name, cls, doc, parse)
        return cls

    return register


def sections() -> dict[str, SectionSpec]:
    """Every registered section by name (those whose modules were imported)."""
    return dict(_REGISTRY)


def fields_of(cls: type) -> list[tuple[dataclasses.Field[Any], Setting]]:
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


# --------------------------------------------------------------------------------------
# Durations and sizes: one style everywhere.

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|TiB)\s*$")
_SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def format_duration(seconds: float) -> str:
    """``30.0`` -> ``"30s"``, ``0.25`` -> ``"250ms"``, ``7200`` -> ``"2h"`` (the largest whole unit)."""
    for unit in ("d", "h", "m", "s"):
        n = seconds / _DURATION_UNITS[unit]
        if seconds and n == int(n) and n >= 1:
            return f"{int(n)}{unit}"
    ms = seconds * 1000
    return f"{int(ms)}ms" if ms == int(ms) else f"{seconds:g}s"


def format_size(n: int) -> str:
    """``65536`` -> ``"64KiB"`` (the largest whole unit), ``1000`` -> ``"1000B"``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if n and n % _SIZE_UNITS[unit] == 0:
            return f"{n // _SIZE_UNITS[unit]}{unit}"
    return f"{n}B"


def _range(s: Setting, fmt: Callable[[Any], str]) -> str:
    if s.lo is None or s.hi is None:
        return ""
    if s.zero_off:
        return f" of 0 (no deadline) or from {fmt(s.lo)}{s.what} to {fmt(s.hi)}"
    return f" from {fmt(s.lo)}{s.what} to {fmt(s.hi)}"


def expectation(s: Setting) -> str:
    """What a field takes, in the words of its error messages and of the reference page."""
    if s.expect:
        return s.expect
    if s.kind == "int":
        return "an integer" + _range(s, lambda v: str(int(v)))
    if s.kind == "float":
        return "a number" + _range(s, lambda v: f"{v:g}")
    if s.kind == "duration":
        return ("a duration" + _range(s, format_duration)
                + ' such as "250ms", "30s", "5m" (a plain number counts as seconds)')
    if s.kind == "size":
        return ("a size" + _range(s, lambda v: format_size(int(v)))
                + ' such as "64KiB", "16MiB" (a plain number counts as bytes)')
    if s.kind == "bool":
        return "true or false"
    if s.kind == "str":
        return "a string"
    if s.kind == "choice":
        return "one of " + ", ".join(s.choices)
    return s.expect or "see the section's documentation"


def _bad(key: str, value: Any, s: Setting) -> ConfigError:
    return ConfigError(f"{key}: {toml_value(value)} is not allowed; expected {expectation(s)}")


def _in(s: Setting, v: float) -> bool:
    if s.zero_off and v == 0:
        return True
    return (s.lo is None or v >= s.lo) and (s.hi is None or v <= s.hi)


def parse_duration(key: str, value: Any, s: Setting | None = None) -> float:
    """Seconds of ``"250ms"``, ``"30s"``, ``"1.5m"``, ``"2h"``, ``"1d"`` or a plain number of seconds."""
    s = s or Setting("", "duration")
    secs: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        secs = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            secs = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if secs is None or secs != secs or secs < 0 or not _in(s, secs):
        raise _bad(key, value, s)
    return secs


def parse_size(key: str, value: Any, s: Setting | None = None) -> int:
    """Bytes of ``"512B"``, ``"64KiB"``, ``"16MiB"``, ``"1GiB"``, ``"1TiB"`` or a plain integer of bytes."""
    s = s or Setting("", "size")
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            n = int(m.group(1)) * _SIZE_UNITS[m.group(2)]
    if n is None or n < 0 or not _in(s, n):
        raise _bad(key, value, s)
    return n


def parse_value(key: str, value: Any, s: Setting) -> Any:
    """One value checked against its declaration; :class:`ConfigError` in the one wording."""
    if s.parse is not None:
        return s.parse(key, value)
    if s.kind == "duration":
        return parse_duration(key, value, s)
    if s.kind == "size":
        return parse_size(key, value, s)
    if s.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not _in(s, value):
            raise _bad(key, value, s)
        return value
    if s.kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or not _in(s, value):
            raise _bad(key, value, s)
        return float(value)
    if s.kind == "bool":
        if not isinstance(value, bool):
            raise _bad(key, value, s)
        return value
    if s.kind == "str":
        if not isinstance(value, str):
            raise _bad(key, value, s)
        return value
    if s.kind == "choice":
        if value not in s.choices:
            raise _bad(key, value, s)
        return str(value)
    raise TypeError(f"{key}: kind {s.kind!r} needs parse=")


def toml_keys(cls: type) -> dict[str, str]:
    """TOML key -> field name for a declared section."""
    return {(s.key or f.name): f.name for f, s in fields_of(cls)}


def parse_section(cls: type[T], name: str, raw: Any, errs: Errors | None = None) -> T:
    """``[name]`` parsed into ``cls``: unknown keys and bad values all reported (one wording).

    A section may define ``check(self) -> list[str]`` for checks across its fields (a field that
    did not parse holds its default there)."""
    own = errs is None
    errs = errs if errs is not None else Errors()
    obj = cls()
    with errs.check():
        tbl = table(name, raw)
        keys = toml_keys(cls)
        with errs.check():
            check_keys(name, tbl, set(keys))
        decl = {f.name: s for f, s in fields_of(cls)}
        for k, fname in keys.items():
            if k in tbl or decl[fname].required:
                with errs.check():
                    value = tbl[k] if k in tbl else getattr(obj, fname)
                    setattr(obj, fname, parse_value(f"{name}.{k}", value, decl[fname]))
        check = getattr(obj, "check", None)
        if check is not None:
            errs.messages.extend(check())
    if own:
        errs.raise_if_any()
    return obj


# --------------------------------------------------------------------------------------
# JSON back into dataclasses (a worker's copy of the configuration), driven by the type hints.

def revive(tp: Any, value: Any) -> Any:
    """``value`` (from ``json.loads(json.dumps(asdict(x)))``) rebuilt as type ``tp``."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return revive(args[0], value) if len(args) == 1 else value
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return [revive(arg, v) for v in value]
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(revive(args[0], v) for v in value)
        return tuple(revive(a, v) for a, v in zip(args, value, strict=False))
    if origin is dict:
        _, arg = typing.get_args(tp) or (Any, Any)
        return {k: revive(arg, v) for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        from_dict = getattr(tp, "from_dict", None)
        if from_dict is not None:
            return from_dict(value)
        hints = typing.get_type_hints(tp)
        kw = {f.name: revive(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)
              if f.init and f.name in value}
        return tp(**kw)
    return value


# --------------------------------------------------------------------------------------
# Values written as TOML.

def render(value: Any, s: Setting | None = None) -> str:
    """A field's value as it is written in the TOML file (durations and sizes in their style)."""
    if s is not None and isinstance(value, int | float) and not isinstance(value, bool):
        if s.kind == "duration":  # unit "ms": the field holds milliseconds
            return f'"{format_duration(value / 1000 if s.unit == "ms" else value)}"'
        if s.kind == "size":
            return f'"{format_size(int(value))}"'
    return toml_value(_plain(value), limit=10_000)


def _plain(value: Any) -> Any:
    """Dataclasses as tables, except those with their own text (``HostPort``: ``"host:port"``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if type(value).__str__ is not object.__str__:
            return str(value)
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
