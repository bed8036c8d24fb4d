"""One optimizer step across ranks: what they agree on, how gradients are weighted and reduced.

``agreement`` is the step's one small all-reduce; ``batch_weights`` weights
each micro-step by its data; ``mixed_precision`` casts and scales the loss for
fp16; ``reducer`` launches gradient reductions in a fixed order; ``join``
serves the collectives of ranks that ran out of data.
"""
