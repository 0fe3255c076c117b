"""``LiveEngineWidget``: drive a real engine one iteration at a time and watch its KV blocks.

Buttons step the engine (or play it at a chosen speed), add a request, add an ``n = 2``
request (the scheduler forks it after its prefill), fork a running sequence by hand
(``fork_sequence``), and abort a request. Every change redraws the block view
(``blocks.py``) from the engine's own allocator and block tables, and a status line
says what the iteration did. Each iteration is also kept in a ``Recording``, so the
session can be replayed (``replay()``) or exported as a kernel-free animation
(``export_html``).

By default the engine is the real scheduler on a small pool with the simulator's executor
(instant, no model needed); pass any ``Engine`` (or an ``LLM``) to watch it instead, e.g.
one serving the real model: hovering a block then shows its tokens' text too. Importing
this module needs ipywidgets.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from . import _deps
from .blocks import block_figure_dict
from .fork import fork_sequence
from .pool import live_sequences, request_of, seq_label, status_line
from .replay import Recording

if TYPE_CHECKING:
    from ..engine import Engine
    from ..llm import LLM
    from ..request import Request

W = _deps.widgets()


def make_sim_engine(num_blocks: int = 32, block_size: int = 4, *, policy: str = "continuous",
                    max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                    enable_prefix_caching: bool = True, max_model_len: int | None = None) -> "Engine":
    """The real allocator and scheduler, with the simulator's executor: a small engine for
    watching (``policy``: ``"continuous"`` or ``"static"``)."""
    from ..engine import Engine
    from ..memory import BlockAllocator
    from ..scheduler import make_scheduler
    from ..sim import SimExecutor

    allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
    scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                               max_num_batched_tokens=max_num_batched_tokens, reserve="max_tokens")
    return Engine(scheduler, SimExecutor())


def _vocab_size(engine: "Engine") -> int:
    """How many token ids the engine's model knows (random prompts must stay below it)."""
    executor = engine.executor
    for owner in (executor, getattr(executor, "runner", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 10:
            return size
    return 32000


class LiveEngineWidget(W.VBox):
    """Controls + status line + block view over one engine (see the module docstring).

    Everything the buttons do is also a method (``step``, ``add_request``, ``fork``,
    ``abort``, ``select``), for notebook cells and tests. ``figure_widget``: True/False
    forces plotly's ``FigureWidget`` or the ``Output`` fallback; None picks what works.
    """

    def __init__(self, engine: "Engine | LLM | None" = None, *, num_blocks: int = 32, block_size: int = 4,
                 policy: str = "continuous", max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
                 enable_prefix_caching: bool = True, columns: int | None = None,
                 prompt_len: int = 10, max_tokens: int = 8, shared_prefix_len: int | None = None,
                 figure_widget: bool | None = None, seed: int = 0):
        from ._render import FigureView
        engine = getattr(engine, "engine", engine)     # an ``LLM``: watch the engine inside it
        if engine is None:
            engine = make_sim_engine(num_blocks, block_size, policy=policy, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens,
                                     enable_prefix_caching=enable_prefix_caching)
        self.engine = engine
        alloc = engine.scheduler.allocator
        self.recording = Recording(columns=columns)
        self.colors = self.recording.colors          # one colour per request, here and in replays
        self.selected: str | None = None
        self._rng = random.Random(seed)
        self._next_id = 0
        self._vocab = min(_vocab_size(engine), 32000)
        self.shared_prefix_len = shared_prefix_len or 2 * alloc.block_size
        tokenizer = getattr(engine, "tokenizer", None) or getattr(engine.executor, "tokenizer", None)
        self._token_text = tokenizer.decode if tokenizer is not None else None   # hover shows text
        self._busy = False
        self._syncing = False

        # Controls. Only widgets and traits that ipywidgets 7 and 8 both have.
        narrow = W.Layout(width="auto")
        self.step_button = W.Button(description="Step", tooltip="run one iteration", layout=narrow,
                                    button_style="primary")
        self.play = W.Play(value=0, min=0, max=10**9, step=1, interval=500, description="play",
                           show_repeat=False)
        self.speed = W.FloatSlider(value=2.0, min=0.5, max=10.0, step=0.5, description="steps/s",
                                   readout_format=".1f", layout=W.Layout(width="260px"))
        self.prompt_len = W.IntSlider(value=prompt_len, min=1, max=4 * 16, description="prompt",
                                      layout=W.Layout(width="260px"))
        self.max_tokens = W.IntSlider(value=max_tokens, min=1, max=64, description="max tokens",
                                      layout=W.Layout(width="260px"))
        self.shared_prefix = W.Checkbox(value=False, description="shared system prompt",
                                        indent=False, layout=narrow)
        self.add_button = W.Button(description="Add request", layout=narrow)
        self.add_n2_button = W.Button(description="Add n=2", tooltip="a request with two samples: "
                                      "forked after its prefill, sharing the prompt's blocks",
                                      layout=narrow)
        self.seq_select = W.Dropdown(options=[("(oldest running)", "")], value="",
                                     description="sequence", layout=W.Layout(width="240px"))
        self.fork_button = W.Button(description="Fork", tooltip="fork the chosen running sequence "
                                    "(copy-on-write)", layout=narrow)
        self.abort_button = W.Button(description="Abort", tooltip="abort the chosen sequence's request",
                                     button_style="warning", layout=narrow)
        self.status = W.HTML()
        self.message = W.HTML()
        self.view = FigureView(self._figure_dict(self._snapshot()), figure_widget)

        self.step_button.on_click(lambda _: self._safely(self.step))
        self.play.observe(self._on_play, names="value")
        self.speed.observe(lambda c: setattr(self.play, "interval", int(1000 / c["new"])), names="value")
        self.play.interval = int(1000 / self.speed.value)
        self.add_button.on_click(lambda _: self._safely(self.add_request))
        self.add_n2_button.on_click(lambda _: self._safely(self.add_request, n=2))
        self.fork_button.on_click(lambda _: self._safely(self.fork))
        self.abort_button.on_click(lambda _: self._safely(self.abort))
        self.seq_select.observe(self._on_select, names="value")

        super().__init__([
            W.HBox([self.step_button, self.play, self.speed]),
            W.HBox([self.prompt_len, self.max_tokens, self.shared_prefix, self.add_button,
                    self.add_n2_button]),
            W.HBox([self.seq_select, self.fork_button, self.abort_button, self.message]),
            self.status,
            self.view.widget,
        ])
        self.refresh()           # the first snapshot of the recording: the state before any step

    # ---- actions (the buttons call these) --------------------------------------------
    def step(self, n: int = 1) -> list["Request"]:
        """Run ``n`` iterations of the engine (fewer if it runs out of work); redraw."""
        finished: list[Request] = []
        for i in range(n):
            if not self.engine.has_unfinished:
                self._say("nothing to run: add a request")
                break
            finished += self.engine.step()
            if i < n - 1:
                self.recording.capture(self.engine)      # every iteration, for the replay
        self.refresh()
        return finished

    def add_request(self, prompt_len: int | None = None, max_tokens: int | None = None, n: int = 1,
                    shared_prefix: bool | None = None, prompt_token_ids: list[int] | None = None) -> str:
        """Queue a request (lengths default to the sliders); it joins at the next step.
        With ``shared_prefix`` its prompt starts with the same system prompt as every other
        such request, so prefix caching can share those blocks. Returns its id."""
        prompt_len = self.prompt_len.value if prompt_len is None else prompt_len
        max_tokens = self.max_tokens.value if max_tokens is None else max_tokens
        shared = self.shared_prefix.value if shared_prefix is None else shared_prefix
        if prompt_token_ids is None:
            head = [(7 * i + 3) % self._vocab for i in range(self.shared_prefix_len)] if shared else []
            prompt_token_ids = head[:prompt_len] + [self._rng.randrange(10, self._vocab)
                                                    for _ in range(prompt_len - len(head))]
        from ..sampling_params import SamplingParams
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0, ignore_eos=True)
        while f"r{self._next_id}" in self.engine.scheduler.requests:
            self._next_id += 1
        request = self.engine.add_request(list(prompt_token_ids), params, request_id=f"r{self._next_id}")
        self._next_id += 1
        self.refresh(record=False)
        self._say(f"added {request.request_id}: prompt {len(prompt_token_ids)}, "
                  f"max tokens {max_tokens}" + (f", n={n}" if n > 1 else ""))
        return request.request_id

    def fork(self, label: str | None = None) -> str:
        """Fork the running sequence ``label`` (default: the chosen one, else the oldest
        running) by ``BlockTable.fork``; the child shares its blocks copy-on-write."""
        label = label or self.selected or next((seq_label(s) for s in self.engine.scheduler.running), None)
        if label is None:
            raise ValueError("nothing is running to fork")
        child = fork_sequence(self.engine, label)
        self.selected = child
        self.refresh(event=f"fork {label} → {child}")
        self._say(f"forked {label} into {child}: they share every block until one writes")
        return child

    def abort(self, request_id: str | None = None) -> bool:
        """Abort a request (default: the chosen sequence's); its blocks are freed at once."""
        if request_id is None:
            if self.selected is None:
                raise ValueError("choose a sequence to abort")
            request_id = request_of(self.selected)
        done = self.engine.abort(request_id)
        if not done:
            raise ValueError(f"no unfinished request {request_id!r}")
        self.refresh(event=f"abort {request_id}")
        self._say(f"aborted {request_id}")
        return done

    def select(self, label: str | None) -> None:
        """Show the block table of sequence ``label`` (None: the oldest running)."""
        self.selected = label
        self.refresh(record=False)

    # ---- what is on screen --------------------------------------------------------------
    @property
    def figure_data(self) -> dict:
        """The plotly figure dict now on screen (plain data: what tests compare)."""
        return self.view.figure_dict

    @property
    def snapshot(self) -> dict:
        """The block-view snapshot now on screen."""
        return self._last_snapshot

    def refresh(self, record: bool = True, event: str | None = None) -> None:
        """Re-read the engine and redraw; ``record`` keeps the snapshot in the recording
        (``event`` says what happened if it was not an iteration: a fork, an abort)."""
        snap = self._snapshot()
        if event:
            snap["event"] = event
        if record:
            self.recording.append(snap)
        self._sync_choices()
        self.view.show(self._figure_dict(snap))
        self.status.value = self._status_html(snap)

    def replay(self, follow: str | None = None, **options):
        """A ``ReplayWidget`` over this session's recording."""
        from .replay_widget import ReplayWidget
        return ReplayWidget(self.recording, follow, **options)

    def export_html(self, path: str | Path, **options) -> Path:
        """This session as a kernel-free animation (see ``Recording.export_html``)."""
        return self.recording.export_html(path, **options)

    # ---- internals ---------------------------------------------------------------------
    def _snapshot(self) -> dict:
        from .pool import snapshot
        self._last_snapshot = snapshot(self.engine)
        return self._last_snapshot

    def _figure_dict(self, snap: dict) -> dict:
        # No title: the status line above the figure says it (replays and exports keep it).
        return block_figure_dict(snap, self.selected, columns=self.recording.columns, color=self.colors,
                                 title="", token_text=self._token_text)

    def _status_html(self, snap: dict) -> str:
        line = status_line(snap["status"])
        if snap.get("event"):
            line += f" · {snap['event']}"
        events = []
        records = self.engine.records
        if records and records[-1].step == self.engine.scheduler.step:
            rec = records[-1]
            if rec.ran:
                tokens = f"{rec.num_prefill_tokens} prefill + {rec.num_decode_tokens} decode tokens"
                events.append(f"ran {len(rec.ran)} sequences ({tokens})")
            if rec.num_cached_tokens:
                events.append(f"{rec.num_cached_tokens} prompt tokens from the prefix cache")
            if rec.num_copies:
                events.append(f"{rec.num_copies} copy-on-write block copies")
            if rec.preempted:
                events.append("<b style='color:#c0392b'>preempted " + ", ".join(rec.preempted) + "</b>")
            if rec.finished:
                events.append("finished " + ", ".join(rec.finished))
        html = f"<code>{line}</code>"
        if events:
            html += f"<br><span style='font-size:90%'>last iteration: {'; '.join(events)}</span>"
        return html

    def _sync_choices(self) -> None:
        """The sequence dropdown lists every unfinished request's sequences."""
        sched = self.engine.scheduler
        seqs = live_sequences(self.engine)
        seen = {id(s) for s in seqs}
        seqs += [s for s in sched.waiting if id(s) not in seen]
        options = [("(oldest running)", "")]    # "" not None: ipywidgets 8 shows None as no choice
        for s in seqs:
            options.append((f"{seq_label(s)} ({s.status.value})", seq_label(s)))
        if self.selected is not None and self.selected not in [v for _, v in options]:
            self.selected = None
        self._syncing = True
        try:
            if list(self.seq_select.options) != options:
                self.seq_select.options = options
            self.seq_select.value = self.selected or ""
        finally:
            self._syncing = False

    def _on_select(self, change) -> None:
        if not self._syncing:
            self._safely(self.select, change["new"] or None)

    def _on_play(self, change) -> None:
        if self._busy:
            return          # the previous tick is still drawing: skip this one
        self._busy = True
        try:
            self._safely(self.step)
        finally:
            self._busy = False

    def _safely(self, action, *args, **kwargs):
        """Run a button's action; show a ValueError (a refused action) instead of raising."""
        self._say("")
        try:
            return action(*args, **kwargs)
        except ValueError as e:
            self._say(str(e), error=True)
            return None

    def _say(self, text: str, error: bool = False) -> None:
        color = "#c0392b" if error else "#555"
        self.message.value = f"<span style='color:{color}'>{text}</span>" if text else ""
