"""The verifier's view: at each step of speculative decoding, what was guessed, what the target
kept, and which KV slots the guesses took and gave back.

``record_speculation(engine, prompts, params)`` serves requests on a speculating engine
(``speculative_config=...``) and collects what the engine's ``Speculator`` reports after every
step (``Speculator.observer``: one ``DraftOutcome`` per sequence that guessed): nothing is
recomputed beside the engine. ``speculation_data`` turns them into plain numbers and slot
states (unit-testable); ``speculation_text`` prints them as a table (the static view, for a
terminal or a saved notebook without plotly); ``speculation_figure`` draws one sequence's
last blocks while the step ran and after it settled, as a plain ``go.Figure`` with a slider
over the steps (no widget state: it renders in a saved notebook, on Colab and in exported HTML).
"""

from __future__ import annotations

from . import _deps
from .colors import MUTED, TEXT

#: What a slot holds, and its colour.
SLOT_COLORS = {
    "computed": "#d9d9d9",      # K/V of the text, from earlier steps
    "last": "#4e79a7",          # the token sampled last step: computed in this step
    "accepted": "#59a14f",      # a guess the target kept
    "rejected": "#e15759",      # a guess the target did not keep: its slot goes back
    "lookahead": "#f28e2b",     # a slot reserved for the next step's model draft
    "empty": "#ffffff",         # a slot of the block nobody uses (yet)
}
SLOT_NAMES = {"computed": "text (earlier steps)", "last": "last sampled token", "accepted": "guess kept",
              "rejected": "guess rejected (slot given back)", "lookahead": "lookahead (given back)",
              "empty": "free slot"}


def record_speculation(engine, prompts: list[list[int]], params) -> list["Stamped"]:
    """Serve ``prompts`` (token ids) with ``params`` on ``engine`` (which must speculate) to the
    end, and return every step's ``DraftOutcome``s in order, each as a ``Stamped`` that adds the
    engine step it came from (``.step``). The engine must have no unfinished requests."""
    spec = getattr(engine.executor, "speculator", None)
    if spec is None or getattr(engine.executor, "speculative_config", None) is None:
        raise ValueError("record_speculation needs an engine built with speculative_config=...")
    if engine.has_unfinished:
        raise ValueError("record_speculation runs its requests alone: let the engine finish its requests first")
    seen: list = []

    def observe(step) -> None:
        for outcome in step.outcomes:
            seen.append((step.step, outcome))

    previous, spec.observer = spec.observer, observe
    requests = []
    try:
        for i, ids in enumerate(prompts):
            requests.append(engine.add_request(list(ids), params, request_id=f"spec-{i}"))
        while engine.has_unfinished:
            engine.step()
    finally:
        spec.observer = previous
        for r in requests:
            engine.release(r)
    return [Stamped(step, o) for step, o in seen]


class Stamped:
    """A ``DraftOutcome`` with the engine step it came from (``DraftOutcome`` has slots)."""

    __slots__ = ("step", "outcome")

    def __init__(self, step: int, outcome) -> None:
        self.step, self.outcome = step, outcome

    def __getattr__(self, name: str):
        return getattr(self.outcome, name)


def _slots(o) -> tuple[list[str], list[str]]:
    """The states of every slot of the blocks the sequence held while the step ran, and after."""
    bs, first, d = o.block_size, o.first_position, len(o.drafted)
    during_len = len(o.blocks_during) * bs
    filled = first + d + o.lookahead

    def state_during(p: int) -> str:
        if p < first - 1:
            return "computed"
        if p == first - 1:
            return "last"
        if p < first + o.accepted:
            return "accepted"
        if p < first + d:
            return "rejected"
        return "lookahead" if p < filled else "empty"

    during = [state_during(p) for p in range(during_len)]
    after_len = len(o.blocks_after) * bs
    after = ["computed" if p < first - 1 else "last" if p == first - 1 else "accepted"
             if p < first + o.accepted else "empty" for p in range(after_len)]
    return during, after


def speculation_data(outcomes, tokenizer=None) -> dict:
    """The view's numbers: ``{"steps": [{"step", "request_id", "index", "proposer", "guesses"
    (texts, or ids as strings without a tokenizer), "accepted", "token", "blocks_during",
    "blocks_after", "block_size", "slots_during", "slots_after", "slots_given_back",
    "blocks_given_back"}]}`` and totals: ``num_guessed``, ``num_accepted``, ``acceptance_rate``."""
    decode = (lambda t: tokenizer.decode([t])) if tokenizer is not None else (lambda t: str(t))
    out = []
    for o in outcomes:
        during, after = _slots(o)
        out.append({"step": getattr(o, "step", None), "request_id": o.request_id, "index": o.index,
                    "proposer": o.proposer, "guesses": [decode(t) for t in o.drafted], "accepted": o.accepted,
                    "token": None if o.token is None else decode(o.token),
                    "first_position": o.first_position, "blocks_during": list(o.blocks_during),
                    "blocks_after": list(o.blocks_after), "block_size": o.block_size,
                    "slots_during": during, "slots_after": after, "slots_given_back": o.slots_given_back,
                    "blocks_given_back": len(set(o.blocks_during) - set(o.blocks_after))})
    guessed = sum(len(s["guesses"]) for s in out)
    accepted = sum(s["accepted"] for s in out)
    return {"steps": out, "num_guessed": guessed, "num_accepted": accepted,
            "acceptance_rate": accepted / guessed if guessed else 0.0}


def speculation_text(outcomes, tokenizer=None, limit: int | None = None) -> str:
    """One line per sequence-step: guesses (kept ones in [brackets]), the step's own token, the
    blocks held while verifying and after, and the slots given back. The static view."""
    data = speculation_data(outcomes, tokenizer)
    lines = ["step  request   guesses (kept in [ ])                          token      blocks   slots back"]
    for s in data["steps"][:limit]:
        shown = " ".join(f"[{g!r}]" if j < s["accepted"] else repr(g) for j, g in enumerate(s["guesses"]))
        lines.append(f"{s['step'] if s['step'] is not None else '':>4}  {s['request_id']:<8}  {shown[:46]:<46} "
                     f"{s['token']!r:<10} {len(s['blocks_during']):>2} -> {len(s['blocks_after']):<2}  "
                     f"{s['slots_given_back']:>4}")
    lines.append(f"{data['num_accepted']} of {data['num_guessed']} guesses kept ({data['acceptance_rate']:.0%})")
    return "\n".join(lines)


def speculation_figure(outcomes, tokenizer=None, request_id: str | None = None, last_blocks: int = 3,
                       title: str = "Guess, verify, give back"):
    """One sequence's last ``last_blocks`` blocks at each step that guessed: top row while the
    step ran (the last sampled token, the kept and rejected guesses, each in its slot), bottom
    row after it settled (rejected slots free, a block left empty back in the pool); a slider
    walks the steps. ``request_id``: the sequence to show (default: the first that guessed).
    Returns a ``go.Figure``."""
    go = _deps.go()
    data = speculation_data(outcomes, tokenizer)
    steps = [s for s in data["steps"] if s["guesses"]]
    if request_id is not None:
        steps = [s for s in steps if s["request_id"] == request_id]
    elif steps:
        steps = [s for s in steps if (s["request_id"], s["index"]) == (steps[0]["request_id"], steps[0]["index"])]
    if not steps:
        raise ValueError("no step with guesses to show")
    fig = go.Figure()
    guess_text = {}
    for i, s in enumerate(steps):
        bs = s["block_size"]
        start_block = max(0, len(s["blocks_during"]) - last_blocks)
        xs, ys, colors, texts, hovers = [], [], [], [], []
        for row, (slots, blocks) in enumerate(((s["slots_during"], s["blocks_during"]),
                                               (s["slots_after"], s["blocks_after"]))):
            for b in range(start_block, len(blocks)):
                for j in range(bs):
                    p = b * bs + j
                    state = slots[p] if p < len(slots) else "empty"
                    xs.append((b - start_block) * (bs + 1) + j)
                    ys.append(1 - row)
                    colors.append(SLOT_COLORS[state])
                    k = p - s["first_position"]
                    texts.append(s["guesses"][k][:6] if 0 <= k < len(s["guesses"]) and
                                 state in ("accepted", "rejected") else "")
                    hovers.append(f"block {blocks[b]}, slot {j}: {SLOT_NAMES[state]}")
        fig.add_scatter(x=xs, y=ys, mode="markers+text", visible=i == 0, showlegend=False, text=texts,
                        textfont={"size": 10, "color": TEXT}, hovertext=hovers, hoverinfo="text",
                        marker={"symbol": "square", "size": 34, "color": colors, "line": {"color": MUTED, "width": 1}})
        guess_text[i] = s
    for state, color in SLOT_COLORS.items():
        fig.add_scatter(x=[None], y=[None], mode="markers", name=SLOT_NAMES[state],
                        marker={"symbol": "square", "size": 12, "color": color, "line": {"color": MUTED, "width": 1}})

    def title_of(s: dict) -> str:
        kept = " ".join(f"<b>{g!r}</b>" if j < s["accepted"] else f"<s>{g!r}</s>" for j, g in enumerate(s["guesses"]))
        return (f"{title}: step {s['step']}, {s['accepted']} of {len(s['guesses'])} guesses kept, then "
                f"{s['token']!r}; {s['slots_given_back']} slots and {s['blocks_given_back']} blocks given back"
                f"<br><sup>{kept}</sup>")

    n = len(steps)
    visible = lambda i: [k == i for k in range(n)] + [True] * len(SLOT_COLORS)  # noqa: E731
    slider = [{"method": "update", "label": str(s["step"]), "args": [{"visible": visible(i)},
                                                                    {"title.text": title_of(s)}]}
              for i, s in enumerate(steps)]
    fig.update_layout(
        template="plotly_white", height=330, title={"text": title_of(steps[0]), "font": {"size": 13}},
        xaxis={"visible": False}, yaxis={"tickvals": [1, 0], "ticktext": ["while verifying", "after"],
                                         "range": [-0.7, 1.7]},
        legend={"orientation": "h", "y": -0.15, "x": 0},
        sliders=[{"active": 0, "steps": slider, "currentvalue": {"prefix": "engine step "}, "pad": {"t": 40},
                  "font": {"color": MUTED}}],
        margin={"t": 90, "b": 40})
    return fig
