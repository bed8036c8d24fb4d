"""The ``python -m shardengine.consolidate`` command (see ``__main__``); the code is in ``state/consolidate.py``.

A package rather than a module so that ``shardengine/consolidate.py`` reads as
moved to ``state/consolidate.py`` in git, and merges follow it there.
"""

from ..state.consolidate import (consolidate, consolidated_optimizer_state, consolidated_optimizer_state_dict,
                                 consolidated_state_dict, main)

__all__ = ["consolidate", "consolidated_optimizer_state", "consolidated_optimizer_state_dict",
           "consolidated_state_dict", "main"]
