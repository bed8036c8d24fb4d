"""Outside stages/, code and tests reach the engine only through its typed interface.

Read from the source (``ast``): an attribute access ``x._engine`` anywhere, or
``engine._anything`` / ``model.engine._anything``, in shardengine/ outside stages/
or in tests/, fails here. See [Note: a typed engine interface] in shardengine/engine_api.py.
"""
from __future__ import annotations

import ast
import pathlib

import torch

import shardengine as se
from shardengine.engine_api import Engine
from shardengine.stages.recipes import STAGES

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Inside these the engine is ``self``; model.py holds it and hands it out as ``model.engine``.
ENGINE_HOME = {"shardengine/stages", "shardengine/model.py"}


def _engine_like(node: ast.AST) -> bool:
    """``engine``, ``x.engine`` or ``x._engine``: an expression naming a stage engine."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    return isinstance(node, ast.Attribute) and node.attr in ("engine", "_engine")


def _private_engine_reads(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if node.attr == "_engine" or (private and _engine_like(node.value)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return found


def _engine_assignments(path: pathlib.Path) -> list[str]:
    """``engine.x = ...`` (or ``+=``): the view is read-only, changes go through named methods."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and _engine_like(item.value):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{item.attr}")
    return found


def _checked_files() -> list[pathlib.Path]:
    files = sorted((ROOT / "shardengine").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    home = [ROOT / h for h in ENGINE_HOME]
    return [f for f in files if not any(f == h or h in f.parents for h in home)]


def test_nothing_outside_the_stages_reads_a_private_engine_attribute() -> None:
    found = [hit for path in _checked_files() for hit in _private_engine_reads(path)]
    assert not found, ("use ShardedModel.engine and the Engine protocol (shardengine/engine_api.py), "
                       f"not private engine attributes: {found}")


def test_nothing_outside_the_stages_assigns_an_engine_attribute() -> None:
    found = [hit for path in _checked_files() for hit in _engine_assignments(path)]
    assert not found, f"the Engine view is read-only; use its named methods: {found}"


def test_the_checker_sees_an_assignment(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("def f(model, engine):\n    engine.sync_enabled = False\n"
                      "    model.engine.counters, x = 1, 2\n    engine.counters.steps += 1\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [hit.split(": ")[1] for hit in _engine_assignments(source)] == [".sync_enabled", ".counters"]
    finally:
        ROOT = saved


def test_the_checker_sees_a_private_read(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("def f(model, engine):\n    return model._engine, engine._trainable, model.engine._slot_of\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert [hit.split(": ")[1] for hit in _private_engine_reads(source)] == ["._engine", "._trainable", "._slot_of"]
    finally:
        ROOT = saved


def test_every_stage_engine_satisfies_the_interface() -> None:
    for stage in range(4):
        net = torch.nn.Linear(3, 2)
        model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage)
        engine = model.engine
        assert isinstance(engine, Engine)
        assert engine.spec.stage == stage
        assert sorted(engine.params.name(p) for p in engine.params.trainable) == ["bias", "weight"]
        assert engine.hook_ids and all(isinstance(i, int) for i in engine.hook_ids)


def _protocol_members(protocol: type) -> set[str]:
    own = set(protocol.__dict__.get("__annotations__", {}))
    own |= {name for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return own


def test_the_engine_view_stays_narrow() -> None:
    """What outside code may touch: at most 25 names (see [Note: a typed engine interface])."""
    members = _protocol_members(Engine)
    assert "stage" not in members and "spec" in members
    assert len(members) <= 25, sorted(members)


def test_a_stage_is_a_row_of_the_table_not_a_subclass() -> None:
    """Every stage runs the same engine class; what differs is its recipe's spec and collaborators."""
    classes = set()
    for stage, recipe in STAGES.items():
        net = torch.nn.Linear(3, 2)
        model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=stage)
        engine = model.engine
        classes.add(type(engine))
        assert engine.spec is recipe.spec and recipe.spec.stage == stage
        assert len(type(engine).__mro__) <= 4
    assert len(classes) == 1
