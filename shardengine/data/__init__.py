"""Data for uneven ranks: ``sampler`` (``ProportionalSampler``: shares by rank speed)."""
