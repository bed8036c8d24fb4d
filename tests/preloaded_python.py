"""``python`` that starts in a tenth of a second: a fork of an interpreter that has imported torch.

Starting Python and importing torch, shardengine and memory_estimator takes ~4.5 s of CPU on
this machine, and the documentation's runnable blocks start about sixty such processes
(``python block.py``, ``python -m ...``, ``memory-estimator ...``). A ``PreloadedPython``
server imports those once; each command is then a ``fork()`` of it that runs the script as
``python`` would, in a process of its own::

    with PreloadedPython(env, preload=("torch",)) as server:
        server.write_shims(bin_dir)     # bin_dir/python, bin_dir/python3, bin_dir/memory-estimator
        subprocess.run([bin_dir / "python", "-c", "import torch; print(torch.ones(1))"], env=env)

[Note: what a preloaded fork keeps of a fresh interpreter]
The forked process runs ``python SCRIPT``, ``python -c CODE`` or ``python -m MODULE`` with the
caller's argv, working directory, environment, stdin, stdout and stderr (passed over a Unix
socket), a fresh ``__main__``, ``sys.path[0]`` and ``PYTHONPATH`` as the caller's ``python``
would set them, ``tempfile``'s directory read again from ``TMPDIR``, fresh random seeds, and
its exit status (a signal included) returned as the caller's own. What a fork cannot give is
a different interpreter *start*: anything read while the preloaded modules were imported.
So the shim runs the real interpreter instead (exec, same argv) for any other command line
(interpreter flags other than ``-u``, such as ``-X``; ``-``), and whenever the caller's
environment differs from the server's in a variable read at start-up or import (``PYTHON*``,
``TORCH*``, ``OMP_*``, ``LD_*``, ``MALLOC_*``, ...: ``STARTUP_VARIABLES``; torchrun's
``TORCHELASTIC_*`` are read later). Killing the caller kills the fork. What the fork starts
with ``sys.executable`` is a fresh interpreter as before; torchrun's ranks are forks too where
``PYTHON_EXEC`` (torchrun's own override) names the shim.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

SERVER_START_TIMEOUT_S = 300.0
SOCKET_VARIABLE = "PRELOADED_PYTHON_SOCKET"
STARTUP_VARIABLES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "OPENBLAS", "GOTO", "CUDA", "NCCL",
                     "LD_", "MALLOC", "GLIBC", "HF_", "TRANSFORMERS", "TOKENIZERS", "NUMPY", "NPY", "LANG", "LC_",
                     "HOME", "TZ", "XDG")
# what torchrun sets for its ranks, read when the process group starts, not at import
LAUNCHER_VARIABLES = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
FALLBACK = b"F"
_SERVER_PATH: list[str] = []  # the server's sys.path after its start-up (PYTHONPATH, site), before preloading


@dataclass(frozen=True)
class ForkedPython:
    """What a test uses to start Python processes (the ``forked_python`` fixture, tests/conftest.py)."""

    python: str             # in place of sys.executable
    env: dict[str, str]     # the server's environment; a process whose start-up variables differ
                            # from it runs a fresh interpreter (STARTUP_VARIABLES)


class PreloadedPython:
    """A server process that imported ``preload``; ``write_shims`` points ``python`` at it."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ("torch", "shardengine", "memory_estimator.cli"),
                 cwd: str | None = None):
        self.folder = tempfile.mkdtemp(prefix="preloaded_python_")
        self.socket_path = os.path.join(self.folder, "socket")
        self.env = {**env, SOCKET_VARIABLE: self.socket_path}
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", self.socket_path,
                                         *preload], env=self.env, cwd=cwd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not os.path.exists(self.socket_path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the preloaded Python server did not start (exit {self.process.returncode})")
            time.sleep(0.05)

    def write_shims(self, bin_dir: str | os.PathLike) -> None:
        """``python``, ``python3`` and ``memory-estimator`` in ``bin_dir``, served by this server."""
        client = f'exec "{sys.executable}" -I -S "{os.path.abspath(__file__)}" run'
        for name, command in {"python": "", "python3": "", "memory-estimator": " -m memory_estimator.cli"}.items():
            shim = os.path.join(bin_dir, name)
            with open(shim, "w") as file:
                file.write(f'#!/usr/bin/env bash\n{client}{command} "$@"\n')
            os.chmod(shim, 0o755)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()            # waits for what it started, then exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for name in os.listdir(self.folder):
            os.unlink(os.path.join(self.folder, name))
        os.rmdir(self.folder)

    def __enter__(self) -> "PreloadedPython":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# ------------------------------------------------------------------------------ client


def _client(argv: list[str]) -> None:
    """The shim's side: hand argv, cwd, environment and stdio to a fork; exit with its status."""
    path = os.environ.get(SOCKET_VARIABLE)
    if path and os.path.exists(path) and _stdio_open():
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(path)
        except OSError:                         # no server any more: the real interpreter
            answer = FALLBACK
        else:
            answer = _exchange(connection, pickle.dumps((argv, os.getcwd(), dict(os.environ))))
        connection.close()
        if not answer:
            sys.stderr.write(f"preloaded_python: the server at {path} ended before the command did\n")
            os._exit(1)
        if answer != FALLBACK:
            code = int(answer)
            if code < 0:                        # killed by a signal: die by the same one
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code)
    os.execv(sys.executable, [sys.executable, *argv])


def _stdio_open() -> bool:
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
    except OSError:
        return False
    return True


def _exchange(connection: socket.socket, request: bytes) -> bytes:
    """Send the request with our stdio; the answer (empty if the server's side ended first)."""
    chunks = []
    try:
        socket.send_fds(connection, [len(request).to_bytes(8, "little")], [0, 1, 2])
        connection.sendall(request)
        while chunk := connection.recv(4096):
            chunks.append(chunk)
    except OSError:
        return b""
    return b"".join(chunks)


# ------------------------------------------------------------------------------ server


def _serve(socket_path: str, preload: list[str]):
    """Import ``preload``, then fork a handler per connection; returns only in a fork that runs a job."""
    import importlib
    from rank_pool import _set_parent_death_signal
    _set_parent_death_signal()
    _SERVER_PATH[:] = sys.path[1:]              # sys.path[0] is this file's folder
    for name in preload:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    server_env = dict(os.environ)
    # Handlers are reaped here, and all of them before a SIGTERM ends the server, so their CPU
    # time (their forks' included) counts as the server's, and the caller's once it waits for it.
    signal.signal(signal.SIGCHLD, lambda *_: _reap(os.WNOHANG))
    signal.signal(signal.SIGTERM, lambda *_: (_reap(0), os._exit(0)))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".binding")
    listener.listen(64)
    os.rename(socket_path + ".binding", socket_path)  # the path appears once it accepts
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            job = _handle(connection, server_env)
            if job is None:
                os._exit(0)
            return job
        connection.close()


def _reap(options: int) -> None:
    try:
        while os.waitpid(-1, options)[0]:
            pass
    except ChildProcessError:
        pass


def _handle(connection: socket.socket, server_env: dict[str, str]):
    """Receive one request; run it in a fork (returned there) or answer FALLBACK; report the status."""
    header, fds, _, _ = socket.recv_fds(connection, 8, 3)
    size = int.from_bytes(header, "little")
    request = b""
    while len(request) < size:
        request += connection.recv(size - len(request))
    argv, cwd, env = pickle.loads(request)
    unbuffered = argv[:1] == ["-u"]             # how torchrun starts its ranks
    argv = argv[unbuffered:]
    if not _forkable(argv, cwd, env, server_env):
        connection.sendall(FALLBACK)
        return None
    pid = os.fork()
    if pid == 0:
        connection.close()
        return argv, cwd, env, fds, unbuffered
    for fd in fds:
        os.close(fd)
    status = _supervise(pid, connection)
    if status is not None:
        connection.sendall(str(status).encode())
    return None


def _forkable(argv: list[str], cwd: str, env: dict[str, str], server_env: dict[str, str]) -> bool:
    """A command line this module runs as python would (anything else: the real interpreter)."""
    if not argv or argv[0] in ("-c", "-m") and len(argv) < 2:
        return False
    if argv[0].startswith("-") and argv[0] not in ("-c", "-m") or argv[0] == "-":
        return False
    if not argv[0].startswith("-") and not os.path.isfile(os.path.join(cwd, argv[0])):
        return False                            # python's own "can't open file" message
    changed = {key for key in env.keys() | server_env.keys() if env.get(key) != server_env.get(key)}
    return not any(key.startswith(STARTUP_VARIABLES) and not key.startswith(LAUNCHER_VARIABLES) for key in changed)


def _supervise(pid: int, connection: socket.socket) -> int | None:
    """The fork's exit code (negative: killed by that signal), or None if the caller went away first."""
    process = os.pidfd_open(pid)
    readable, _, _ = select.select([process, connection], [], [])
    if process not in readable:                 # the caller closed the socket: it was killed
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _become_fresh(argv: list[str], cwd: str, env: dict[str, str], fds: list[int], unbuffered: bool) -> None:
    """Take the caller's stdio, directory, environment and sys.path; reseed what a fork shares."""
    import io
    import random
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None                     # read TMPDIR again
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.realpath(argv[0]))
    sys.path[:] = [first, *_SERVER_PATH]        # the same PYTHONPATH, or this is no fork
    sys.argv = [argv[0], *argv[2:]] if argv[0] in ("-c", "-m") else list(argv)
    sys.orig_argv = [sys.executable, *["-u"][:unbuffered], *argv]
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    # as the interpreter opens them: unbuffered, or stderr line-buffered and stdout when a terminal
    for name, fd, mode, line_buffering in (("stdin", 0, "rb", False), ("stdout", 1, "wb", os.isatty(1)),
                                           ("stderr", 2, "wb", True)):
        line_buffering = line_buffering and not unbuffered
        old = getattr(sys, name)
        binary = open(fd, mode, closefd=False, buffering=0 if unbuffered and fd else -1)
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors,
                                  line_buffering=line_buffering, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_job(argv: list[str], cwd: str, env: dict[str, str], fds: list[int], unbuffered: bool) -> int:
    """Run the script, ``-c`` code or ``-m`` module as ``__main__``; the exit code python would give."""
    import builtins
    import runpy
    import types
    _become_fresh(argv, cwd, env, fds, unbuffered)
    main = types.ModuleType("__main__")
    main.__builtins__, main.__annotations__ = builtins, {}
    sys.modules["__main__"] = main
    try:
        if argv[0] == "-m":
            if not hasattr(sys.modules.get(argv[1]), "__path__"):
                sys.modules.pop(argv[1], None)  # a preloaded module runs again as __main__; a package's __main__ runs
            runpy._run_module_as_main(argv[1], alter_argv=True)
        elif argv[0] == "-c":
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            import importlib.machinery
            path = os.path.abspath(argv[0])     # as python >= 3.9 names the script
            main.__file__, main.__cached__ = path, None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
            with open(path, "rb") as file:
                source = file.read()
            exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as exit_request:
        return _exit_code(exit_request.code)
    except BaseException as error:              # as the interpreter reports it, this frame left out
        error = error.with_traceback(error.__traceback__.tb_next)
        sys.excepthook(type(error), error, error.__traceback__)
        return 1
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "run":
        _client(sys.argv[2:])
    job = _serve(sys.argv[2], sys.argv[3:])
    sys.exit(_run_job(*job))
