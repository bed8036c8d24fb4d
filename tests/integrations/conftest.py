"""Fixtures the integration tests share."""

from __future__ import annotations

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
