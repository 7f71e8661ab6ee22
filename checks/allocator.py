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
    key: int  # segment << OFFSET_BITS | offset: orders like (segment, offset) and hashes as one int
    size: int
    pool: int  # stream << 1 | small: the pool it belongs to


OFFSET_BITS = 48  # offsets within a segment stay below 256 TiB


@dataclass(slots=True)
class _Pool:
    """One pool's cached free blocks: sorted by (size, segment, offset) for best fit (the order of
    the allocator's BlockComparatorSize), and indexed by where each starts and ends for merging."""

    order: list = field(default_factory=list)  # (size, key)
    starts: dict = field(default_factory=dict)  # key -> block
    ends: dict = field(default_factory=dict)  # key + size -> block


@dataclass
class CachingAllocator:
    """Replays malloc/free; `reserved` only grows (nothing calls empty_cache)."""

    pools: dict = field(default_factory=dict)  # stream << 1 | small -> _Pool of cached free blocks
    reserved: int = 0
    reserved_large: int = 0
    """Of `reserved`, the large pool's segments (what requests over 1 MiB can use)."""
    allocated: int = 0
    peak_allocated: int = 0
    _segments: int = 0

    def malloc(self, size: int, stream: int = 0) -> _Block:
        # Best fit and the pool's bookkeeping written out here and in free, keys as single ints: the FSDP1
        # step replay makes tens of thousands of requests within preflight's half second.
        size = round_size(size)
        small = size <= K_SMALL_SIZE
        pid = stream << 1 | small
        pool = self.pools.get(pid)
        if pool is None:
            pool = self.pools[pid] = _Pool()
        order = pool.order
        i = bisect_left(order, (size,))
        if i < len(order):
            have, key = order.pop(i)
            block = pool.starts.pop(key)
            del pool.ends[key + have]
        else:
            have = segment_size(size)
            block = _Block(self._segments << OFFSET_BITS, have, pid)
            self._segments += 1
            self.reserved += have
            if not small:
                self.reserved_large += have
        rest = have - size
        if rest >= K_MIN_BLOCK if small else rest > K_SMALL_SIZE:
            key = block.key + size
            insort(order, (rest, key))
            pool.starts[key] = pool.ends[key + rest] = _Block(key, rest, pid)
            block.size = have = size
        self.allocated += have
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: _Block) -> None:
        size = block.size
        self.allocated -= size
        pool = self.pools[block.pool]
        order, starts, ends = pool.order, pool.starts, pool.ends
        key = block.key
        before = ends.pop(key, None)  # blocks of different segments never meet: keys differ in the high bits
        after = starts.pop(key + size, None)
        if before is not None:
            del order[bisect_left(order, (before.size, before.key))]
            del starts[before.key]
            key = before.key
            size += before.size
        if after is not None:
            del order[bisect_left(order, (after.size, after.key))]
            del ends[after.key + after.size]
            size += after.size
        block.key, block.size = key, size
        insort(order, (size, key))
        starts[key] = ends[key + size] = block


def replay(events: list[tuple], alloc: CachingAllocator | None = None, live: dict | None = None) -> CachingAllocator:
    """Run allocation events through `alloc`: ("a", key, bytes) allocates, ("f", key) frees, ("r", key, new
    key) renames (a gradient written into a tensor's storage, handed on); `live` receives the blocks still
    allocated at the end, by key."""
    alloc = alloc or CachingAllocator()
    live = {} if live is None else live
    malloc, free, pop = alloc.malloc, alloc.free, live.pop
    for ev in events:
        kind = ev[0]
        if kind == "a":
            live[ev[1]] = malloc(ev[2])
        elif kind == "r":
            live[ev[2]] = pop(ev[1])
        else:
            free(pop(ev[1]))
    return alloc
