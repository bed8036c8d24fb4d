"""shardengine: ZeRO stages 0-3 for PyTorch over torch.distributed."""
