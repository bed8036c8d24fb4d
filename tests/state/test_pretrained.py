"""Pretrained weights in and out of sharded models (``se.load_pretrained`` / ``se.save_pretrained``).

* Exactness: load a ``save_pretrained`` folder -> train -> save -> ``from_pretrained``
  equals the unwrapped model trained on the global batch, at N = 1, 2, 3 and
  stages 0-3, for GPT-2 (decoder-only, tied embeddings) and T5 (encoder-decoder).
* Mixed precision: the fp32 masters get (and save) the full-precision values.
* Each rank reads only what it holds: bytes read add up to one copy of the model.
* Bad input (a missing shard file, a truncated file, a missing or extra key, a
  shape that differs): a clear error naming them on every rank, the model untouched.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_cases as cases  # noqa: E402
import shardengine as se  # noqa: E402
from engine_cases import rel_err  # noqa: E402
from rank_pool import RankPoolRegistry  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, str]:
    """A sharded "pretrained" folder per family (several files, as large checkpoints are)."""
    root = tmp_path_factory.mktemp("pretrained")
    folders = {}
    for family in ("gpt2", "t5"):
        folders[family] = str(root / family)
        cases.make_pretrained(family, folders[family], max_shard_size="10KB")
        assert os.path.isfile(os.path.join(folders[family], "model.safetensors.index.json"))
    return folders


@pytest.fixture(scope="module")
def references(pretrained) -> dict[str, tuple[dict, list[float]]]:
    return {family: cases.reference(family, folder, STEPS) for family, folder in pretrained.items()}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_load_train_save_equals_unwrapped_training(rank_pools: RankPoolRegistry, pretrained, references,
                                                   tmp_path, family: str, world: int) -> None:
    stages = [0, 1, 2, 3]
    results = rank_pools.get(world).run(cases.load_train_save, family, pretrained[family], str(tmp_path),
                                        stages, STEPS)
    expected, expected_losses = references[family]
    for stage in stages:
        folder = tmp_path / f"stage{stage}"
        assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1  # spread over ranks
        saved = cases.load(family, str(folder)).state_dict()
        assert sorted(saved) == sorted(expected)
        errors = {key: rel_err(saved[key], expected[key]) for key in expected}
        bad = {key: err for key, err in errors.items() if not err <= 2e-4}
        assert not bad, f"stage {stage}, N={world}: differs from the unwrapped training: {bad}"
        mean_losses = [sum(r[stage][step] for r in results) / world for step in range(STEPS)]
        assert mean_losses == pytest.approx(expected_losses, rel=1e-4)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_mixed_precision_masters_load_and_save_full_precision(rank_pools: RankPoolRegistry, pretrained,
                                                              tmp_path, stage: int) -> None:
    source = pretrained["gpt2"]
    results = rank_pools.get(2).run(cases.load_then_save, "gpt2", source, str(tmp_path / "out"), stage,
                                    {"param_dtype": "bf16"})
    assert results[0]["master_dtypes"] == ["torch.float32"]
    assert results[0]["param_dtypes"] == ["torch.bfloat16"]
    original = cases.load("gpt2", source).state_dict()
    saved = cases.load("gpt2", str(tmp_path / "out")).state_dict()
    for key, value in original.items():
        assert saved[key].dtype == torch.float32 and torch.equal(saved[key], value), key
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_each_rank_reads_only_what_it_holds(rank_pools: RankPoolRegistry, pretrained, tmp_path, stage: int) -> None:
    results = rank_pools.get(2).run(cases.load_then_save, "gpt2", pretrained["gpt2"], str(tmp_path / "out"),
                                    stage, {})
    model_bytes = sum(t.numel() * t.element_size() for t in {id(p): p for p in
                      cases.load("gpt2", pretrained["gpt2"]).parameters()}.values())
    read = [r["bytes_read"] for r in results]
    if stage == 0:  # every rank holds (and steps) the whole model
        assert read == [model_bytes, model_bytes]
    else:           # each element is read by exactly one rank, about half each
        assert sum(read) == model_bytes
        assert all(abs(r - model_bytes / 2) < 0.1 * model_bytes for r in read), read


def _bad_folders(good: str, root) -> dict[str, str]:
    """Copies of ``good`` (a sharded folder) broken in one way each."""
    from safetensors.torch import load_file, save_file
    bad = {}
    index = json.load(open(os.path.join(good, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))

    def copy(name: str) -> str:
        bad[name] = str(root / name)
        shutil.copytree(good, bad[name])
        return bad[name]

    os.remove(os.path.join(copy("missing_file"), files[1]))
    with open(os.path.join(copy("truncated"), files[0]), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(good, files[0])) - 64)
    for case in ("missing_key", "shape", "extra_key"):
        folder = copy(case)
        path = os.path.join(folder, files[0])
        tensors = load_file(path)
        name = sorted(tensors)[0]
        if case == "missing_key":
            del tensors[name]
            del index["weight_map"][name]
        elif case == "shape":
            tensors[name] = torch.zeros(tensors[name].numel() + 1)
        else:
            tensors["extra.weight"] = torch.zeros(3)
            index["weight_map"]["extra.weight"] = files[0]
        save_file(tensors, path, metadata={"format": "pt"})
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        index = json.load(open(os.path.join(good, "model.safetensors.index.json")))
    bad["empty_folder"] = str(root / "empty")
    os.makedirs(bad["empty_folder"])
    return bad


@pytest.mark.parametrize("stage", [1, 3])
def test_bad_checkpoints_are_clear_errors_and_leave_the_model_untouched(
        rank_pools: RankPoolRegistry, pretrained, tmp_path, stage: int) -> None:
    good = pretrained["gpt2"]
    bad = _bad_folders(good, tmp_path)
    index = json.load(open(os.path.join(good, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    first_key = sorted(k for k, f in index["weight_map"].items() if f == files[0])[0]
    expected = {
        "missing_file": [files[1], "missing"],
        "truncated": [files[0], "not a complete safetensors file"],
        "missing_key": ["missing from the checkpoint", first_key],
        "shape": ["shapes differ", first_key],
        "extra_key": ["not in the model", "extra.weight"],
        "empty_folder": ["no weights found", "model.safetensors"],
    }
    results = rank_pools.get(2).run(cases.bad_loads, "gpt2", stage, good, bad)
    for rank, outcome in enumerate(results):
        for case, fragments in expected.items():
            message = outcome[case]["error"]
            assert message is not None, f"rank {rank}: {case} loaded without an error"
            for fragment in fragments:
                assert fragment in message, f"rank {rank}, {case}: {fragment!r} not in {message!r}"
            assert outcome[case]["untouched"], f"rank {rank}, {case}: the model changed"


# --------------------------------------------------------------------------- keys, formats (one process)


def _shard_and_load(family: str, source: str, stage: int = 3, **kwargs):
    net = cases.build(family, device="meta" if stage == 3 else None)
    model, _ = se.shard(net, cases.optimizer_factory, stage=stage)
    return model, se.load_pretrained(model, source, **kwargs)


def test_head_checkpoint_loads_into_the_base_model_and_back(tmp_path) -> None:
    head = cases.make_pretrained("llama", str(tmp_path / "head"))
    model, report = _shard_and_load("llama-base", str(tmp_path / "head"))
    assert report.key_mapping == "checkpoint keys under 'model.'" and report.outside == ["lm_head.weight"]
    full = model.full_state_dict()
    assert all(torch.equal(full[k], head["model." + k]) for k in full)
    # A base checkpoint into a model with a tied head: every tensor found (the head through its tie).
    se.save_pretrained(model, str(tmp_path / "base"))
    net = cases.build("llama", device="meta", tie_word_embeddings=True)
    tied, _ = se.shard(net, cases.optimizer_factory, stage=3)
    report = se.load_pretrained(tied, str(tmp_path / "base"))
    assert report.key_mapping == "model keys without 'model.'" and not report.missing
    assert torch.equal(tied.full_state_dict()["lm_head.weight"], head["model.embed_tokens.weight"])


def test_torch_state_dicts_load_too(tmp_path) -> None:
    """A torch.save file (here with DDP's 'module.' prefix), and a sharded one with its index."""
    state = cases.make_pretrained("gpt2", str(tmp_path / "hf"))
    torch.save({f"module.{k}": v for k, v in state.items()}, str(tmp_path / "ddp.pt"))
    model, report = _shard_and_load("gpt2", str(tmp_path / "ddp.pt"), stage=2)
    assert report.key_mapping == "checkpoint keys under 'module.'"
    assert all(torch.equal(v, state[k]) for k, v in model.full_state_dict().items())
    folder = tmp_path / "bin"
    folder.mkdir()
    keys = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": keys[::2], "pytorch_model-00002-of-00002.bin": keys[1::2]}
    for file, names in halves.items():
        torch.save({k: state[k] for k in names}, str(folder / file))
    with open(folder / "pytorch_model.bin.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, names in halves.items() for k in names}}, f)
    model, report = _shard_and_load("gpt2", str(folder))
    assert all(torch.equal(v, state[k]) for k, v in model.full_state_dict().items())


def test_not_strict_reports_what_it_left(tmp_path) -> None:
    state = cases.make_pretrained("gpt2", str(tmp_path / "hf"))
    from safetensors.torch import save_file
    partial = {k: v for k, v in state.items() if k != "transformer.ln_f.weight" and k != "lm_head.weight"}
    save_file({**partial, "extra.bias": torch.zeros(2)}, str(tmp_path / "partial.safetensors"))
    model, report = _shard_and_load("gpt2", str(tmp_path / "partial.safetensors"), strict=False)
    assert report.missing == ["transformer.ln_f.weight"] and report.unexpected == ["extra.bias"]
    assert torch.equal(model.full_state_dict()["transformer.wte.weight"], state["transformer.wte.weight"])


def test_consolidate_writes_a_hugging_face_folder(tmp_path) -> None:
    from shardengine.state.consolidate import main
    source = str(tmp_path / "hf")
    cases.make_pretrained("gpt2", source)
    net = cases.build("gpt2")
    model, optimizer = se.shard(net, cases.optimizer_factory, stage=1)
    se.load_pretrained(model, source)
    se.save_checkpoint(str(tmp_path / "ckpt"), model, optimizer)
    out = str(tmp_path / "consolidated")
    assert main([str(tmp_path / "ckpt"), out, "--format", "hf", "--config", source,
                 "--max-shard-size", "10KB"]) == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    loaded = cases.load("gpt2", out).state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in model.full_state_dict().items())


def test_consolidate_to_hf_without_config_uses_the_recorded_one(tmp_path, capsys) -> None:
    """A checkpoint of a transformers model records its config: ``--format hf`` alone loads.

    Loaded with ``AutoModelForCausalLM``, so the folder's config names its architecture."""
    import transformers
    from shardengine.state.consolidate import main
    model, optimizer = se.shard(cases.build("gpt2"), cases.make_optimizer, stage=2)
    cases.train(model, optimizer, "gpt2", 1)
    se.save_checkpoint(str(tmp_path / "ckpt"), model, optimizer)
    out = str(tmp_path / "consolidated")
    assert main([str(tmp_path / "ckpt"), out, "--format", "hf"]) == 0
    assert "config.json" in capsys.readouterr().out  # says where the config came from
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded).__name__ == type(model.module).__name__
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.full_state_dict().items())


def test_consolidate_to_hf_without_any_config_is_a_clear_error(tmp_path, capsys) -> None:
    """A module without a Hugging Face config: exit 2 naming --config, and no folder written."""
    from shardengine.state.consolidate import main
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model, optimizer = se.shard(net, cases.make_optimizer, stage=1)
    se.save_checkpoint(str(tmp_path / "ckpt"), model, optimizer)
    out = tmp_path / "consolidated"
    assert main([str(tmp_path / "ckpt"), str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and "from_pretrained" in err and not out.exists()


def test_transformers_renamings_of_older_checkpoints_apply(tmp_path) -> None:
    """GPT-NeoX checkpoints store the head as embed_out (the module calls it lm_head)."""
    import transformers
    config = transformers.GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, vocab_size=64)
    source = transformers.GPTNeoXForCausalLM(config)
    source.save_pretrained(str(tmp_path))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "embed_out.weight" in f.keys()
    with torch.device("meta"):
        net = transformers.GPTNeoXForCausalLM(config)
    model, _ = se.shard(net, cases.optimizer_factory, stage=3)
    se.load_pretrained(model, str(tmp_path))
    full = model.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in source.state_dict().items())
