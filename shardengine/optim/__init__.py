"""The optimizer over shards.

``rebuild`` (the user's optimizer rebuilt over owned slices),
``sharded_optimizer`` (what ``shard()`` returns, tied to the engine),
``state_dict`` (its state in torch's format, sharded and full),
``whole_tensor`` (Muon, Adafactor: each parameter stepped whole by one owner),
``optimizer_list`` (several optimizers stepped as one) and ``muon_recipe``
(Muon on hidden matrices, AdamW on the rest).
"""
