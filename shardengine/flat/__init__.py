"""Parameters flattened into buckets: layout, bucket plan, buffers, stage-3 units.

``layout``, ``owner_layout`` (whole parameters per rank) and ``plan`` decide where every element goes (arithmetic on shapes,
shared with the memory estimator); ``bucket`` holds the flat buffers;
``units`` finds the submodules gathered together at stage 3; ``meta_init``
materializes meta-device models unit by unit; ``guard`` makes a read of a
parameter this rank holds only a slice of raise.
"""
