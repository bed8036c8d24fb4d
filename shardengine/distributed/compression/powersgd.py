"""PowerSGD: low-rank gradient compression for data parallelism (stage 0), as pure math.

Nothing here talks to other processes: :class:`PowerSGDState` is one rank's
side of a step, split at the two all-reduces (``compute_p`` → all-reduce the
P's → ``compute_q`` → all-reduce the Q's → ``decompress``), and
:func:`simulate_powersgd_all_reduce` runs N ranks in one process with the
all-reduces as sums. Results are sums in fp32, like the communicator's.

[Note: one PowerSGD step] (Vogels et al., 2019)
Per gradient matrix M (m x n) on each rank: add the rank's error, P = M Q
(m x r); all-reduce P; orthonormalize it to P^; Q = M^T P^ (n x r); all-reduce
Q; the sum of the M's is approximated by P^ Q^T. That is (m + n) r numbers per
matrix on the wire instead of m n. With warm start the all-reduced Q begins
the next step's power iteration, so P^ tracks the top singular vectors across
steps; without it Q is drawn afresh (same seed on every rank, so all agree).
Each rank keeps as its error what of its own M was not sent, M - P^ (M^T P^)^T
(the paper's choice; torch's hook keeps M minus the averaged approximation).
Summed over ranks both are the sum minus what was applied, so the applied
total over k steps is the true total minus the ranks' current errors.

[Note: which tensors stay uncompressed]
As in torch's PowerSGD hook, a tensor is seen as a (shape[0], -1) matrix and
is compressed only if (m + n) r * min_compression_rate < m n; the rest (1-D
biases and norms, scalars, small matrices) is all-reduced as it is, in one
flat all-reduce. Unlike the hook, 1-D tensors are never compressed, whatever
the rate.

[Note: orientation and orthogonalization]
Each matrix is turned so that P is on its shorter side (m <= n), and P is
orthonormalized by Householder QR rather than Gram-Schmidt: no division by a
zero column, and at r = min(m, n) P^ is a full orthogonal m x m matrix, so
P^ P^T = I and the result is exact whatever Q held.

>>> plan = plan_powersgd([(64, 32), (32,)], rank=2)
>>> states = [PowerSGDState(plan, seed=0) for _ in range(2)]
>>> grads = [[torch.randn(64, 32), torch.randn(32)] for _ in range(2)]
>>> summed = simulate_powersgd_all_reduce(states, grads)
>>> [tuple(t.shape) for t in summed], torch.allclose(summed[1], grads[0][1] + grads[1][1])
([(64, 32), (32,)], True)
>>> plan.wire_bytes(world=2), plan.uncompressed_bytes(world=2)   # fp32: (32 + 64) * 2 + 32 vs 64 * 32 + 32
(896, 8320)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..traffic import ring_bytes
from ...errors import ConfigError


@dataclass(frozen=True)
class MatrixPlan:
    """One compressed tensor: ``index`` in the gradient list, seen as ``rows x cols``
    (rows <= cols, ``transposed`` if that turned it), approximated at ``rank``."""

    index: int
    rows: int
    cols: int
    transposed: bool
    rank: int


@dataclass(frozen=True)
class PowerSGDPlan:
    """Which tensors of a gradient list are compressed, and how; the rest is ``dense``."""

    shapes: tuple[tuple[int, ...], ...]
    matrices: tuple[MatrixPlan, ...]
    dense: tuple[int, ...]

    @property
    def p_numel(self) -> int:
        return sum(m.rows * m.rank for m in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(m.cols * m.rank for m in self.matrices)

    @property
    def dense_numel(self) -> int:
        return sum(math.prod(self.shapes[i]) for i in self.dense)

    def wire_bytes(self, world: int, itemsize: int = 4) -> int:
        """Bytes one rank sends per step: ring all-reduces of the P's, the Q's and the dense rest."""
        return sum(ring_bytes("all_reduce", numel * itemsize, world)
                   for numel in (self.p_numel, self.q_numel, self.dense_numel))

    def uncompressed_bytes(self, world: int, itemsize: int = 4) -> int:
        """The same gradients in one plain all-reduce."""
        return ring_bytes("all_reduce", sum(math.prod(s) for s in self.shapes) * itemsize, world)


def plan_powersgd(shapes: Sequence[Sequence[int]], rank: int = 1,
                  min_compression_rate: float = 2.0) -> PowerSGDPlan:
    """Decide, per gradient shape, whether and how it is compressed (see the Notes).

    >>> plan = plan_powersgd([(1000, 1000), (1000,), (4, 4)], rank=4)
    >>> [(m.index, m.rows, m.cols, m.rank) for m in plan.matrices], plan.dense
    ([(0, 1000, 1000, 4)], (1, 2))
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"PowerSGD rank must be an int >= 1, got {rank!r}")
    if not (isinstance(min_compression_rate, (int, float)) and 0 <= min_compression_rate < math.inf):
        raise ConfigError(f"min_compression_rate must be a finite number >= 0, got {min_compression_rate!r}")
    shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
    matrices, dense = [], []
    for index, shape in enumerate(shapes):
        matrix = _matrix_plan(index, shape, rank, min_compression_rate)
        if matrix:
            matrices.append(matrix)
        else:
            dense.append(index)
    return PowerSGDPlan(shapes, tuple(matrices), tuple(dense))


def _matrix_plan(index: int, shape: tuple[int, ...], rank: int, min_rate: float) -> Optional[MatrixPlan]:
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    rows, cols = shape[0], math.prod(shape[1:])
    short, long = min(rows, cols), max(rows, cols)
    rank = min(rank, short)
    if (short + long) * rank * min_rate >= short * long:
        return None
    return MatrixPlan(index, short, long, rows > cols, rank)


class PowerSGDState:
    """One rank's PowerSGD memory (errors, warm-start Q's) and its side of a step.

    Every rank builds it from the same plan and seed. A step is
    ``compute_p`` → (all-reduce) → ``compute_q`` → (all-reduce) → ``decompress``.
    """

    def __init__(self, plan: PowerSGDPlan, seed: int = 0, warm_start: bool = True,
                 error_feedback: bool = True, device: Optional[torch.device] = None):
        self.plan, self.warm_start, self.error_feedback = plan, warm_start, error_feedback
        self.device = torch.device(device or "cpu")
        self._generator = torch.Generator(device="cpu").manual_seed(seed)
        self.errors = {m.index: torch.zeros(m.rows, m.cols, device=self.device)
                       for m in plan.matrices} if error_feedback else {}
        self._q: dict[int, torch.Tensor] = {}
        self._step: dict[int, dict[str, torch.Tensor]] = {}
        self._phase = "p"

    def compute_p(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """P = (grad + error) Q for each compressed matrix: what this rank all-reduces first."""
        self._expect("p", "compute_p")
        self._check_grads(grads)
        self._step = {}
        ps = []
        for m in self.plan.matrices:
            matrix = _as_matrix(grads[m.index], m).to(self.device, torch.float32)
            if self.error_feedback:
                matrix = matrix + self.errors[m.index]
            self._step[m.index] = {"matrix": matrix}
            ps.append(matrix @ self._starting_q(m))
        self._phase = "q"
        return ps

    def compute_q(self, p_sums: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Q = M^T P^ with P^ the orthonormalized all-reduced P: what this rank all-reduces second."""
        self._expect("q", "compute_q")
        qs = []
        for m, p_sum in zip(self.plan.matrices, p_sums, strict=True):
            step = self._step[m.index]
            step["p_hat"] = torch.linalg.qr(p_sum.to(torch.float32)).Q
            step["q_local"] = step["matrix"].T @ step["p_hat"]
            qs.append(step["q_local"])
        self._phase = "decompress"
        return qs

    def decompress(self, q_sums: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The approximated sums P^ Q^T, one per compressed matrix, in the gradients' shapes."""
        self._expect("decompress", "decompress")
        approximations = []
        for m, q_sum in zip(self.plan.matrices, q_sums, strict=True):
            step = self._step[m.index]
            if self.error_feedback:
                self.errors[m.index] = torch.addmm(step["matrix"], step["p_hat"], step["q_local"].T, alpha=-1)
            if self.warm_start:
                self._q[m.index] = q_sum.to(torch.float32)
            approximations.append(_from_matrix(step["p_hat"] @ q_sum.to(torch.float32).T, m, self.plan))
        self._step, self._phase = {}, "p"
        return approximations

    def state_dict(self) -> dict:
        """The memory carried between steps: errors and warm-start Q's, by tensor index."""
        return {"errors": dict(self.errors), "q": dict(self._q)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from a state built on the same plan."""
        expected = {m.index: (m.rows, m.cols, m.rank) for m in self.plan.matrices}
        for index, error in state["errors"].items():
            rows, cols, _ = expected[index]
            if tuple(error.shape) != (rows, cols):
                raise ValueError(f"PowerSGD error of shape {tuple(error.shape)} for a {rows}x{cols} matrix")
        for index, q in state["q"].items():
            _, cols, rank = expected[index]
            if tuple(q.shape) != (cols, rank):
                raise ValueError(f"PowerSGD Q of shape {tuple(q.shape)} for a {cols}x{rank} factor")
        if self.error_feedback:
            self.errors = {i: state["errors"][i].to(self.device, torch.float32) if i in state["errors"]
                           else torch.zeros_like(e) for i, e in self.errors.items()}
        self._q = {i: q.to(self.device, torch.float32) for i, q in state["q"].items()}

    def _starting_q(self, m: MatrixPlan) -> torch.Tensor:
        if m.index not in self._q:
            self._q[m.index] = torch.randn(m.cols, m.rank, generator=self._generator).to(self.device)
        q = self._q[m.index]
        if not self.warm_start:
            del self._q[m.index]  # a fresh draw next step
        return q

    def _expect(self, phase: str, call: str) -> None:
        if self._phase != phase:
            raise RuntimeError(f"PowerSGD {call}() called out of order: a step is compute_p, "
                               f"compute_q, decompress (next expected: {self._phase})")

    def _check_grads(self, grads: Sequence[torch.Tensor]) -> None:
        shapes = tuple(tuple(g.shape) for g in grads)
        if shapes != self.plan.shapes:
            raise ValueError(f"gradients of shapes {list(shapes)} for a PowerSGD plan of {list(self.plan.shapes)}")


def _as_matrix(grad: torch.Tensor, m: MatrixPlan) -> torch.Tensor:
    matrix = grad.reshape(grad.shape[0], -1)
    return matrix.T if m.transposed else matrix


def _from_matrix(matrix: torch.Tensor, m: MatrixPlan, plan: PowerSGDPlan) -> torch.Tensor:
    return (matrix.T if m.transposed else matrix).reshape(plan.shapes[m.index])


def simulate_powersgd_all_reduce(states: Sequence[PowerSGDState],
                                 grads_per_rank: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The summed gradients (fp32, the same on every rank): low-rank for compressed
    tensors, exact for the dense ones; rank r's state and gradients at index r."""
    if len(states) != len(grads_per_rank) or not states:
        raise ValueError(f"{len(states)} PowerSGD states for {len(grads_per_rank)} ranks' gradients")
    plan = states[0].plan
    p_sums = _sum_columns([state.compute_p(grads) for state, grads in zip(states, grads_per_rank)])
    q_sums = _sum_columns([state.compute_q(p_sums) for state in states])
    approximations = [state.decompress(q_sums) for state in states][0]
    summed: list[Optional[torch.Tensor]] = [None] * len(plan.shapes)
    for m, approximation in zip(plan.matrices, approximations):
        summed[m.index] = approximation
    for index in plan.dense:
        summed[index] = sum(grads[index].to(torch.float32) for grads in grads_per_rank)
    return summed


def _sum_columns(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(column).sum(dim=0) for column in zip(*per_rank)]
