"""Measure the import structure of rmqfast: cycles, imports against the layers, private names.

Run from the checkout::

    python tools/imports.py                 # counts
    python tools/imports.py --list          # and every offending import, file:line

It reads only source (``ast``), never imports rmqfast, so it measures any tree (``--root``). The
layers are those of the import-linter layers contract in ``pyproject.toml`` (``--pyproject`` to
measure an older tree against today's contract). It counts:

- cycles: strongly connected sets of modules in the graph of module-level imports (the imports
  that run when a module is loaded; ``if TYPE_CHECKING:`` and function-local ones left out), and
  the same for the graph of every import (what import-linter sees);
- lower->higher: imports (any, as import-linter counts them) from a module of a lower layer to a
  module of a higher one;
- private across packages: an imported name or module that starts with ``_`` (not a dunder)
  below ``rmqfast.X`` imported from outside ``rmqfast.X`` (``rmqfast._args`` and
  ``rmqfast._speedups`` are private to ``rmqfast`` as a whole, so shared by all of it);
- function-local: imports of rmqfast modules written inside a function body.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "rmqfast"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (resolved to a module of the package)
    names: tuple[str, ...]  # names taken from it (empty for ``import x``)
    path: str
    line: int
    local: bool  # inside a function body
    type_checking: bool  # under ``if TYPE_CHECKING:``


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    modules: dict[str, Path] = {}
    for path in sorted((root / ROOT_PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    for path in sorted((root / ROOT_PACKAGE).glob("*.pyi")):  # compiled extensions (their stub)
        name = f"{ROOT_PACKAGE}.{path.stem}"
        modules.setdefault(name, path)
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self, source: str, path: str, modules: dict[str, Path]) -> None:
        self.source, self.path, self.modules = source, path, modules
        self.depth = 0
        self.type_checking = 0
        self.found: list[Import] = []

    def _add(self, target: str, names: tuple[str, ...], line: int) -> None:
        resolved = _resolve(target, self.modules)
        if resolved is not None:
            self.found.append(
                Import(self.source, resolved, names, self.path, line, self.depth > 0, self.type_checking > 0)
            )

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815 (ast visitor name)

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        is_tc = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        if not is_tc:
            self.generic_visit(node)
            return
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == ROOT_PACKAGE or alias.name.startswith(ROOT_PACKAGE + "."):
                self._add(alias.name, (), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.source if self.path.endswith("__init__.py") else self.source.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        if not (base == ROOT_PACKAGE or base.startswith(ROOT_PACKAGE + ".")):
            return
        plain: list[str] = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.modules:  # ``from pkg import submodule``
                self._add(sub, (), node.lineno)
            else:
                plain.append(alias.name)
        if plain:
            self._add(base, tuple(plain), node.lineno)


def collect(root: Path) -> tuple[dict[str, Path], list[Import]]:
    modules = module_names(root)
    found: list[Import] = []
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        visitor = _Visitor(name, str(path.relative_to(root)), modules)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found.extend(i for i in visitor.found if i.target != name)
    return modules, found


def cycles(modules: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in edges:
        graph[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    result: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        result.append(sorted(component))
    return result


def read_layers(pyproject: Path) -> list[list[str]]:
    """The layers (top first) of the first layers contract, each a list of modules."""
    config = tomllib.loads(pyproject.read_text())
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    for contract in contracts:
        if contract.get("type") == "layers":
            layers = []
            for entry in contract["layers"]:
                members = [m.strip() for part in entry.split("|") for m in part.split(":")]
                layers.append([m for m in members if m])
            return layers
    raise SystemExit(f"{pyproject}: no [[tool.importlinter.contracts]] of type 'layers'; add one or pass --pyproject")


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """0 for the bottom layer; None for a module no layer names."""
    for height, members in enumerate(reversed(layers)):
        for member in members:
            if module == member or module.startswith(member + "."):
                return height
    return None


def upward(found: list[Import], layers: list[list[str]]) -> list[Import]:
    out = []
    for imp in found:
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            out.append(imp)
    return out


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_across(found: list[Import]) -> list[tuple[Import, str]]:
    out = []
    for imp in found:
        names = imp.names or ("",)
        for name in names:
            full = f"{imp.target}.{name}" if name else imp.target
            parts = full.split(".")
            for depth in range(2, len(parts)):
                if _is_private(parts[depth]):
                    owner = ".".join(parts[:depth]) if depth > 1 else parts[0]
                    if _unit(imp.source) != _unit(owner) and not imp.source.startswith(owner + "."):
                        out.append((imp, full))
                    break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="checkout to measure (default: .)")
    parser.add_argument("--pyproject", type=Path, help="file with the layers contract (default: ROOT/pyproject.toml)")
    parser.add_argument("--list", action="store_true", help="list every offending import")
    args = parser.parse_args(argv)
    modules, found = collect(args.root)
    runtime = [i for i in found if not i.local and not i.type_checking]
    layers = read_layers(args.pyproject or args.root / "pyproject.toml")
    unlayered = sorted(m for m in modules
                       if layer_of(m, layers) is None and modules[m].suffix == ".py" and m != ROOT_PACKAGE)
    runtime_cycles, all_cycles = cycles(modules, runtime), cycles(modules, found)
    up, private = upward(found, layers), private_across(found)
    local = [i for i in found if i.local]
    print(f"modules: {len(modules)}; imports of rmqfast modules: {len(found)}")
    print(f"cycles (module-level imports): {len(runtime_cycles)}, "
          f"{sum(len(c) for c in runtime_cycles)} modules in them")
    print(f"cycles (every import): {len(all_cycles)}, {sum(len(c) for c in all_cycles)} modules in them")
    print(f"lower->higher imports: {len(up)} ({len({(i.source, i.target) for i in up})} module pairs)")
    print(f"private names imported across packages: {len(private)}")
    print(f"function-local imports of rmqfast modules: {len(local)}")
    if unlayered:
        print(f"modules in no layer: {', '.join(unlayered)}")
    if args.list:
        for title, group in (("cycles (module-level)", runtime_cycles), ("cycles (every import)", all_cycles)):
            print(f"\n{title}:")
            for component in group:
                print("  " + " ".join(component))
        print("\nlower->higher:")
        for imp in up:
            print(f"  {imp.path}:{imp.line} {imp.source} -> {imp.target}")
        print("\nprivate across packages:")
        for imp, full in private:
            print(f"  {imp.path}:{imp.line} {imp.source} -> {full}")
        print("\nfunction-local:")
        for imp in local:
            print(f"  {imp.path}:{imp.line} {imp.source} -> {imp.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
