"""Capacity in every verdict: a plan fits when the device, the host's RAM and the disk hold it.

Mixtral-8x7B on one RTX 4090 fits the device only with every parameter on the host (609 GiB of
host RAM): at 128 GiB per node it does not fit, and the answer says the host is why; at 1 TiB
it fits with its host figures; with no host stated it is not a plain "fits".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memory_estimator import estimate
from memory_estimator.cli.command import main
from memory_estimator.plan.capacity import Capacity, combined_verdict

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
MIXTRAL = ["--config", str(CONFIGS / "mixtral-8x7b.json"), "--world-size", "1", "--device", "RTX4090",
           "--micro-batch", "1", "--seq-len", "512"]
LLAMA = str(CONFIGS / "llama-2-7b.json")


def run(capsys, *extra: str) -> tuple[int, str, dict]:
    code = main([*MIXTRAL, *extra])
    text = capsys.readouterr().out
    assert main([*MIXTRAL, *extra, "--json"]) == code
    return code, text, json.loads(capsys.readouterr().out)


def test_mixtral_on_one_4090_does_not_fit_128_gib_of_host_ram_and_says_so(capsys):
    code, text, payload = run(capsys, "--host-memory", "128GiB")
    assert code == 1 and payload["recommended"] is None
    plan = {p["name"]: p for p in payload["plans"]}["zero3-offload-params"]
    assert (plan["device_verdict"], plan["host_verdict"], plan["verdict"]) == ("fits", "does not fit", "does not fit")
    assert plan["host_bytes_per_node"] == plan["host_bytes"] > 128 * 2**30 and not plan["fits"]
    assert "recommended: none fits" in text
    assert "zero3-offload-params fits the device but not the node: host RAM: needs 608.94 GiB per node, " \
           "128.00 GiB available" in text
    assert "the disk tier (--offload disk): zero3-offload-params-disk fits" in text  # what would fit instead


def test_mixtral_fits_with_a_terabyte_of_host_ram_with_its_host_figures(capsys):
    code, text, payload = run(capsys, "--host-memory", "1TiB")
    assert code == 0 and payload["recommended"] == "zero3-offload-params"
    plan = {p["name"]: p for p in payload["plans"]}["zero3-offload-params"]
    assert (plan["verdict"], plan["host_verdict"]) == ("fits", "fits")
    assert payload["capacity"] == {"ranks_per_node": 1, "host_memory_bytes": 2**40, "host_memory_source": "given",
                                   "disk_space_bytes": None, "disk_space_source": "not stated"}
    assert "zero3-offload-params: host RAM 608.94 GiB per rank" in text
    assert "608.94 GiB per node (1 rank) of 1.00 TiB: fits" in text


def test_without_a_stated_host_the_answer_names_the_ram_it_needs_and_is_not_a_plain_fit(capsys):
    code, text, payload = run(capsys)
    assert payload["recommended"] == "zero3-offload-params"
    plan = {p["name"]: p for p in payload["plans"]}["zero3-offload-params"]
    assert (plan["verdict"], plan["host_verdict"]) == ("fits if", "unknown")
    assert "not a plain fit: it fits if the host has >= 608.94 GiB of RAM per node (--host-memory)" in text
    fits_row = next(line for line in text.splitlines() if line.startswith("fits "))
    assert fits_row.endswith("if node") and "yes" not in fits_row  # the table's cell: not a plain yes


def test_a_node_holds_its_ranks_host_bytes_and_the_usual_node_size_is_assumed():
    """8 A100s on one node: the node's host RAM holds 8 ranks' offloaded states."""
    result = estimate(config=LLAMA, world_size=8, seq_len=2048, device="A100-80GB", host_memory_bytes="512GiB")
    plan = result.plan("zero3-offload")
    assert result.capacity.ranks_per_node(8) == 8
    assert plan.host_bytes_per_node == 8 * plan.host_bytes and plan.host_verdict == "fits"
    tight = estimate(config=LLAMA, world_size=8, seq_len=2048, device="A100-80GB",
                     host_memory_bytes=8 * plan.host_bytes - 1)
    assert tight.plan("zero3-offload").verdict == "does not fit"
    assert tight.plan("zero3").verdict == "fits"  # nothing on the host: the host is no limit


def test_the_disk_tier_is_judged_against_the_disk_space():
    kwargs = dict(config=LLAMA, world_size=1, seq_len=2048, device="A100-80GB", disk=True,
                  host_memory_bytes="1TiB")
    unknown = estimate(**kwargs).plan("zero3-offload-params-disk")
    assert unknown.disk_verdict == "unknown" and unknown.verdict == "fits if"
    small = estimate(**kwargs, disk_space_bytes="10GiB").plan("zero3-offload-params-disk")
    assert (small.disk_verdict, small.verdict) == ("does not fit", "does not fit")
    large = estimate(**kwargs, disk_space_bytes="1TiB").plan("zero3-offload-params-disk")
    assert (large.disk_verdict, large.verdict, large.disk_bytes_per_node) == ("fits", "fits", large.disk_bytes)


def test_this_machine_defaults_to_its_available_ram_and_free_disk(monkeypatch, tmp_path):
    import memory_estimator.plan.capacity as capacity

    monkeypatch.setattr(capacity, "this_machine_host_bytes", lambda: 3 * 2**30)
    result = estimate(params=1e6, device="this-machine", offload_path=str(tmp_path))
    assert result.capacity.host_memory_bytes == 3 * 2**30
    assert result.capacity.host_source.startswith("this machine")
    assert result.capacity.disk_space_bytes > 0 and str(tmp_path) in result.capacity.disk_source


def test_on_cpu_ranks_the_device_bytes_come_out_of_the_same_ram():
    result = estimate(params=1e6, device="cpu", device_memory_bytes=2**30, host_memory_bytes=2**30, world_size=2,
                      ranks_per_node=2)
    plan = result.plan("zero3-offload")
    assert plan.host_bytes_per_node == 2 * (plan.host_bytes + plan.total)


@pytest.mark.parametrize("device, host, disk, verdict", [
    ("fits", "fits", "fits", "fits"), ("fits", "unknown", "fits", "fits if"), ("tight", "unknown", "fits", "tight"),
    ("fits", "does not fit", "unknown", "does not fit"), ("does not fit", "fits", "fits", "does not fit")])
def test_the_verdict_combines_the_three_budgets(device, host, disk, verdict):
    assert combined_verdict(device, host, disk) == verdict


def test_bad_capacities_are_refused(capsys):
    assert main([*MIXTRAL, "--host-memory", "lots"]) == 2
    assert "--host-memory" in capsys.readouterr().err
    with pytest.raises(Exception, match="ranks per node"):
        estimate(params=1e6, ranks_per_node=0)
    assert Capacity().ranks_per_node(8) == 1
