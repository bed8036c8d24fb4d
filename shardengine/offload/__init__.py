"""Training state kept off the device beyond host memory: the disk tier (see disk_tier.py)."""
