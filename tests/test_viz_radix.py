"""labkit.viz.radix: the radix view draws the allocator's real tree, and its widget drives a real engine.

The data behind the figure is checked against the tree and the allocator after random block-table
operations (hypothesis); the ringed "next victim" against what the allocator really evicts next;
the widget by calling its methods, on pools small enough to evict. The browser test
(``tests/test_browser.py``) clicks the same buttons in JupyterLab.
"""

from __future__ import annotations

import pytest

pytest.importorskip("plotly", reason="labkit.viz figures need plotly (pip install 'labkit[lab]')")
pytest.importorskip("ipywidgets", reason="labkit.viz widgets need ipywidgets (pip install 'labkit[lab]')")

from hypothesis import given, settings, strategies as st  # noqa: E402

from labkit.memory import BlockAllocator, BlockTable, NoFreeBlocksError  # noqa: E402
from labkit import viz  # noqa: E402
from labkit.viz.radix import EDGES, NODES, RING, VICTIM, radix_data, radix_figure_dict, radix_tree_of  # noqa: E402

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23]]

ops = st.lists(st.tuples(st.sampled_from(["new", "new", "append", "free"]),
                         st.integers(0, 50), st.integers(1, 9)), max_size=30)


def run_ops(program, num_blocks=16, block_size=4):
    """Random requests on a radix-policy allocator: new prompts (sharing prefixes), appends, frees."""
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching="radix")
    tables: list[BlockTable] = []
    for op, pick, n in program:
        try:
            if op == "new" or not tables:
                table = BlockTable(alloc)
                prompt = PREFIXES[pick % len(PREFIXES)] + list(range(100 + pick, 100 + pick + n))
                table.reuse_cached_prefix(prompt, len(prompt) - 1)
                try:
                    table.append_tokens(prompt[table.num_tokens:])
                except NoFreeBlocksError:
                    table.free()
                    raise
                tables.append(table)
            elif op == "append":
                tables[pick % len(tables)].append_tokens(list(range(500, 500 + n)))
            else:
                tables.pop(pick % len(tables)).free()
        except NoFreeBlocksError:
            pass
    return alloc, tables


def path_tokens(views, key):
    by_key = {v.key: v for v in views}
    tokens = []
    while key is not None:
        v = by_key[key]
        tokens[:0] = v.token_ids
        key = v.parent
    return tokens


@settings(max_examples=40, deadline=None)
@given(ops)
def test_the_drawn_tree_is_the_allocators_tree(program):
    alloc, tables = run_ops(program)
    tree = alloc.radix
    views = radix_data(tree)
    nodes = list(tree.nodes())
    assert [v.key for v in views] == ["root"] + [f"n{n.id}" for n in nodes[1:]]
    assert len({v.key for v in views}) == len(views)
    drawn_blocks = [b for v in views for b in v.block_ids]
    assert len(drawn_blocks) == len(set(drawn_blocks))
    assert set(drawn_blocks) == {b for b in range(alloc.num_blocks) if alloc.is_cached(b)}
    for v, node in zip(views, nodes):
        assert v.block_ids == node.block_ids and v.hit_count == node.hit_count
        if v.parent is not None:
            assert {alloc.ref_count(b) for b in v.block_ids} == {v.ref_count}
            assert v.depth * alloc.block_size == len(path_tokens(views, v.key))
    # Every running table's full blocks lie on one drawn path that spells its tokens.
    for table in tables:
        full = table.num_tokens // alloc.block_size
        cached = [b for b in table.block_ids[:full] if alloc.is_cached(b)]
        if cached:
            owner = next(v for v in views if cached[-1] in v.block_ids)
            path = path_tokens(views, owner.key)
            assert table.token_ids[:len(cached) * alloc.block_size] == path[:len(cached) * alloc.block_size]
    # The eviction ranks are the tree's own order.
    ranked = sorted((v for v in views if v.evict_rank is not None), key=lambda v: v.evict_rank)
    assert [v.key for v in ranked] == [f"n{n.id}" for n in tree.evictable_leaves()]
    assert all(v.ref_count == 0 for v in ranked)


@settings(max_examples=25, deadline=None)
@given(ops)
def test_layout_puts_leaves_apart_and_parents_over_their_children(program):
    views = radix_data(run_ops(program)[0].radix)
    children = {v.key: [c for c in views if c.parent == v.key] for v in views}
    leaves = [v.x for v in views if not children[v.key]]
    assert len(leaves) == len(set(leaves))
    for v in views:
        kids = children[v.key]
        if kids:
            assert min(k.x for k in kids) <= v.x <= max(k.x for k in kids)
            assert all(k.depth > v.depth for k in kids)


def full_pool_with_a_victim():
    """Two finished chats and one running, on a pool with no plainly free block left."""
    alloc = BlockAllocator(7, 4, enable_prefix_caching="radix")
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    for own in ([10, 11, 12, 13], [20, 21, 22, 23]):
        t = BlockTable(alloc)
        prompt = system + own + [99]
        t.reuse_cached_prefix(prompt, len(prompt) - 1)
        t.append_tokens(prompt[t.num_tokens:])
        t.free()
    running = BlockTable(alloc)
    running.reuse_cached_prefix(system + [30, 31], 9)
    running.append_tokens((system + [30, 31])[running.num_tokens:])
    return alloc, running


def test_the_ring_marks_the_block_the_allocator_evicts_next():
    alloc, running = full_pool_with_a_victim()
    for _ in range(alloc.num_free_blocks - alloc.num_cached_free_blocks):
        alloc.allocate()                               # use up the plainly free blocks
    seen = []
    while alloc.radix.evictable_leaves():
        fig = radix_figure_dict(alloc)
        ring = fig["data"][RING]
        nodes = fig["data"][NODES]
        k = next(i for i, (x, y) in enumerate(zip(nodes["x"], nodes["y"]))
                 if (x, y) == (ring["x"][0], ring["y"][0]))
        victim = next(v for v in radix_data(alloc.radix) if v.key == nodes["customdata"][k])
        assert victim.evict_rank == 0 and victim.ref_count == 0
        assert f"next victim: blocks {victim.block_ids}" in fig["layout"]["title"]["text"]
        evicted = alloc.allocate()
        assert evicted == victim.block_ids[-1], "the ring named another block than the one evicted"
        seen.append(evicted)
        assert f"evictions {len(seen)}" in radix_figure_dict(alloc)["layout"]["title"]["text"]
    assert seen and not set(seen) & set(running.block_ids)
    assert radix_figure_dict(alloc)["data"][RING]["x"] == []   # nothing left to evict: no ring
    alloc.radix.check()


def test_figure_has_fixed_traces_and_can_hide_the_eviction_order():
    alloc, _ = full_pool_with_a_victim()
    fig = radix_figure_dict(alloc)
    assert [t["name"] for t in fig["data"]] == ["edges", "nodes", "next victim"]
    assert (EDGES, NODES, RING) == (0, 1, 2)
    views = radix_data(alloc.radix)
    assert len(fig["data"][NODES]["x"]) == len(views)
    assert fig["data"][EDGES]["x"].count(None) == len(views) - 1      # one edge per non-root node
    assert fig["data"][RING]["marker"]["color"] == VICTIM
    hidden = radix_figure_dict(alloc, show_victim=False)
    assert hidden["data"][RING]["x"] == [] and "victim" not in hidden["layout"]["title"]["text"]
    assert not any("eviction order" in h for h in hidden["data"][NODES]["hovertext"])
    assert any("eviction order" in h for h in fig["data"][NODES]["hovertext"])
    held = [h for h, v in zip(fig["data"][NODES]["hovertext"], views) if v.ref_count]
    assert held and all("held by running sequences" in h for h in held)
    assert viz.radix_figure(alloc).data[NODES].hovertext == tuple(fig["data"][NODES]["hovertext"])


def test_hover_shows_the_tokens_text_when_given_a_decoder():
    alloc, _ = full_pool_with_a_victim()
    fig = radix_figure_dict(alloc, token_text=lambda ids: "<" + "-".join(map(str, ids)) + ">")
    assert any("“&lt;1-2-3-4-5-6-7-8&gt;”" in h for h in fig["data"][NODES]["hovertext"])
    broken = radix_figure_dict(alloc, token_text=lambda ids: 1 / 0)    # a decoder that fails: ids only
    assert broken["data"][NODES]["hovertext"][1].count("tokens [") == 1


def test_radix_tree_of_finds_the_tree_and_refuses_other_policies():
    alloc, _ = full_pool_with_a_victim()
    assert radix_tree_of(alloc) is alloc.radix is radix_tree_of(alloc.radix)
    engine = viz.make_radix_engine(num_blocks=8, block_size=4)
    assert radix_tree_of(engine) is engine.scheduler.allocator.radix
    for policy in (True, "hash", False):
        with pytest.raises(ValueError, match="enable_prefix_caching='radix'"):
            radix_tree_of(BlockAllocator(8, 4, enable_prefix_caching=policy))
    with pytest.raises(ValueError, match="radix"):
        viz.RadixTreeWidget(viz.make_sim_engine(8, 4, enable_prefix_caching=True))


def test_empty_tree_draws_a_root():
    fig = radix_figure_dict(BlockAllocator(4, 4, enable_prefix_caching="radix"))
    assert fig["data"][NODES]["text"] == ["root"] and fig["data"][EDGES]["x"] == []
    assert fig["data"][RING]["x"] == []


# ---- the widget ------------------------------------------------------------------------------------
def nodes_drawn(widget) -> int:
    return len(widget.figure_data["data"][NODES]["x"])


def test_widget_chats_turns_and_branches_grow_the_tree():
    w = viz.RadixTreeWidget(num_blocks=32, block_size=4, system_prompt_len=8, figure_widget=False, seed=3)
    assert nodes_drawn(w) == 1                                  # the root alone
    assert w.new_chat() == "chat0" and w.new_chat() == "chat1"
    finished = w.run()
    assert sorted(finished) == ["r0", "r1"] and not w.engine.has_unfinished
    views = radix_data(w.tree)
    system = [v for v in views if v.parent == "root"]
    assert len(system) == 1 and system[0].num_tokens == 8      # computed together, stored once
    assert len([v for v in views if v.parent == system[0].key]) == 2   # the two chats branch after it
    before = {v.key: v for v in views}
    w.next_turn("chat0")
    w.step()                                                     # its prefill: the history is matched
    hits = sum(v.hit_count for v in radix_data(w.tree)) - sum(v.hit_count for v in before.values())
    assert hits >= 2, "the next turn matched neither the system prompt nor its chat's path"
    ids = w.branch("chat1", k=3)
    assert len(ids) == 3 and {"chat1.0", "chat1.1", "chat1.2"} <= set(w.chats)
    w.step()
    held = [v for v in radix_data(w.tree) if v.ref_count >= 3]
    assert held, "three branches of one history hold its nodes together"
    w.run()
    assert len(radix_data(w.tree)) > len(views)
    assert "evictions" in w.status.value and "step " in w.status.value
    w.tree.check()
    w.engine.scheduler.allocator.check_invariants()


def test_widget_refuses_a_turn_before_the_answer_and_says_why():
    w = viz.RadixTreeWidget(num_blocks=16, block_size=4, figure_widget=False)
    with pytest.raises(ValueError, match="no chat chosen"):
        w.next_turn()
    w.new_chat()
    with pytest.raises(ValueError, match="has not finished"):
        w.next_turn("chat0")
    w.turn_button.click()                                       # the button shows the refusal instead
    assert "has not finished" in w.message.value
    with pytest.raises(ValueError, match="no chat 'chat9'"):
        w.branch("chat9")
    with pytest.raises(ValueError, match="k must be"):
        w.branch("chat0", k=0)
    w.step_button.click()
    assert w.engine.scheduler.step == 1 and w.message.value == ""
    with pytest.raises(ValueError, match="message_len"):
        viz.RadixTreeWidget(message_len=(0, 3), figure_widget=False)


def test_widget_on_a_small_pool_evicts_and_says_so():
    w = viz.RadixTreeWidget(num_blocks=12, block_size=4, system_prompt_len=4, message_len=(4, 8),
                            max_tokens=4, figure_widget=False, seed=1)
    for _ in range(8):
        w.new_chat()
        w.run()
        if w.tree.num_evictions:
            break
    assert w.tree.num_evictions > 0, "a pool of 12 blocks never evicted"
    assert "evicted" in w.status.value
    w.tree.check()
    w.engine.scheduler.allocator.check_invariants()
    # Buttons do what the methods do.
    steps = w.engine.scheduler.step
    w.new_button.click()
    w.run_button.click()
    assert w.engine.scheduler.step > steps and not w.engine.has_unfinished


def test_widget_on_the_real_engine_shows_the_tokens_text():
    """The same widget over an ``LLM`` (tiny-llama: random weights, a real tokenizer and model
    run): the next turn reuses the first turn's blocks, and hovering shows their text."""
    from labkit import LLM
    llm = LLM("tiny-llama", num_blocks=32, block_size=4, enable_prefix_caching="radix")
    w = viz.RadixTreeWidget(llm, max_tokens=4, figure_widget=False, seed=0)
    w.new_chat()
    w.run()
    first = sum(v.num_tokens for v in radix_data(w.tree))
    turn = w.next_turn("chat0")
    w.run()
    request = w.chats["chat0"][-1]
    assert request.request_id == turn and request.seqs[0].num_cached_tokens >= first - 4 > 0
    hovers = w.figure_data["data"][NODES]["hovertext"][1:]
    assert hovers and all("“" in h for h in hovers), hovers      # decoded text, quoted
    w.tree.check()
