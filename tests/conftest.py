"""Session-wide test setup: shared rank pools and the hypothesis "ci" profile.

Multi-rank tests ask for a pool of the world size they need; pools start on
first use and live for the whole session (see ``rank_pool.py`` for why)::

    def test_sum(rank_pools):
        assert rank_pools.get(2).run(my_module_level_fn, 3) == [6, 6]

A module that needs several pools marks itself ``pytestmark = pytest.mark.prestart(2, 3)``
to start them together. Shared pieces live in one place each: ``rank_pool.py`` (the
harness, ``rank_world``, ``run_local``), ``toy_models.py`` (the toy ``Net`` and
``make_optimizer``), ``engine_cases.py`` (data and rank workers of the engine tests).

``rank_pools`` is session-scoped, so ``@given`` tests may use it: every
example reuses the same worker processes.

A test that starts Python processes itself (a script, ``python -m torch.distributed.run``)
asks for ``forked_python`` and uses its ``python`` and ``env``: each such process (torchrun's
agent and ranks too) is then a fork of one interpreter that imported torch, shardengine and
memory_estimator once (``preloaded_python.py``), not a fresh one spending ~4.5 s of CPU on it.
Its processes see no GPU (``CUDA_VISIBLE_DEVICES=""``): the suite runs on CPU as CI does, and a
script that hides the GPU itself (the GPU check's dry run) then still matches the preloaded start.
"""

from __future__ import annotations

import compileall
import os
import sys
from typing import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings


def _compile_bytecode_once() -> None:
    """Writes this checkout's ``__pycache__`` before any test starts a Python process.

    [Note: bytecode for the processes the suite starts]
    CI's image sets PYTHONDONTWRITEBYTECODE=1, so a clean clone never gets ``.pyc`` files and
    every process the suite starts (rank-pool workers, torchrun ranks, doc blocks, example and
    CLI runs: several hundred) compiled shardengine's and memory_estimator's ~150 modules from
    source again: 0.45 s of CPU each on this machine (``import shardengine``: 4.6 s without,
    4.1 s with). That variable only stops *writing* bytecode; files written here are read, and
    Python checks each against its source's mtime and size, so an edited module is recompiled
    in memory, never run stale. Folders under git's ignore rule ``__pycache__/``.
    """
    root = os.path.dirname(_TESTS_DIR)
    for folder in ("shardengine", "memory_estimator", "tests", "benchmarks", "examples"):
        path = os.path.join(root, folder)
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2)


# Workers import test modules by name from every test folder (rank_pool.TEST_DIRS); make
# the parent agree, whichever folder pytest started in.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from preloaded_python import ForkedPython, PreloadedPython  # noqa: E402
from rank_pool import TEST_DIRS, RankPool, RankPoolError, RankPoolRegistry, scripts_pythonpath  # noqa: E402

for _folder in TEST_DIRS:
    if _folder not in sys.path:
        sys.path.insert(1, _folder)

_compile_bytecode_once()

# torch caches the set of tensor constructors that `with torch.device(...)` redirects on its
# first use. transformers swaps torch.linspace for a wrapper while it builds a model; if that
# first use falls inside such a build (from_pretrained's meta context), torch.linspace is never
# redirected again in this process, and a model built under `torch.device("meta")` gets real
# linspace buffers. Fill the cache now, before any test builds a Hugging Face model.
import torch.utils._device  # noqa: E402

torch.utils._device._device_constructors()

# Reproducible CI: fixed examples (derandomize), no wall-clock deadline (ranks
# share 2 cores, so timings are noisy), a modest example count to keep the
# suite under 10 minutes. function_scoped_fixture is deliberately NOT
# suppressed: the pools are session-scoped and never trip it, while a real
# function-scoped fixture (tmp_path, ...) shared across examples is a bug.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    database=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_REGISTRY = RankPoolRegistry()


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPoolRegistry]:
    """Registry of shared pools: ``rank_pools.get(n)`` is the session's n-rank pool.

    At the end the workers are stopped the way a training script ends (leave the
    group, exit) and any abnormal exit, such as an abort at interpreter exit, is
    an error of the session.
    """
    yield _REGISTRY
    _REGISTRY.shutdown_all(graceful=True)


@pytest.fixture(scope="session")
def forked_python(tmp_path_factory) -> Iterator[ForkedPython]:
    """``python`` as forks of one preloaded interpreter (see the module docstring)."""
    bin_dir = tmp_path_factory.mktemp("forked_python_bin")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": scripts_pythonpath(),
           "CUDA_VISIBLE_DEVICES": "",
           "PYTHON_EXEC": str(bin_dir / "python")}  # torchrun starts its ranks with this
    with PreloadedPython(env) as server:
        server.write_shims(bin_dir)
        yield ForkedPython(str(bin_dir / "python"), server.env)


@pytest.fixture(scope="session")
def rank_pool(rank_pools: RankPoolRegistry) -> Callable[[int], RankPool]:
    """Factory form: ``rank_pool(n)`` is the same as ``rank_pools.get(n)``."""
    return rank_pools.get


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "prestart(*world_sizes): start these rank pools together as the "
                                       "module starts, so their start-ups overlap")


@pytest.fixture(scope="module", autouse=True)
def _prestart_marked_pools(request: pytest.FixtureRequest) -> None:
    """A module marked ``pytestmark = pytest.mark.prestart(2, 3)`` starts those pools at once.

    Each pool's start-up (Python + torch + a process group per rank) takes seconds on this
    machine; started together, they overlap instead of adding up test after test.
    """
    marker = request.node.get_closest_marker("prestart")
    if marker is not None:
        request.getfixturevalue("rank_pools").prestart(list(marker.args))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Also covers pools used without the fixture; atexit in rank_pool is the last resort.
    try:
        _REGISTRY.shutdown_all(graceful=True)
    except RankPoolError as error:
        print(f"\nrank pool workers exited abnormally:\n{error}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
