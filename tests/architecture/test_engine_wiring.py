"""The engine's collaborators receive what they use; they do not hold or import the engine.

Read from the source (``ast``). ``StageEngine.__init__`` (stages/engine.py) wires each
collaborator once with the few objects it uses (issue 42, item 1; FSDP2's
``FSDPParamGroup`` is the model). The collaborators not yet converted are listed in
``STILL_IMPORTING``: a new module importing ``stages/engine.py`` fails here, and so does
an entry that no longer imports it (the list only shrinks).
"""
from __future__ import annotations

import ast
import pathlib

from test_package_boundaries import ROOT, _files, _imports, _module_name

ENGINE_MODULE = "shardengine.stages.engine"
# Who may import the engine: the builder, and the collaborators still constructed with it.
BUILDER = {"shardengine.model"}                  # shard() makes the engine (model.py)
STILL_IMPORTING = {
    "shardengine.stages.backward", "shardengine.stages.buckets", "shardengine.stages.forward",
    "shardengine.stages.units", "shardengine.stages.window",
}
# The collaborators' homes: a module here that is off the list holds no ``self.engine``.
COLLABORATOR_PACKAGES = ("shardengine/stages", "shardengine/offload")


def _importers_of_engine() -> set[str]:
    return {_module_name(path) for path in _files("shardengine") if path.name != "engine.py"
            for imp in _imports(path) if imp.module == ENGINE_MODULE}


def _holds_engine(path: pathlib.Path) -> list[int]:
    """Lines that store the engine on an object: ``self.engine = ...``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            for item in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(item, ast.Attribute) and item.attr == "engine" \
                        and isinstance(item.value, ast.Name) and item.value.id == "self":
                    lines.append(node.lineno)
    return lines


def test_no_new_module_imports_the_engine() -> None:
    new = _importers_of_engine() - BUILDER - STILL_IMPORTING
    assert not new, (f"{sorted(new)} import stages/engine.py: construct the collaborator with the few "
                     "objects it uses (the communicator, the buckets, config values as data, the "
                     "collaborators it calls) and wire it in StageEngine.__init__")


def test_the_list_of_importers_only_shrinks() -> None:
    stale = STILL_IMPORTING - _importers_of_engine()
    assert not stale, f"{sorted(stale)} no longer import the engine: take them off STILL_IMPORTING"


def test_converted_collaborators_hold_no_engine() -> None:
    held = [f"{path.relative_to(ROOT)}:{line}" for package in COLLABORATOR_PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))
            if _module_name(path) not in STILL_IMPORTING | {ENGINE_MODULE}
            for line in _holds_engine(path)]
    assert not held, f"these collaborators keep a reference to the engine: {held}"


def test_the_checker_sees_a_held_engine(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("class A:\n    def __init__(self, engine):\n        self.engine = engine\n"
                      "        self.comm, self.engine = engine.comm, engine\n        self.other = engine\n")
    assert _holds_engine(source) == [3, 4]
