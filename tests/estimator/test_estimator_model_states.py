"""Model-state bytes: the ZeRO paper table and the sharding properties."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from memory_estimator.terms.model_states import (PLANS, BytesPerParam, bytes_per_param, model_state_bytes,
                                           plan_spec, shard_numel)
from memory_estimator.errors import EstimatorInputError

PRECISIONS = ["fp32", "bf16", "fp16"]
OPTIMIZERS = ["adamw", "adam", "sgd", "sgd-momentum", "adafactor", "adam8bit"]


def test_zero_paper_table_psi_7_5e9_n64():
    per_param = bytes_per_param("fp16", "adam")
    assert per_param == BytesPerParam(2, 2, 12)
    totals_gb = [model_state_bytes(plan, 7_500_000_000, 64, per_param).device_total / 1e9 for plan in PLANS[:4]]
    assert totals_gb == [120.0, 31.40625, 16.640625, 1.875]
    assert [round(t, 1) if t > 2 else round(t, 2) for t in totals_gb] == [120.0, 31.4, 16.6, 1.88]


@pytest.mark.parametrize("precision,optimizer,expected", [
    ("fp32", "adamw", (4, 4, 8)), ("fp32", "sgd", (4, 4, 0)), ("fp32", "sgd-momentum", (4, 4, 4)),
    ("bf16", "adamw", (2, 2, 12)), ("bf16", "sgd", (2, 2, 4)), ("fp16", "sgd-momentum", (2, 2, 8)),
    ("bf16", "adam8bit", (2, 2, 6)), ("fp32", "adam8bit", (4, 4, 2)), ("bf16", "adafactor", (2, 2, 4)),
])
def test_bytes_per_param(precision, optimizer, expected):
    assert tuple(vars(bytes_per_param(precision, optimizer)).values()) == expected


def test_offload_moves_optimizer_states_to_host():
    per_param = bytes_per_param("bf16", "adamw")
    on_device = model_state_bytes(plan_spec("zero3"), 1000, 4, per_param)
    offloaded = model_state_bytes(plan_spec("zero3-offload"), 1000, 4, per_param)
    assert offloaded.optimizer_states == 0
    assert offloaded.host_optimizer_states == on_device.optimizer_states == 250 * 12
    assert (offloaded.params, offloaded.grads) == (on_device.params, on_device.grads)


def test_engine_shard_size_overrides_even_split():
    per_param = bytes_per_param("bf16", "adamw")
    padded = model_state_bytes(plan_spec("zero3"), 1001, 4, per_param, shard_numel_per_rank=260)
    assert (padded.params, padded.grads, padded.optimizer_states) == (520, 520, 3120)
    assert model_state_bytes(plan_spec("zero3"), 1001, 4, per_param).params == 2 * 251


def test_bad_names_are_one_line_errors():
    with pytest.raises(EstimatorInputError, match="unknown optimizer 'lion'"):
        bytes_per_param("bf16", "lion")
    with pytest.raises(EstimatorInputError, match="unknown precision"):
        bytes_per_param("int8", "adam")


psi = st.integers(min_value=1, max_value=10**12)
ranks = st.integers(min_value=1, max_value=4096)
setups = st.tuples(st.sampled_from(PRECISIONS), st.sampled_from(OPTIMIZERS))


@settings(max_examples=60, deadline=None)
@given(psi, ranks, setups)
def test_per_rank_bytes_never_grow_with_world_size(num_params, n, setup):
    per_param = bytes_per_param(*setup)
    for plan in PLANS:
        fewer = model_state_bytes(plan, num_params, n, per_param).device_total
        more = model_state_bytes(plan, num_params, n + 1, per_param).device_total
        assert more <= fewer


@settings(max_examples=60, deadline=None)
@given(psi, ranks, setups)
def test_per_rank_bytes_never_grow_with_stage(num_params, n, setup):
    per_param = bytes_per_param(*setup)
    # Each chain shards or offloads more at every step; zero2-offload and zero3 are not ordered.
    for chain in (["ddp", "zero1", "zero2", "zero3", "zero3-offload", "zero3-offload-params"],
                  ["zero2", "zero2-offload", "zero3-offload"]):
        totals = [model_state_bytes(plan_spec(name), num_params, n, per_param).device_total for name in chain]
        assert all(later <= earlier for earlier, later in zip(totals, totals[1:])), chain


@settings(max_examples=60, deadline=None)
@given(psi, ranks, setups)
def test_stage3_times_n_equals_unsharded_up_to_padding(num_params, n, setup):
    per_param = bytes_per_param(*setup)
    sharded = model_state_bytes(plan_spec("zero3"), num_params, n, per_param).device_total * n
    unsharded = model_state_bytes(plan_spec("ddp"), num_params, n, per_param).device_total
    padding_elements = shard_numel(num_params, n) * n - num_params
    assert 0 <= padding_elements < n
    assert sharded - unsharded == padding_elements * per_param.total
