"""``python -m labkit.bench memory``: how fast the paged KV memory layer does its bookkeeping.

The scheduler touches the allocator for every token of every sequence, every iteration,
so its operations must cost microseconds, whatever the pool's size. Measured here:

* ``alloc_free``        -- ``BlockAllocator.allocate`` + ``free`` (a stack of free ids: O(1));
* ``naive_alloc_free``  -- the same on a *naive* free list that pops from the front of a
  Python list, as the vLLM article's sketch does: O(n) per allocation. At 100k blocks
  it is orders of magnitude slower: the reason the allocator keeps a stack;
* ``append_decode``     -- ``BlockTable.append_tokens`` one token at a time (decoding),
  a block allocated on demand every ``block_size`` tokens;
* ``append_prefill``    -- a whole prompt in one call, without and with prefix caching
  (with it, each full block is hashed and published);
* ``fork_cow``          -- fork a 1000-token sequence, write one token (copy-on-write of
  the shared partial last block), free the child: parallel sampling's cycle;
* ``prefix_hit``        -- a new table finds a cached 1024-token prompt (64 blocks) and
  frees it again: admission of a request whose prompt is cached.

Examples::

    python -m labkit.bench memory
    python -m labkit.bench memory --json
    python -m labkit.bench memory --quick          # smaller counts, for CI smoke tests
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Callable

from ..memory import BlockAllocator, BlockTable
from ..utils import cdiv


# ---- the naive baseline: NOT how labkit allocates ----------------------------------------
class NaiveFreeList:
    """A deliberately naive block pool, for comparison only: the free list is a Python list
    used as a queue, ``pop(0)`` to allocate (the vLLM article's sketch). ``pop(0)`` shifts
    every remaining element, so one allocation costs O(free blocks)."""

    def __init__(self, num_blocks: int):
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self) -> int:
        block_id = self.free_blocks.pop(0)      # O(n): the whole list moves down one slot
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, block_id: int) -> None:
        self.ref_counts[block_id] = 0
        self.free_blocks.append(block_id)


# ---- timing ----------------------------------------------------------------------------
def best_time(fn: Callable[[], None], repeat: int) -> float:
    """The fastest of ``repeat`` runs, in seconds: the least disturbed by other work."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def rate(count: int, seconds: float, unit: str, **extra) -> dict:
    return {"per_s": count / seconds, "unit": unit, "count": count, "seconds": seconds,
            "us_per_op": 1e6 * seconds / count, **extra}


# ---- the measurements ----------------------------------------------------------------------
def bench_alloc_free(pool, num_ops: int, repeat: int) -> float:
    """Time ``num_ops`` allocations then as many frees on a full pool (best of ``repeat``)."""
    def run():
        ids = [pool.allocate() for _ in range(num_ops)]
        for block_id in ids:
            pool.free(block_id)
    return best_time(run, repeat)


def bench_append_decode(block_size: int, num_tokens: int, repeat: int) -> float:
    def run():
        allocator = BlockAllocator(num_blocks=cdiv(num_tokens, block_size), block_size=block_size)
        table = BlockTable(allocator)
        for token in range(num_tokens):
            table.append_tokens([token])
    return best_time(run, repeat)


def bench_append_prefill(block_size: int, prompt_len: int, num_prompts: int, caching: bool,
                         repeat: int) -> float:
    prompts = [[p] + list(range(prompt_len - 1)) for p in range(num_prompts)]   # all distinct
    def run():
        allocator = BlockAllocator(num_blocks=num_prompts * cdiv(prompt_len, block_size),
                                   block_size=block_size, enable_prefix_caching=caching)
        for prompt in prompts:
            BlockTable(allocator).append_tokens(prompt)
    return best_time(run, repeat)


def bench_fork_cow(block_size: int, prompt_len: int, num_forks: int, repeat: int) -> float:
    allocator = BlockAllocator(num_blocks=cdiv(prompt_len, block_size) + 1, block_size=block_size)
    parent = BlockTable(allocator)
    parent.append_tokens(range(prompt_len))
    assert prompt_len % block_size, "the prompt must end in a partial block to copy"
    def run():
        for i in range(num_forks):
            child = parent.fork()
            copies = child.append_tokens([i])
            child.free()
        assert copies, "no copy-on-write happened"
    return best_time(run, repeat)


def bench_prefix_hit(block_size: int, prompt_len: int, num_lookups: int, repeat: int) -> float:
    allocator = BlockAllocator(num_blocks=2 * cdiv(prompt_len, block_size), block_size=block_size,
                               enable_prefix_caching=True)
    prompt = list(range(prompt_len))
    BlockTable(allocator).append_tokens(prompt)   # published, and kept referenced
    expected = (prompt_len - 1) // block_size * block_size
    def run():
        for _ in range(num_lookups):
            table = BlockTable(allocator)
            hit = table.reuse_cached_prefix(prompt, max_tokens=prompt_len - 1)
            table.free()
        assert hit == expected, f"expected a {expected}-token hit, got {hit}"
    return best_time(run, repeat)


def run_all(num_blocks: int, block_size: int, quick: bool, repeat: int) -> dict:
    scale = 10 if quick else 1
    results: dict[str, dict] = {}
    ops = min(num_blocks, 100_000 // scale)
    t = bench_alloc_free(BlockAllocator(num_blocks, block_size), ops, repeat)
    results["alloc_free"] = rate(2 * ops, t, "ops", num_blocks=num_blocks)
    # The naive pool: allocating from the front of a long list. Few operations, because
    # each one moves the whole list; the per-operation cost is what matters.
    naive_ops = min(num_blocks, 10_000 // scale)
    for pool_size in sorted({1_000, num_blocks}):
        naive_ops_here = min(pool_size, naive_ops)
        t = bench_alloc_free(NaiveFreeList(pool_size), naive_ops_here, repeat)
        results[f"naive_alloc_free_{pool_size}"] = rate(2 * naive_ops_here, t, "ops", num_blocks=pool_size)
        t = bench_alloc_free(BlockAllocator(pool_size, block_size), naive_ops_here, repeat)
        results[f"alloc_free_{pool_size}"] = rate(2 * naive_ops_here, t, "ops", num_blocks=pool_size)
    tokens = 200_000 // scale
    results["append_decode"] = rate(tokens, bench_append_decode(block_size, tokens, repeat), "tokens")
    prompt_len, prompts = 1024, 200 // scale
    for caching in (False, True):
        t = bench_append_prefill(block_size, prompt_len, prompts, caching, repeat)
        name = "append_prefill_cached" if caching else "append_prefill"
        results[name] = rate(prompts * prompt_len, t, "tokens", prompt_len=prompt_len)
    forks = 20_000 // scale
    results["fork_cow"] = rate(forks, bench_fork_cow(block_size, 1000, forks, repeat), "forks",
                               prompt_len=1000)
    lookups = 2_000 // scale
    t = bench_prefix_hit(block_size, 1024, lookups, repeat)
    blocks_hit = (1024 - 1) // block_size
    results["prefix_hit"] = rate(lookups, t, "prompts", prompt_len=1024, blocks_hit=blocks_hit,
                                 blocks_per_s=lookups * blocks_hit / t)
    return results


# ---- output --------------------------------------------------------------------------------
LABELS = {
    "alloc_free": "BlockAllocator allocate+free",
    "append_decode": "append_tokens, 1 token/call (decode)",
    "append_prefill": "append_tokens, 1024-token prompt",
    "append_prefill_cached": "  same, prefix caching on (hash+publish)",
    "fork_cow": "fork + copy-on-write + free (1000 tok)",
    "prefix_hit": "prefix-cache hit, 1024-token prompt",
}


def format_table(result: dict) -> str:
    cfg, res = result["config"], result["results"]
    lines = [f"labkit memory benchmark: block_size={cfg['block_size']}, num_blocks={cfg['num_blocks']:,}, "
             f"best of {cfg['repeat']} (python {cfg['python']})", ""]
    lines.append(f"{'operation':<44}{'rate':>12}{'':10}{'per op':>10}")
    for key, label in LABELS.items():
        r = res[key]
        lines.append(f"{label:<44}{r['per_s']:>12,.0f} {r['unit'] + '/s':<9}{r['us_per_op']:>8.2f} us")
    r = res["prefix_hit"]
    lines.append(f"{'  = blocks found in the cache':<44}{r['blocks_per_s']:>12,.0f} blocks/s")
    lines += ["", "why the free list is a stack (allocate+free, per operation):"]
    for key in sorted(k for k in res if k.startswith("naive_alloc_free_")):
        n = int(key.rsplit("_", 1)[1])
        naive, fast = res[key], res[f"alloc_free_{n}"]
        lines.append(f"  {n:>9,} blocks: naive list.pop(0) {naive['us_per_op']:8.2f} us   "
                     f"labkit stack {fast['us_per_op']:6.2f} us   "
                     f"({naive['us_per_op'] / fast['us_per_op']:,.1f}x)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-blocks", type=int, default=100_000,
                   help="pool size for allocate/free and the naive comparison (default 100,000)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best counts")
    p.add_argument("--quick", action="store_true", help="10x fewer operations (smoke test)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_blocks < 1 or args.block_size < 1 or args.repeat < 1:
        print("--num-blocks, --block-size and --repeat must be positive", file=sys.stderr)
        return 2
    result = {
        "benchmark": "memory",
        "config": {"num_blocks": args.num_blocks, "block_size": args.block_size, "repeat": args.repeat,
                   "quick": args.quick, "python": platform.python_version()},
        "results": run_all(args.num_blocks, args.block_size, args.quick, args.repeat),
    }
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
