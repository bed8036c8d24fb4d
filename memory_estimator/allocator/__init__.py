"""What PyTorch's CUDA caching allocator holds: its rules on sizes (``caching.py``), a training
step's shape-dependent tensors (``trace.py``), the run's batch lengths (``lengths.py``) and the
reserved peak they leave, replayed (``reserved.py``)."""
