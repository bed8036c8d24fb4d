"""Where buckets are cut, and how many reductions hold buffers at once; no process group.

Stage 2's transient full gradient is bounded by its largest bucket, so its buckets also end
where a unit (a block) ends; stages 0-1, whose full gradients persist, keep ``bucket_mb``
alone. Over the in-flight cap, the oldest reduction lands before the next item is launched.
"""

from __future__ import annotations

from torch import nn

from shardengine.distributed.work import Work
from shardengine.flat.plan import UnitCuts, count_elements, plan_replicated_buckets
from shardengine.stages.recipes import STAGES
from shardengine.flat.units import find_units
from shardengine.step.reducer import OrderedReducer
from shardengine.testing.models import build_gpt

MIB = 2**20


def _unit_index(model: nn.Module) -> dict[int, int]:
    return {id(p): i for i, (_, _, params) in enumerate(find_units(model, None, None)) for p in params}


def test_stage_2_buckets_never_span_two_units_and_cover_every_parameter_once() -> None:
    model = build_gpt("10m", n_layer=4, seed=0)
    plans = plan_replicated_buckets(model, {}, 25 * MIB, unit_cuts=UnitCuts())
    unit_of = _unit_index(model)
    assert all(len({unit_of[id(p)] for p in plan.params}) == 1 for plan in plans)
    planned = [id(p) for plan in plans for p in plan.params]
    assert sorted(planned) == sorted(id(p) for p in model.parameters())
    # head and final norm, the four blocks in backward order, then the embeddings
    blocks = [[id(p) for p in block.parameters()][::-1] for block in model.blocks]
    assert [[id(p) for p in plan.params] for plan in plans[1:5]] == blocks[::-1]
    assert len(plans) == 6
    # stages 0-1: bucket_mb alone, so their 25 MiB buckets hold several blocks (2 buckets of fp32)
    by_size = plan_replicated_buckets(model, {}, 25 * MIB)
    assert len(by_size) == 2 and all(len({unit_of[id(p)] for p in plan.params}) > 1 for plan in by_size)


def test_a_block_larger_than_bucket_mb_is_still_cut_by_size() -> None:
    model = build_gpt("10m", n_layer=2, seed=0)
    block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    plans = plan_replicated_buckets(model, {}, block_bytes // 3, unit_cuts=UnitCuts())
    by_size = plan_replicated_buckets(model, {}, block_bytes // 3)
    assert len(plans) > len(by_size) > 1
    assert max(sum(p.numel() for p in plan.params) for plan in plans) * 4 <= block_bytes // 3


def test_stage_2_counts_follow_its_buckets_and_stages_0_1_do_not() -> None:
    model = build_gpt("10m", n_layer=4, seed=0)
    world = 3  # every bucket pads to a multiple of 3 on its own
    stage2 = count_elements(model, world, STAGES[2].spec.bucket_shape)
    stage1 = count_elements(model, world, STAGES[1].spec.bucket_shape)
    layouts = plan_replicated_buckets(model, {}, 25 * MIB, unit_cuts=UnitCuts())
    psi = sum(p.numel() for p in model.parameters())
    assert stage2.trainable == stage1.trainable == psi
    assert stage1.padded == -(-psi // world) * world
    assert stage2.padded == sum(-(-sum(p.numel() for p in plan.params) // world) * world for plan in layouts)


class _Handle:
    """A backend handle that completes when waited for."""

    def __init__(self) -> None:
        self.done = False


class _Comm:
    class stats:  # noqa: N801 - the attribute Work adds its wait time to
        seconds = 0.0

    def wait_for(self, handle: _Handle) -> None:
        handle.done = True


def test_the_oldest_reduction_lands_before_the_next_item_is_launched_over_the_cap() -> None:
    comm, landed, seen_at_launch = _Comm(), [], {}

    def launch(item: str) -> list[Work]:
        seen_at_launch[item] = list(landed)  # an item allocates its buffers when launched
        return [Work(comm, "reduce_scatter", (_Handle(),)).then(lambda: landed.append(item))]

    reducer = OrderedReducer(launch, expected=lambda item: 1, max_inflight=2)
    reducer.start(["a", "b", "c", "d"])
    for item in "abcd":
        reducer.arrived(item, f"{item}.weight")
        reducer.launch_ready()
    # never more than two in flight, not even while the third allocates
    assert seen_at_launch == {"a": [], "b": [], "c": ["a"], "d": ["a", "b"]}
    reducer.flush()
    assert landed == ["a", "b", "c", "d"]
