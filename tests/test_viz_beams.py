"""The beam view (``labkit.viz.beams``): the beam tree's bookkeeping on the real memory layer,
what its figure draws, and the widget's stepping, in both figure paths (FigureWidget and the
re-rendered ``Output`` that Colab uses)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("plotly", reason="labkit.viz figures need plotly (pip install 'labkit[lab]')")
pytest.importorskip("ipywidgets", reason="labkit.viz widgets need ipywidgets (pip install 'labkit[lab]')")

from labkit import viz  # noqa: E402
from labkit.viz.beams import (DEVICE, HOST, NODES, TABLE, BeamTree, BeamWidget, beam_animation,  # noqa: E402
                              beam_figure_dict, demo_tree)


def _check(tree: BeamTree) -> None:
    """Every reference count is the number of live tables naming the block, on each side."""
    tree.device.check_invariants()
    tree.host.check_invariants()
    for alloc, on_host in ((tree.device, False), (tree.host, True)):
        named = [x for b in tree.live if b.on_host == on_host for x in b.table.block_ids]
        for x in range(alloc.num_blocks):
            assert alloc.ref_count(x) == named.count(x), (on_host, x)
    for b in tree.live:
        assert b.table.num_tokens == b.num_tokens
        assert b.table.num_blocks == -(-b.num_tokens // tree.block_size)


def test_fork_shares_and_copies_only_the_partly_filled_block():
    tree = BeamTree(prompt_len=6, block_size=4)         # a full block and a half-filled one
    tree.step(["b0", "b0", "b0"])
    _check(tree)
    full = tree.beams["b0"].table.block_ids[0]
    assert all(b.table.block_ids[0] == full for b in tree.live)    # the full block: shared by 3
    assert tree.device.ref_count(full) == 3
    assert tree.num_copies == 2                          # two of three writers copy; the last writes in place
    assert tree.num_physical_blocks == 4 and tree.num_logical_blocks == 6


def test_a_beam_that_dies_frees_its_blocks_at_once():
    tree = BeamTree(prompt_len=4, block_size=4)
    tree.step(["b0", "b0"])                              # a full prompt block: forks copy nothing
    assert tree.num_copies == 0
    before = tree.device.num_used_blocks
    tree.step(["b0", "b0"])                              # b1 dies, b0 forks again
    _check(tree)
    assert tree.beams["b1"].died == 2 and tree.num_deaths == 1
    assert tree.device.num_used_blocks == before         # b1's private block went back, b2's arrived


def test_swap_out_and_in_keep_sharing_and_tokens():
    tree = demo_tree()
    snaps = {s["event"].split(":")[0]: s for s in tree.snapshots}
    out, back = snaps["swap out"], snaps["swap in"]
    assert sum(out["device"]) == 0 and sum(out["host"]) == sum(back["device"])   # every reference moved
    assert out["physical"] == back["physical"] and out["logical"] == back["logical"]
    _check(tree)


def test_swap_errors_change_nothing():
    tree = BeamTree(prompt_len=8, block_size=4, num_host_blocks=1)
    tree.step(["b0", "b0"])
    with pytest.raises(MemoryError, match="host"):
        tree.swap_out()
    _check(tree)
    with pytest.raises(ValueError, match="nothing to swap in"):
        tree.swap_in()
    tree2 = BeamTree(prompt_len=3, block_size=4)
    tree2.swap_out()
    with pytest.raises(ValueError, match="swap_in"):
        tree2.step(["b0"])


@pytest.mark.parametrize("parents", [[], ["b9"], ["b0", "nobody"]])
def test_step_names_live_beams_only(parents):
    tree = BeamTree(prompt_len=3)
    with pytest.raises(ValueError, match="live beam"):
        tree.step(parents)
    assert tree.step_index == 0 and len(tree.snapshots) == 1


def test_random_beam_searches_keep_the_invariants():
    rng = random.Random(0)
    for trial in range(30):
        tree = BeamTree(prompt_len=rng.randint(1, 12), block_size=rng.choice([1, 2, 4, 8]),
                        num_blocks=512, num_host_blocks=512)
        for _ in range(rng.randint(1, 12)):
            live = [b.label for b in tree.live]
            tree.step([rng.choice(live) for _ in range(rng.randint(1, 4))])
            _check(tree)
            if rng.random() < 0.2:
                tree.swap_out()
                _check(tree)
                tree.swap_in()
                _check(tree)
        assert tree.num_physical_blocks <= tree.num_logical_blocks


def test_figure_draws_the_snapshot():
    tree = demo_tree()
    for snap in tree.snapshots:
        fig = beam_figure_dict(snap, 5)
        assert len(fig["data"]) == 5                   # the same traces always: live updates, frames
        cells = sum(len(t["blocks"]) for t in snap["tables"].values())
        assert len(fig["data"][TABLE]["x"]) == cells
        assert len(fig["data"][DEVICE]["x"]) == len(snap["device"])
        assert len(fig["data"][HOST]["x"]) == len(snap["host"])
        assert len(fig["data"][NODES]["x"]) == len(snap["tree"])
        shared = [t for t in fig["data"][TABLE]["text"] if "×" in t]
        refs = snap["host"] if any(t["on_host"] for t in snap["tables"].values()) else snap["device"]
        assert len(shared) == sum(rc for rc in refs if rc > 1)   # each holder shows the count
    on_host = next(s for s in tree.snapshots if s["event"].startswith("swap out"))
    assert all(t.startswith("h") for t in beam_figure_dict(on_host)["data"][TABLE]["text"])


@pytest.mark.parametrize("figure_widget", [False, None])
def test_widget_steps_back_and_forth(figure_widget):
    tree = demo_tree()
    w = BeamWidget(tree, figure_widget=figure_widget)
    assert w.view.uses_figure_widget is (figure_widget is None)
    assert w.index == 0 and "prefill" in w.status.value
    w.next.click()
    assert w.index == 1 and w.slider.value == 1 and "fork" in w.status.value
    w.slider.value = len(tree.snapshots) - 1
    assert w.index == len(tree.snapshots) - 1
    w.next.click()                                      # at the end: stays
    assert w.index == len(tree.snapshots) - 1
    w.back.click()
    assert w.index == len(tree.snapshots) - 2
    assert w.view.figure_dict == beam_figure_dict(tree.snapshots[w.index], w.steps)


def test_widget_refuses_nothing_to_show_and_animation_has_a_frame_per_snapshot():
    with pytest.raises(ValueError, match="no snapshot"):
        BeamWidget([])
    tree = demo_tree()
    assert len(beam_animation(tree).frames) == len(tree.snapshots)


def test_exported_from_labkit_viz():
    assert viz.BeamTree is BeamTree and viz.BeamWidget is BeamWidget


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_record_engine_beams_reads_the_engine(preemption_mode):
    """The snapshots of a real engine's beam search (simulator's executor): what they say
    held is what the allocator holds, forks and deaths are the scheduler's counters, every
    fork's parent held its tokens, and everything is freed at the end."""
    from labkit import BeamSearchParams
    from labkit.engine import Engine
    from labkit.memory import BlockAllocator
    from labkit.scheduler import make_scheduler
    from labkit.sim import SimExecutor
    from labkit.viz.beams import record_engine_beams

    alloc = BlockAllocator(64, 4)
    sched = make_scheduler("continuous", alloc, preemption_mode=preemption_mode,
                           num_host_blocks=64 if preemption_mode == "swap" else 0)
    engine = Engine(sched, SimExecutor())
    snaps = record_engine_beams(engine, list(range(10)), BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    assert snaps[-1]["tables"] == {} and alloc.num_used_blocks == 0
    assert snaps[-1]["forks"] == sched.num_beam_forks > 0 and snaps[-1]["deaths"] == sched.num_beam_deaths
    for snap in snaps:
        assert len(beam_figure_dict(snap)["data"]) == 5
        held = {x for t in snap["tables"].values() for x in t["blocks"]}
        assert snap["physical"] == len(held) <= snap["logical"]
    labels = [label for label, *_ in snaps[-1]["tree"]]
    assert len(labels) == 1 + sched.num_beam_forks
    assert all(parent in labels for _, parent, *_ in snaps[-1]["tree"] if parent is not None)
    assert sum(died is not None for *_, died in snaps[-1]["tree"]) == sched.num_beam_deaths
    BeamWidget(snaps, figure_widget=False)
