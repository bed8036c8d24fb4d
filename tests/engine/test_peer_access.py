"""Parameters used outside their unit's forward, and units entered through another method.

(issue 39, items 6 and 7.) Each test names the peer test it restates. At stage 3 a unit's
parameters are gathered around its forward; a read of one of them elsewhere inside the
model's forward (or backward) gathers its unit there and keeps it until its backward, as
DeepSpeed registers and trains such "external parameters".
"""

from __future__ import annotations

import pytest
from torch import nn

from peer_access_cases import train_external
from rank_pool import RankPoolRegistry

pytestmark = pytest.mark.prestart(2, 3)

EACH_LINEAR = {"wrap": (nn.Linear,)}  # every Linear its own unit: every use outside it is external


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("model", ["getattr", "return"])
@pytest.mark.parametrize("stage", [3, 2])
def test_external_parameters_train_as_one_process(rank_pools: RankPoolRegistry, model: str, stage: int,
                                                  world: int) -> None:
    """DeepSpeed's test_ext_param_getattr (the parent reads linear1.weight after linear1 ran) and
    test_ext_param_return (a module returns its bias, the parent adds it)."""
    spec = {"model": model, "stage": stage, "options": EACH_LINEAR}
    for rank, result in enumerate(rank_pools.get(world).run(train_external, spec)):
        assert result["message"] is None, f"rank {rank}: {result['message']}"
        assert result["error"] < 1e-5, f"rank {rank}: {result}"


@pytest.mark.parametrize("options", [{}, EACH_LINEAR], ids=["head_in_root", "head_a_unit"])
@pytest.mark.parametrize("stage,world", [(3, 2), (3, 3), (1, 3)])
def test_tied_head_called_alone_per_chunk(rank_pools: RankPoolRegistry, stage: int, world: int,
                                          options: dict) -> None:
    """FSDP2's test_partial_group_forward_then_standalone: a head tied to the embedding (its weight
    in the root unit) applied in the forward to one chunk and called alone on each further chunk;
    as a unit of its own (wrap=(nn.Linear,)) it once raised ShardedAccessError on the tied weight."""
    spec = {"model": "tied_head", "stage": stage, "options": options}
    for rank, result in enumerate(rank_pools.get(world).run(train_external, spec)):
        assert result["message"] is None, f"rank {rank}: {result['message']}"
        assert result["error"] < 1e-5, f"rank {rank}: {result}"


@pytest.mark.parametrize("world,register", [(2, True), (3, True), (2, False)])
def test_registered_forward_method_gathers_its_unit(rank_pools: RankPoolRegistry, world: int,
                                                    register: bool) -> None:
    """FSDP2's register_fsdp_forward_method: the parent calls self.vit.forward_features(x), a unit
    entered through another method than forward; registered, it trains as one process, and
    unregistered too (its parameters gathered on first use: an external use)."""
    for rank, result in enumerate(rank_pools.get(world).run(
            train_external, {"model": "forward_features", "stage": 3, "register": register})):
        assert result["message"] is None, f"rank {rank}: {result['message']}"
        assert result["error"] < 1e-5, f"rank {rank}: {result}"
