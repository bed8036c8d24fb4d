"""The estimator stays organised by question: a small root, typed requests, argparse only in commands.

Read from the source (``ast``): what is checked is what a reader of the code meets.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "memory_estimator"
MAX_ROOT_MODULES = 8
MAX_PARAMETERS = 12
# The model and the planner: they take typed objects, never parsed flags.
NO_ARGPARSE = ("plan", "timing", "terms", "engines", "model", "hardware")


def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _parameter_count(function: ast.FunctionDef) -> int:
    arguments = function.args
    return (len(arguments.posonlyargs) + len(arguments.args) + len(arguments.kwonlyargs)
            + (arguments.vararg is not None) + (arguments.kwarg is not None))


def _mentions_argparse(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Name) and node.id == "argparse"
               or isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names)
               for node in ast.walk(tree))


def test_root_keeps_few_modules():
    modules = sorted(path.name for path in ROOT.glob("*.py"))
    assert len(modules) <= MAX_ROOT_MODULES, f"memory_estimator/ has {len(modules)} root modules: {modules}"


def test_no_public_root_function_takes_many_parameters():
    too_many = [f"{path.name}:{node.name} ({_parameter_count(node)})"
                for path in ROOT.glob("*.py") for node in _tree(path).body
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
                and _parameter_count(node) > MAX_PARAMETERS]
    assert not too_many, f"group these parameters into a typed request: {too_many}"


def test_argparse_only_in_command_entry_points():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] == "cli" or not _mentions_argparse(tree := _tree(path)):
            continue
        in_model = len(relative.parts) == 1 or relative.parts[0] in NO_ARGPARSE
        is_command = any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)
        if in_model or not is_command:
            offenders.append(str(relative))
    assert not offenders, f"argparse outside cli/ and the commands' main(): {offenders}"


def _assigns_to_args(tree: ast.Module) -> list[int]:
    """Lines that change a parsed ``args``: ``args.x = ...``, ``args.x += ...``, ``setattr(args, ...)``."""
    lines = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "args":
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
            lines.append(node.lineno)
    return lines


def test_a_request_flows_one_way():
    """The parsed flags are read once into a typed request and never changed (issue 42, item 5:
    ``resolve_topology`` used to fill ``args`` in place)."""
    changed = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(ROOT.rglob("*.py"))
               for line in _assigns_to_args(_tree(path))]
    assert not changed, f"these lines change the parsed flags; build a typed value instead: {changed}"


def test_the_one_way_check_sees_a_change(tmp_path: pathlib.Path):
    source = tmp_path / "probe.py"
    source.write_text("def f(args):\n    args.nodes = 2\n    args.a, b = 1, 2\n    setattr(args, 'x', 1)\n"
                      "    other.nodes = 3\n")
    assert _assigns_to_args(_tree(source)) == [2, 3, 4]
