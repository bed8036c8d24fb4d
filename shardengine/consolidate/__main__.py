"""``python -m shardengine.consolidate CKPT OUT``: see state/consolidate.py for the options."""

import sys

from shardengine.state.consolidate import main

sys.exit(main())
