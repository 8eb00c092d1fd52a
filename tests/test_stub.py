"""``rmqfast/_speedups.pyi`` describes the built extension: the same names, and the same signatures
wherever Cython lets them be read (``def`` functions and methods are cyfunctions with a signature;
``__init__`` of a ``cdef class`` and its attributes are not)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest

from rmqfast import codec

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "rmqfast" / "_speedups.pyi"
C = codec.compiled_twin()
pytestmark = [pytest.mark.twin, pytest.mark.skipif(C is None, reason="compiled extension not built")]

_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": float, "bytes": bytes, "str": str, "bool": bool}


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _public(names: Any) -> set[str]:
    return {n for n in names if not n.startswith("__")}


def _members(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
    return out


def _stub_params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of every parameter, ``self`` included, in order."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, d) for p, d in zip(positional, defaults, strict=True)]
    out += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    return out


def _runtime_params(obj: Any) -> list[tuple[str, bool]] | None:
    """The same from the extension; None when Cython gives no readable signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in sig.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds and inspect.Parameter.VAR_KEYWORD in kinds:
        return None  # a slot wrapper (the __init__ of a cdef class): nothing to compare
    return [(p.name, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]


def test_the_stub_names_every_public_name_of_the_extension_and_nothing_else():
    stub = _members(_stub().body)
    runtime = _public(vars(C))
    assert not runtime - set(stub), f"in rmqfast._speedups but not in {STUB.name}: {sorted(runtime - set(stub))}"
    assert not set(stub) - runtime, f"in {STUB.name} but not in rmqfast._speedups: {sorted(set(stub) - runtime)}"


def test_module_constants_have_the_stubbed_type():
    checked = 0
    for name, node in _members(_stub().body).items():
        if not isinstance(node, ast.AnnAssign):
            continue
        ann = ast.unparse(node.annotation)
        value = getattr(C, name)
        if ann in _TYPES:
            assert type(value) is _TYPES[ann], f"{name}: stub says {ann}, the extension has {type(value).__name__}"
        elif ann.startswith("tuple["):
            item = _TYPES[ann[len("tuple["):].split(",")[0]]
            assert isinstance(value, tuple) and all(type(v) is item for v in value), f"{name}: not {ann}"
        else:
            continue
        checked += 1
    assert checked >= 85


def test_functions_have_the_stubbed_signatures():
    checked = 0
    for name, node in _members(_stub().body).items():
        if isinstance(node, ast.FunctionDef):
            got = _runtime_params(getattr(C, name))
            assert got is not None, f"{name}: no signature to read from the extension"
            assert got == _stub_params(node), f"{name}: extension {got} != stub {_stub_params(node)}"
            checked += 1
    assert checked >= 7


def test_classes_have_the_stubbed_members_and_signatures():
    classes = {n: node for n, node in _members(_stub().body).items()
               if isinstance(node, ast.ClassDef) and n != "HeaderErrorCode"}
    assert len(classes) >= 8
    compared = 0
    for cname, cnode in classes.items():
        cls = getattr(C, cname)
        stub = _members(cnode.body)
        runtime = {n for n in vars(cls) if not n.startswith("__") or n in ("__init__", "__len__")}
        # a cdef class is built by its type slots (__cinit__): its __init__ is not always in vars()
        missing = {n for n in stub if n not in runtime and n != "__init__"}
        assert not missing, f"{cname}: in the stub but not in the extension: {sorted(missing)}"
        extra = runtime - set(stub) - {"__init__"}
        assert not extra, f"{cname}: in the extension but not in the stub: {sorted(extra)}"
        for name, node in stub.items():
            if not isinstance(node, ast.FunctionDef):
                continue
            is_property = any(ast.unparse(d) == "property" for d in node.decorator_list)
            attr = vars(cls).get(name)
            if is_property:
                assert inspect.isdatadescriptor(attr), f"{cname}.{name}: a property in the stub, not in the extension"
                continue
            got = _runtime_params(getattr(cls, name))
            if got is None:
                continue
            assert got == _stub_params(node), f"{cname}.{name}: extension {got} != stub {_stub_params(node)}"
            compared += 1
    assert compared >= 30


def test_the_stub_check_fails_on_a_wrong_signature():
    """The comparison above can fail: a parameter renamed in a copy of the stub is caught."""
    tree = _stub()
    node = _members(tree.body)["code_slot"]
    assert isinstance(node, ast.FunctionDef)
    node.args.args[0].arg = "kode"
    assert _runtime_params(C.code_slot) != _stub_params(node)
