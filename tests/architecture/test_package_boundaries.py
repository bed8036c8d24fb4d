"""The engine and the estimator depend one way, and only distributed/ calls torch.distributed.

Read from the source (``ast``), not by importing: ``import torch`` itself loads
torch.distributed, so only the code says which module *uses* it. See
[Note: the one way from the engine to the estimator] in shardengine/auto.py.
"""
from __future__ import annotations

import ast
import pathlib
import sys
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEAM = ("shardengine/auto.py", "_estimate_on_rank0")  # the only place the engine imports the estimator
# The one module the estimator's model imports from the engine, at module top: the engine's pure
# layout, residency, traffic and activation facts ([Note: one seam each way] in shardengine/engine_facts.py).
PURE_API = {"shardengine.engine_facts"}
# A tool at the edge that uses both whole (see [Note: the selfcheck is a tool at the edge] in
# shardengine/selfcheck/__init__.py): a leaf no other engine module imports.
EDGE_TOOL = "shardengine.selfcheck"
# Measurement commands: they run the engine (shard(), collectives) to calibrate and validate the estimator.
MEASUREMENT = {"memory_estimator/measure/calibrate.py", "memory_estimator/measure/validate.py"}


class Imported:
    def __init__(self, module: str, node: ast.AST, function: Optional[str], top_level: bool, type_only: bool):
        self.module, self.node, self.function, self.top_level, self.type_only = \
            module, node, function, top_level, type_only


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path) -> Iterator[Imported]:
    """Every module ``path`` imports, with where the import statement sits."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]

    def visit(node: ast.AST, function: Optional[str], top_level: bool, type_only: bool) -> Iterator[Imported]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield Imported(alias.name, child, function, top_level, type_only)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                for alias in child.names:  # ``from pkg import module`` imports the module
                    sub = f"{base}.{alias.name}"
                    yield Imported(sub if _is_module(sub) else base, child, function, top_level, type_only)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, function or child.name, False, type_only)
            elif isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
                yield from visit(child, function, False, True)
            else:
                yield from visit(child, function, top_level and isinstance(child, (ast.Module,)), type_only)

    yield from visit(tree, None, True, False)


def _files(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _file_of(module: str) -> pathlib.Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if (path / "__init__.py").exists() else path.with_suffix(".py")


def _runtime_closure(modules: set[str]) -> set[str]:
    """``modules`` and every shardengine module they load when imported (their parent packages
    too, except the root package: ``shardengine/__init__.py`` is the public facade)."""
    seen, todo = set(), list(modules)
    while todo:
        module = todo.pop()
        if module in seen or not module.startswith("shardengine"):
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(2, len(parts))]
        todo += [imp.module for imp in _imports(_file_of(module)) if not imp.type_only]
    return {m for m in seen if m != "shardengine"}


def _uses_torch_distributed(module: str) -> bool:
    return any(imp.module == "torch.distributed" or imp.module.startswith("torch.distributed.")
               for imp in _imports(_file_of(module)))


def test_no_function_level_import_between_the_packages() -> None:
    late = [f"{path.relative_to(ROOT)}:{imp.node.lineno} {imp.module}" for path in _files("memory_estimator")
            for imp in _imports(path) if imp.module.split(".")[0] == "shardengine" and not imp.top_level]
    assert not late, f"the estimator imports the engine at module top only: {late}"
    engine_to_estimator = [(str(path.relative_to(ROOT)), imp) for path in _files("shardengine")
                           for imp in _imports(path) if imp.module.split(".")[0] == "memory_estimator"
                           and not _in_edge_tool(path)]
    assert {(path, imp.function) for path, imp in engine_to_estimator} == {SEAM}, \
        f"the engine reaches the estimator only in {SEAM}: {engine_to_estimator}"


# The estimator's public API as the engine may use it: the top level, the measuring tools' face
# (memory_estimator/measure/__init__.py) and the auto planner's module (auto_plan, auto_device).
ESTIMATOR_FACE = {"memory_estimator", "memory_estimator.measure", "memory_estimator.plan.auto_plan"}


def test_the_engine_reaches_the_estimator_only_through_its_public_api() -> None:
    """[Note: one seam each way] in shardengine/engine_facts.py: auto.py and the selfcheck import the
    estimator's published names, never its internals."""
    beyond = []
    for path in _files("shardengine"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            beyond += [f"{path.relative_to(ROOT)}:{node.lineno} {module}" for module in modules
                       if module.split(".")[0] == "memory_estimator" and module not in ESTIMATOR_FACE]
    assert not beyond, f"the engine imports estimator internals; use its public API ({ESTIMATOR_FACE}): {beyond}"


def _in_edge_tool(path: pathlib.Path) -> bool:
    return _module_name(path).startswith(EDGE_TOOL)


def test_the_edge_tool_is_a_leaf_on_the_public_api() -> None:
    """No engine module imports the selfcheck, so the estimator it imports never reaches the core;
    it reaches the engine only through the facade, distributed/ and testing/."""
    importers = [f"{path.relative_to(ROOT)}:{imp.node.lineno}" for path in _files("shardengine")
                 if not _in_edge_tool(path) for imp in _imports(path) if imp.module.startswith(EDGE_TOOL)]
    assert not importers, f"{EDGE_TOOL} is a leaf; imported by {importers}"
    allowed = ("shardengine", "shardengine.distributed.", "shardengine.testing.", EDGE_TOOL)
    reached = {imp.module for path in _files(EDGE_TOOL.replace(".", "/")) for imp in _imports(path)
               if imp.module.split(".")[0] == "shardengine"}
    beyond = sorted(m for m in reached if not (m == "shardengine" or m.startswith(allowed[1:])))
    assert not beyond, f"{EDGE_TOOL} imports engine internals {beyond}; use the public API"


def test_the_estimator_imports_only_the_engines_pure_api() -> None:
    for path in _files("memory_estimator"):
        if str(path.relative_to(ROOT)) in MEASUREMENT:
            continue
        direct = {imp.module for imp in _imports(path) if imp.module.split(".")[0] == "shardengine"}
        assert direct <= PURE_API, f"{path.relative_to(ROOT)} imports {sorted(direct - PURE_API)} beyond the pure API"
        impure = sorted(m for m in _runtime_closure(direct) if _uses_torch_distributed(m))
        assert not impure, f"{path.relative_to(ROOT)} reaches torch.distributed through {impure}"


def test_the_pure_api_exists_and_is_used() -> None:
    used = {imp.module for path in _files("memory_estimator") for imp in _imports(path)
            if imp.module.split(".")[0] == "shardengine"}
    assert all(_is_module(m) for m in PURE_API)
    assert PURE_API <= used, sorted(PURE_API - used)


@pytest.mark.parametrize("path", _files("shardengine"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_distributed_package_calls_torch_distributed(path: pathlib.Path) -> None:
    if path.relative_to(ROOT).parts[1] == "distributed":
        return
    assert not _uses_torch_distributed(_module_name(path)), f"{path.relative_to(ROOT)} imports torch.distributed"


def _folder(module: str) -> str:
    """The top-level room of shardengine a module lives in (``flat``, ``config``, ...)."""
    return module.split(".")[1] if module.count(".") else "__init__"


def test_the_engines_folders_depend_one_way() -> None:
    """No cycle between shardengine's folders and top-level modules (the root facade aside):
    errors/policies/flat at the bottom, model.py at the top."""
    edges: dict[str, set[str]] = {}
    for path in _files("shardengine"):
        source = _folder(_module_name(path))
        for imp in _imports(path):
            if imp.module.startswith("shardengine.") and not imp.type_only and _folder(imp.module) != source:
                edges.setdefault(source, set()).add(_folder(imp.module))
    edges.pop("__init__", None)
    order: list[str] = []
    visiting: list[str] = []

    def visit(node: str) -> None:
        assert node not in visiting, f"import cycle between folders: {' -> '.join(visiting + [node])}"
        if node in order:
            return
        visiting.append(node)
        for target in sorted(edges.get(node, ())):
            visit(target)
        visiting.pop()
        order.append(node)

    for node in sorted(edges):
        visit(node)
    assert order.index("errors") < order.index("flat") < order.index("distributed") < order.index("stages") \
        < order.index("model")


def _module_cycles(package: str) -> list[list[str]]:
    """The import circles between ``package``'s modules: every import counted, type-only and
    inside functions too (a circle hidden that way is still one a reader has to untangle)."""
    edges = {_module_name(path): {imp.module for imp in _imports(path) if imp.module.startswith(package + ".")}
             for path in _files(package)}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in edges:
                continue
            if target not in order:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], order[target])
        if low[node] == order[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in order:
            visit(node)
    return cycles


def test_the_estimator_has_no_import_circle() -> None:
    """Between any two of its modules, imports go one way (issue 42: the estimator's four circles,
    most hidden in TYPE_CHECKING blocks and function bodies, were broken by giving the shared
    records modules of their own: plan/setup.py, plan/estimates.py, plan/inputs.py,
    hardware/link.py, model/family_table.py, the readings in basis.py)."""
    assert _module_cycles("memory_estimator") == []


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch) -> None:
    package = tmp_path / "circ"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (package / "b.py").write_text("def f():\n    from .a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _module_cycles("circ") == [["circ.a", "circ.b"]]
