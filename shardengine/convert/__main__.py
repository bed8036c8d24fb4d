"""``python -m shardengine.convert DS_CHECKPOINT OUT``: see state/interop/convert.py for the options."""

import sys

from shardengine.state.interop.convert import main

sys.exit(main())
