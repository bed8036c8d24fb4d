"""A sharded model's state in and out.

``full_state`` gathers and scatters whole tensors; ``copying`` backs
``copy.deepcopy``; ``fingerprint`` is what ranks must agree on before
sharding; ``checkpoint`` saves and loads sharded, reshardable checkpoints;
``consolidate`` turns one into a single file; ``hf`` reads and writes
Hugging Face / safetensors weights.
"""
