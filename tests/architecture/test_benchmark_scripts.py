"""Every benchmark script still starts: its imports resolve and ``--help`` parses.

The figures in the docs are reproduced by these scripts; one that no longer imports (a
renamed module, a moved helper) would only be found when someone next needs the figure.
All scripts are loaded in one subprocess, so torch is imported once. The ``check_*.py``
scripts take no arguments and run the tests' own cases, so they are only compiled here.
"""

from __future__ import annotations

import doctest
import py_compile
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"

_LOAD_ALL = r"""
import contextlib, io, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            failed.append(f"{path}: exit {stop.code}")
    except Exception as error:
        failed.append(f"{path}: {type(error).__name__}: {error}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_parses_help(forked_python):
    scripts = sorted(str(p) for p in BENCHMARKS.glob("bench_*.py"))
    assert scripts, "no benchmark scripts found"
    for check in BENCHMARKS.glob("check_*.py"):
        py_compile.compile(str(check), doraise=True)
    done = subprocess.run([forked_python.python, "-c", _LOAD_ALL, *scripts], cwd=ROOT, env=forked_python.env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_launcher_examples():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import launch
        assert doctest.testmod(launch).failed == 0
    finally:
        sys.path.remove(str(BENCHMARKS))
