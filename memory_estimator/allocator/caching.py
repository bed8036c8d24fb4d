"""PyTorch's CUDA caching allocator, replayed on sizes: what ``max_memory_reserved`` reads.

[Note: the caching allocator, as its source has it]
``c10/cuda/CUDACachingAllocator.cpp`` (the rules this class follows; nothing here is fitted):

- every request is rounded up to 512 bytes (``kMinBlockSize``); requests of at most 1 MiB
  (``kSmallSize``) are served from the small pool, larger ones from the large pool;
- a request is served by the smallest cached free block of its pool and stream that is large
  enough (best fit, ties by address); a block larger than the request is split when the rest
  is at least 512 bytes (small pool) or more than 1 MiB (large pool);
- when no cached block fits, a new segment is taken from the driver: 2 MiB for a small request
  (``kSmallBuffer``), 20 MiB for a request under 10 MiB (``kLargeBuffer``,
  ``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``);
- a freed block merges with free neighbours of the same segment only; segments are given
  back to the driver only by ``empty_cache()`` or when a ``cudaMalloc`` fails, and then only
  those with nothing allocated in them, after which the request is retried
  (``num_alloc_retries``); a request that still does not fit is an out-of-memory error;
- blocks are cached per stream: a block freed on one stream serves requests on that stream only;
- ``expandable_segments:True`` keeps one segment per pool and stream and maps 2 MiB pages
  (20 MiB for the large pool) onto its end instead of opening a new segment, so a request that
  fits nowhere grows the last block when it is free.

``reserved`` is the bytes of all segments (what ``torch.cuda.memory_reserved()`` reads);
``allocated`` the bytes of allocated blocks, rounded (``memory_allocated()``).

>>> allocator = CachingAllocator()
>>> first = allocator.malloc(100 * 2**20)
>>> allocator.free(first); second = allocator.malloc(120 * 2**20)   # does not fit the cached 100 MiB
>>> allocator.reserved // 2**20, allocator.allocated // 2**20
(220, 120)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: largest "small" request
SMALL_BUFFER = 2 << 20          # kSmallBuffer: segment of the small pool
LARGE_BUFFER = 20 << 20         # kLargeBuffer: segment for requests under kMinLargeAlloc
MIN_LARGE_ALLOC = 10 << 20      # kMinLargeAlloc
ROUND_LARGE = 2 << 20           # kRoundLarge: large segments rounded up to 2 MiB


class AllocatorOutOfMemory(RuntimeError):
    """A request that no cached block, new segment or released cache could hold."""


def round_size(nbytes: int) -> int:
    """``round_size``: at least 512 bytes, a multiple of 512.

    >>> round_size(1), round_size(513)
    (512, 1024)
    """
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * -(-nbytes // MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """``get_allocation_size``: the segment a request that fits no cached block opens.

    >>> [segment_size(n) // 2**20 for n in (4096, 3 * 2**20, 33 * 2**20)]
    [2, 20, 34]
    """
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-nbytes // ROUND_LARGE)


@dataclass(slots=True)   # the replay's hot loop reads these fields millions of times
class _Block:
    address: int
    size: int
    segment: int
    pool: tuple[int, bool]               # (stream, small)
    allocated: bool = False
    prev: Optional["_Block"] = field(default=None, repr=False)
    next: Optional["_Block"] = field(default=None, repr=False)


class CachingAllocator:
    """The allocator's bookkeeping on sizes alone (no memory is touched).

    ``capacity``: bytes the driver can hand out (None: unlimited); ``expandable``:
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
    """

    def __init__(self, capacity: Optional[int] = None, expandable: bool = False) -> None:
        self.capacity, self.expandable = capacity, expandable
        self._free: dict[tuple[int, bool], list[tuple[int, int]]] = {}   # pool -> sorted (size, address)
        self._blocks: dict[int, _Block] = {}                             # address -> block
        self._segments: dict[int, int] = {}                              # segment id -> bytes
        self._tails: dict[tuple[int, bool], _Block] = {}                 # expandable: the last block per pool
        self._next_address = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = 0

    # ---------------------------------------------------------------- requests

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Serve a request; returns its handle (the block's address)."""
        size = round_size(int(nbytes))
        pool = (stream, size <= SMALL_SIZE)
        block = self._take_cached(pool, size) or self._grow(pool, size)
        self._split(block, size)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block.address

    def free(self, handle: int) -> None:
        block = self._blocks[handle]
        if not block.allocated:
            raise ValueError(f"block {handle} is not allocated")
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._unlist(neighbour)
                block = self._merge(block, neighbour)
        self._list(block)

    def empty_cache(self) -> None:
        """Return every segment with nothing allocated in it to the driver (expandable segments:
        unmap their free tails too)."""
        if self.expandable:
            for pool, tail in list(self._tails.items()):
                if not tail.allocated and tail.prev is not None:
                    self._unlist(tail)
                    tail.prev.next = None
                    self._tails[pool] = tail.prev
                    del self._blocks[tail.address]
                    self._segments[tail.segment] -= tail.size
                    self.reserved -= tail.size
        for block in [b for b in self._blocks.values() if not b.allocated and b.prev is None and b.next is None]:
            self._unlist(block)
            del self._blocks[block.address]
            self.reserved -= self._segments.pop(block.segment)
            if self._tails.get(block.pool) is block:
                del self._tails[block.pool]

    # ---------------------------------------------------------------- internals

    def _take_cached(self, pool: tuple[int, bool], size: int) -> Optional[_Block]:
        free = self._free.get(pool, [])
        index = bisect.bisect_left(free, (size, -1))
        if index == len(free):
            return None
        _, address = free.pop(index)
        return self._blocks[address]

    def _grow(self, pool: tuple[int, bool], size: int) -> _Block:
        if self.expandable:
            return self._extend(pool, size)
        nbytes = segment_size(size)
        self._reserve(nbytes)
        block = _Block(self._next_address, nbytes, self._next_address, pool)
        self._segments[block.segment] = nbytes
        self._next_address += nbytes
        self._blocks[block.address] = block
        return block

    def _extend(self, pool: tuple[int, bool], size: int) -> _Block:
        """Expandable segments: map pages onto the pool's one segment, growing its free tail."""
        page = SMALL_BUFFER if pool[1] else LARGE_BUFFER
        tail = self._tails.get(pool)
        if tail is not None and not tail.allocated:
            self._unlist(tail)
            missing = size - tail.size
        else:
            missing = size
        mapped = page * -(-missing // page)
        self._reserve(mapped)
        if tail is not None and not tail.allocated:
            tail.size += mapped
            self._segments[tail.segment] += mapped
            return tail
        segment = tail.segment if tail is not None else self._next_address
        address = tail.address + tail.size if tail is not None else self._next_address
        block = _Block(address, mapped, segment, pool, prev=tail)
        if tail is not None:
            tail.next = block
        self._segments[segment] = self._segments.get(segment, 0) + mapped
        self._next_address = max(self._next_address, address + mapped) + (1 << 50 if tail is None else 0)
        self._blocks[address] = self._tails[pool] = block
        return block

    def _reserve(self, nbytes: int) -> None:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self.retries += 1            # cudaMalloc failed: release the cache and retry
            self.empty_cache()
            if self.reserved + nbytes > self.capacity:
                raise AllocatorOutOfMemory(f"{nbytes} bytes requested with {self.reserved} reserved "
                                           f"of {self.capacity}")
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _split(self, block: _Block, size: int) -> None:
        remaining = block.size - size
        if remaining < MIN_BLOCK if block.pool[1] else remaining <= SMALL_SIZE:
            return
        rest = _Block(block.address + size, remaining, block.segment, block.pool, prev=block, next=block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self._blocks[rest.address] = rest
        if self._tails.get(block.pool) is block:
            self._tails[block.pool] = rest
        self._list(rest)

    def _merge(self, block: _Block, other: _Block) -> _Block:
        first, second = (block, other) if block.address < other.address else (other, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        del self._blocks[second.address]
        if self._tails.get(first.pool) is second:
            self._tails[first.pool] = first
        return first

    def _list(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault(block.pool, []), (block.size, block.address))

    def _unlist(self, block: _Block) -> None:
        free = self._free[block.pool]
        del free[bisect.bisect_left(free, (block.size, block.address))]
