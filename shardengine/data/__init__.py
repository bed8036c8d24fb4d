"""Data for uneven ranks: ``proportions`` (shares: check, split, rebalance by speed; pure) and
``sampler`` (``ProportionalSampler``)."""
