"""Which of a bucket's pieces the step inside backward steps together: runs under a byte cap.

[Note: the step inside backward under a byte cap]
With ``step_in_backward=True`` a bucket is stepped where its reduced gradient
lands, in the middle of backward: its temporaries stack on the gathered unit,
the reductions still in flight and the activations alive there, so they set
the peak. Stepping a whole bucket at once makes an fp32 copy of its gradient
slice (under mixed precision the slice is in the reduce dtype) and the
optimizer's temporaries over all of it (``foreach`` AdamW: the square root of
every ``exp_avg_sq``), about two bucket slices in fp32 above the states.

So that step runs over consecutive runs of the bucket's pieces of at most
``STEP_GROUP_BYTES`` (in the master's dtype) each; a piece larger than that is
a run of its own (a piece is one optimizer tensor with its own state: it is
never split), and runs may grow to the bucket's largest piece, which is stepped
alone anyway (fewer optimizer calls at the same peak). Each run's gradient is
cast for that run alone and dropped after it, so the working set is that of
the largest run, not the bucket's. The
values are the same as one step over the bucket (an element-wise optimizer
updates each tensor from its own gradient and state). The cap is a few hundred
thousand elements: small enough to stay below a transformer block's shard,
large enough that tiny tensors (norms, biases) are stepped together and a
step is not a long series of one-tensor optimizer calls.

The estimator reads the same runs (memory_estimator/engines/shardengine_exact.py).

>>> step_runs([10, 10, 30, 5, 5, 5], element_bytes=4, cap_bytes=80)  # 20 elements; the largest piece 30
[[0, 1], [2], [3, 4, 5]]
>>> step_runs([10, 10, 5, 5, 5], element_bytes=4, cap_bytes=40)
[[0], [1], [2, 3], [4]]
"""

from __future__ import annotations

from typing import Sequence

from ..flat.layout import split_into_buckets

STEP_GROUP_BYTES = 1 << 20  # 1 MiB of fp32: 262,144 elements per run at most (unless one piece is larger)


def step_runs(piece_numels: Sequence[int], element_bytes: int, cap_bytes: int = 0) -> list[list[int]]:
    """The runs of a bucket's pieces (indices, in order) that one in-backward step call steps
    together: consecutive, of at most ``cap_bytes`` (default ``STEP_GROUP_BYTES``) of
    ``element_bytes`` each or the bucket's largest piece, whichever is more (that piece is a
    run anyway, so runs up to its size cost no more at the peak and take fewer calls); the
    same grouping as buckets of parameters."""
    cap_numel = max(1, (cap_bytes or STEP_GROUP_BYTES) // element_bytes, *piece_numels)
    return split_into_buckets(piece_numels, cap_numel)
