"""The optimizer over shards.

``rebuild`` (the user's optimizer rebuilt over owned slices),
``sharded_optimizer`` (what ``shard()`` returns, tied to the engine),
``state_dict`` (its state in torch's format, sharded and full).
"""
