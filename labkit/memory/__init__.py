"""The paged KV memory layer: physical blocks, block tables, copy-on-write, prefix caching.

Layer 1 of labkit: it knows block ids and token ids, never tensors.
"""

from .allocator import BlockAllocator, CacheEntry, NoFreeBlocksError
from .beam_tree import Beam, BeamTree
from .block_manager import Allocation, BlockManager, CachedPrefix, Growth, beam_successors
from .block_table import BlockTable, CopyOnWrite, copies_on_write
from .host_tier import HostTier
from .policy import PrefixCachePolicy, match_limit, prefix_cache_policy
from .prefix_cache import ROOT_HASH, HashPrefixCache, hash_block, hash_full_blocks, hash_prefix, root_hash
from .radix_cache import RadixNode, RadixTree
from .waste import (ContiguousAllocator, Hole, SeqUsage, Waste, contiguous_waste,
                    live_paged_waste, paged_waste, reservation)

__all__ = [
    "Allocation", "BlockManager", "CachedPrefix", "Growth", "beam_successors", "copies_on_write",
    "PrefixCachePolicy", "match_limit",
    "Beam", "BeamTree", "BlockAllocator", "HostTier", "BlockTable", "CacheEntry", "CopyOnWrite", "NoFreeBlocksError",
    "ROOT_HASH", "HashPrefixCache", "hash_block", "hash_full_blocks", "hash_prefix", "prefix_cache_policy",
    "root_hash", "RadixNode", "RadixTree",
    "ContiguousAllocator", "Hole", "SeqUsage", "Waste", "contiguous_waste", "live_paged_waste",
    "paged_waste", "reservation",
]
