"""labkit.viz: what the widgets draw matches the engine's real state (no browser here).

The block view is checked against the allocator after random operations on block tables
(fork, copy-on-write, free, prefix caching); the timeline against the step records; the
waste chart against the waste accounting; the live widget by calling its methods.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("plotly", reason="labkit.viz figures need plotly (pip install 'labkit[lab]')")
pytest.importorskip("ipywidgets", reason="labkit.viz widgets need ipywidgets (pip install 'labkit[lab]')")

from hypothesis import given, settings, strategies as st  # noqa: E402

from labkit.memory import (BlockAllocator, BlockTable, NoFreeBlocksError, SeqUsage,  # noqa: E402
                           contiguous_waste, paged_waste)
from labkit.sampling_params import SamplingParams  # noqa: E402
from labkit.sim import TraceRequest, simulate, synthetic_trace  # noqa: E402
from labkit import viz  # noqa: E402
from labkit.viz import colors as C  # noqa: E402
from labkit.viz.blocks import ARROWS, LOGICAL, POOL  # noqa: E402


# ---- the block view against the allocator ------------------------------------------------
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25, 26, 27]]

ops = st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]),
                         st.integers(0, 50), st.integers(1, 9)), max_size=40)


def run_ops(program, num_blocks=24, block_size=4):
    """Apply random table operations; ``NoFreeBlocksError`` refuses an op (changing nothing)."""
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=True)
    tables: dict[str, BlockTable] = {}
    count = 0
    for op, pick, n in program:
        live = list(tables)
        try:
            if op == "new" or not live:
                table = BlockTable(alloc)
                prompt = PREFIXES[pick % len(PREFIXES)] + list(range(100 + pick, 100 + pick + n))
                table.reuse_cached_prefix(prompt, len(prompt) - 1)
                try:
                    table.append_tokens(prompt[table.num_tokens:])
                except NoFreeBlocksError:
                    table.free()            # give back the cached blocks it took
                    raise
                tables[f"s{count}"] = table
                count += 1
            elif op == "append":
                tables[live[pick % len(live)]].append_tokens(list(range(500, 500 + n)))
            elif op == "fork":
                label = live[pick % len(live)]
                tables[f"{label}#{count}"] = tables[label].fork()
                count += 1
            else:
                tables.pop(live[pick % len(live)]).free()
        except NoFreeBlocksError:
            pass
        alloc.check_invariants()
    return alloc, tables


def check_view_matches(alloc, tables):
    snap = viz.allocator_snapshot(alloc, tables)
    pool = snap["pool"]
    bs = alloc.block_size
    # Every table's cells: as many as its blocks, holding exactly its tokens.
    for label, table in tables.items():
        assert sum(label in owners for owners in pool["owners"]) == table.num_blocks
        for i, b in enumerate(table.block_ids):
            assert pool["state"][b] == "used"
            held = table.token_ids[i * bs:(i + 1) * bs]
            assert pool["tokens"][b][:len(held)] == tuple(held)
    # Reference counts: the allocator's, and the number of tables holding the block.
    for b in range(alloc.num_blocks):
        assert pool["ref_count"][b] == alloc.ref_count(b)
        assert pool["state"][b] == alloc.state(b)
        assert pool["fill"][b] == (alloc.fill(b) if alloc.state(b) != "free" else 0)
        if pool["state"][b] == "used":
            assert len(pool["owners"][b]) == alloc.ref_count(b)
    assert sum(s != "used" for s in pool["state"]) == alloc.num_free_blocks
    assert pool["state"].count("cached-free") == alloc.num_cached_free_blocks

    # What is drawn: one hover cell per block, its state and refcount, "×n" on shared cells.
    for selected in [None, *tables]:
        fig = viz.block_figure_dict(snap, selected)
        cells = fig["data"][POOL]
        assert len(cells["customdata"]) == alloc.num_blocks
        for b, (bid, state, refs, owners) in enumerate(cells["customdata"]):
            assert (bid, state, refs) == (b, alloc.state(b), alloc.ref_count(b))
            assert set(filter(None, owners.split(","))) == set(pool["owners"][b])
            assert (f"×{refs}" in cells["text"][b]) == (refs > 1)
        shown = selected if selected is not None else next(iter(tables), None)
        if shown is not None:
            table = tables[shown]
            assert fig["data"][LOGICAL]["text"] == [f"L{i}→{b}" for i, b in enumerate(table.block_ids)]
            assert len([s for s in fig["data"][ARROWS]["marker"]["size"] if s]) == table.num_blocks
        # Shapes: a free block is one white cell; held blocks draw in their request's colour.
        free_cells = [s for s in fig["layout"]["shapes"] if s["fillcolor"] == C.FREE]
        assert len(free_cells) == pool["state"].count("free")
        cached_cells = [s for s in fig["layout"]["shapes"] if s["fillcolor"] == C.CACHED_FREE]
        assert len(cached_cells) == pool["state"].count("cached-free")


@settings(max_examples=60, deadline=None)
@given(ops)
def test_block_view_matches_allocator_after_random_ops(program):
    alloc, tables = run_ops(program)
    check_view_matches(alloc, tables)


def test_block_view_shared_and_copy_on_write():
    alloc = BlockAllocator(8, 4)
    a = BlockTable(alloc)
    a.append_tokens([1, 2, 3, 4, 5, 6])
    b = a.fork()
    snap = viz.allocator_snapshot(alloc, {"A": a, "A#1": b})
    assert snap["pool"]["ref_count"][:2] == [2, 2]
    assert snap["pool"]["owners"][1] == ("A", "A#1")
    copies = b.append_tokens([7])                  # writes into the shared last block: COW
    assert copies == [(1, 2)]
    snap = viz.allocator_snapshot(alloc, {"A": a, "A#1": b})
    assert snap["pool"]["ref_count"][:3] == [2, 1, 1]
    assert snap["pool"]["tokens"][2] == (5, 6, 7)
    assert snap["tables"]["A#1"]["block_ids"] == [0, 2]
    check_view_matches(alloc, {"A": a, "A#1": b})


# ---- the live widget ------------------------------------------------------------------
@pytest.mark.parametrize("figure_widget", [False, None])
def test_live_widget_steps_and_redraws(figure_widget):
    w = viz.LiveEngineWidget(num_blocks=24, block_size=4, figure_widget=figure_widget)
    assert w.view.uses_figure_widget is (figure_widget is None)
    r0 = w.add_request(prompt_len=9, max_tokens=6)
    w.add_request(prompt_len=5, max_tokens=4, n=2)
    before = w.figure_data
    w.step()
    after = w.figure_data
    assert after["data"][POOL]["customdata"] != before["data"][POOL]["customdata"]
    assert after["layout"]["title"]["text"] == ""            # the status line says it instead
    assert "step 1" in w.status.value
    alloc = w.engine.scheduler.allocator
    states = [c[1] for c in after["data"][POOL]["customdata"]]
    assert sum(s != "used" for s in states) == alloc.num_free_blocks
    for _ in range(2):
        w.step()
    # The n=2 request forked after its prefill: its prompt blocks are shared.
    assert any(refs == 2 for _b, _s, refs, _o in w.figure_data["data"][POOL]["customdata"])
    child = w.fork(r0)
    assert child == f"{r0}#1"
    shared = w.engine.scheduler.running[0].block_table.block_ids
    assert all(alloc.ref_count(b) == 2 for b in shared)
    assert w.figure_data["data"][LOGICAL]["text"][0].startswith("L0→")
    w.step()
    assert w.engine.records[-1].num_copies >= 1          # the fork's shared last block was copied
    w.abort(r0)
    assert r0 not in w.engine.scheduler.requests
    w.step(50)
    assert not w.engine.has_unfinished
    assert alloc.num_used_blocks == 0
    alloc.check_invariants()
    assert len(w.recording) >= 8
    # The play widget's ticks step the engine (the browser test clicks the real button).
    w.add_request(prompt_len=3, max_tokens=4)
    steps = w.engine.num_steps
    w.play.value += 1
    w.play.value += 1
    assert w.engine.num_steps == steps + 2
    # A refused action shows a message instead of raising (what the buttons do).
    w._safely(w.abort, "nope")
    assert "nope" in w.message.value
    w.select(None)
    replay = w.replay(figure_widget=figure_widget)
    first = replay.view.figure_dict
    replay.show(3)
    assert replay.view.figure_dict != first


def test_live_widget_drives_any_engine():
    engine = viz.make_sim_engine(16, 4, policy="static", max_num_seqs=4)
    w = viz.LiveEngineWidget(engine, figure_widget=False)
    w.add_request(prompt_len=4, max_tokens=3)
    w.step()
    with pytest.raises(ValueError, match="continuous"):
        w.fork()
    w._safely(w.fork)
    assert "continuous" in w.message.value


def test_fork_sequence_refuses_a_prefilling_sequence():
    engine = viz.make_sim_engine(16, 4, max_num_batched_tokens=4)
    engine.add_request(list(range(10, 22)), SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")
    engine.step()                                   # 4 of 12 prompt tokens: still prefilling
    with pytest.raises(ValueError, match="prefilling"):
        viz.fork_sequence(engine, "a")
    with pytest.raises(ValueError, match="no running sequence"):
        viz.fork_sequence(engine, "zz")


def test_output_fallback_in_colab(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    w = viz.LiveEngineWidget(num_blocks=8, block_size=4)
    assert not w.view.uses_figure_widget           # Colab: re-rendered into an Output
    w.add_request(prompt_len=3, max_tokens=2)
    w.step()
    assert "step 1" in w.status.value
    assert w.recording[-1]["status"]["num_steps"] == 1


# ---- replay and export ----------------------------------------------------------------
def test_record_trace_and_export_html(tmp_path):
    trace = [TraceRequest(6, 5, 0.0), TraceRequest(9, 3, 0.0), TraceRequest(5, 8, 0.05)]
    rec, result = viz.record_trace(trace, num_blocks=16, block_size=4)
    assert len(rec) == len(result.records) + 1
    assert result.metrics["leaked_blocks"] == 0
    assert rec[-1]["status"]["num_used_blocks"] == 0
    for snap, record in zip(rec.snapshots[1:], result.records):
        assert snap["status"]["num_used_blocks"] == record.num_used_blocks
        assert sum(s != "used" for s in snap["pool"]["state"]) == record.num_free_blocks
    fig = viz.replay_figure(rec)
    assert len(fig.frames) == len(rec)
    assert len(fig.layout.sliders[0].steps) == len(rec)
    path = viz.export_html(rec, tmp_path / "replay.html", include_plotlyjs="cdn")
    html = path.read_text()
    assert "addFrames" in html and html.count('"name":"') >= len(rec)
    # Long recordings are thinned to max_frames, keeping the first and last.
    assert len(rec.figure(max_frames=4).frames) == 4


def test_record_engine_and_selection_follows_a_sequence():
    engine = viz.make_sim_engine(16, 4)
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), request_id="b")
    rec = viz.record_engine(engine)
    sel = rec.selections()
    assert sel[0] is None and sel[1] == "a" and sel[-2] == "b"
    assert set(rec.selections(follow="b")[1:-1]) == {"b"}


# ---- the scheduler timeline ---------------------------------------------------------
def test_timeline_data_matches_records():
    trace = synthetic_trace("alpaca", 10, rate=30, seed=3, max_len=200)
    for policy in ("continuous", "static"):
        res = simulate(trace, policy, num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=6)
        d = viz.timeline_data(res.records, res.requests)
        assert d["requests"] == [r.request_id for r in sorted(res.requests, key=lambda r: r.arrival_time)]
        assert res.metrics["num_preemptions"] == 0
        for r in res.requests:
            cells = d["cells"][r.request_id]
            out = r.seqs[0].num_output_tokens
            assert cells.count("decode") == out - 1          # the first token comes with the prefill
            assert d["tokens"][r.request_id] == {"prefill": len(r.prompt_token_ids), "decode": out - 1}
            last = max(k for k, c in enumerate(cells) if c is not None)
            assert r.request_id in res.records[last].finished
        for k, rec in enumerate(res.records):
            for rid, _i, _n, phase in rec.ran:
                assert d["cells"][rid][k] == phase
        assert d["kv"]["num_used_blocks"] == [rec.num_used_blocks for rec in res.records]


def test_timeline_shows_preemptions():
    trace = [TraceRequest(12, 40, 0.0) for _ in range(4)]
    res = simulate(trace, "continuous", num_blocks=14, block_size=4, max_model_len=None, watermark=0.0)
    assert res.metrics["num_preemptions"] > 0
    d = viz.timeline_data(res.records, res.requests)
    assert any("preempted" in cells for cells in d["cells"].values())
    for r in res.requests:       # every output token: one decode cell, or a prefill that sampled it
        assert d["cells"][r.request_id].count("decode") <= r.seqs[0].num_output_tokens - 1
    fig = viz.timeline_figure(res)
    assert any(t.name == "preempted" and len(t.y) for t in fig.data)


def test_compare_schedulers_figure():
    trace = synthetic_trace("alpaca", 8, rate=20, seed=1, max_len=200)
    fig = viz.compare_schedulers(trace, num_blocks=64, block_size=16, max_model_len=256, max_num_seqs=4)
    names = {t.name for t in fig.data}
    assert {"prefill", "decode", "waiting", "KV cache usage (% of blocks held)"} <= names
    assert "static batching" in fig.layout.annotations[0].text
    assert "continuous batching" in fig.layout.annotations[1].text
    fig_steps = viz.timeline_figure(viz.simulate_policies(trace, ("continuous",), num_blocks=64), x="step")
    assert fig_steps.layout.xaxis2.title.text == "iteration"          # the KV panel's axis, bottom
    assert all(min(b.base, default=0.5) >= 0.5 for b in fig_steps.data if b.type == "bar")  # steps from 1
    with pytest.raises(ValueError, match="x must be"):
        viz.timeline_figure(viz.simulate_policies(trace[:2], ("continuous",)), x="seconds")


# ---- the waste chart ------------------------------------------------------------------
SEQS = [SeqUsage.request(p, o, generated=g, max_tokens=128)
        for p, o, g in [(20, 60, 30), (30, 90, 90), (15, 40, 5), (50, 70, 20), (10, 30, 29)]]


def test_waste_bars_sum_to_total_slots():
    wastes = viz.compare_waste(SEQS, 16)
    assert list(wastes) == ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)", "vLLM (paged)"]
    raw = viz.waste_data(wastes, normalize=None)
    for j, w in enumerate(wastes.values()):
        assert sum(raw["values"][k][j] for k, _ in raw["categories"]) == w.total_slots == raw["totals"][j]
        assert raw["values"]["token_slots"][j] == sum(s.num_tokens for s in SEQS)
    for normalize in ("total", "consumed"):
        d = viz.waste_data(wastes, normalize=normalize)
        for j in range(len(wastes)):
            assert sum(d["values"][k][j] for k, _ in d["categories"]) == pytest.approx(100.0)
    paged = wastes["vLLM (paged)"]
    assert paged == paged_waste(SEQS, 16, total_slots=paged.total_slots)
    assert paged.reserved_slots == paged.external_fragmentation == 0
    assert wastes["Orca (Max)"].external_fragmentation > 0          # holes left by departed requests
    packed = viz.compare_waste(SEQS, 16, churn=False)
    assert packed["Orca (Max)"] == contiguous_waste(SEQS, reserve="max",
                                                    total_slots=packed["Orca (Max)"].total_slots)
    fig = viz.waste_figure(wastes)
    assert [t.name for t in fig.data] == ["token states", "reservation", "internal fragmentation",
                                          "external fragmentation"]
    assert len(viz.waste_figure(wastes, normalize=None).data) == 5


def test_fragmented_layout_holds_exactly_the_reservations():
    from labkit.memory import reservation
    for reserve in ("max", "pow2", "oracle"):
        mem = viz.fragmented_layout(SEQS, reserve, 2000, seed=4)
        mem.check_invariants()
        assert sorted(mem.allocations.values()) == sorted(reservation(s, reserve) for s in SEQS)
    with pytest.raises(ValueError, match="do not fit"):
        viz.fragmented_layout(SEQS, "max", 100)


def test_live_waste_adds_up():
    w = viz.LiveEngineWidget(num_blocks=16, block_size=4, figure_widget=False)
    w.add_request(prompt_len=6, max_tokens=5)
    w.add_request(prompt_len=3, max_tokens=7, n=2)
    for _ in range(3):
        w.step()
    for known in (False, True):
        waste = viz.live_waste(w.engine, known_lengths=known)
        assert waste.total_slots == 16 * 4
        assert waste.free_slots == w.engine.scheduler.allocator.num_free_blocks * 4
    assert viz.live_waste(w.engine, known_lengths=True).reserved_slots > 0
    viz.waste_figure({"now": viz.live_waste(w.engine)}, normalize="total")


# ---- packaging ------------------------------------------------------------------------
def test_import_is_light():
    code = ("import sys, labkit.viz as v; v.status_line; "
            "assert 'plotly' not in sys.modules and 'ipywidgets' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('plotly', 'ipywidgets'))]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_hover_shows_token_text_escaped():
    alloc = BlockAllocator(4, 2)
    t = BlockTable(alloc)
    t.append_tokens([60, 62, 38])
    decode = lambda ids: "".join(chr(i) for i in ids)   # noqa: E731  (a stand-in tokenizer)
    fig = viz.block_figure_dict(viz.allocator_snapshot(alloc, {"A": t}), token_text=decode)
    hover = fig["data"][POOL]["hovertext"]
    assert "text “&lt;&gt;”" in hover[0] and "text “&amp;”" in hover[1]


def test_block_figure_builds():
    alloc = BlockAllocator(40, 8)
    t = BlockTable(alloc)
    t.append_tokens(list(range(30)))
    fig = viz.block_figure(viz.allocator_snapshot(alloc, {"A": t}))
    assert len(fig.data) >= 4 and fig.layout.yaxis.scaleanchor == "x"
    with pytest.raises(AttributeError):
        _ = viz.no_such_thing
