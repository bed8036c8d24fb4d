"""preloaded_python.py: a fork runs a command as a fresh ``python`` would, or the real interpreter runs it.

The server here preloads one stdlib module (``wave``, which nothing else imports) instead of
torch, so it starts at once; whether ``wave`` is in ``sys.modules`` tells a fork from a
fresh interpreter.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from preloaded_python import PreloadedPython

FORKED = "import sys; print('wave' in sys.modules)"


@pytest.fixture(scope="module")
def shell(tmp_path_factory) -> Iterator[tuple[dict[str, str], Path]]:
    bin_dir = tmp_path_factory.mktemp("bin")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONUNBUFFERED", None)
    with PreloadedPython(env, preload=("wave",)) as server:
        server.write_shims(bin_dir)
        yield server.env, tmp_path_factory.mktemp("work")


def run(shell, command: str, **env: str) -> subprocess.CompletedProcess:
    base, cwd = shell
    return subprocess.run(["bash", "-c", command], cwd=cwd, env={**base, **env}, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60)


PROBE = ("import os, sys, tempfile\n"
         "print(sys.argv, sys.path, os.getcwd(), os.environ.get('GREETING'), tempfile.gettempdir())\n"
         "print(__name__, globals().get('__file__'), sorted(globals()), sys.stdin.read().strip())\n"
         "print([(s.encoding, s.errors, s.line_buffering, s.write_through, type(s.buffer).__name__)\n"
         "       for s in (sys.stdin, sys.stdout, sys.stderr)])\n"
         "print('wave' in sys.modules, file=sys.stderr)\n"
         "sys.exit(3)\n")


@pytest.mark.parametrize("form", ["script", "-c", "-m", "-u"])
def test_a_fork_runs_a_command_as_a_fresh_interpreter_does(shell, tmp_path, form):
    """The same probe forked and in a fresh interpreter (``-X int_max_str_digits`` changes
    nothing it prints): argv, sys.path, directory, environment, TMPDIR, globals, stdio, exit code.
    PYTHONUNBUFFERED is unset here, so ``-u`` is what makes the streams unbuffered."""
    (tmp_path / "probe.py").write_text(PROBE)
    command = {"script": f"{tmp_path}/probe.py a 'b c'", "-c": f'-c "$(cat {tmp_path}/probe.py)" a',
               "-m": "-m probe a", "-u": "-u probe.py"}[form]
    runs = [run(shell, f"cd {tmp_path} && echo piped | GREETING=hello python {flags}{command}", TMPDIR=str(tmp_path))
            for flags in ("", "-X int_max_str_digits=5000 ")]
    assert [(done.returncode, done.stderr) for done in runs] == [(3, "True\n"), (3, "False\n")]
    assert runs[0].stdout == runs[1].stdout and "hello" in runs[0].stdout and "piped" in runs[0].stdout


def test_c_and_m_and_stdin_run_as_python_runs_them(shell):
    (shell[1] / "tool.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.stdin.read().strip())\n")
    done = run(shell, "echo piped | python -m tool x && python -c 'import sys; print(sys.argv)' y")
    assert done.stdout == "__main__ ['x'] piped\n['-c', 'y']\n", done.stderr


def test_an_uncaught_exception_prints_the_scripts_traceback_and_exits_1(shell):
    done = run(shell, "python -c 'raise ValueError(42)'")
    assert done.returncode == 1 and done.stderr.endswith("ValueError: 42\n")
    assert done.stderr.startswith("Traceback") and "preloaded_python" not in done.stderr, done.stderr


def test_interpreter_flags_and_start_up_variables_get_a_fresh_interpreter(shell):
    assert run(shell, f'python -c "{FORKED}"').stdout == "True\n"
    assert run(shell, f'python -X dev -c "{FORKED}"').stdout == "False\n"
    for variable in ("PYTHONHASHSEED", "OMP_NUM_THREADS", "TORCH_LOGS", "MALLOC_ARENA_MAX"):
        assert run(shell, f'python -c "{FORKED}"', **{variable: "7"}).stdout == "False\n", variable
    assert "can't open file" in run(shell, "python missing.py").stderr


def test_forks_draw_their_own_random_numbers(shell):
    draws = {run(shell, "python -c 'import random; print(random.random())'").stdout for _ in range(2)}
    assert len(draws) == 2


def test_a_fork_killed_by_a_signal_kills_its_caller_the_same_way(shell):
    assert run(shell, "exec python -c 'import os; os.kill(os.getpid(), 15)'").returncode == -signal.SIGTERM


def test_killing_the_caller_kills_the_fork(shell, tmp_path):
    pid_file = tmp_path / "pid"
    base, cwd = shell
    caller = subprocess.Popen(["python", "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()));"
                               " time.sleep(120)"], cwd=cwd, env=base)
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    fork = int(pid_file.read_text())
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 30
    while Path(f"/proc/{fork}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{fork}").exists() and fork != caller.pid
