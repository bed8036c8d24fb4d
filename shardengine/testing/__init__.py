"""Small reference models for the tests, benchmarks, examples and the estimator's validation."""
