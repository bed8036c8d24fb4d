"""``python -m shardengine.selfcheck``: is shardengine right and fast on this machine?

One command, on any machine, in a minute (``--fast``) or a few: the environment
(environment.py), stages 0-3 against one process, fp32 and bf16
(correctness.py), the collectives' bus bandwidth (links.py), the device's rates
and the allocator's overheads (device_rates.py), written as a calibration file
for the estimator (calibration_file.py), the estimator's per-rank peak against
the measured one (memory_estimate.py), and a verdict table with a non-zero exit code when
something is wrong (verdict.py, measurement_rows.py, cli.py). See
docs/observability.md.

[Note: the selfcheck is a tool at the edge]
The engine reaches the estimator only through ``stage="auto"`` (shardengine/auto.py),
and the estimator reads only the engine's pure modules. The selfcheck needs both
whole: it trains with the engine and asks the estimator, as
``memory_estimator.measure.validate`` does from the other side. It lives here, so that
``python -m shardengine.selfcheck`` is where a user of the engine looks, but as a
leaf: nothing else in ``shardengine`` imports it, and it imports the engine only
through its public API (``shardengine``, ``shardengine.distributed`` for the
communicator and the fake process group, ``shardengine.testing`` for the model).
tests/test_package_boundaries.py holds it to exactly that, so the one-way rule
between the engine's core and the estimator is unchanged. Like every module
outside ``shardengine/distributed/``, it never calls torch.distributed itself.
"""
from .cli import main, run
from .verdict import Check

__all__ = ["Check", "main", "run"]
