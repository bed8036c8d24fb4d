"""``examples/finetune_lora.py`` runs end to end on 2 ranks (a few steps): trains LoRA adapters
at stage 3 in bf16 with checkpointing, saves the adapter with peft, reloads it, generates."""
from __future__ import annotations

import json
import os
import re
import subprocess
from rank_pool import REPO_ROOT  # noqa: E402



def test_finetune_lora_example_trains_saves_reloads_and_generates(tmp_path, forked_python) -> None:
    command = [forked_python.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--monitor-interval=0.2", os.path.join(REPO_ROOT, "examples", "finetune_lora.py"),
               "--steps", "4", "--log-every", "2", "--micro-batch", "2", "--seq-len", "16", "--new-tokens", "4"]
    env = forked_python.env
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    adapter = tmp_path / "finetune_lora_run" / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter))
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    sharded = re.search(r"validation loss: before ([\d.]+), after ([\d.]+) \(bf16 compute\)", log)
    reloaded = re.search(r"reloaded the adapter from .*: validation loss \(fp32\) ([\d.]+)", log)
    assert sharded and reloaded, log[-3000:]
    # the reloaded adapter (fp32 compute) scores what the sharded model (bf16 compute) scored
    assert abs(float(reloaded[1]) - float(sharded[2])) < 0.02 * float(sharded[2]), (sharded[0], reloaded[0])
    assert float(sharded[2]) < float(sharded[1])  # training lowered the loss
    assert re.search(r"generated \(reloaded\): 'The old miller", log)
    assert re.search(r"generated \(sharded\): 'The old miller", log)
