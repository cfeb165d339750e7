"""The pool of fixed-size KV-cache blocks of the dynamic engine, with prefix caching.

Every block holds ``block_size_tokens`` consecutive positions of one request (of every layer). A
request takes the blocks it needs when it is admitted and gives them back when it finishes. A block
filled with prompt tokens only is registered under a hash of those tokens and of every token before
them (the hash of the previous block chains in), so a later prompt that starts with the same tokens
takes the same block instead of computing it again (prefix caching). A registered block whose last
user finished stays cached until its space is needed: free blocks are handed out first, then cached
ones, least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple


def block_hashes(tokens: Sequence[int], block_size: int, count: int) -> List[str]:
    """Chained hashes of the first ``count`` full blocks of ``tokens``: block i's covers tokens[: (i+1)*block_size]."""
    hashes, parent = [], ""
    for i in range(count):
        chunk = ",".join(str(int(t)) for t in tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(f"{parent}|{chunk}".encode()).hexdigest()
        hashes.append(parent)
    return hashes


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1``; counts references to shared (prefix-cached) blocks.

    Attributes:
        reused_blocks: how many blocks requests took from the prefix cache instead of computing them.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockAllocator(num_blocks={num_blocks}, block_size={block_size}): both must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free: List[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first
        self.refs: Dict[int, int] = {}  # block -> requests holding it
        self.cached: Dict[str, int] = {}  # prefix hash -> block holding those positions
        self.hash_of: Dict[int, str] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, least recent first
        self.reused_blocks = 0

    @property
    def available(self) -> int:
        """Blocks a new request can take (free ones and cached ones nobody holds)."""
        return len(self.free) + len(self.idle)

    def match_prefix(self, tokens: Sequence[int]) -> List[int]:
        """Cached blocks holding the longest run of ``tokens``' leading full blocks (at least one token is left
        to compute: its logits choose the first new token)."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for digest in block_hashes(tokens, self.block_size, (len(tokens) - 1) // self.block_size):
            block = self.cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, count: int, shared: Sequence[int] = ()) -> Optional[List[int]]:
        """``shared`` (from ``match_prefix``) followed by ``count`` new blocks, or None (nothing taken) when the
        pool cannot hold them."""
        idle_shared = sum(1 for b in shared if b in self.idle)
        if count > self.available - idle_shared:
            return None
        for block in shared:
            self.idle.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
        self.reused_blocks += len(shared)
        new = [self._take() for _ in range(count)]
        for block in new:
            self.refs[block] = 1
        return list(shared) + new

    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        block, _ = self.idle.popitem(last=False)  # evict the least recently used cached block
        del self.cached[self.hash_of.pop(block)]
        return block

    def register(self, block: int, digest: str) -> None:
        """``block`` now holds the positions ``digest`` names: later prompts with that prefix may share it."""
        if self.enable_prefix_caching and digest not in self.cached and block not in self.hash_of:
            self.cached[digest] = block
            self.hash_of[block] = digest

    def release(self, blocks: Sequence[int]) -> None:
        """A finished request's blocks: registered ones stay cached (idle), the others become free."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            del self.refs[block]
            if block in self.hash_of:
                self.idle[block] = None
            else:
                self.free.append(block)

    def usage(self) -> Tuple[int, int]:
        """(blocks held by requests, blocks in the pool)."""
        return len(self.refs), self.num_blocks
