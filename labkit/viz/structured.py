"""The grammar's view: at each step of a constrained generation, what the model wanted, which
tokens the grammar allowed, and which one was chosen.

``trace_grammar(llm, prompt, params)`` serves one request with ``structured_outputs`` on the
real engine and records, at every masked row, the model's raw logits and the grammar's
bitmask (through ``GrammarMatchers.observer``): nothing is recomputed beside the engine.
Each generated token becomes a ``GrammarStep``: how many of the vocabulary's tokens the
grammar allowed, the model's most likely tokens (allowed or not), how much of the model's
probability fell on allowed tokens, and whether the token was *jumped*: drafted by
jump-forward decoding and verified in a step that computed several tokens at once.

``grammar_data`` returns plain numbers (unit-testable); ``grammar_figure`` draws them as a
plain ``go.Figure`` with a slider over the steps (no widget state: it renders in a saved
notebook, on Colab and in exported HTML).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import _deps
from .colors import MUTED, TEXT

if TYPE_CHECKING:
    from ..sampling_params import SamplingParams

ALLOWED_COLOR = "#59a14f"
FORBIDDEN_COLOR = "#bab0ac"


@dataclass(slots=True)
class GrammarStep:
    """One generated token of a constrained request, as the engine's mask saw it."""

    position: int               # index of the generated token (0: the first)
    engine_step: int            # which iteration of the engine produced it (a jump gives several)
    chosen: int                 # the token emitted
    chosen_text: str
    text_before: str            # the output's text before it
    num_allowed: int            # tokens the grammar allowed here
    vocab_size: int
    p_allowed: float            # the model's raw probability of all the allowed tokens together
    top_ids: list[int]          # the model's most likely tokens, raw, most likely first
    top_texts: list[str]
    top_probs: list[float]      # their raw probabilities
    top_allowed: list[bool]     # whether the grammar allowed each
    allowed_texts: list[str]    # some allowed tokens, most likely first (all of them when few)
    jumped: bool                # drafted by jump-forward and verified, not sampled at a step of its own

    @property
    def forced(self) -> bool:
        """Whether the grammar left exactly one choice."""
        return self.num_allowed == 1


def trace_grammar(llm, prompt: str | list[int], params: "SamplingParams", top: int = 10,
                  show: int = 12) -> list[GrammarStep]:
    """Serve ``prompt`` with ``params`` (which must ask for ``structured_outputs``; sample 0 is
    traced) on ``llm``'s engine alone, step by step, and return one ``GrammarStep`` per token."""
    import torch

    from ..request import encode_prompt
    from ..structured.bitmask import unpack

    if getattr(params, "structured_outputs", None) is None:
        raise ValueError("trace_grammar shows a grammar's mask: give SamplingParams(structured_outputs=...)")
    engine = llm.engine
    if engine.has_unfinished:
        raise ValueError("trace_grammar runs its request alone: let the engine finish its requests first")
    grammars = engine.executor.grammars
    tokenizer = llm.tokenizer
    text, ids = encode_prompt(prompt, tokenizer)
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []     # (drafted tokens assumed, raw row, bitmask row)
    request_box = []

    def observe(rows, raw, bitmask):
        for i, r in enumerate(rows):
            if request_box and r.request is request_box[0] and r.index == 0:
                seen.append((len(r.assumed), raw[i], bitmask[i]))

    previous, grammars.observer = grammars.observer, observe
    steps: list[GrammarStep] = []
    try:
        request = engine.add_request(ids, params, prompt=text)
        request_box.append(request)
        seq = request.seqs[0]
        while not request.finished:
            before = seq.num_output_tokens
            seen.clear()
            engine.step()
            seq = request.seqs[0]
            gained = seq.num_output_tokens - before
            rows = sorted(seen, key=lambda item: item[0])[:gained]
            for k, (_, raw, bitmask) in enumerate(rows):
                position = before + k
                out = seq.output_token_ids
                probs = raw.softmax(-1)
                allowed = unpack(bitmask.reshape(1, -1), raw.shape[-1])[0]
                order = torch.argsort(probs, descending=True)
                top_ids = order[:top].tolist()
                allowed_ids = order[allowed[order]][:show].tolist()
                decode = (lambda t: tokenizer.decode([t]))
                steps.append(GrammarStep(
                    position=position, engine_step=engine.num_steps, chosen=out[position],
                    chosen_text=decode(out[position]),
                    text_before=tokenizer.decode(out[:position], skip_special_tokens=True),
                    num_allowed=int(allowed.sum()), vocab_size=raw.shape[-1],
                    p_allowed=float(probs[allowed].sum()), top_ids=top_ids,
                    top_texts=[decode(t) for t in top_ids], top_probs=probs[top_ids].tolist(),
                    top_allowed=allowed[top_ids].tolist(), allowed_texts=[decode(t) for t in allowed_ids],
                    jumped=k < gained - 1))
    finally:
        grammars.observer = previous
        if request_box:
            engine.release(request_box[0])
    return steps


def grammar_data(steps: list[GrammarStep]) -> dict:
    """The figure's numbers: ``{"steps": [{"position", "chosen_text", "text_before",
    "num_allowed", "vocab_size", "p_allowed", "forced", "jumped", "tokens", "probs",
    "allowed", "chosen_at", "allowed_texts"}]}`` and totals: ``num_forced``, ``num_jumped``."""
    out = []
    for s in steps:
        out.append({"position": s.position, "chosen_text": s.chosen_text, "text_before": s.text_before,
                    "num_allowed": s.num_allowed, "vocab_size": s.vocab_size, "p_allowed": s.p_allowed,
                    "forced": s.forced, "jumped": s.jumped, "tokens": list(s.top_texts), "probs": list(s.top_probs),
                    "allowed": list(s.top_allowed), "chosen_at": [t == s.chosen for t in s.top_ids],
                    "allowed_texts": list(s.allowed_texts)})
    return {"steps": out, "num_forced": sum(s.forced for s in steps), "num_jumped": sum(s.jumped for s in steps)}


def _short(text: str, limit: int = 70) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1):]


def grammar_figure(steps: list[GrammarStep], title: str = "What the grammar allows"):
    """Bars per step: the model's most likely tokens by raw probability, green where the grammar
    allows them and grey where it forbids them, the emitted token outlined; the title says how
    many tokens the grammar allowed, how much of the model's probability they held, and whether
    the token was forced or jumped; a slider walks the steps. Returns a ``go.Figure``."""
    go = _deps.go()
    data = grammar_data(steps)
    if not data["steps"]:
        raise ValueError("no generated token to show")
    fig = go.Figure()
    for i, s in enumerate(data["steps"]):
        fig.add_bar(
            x=list(range(1, len(s["tokens"]) + 1)), y=s["probs"], visible=i == 0, showlegend=False,
            marker={"color": [ALLOWED_COLOR if a else FORBIDDEN_COLOR for a in s["allowed"]],
                    "line": {"color": TEXT, "width": [2.5 if c else 0 for c in s["chosen_at"]]}},
            customdata=[[repr(t), "allowed" if a else "forbidden"] for t, a in zip(s["tokens"], s["allowed"])],
            hovertemplate="%{customdata[0]}: %{y:.3f} (%{customdata[1]})<extra></extra>")
    # Two legend entries drawn once, for the colours.
    for name, color in (("allowed by the grammar", ALLOWED_COLOR), ("forbidden (logit set to -inf)", FORBIDDEN_COLOR)):
        fig.add_bar(x=[None], y=[None], marker={"color": color}, name=name, showlegend=True)

    def layout_of(s: dict) -> dict:
        how = (" · jumped: drafted by jump-forward, verified in a step that computed several tokens"
               if s["jumped"] else " · forced: the only token allowed" if s["forced"] else "")
        allowed = ", ".join(repr(t) for t in s["allowed_texts"][:8]) + (", …" if s["num_allowed"] > 8 else "")
        return {"title.text": (f"{title}: token {s['position'] + 1}, {s['num_allowed']:,} of {s['vocab_size']:,} "
                               f"tokens allowed, holding {s['p_allowed']:.0%} of the model's probability{how}"
                               f"<br><sup>{_short(s['text_before'])!r} + <b>{s['chosen_text']!r}</b> · "
                               f"allowed: {allowed}</sup>"),
                "xaxis.tickvals": list(range(1, len(s["tokens"]) + 1)),
                "xaxis.ticktext": [repr(t) for t in s["tokens"]]}

    n = len(data["steps"])
    visible = lambda i: [k == i for k in range(n)] + [True, True]  # noqa: E731
    slider = [{"method": "update", "label": str(i + 1), "args": [{"visible": visible(i)}, layout_of(s)]}
              for i, s in enumerate(data["steps"])]
    first = layout_of(data["steps"][0])
    fig.update_layout(
        template="plotly_white", height=430, barmode="overlay",
        title={"text": first["title.text"], "font": {"size": 13}},
        xaxis={"tickvals": first["xaxis.tickvals"], "ticktext": first["xaxis.ticktext"], "tickangle": -30,
               "title": "the model's most likely tokens, raw (dark outline: the one emitted)"},
        yaxis={"title": "raw probability", "range": [0, 1]},
        legend={"orientation": "h", "y": 1.1, "x": 0},
        sliders=[{"active": 0, "steps": slider, "currentvalue": {"prefix": "token "}, "pad": {"t": 60},
                  "font": {"color": MUTED}}],
        margin={"t": 100, "b": 40})
    return fig
