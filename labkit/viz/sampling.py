"""The sampler's view: what the model proposed at each step of a generation, and what sampling
settings make of it.

The data are the engine's own log-probabilities (``SamplingParams(logprobs=k)``): at every
generated position, the model's RAW distribution over its k most likely tokens. Each
setting (a ``SamplingParams``: temperature, top-k, top-p, min-p, presence and frequency
penalties, logit bias) is applied to those tokens by labkit's own sampler
(``labkit.model.sampler.apply_penalties`` and ``probabilities``), so the bars show what the
engine would draw from, not a second implementation of it.

What the view can and cannot show, since it sees only the k reported tokens:

* temperature and min-p are exact: both depend only on differences of logits, and the
  reported tokens are the most likely ones;
* the processed probabilities are renormalised over the reported tokens, as if the
  vocabulary were those k; when the unreported tail holds much mass (``rest``, shown in
  the title), top-p and the final normalisation differ from the full-vocabulary ones;
* presence and frequency penalties and ``logit_bias`` are exact for the tokens shown, but a
  token outside them that a negative penalty or a positive bias would raise is not shown;
* the repetition penalty is refused: it divides positive logits and multiplies negative
  ones, and log-probabilities do not keep the sign of the logits.

``sampling_data`` returns plain numbers (unit-testable); ``sampling_figure`` draws them as a
plain ``go.Figure`` with a slider over the steps (no widget state: it renders in a saved
notebook, on Colab and in exported HTML).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from . import _deps
from .colors import MUTED, PALETTE, TEXT

if TYPE_CHECKING:
    from ..outputs import CompletionOutput, RequestOutput
    from ..sampling_params import SamplingParams

RAW_LABEL = "model (raw)"
RAW_COLOR = "#4e79a7"


@dataclass(slots=True)
class StepView:
    """One generated position as the engine reported it: its tokens, most likely first."""

    position: int              # index of the generated token (0: the first one)
    chosen: int                # the token the engine emitted there
    token_ids: list[int]       # the reported tokens, by rank (the chosen one included)
    texts: list[str]           # their text (the id as a string when no tokenizer decoded it)
    logprobs: list[float]      # the model's log-probabilities of them, as the engine reported
    raw: list[float]           # the model's probabilities, exp(logprob)
    rest: float                # the probability of every token not reported


def _completion(output: "RequestOutput | CompletionOutput") -> "CompletionOutput":
    completion = output.outputs[0] if hasattr(output, "outputs") else output
    if getattr(completion, "logprobs", None) is None:
        raise ValueError("this output has no logprobs: generate it with SamplingParams(logprobs=k), "
                         "k between 1 and 20, to see the distribution at each step")
    return completion


def steps(output: "RequestOutput | CompletionOutput") -> list[StepView]:
    """One ``StepView`` per generated token of ``output`` (a ``RequestOutput``: its first
    sample; or one ``CompletionOutput``), read from its logprobs."""
    import math

    completion = _completion(output)
    views = []
    for position, (chosen, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
        ranked = sorted(entries.items(), key=lambda item: (item[1].rank, item[0]))
        raw = [math.exp(lp.logprob) for _, lp in ranked]
        views.append(StepView(position=position, chosen=chosen, token_ids=[t for t, _ in ranked],
                              texts=[lp.decoded_token if lp.decoded_token is not None else str(t)
                                     for t, lp in ranked],
                              logprobs=[lp.logprob for _, lp in ranked],
                              raw=raw, rest=max(0.0, 1.0 - sum(raw))))
    return views


def reshape(view: StepView, params: "SamplingParams", generated: Sequence[int] = ()) -> list[float]:
    """The probabilities with which ``params`` draws each of ``view``'s tokens, renormalised
    over them, given the tokens ``generated`` before this step (for the penalties); computed
    by labkit's sampler. A greedy ``params`` puts all the mass on the argmax."""
    import torch

    from ..model.sampler import PenaltyRow, SamplingRow, apply_penalties, probabilities
    if params.repetition_penalty != 1.0:
        raise ValueError("SamplingParams.repetition_penalty cannot be shown from logprobs: it divides "
                         "positive logits and multiplies negative ones, and logprobs do not keep the "
                         "logits' sign. Use presence_penalty or frequency_penalty here.")
    # A vocabulary row where only the reported tokens are possible: the sampler then works on
    # exactly the distribution the engine reported, renormalised over it.
    vocab = max([*view.token_ids, *generated]) + 1
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, view.token_ids] = torch.tensor(view.logprobs)
    if params.presence_penalty or params.frequency_penalty or params.logit_bias:
        logits = apply_penalties(logits, [PenaltyRow(
            token_ids=list(generated), num_prompt_tokens=0, presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias)])
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs[0, int(logits.argmax())] = 1.0
    else:
        probs = probabilities(logits, [SamplingRow(temperature=params.temperature, top_p=params.top_p,
                                                   top_k=params.top_k, min_p=params.min_p)])
    return probs[0, view.token_ids].tolist()


def sampling_data(output: "RequestOutput | CompletionOutput",
                  settings: Mapping[str, "SamplingParams"] | None = None, top: int = 10) -> dict:
    """The figure's numbers: ``{"labels": [RAW_LABEL, *settings], "steps": [{"position",
    "chosen", "chosen_text", "tokens", "token_ids", "reported", "rest", "bars": {label: [p, ...]}}]}``,
    each step's ``top`` most likely reported tokens (``reported``: how many the engine
    reported, over which the settings' bars are renormalised; ``rest``: the raw mass
    beyond them). Each setting is applied with the tokens the output generated before that
    step (so penalties grow as the text repeats itself)."""
    if not isinstance(top, int) or top < 1:
        raise ValueError(f"top={top!r}: must be an integer >= 1 (how many tokens to draw per step)")
    settings = dict(settings or {})
    if RAW_LABEL in settings:
        raise ValueError(f"{RAW_LABEL!r} names the model's own distribution; pick another label")
    completion = _completion(output)
    data = {"labels": [RAW_LABEL, *settings], "steps": []}
    for view in steps(completion):
        generated = completion.token_ids[:view.position]
        bars = {RAW_LABEL: view.raw[:top]}
        for label, params in settings.items():
            bars[label] = reshape(view, params, generated)[:top]
        data["steps"].append({
            "position": view.position, "chosen": view.chosen,
            "chosen_text": view.texts[view.token_ids.index(view.chosen)],
            "tokens": view.texts[:top], "token_ids": view.token_ids[:top], "reported": len(view.token_ids),
            "rest": view.rest,
            "bars": bars,
        })
    return data


def sampling_figure(output: "RequestOutput | CompletionOutput",
                    settings: Mapping[str, "SamplingParams"] | None = None, top: int = 10,
                    title: str = "What the sampler draws from"):
    """Grouped bars per step: the model's top-``top`` tokens (raw probabilities) and what
    each of ``settings`` ({label: SamplingParams}) makes of them; a slider walks the steps,
    and the token the engine emitted has a dark outline. Returns a ``go.Figure``."""
    go = _deps.go()
    data = sampling_data(output, settings, top)
    labels, nsteps = data["labels"], len(data["steps"])
    if nsteps == 0:
        raise ValueError("this output generated no tokens: nothing to show")
    fig = go.Figure()
    for s, step in enumerate(data["steps"]):
        ranks = list(range(1, len(step["tokens"]) + 1))
        chosen_at = [t == step["chosen"] for t in step["token_ids"]]
        for j, label in enumerate(labels):
            fig.add_bar(
                x=ranks, y=step["bars"][label], name=label, legendgroup=label, showlegend=s == 0,
                visible=s == 0, offsetgroup=str(j),
                marker={"color": RAW_COLOR if j == 0 else PALETTE[(j - 1) % len(PALETTE)],
                        "line": {"color": TEXT, "width": [2.5 if c else 0 for c in chosen_at]}},
                customdata=[repr(t) for t in step["tokens"]],
                hovertemplate=f"{label}<br>%{{customdata}}: %{{y:.3f}}<extra></extra>")
    per_step = len(labels)

    def layout_of(step: dict) -> dict:
        return {"title.text": (f"{title}: step {step['position'] + 1} of {nsteps}, the engine emitted "
                               f"{step['chosen_text']!r}<br><sup>settings renormalised over the "
                               f"{step['reported']} reported tokens, which hold {1 - step['rest']:.0%} "
                               "of the model's probability</sup>"),
                "xaxis.tickvals": list(range(1, len(step["tokens"]) + 1)),
                "xaxis.ticktext": [repr(t) for t in step["tokens"]]}

    slider_steps = [{"method": "update", "label": str(s + 1),
                     "args": [{"visible": [k // per_step == s for k in range(nsteps * per_step)]},
                              layout_of(step)]}
                    for s, step in enumerate(data["steps"])]
    first = layout_of(data["steps"][0])
    fig.update_layout(
        barmode="group", template="plotly_white", height=420,
        title={"text": first["title.text"], "font": {"size": 13}},
        xaxis={"tickvals": first["xaxis.tickvals"], "ticktext": first["xaxis.ticktext"], "tickangle": -30,
               "title": "reported tokens, most likely first (dark outline: the one emitted)"},
        yaxis={"title": "probability", "range": [0, 1]},
        legend={"orientation": "h", "y": 1.08, "x": 0},
        sliders=[{"active": 0, "steps": slider_steps, "currentvalue": {"prefix": "step "},
                  "pad": {"t": 60}, "font": {"color": MUTED}}],
        margin={"t": 90, "b": 40})
    return fig
