"""The engine, one stage per file.

``base`` (stage 0: replicated, and the shared step), ``stage1`` (optimizer
states sharded), ``stage2`` (+ gradients), ``stage3`` (+ parameters);
``reports`` says what each stage sends and holds.
"""
