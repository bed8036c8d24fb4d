"""Turn a sharded checkpoint into a plain ``state_dict`` file, with no process group.

    python -m shardengine.consolidate CKPT OUT      # OUT: torch.save file, or *.safetensors
    python -m shardengine.consolidate CKPT OUT --optimizer OPT.pt   # + the optimizer, torch's format
    python -m shardengine.consolidate CKPT DIR --format hf [--config CONFIG] [--max-shard-size 5GB]

``CKPT`` is a checkpoint directory (its ``latest`` is followed) or one
``step_<k>`` directory, saved at any world size and stage. Rank files are read
one at a time, memory-mapped, and their fragments copied into the output
tensors, so memory is the output plus at most one rank's shard. The result has
the unwrapped module's keys (a tied weight under each of its keys, sharing one
tensor, as ``module.state_dict()`` does) and the parameters' original dtypes:
``module.load_state_dict(torch.load(OUT))`` just works.

``--format hf`` writes a folder as Hugging Face's ``save_pretrained`` does
(``model.safetensors``, or shards + ``model.safetensors.index.json``; a tied
weight once, under its first key), plus the ``config.json`` (and
``generation_config.json``) found at ``--config`` (the file, or a folder
holding it), so ``from_pretrained(DIR)`` loads it. Without ``--config`` the
config the checkpoint recorded is written (a transformers model's, saved by
``save_checkpoint``); a checkpoint without one is refused (exit code 2), since
a folder of weights alone does not load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Optional

import torch

from .checkpoint import SHARED_FILE, CheckpointReader, dtype_from_name, read_state, resolve_checkpoint
from ..errors import CheckpointError
from .hf.weight_files import parse_size, write_folder


def consolidate(checkpoint: str, out: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The full ``state_dict`` of the unwrapped model in ``checkpoint``; written to ``out`` if given.

    ``out`` ending in ``.safetensors`` is written with safetensors (which must
    be installed), anything else with ``torch.save``.

    >>> state = consolidate("ckpt", "model.pt")          # doctest: +SKIP
    >>> net.load_state_dict(state)                       # doctest: +SKIP
    """
    state = consolidated_state_dict(checkpoint)
    if out is not None:
        write_state_dict(state, out)
    return state


def consolidated_state_dict(checkpoint: str) -> dict[str, torch.Tensor]:
    """The unwrapped model's full ``state_dict`` from a sharded checkpoint, in memory, without a
    process group (``se.interop.consolidated_state_dict``; DeepSpeed's
    ``get_fp32_state_dict_from_zero_checkpoint``).

    ``checkpoint`` is a checkpoint directory (its ``latest`` is followed) or one
    ``step_<k>`` directory, saved at any world size and stage. Parameters and
    buffers come in ``module.state_dict()`` order and the parameters' original
    dtypes (the fp32 masters cast back); rank files are read one at a time.

    >>> import tempfile, torch, shardengine as se
    >>> net = torch.nn.Linear(4, 2)
    >>> model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
    >>> ckpt = tempfile.mkdtemp() + "/ckpt"
    >>> path = se.save_checkpoint(ckpt, model, optimizer)
    >>> state = se.interop.consolidated_state_dict(ckpt)
    >>> sorted(state), tuple(state["weight"].shape)
    (['bias', 'weight'], (2, 4))
    """
    reader = CheckpointReader(resolve_checkpoint(checkpoint))
    reader.check_present()
    params = {p["name"]: p for p in reader.manifest["params"]}
    values = {name: torch.empty(p["shape"], dtype=dtype_from_name(p["dtype"])) for name, p in params.items()}
    filled = dict.fromkeys(params, 0)
    for file in reader.record_files():
        for record in reader.load(file)["records"]:
            name, start, end = record["name"], record["start"], record["end"]
            values[name].view(-1)[start:end] = record["value"]  # casts to the original dtype
            filled[name] += end - start
        reader.release(file)  # one rank's shard at a time
    _check_filled(reader, values, filled)
    buffers = reader.load(SHARED_FILE)["buffers"]
    by_key = {key: values[p["name"]] for p in params.values() for key in p["keys"]}
    return {key: by_key[key] if key in by_key else buffers[key] for key in reader.manifest["state_dict_keys"]}


def consolidated_optimizer_state(checkpoint: str) -> dict[str, dict]:
    """``parameter name -> optimizer state`` in full shapes (as a plain optimizer over the
    unwrapped model would hold it); parameters without state are left out."""
    reader = CheckpointReader(resolve_checkpoint(checkpoint))
    result = {}
    for param in reader.manifest["params"]:
        numel = int(torch.Size(param["shape"]).numel())
        part = read_state(reader, param["name"], 0, numel) if numel else None
        if part is not None:
            result[param["name"]] = part.as_state(torch.Size(param["shape"]))
    return result


def consolidated_optimizer_state_dict(checkpoint: str) -> dict:
    """The optimizer state as a plain torch optimizer over the unwrapped model would save it:
    ``{"state": {position: {...}}, "param_groups": [{hyperparameters..., "params": [positions]}]}``,
    positions counted over the param groups given to ``shard()`` (so it loads with
    ``torch.optim.AdamW(groups).load_state_dict(...)``, or into a sharded optimizer at any layout).
    No process group is needed (``se.interop.consolidated_optimizer_state_dict``).

    >>> import tempfile, torch, shardengine as se
    >>> net = torch.nn.Linear(4, 2)
    >>> model, optimizer = se.shard(net, torch.optim.Adam(net.parameters()), stage=2)
    >>> model(torch.randn(3, 4)).sum().backward(); optimizer.step()
    >>> ckpt = tempfile.mkdtemp() + "/ckpt"
    >>> path = se.save_checkpoint(ckpt, model, optimizer)
    >>> full = se.interop.consolidated_optimizer_state_dict(ckpt)
    >>> sorted(full["state"][0]), full["param_groups"][0]["params"]
    (['exp_avg', 'exp_avg_sq', 'step'], [0, 1])
    >>> torch.optim.Adam(torch.nn.Linear(4, 2).parameters()).load_state_dict(full)
    """
    reader = CheckpointReader(resolve_checkpoint(checkpoint))
    names = reader.manifest["optimizer"].get("param_names")
    if names is None:
        raise CheckpointError(f"{reader.step_dir}: this checkpoint does not record its param groups' "
                              "members (saved by an older shardengine); only the model can be consolidated")
    by_name = consolidated_optimizer_state(checkpoint)
    hyper = reader.load(SHARED_FILE)["param_groups"]
    state, groups, position = {}, [], 0
    for group_names, group in zip(names, hyper):
        groups.append({**group, "params": list(range(position, position + len(group_names)))})
        for name in group_names:
            if name in by_name:
                state[position] = by_name[name]
            position += 1
    return {"state": state, "param_groups": groups}


def _check_filled(reader: CheckpointReader, values: dict, filled: dict) -> None:
    for name, tensor in values.items():
        if filled[name] != tensor.numel():
            raise CheckpointError(f"{reader.step_dir}: the rank files hold {filled[name]} of "
                                  f"{tensor.numel()} elements of {name}")


def write_state_dict(state: dict[str, torch.Tensor], out: str) -> None:
    """``torch.save``, or safetensors for a ``.safetensors`` path (tied tensors stored per key)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if not out.endswith(".safetensors"):
        torch.save(state, out)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"{out}: writing .safetensors needs the safetensors package "
                              "(pip install safetensors); or pick a .pt output") from None
    seen: set[int] = set()
    unshared = {}
    for key, tensor in state.items():  # safetensors refuses tensors that share memory
        unshared[key] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
        seen.add(id(tensor))
    save_file(unshared, out)


def recorded_model_config(checkpoint: str) -> Optional[dict]:
    """The Hugging Face config ``save_checkpoint`` recorded (``{"config", "generation_config"}``),
    or None: the model had none, or an older shardengine saved the checkpoint."""
    return CheckpointReader(resolve_checkpoint(checkpoint)).manifest.get("model_config")


def write_hf_folder(state: dict[str, torch.Tensor], folder: str, config: Optional[str] = None,
                    max_shard_size: str = "5GB", recorded: Optional[dict] = None) -> list[str]:
    """``state`` as a Hugging Face folder (see the module docstring); returns the files written.

    ``config``: a config.json (or a folder holding it) to copy in; else ``recorded``
    (:func:`recorded_model_config`) is written; with neither, the weights only.
    """
    files = write_folder(state, folder, parse_size(max_shard_size))
    if config is not None:
        files += _copy_config(config, folder)
    elif recorded is not None:
        files += _write_recorded_config(recorded, state, folder)
    return files


def _write_recorded_config(recorded: dict, state: dict[str, torch.Tensor], folder: str) -> list[str]:
    """config.json with the dtype most bytes are in (what ``from_pretrained(dtype="auto")`` picks)."""
    config = dict(recorded["config"])
    by_dtype: dict[torch.dtype, int] = {}
    for tensor in {id(t): t for t in state.values() if t.is_floating_point()}.values():
        by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
    if by_dtype:
        dtype = str(max(by_dtype, key=by_dtype.get)).removeprefix("torch.")
        config["dtype"] = dtype
        if "torch_dtype" in config:  # transformers < 5 names it so
            config["torch_dtype"] = dtype
    written = []
    for name, data in (("config.json", config), ("generation_config.json", recorded.get("generation_config"))):
        if data is not None:
            path = os.path.join(folder, name)
            with open(path, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.write("\n")
            written.append(path)
    return written


def _copy_config(config: str, folder: str) -> list[str]:
    source = config if os.path.isdir(config) else os.path.dirname(os.path.abspath(config))
    names = ["config.json", "generation_config.json"] if os.path.isdir(config) else [os.path.basename(config)]
    if not os.path.isfile(os.path.join(source, names[0])):
        raise CheckpointError(f"--config {config}: no {names[0]} there")
    copied = []
    for name in names:
        if os.path.isfile(os.path.join(source, name)):
            target = os.path.join(folder, "config.json" if name == names[0] else name)
            shutil.copyfile(os.path.join(source, name), target)
            copied.append(target)
    return copied


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardengine.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="checkpoint directory (with 'latest') or a step_<k> directory")
    parser.add_argument("out", help="output: a file (*.safetensors, or anything else for torch.save), "
                                    "or a folder with --format hf")
    parser.add_argument("--format", choices=["auto", "hf"], default="auto",
                        help="hf: a Hugging Face folder; auto: by OUT's suffix (default)")
    parser.add_argument("--config", help="with --format hf: config.json to copy in (or a folder holding it); "
                                         "default: the config the checkpoint recorded")
    parser.add_argument("--max-shard-size", default="5GB", help="with --format hf: largest file (default 5GB)")
    parser.add_argument("--optimizer", metavar="FILE",
                        help="also write the optimizer state in torch's format (torch.save) to FILE")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.format == "hf":
            recorded = None if args.config else recorded_model_config(args.checkpoint)
            if args.config is None and recorded is None:
                print(f"error: {args.checkpoint} records no model config (its model has no Hugging Face "
                      "config, or an older shardengine saved it), and a folder of weights alone does not "
                      "load with from_pretrained: give --config CONFIG (the model's config.json, or a "
                      "folder holding it)", file=sys.stderr)
                return 2
            state = consolidated_state_dict(args.checkpoint)
            files = write_hf_folder(state, args.out, args.config, args.max_shard_size, recorded)
            print(f"config.json: {'from ' + args.config if args.config else 'recorded in the checkpoint'} "
                  f"({_architecture(os.path.join(args.out, 'config.json'))})")
        else:
            state = consolidate(args.checkpoint, args.out)
            files = [args.out]
        if args.optimizer:
            torch.save(consolidated_optimizer_state_dict(args.checkpoint), args.optimizer)
            print(f"wrote {args.optimizer}: the optimizer state in torch's format")
    except (CheckpointError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    tensors = {id(t): t for t in state.values()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    on_disk = sum(os.path.getsize(f) for f in files)
    print(f"wrote {args.out}: {len(state)} entries, {nbytes / 2**20:.2f} MiB of tensors, "
          f"{on_disk / 2**20:.2f} MiB on disk in {len(files)} file(s), {time.perf_counter() - started:.2f} s")
    return 0


def _architecture(config_path: str) -> str:
    with open(config_path) as f:
        config = json.load(f)
    return ", ".join(config.get("architectures") or [config.get("model_type", "no model_type")])


if __name__ == "__main__":
    sys.exit(main())
