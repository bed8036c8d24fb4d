"""Weight-file plumbing, no engine: the streaming safetensors writer against the safetensors
library, file planning, element-range reads, and key matching (exact names, sensible prefixes)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import given, strategies as st

from shardengine.errors import CheckpointError
from shardengine.state.hf.state_keys import best_mapping, match_keys
from shardengine.state.hf.weight_files import (SafetensorsWriter, WeightFiles, entry_bytes, file_names, parse_size,
                                               plan_files, write_index)

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8,
          torch.uint8, torch.bool]
shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple)
tensor_specs = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=6)


def _random(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=generator).to(dtype)


@given(specs=tensor_specs, order_seed=st.integers(0, 1000))
def test_streamed_file_reads_back_with_the_safetensors_library(tmp_path_factory, specs, order_seed) -> None:
    """Tensors written in any order, at their offsets, make a file the library reads exactly."""
    folder = tmp_path_factory.mktemp("writer")
    tensors = {f"t{i}": _random(dtype, shape, i) for i, (dtype, shape) in enumerate(specs)}
    entries = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    writer = SafetensorsWriter(str(folder / "out.safetensors"), entries)
    order = list(tensors)
    random.Random(order_seed).shuffle(order)
    for name in order:
        writer.write(name, tensors[name])
    writer.close()
    assert os.path.getsize(folder / "out.safetensors") == writer.nbytes
    loaded = load_file(str(folder / "out.safetensors"))
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


@given(shape=st.lists(st.integers(min_value=1, max_value=6), min_size=0, max_size=3).map(tuple),
       data=st.data())
def test_reading_an_element_range_equals_slicing_the_flat_tensor(tmp_path_factory, shape, data) -> None:
    folder = tmp_path_factory.mktemp("ranges")
    tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    save_file({"w": tensor}, str(folder / "model.safetensors"))
    torch.save({"w": tensor}, str(folder / "weights.pt"))
    lo = data.draw(st.integers(0, tensor.numel()))
    hi = data.draw(st.integers(lo, tensor.numel()))
    for path in (str(folder), str(folder / "weights.pt")):
        files = WeightFiles(path)
        assert torch.equal(files.read("w", lo, hi), tensor.reshape(-1)[lo:hi]), path


def test_writer_refuses_a_wrong_tensor_and_an_unfinished_file(tmp_path) -> None:
    writer = SafetensorsWriter(str(tmp_path / "a.safetensors"), [("w", torch.float32, (2,)), ("b", torch.float32, (1,))])
    with pytest.raises(CheckpointError, match=r"w is torch.float16 \[2\], the header says torch.float32 \[2\]"):
        writer.write("w", torch.zeros(2, dtype=torch.float16))
    writer.write("w", torch.zeros(2))
    with pytest.raises(CheckpointError, match="never received b"):
        writer.close()


@given(sizes=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=20),
       limit=st.integers(min_value=1, max_value=120))
def test_file_plan_keeps_order_and_respects_the_size_limit(sizes, limit) -> None:
    entries = [(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]
    files = plan_files(entries, limit)
    assert [e for f in files for e in f] == entries
    for file in files:
        assert file and (sum(entry_bytes(e) for e in file) <= limit or len(file) == 1)
    names = file_names(len(files))
    assert len(set(names)) == len(files) and (len(files) > 1 or names == ["model.safetensors"])


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("five gigs")


def test_index_and_missing_files_are_checked(tmp_path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    write_index(str(tmp_path), {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
                [("a", torch.float32, (2,)), ("b", torch.float32, (3,))])
    with pytest.raises(CheckpointError, match=r"missing .*model-00002-of-00002.safetensors \(1 tensors, e.g. b\)"):
        WeightFiles(str(tmp_path))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(CheckpointError, match="the index lists b in this file, but it does not hold them"):
        WeightFiles(str(tmp_path))


def test_torch_files_that_cannot_be_mapped_are_named(tmp_path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: cannot be memory-mapped"):
        WeightFiles(str(tmp_path))
    torch.save({"step": 3}, str(tmp_path / "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match="not a state dict of tensors"):
        WeightFiles(str(tmp_path))


# --------------------------------------------------------------------------- key matching


def test_prefixes_are_matched_sensibly() -> None:
    head_ckpt = {"model.layers.0.w", "model.norm.w", "lm_head.w"}
    base_keys = [["layers.0.w"], ["norm.w"]]
    match = match_keys(base_keys, head_ckpt, base_prefix="model")
    assert match.source == {"layers.0.w": "model.layers.0.w", "norm.w": "model.norm.w"}
    assert match.outside == ["lm_head.w"] and not match.missing and not match.unexpected
    # The reverse: a base checkpoint into the model with a head; the tied head is found via its other key.
    match = match_keys([["model.embed.w", "lm_head.w"], ["model.norm.w"]], {"embed.w", "norm.w"},
                       base_prefix="model")
    assert match.source == {"model.embed.w": "embed.w", "model.norm.w": "norm.w"}
    # Wrappers' prefixes.
    assert best_mapping(["a.w"], {"module.a.w"}).checkpoint_key("a.w") == "module.a.w"
    assert best_mapping(["a.w"], {"_orig_mod.a.w"}).checkpoint_key("a.w") == "_orig_mod.a.w"
    # No renaming wins ties, and nothing is matched fuzzily.
    assert best_mapping(["w"], {"w", "model.w"}, base_prefix="model").checkpoint_key("w") == "w"
    match = match_keys([["norm.weight"]], {"norm.wieght"})
    assert match.missing == ["norm.weight"] and match.unexpected == ["norm.wieght"]


def test_optional_keys_are_not_errors() -> None:
    match = match_keys([["h.0.w"], ["h.0.attn.masked_bias"]], {"h.0.w", "h.0.attn.bias"},
                       ignore_missing=[r"attn\.masked_bias"], ignore_unexpected=[r"attn\.bias"])
    assert match.missing == [] and match.optional_missing == ["h.0.attn.masked_bias"] and match.unexpected == []


# --------------------------------------------------------------------------- any module, no transformers


def test_plain_module_round_trip(tmp_path) -> None:
    """save_pretrained / load_pretrained need no transformers: a torch module, tied head, buffer."""
    import shardengine as se
    from toy_models import Net
    torch.manual_seed(0)
    source = Net(vocab=7, dim=5, hidden=[3], tied=True)
    model, _ = se.shard(source, torch.optim.SGD(source.parameters(), lr=0.1), stage=3)
    files = se.save_pretrained(model, str(tmp_path), max_shard_size=64)
    assert len(files) > 2 and files[-1].endswith("model.safetensors.index.json")
    expected = model.full_state_dict()
    stored = {}
    for file in files[:-1]:
        stored.update(load_file(file))
    assert "head.weight" not in stored  # the tied head is stored once, as embed.weight
    assert all(torch.equal(stored[k], v) for k, v in expected.items() if k != "head.weight")
    torch.manual_seed(1)
    with torch.device("meta"):
        refused = Net(vocab=7, dim=5, hidden=[3], tied=True)
    with pytest.raises(se.ConfigError, match=r"buffer shift \(Net\).*meta_parameters\(\)"):
        se.shard(refused, lambda params: torch.optim.SGD(params, lr=0.1), stage=3)
    with se.model.meta_parameters():  # a CPU skeleton: the buffer computed in __init__ stays real
        fresh = Net(vocab=7, dim=5, hidden=[3], tied=True)
    model, _ = se.shard(fresh, lambda params: torch.optim.SGD(params, lr=0.1), stage=3)
    report = se.load_pretrained(model, str(tmp_path))
    loaded = model.full_state_dict()
    assert report.tensors == len(stored) and all(torch.equal(loaded[k], v) for k, v in expected.items())
