"""Reinforcement-learning post-training: the trained weights streamed to a rollout model (docs/rl.md)."""
