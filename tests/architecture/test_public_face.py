"""Each package's top level stays small; the names it used to hold still work for one release.

See [Note: the public face] in shardengine/public_face.py and "The public face" in
docs/architecture.md. The old faces are listed here as they were, so that dropping a name from
the moved table (before its release is over) fails here rather than in a user's script.
"""
from __future__ import annotations

import ast
import importlib
import pathlib
import re
import warnings

import pytest

import memory_estimator
import shardengine

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_PUBLIC_NAMES = 15
OLD_FACE = {
    shardengine: [
        "Activations", "CheckpointError", "CollectiveError", "CommStats", "Compression", "ConfigError", "DistInfo",
        "Hybrid", "LoadReport", "MemoryReport", "MixedPrecision", "Offload", "OptimizerList", "ProportionalSampler",
        "ShardConfig", "ShardedAccessError", "ShardedModel", "Stage3", "StepStats", "consolidated_optimizer_state_dict",
        "consolidated_state_dict", "deepspeed_training_state", "init_distributed", "is_main_process",
        "load_checkpoint", "load_dcp_checkpoint", "load_pretrained", "load_training_state", "meta_parameters",
        "muon_with_adamw", "proportional_counts", "rank", "rebalance_proportions", "register_forward_method",
        "save_checkpoint", "save_dcp_checkpoint", "save_pretrained", "shard", "world_size"],
    memory_estimator: [
        "Architecture", "BytesPerParam", "CATALOG", "DeepSpeedKnobs", "Device", "ENGINES", "EngineOptions",
        "EngineRequest", "Estimate", "EstimateRequest", "EstimatorInputError", "FineTuningRequest", "ModelRequest",
        "ModelStats", "Overheads", "PLAN_NAMES", "PRECISIONS", "PlanEstimate", "PlannedRun", "SUPPORTED_MODEL_TYPES",
        "TargetRequest", "TimedEstimate", "TimingRequest", "TrainingRequest", "TrainingSetup", "auto_device",
        "auto_plan", "bytes_per_param", "estimate", "fastest_plan", "largest_device_budget", "model_state_bytes",
        "optimizer_name", "precision_policy", "resolve_device", "stats_from_config", "time_estimate"],
}
PACKAGES = pytest.mark.parametrize("package", list(OLD_FACE), ids=lambda package: package.__name__)
# Where the suite, the docs, the examples and the benchmarks are read for old top-level names.
READ = ("shardengine", "memory_estimator", "tests", "docs", "examples", "benchmarks", "README.md")
ALIASES = {shardengine: ("se", "shardengine"), memory_estimator: ("me", "memory_estimator")}


@PACKAGES
def test_the_top_level_is_small(package) -> None:
    assert len(package.__all__) <= MAX_PUBLIC_NAMES, \
        f"{package.__name__} publishes {len(package.__all__)} names; move the rest to a documented submodule"
    assert len(set(package.__all__)) == len(package.__all__)
    submodules = set(getattr(package, "_SUBMODULES", ()))
    assert set(dir(package)) == set(package.__all__) | submodules


@PACKAGES
def test_new_names_resolve_without_a_warning(package) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in package.__all__:
            assert getattr(package, name) is not None
        for name in getattr(package, "_SUBMODULES", ()):
            assert getattr(package, name) is importlib.import_module(f"{package.__name__}.{name}")


@PACKAGES
def test_every_old_name_resolves_to_the_same_object_with_a_warning_naming_its_home(package) -> None:
    moved = package._MOVED
    assert set(OLD_FACE[package]) == set(package.__all__) | set(moved), "an old name was dropped (or invented)"
    assert not set(moved) & set(package.__all__)
    for name, home in moved.items():
        with pytest.warns(DeprecationWarning) as caught:
            old = getattr(package, name)
        assert old is getattr(importlib.import_module(home), name), f"{package.__name__}.{name}"
        message = str(caught[0].message)
        assert f"from {home} import {name}" in message, message
        assert caught[0].filename == __file__, "the warning points at the importing line"


def test_the_published_submodules_resolve_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for package in ("shardengine.distributed", "shardengine.data", "shardengine.optim", "shardengine.interop"):
            module = importlib.import_module(package)
            assert module.__doc__, package
            for name in module.__all__:
                assert getattr(module, name) is not None, f"{package}.{name}"
                assert name in dir(module)


def test_the_repository_does_not_use_the_old_names() -> None:
    """So the suite, the docs and the examples raise no DeprecationWarning, and teach the new paths:
    in Python files the code and the docstring examples (``>>>``) are read, in Markdown all of it."""
    used = []
    for path in _files():
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        if path.suffix == ".md":
            used += [f"{where}: {found}" for found in _dotted_uses(text)]
            continue
        examples = "\n".join(line for line in text.splitlines() if line.lstrip().startswith((">>>", "...")))
        used += [f"{where}: {found}" for found in _dotted_uses(examples) + _code_uses(ast.parse(text))]
    assert not used, "old top-level names (import them from their new home):\n" + "\n".join(used)


def _dotted_uses(text: str) -> list[str]:
    found = []
    for package, aliases in ALIASES.items():
        dotted = re.compile(rf"\b(?:{'|'.join(aliases)})\.({'|'.join(package._MOVED)})\b")
        imported = re.compile(rf"from {package.__name__} import (\([^)]*\)|[^\n]*)")
        found += [match.group(0) for match in dotted.finditer(text)]
        found += [f"from {package.__name__} import {name}" for match in imported.finditer(text)
                  for name in sorted(set(re.findall(r"\w+", match.group(1))) & set(package._MOVED))]
    return found


def _code_uses(tree: ast.Module) -> list[str]:
    """``se.rank`` / ``shardengine.rank`` read in code, and ``from shardengine import rank``."""
    found = []
    for node in ast.walk(tree):
        for package, aliases in ALIASES.items():
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in aliases and node.attr in package._MOVED:
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and node.module == package.__name__ and not node.level:
                found += [f"line {node.lineno}: from {node.module} import {alias.name}" for alias in node.names
                          if alias.name in package._MOVED]
    return found


def test_the_architecture_doc_names_every_new_home() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    homes = {home for package in OLD_FACE for home in package._MOVED.values()}
    assert not [home for home in sorted(homes) if f"`{home}`" not in text]


def _files() -> list[pathlib.Path]:
    this = pathlib.Path(__file__).resolve()
    files = []
    for entry in READ:
        path = ROOT / entry
        files += [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.md")]
    return [file for file in files if file.resolve() != this]
