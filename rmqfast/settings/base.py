"""The helpers every configuration section is parsed with: a leaf that imports no feature.

Each helper takes the dotted key for its error messages and raises :class:`ConfigError` naming
the key, the value (written as TOML writes it) and what is allowed; :class:`Errors` collects the
errors of independent checks so a file's problems are all reported at once
(:class:`ConfigErrors`). :mod:`rmqfast.config` and the features' own settings modules
(``rmqfast.delay.settings``, ``rmqfast.proxy.tls``...) import them from here, never from
``rmqfast.config``: that would close an import circle through every feature.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rmqfast.errors import ConfigError, ConfigErrors

__all__ = [
    "ConfigError", "ConfigErrors", "Errors", "boolean", "check_keys", "choice", "integer", "seconds",
    "string", "table", "toml_value", "valid_host",
]


def toml_value(value: Any, limit: int = 80) -> str:
    """``value`` as it is written in TOML (``true``, ``"text"``, ``[1, 2]``), cut at ``limit``."""
    if value is None:
        text = "nothing"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, list):
        text = "[" + ", ".join(toml_value(v, limit) for v in value[:20]) + (", ..." if len(value) > 20 else "") + "]"
    elif isinstance(value, dict):
        text = "{ " + ", ".join(f"{k} = {toml_value(v, limit)}" for k, v in list(value.items())[:20]) + " }"
        text = "{}" if not value else text
    elif hasattr(value, "isoformat"):
        text = value.isoformat()
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_t = toml_value


class Errors:
    """Collects the errors of independent checks: ``with errs.check(): ...`` per check."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ConfigErrors as exc:
            self.messages.extend(exc.errors)
        except ConfigError as exc:
            self.messages.append(str(exc))

    def any_under(self, *prefixes: str) -> bool:
        return any(m.startswith(prefixes) for m in self.messages)

    def raise_if_any(self) -> None:
        if len(self.messages) == 1:
            raise ConfigError(self.messages[0])
        if self.messages:
            raise ConfigErrors(self.messages)


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def valid_host(host: str) -> bool:
    """An IP address or a DNS host name (letters, digits, '-', '_' in dot-separated labels)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    return 0 < len(name) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in name.split("."))


def integer(key: str, value: Any, lo: int, hi: int, what: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected an integer from {lo}{what} to {hi}")
    return value


def seconds(key: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a number of seconds from {lo} to {hi}")
    return float(value)


def string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a string")
    return value


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected true or false")
    return value


def choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected one of {', '.join(choices)}")
    return str(value)


def table(key: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {_t(value)} is not allowed; expected a table")
    return value


def check_keys(prefix: str, tbl: dict[str, Any], allowed: set[str]) -> None:
    """Every key of ``tbl`` not in ``allowed``, reported at once with the keys allowed there."""
    bad = []
    for k in tbl:
        if k not in allowed:
            where = f"{prefix}.{k}" if prefix else k
            bad.append(f"{where}: unknown key; allowed here: {', '.join(sorted(allowed))}")
    if len(bad) == 1:
        raise ConfigError(bad[0])
    if bad:
        raise ConfigErrors(bad)
