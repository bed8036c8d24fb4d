"""``python -m memory_estimator.cli``: the ``memory-estimator`` command."""
import sys

from .command import main

sys.exit(main())
