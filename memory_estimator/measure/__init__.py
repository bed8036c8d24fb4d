"""The estimator held against measurements: the only part that runs shardengine (validate,
calibrate) or reads published runs (field)."""
