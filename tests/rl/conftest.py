"""Fixtures of the reinforcement-learning tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> str:
    """A small Llama checkpoint written by save_pretrained (hf_cases.make_pretrained), once per module."""
    import hf_cases

    folder = str(tmp_path_factory.mktemp("llama-base"))
    hf_cases.make_pretrained("llama", folder)
    return folder
