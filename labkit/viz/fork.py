"""Fork a running sequence by hand: what parallel sampling and beam search do, on demand.

The scheduler forks an ``n > 1`` request by itself, right after its prompt's prefill. For
the live widget's "fork" button we want the same thing at any later moment, on any
running sequence, so that students watch copy-on-write happen: the child's block table is
``BlockTable.fork()`` of the parent's (every block shared, reference counts up), and the
first of the two to write into their shared last block gets a private copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .pool import seq_label

if TYPE_CHECKING:
    from ..engine import Engine


def fork_sequence(engine: "Engine", label: str) -> str:
    """Fork the running sequence ``label`` (``"r3"`` or ``"r3#1"``); return the child's label.

    The child is a new sample of the same request: same tokens so far, a block table that
    shares every block with its parent, and it runs from the next iteration on, next to
    its parent. The request finishes when all its sequences have.

    Only the continuous scheduler, and only a sequence past its prefill (its KV complete
    but for the last sampled token) can be forked: ``ValueError`` otherwise, and nothing
    changes (``Scheduler.fork`` checks).
    """
    sched = engine.scheduler
    parent = next((s for s in sched.running if seq_label(s) == label), None)
    if parent is None:
        raise ValueError(f"no running sequence {label!r}; running: "
                         f"{[seq_label(s) for s in sched.running]}")
    return seq_label(sched.fork(parent))
