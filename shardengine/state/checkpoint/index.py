"""Which file of a checkpoint holds which element range, and what each file must be.

[Note: nothing on rank 0 grows with the world size]
Format 1 kept, in the one manifest rank 0 writes, every rank's files (size,
sha256) and every rank's index of records: rank 0 gathered them from all ranks
(every rank received every rank's, an all-gather of objects), wrote them, and
every loading rank read and indexed all of them. At 1,024 ranks that is the
largest file of the checkpoint's metadata and the slowest part of a load.

Format 2 writes none of it centrally. Where a range lives follows from the
layout the manifest already holds (N-independent: buckets, slots, shard size):
rank r's file holds, of every bucket, the pieces of parameters inside flat
``[r * shard_numel, (r + 1) * shard_numel)`` (the shard group's ranks 0..k-1
under hybrid sharding), a record starting where the piece starts in its
parameter; parameters outside every bucket are whole in rank 0's file. Each
rank's file is described by a small sidecar it writes itself,
``rank_<r>.json`` (bytes, sha256 and its index), which a reader opens only
for the files it reads. Rank 0 writes one manifest whose size depends on the
model only (``benchmarks/bench_checkpoint_scale.py`` measures it at 1,024 ranks).

>>> where = LayoutIndex({"layout": [{"params": ["w"], "slots": [[0, 10]], "shard_numel": 4}],
...                      "params": [{"name": "w", "shape": [10]}, {"name": "loose", "shape": [3]}]})
>>> where.pieces("w")
[(0, 4, 'rank_0.pt'), (4, 8, 'rank_1.pt'), (8, 10, 'rank_2.pt')]
>>> where.pieces("loose")
[(0, 3, 'rank_0.pt')]
"""

from __future__ import annotations

import math
import os
from typing import Optional

from ...errors import CheckpointError
from .format import read_json

RANK_FILE = "rank_{}.pt"
SIDECAR = "rank_{}.json"


def rank_of_file(file: str) -> Optional[int]:
    """``rank_<r>.pt`` -> r; None for any other name."""
    number = file.removeprefix("rank_").removesuffix(".pt")
    return int(number) if file.startswith("rank_") and file.endswith(".pt") and number.isdigit() else None


class ManifestIndex:
    """Format 1: the manifest lists every file and every rank's records."""

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest
        self._where: dict[str, list[tuple[int, int, str]]] = {}
        for file, index in manifest["index"].items():
            for name, start, end in index:
                self._where.setdefault(name, []).append((start, end, file))

    def pieces(self, name: str) -> list[tuple[int, int, str]]:
        return sorted(self._where.get(name, []))

    def file_info(self, file: str, step_dir: str) -> Optional[dict]:
        return self.manifest["files"].get(file)

    def record_files(self) -> list[str]:
        return sorted(self.manifest["index"], key=lambda f: rank_of_file(f) or 0)

    def has_rank_file(self, rank: int) -> bool:
        return RANK_FILE.format(rank) in self.manifest["files"]

    def listed_files(self) -> list[str]:
        return list(self.manifest["files"]) + list(self.manifest["index"])


class LayoutIndex:
    """Format 2: ranges located from the manifest's layout, files described by their sidecars."""

    def __init__(self, manifest: dict) -> None:
        self.manifest = manifest
        self.writers = int(manifest.get("rank_files", 1))  # ranks that wrote a file (all of them)
        self._slot: dict[str, tuple[int, int, int]] = {}  # name -> (flat offset, numel, shard numel)
        for bucket in manifest["layout"]:
            for name, (offset, numel) in zip(bucket["params"], bucket["slots"]):
                self._slot[name] = (offset, numel, bucket["shard_numel"])
        self._numel = {p["name"]: math.prod(p["shape"]) for p in manifest["params"]}
        self._sidecars: dict[str, dict] = {}

    def pieces(self, name: str) -> list[tuple[int, int, str]]:
        if name not in self._slot:  # outside every bucket: whole, from rank 0
            return [(0, self._numel[name], RANK_FILE.format(0))] if self._numel.get(name) else []
        offset, numel, shard = self._slot[name]
        found = []
        for rank in range(offset // shard, -(-(offset + numel) // shard) if numel else offset // shard):
            lo, hi = max(offset, rank * shard), min(offset + numel, (rank + 1) * shard)
            if lo < hi:
                found.append((lo - offset, hi - offset, RANK_FILE.format(rank)))
        return found

    def file_info(self, file: str, step_dir: str) -> Optional[dict]:
        if file in self.manifest["files"]:
            return self.manifest["files"][file]
        rank = rank_of_file(file)
        if rank is None or rank >= self.writers:
            return None
        if file not in self._sidecars:
            self._sidecars[file] = read_sidecar(step_dir, rank)
        return self._sidecars[file]

    def record_files(self) -> list[str]:
        holders = max(int(self.manifest.get("shard_group_size", self.writers)), 1)
        return [RANK_FILE.format(rank) for rank in range(min(holders, self.writers))]

    def has_rank_file(self, rank: int) -> bool:
        return rank < self.writers

    def listed_files(self) -> list[str]:
        return list(self.manifest["files"])


def read_sidecar(step_dir: str, rank: int) -> dict:
    """What rank ``rank`` wrote about its file: ``{"bytes", "sha256", "index"}``."""
    path = os.path.join(step_dir, SIDECAR.format(rank))
    sidecar = read_json(path, f"it describes rank_{rank}.pt; was it lost?")
    if not isinstance(sidecar, dict) or not isinstance(sidecar.get("bytes"), int) \
            or not isinstance(sidecar.get("sha256"), str) or sidecar.get("rank") != rank:
        raise CheckpointError(f"{path}: not the description of rank_{rank}.pt")
    return sidecar
