"""A replay of PyTorch's CUDA caching allocator, for the segments a known sequence of allocations leaves.

`torch.cuda.max_memory_reserved` counts segments, and a segment is never returned to the driver
during training (only `empty_cache()` or an out-of-memory retry releases it), so what a job reserves
depends on the order and sizes of its allocations, not only on their sum. Where podkit knows that
order from a library's source (FSDP1's initialisation), it replays it here. Written rather than
imported because checks/ never imports torch, and the rules are few. The rules, from
c10/cuda/CUDACachingAllocator.cpp (torch 2.2, unchanged in 2.13):

- a request is rounded up to 512 B (kMinBlockSize, round_size);
- requests <= 1 MiB (kSmallSize) use the small pool, larger ones the large pool; pools are per stream;
- a cached free block of the same pool and stream serves the request if it is big enough: the
  smallest such (get_free_block: `pool.blocks.lower_bound(&p.search_key)`, ordered by stream, size,
  address); otherwise a new segment of 2 MiB (kSmallBuffer) for small requests, 20 MiB (kLargeBuffer)
  for requests under 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- the block is split when the rest is >= 512 B (small pool) or > 1 MiB (large pool) (should_split);
- a freed block merges with free neighbours of its own segment (free_block, try_merge_blocks);
  blocks of different segments never merge.
max_split_size_mb and expandable segments are not modelled (both off by default).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

MIB = 1 << 20
K_MIN_BLOCK = 512
K_SMALL_SIZE = MIB
K_SMALL_BUFFER = 2 * MIB
K_LARGE_BUFFER = 20 * MIB
K_MIN_LARGE_ALLOC = 10 * MIB
K_ROUND_LARGE = 2 * MIB


def round_size(size: int) -> int:
    return max(K_MIN_BLOCK, -(-size // K_MIN_BLOCK) * K_MIN_BLOCK)


def segment_size(size: int) -> int:
    """cudaMalloc size for a request that no cached block serves (get_allocation_size)."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    stream: int
    free: bool = True


@dataclass(slots=True)
class _Pool:
    """One pool's cached free blocks: sorted by (size, segment, offset) for best fit (the order of
    the allocator's BlockComparatorSize), and indexed by where each starts and ends for merging."""

    order: list = field(default_factory=list)
    starts: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)

    def add(self, b: _Block) -> None:
        insort(self.order, (b.size, b.segment, b.offset))
        self.starts[(b.segment, b.offset)] = b
        self.ends[(b.segment, b.offset + b.size)] = b


@dataclass
class CachingAllocator:
    """Replays malloc/free; `reserved` only grows (nothing calls empty_cache)."""

    free_blocks: dict = field(default_factory=dict)  # (small, stream) -> _Pool of cached free blocks
    reserved: int = 0
    reserved_large: int = 0
    """Of `reserved`, the large pool's segments (what requests over 1 MiB can use)."""
    allocated: int = 0
    peak_allocated: int = 0
    _segments: int = 0

    def _pool(self, small: bool, stream: int) -> _Pool:
        pool = self.free_blocks.get((small, stream))
        if pool is None:
            pool = self.free_blocks[(small, stream)] = _Pool()
        return pool

    def malloc(self, size: int, stream: int = 0) -> _Block:
        # Best fit and the pool's bookkeeping written out here and in free: the FSDP1 step replay makes tens
        # of thousands of requests within preflight's half second.
        size = round_size(size)
        small = size <= K_SMALL_SIZE
        pool = self.free_blocks.get((small, stream)) or self._pool(small, stream)
        order = pool.order
        i = bisect_left(order, (size,))
        if i < len(order):
            _, segment, offset = order.pop(i)
            block = pool.starts.pop((segment, offset))
            del pool.ends[(segment, offset + block.size)]
        else:
            seg = segment_size(size)
            block = _Block(self._segments, 0, seg, small, stream)
            self._segments += 1
            self.reserved += seg
            if not small:
                self.reserved_large += seg
        rest = block.size - size
        if rest >= K_MIN_BLOCK if small else rest > K_SMALL_SIZE:
            pool.add(_Block(block.segment, block.offset + size, rest, small, stream))
            block.size = size
        block.free = False
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated -= block.size
        pool = self.free_blocks[(block.small, block.stream)]
        order, starts, ends = pool.order, pool.starts, pool.ends
        seg, offset, size = block.segment, block.offset, block.size
        before = ends.pop((seg, offset), None)
        after = starts.pop((seg, offset + size), None)
        if before is not None:
            del order[bisect_left(order, (before.size, seg, before.offset))]
            del starts[(seg, before.offset)]
            offset = before.offset
            size += before.size
        if after is not None:
            del order[bisect_left(order, (after.size, seg, after.offset))]
            del ends[(seg, after.offset + after.size)]
            size += after.size
        block.offset, block.size = offset, size
        insort(order, (size, seg, offset))
        starts[(seg, offset)] = block
        ends[(seg, offset + size)] = block


def replay(events: list[tuple], alloc: CachingAllocator | None = None, live: dict | None = None) -> CachingAllocator:
    """Run allocation events through `alloc`: ("a", key, bytes) allocates, ("f", key) frees, ("r", key, new
    key) renames (a gradient written into a tensor's storage, handed on); `live` receives the blocks still
    allocated at the end, by key."""
    alloc = alloc or CachingAllocator()
    live = {} if live is None else live
    for ev in events:
        if ev[0] == "a":
            live[ev[1]] = alloc.malloc(ev[2])
        elif ev[0] == "r":
            live[ev[2]] = live.pop(ev[1])
        else:
            alloc.free(live.pop(ev[1]))
    return alloc
