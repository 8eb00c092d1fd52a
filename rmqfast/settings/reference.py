"""Text generated from the declarations: the reference part of ``docs/configuration.md`` and the
"changed from the defaults" lines of ``rmqfast check-config``.

Nothing here is written by hand per field: a field added to a section appears in both the moment
it is declared (:func:`rmqfast.settings.engine.setting`). ``tests/test_settings_engine.py`` fails
when the page in ``docs/`` is stale; ``python -m rmqfast.checkconfig --write-reference`` rewrites it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rmqfast.settings.engine import SectionSpec, expectation, fields_of, render

BEGIN = "<!-- BEGIN GENERATED: settings reference (python -m rmqfast.checkconfig --write-reference) -->"
END = "<!-- END GENERATED: settings reference -->"


def _default(f: dataclasses.Field[Any], s: Any) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING
    return f.default_factory()


def _cell(text: str) -> str:
    """Table text: '|' escaped, '<' and '>' as entities (not taken for HTML tags)."""
    return _code(text).replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    """A code span's text in a table cell: only '|' escaped."""
    return text.replace("|", "\\|").replace("\n", " ")


def reference(specs: dict[str, SectionSpec]) -> str:
    """Every registered section, one table row per declared field, in TOML terms."""
    out = ["Durations are written `\"250ms\"`, `\"30s\"`, `\"5m\"`, `\"2h\"`, `\"1d\"` and sizes `\"512B\"`, "
           "`\"64KiB\"`, `\"16MiB\"`, `\"1GiB\"`; a plain number still counts as seconds or bytes.", ""]
    for name in sorted(specs):
        spec = specs[name]
        decl = fields_of(spec.cls)
        out += [f"### `[{name}]`", "", spec.doc + f" Declared in `{spec.cls.__module__}`.", ""]
        if not decl:
            out += ["Checked by its own parser; see the feature's page for its keys.", ""]
            continue
        out += ["| key | default | takes | what |", "|---|---|---|---|"]
        for f, s in decl:
            out.append(f"| `{s.key or f.name}` | `{_code(render(_default(f, s), s))}` | {_cell(expectation(s))} "
                       f"| {_cell(s.doc)} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def replace_generated(page: str, body: str) -> str:
    """``page`` with the text between :data:`BEGIN` and :data:`END` replaced by ``body``."""
    if BEGIN not in page or END not in page:
        raise ValueError(f"the page has no generated part: add the lines {BEGIN!r} and {END!r}")
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n\n{body}\n{END}{tail}"


def changed(name: str, obj: Any) -> list[str]:
    """``name.key = value`` (TOML) for each declared field of a section that differs from its default."""
    out = []
    for f, s in fields_of(type(obj)):
        value = getattr(obj, f.name)
        if value != _default(f, s):
            out.append(f"{name}.{s.key or f.name} = {render(value, s)}")
    return out
