"""The verifier's view (``labkit.viz.speculative``): what a speculating engine reports after each
step, the slot states the figure draws from it, the static table, and the figure itself, all
without a browser (tiny-llama, blocks of 4, prompt lookup)."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly", reason="labkit.viz figures need plotly (pip install 'labkit[lab]')")

from labkit import SamplingParams  # noqa: E402
from labkit.model.loader import tiny_llama  # noqa: E402
from labkit.viz.speculative import (SLOT_COLORS, record_speculation, speculation_data,  # noqa: E402
                                    speculation_figure, speculation_text)
from test_spec_decode import NGRAM, make_engine  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.fixture(scope="module")
def recorded():
    engine = make_engine(tiny_llama(), NGRAM, block_size=4)
    outcomes = record_speculation(engine, [PROMPT, [40, 41, 42, 43, 40, 41, 42]],
                                  SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    return engine, outcomes


def test_recording_sees_every_guess_and_leaves_the_pool_whole(recorded):
    engine, outcomes = recorded
    stats = engine.executor.speculator.stats
    assert outcomes, "nothing was guessed: the test proves nothing"
    assert sum(len(o.drafted) for o in outcomes) == stats.num_draft_tokens
    assert sum(o.accepted for o in outcomes) == stats.num_accepted_tokens
    assert all(o.step is not None for o in outcomes)
    assert [o.step for o in outcomes] == sorted(o.step for o in outcomes)
    assert not engine.has_unfinished and engine.scheduler.allocator.num_used_blocks == 0
    assert engine.executor.speculator.observer is None          # the observer is put back


def test_slot_states_follow_the_outcome(recorded):
    _, outcomes = recorded
    data = speculation_data(outcomes)
    assert data["num_guessed"] == sum(len(s["guesses"]) for s in data["steps"])
    assert 0 < data["acceptance_rate"] <= 1
    for s, o in zip(data["steps"], outcomes, strict=True):
        during, after = s["slots_during"], s["slots_after"]
        assert len(during) == len(o.blocks_during) * o.block_size
        assert len(after) == len(o.blocks_after) * o.block_size
        assert during.count("accepted") == o.accepted == after.count("accepted")
        assert during.count("rejected") == len(o.drafted) - o.accepted
        assert "rejected" not in after and after.count("last") == during.count("last") == 1
        assert s["slots_given_back"] == during.count("rejected") + during.count("lookahead")
        assert s["blocks_given_back"] == len(o.blocks_during) - len(o.blocks_after)
        assert set(during) <= set(SLOT_COLORS)
    assert any(s["blocks_given_back"] for s in data["steps"]) or any(s["slots_given_back"] for s in data["steps"])


def test_the_static_table_has_a_line_per_step(recorded):
    _, outcomes = recorded
    text = speculation_text(outcomes)
    assert len(text.splitlines()) == len(outcomes) + 2
    assert "guesses kept" in text


def test_the_figure_has_a_slider_step_per_guessing_step(recorded):
    _, outcomes = recorded
    fig = speculation_figure(outcomes)
    first = outcomes[0]
    shown = [o for o in outcomes if o.drafted and (o.request_id, o.index) == (first.request_id, first.index)]
    assert len(fig.layout.sliders[0].steps) == len(shown)
    assert len(fig.data) == len(shown) + len(SLOT_COLORS)
    assert [t.visible for t in fig.data[:len(shown)]].count(True) == 1
    fig.to_dict()                                                      # serialisable: renders without a kernel
    other = speculation_figure(outcomes, request_id="spec-1")
    assert len(other.layout.sliders[0].steps) == sum(1 for o in outcomes if o.request_id == "spec-1" and o.drafted)


def test_it_refuses_what_it_cannot_show():
    plain = make_engine(tiny_llama(), None, block_size=4)
    with pytest.raises(ValueError, match="speculative_config"):
        record_speculation(plain, [PROMPT], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="no step with guesses"):
        speculation_figure([])
