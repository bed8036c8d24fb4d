"""The example scripts run as a user runs them, ``python examples/X.py`` or under torchrun, each in a
process of its own; ``python`` and torchrun's ranks here are forks of one interpreter that has
imported torch, shardengine and memory_estimator (``preloaded_python.py``), not fresh
interpreters that each spend ~4.5 s of CPU importing them first."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import pytest

from preloaded_python import PreloadedPython
from rank_pool import REPO_ROOT


@dataclass(frozen=True)
class ExamplePython:
    python: str             # use in place of sys.executable
    env: dict[str, str]     # one thread per rank, Gloo on loopback, this checkout on PYTHONPATH


@pytest.fixture(scope="session")
def example_python(tmp_path_factory) -> Iterator[ExamplePython]:
    bin_dir = tmp_path_factory.mktemp("example_bin")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": REPO_ROOT,
           "PYTHON_EXEC": str(bin_dir / "python")}  # torchrun starts its ranks with this
    with PreloadedPython(env) as server:
        server.write_shims(bin_dir)
        yield ExamplePython(str(bin_dir / "python"), server.env)
