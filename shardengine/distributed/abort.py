"""Where a rank that stops on purpose leaves its reason, for its peers' error messages.

:meth:`Communicator.abort` writes the reason under one key per group in the
default group's store; a peer whose collective then fails reads it
(:func:`peer_abort_reason`) and says why, instead of guessing.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

ABORT_KEY = "shardengine/abort_reason"


def default_store():
    return dist.distributed_c10d._get_default_store()


def peer_abort_reason(key: str) -> Optional[str]:
    """What a peer that stopped on purpose left in the store (see :meth:`Communicator.abort`)."""
    try:
        store = default_store()
        if store.check([key]):
            return store.get(key).decode(errors="replace")
    except Exception:  # noqa: BLE001 - no store, or it is gone with the peer
        return None
    return None

