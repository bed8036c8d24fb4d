"""The one way a benchmark starts its ranks: ``torchrun --standalone`` on this machine.

Every multi-rank benchmark either runs under a launcher already (``RANK`` set by
torchrun or SLURM's wrapper) or starts one itself with :func:`relaunch`; the ones
that sweep world sizes call :func:`torchrun` once per size. Ranks get one
OpenMP thread each unless the caller set ``OMP_NUM_THREADS``: on a few cores, N ranks with a thread per core each would
oversubscribe the machine and time the scheduler, not the engine.

    >>> under_launcher({"RANK": "0"}), under_launcher({})
    (True, False)
    >>> torchrun_command("bench.py", 2, ["--rounds", "3"])[-4:]
    ['--', 'bench.py', '--rounds', '3']
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Optional


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process is one rank of a launched job (torchrun sets ``RANK``)."""
    return "RANK" in environ


def torchrun_command(script: str, nproc: int, args: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N -- script args``.

    The ``--`` keeps a benchmark's own flags (``--nproc`` among them) from being read as
    torchrun's."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "--", str(script), *args]


def torchrun(script: str, nproc: int, args: Sequence[str], env: Optional[Mapping[str, str]] = None,
             check: bool = False, echo: bool = False) -> int:
    """Run ``script`` on ``nproc`` ranks of this machine and return its exit code.

    ``env`` adds to (overrides) this process's environment; ``check`` raises on failure."""
    command = torchrun_command(script, nproc, args)
    if echo:
        print("+", " ".join(command), flush=True)
    merged = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}  # a value the user set wins
    return subprocess.run(command, env=merged, check=check).returncode


def relaunch(script: str, nproc: int, argv: Optional[Sequence[str]] = None, **kwargs) -> int:
    """Start this benchmark again under torchrun with the same arguments (``sys.argv[1:]``
    unless ``argv`` is given); the caller returns the exit code."""
    return torchrun(script, nproc, list(sys.argv[1:] if argv is None else argv), **kwargs)
