"""DeepSpeed ZeRO-1/2/3 checkpoints resume in shardengine at any world size and stage.

A real DeepSpeed run (CPU, Gloo, N = 2, torch's AdamW, a StepLR schedule) saves a
checkpoint at step 3 and trains on to step 6 (every run of the module in the same two
processes); ``python -m shardengine.convert``'s ``main`` turns the checkpoint into a DCP
folder and a ``.pt`` file; shardengine resumes from them at
N = 1, 2, 3 and stages 0-3 and trains steps 3-5 on the same global batches. Checked:

* the converted fp32 weights equal DeepSpeed's own ``zero_to_fp32`` bit for bit;
* the resumed run ends where DeepSpeed ended, within 1e-6. Both runs compute the same
  fp32 AdamW updates from the same state; only the order in which gradients are summed
  differs (DeepSpeed's two ranks vs one to three ranks here), ~1e-7 relative. Adam's
  update lr*m/sqrt(v) is invariant to the gradients' scale, so that moves each update by
  about 1e-7 of lr (1e-2): ~1e-9 per step, and the largest difference measured is 3e-8
  (N = 3; N = 2 is bit-identical). A lost moment, step count or learning rate moves the
  weights by more than 1e-3 (checked below: a fresh optimizer fails the tolerance).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import pytest
import torch

import interop_cases as cases
from rank_pool import RankPoolRegistry

deepspeed = pytest.importorskip("deepspeed", reason="the DeepSpeed round trip needs deepspeed (the test extra)")

pytestmark = pytest.mark.prestart(1, 2, 3)
FIRST, TOTAL = 3, 6


# Every DeepSpeed run the module compares against, made together in one spawn of two processes
# ([Note: DeepSpeed runs share their processes] in interop_cases.py): (name, stage, total, options).
RUNS = [*((f"zero{stage}", stage, TOTAL, {}) for stage in (1, 2, 3)),
        *((f"bf16-zero{stage}", stage, FIRST + 1, {"bf16": True}) for stage in (1, 3)),
        *((f"frozen-zero{stage}", stage, TOTAL, {"frozen": True}) for stage in (2, 3))]


@pytest.fixture(scope="module")
def deepspeed_runs():
    """name -> (folder with DeepSpeed's checkpoint at step FIRST, final weights) for each of RUNS."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = [cases.DeepSpeedRun(stage, f"{tmp}/{name}", FIRST, total, **options)
                for name, stage, total, options in RUNS]
        finals = cases.deepspeed_references(runs)
        yield {name: (run.out, final) for (name, *_), run, final in zip(RUNS, runs, finals)}


def convert(checkpoint: str, out: str) -> str:
    """What ``python -m shardengine.convert CHECKPOINT OUT`` prints, run in this process (its
    ``__main__`` is ``sys.exit(main())``; test_interop_errors.py starts it as a command)."""
    from shardengine.state.interop.convert import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main([checkpoint, out])
    assert code == 0, printed.getvalue()
    return printed.getvalue()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda s: f"zero{s}")
def deepspeed_run(request, deepspeed_runs):
    """(ZeRO stage, folder with DeepSpeed's checkpoint at step FIRST and the converted forms, final weights)."""
    tmp, final = deepspeed_runs[f"zero{request.param}"]
    for out in (f"{tmp}/converted", f"{tmp}/converted.pt"):
        printed = convert(f"{tmp}/ds", out)
        assert f"step {FIRST}, lr_scheduler yes" in printed, printed
    return request.param, tmp, final


def test_converted_weights_equal_zero_to_fp32(deepspeed_run) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    _, tmp, _ = deepspeed_run
    import shardengine as se

    converted = se.interop.deepspeed_training_state(f"{tmp}/ds")
    reference = get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/ds")
    assert list(converted["model"]) == list(reference)
    assert all(torch.equal(converted["model"][k], reference[k]) for k in reference)
    assert converted["step"] == FIRST
    for name, state in converted["optimizer"]["state"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and float(state["step"]) == FIRST
        assert state["exp_avg"].shape == reference[name].shape


@pytest.mark.parametrize("world,stage,kind", [(1, 0, "dcp"), (2, 1, "pt"), (2, 3, "dcp"), (3, 2, "dcp"),
                                              (3, 3, "pt")])
def test_shardengine_continues_as_deepspeed(rank_pools: RankPoolRegistry, deepspeed_run, world: int, stage: int,
                                            kind: str) -> None:
    ds_stage, tmp, final = deepspeed_run
    source = f"{tmp}/converted.pt" if kind == "pt" else f"{tmp}/converted"
    results = rank_pools.get(world).run(cases.shard_resume, stage, source, kind, FIRST, TOTAL)
    assert results[0]["rest"] == ["lr_scheduler", "step"]
    assert results[0]["lr"] == pytest.approx(cases.ADAMW["lr"] * cases.GAMMA ** TOTAL)
    for key, expected in final.items():
        torch.testing.assert_close(results[0]["weights"][key], expected, rtol=0, atol=1e-6,
                                   msg=lambda m: f"ZeRO-{ds_stage} -> N={world} stage {stage} ({kind}): {key}: {m}")


def test_a_fresh_optimizer_would_fail_the_tolerance(rank_pools: RankPoolRegistry, deepspeed_run) -> None:
    """The tolerance is tight enough to see lost optimizer state: weights alone end elsewhere."""
    _, tmp, final = deepspeed_run
    state = torch.load(f"{tmp}/converted.pt", weights_only=True)
    state["optimizer"]["state"] = {}
    with tempfile.TemporaryDirectory() as other:
        torch.save(state, f"{other}/weights_only.pt")
        results = rank_pools.get(2).run(cases.shard_resume, 2, f"{other}/weights_only.pt", "pt", FIRST, TOTAL)
    worst = max((results[0]["weights"][k] - v).abs().max().item() for k, v in final.items())
    assert worst > 1e-3


def test_a_step_count_kept_in_the_param_group_moves_into_each_parameters_state(deepspeed_run) -> None:
    """DeepSpeed's FusedAdam keeps ``step`` in the param group; torch's AdamW reads it per parameter."""
    import glob
    import shutil

    import shardengine as se

    _, tmp, _ = deepspeed_run
    with tempfile.TemporaryDirectory() as other:
        shutil.copytree(f"{tmp}/ds", f"{other}/ds")
        for path in glob.glob(f"{other}/ds/global_step*/*optim_states.pt"):
            saved = torch.load(path, weights_only=False)
            inner = saved["optimizer_state_dict"]
            base = inner.get("base_optimizer_state") or inner["optimizer_state_dict"]
            for index, group_state in base["state"].items():
                base["param_groups"][index]["step"] = int(group_state.pop("step"))
            torch.save(saved, path)
        converted = se.interop.deepspeed_training_state(f"{other}/ds")
    assert all("step" not in group for group in converted["optimizer"]["param_groups"])
    assert all(float(state["step"]) == FIRST for state in converted["optimizer"]["state"].values())


@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_checkpoints_convert_to_their_fp32_masters(rank_pools: RankPoolRegistry, deepspeed_runs,
                                                       stage: int) -> None:
    """bf16 runs write bf16_zero_* optimizer files: the fp32 masters in them are what converts
    (equal to zero_to_fp32's), with the moments and step, and a sharded run loads them."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import shardengine as se

    tmp, _ = deepspeed_runs[f"bf16-zero{stage}"]
    assert any(name.startswith("bf16_zero_pp_rank_") for name in os.listdir(f"{tmp}/ds/global_step{FIRST}"))
    converted = se.interop.deepspeed_training_state(f"{tmp}/ds")
    reference = get_fp32_state_dict_from_zero_checkpoint(f"{tmp}/ds")
    assert all(converted["model"][k].dtype == torch.float32 and torch.equal(converted["model"][k], v)
               for k, v in reference.items())
    assert all(float(s["step"]) == FIRST and s["exp_avg_sq"].dtype == torch.float32
               for s in converted["optimizer"]["state"].values())
    torch.save(converted, f"{tmp}/converted.pt")
    result = rank_pools.get(3).run(cases.shard_resume, 2, f"{tmp}/converted.pt", "pt", FIRST, FIRST)[0]
    assert all(torch.equal(result["weights"][k], v) for k, v in reference.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameters_come_along(rank_pools: RankPoolRegistry, deepspeed_runs, stage: int) -> None:
    """A frozen parameter has no fp32 partition: DeepSpeed keeps it whole (ZeRO-2) or in per-rank
    fragments (ZeRO-3) beside the optimizer's groups. It converts, in the module's order, and the
    run resumed with the same parameter frozen ends where DeepSpeed ends."""
    import shardengine as se

    tmp, final = deepspeed_runs[f"frozen-zero{stage}"]
    converted = se.interop.deepspeed_training_state(f"{tmp}/ds")
    assert list(converted["model"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert "0.bias" not in converted["optimizer"]["state"]
    torch.save(converted, f"{tmp}/converted.pt")
    result = rank_pools.get(3).run(cases.shard_resume, 3, f"{tmp}/converted.pt", "pt", FIRST, TOTAL, True)[0]
    assert torch.equal(result["weights"]["0.bias"], cases.make_net()[0].bias.detach())
    for key, expected in final.items():
        torch.testing.assert_close(result["weights"][key], expected, rtol=0, atol=1e-6)
