"""What one check found, and the table of all of them."""
from __future__ import annotations

import dataclasses
from typing import Sequence

# "info": a measurement with nothing to pass or fail; "skip": not measurable here (says why).
STATUSES = ("pass", "fail", "info", "skip")


@dataclasses.dataclass(frozen=True)
class Check:
    """One row of the verdict: which area, what was checked, the outcome and its figures.

    >>> Check("correctness", "stage 2 fp32", "pass", "max |Δ| 1e-07").failed
    False
    """

    area: str
    name: str
    status: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")

    @property
    def failed(self) -> bool:
        return self.status == "fail"


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0 (skipped and informational rows pass)."""
    return 1 if any(check.failed for check in checks) else 0


def render(checks: Sequence[Check], title: str) -> str:
    """The verdict as a rich table, rendered to text (no colour codes: logs and CI read it)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for column in ("area", "check", "verdict", "figures"):
        table.add_column(column, overflow="fold")
    for check in checks:
        table.add_row(check.area, check.name, check.status.upper(), check.detail)
    console = Console(width=120, no_color=True, record=True, force_terminal=False)
    with console.capture() as captured:
        console.print(table)
    return captured.get()
