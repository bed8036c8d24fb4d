"""Units whose inputs and outputs are structures, and units never picked where nothing runs.

(issue 39, items 5 and 9.) Each test names the peer test it restates.
"""

from __future__ import annotations

import pytest
from torch import nn

import shardengine as se
from peer_structures_cases import train_structured, train_with_containers
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(2, 3)


@pytest.mark.parametrize("kind", ["dataclass", "registered", "object"])
@pytest.mark.parametrize("stage,world", [(3, 2), (3, 3), (0, 3), (1, 2), (2, 3)])
def test_structured_outputs_get_their_backward(rank_pools: RankPoolRegistry, kind: str, stage: int,
                                               world: int) -> None:
    """FSDP2's test_structured_input_output: units take and return a dataclass (registered with
    pytree or not; here also a plain object). Stage 3 once crashed inside autograd (the unit was
    freed after forward and never gathered for backward); now they train as one process."""
    for rank, result in enumerate(rank_pools.get(world).run(train_structured, {"kind": kind, "stage": stage})):
        assert result["error"] < 1e-5, f"rank {rank}: {result}"


@pytest.mark.parametrize("stage,world", [(3, 2), (3, 3), (2, 2)])
def test_containers_are_never_units(rank_pools: RankPoolRegistry, stage: int, world: int) -> None:
    """wrap_min_params=1 on a root holding a ModuleList and a ModuleDict: the containers (never
    called) once became units and the first forward raised ShardedAccessError; their elements are
    the units now."""
    for rank, result in enumerate(rank_pools.get(world).run(train_with_containers, {"stage": stage})):
        assert result["error"] < 1e-5, f"rank {rank}: {result}"
        if stage == 3:
            assert result["units"] == ["layers.0", "layers.1", "heads.a", "heads.b", "<root>"], result["units"]


def test_wrapping_a_container_class_is_refused() -> None:
    with pytest.raises(se.ConfigError, match="ModuleList, a container whose forward never runs"):
        se.Stage3(wrap=(nn.ModuleList,))
