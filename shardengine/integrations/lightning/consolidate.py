"""``python -m shardengine.integrations.lightning.consolidate CKPT_DIR OUT.ckpt``: one-file export."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from .checkpoint import consolidate_checkpoint


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory written by ShardStrategy")
    parser.add_argument("out", help="the Lightning .ckpt file to write")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.checkpoint, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
