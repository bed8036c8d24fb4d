"""Trainers on shardengine: ``integrations.lightning`` and ``integrations.transformers``.

Optional extras: nothing here is imported by ``import shardengine``, and each
subpackage imports its trainer library only when it is imported itself
(``pip install -e ".[lightning]"`` or ``".[hf]"``). See docs/integrations.md.
"""
