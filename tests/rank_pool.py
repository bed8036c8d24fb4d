"""A pool of long-lived Gloo ranks that tests send work to.

Starting a rank means starting Python and importing torch: seconds each on
this 2-core machine. Property tests run dozens of examples, so spawning per
test (or per example) would blow the suite's time budget. A ``RankPool``
starts ``world_size`` worker processes once, initializes a Gloo process group
of that size in them (127.0.0.1, a free port), and then runs module-level
functions on every rank on request.

Usage::

    from rank_pool import RankPool

    def rank_sum(value: float) -> float:          # module level: workers import it
        import torch, torch.distributed as dist
        t = torch.tensor([value * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    with RankPool(world_size=2) as pool:
        assert pool.run(rank_sum, 1.0) == [3.0, 3.0]   # one result per rank, rank order

Failure policy (why the pool restarts itself): after a call, every rank
reports its default group's collective sequence number. If any rank raised
and the numbers disagree, or a rank did not answer within ``timeout``, or a
rank died, the ranks no longer agree on which collective comes next; any
later call would pair mismatched collectives and hang. The pool is then
killed and restarted lazily on the next ``run``. Errors raised to the caller
carry every failing rank's traceback and the tail of its output.

A graceful shutdown ends each worker as a training script ends (leave the
group, exit the interpreter) and checks its exit code: an abort at exit is a
``RankPoolError``, not something nobody sees.

Worker output (stdout and stderr, C-level included) is forwarded line by line
to the parent's ``sys.stderr`` with a ``[rank r]`` prefix, so ``pytest -s``
shows it and pytest shows it for a failing test.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import gc
import importlib
import importlib.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from types import ModuleType
from typing import Any, Callable, Iterable

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
# Test modules live in one folder per area (tests/README.md) and import the shared harness
# and each other's cases by module name, in pytest and in the pool's workers alike: every
# folder holding test modules goes on the path.
TEST_DIRS = [TESTS_DIR] + sorted(
    entry.path for entry in os.scandir(TESTS_DIR)
    if entry.is_dir() and not entry.name.startswith((".", "_")) and
    any(name.endswith(".py") for name in os.listdir(entry.path)))


def scripts_pythonpath(*extra: str) -> str:
    """PYTHONPATH for a script started from a test: the test folders, the repository, ``extra``."""
    return os.pathsep.join([*TEST_DIRS, REPO_ROOT, *extra])

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
DEFAULT_CALL_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0  # leaving the group and exiting takes ~2 s per worker on a busy machine
OUTPUT_TAIL_LINES = 60
# Written by a worker to its stdout after each call, so the parent knows the
# call's output has been read before it builds an error message.
_CALL_DONE_MARKER = "\x00rank-pool-call-done"


class RankPoolError(RuntimeError):
    """Base class of the errors ``RankPool`` raises."""


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """An exception raised by ``fn`` on one rank (exceptions may not pickle, so text)."""

    rank: int
    exc_type: str
    message: str
    traceback: str


class RankError(RankPoolError):
    """``fn`` raised on one or more ranks; ``failures`` maps rank -> RankFailure."""

    def __init__(self, message: str, failures: dict[int, RankFailure], results: list[Any]):
        super().__init__(message)
        self.failures = failures
        # Per rank: the return value, or None where that rank failed.
        self.results = results


class RanksUnresponsive(RankPoolError):
    """Some ranks timed out or died; the pool was torn down and restarts on next use."""

    def __init__(self, message: str, silent_ranks: list[int], dead_ranks: list[int]):
        super().__init__(message)
        self.silent_ranks = silent_ranks
        self.dead_ranks = dead_ranks


# --------------------------------------------------------------------------- parent side


def find_free_port() -> int:
    """A port free right now on 127.0.0.1 (a tiny race remains; start-up retries on it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def function_reference(fn: Callable[..., Any]) -> tuple[str, str, str | None]:
    """(module, qualname, file) by which a worker can import ``fn``."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module_name or not qualname or "<" in qualname or module_name == "__main__":
        raise TypeError(
            f"RankPool.run needs a module-level function the workers can import, got {fn!r}; "
            "move it to module level in a test or helper module (no lambdas, closures or __main__)."
        )
    module = sys.modules.get(module_name)
    return module_name, qualname, getattr(module, "__file__", None)


class _Worker:
    """One rank's process, its command channel and a thread forwarding its output."""

    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection):
        self.rank = rank
        self.process = process
        self.conn = conn
        self.output_tail: collections.deque[str] = collections.deque(maxlen=OUTPUT_TAIL_LINES)
        # Id of the last call whose output has been read, guarded by the condition.
        self.last_call_done = -1
        self.finished_call_output: list[str] = []
        self.call_done = threading.Condition()
        self.reader = threading.Thread(target=self._forward_output, daemon=True)
        self.reader.start()

    def _forward_output(self) -> None:
        assert self.process.stdout is not None
        for raw in iter(self.process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if line.startswith(_CALL_DONE_MARKER):
                with self.call_done:
                    # Keep output per call, so an error shows the failing call's lines only.
                    self.finished_call_output = list(self.output_tail)
                    self.output_tail.clear()
                    self.last_call_done = int(line[len(_CALL_DONE_MARKER):])
                    self.call_done.notify_all()
                continue
            self.output_tail.append(line)
            try:
                print(f"[rank {self.rank}] {line}", file=sys.stderr, flush=True)
            except (ValueError, OSError):  # parent's stderr closed at interpreter exit
                pass

    def output_of_call(self, call_id: int, timeout: float = 1.0) -> str:
        """What the worker printed during call ``call_id``, once the reader has it all."""
        with self.call_done:
            if self.call_done.wait_for(lambda: self.last_call_done >= call_id, timeout=timeout):
                return "\n".join(self.finished_call_output) or "(no output)"
        return self.tail_text()

    def tail_text(self) -> str:
        """Output since the last finished call (the current call's, for a hung rank)."""
        return "\n".join(self.output_tail) or "(no output)"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.conn.close()
        self.reader.join(timeout=2.0)


def _worker_env(rank: int, world_size: int, port: int, collective_timeout_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        # Up to 4 ranks share 2 cores: more threads per rank only thrash.
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        RANK_POOL_COLLECTIVE_TIMEOUT_S=str(collective_timeout_s),
    )
    # Gloo otherwise resolves the hostname, which may not route; loopback always does.
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _spawn_worker(rank: int, env: dict[str, str]) -> _Worker:
    parent_sock, child_sock = socket.socketpair()
    bootstrap = (
        f"import sys; sys.path[:0] = [*{TEST_DIRS!r}, {REPO_ROOT!r}]; "
        f"import rank_pool; rank_pool.worker_main({child_sock.fileno()})"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", bootstrap],
        env=env,
        pass_fds=[child_sock.fileno()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    child_sock.close()
    return _Worker(rank, process, Connection(parent_sock.detach()))


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle, not Connection.send: once torch.multiprocessing is imported,
    # multiprocessing's pickler would try to pass tensors through shared memory.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


_live_pools: "weakref.WeakSet[RankPool]" = weakref.WeakSet()


@atexit.register
def _kill_live_pools() -> None:
    """No worker may outlive the test session, whatever path the parent exits by."""
    for pool in list(_live_pools):
        pool.shutdown(graceful=False)


class RankPool:
    """``world_size`` long-lived Gloo ranks; ``run(fn, ...)`` runs fn on all of them.

    Processes start on construction (unless ``start=False``) without waiting;
    the first ``run`` (or ``wait_ready``) waits for them, so several pools can
    start in parallel.
    """

    def __init__(
        self,
        world_size: int,
        *,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        start: bool = True,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0  # times the pool was torn down after a failure
        self.shardengine_import_error: str | None = None
        self._workers: list[_Worker] = []
        self._ready = False
        self._stopping = False
        self._next_call_id = 0
        _live_pools.add(self)
        if start:
            self.start()

    # ---- lifecycle

    def start(self) -> None:
        """Spawn the worker processes without waiting for them (no-op if running)."""
        if self._workers:
            return
        port = find_free_port()
        self._workers = [
            _spawn_worker(rank, _worker_env(rank, self.world_size, port, self.collective_timeout_s))
            for rank in range(self.world_size)
        ]
        self._ready = False

    def wait_ready(self, attempts: int = 3) -> None:
        """Block until every rank has its process group; retry start-up on a lost port race."""
        for attempt in range(attempts):
            self.start()
            try:
                self._await_ready_messages()
                return
            except RanksUnresponsive as error:
                self._kill_workers()
                # A rank dying at start-up is typically rank 0 losing the port race;
                # a rank that stays silent for startup_timeout_s is not worth retrying.
                if not error.dead_ranks or attempt == attempts - 1:
                    raise

    def _await_ready_messages(self) -> None:
        if self._ready:
            return
        replies, silent, dead = self._collect(None, self.startup_timeout_s)
        if silent or dead:
            raise RanksUnresponsive(
                self._unresponsive_message("start-up", silent, dead, self.startup_timeout_s),
                silent,
                dead,
            )
        self.shardengine_import_error = replies[0][1]
        self._ready = True

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers: ask them to leave the group and exit (graceful), then kill what remains.

        A graceful stop checks how each worker exited: ``RankPoolError`` if one
        did not exit with code 0 (e.g. an abort at interpreter exit) or not at all.
        """
        self.request_stop(graceful)
        problems = self.finish_stop(time.monotonic() + STOP_TIMEOUT_S)
        if problems:
            raise RankPoolError("\n".join(problems))

    def request_stop(self, graceful: bool = True) -> None:
        """Ask every worker to leave the group and exit (no-op unless graceful and ready)."""
        self._stopping = graceful and self._ready
        if self._stopping:
            for worker in self._workers:
                try:
                    _send(worker.conn, ("stop",))
                except OSError:
                    pass

    def finish_stop(self, deadline: float) -> list[str]:
        """Wait for the workers asked to stop, kill the rest; describe every abnormal exit."""
        problems = []
        for worker in self._workers if self._stopping else []:
            try:
                code = worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                worker.reader.join(timeout=2.0)  # its last words (e.g. "terminate called ...")
                what = "did not exit" if code is None else f"exited with code {code}"
                problems.append(f"RankPool(world_size={self.world_size}) rank {worker.rank} {what} when "
                                f"stopped; output (tail):\n{worker.tail_text()}")
        self._stopping = False
        self._kill_workers()
        return problems

    def _kill_workers(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []
        self._ready = False

    def _tear_down_after_failure(self) -> None:
        self._kill_workers()
        self.restarts += 1

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def pids(self) -> list[int]:
        """Worker process ids in rank order (starts the pool if needed)."""
        self.wait_ready()
        return [worker.process.pid for worker in self._workers]

    # ---- running work

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises ``RankError`` if fn raised on any rank, ``RanksUnresponsive``
        if a rank did not answer within ``timeout`` seconds or died.
        """
        reference = function_reference(fn)
        self.wait_ready()
        call_id = self._next_call_id
        self._next_call_id += 1
        # Arguments are pickled separately so a worker unpickles them inside its
        # error handling, after importing fn's module (which may define their types).
        arguments = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        payload = pickle.dumps(("call", call_id, reference, arguments), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._send_to_all(payload)
            replies, silent, dead = self._collect(call_id, timeout)
        except BaseException:
            # e.g. KeyboardInterrupt: ranks may be mid-call; never reuse them half-way.
            self._tear_down_after_failure()
            raise
        if silent or dead:
            message = self._unresponsive_message(f"{fn.__qualname__}", silent, dead, timeout)
            self._tear_down_after_failure()
            raise RanksUnresponsive(message, silent, dead)
        return self._results_or_raise(fn, replies)

    def _send_to_all(self, payload: bytes) -> None:
        for worker in self._workers:
            try:
                worker.conn.send_bytes(payload)
            except OSError:
                pass  # the worker died since the last call; _collect sees its EOF and names it

    def _collect(self, call_id: int | None, timeout: float) -> tuple[dict[int, tuple], list[int], list[int]]:
        """Wait for one reply per rank: (replies by rank, silent ranks, dead ranks)."""
        by_conn = {worker.conn: worker for worker in self._workers}
        replies: dict[int, tuple] = {}
        dead: list[int] = []
        deadline = time.monotonic() + timeout
        while by_conn and time.monotonic() < deadline:
            for conn in wait(list(by_conn), timeout=max(0.0, deadline - time.monotonic())):
                worker = by_conn.pop(conn)
                try:
                    reply = _recv(conn)
                except (EOFError, OSError):
                    dead.append(worker.rank)
                    continue
                if call_id is not None and reply[1] != call_id:
                    by_conn[conn] = worker  # a reply to an earlier, abandoned call: skip it
                    continue
                replies[worker.rank] = reply
            if dead:
                break  # the others are likely blocked in a collective with the dead rank
        silent = sorted(worker.rank for worker in by_conn.values())
        return replies, silent, sorted(dead)

    def _results_or_raise(self, fn: Callable[..., Any], replies: dict[int, tuple]) -> list[Any]:
        results = [replies[rank][2] if replies[rank][0] == "ok" else None for rank in range(self.world_size)]
        failures = {rank: reply[2] for rank, reply in replies.items() if reply[0] == "err"}
        message = self._failure_message(fn, failures, call_id=replies[0][1]) if failures else ""
        if len({reply[3] for reply in replies.values()}) > 1:
            # Ranks ran different numbers of collectives: the group is out of step.
            self._tear_down_after_failure()
            message += "\nThe ranks' collectives got out of step: the pool was torn down and restarts on next use."
        if failures:
            raise RankError(message, failures, results)
        return results

    # ---- messages

    def _exit_code(self, rank: int) -> int | None:
        # The channel reports EOF a moment before the process can be reaped.
        try:
            return self._workers[rank].process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _failure_message(self, fn: Callable[..., Any], failures: dict[int, RankFailure], call_id: int) -> str:
        lines = [f"{fn.__qualname__} raised on rank(s) {sorted(failures)} of {self.world_size}:"]
        for rank, failure in sorted(failures.items()):
            lines.append(f"\n--- rank {rank} traceback ---\n{failure.traceback.rstrip()}")
            lines.append(f"--- rank {rank} output (tail) ---\n{self._workers[rank].output_of_call(call_id)}")
        if self.shardengine_import_error:
            lines.append(f"\nNote: `import shardengine` failed in the workers:\n{self.shardengine_import_error}")
        return "\n".join(lines)

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Ask hung ranks for every thread's Python stack (faulthandler, registered in
        worker_main), so the message shows where they wait, not just that they do."""
        for rank in ranks:
            try:
                self._workers[rank].process.send_signal(signal.SIGUSR1)
            except (OSError, ValueError):
                pass
        if ranks:
            time.sleep(1.0)  # the dump goes through the output reader thread

    def _unresponsive_message(self, what: str, silent: list[int], dead: list[int], timeout: float) -> str:
        lines = [f"RankPool(world_size={self.world_size}) {what}:"]
        if silent:
            lines.append(f"rank(s) {silent} did not answer within {timeout:g} s")
        if dead:
            codes = {rank: self._exit_code(rank) for rank in dead}
            lines.append(f"rank(s) {dead} died (exit codes {codes})")
        lines.append("The pool was torn down and will restart on next use.")
        self._dump_stacks(silent)
        for rank in silent + dead:
            lines.append(f"--- rank {rank} output (tail) ---\n{self._workers[rank].tail_text()}")
        return "\n".join(lines)


def rank_world() -> tuple[int, int]:
    """This worker's rank and world size: (0, 1) with no process group (``run_local``, a plain script)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def run_local(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    """Run fn in this process with no process group: "world size 1, not distributed".

    Returns a one-element list so callers can treat it like ``RankPool.run``.
    """
    return [fn(*args, **kwargs)]


class RankPoolRegistry:
    """One lazily started pool per world size, shared by a whole test session."""

    def __init__(self, **pool_options: Any):
        self._pool_options = pool_options
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        """The session's pool of ``world_size`` ranks, started on first use."""
        self.prestart([world_size])
        pool = self._pools[world_size]
        pool.wait_ready()
        return pool

    def prestart(self, world_sizes: Iterable[int]) -> None:
        """Spawn the pools for several world sizes at once so their start-ups overlap."""
        for world_size in world_sizes:
            if world_size not in self._pools:
                self._pools[world_size] = RankPool(world_size, **self._pool_options)

    def shutdown_all(self, graceful: bool = True) -> None:
        """Stop every pool, in parallel; graceful: ``RankPoolError`` naming every worker that
        exited abnormally (an abort at exit would otherwise go unnoticed)."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.request_stop(graceful)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        problems = [problem for pool in pools for problem in pool.finish_stop(deadline)]
        if problems:
            raise RankPoolError("\n".join(problems))


# --------------------------------------------------------------------------- worker side


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this worker when the parent dies, even by SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: EOF on the command channel still ends the worker


def _import_shardengine() -> str | None:
    """Import shardengine now (not per call); return the traceback text if it fails."""
    try:
        importlib.import_module("shardengine")
    except Exception:  # the package may be mid-edit: report on use, don't break the pool
        return traceback.format_exc()
    return None


def _load_module(module_name: str, file: str | None) -> ModuleType:
    if module_name in sys.modules:
        return sys.modules[module_name]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError:
        if file is None:
            raise
    # e.g. pytest's importmode=importlib names modules that are not on sys.path
    spec = importlib.util.spec_from_file_location(module_name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(reference: tuple[str, str, str | None]) -> Callable[..., Any]:
    module_name, qualname, file = reference
    target: Any = _load_module(module_name, file)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _to_cpu(value: Any) -> Any:
    """Results travel by pickle: tensors detached and on CPU; containers recursed."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(item) for item in value)
    if isinstance(value, dict) and type(value) is dict:
        return {key: _to_cpu(item) for key, item in value.items()}
    return value


def _sequence_number() -> int:
    """The default group's collective counter: equal on all ranks iff they are in step."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def _execute(call_id: int, reference: tuple, arguments: bytes) -> bytes:
    """Run one call; return the pickled reply (pickled here so a bad result is an error, not a crash)."""
    try:
        fn = _resolve(reference)
        args, kwargs = pickle.loads(arguments)
        result = _to_cpu(fn(*args, **kwargs))
        return pickle.dumps(("ok", call_id, result, _sequence_number()), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - every failure, unpicklable results included, must reach the parent
        failure = RankFailure(int(os.environ["RANK"]), type(exc).__qualname__, str(exc), traceback.format_exc())
        return pickle.dumps(("err", call_id, failure, _sequence_number()), protocol=pickle.HIGHEST_PROTOCOL)


def _init_process_group() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout_s = float(os.environ["RANK_POOL_COLLECTIVE_TIMEOUT_S"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def _collect_garbage(freeze_survivors: bool) -> None:
    """Free the last call's garbage now, so it cannot skew the next call's memory.

    A full collection over torch's ~180k objects takes ~70 ms; freezing what
    survives after imports (modules live forever) keeps it to ~1 ms per call.
    """
    gc.collect()
    if freeze_survivors:
        gc.freeze()


def worker_main(fd: int) -> None:
    """Entry point of a worker process: init the group, then serve calls until told to stop."""
    _set_parent_death_signal()
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung rank's stacks (see _dump_stacks)
    conn = Connection(fd)
    import_error = _import_shardengine()  # before the group exists, as a training script does
    _init_process_group()
    _send(conn, ("ready", import_error))
    _collect_garbage(freeze_survivors=True)
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            break  # parent gone
        if message[0] == "stop":
            break
        _, call_id, reference, arguments = message
        modules_before = len(sys.modules)
        conn.send_bytes(_execute(call_id, reference, arguments))
        _collect_garbage(freeze_survivors=len(sys.modules) != modules_before)
        sys.stderr.flush()
        print(f"{_CALL_DONE_MARKER}{call_id}", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
