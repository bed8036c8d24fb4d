"""Pretrained weights: weight files (``weight_files``: safetensors and torch), matching their
keys to a model's (``state_keys``), and ``load_pretrained`` / ``save_pretrained`` (``pretrained``).
"""
