"""The ``memory-estimator`` command: flags, the tables it prints and the configurations it emits."""
from .command import main

__all__ = ["main"]
