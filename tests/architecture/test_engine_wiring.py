"""The engine's collaborators receive what they use; they do not hold or import the engine.

Read from the source (``ast``). ``StageEngine.__init__`` (stages/engine.py) wires each
collaborator once with the few objects it uses (issue 42, item 1; FSDP2's
``FSDPParamGroup`` is the model): a module besides the builder importing
``stages/engine.py`` fails here, as does one that stores the engine on an object, and any
import circle between the engine's modules (type-only imports included).
"""
from __future__ import annotations

import ast
import pathlib

from test_package_boundaries import ROOT, _files, _imports, _module_cycles, _module_name

ENGINE_MODULE = "shardengine.stages.engine"
BUILDER = {"shardengine.model"}                  # shard() makes the engine (model.py): its only importer
# The collaborators' homes: no module here holds ``self.engine``.
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


def test_only_the_builder_imports_the_engine() -> None:
    others = _importers_of_engine() - BUILDER
    assert not others, (f"{sorted(others)} import stages/engine.py: construct the collaborator with the few "
                        "objects it uses (the communicator, the buckets, config values as data, the "
                        "collaborators it calls) and wire it in StageEngine.__init__")


def test_no_collaborator_holds_the_engine() -> None:
    held = [f"{path.relative_to(ROOT)}:{line}" for package in COLLABORATOR_PACKAGES
            for path in sorted((ROOT / package).rglob("*.py")) if _module_name(path) != ENGINE_MODULE
            for line in _holds_engine(path)]
    assert not held, f"these collaborators keep a reference to the engine: {held}"


def test_the_engine_has_no_import_circle() -> None:
    """Between any two of shardengine's modules imports go one way, type-only and function-level
    ones included (issue 42, item 2: the 16-module circle through stages/ was the collaborators'
    ``TYPE_CHECKING`` import of ``StageEngine``)."""
    assert _module_cycles("shardengine") == []


def test_the_checker_sees_a_held_engine(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("class A:\n    def __init__(self, engine):\n        self.engine = engine\n"
                      "        self.comm, self.engine = engine.comm, engine\n        self.other = engine\n")
    assert _holds_engine(source) == [3, 4]


# Where the stage number may be compared: the stage table's facts and the options' validation.
# Everything else reads the facts (StageSpec: shards_optimizer, bucket_shape, steps_whole, ...).
STAGE_VALIDATION = {"shardengine/stages/spec.py", "shardengine/config.py", "shardengine/policies.py"}


def _stage_comparisons(path: pathlib.Path) -> list[int]:
    """Lines comparing a ``stage`` (a name or an attribute) with a number or a tuple; comparing
    with the option's string ``"auto"`` resolves the option and is not counted."""
    def is_stage(node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id == "stage" or \
            isinstance(node, ast.Attribute) and node.attr == "stage"

    def is_auto(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value == "auto"

    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(is_stage(side) for side in sides) and not any(is_auto(side) for side in sides):
                lines.append(node.lineno)
    return lines


def test_only_the_stage_table_and_validation_compare_the_stage() -> None:
    compared = [f"{path.relative_to(ROOT)}:{line}" for path in _files("shardengine")
                if str(path.relative_to(ROOT)) not in STAGE_VALIDATION for line in _stage_comparisons(path)]
    assert not compared, (f"these lines compare the stage number: read the stage's facts instead "
                          f"(STAGES[stage].spec, stages/spec.py): {compared}")


def test_the_checker_sees_a_stage_comparison(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("if stage == 0:\n    pass\nx = cfg.stage > 1\ny = stage == 'auto'\nz = 3 in (stage,)\n"
                      "w = self.stage in (1, 2)\n")
    assert _stage_comparisons(source) == [1, 3, 6]
