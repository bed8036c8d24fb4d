"""Activations: what forward keeps for backward, where it lives, and how much of it there is.

The policy's vocabulary is parsed in ``shardengine/activation_rules.py`` (pure, shared
with the memory estimator). Here: ``ledger`` counts the bytes kept on the device and on
the host; ``saved`` holds the saved-tensor hooks that count them; ``offload`` moves them
to host memory and back; ``checkpointing`` recomputes them; ``blocks`` applies a policy
to a model's blocks (the engine builds one per sharded model, the estimator's traced
path one per trace). See docs/activations.md.
"""
