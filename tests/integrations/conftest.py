"""Fixtures the integration tests share."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> str:
    """A small Llama checkpoint written by save_pretrained (hf_cases.make_pretrained), once per module."""
    import hf_cases  # tests/harness is on sys.path by then (tests/conftest.py)

    folder = str(tmp_path_factory.mktemp("llama-base"))
    hf_cases.make_pretrained("llama", folder)
    return folder


@pytest.fixture(scope="session")
def host_peak_folder(tmp_path_factory) -> str:
    """The host-peak tests' Llama checkpoint (peft_meta_cases.HOST_PEAK_SIZE, 202 MB), written once."""
    import hf_cases
    from peft_meta_cases import HOST_PEAK_SIZE

    folder = str(tmp_path_factory.mktemp("llama-host-peak"))
    hf_cases.build("llama", seed=1, **HOST_PEAK_SIZE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def host_peaks(host_peak_folder: str) -> dict[str, list[dict]]:
    """flow -> each rank's host peaks while building, loading and taking the first step at
    N = HOST_PEAK_WORLD, in fresh ranks (their high-water marks start at the imports): LoRA,
    and QLoRA on NF4 and int8 bases where bitsandbytes is installed. The flows share the
    ranks, the high-water mark reset before each, where the kernel allows it; each flow runs
    in ranks of its own otherwise.

    glibc raises its mmap threshold to the size of a freed large block, so freed unit-sized
    buffers would stay in the heap and count as resident: the ranks run with a fixed
    threshold, which returns them (docs/finetuning.md shows both)."""
    from peft_meta_cases import HOST_PEAK_SIZE, HOST_PEAK_WORLD, host_peaks_of_flows
    from shardengine.testing.host_memory import peak_rss_resets
    from rank_pool import RankPool

    flows = ["lora"] + (["nf4-double", "int8"] if importlib.util.find_spec("bitsandbytes") else [])
    results: dict[str, list[dict]] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
        for group in ([flows] if peak_rss_resets() else [[flow] for flow in flows]):
            with RankPool(HOST_PEAK_WORLD) as pool:
                per_rank = pool.run(host_peaks_of_flows, host_peak_folder, HOST_PEAK_SIZE, group, timeout=600)
            results.update({flow: [peaks[flow] for peaks in per_rank] for flow in group})
    return results
