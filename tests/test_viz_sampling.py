"""labkit.viz.sampling: the sampler's view shows the engine's logprobs, and what each setting
makes of them agrees with the rules written out plainly here (not with a second call to the
sampler): temperature raises probabilities to the power 1/T, min-p cuts relative to the top
token, top-p keeps the head whose mass reaches p, presence and frequency penalties divide a
generated token's weight by e^penalty (per occurrence, for frequency), greedy is one-hot."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("plotly", reason="labkit.viz figures need plotly (pip install 'labkit[lab]')")

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.outputs import CompletionOutput, Logprob  # noqa: E402
from labkit.viz import sampling_data, sampling_figure  # noqa: E402
from labkit.viz.sampling import RAW_LABEL, steps  # noqa: E402

# Three steps over a 4-token view; token 7 is emitted at steps 0 and 1, so the penalties
# lower it at steps 1 (once generated) and 2 (twice).
RAW = {7: 0.5, 100: 0.3, 42: 0.1, 3000: 0.05}          # 0.05 of the mass is unreported


def _entries(raw: dict[int, float]) -> dict[int, Logprob]:
    ranked = sorted(raw, key=raw.get, reverse=True)
    return {t: Logprob(math.log(raw[t]), ranked.index(t) + 1, f"tok{t}") for t in raw}


def _output(token_ids=(7, 7, 100)) -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=list(token_ids),
                            logprobs=[_entries(RAW) for _ in token_ids])


def _norm(w: list[float]) -> list[float]:
    return [x / sum(w) for x in w]


def _bars(settings, step=0, **kw):
    return sampling_data(_output(), settings, **kw)["steps"][step]["bars"]


def test_steps_read_the_logprobs():
    views = steps(_output())
    assert [v.position for v in views] == [0, 1, 2] and [v.chosen for v in views] == [7, 7, 100]
    v = views[0]
    assert v.token_ids == [7, 100, 42, 3000] and v.texts == ["tok7", "tok100", "tok42", "tok3000"]
    assert v.raw == pytest.approx([0.5, 0.3, 0.1, 0.05]) and v.rest == pytest.approx(0.05)


def test_raw_bars_are_the_models_probabilities_and_top_cuts_them():
    data = sampling_data(_output(), top=2)
    assert data["labels"] == [RAW_LABEL]
    step = data["steps"][2]
    assert step["tokens"] == ["tok7", "tok100"] and step["chosen_text"] == "tok100"
    assert step["bars"][RAW_LABEL] == pytest.approx([0.5, 0.3])
    assert step["reported"] == 4 and step["rest"] == pytest.approx(0.05)


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_raises_to_the_power_one_over_t(t):
    bars = _bars({"T": SamplingParams(temperature=t)})["T"]
    assert bars == pytest.approx(_norm([p ** (1 / t) for p in RAW.values()]), rel=1e-5)


def test_min_p_cuts_relative_to_the_top_token_after_temperature():
    bars = _bars({"a": SamplingParams(temperature=1.0, min_p=0.4), "b": SamplingParams(temperature=2.0, min_p=0.4)})
    assert bars["a"] == pytest.approx(_norm([0.5, 0.3, 0, 0]))            # 0.1 / 0.5 < 0.4
    tempered = [p ** 0.5 for p in RAW.values()]                              # sqrt(0.1 / 0.5) >= 0.4
    assert bars["b"] == pytest.approx(_norm([w if w >= 0.4 * tempered[0] else 0 for w in tempered]), rel=1e-5)
    assert bars["b"][2] > 0 == bars["b"][3]


def test_top_p_keeps_the_head_of_the_reported_distribution():
    bars = _bars({"p": SamplingParams(temperature=1.0, top_p=0.6)})["p"]
    # renormalised over the reported tokens: 0.526, 0.316, ...; the head reaching 0.6 is two tokens
    assert bars == pytest.approx(_norm([0.5, 0.3, 0, 0]))


def test_top_k():
    assert _bars({"k": SamplingParams(temperature=1.0, top_k=3)})["k"] == pytest.approx(_norm([0.5, 0.3, 0.1, 0]))


def test_presence_and_frequency_penalties_follow_the_generated_tokens():
    settings = {"pres": SamplingParams(temperature=1.0, presence_penalty=1.0),
                "freq": SamplingParams(temperature=1.0, frequency_penalty=0.5)}
    first, second, third = (_bars(settings, step=s) for s in range(3))
    plain = _norm(list(RAW.values()))
    assert first["pres"] == pytest.approx(plain) and first["freq"] == pytest.approx(plain)   # nothing generated yet
    once = _norm([0.5 * math.exp(-1.0), 0.3, 0.1, 0.05])
    assert second["pres"] == pytest.approx(once, rel=1e-5) and third["pres"] == pytest.approx(once, rel=1e-5)
    assert third["freq"] == pytest.approx(_norm([0.5 * math.exp(-0.5 * 2), 0.3, 0.1, 0.05]), rel=1e-5)


def test_greedy_is_one_hot_and_takes_penalties_and_bias():
    settings = {"greedy": SamplingParams(temperature=0.0),
                "greedy+presence": SamplingParams(temperature=0.0, presence_penalty=1.0),
                "bias": SamplingParams(temperature=0.0, logit_bias={42: 2.0})}
    first, second = _bars(settings, step=0), _bars(settings, step=1)
    assert first["greedy"] == [1.0, 0.0, 0.0, 0.0] and first["greedy+presence"] == [1.0, 0.0, 0.0, 0.0]
    assert second["greedy+presence"] == [0.0, 1.0, 0.0, 0.0]                 # 0.5/e < 0.3
    assert first["bias"] == [0.0, 0.0, 1.0, 0.0]                            # 0.1 * e^2 > 0.5


@pytest.mark.parametrize("settings, top, match", [
    ({"rep": SamplingParams(repetition_penalty=1.2)}, 10, "repetition_penalty"),
    ({RAW_LABEL: SamplingParams()}, 10, "names the model's own distribution"),
    (None, 0, "top=0"),
])
def test_bad_requests_are_refused_clearly(settings, top, match):
    with pytest.raises(ValueError, match=match):
        sampling_data(_output(), settings, top=top)


def test_an_output_without_logprobs_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="logprobs=k"):
        sampling_data(CompletionOutput(index=0, text="", token_ids=[1]))


def test_figure_is_a_plain_figure_with_one_slider_step_per_token():
    import plotly.graph_objects as go
    settings = {"T=0.5": SamplingParams(temperature=0.5), "min_p": SamplingParams(temperature=1.0, min_p=0.3)}
    fig = sampling_figure(_output(), settings)
    assert type(fig) is go.Figure
    labels = 1 + len(settings)
    assert len(fig.data) == 3 * labels
    assert [bool(t.visible) for t in fig.data] == [k < labels for k in range(3 * labels)]
    slider = fig.layout.sliders[0]
    assert len(slider.steps) == 3
    for s, step in enumerate(slider.steps):
        assert step.args[0]["visible"] == [k // labels == s for k in range(3 * labels)]
    emitted = fig.data[2 * labels].marker.line.width               # step 2 emitted tok100, rank 2
    assert list(emitted) == [0, 2.5, 0, 0]
    assert "4 reported tokens, which hold 95%" in fig.layout.title.text
    assert "4 reported tokens" in slider.steps[2].args[1]["title.text"]
    fig.to_json()                                                   # serialisable: no widget state


def test_the_engines_own_logprobs_drive_the_view():
    llm = LLM("tiny-llama", num_blocks=16, block_size=8)
    out = llm.generate([1, 2, 3, 4], SamplingParams(max_tokens=5, temperature=0.0, logprobs=4, ignore_eos=True),
                       use_tqdm=False)[0]
    data = sampling_data(out, {"T=0.7": SamplingParams(temperature=0.7)}, top=3)
    completion = out.outputs[0]
    assert len(data["steps"]) == len(completion.token_ids) == 5
    for step, chosen, entries in zip(data["steps"], completion.token_ids, completion.logprobs):
        assert step["chosen"] == chosen == step["token_ids"][0]             # greedy emits rank 1
        assert step["bars"][RAW_LABEL] == pytest.approx(
            sorted((math.exp(lp.logprob) for lp in entries.values()), reverse=True)[:3])
        assert step["bars"]["T=0.7"][0] >= step["bars"][RAW_LABEL][0]       # a cooler top token
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_a_sampled_token_outside_the_top_k_is_shown_last_with_its_rank():
    entries = _entries(RAW)
    entries[9] = Logprob(math.log(0.01), 7, "tok9")                 # drawn by a random sampler
    out = CompletionOutput(index=0, text="", token_ids=[9], logprobs=[entries])
    step = sampling_data(out)["steps"][0]
    assert step["token_ids"] == [7, 100, 42, 3000, 9] and step["chosen_text"] == "tok9"
    assert step["rest"] == pytest.approx(0.04)
