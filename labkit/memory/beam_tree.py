"""Beam search's memory side, one decoding step at a time, on the real memory layer.

``BeamTree`` keeps the beams of one beam search on a device pool and a host pool (two real
``BlockAllocator``s): ``step(parents)`` names, for each beam that survives the step, the beam
it extends. A beam named k times forks into k children (the first continues in place, the
others are ``BlockTable.fork()``s sharing every block); a beam named by nobody dies and frees
its blocks at once; then every live beam appends its new token, and the first of several
beams to write into a shared, partly filled last block copies it (copy-on-write): the rule
``beam_successors`` states, which the scheduler's beam step applies too.
``swap_out()`` moves every block the beams hold to the host pool, each shared block once
(``BlockTable.copy_to``, as the scheduler's swaps do), and ``swap_in()`` brings them back.

The engine's beam search (``labkit.beam_search``, the scheduler's beam step) does the same
to its sequences' block tables; this model lets chapter 9's widget and graders replay a
chosen pattern of forks and deaths without a model. Every change leaves a snapshot (plain
data) that ``labkit.viz.beams`` draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .allocator import BlockAllocator
from .block_manager import beam_successors
from .block_table import BlockTable


@dataclass(slots=True)
class Beam:
    """One beam: its place in the tree and its block table (on the device or the host)."""

    label: str
    parent: str | None
    born: int                            # the step it was created at
    table: BlockTable | None
    num_tokens: int
    died: int | None = None              # the step it died at (None while alive)
    on_host: bool = False

    @property
    def alive(self) -> bool:
        return self.died is None


@dataclass
class BeamTree:
    """Beam search's block bookkeeping on a device pool and a host pool (both real
    ``BlockAllocator``s). Invariants: every live beam's table holds exactly its tokens;
    dead beams hold nothing; a block's reference count is the number of live beams whose
    table names it; all live beams are on the same side (device or host).
    """

    prompt_len: int
    block_size: int = 4
    num_blocks: int = 32
    num_host_blocks: int = 32
    step_index: int = 0
    num_forks: int = 0
    num_deaths: int = 0
    num_copies: int = 0
    snapshots: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_len, int) or self.prompt_len < 1:
            raise ValueError(f"prompt_len must be a positive integer, got {self.prompt_len!r}")
        self.device = BlockAllocator(self.num_blocks, self.block_size)
        self.host = BlockAllocator(self.num_host_blocks, self.block_size)
        self._next_token = 1000
        table = BlockTable(self.device)
        table.append_tokens(range(self.prompt_len))
        self.beams: dict[str, Beam] = {"b0": Beam("b0", None, 0, table, self.prompt_len)}
        self._record(f"prefill: the prompt's {self.prompt_len} tokens in one beam")

    # ---- reading ---------------------------------------------------------------------
    @property
    def live(self) -> list[Beam]:
        return [b for b in self.beams.values() if b.alive]

    @property
    def on_host(self) -> bool:
        return any(b.on_host for b in self.live)

    @property
    def num_physical_blocks(self) -> int:
        """Blocks the live beams hold, each shared block counted once (on either side)."""
        return self.device.num_used_blocks + self.host.num_used_blocks

    @property
    def num_logical_blocks(self) -> int:
        """Blocks the live beams would hold without sharing: one copy each."""
        return sum(b.table.num_blocks for b in self.live)

    # ---- beam search's steps ---------------------------------------------------------
    def step(self, parents: Sequence[str]) -> list[str]:
        """One decoding step: ``parents[i]`` is the beam the i-th surviving candidate
        extends. Returns the labels of the beams after the step, in ``parents`` order."""
        if self.on_host:
            raise ValueError("the beams are swapped out: swap_in() before stepping")
        parents = list(parents)
        unknown = [p for p in parents if p not in self.beams or not self.beams[p].alive]
        if not parents or unknown:
            raise ValueError(f"each surviving candidate must extend a live beam "
                             f"({', '.join(b.label for b in self.live)}); got {parents!r}")
        self.step_index += 1
        live = self.live
        index = {b.label: i for i, b in enumerate(live)}
        children = beam_successors(len(live), [index[p] for p in parents])
        dead = [b for b, kids in zip(live, children, strict=True) if not kids]
        for beam in dead:                                   # deaths first: their blocks are free at once
            beam.table.free()
            beam.died = self.step_index
            self.num_deaths += 1
        out = []
        for k, label in enumerate(parents):
            parent = self.beams[label]
            if children[index[label]][0] == k:              # the first child continues in place
                out.append(parent)
                continue
            child = Beam(f"b{len(self.beams)}", label, self.step_index, parent.table.fork(),
                         parent.num_tokens)
            self.beams[child.label] = child
            self.num_forks += 1
            out.append(child)
        for beam in out:                                    # each writes its new token
            self.num_copies += len(beam.table.append_tokens([self._next_token]))
            self._next_token += 1
            beam.num_tokens += 1
        forks = [f"{b.parent}→{b.label}" for b in out if b.born == self.step_index]
        what = [f"fork {', '.join(forks)}"] if forks else []
        what += [f"{', '.join(b.label for b in dead)} {'dies' if len(dead) == 1 else 'die'}"] if dead else []
        self._record(f"step {self.step_index}: " + ("; ".join(what) or "every beam extends itself"))
        return [b.label for b in out]

    def swap_out(self) -> list[tuple[int, int]]:
        """Preempt by swapping: move every block of the live beams to the host pool, each
        shared block once. Returns the (device block, host block) copies, as the scheduler's
        ``swap_out`` list. Raises ``MemoryError`` (changing nothing) when the host is short."""
        return self._move(self.device, self.host, to_host=True)

    def swap_in(self) -> list[tuple[int, int]]:
        """Bring the swapped beams back to the device: (host block, device block) copies."""
        return self._move(self.host, self.device, to_host=False)

    def _move(self, src: BlockAllocator, dst: BlockAllocator, to_host: bool) -> list[tuple[int, int]]:
        beams = [b for b in self.live if b.on_host != to_host]
        if not beams:
            raise ValueError("nothing to swap " + ("out: the beams are on the host" if to_host
                                                   else "in: the beams are on the device"))
        blocks = set(x for b in beams for x in b.table.block_ids)
        if len(blocks) > dst.num_free_blocks:
            raise MemoryError(f"swapping needs {len(blocks)} free blocks, the "
                              f"{'host' if to_host else 'device'} pool has {dst.num_free_blocks}")
        moved: dict[int, int] = {}                          # one copy per physical block,
        pairs: list[tuple[int, int]] = []                   # as the scheduler's swaps do
        for beam in beams:
            table, copies = beam.table.copy_to(dst, moved)
            beam.table.free()
            beam.table, beam.on_host = table, to_host
            pairs += copies
        self._record(f"swap {'out' if to_host else 'in'}: {len(pairs)} blocks copied "
                     f"{'device → host' if to_host else 'host → device'}")
        return pairs

    # ---- snapshots -------------------------------------------------------------------
    def _record(self, event: str) -> None:
        self.snapshots.append(self.snapshot(event))

    def snapshot(self, event: str = "") -> dict:
        """This moment as plain data: the tree, each live beam's table, both pools."""
        def pool(alloc: BlockAllocator) -> list[int]:
            return [alloc.ref_count(x) for x in range(alloc.num_blocks)]
        return {
            "step": self.step_index, "event": event,
            "tree": [(b.label, b.parent, b.born, b.died) for b in self.beams.values()],
            "tables": {b.label: {"blocks": list(b.table.block_ids), "tokens": b.num_tokens,
                                 "on_host": b.on_host} for b in self.live},
            "device": pool(self.device), "host": pool(self.host),
            "physical": self.num_physical_blocks, "logical": self.num_logical_blocks,
            "copies": self.num_copies, "forks": self.num_forks, "deaths": self.num_deaths,
        }
