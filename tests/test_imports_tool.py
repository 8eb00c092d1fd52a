"""tools/imports.py, the import-structure counter, on a small package made here: each count it
reports for rmqfast (cycles, imports against the layers, private names, function-local imports)
is checked on a case built to have exactly one or none."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "imports.py"

PYPROJECT = """
[[tool.importlinter.contracts]]
name = "layers"
type = "layers"
layers = ["rmqfast.high", "rmqfast.mid | rmqfast.side", "rmqfast.low"]
"""


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("imports_tool", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"rmqfast/__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "pyproject.toml").write_text(PYPROJECT)
    return root


def test_a_clean_tree_counts_nothing(tool: ModuleType, tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "rmqfast/low/__init__.py": "X = 1\n",
        "rmqfast/mid/__init__.py": "from rmqfast.low import X\n",
        "rmqfast/high.py": "import rmqfast.mid\nfrom rmqfast.low import X\n",
    })
    modules, found = tool.collect(root)
    assert len(found) == 3
    assert tool.cycles(modules, found) == []
    assert tool.upward(found, tool.read_layers(root / "pyproject.toml")) == []
    assert tool.private_across(found) == []
    assert [i for i in found if i.local] == []


def test_each_kind_of_offence_is_counted_once(tool: ModuleType, tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "rmqfast/low/__init__.py": "_HIDDEN = 1\n",
        "rmqfast/low/a.py": "def f():\n    from rmqfast.mid import b  # climbs, function-local\n",
        "rmqfast/mid/__init__.py": "",
        "rmqfast/mid/b.py": "from rmqfast.low import a\nfrom rmqfast.low import _HIDDEN\n",
        "rmqfast/side.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rmqfast.high\n",
        "rmqfast/high.py": "import rmqfast.side\n",
    })
    modules, found = tool.collect(root)
    runtime = [i for i in found if not i.local and not i.type_checking]
    assert tool.cycles(modules, runtime) == []  # the circle closes only through a function-local import
    assert sorted(tool.cycles(modules, found)) == [["rmqfast.high", "rmqfast.side"], ["rmqfast.low.a", "rmqfast.mid.b"]]
    up = tool.upward(found, tool.read_layers(root / "pyproject.toml"))
    assert sorted((i.source, i.target) for i in up) == [("rmqfast.low.a", "rmqfast.mid.b"),
                                                         ("rmqfast.side", "rmqfast.high")]
    private = tool.private_across(found)
    assert [(i.source, full) for i, full in private] == [("rmqfast.mid.b", "rmqfast.low._HIDDEN")]
    assert [(i.source, i.target) for i in found if i.local] == [("rmqfast.low.a", "rmqfast.mid.b")]


def test_a_private_name_inside_its_own_package_is_not_counted(tool: ModuleType, tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "rmqfast/low/__init__.py": "",
        "rmqfast/low/_twin.py": "_K = 1\n",
        "rmqfast/low/c.py": "from rmqfast.low._twin import _K\n",
        "rmqfast/mid/__init__.py": "from rmqfast.low import _twin\n",
    })
    _, found = tool.collect(root)
    assert [(i.source, full) for i, full in tool.private_across(found)] == [("rmqfast.mid", "rmqfast.low._twin")]
