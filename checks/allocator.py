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


# A block is a list [key, size, pool]: pool = stream << 1 | small, key = segment << OFFSET_BITS | offset, which
# orders like (segment, offset) and hashes as one int. A free block's place in its pool's best-fit order is one
# int, size << ORDER_BITS | key, so that order is a sorted list of ints (the allocator's BlockComparatorSize:
# size, then address) and bisect compares ints, not tuples: the FSDP1 step replay makes tens of thousands of
# requests within preflight's half second.
OFFSET_BITS = 48  # offsets within a segment stay below 256 TiB
ORDER_BITS = 96  # keys stay below 2**96: up to 2**48 segments
ORDER_MASK = (1 << ORDER_BITS) - 1


@dataclass(slots=True)
class _Pool:
    """One pool's cached free blocks: sorted by size << ORDER_BITS | key for best fit, and indexed by where
    each starts (key -> block) and ends (key + size -> block) for merging."""

    order: list = field(default_factory=list)
    starts: dict = field(default_factory=dict)
    ends: dict = field(default_factory=dict)


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

    def malloc(self, size: int, stream: int = 0) -> list:
        # round_size and the pool's bookkeeping written out here and in free: this is the replay's hot path.
        size = -(-size // K_MIN_BLOCK) * K_MIN_BLOCK or K_MIN_BLOCK
        small = size <= K_SMALL_SIZE
        pid = stream << 1 | small
        pool = self.pools.get(pid)
        if pool is None:
            pool = self.pools[pid] = _Pool()
        order = pool.order
        i = bisect_left(order, size << ORDER_BITS)
        if i < len(order):
            key = order.pop(i) & ORDER_MASK
            block = pool.starts.pop(key)
            have = block[1]
            del pool.ends[key + have]
        else:
            have = segment_size(size)
            block = [self._segments << OFFSET_BITS, have, pid]
            self._segments += 1
            self.reserved += have
            if not small:
                self.reserved_large += have
        rest = have - size
        if rest >= K_MIN_BLOCK if small else rest > K_SMALL_SIZE:
            key = block[0] + size
            insort(order, rest << ORDER_BITS | key)
            pool.starts[key] = pool.ends[key + rest] = [key, rest, pid]
            block[1] = have = size
        self.allocated += have
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: list) -> None:
        key, size, pid = block
        self.allocated -= size
        pool = self.pools[pid]
        order, starts, ends = pool.order, pool.starts, pool.ends
        before = ends.pop(key, None)  # blocks of different segments never meet: keys differ in the high bits
        after = starts.pop(key + size, None)
        if before is not None:
            bkey, bsize = before[0], before[1]
            del order[bisect_left(order, bsize << ORDER_BITS | bkey)]
            del starts[bkey]
            key = bkey
            size += bsize
        if after is not None:
            akey, asize = after[0], after[1]
            del order[bisect_left(order, asize << ORDER_BITS | akey)]
            del ends[akey + asize]
            size += asize
        block[0] = key
        block[1] = size
        insort(order, size << ORDER_BITS | key)
        starts[key] = ends[key + size] = block


def block_bytes(block: list) -> int:
    """The bytes a block returned by malloc holds (its request rounded, or the whole block when the rest was
    too small to split off)."""
    return block[1]


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
