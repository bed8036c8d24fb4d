"""``python -m shardengine.selfcheck``: see :mod:`shardengine.selfcheck.cli`."""
import sys

from .cli import main

sys.exit(main())
