"""Inference engines as receivers: the stream in the form their ``load_weights`` takes (each tied weight
once, no buffers), the vLLM and SGLang receivers refused clearly where those packages are missing, and
driven for real where they are installed (a GPU box)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import shardengine as se
import stream_cases as cases
from shardengine.rl.receivers.engines import SGLangReceiver, VLLMReceiver


@pytest.mark.parametrize("stage, receivers", [(3, [0]), (0, "all")])
def test_the_engines_walk_yields_each_weight_once_in_their_dtype(rank_pools, stage, receivers) -> None:
    for found in rank_pools.get(2).run(cases.named_weights_for_engines, stage, receivers, timeout=300):
        receives = receivers == "all" or found["rank"] in receivers
        assert found["names"] == (found["params"] if receives else [])
        assert found["equal"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_a_vllm_receiver_without_vllm_says_which_package_is_missing() -> None:
    with pytest.raises(se.ConfigError, match="'vllm' package"):
        VLLMReceiver(object())


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_an_sglang_receiver_without_sglang_says_which_package_is_missing() -> None:
    with pytest.raises(se.ConfigError, match="'sglang' package"):
        SGLangReceiver(object())


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                    reason="needs vllm and a GPU")
def test_vllm_receives_a_sharded_policy_and_agrees_within_its_dtype(tmp_path) -> None:
    """A tiny Llama sharded at stage 3 (one process) streamed into vLLM's LLM; the numerics check passes."""
    from hf_cases import build
    from vllm import LLM

    from shardengine.rl import WeightSync

    net = build("llama", vocab_size=64, max_position_embeddings=64).cuda()
    net.save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", gpu_memory_utilization=0.2, enforce_eager=True)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01)  # the trainer's weights are no longer the checkpoint's: the sync must carry them
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
    probe = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    report = WeightSync(model, VLLMReceiver(llm), dtype="bf16", bucket_bytes=1 << 16, check_every=1,
                        probe=probe).sync()
    assert report.numerics is not None and report.numerics.explained_by_dtype, str(report)
