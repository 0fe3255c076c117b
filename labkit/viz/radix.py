"""The radix view: SGLang's radix tree of cached prefixes, drawn as requests arrive and finish.

With ``enable_prefix_caching="radix"`` the allocator keeps its cached prefixes in a radix tree
(``labkit.memory.RadixTree``, reachable as ``allocator.radix``): each edge is a run of tokens,
a whole number of KV blocks long, and a path from the root spells a cached prefix. This view
draws that tree from the real allocator, never from a model of its own:

* one marker per node, at the depth (in blocks) where its tokens end, joined to its parent;
  the edge's length is the node's number of blocks;
* a node held by running sequences (reference count > 0) is blue; an unreferenced one is
  pale yellow (cached-free: reusable, and evictable once it is a leaf);
* each node says its hits (``h``: times a request matched it) and references (``r``);
* the **next victim** (the least recently used unreferenced leaf, ``tree.evictable_leaves()[0]``)
  has a red ring; the figure's title counts evictions so far.

Hovering a node shows its tokens, blocks, hits, references and last access.

``radix_data`` returns the plain data (tested against the tree), ``radix_figure_dict`` a plotly
figure dict (no plotly import), ``radix_figure`` a ``go.Figure``. ``RadixTreeWidget`` drives a
small engine (the real scheduler and allocator, the simulator's executor) with buttons for the
workloads where a radix tree shines: new chats sharing a system prompt, a chat's next turn,
and branches of one conversation. Importing this module needs ipywidgets (as ``live``); the
figure functions import plotly only when they build a ``go.Figure``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..utils import cdiv
from . import _deps
from . import colors as C
from .blocks import _quoted as quoted, _tokens_text as block_tokens_text
from .live import LiveEngineWidget, _vocab_size, make_sim_engine

if TYPE_CHECKING:
    from ..engine import Engine
    from ..llm import LLM
    from ..request import Request

HELD = "#4e79a7"
HELD_LINE = "#2b4a6b"
VICTIM = "#e15759"
ROOT = "#bbbbbb"

# Trace order: fixed, so that a FigureWidget can be updated trace by trace.
EDGES, NODES, RING = 0, 1, 2


@dataclass(slots=True)
class NodeView:
    """One node of the tree as drawn: where, what it holds, and its cache state."""

    key: str                   # "root", or "n<node id>" (the tree numbers nodes as it creates them)
    parent: str | None
    x: float
    depth: int                 # blocks from the root to the end of this node
    num_tokens: int
    block_ids: list[int]
    token_ids: tuple[int, ...]
    hit_count: int
    ref_count: int
    last_access: int
    evict_rank: int | None     # position in the eviction order (0: next victim), None if not evictable


def radix_tree_of(source) -> object:
    """The radix tree behind ``source``: a tree, an allocator, a scheduler, an engine or an LLM.
    ``ValueError`` when its prefix caching is not the radix policy."""
    if hasattr(source, "evictable_leaves"):
        return source
    for attr in ("engine", "scheduler", "allocator"):
        inner = getattr(source, attr, None)
        if inner is not None and not isinstance(inner, (bool, str)):
            return radix_tree_of(inner)
    tree = getattr(source, "radix", None)
    if tree is None:
        policy = getattr(source, "enable_prefix_caching", None)
        raise ValueError(f"no radix tree here (prefix caching is {policy!r}): build the engine or "
                         "allocator with enable_prefix_caching='radix'")
    return tree


def radix_data(tree) -> list[NodeView]:
    """Every node of ``tree`` (pre-order, root first) with a tidy layout: leaves side by side,
    a parent centred over its children."""
    order = list(tree.nodes())
    ranks = {id(node): k for k, node in enumerate(tree.evictable_leaves())}
    keys: dict[int, str] = {}
    depth: dict[int, int] = {}
    xs: dict[int, float] = {}
    next_leaf = [0]

    def place(node) -> float:            # post-order: children first, leaves numbered left to right
        kids = list(node.children.values())
        if not kids:
            x = float(next_leaf[0])
            next_leaf[0] += 1
        else:
            x = sum(place(k) for k in kids) / len(kids)
        xs[id(node)] = x
        return x

    place(tree.root)
    views = []
    for node in order:                   # pre-order: a parent before its children
        parent = node.parent
        keys[id(node)] = "root" if parent is None else f"n{node.id}"
        depth[id(node)] = 0 if parent is None else depth[id(parent)] + len(node.block_ids)
        views.append(NodeView(
            key=keys[id(node)], parent=None if parent is None else keys[id(parent)], x=xs[id(node)],
            depth=depth[id(node)], num_tokens=len(node.token_ids), block_ids=list(node.block_ids),
            token_ids=tuple(node.token_ids), hit_count=node.hit_count,
            ref_count=0 if parent is None else tree.ref_count(node), last_access=node.last_access,
            evict_rank=ranks.get(id(node))))
    return views


def _tokens_text(tokens: tuple[int, ...], token_text: Callable[[list[int]], str] | None) -> str:
    """The ids (the first few), and their text in quotes when a decoder is given (as the block view)."""
    text = block_tokens_text(tokens)
    return f"{text}<br>{quoted(token_text, tokens)}" if token_text is not None and tokens else text


def radix_figure_dict(source, title: str | None = None,
                      token_text: Callable[[list[int]], str] | None = None, height: int = 420,
                      show_victim: bool = True) -> dict:
    """The tree of ``source`` (see ``radix_tree_of``) as a plotly figure dict: three traces,
    always in the order EDGES, NODES, RING (the next victim's ring, empty when nothing is
    evictable). ``show_victim=False`` leaves out the ring and the eviction order (for an
    exercise that asks for it); hits, references and last accesses still show."""
    tree = radix_tree_of(source)
    views = radix_data(tree)
    by_key = {v.key: v for v in views}
    ex, ey = [], []
    for v in views:
        if v.parent is not None:
            p = by_key[v.parent]
            ex += [p.x, p.x, v.x, None]         # a short drop below the parent, then to the child
            ey += [-p.depth, -p.depth - 0.35, -v.depth, None]
    fills, lines, texts, hovers, sizes = [], [], [], [], []
    for v in views:
        if v.parent is None:
            fills.append(ROOT)
            lines.append(ROOT)
            texts.append("root")
            hovers.append(f"root<br>{len(views) - 1} cached nodes")
            sizes.append(12)
            continue
        held = v.ref_count > 0
        fills.append(HELD if held else C.CACHED_FREE)
        lines.append(HELD_LINE if held else C.CACHED_FREE_LINE)
        texts.append(f"{len(v.block_ids)}b h{v.hit_count} r{v.ref_count}")
        state = ("held by running sequences" if held else
                 "inner node: evictable once its children are gone" if v.evict_rank is None else
                 f"evictable leaf (#{v.evict_rank + 1} in eviction order)" if show_victim else "evictable leaf")
        hovers.append(f"<b>{len(v.block_ids)} blocks, {v.num_tokens} tokens</b><br>"
                      f"tokens {_tokens_text(v.token_ids, token_text)}<br>blocks {v.block_ids}<br>"
                      f"hits {v.hit_count} · refs {v.ref_count} · last access {v.last_access}<br>{state}")
        sizes.append(16 + 3 * min(len(v.block_ids), 6))
    victim = next((v for v in views if v.evict_rank == 0), None) if show_victim else None
    evictions = getattr(tree, "num_evictions", 0)
    if title is None:
        title = (f"radix tree: {len(views) - 1} nodes, "
                 f"{sum(len(v.block_ids) for v in views)} cached blocks · evictions {evictions}"
                 + (f" · next victim: blocks {victim.block_ids}" if victim else ""))
    max_depth = max(v.depth for v in views)
    ticks = range(0, max_depth + 1, cdiv(max_depth + 1, 12))     # a dozen labels at most
    xs = [v.x for v in views]
    return {
        "data": [
            {"type": "scatter", "mode": "lines", "x": ex, "y": ey, "hoverinfo": "skip",
             "line": {"color": "#999999", "width": 2}, "showlegend": False, "name": "edges"},
            {"type": "scatter", "mode": "markers+text", "x": xs, "y": [-v.depth for v in views],
             "text": texts, "textposition": "middle right", "hovertext": hovers, "hoverinfo": "text",
             "customdata": [v.key for v in views],
             "marker": {"color": fills, "size": sizes, "line": {"color": lines, "width": 2}},
             "textfont": {"size": 11, "color": C.TEXT}, "showlegend": False, "name": "nodes"},
            {"type": "scatter", "mode": "markers", "x": [victim.x] if victim else [],
             "y": [-victim.depth] if victim else [], "hoverinfo": "skip", "showlegend": False,
             "marker": {"symbol": "circle-open", "size": 34, "color": VICTIM, "line": {"width": 3}},
             "name": "next victim"},
        ],
        "layout": {
            "title": {"text": title, "font": {"size": 13}},
            "height": height, "margin": {"l": 20, "r": 20, "t": 40, "b": 30},
            "xaxis": {"visible": False, "range": [min(xs) - 0.6, max(xs) + 1.4]},
            "yaxis": {"title": {"text": "prefix length (blocks)"}, "zeroline": False,
                      "range": [-max_depth - 0.8, 0.8],
                      "tickvals": [-d for d in ticks], "ticktext": [str(d) for d in ticks]},
            "plot_bgcolor": "white", "showlegend": False,
        },
    }


def radix_figure(source, **options):
    """``radix_figure_dict`` as a ``go.Figure`` (call ``.show()``)."""
    return _deps.go().Figure(radix_figure_dict(source, **options))


def make_radix_engine(num_blocks: int = 24, block_size: int = 4, *, max_num_seqs: int = 8,
                      max_num_batched_tokens: int = 32) -> "Engine":
    """The real allocator (radix prefix cache) and scheduler, with the simulator's executor."""
    return make_sim_engine(num_blocks, block_size, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching="radix")


W = _deps.widgets()


class RadixTreeWidget(W.VBox):
    """Buttons that send chat-like requests to a small engine with the radix prefix cache,
    a status line, and the tree redrawn after every action.

    * **New chat**: a new conversation: the shared system prompt, then a user message;
    * **Next turn**: the chosen finished chat comes back with its whole history (prompt and
      answer) plus a new message: the tree's path for that chat grows;
    * **Branch ×k**: k requests that continue the chosen chat's history differently
      (self-consistency, tree-of-thought): the path forks;
    * **Step** / **play**: run the engine one iteration at a time; **Run to idle**.

    Everything the buttons do is a method (``new_chat``, ``next_turn``, ``branch``,
    ``step``, ``run``), for cells and tests. A small pool forces evictions: watch the
    ringed next victim go. ``engine``: any engine (or ``LLM``) whose allocator uses the radix
    policy, e.g. one serving the real model, whose hover then shows the tokens' text (default:
    ``make_radix_engine(num_blocks, block_size)``).
    """

    def __init__(self, engine: "Engine | LLM | None" = None, *, num_blocks: int = 24, block_size: int = 4,
                 system_prompt_len: int = 8, message_len: tuple[int, int] = (3, 9), max_tokens: int = 6,
                 figure_widget: bool | None = None, seed: int = 0):
        from ._render import FigureView
        engine = getattr(engine, "engine", engine)
        self.engine = engine if engine is not None else make_radix_engine(num_blocks, block_size)
        self.tree = radix_tree_of(self.engine)
        tokenizer = getattr(self.engine, "tokenizer", None) or getattr(self.engine.executor, "tokenizer", None)
        self._token_text = tokenizer.decode if tokenizer is not None else None   # hover shows text
        if message_len[0] < 1 or message_len[1] < message_len[0]:
            raise ValueError(f"message_len must be (low, high) with 1 <= low <= high, got {message_len}")
        self.message_len = message_len
        self.max_tokens = max_tokens
        self._rng = random.Random(seed)
        vocab = min(_vocab_size(self.engine), 32000)
        self._vocab = vocab
        self.system_prompt = [(7 * i + 3) % vocab for i in range(system_prompt_len)]
        self.chats: dict[str, list["Request"]] = {}    # chat name -> its requests, in turn order
        self._next_request = 0
        self._busy = False

        narrow = W.Layout(width="auto")
        self.step_button = W.Button(description="Step", button_style="primary", layout=narrow,
                                    tooltip="run one iteration")
        self.play = W.Play(value=0, min=0, max=10**9, step=1, interval=600, description="play",
                           show_repeat=False)
        self.run_button = W.Button(description="Run to idle", layout=narrow,
                                   tooltip="step until every request has finished")
        self.new_button = W.Button(description="New chat", layout=narrow,
                                   tooltip="system prompt + a new user message")
        self.chat_select = W.Dropdown(options=[("(no chat yet)", "")], value="", description="chat",
                                      layout=W.Layout(width="200px"))
        self.turn_button = W.Button(description="Next turn", layout=narrow,
                                    tooltip="the chosen chat's history + a new message")
        self.branch_k = W.BoundedIntText(value=3, min=2, max=6, description="k",
                                         style={"description_width": "16px"}, layout=W.Layout(width="90px"))
        self.branch_button = W.Button(description="Branch", layout=narrow,
                                      tooltip="k continuations of the chosen chat's history")
        self.status = W.HTML()
        self.message = W.HTML()
        self.view = FigureView(self._figure_dict(), figure_widget)

        self.step_button.on_click(lambda _: self._safely(self.step))
        self.play.observe(self._on_play, names="value")
        self.run_button.on_click(lambda _: self._safely(self.run))
        self.new_button.on_click(lambda _: self._safely(self.new_chat))
        self.turn_button.on_click(lambda _: self._safely(self.next_turn))
        self.branch_button.on_click(lambda _: self._safely(self.branch, None, self.branch_k.value))
        super().__init__([
            W.HBox([self.step_button, self.play, self.run_button]),
            W.HBox([self.new_button, self.chat_select, self.turn_button, self.branch_k,
                    self.branch_button, self.message]),
            self.status,
            self.view.widget,
        ])
        self.refresh()

    # ---- actions -----------------------------------------------------------------
    def step(self, n: int = 1) -> list[str]:
        """Run ``n`` iterations (fewer when the engine runs out of work); redraw. Returns
        the ids of the requests that finished."""
        before = self.tree.num_evictions
        finished = []
        for _ in range(n):
            if not self.engine.has_unfinished:
                self._say("nothing to run: start a chat")
                break
            finished += [r.request_id for r in self.engine.step()]
        self.refresh(evicted=self.tree.num_evictions - before)
        return finished

    def run(self, max_steps: int = 1000) -> list[str]:
        """Step until no request is left (at most ``max_steps`` iterations)."""
        before = self.tree.num_evictions
        finished = []
        for _ in range(max_steps):
            if not self.engine.has_unfinished:
                break
            finished += [r.request_id for r in self.engine.step()]
        self.refresh(evicted=self.tree.num_evictions - before)
        return finished

    def new_chat(self, message_len: int | None = None) -> str:
        """Start a conversation: the system prompt, then a fresh user message. Returns its
        name ("chat0", ...)."""
        name = f"chat{len(self.chats)}"
        self.chats[name] = [self._submit(self.system_prompt + self._message(message_len))]
        self._say(f"{name}: system prompt ({len(self.system_prompt)} tokens) + a new message")
        self.refresh(record_choice=name)
        return name

    def next_turn(self, chat: str | None = None, message_len: int | None = None) -> str:
        """The chat's next turn: its last request's prompt and answer, then a new message.
        The chat's last request must have finished (its answer is part of the history)."""
        chat = self._chat(chat)
        history = self._history(chat)
        request = self._submit(history + self._message(message_len))
        self.chats[chat].append(request)
        self._say(f"{chat}, turn {len(self.chats[chat])}: {len(history)} tokens of history + a new message")
        self.refresh(record_choice=chat)
        return request.request_id

    def branch(self, chat: str | None = None, k: int = 3, message_len: int | None = None) -> list[str]:
        """``k`` requests continuing the chat's history with different messages (a branching
        program: the same context, k ways on). Each becomes a chat of its own."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        chat = self._chat(chat)
        history = self._history(chat)
        ids = []
        for j in range(k):
            request = self._submit(history + self._message(message_len))
            self.chats[f"{chat}.{j}"] = [*self.chats[chat], request]
            ids.append(request.request_id)
        self._say(f"{chat} branches {k} ways on its {len(history)}-token history")
        self.refresh(record_choice=chat)
        return ids

    # ---- what is on screen -------------------------------------------------------------
    @property
    def figure_data(self) -> dict:
        """The plotly figure dict now on screen (plain data: what tests compare)."""
        return self.view.figure_dict

    def refresh(self, evicted: int = 0, record_choice: str | None = None) -> None:
        """Re-read the tree and the engine; redraw."""
        self._sync_choices(record_choice)
        self.view.show(self._figure_dict())
        self.status.value = self._status_html(evicted)

    # ---- internals -------------------------------------------------------------------
    def _figure_dict(self) -> dict:
        return radix_figure_dict(self.tree, token_text=self._token_text)

    def _status_html(self, evicted: int) -> str:
        sched = self.engine.scheduler
        alloc = sched.allocator
        parts = [f"step {sched.step}", f"running {len(sched.running)}", f"waiting {len(sched.waiting)}",
                 f"free {alloc.num_free_blocks}/{alloc.num_blocks} blocks "
                 f"({alloc.num_cached_free_blocks} cached)",
                 f"evictions {self.tree.num_evictions}"]
        html = f"<code>{' · '.join(parts)}</code>"
        if evicted:
            html += (f"<br><span style='font-size:90%;color:{VICTIM}'>evicted {evicted} "
                     f"block{'s' if evicted > 1 else ''} in the last action</span>")
        return html

    def _message(self, length: int | None) -> list[int]:
        n = self._rng.randint(*self.message_len) if length is None else length
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a message needs at least one token, got {n!r}")
        return [self._rng.randrange(10, self._vocab) for _ in range(n)]

    def _submit(self, prompt: list[int]) -> "Request":
        from ..sampling_params import SamplingParams
        while f"r{self._next_request}" in self.engine.scheduler.requests:
            self._next_request += 1
        request_id = f"r{self._next_request}"
        self._next_request += 1
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        return self.engine.add_request(prompt, params, request_id=request_id)

    def _chat(self, chat: str | None) -> str:
        chat = chat or self.chat_select.value or None
        if chat is None:
            raise ValueError("no chat chosen: start one with New chat")
        if chat not in self.chats:
            raise ValueError(f"no chat {chat!r}; chats: {sorted(self.chats)}")
        return chat

    def _history(self, chat: str) -> list[int]:
        request = self.chats[chat][-1]
        if not request.finished:
            raise ValueError(f"{chat}'s last request has not finished yet: step until it has "
                             "(its answer is part of the next turn's prompt)")
        return list(request.seqs[0].token_ids)

    def _sync_choices(self, choice: str | None) -> None:
        options = [(name, name) for name in self.chats] or [("(no chat yet)", "")]
        if list(self.chat_select.options) != options:
            self.chat_select.options = options
        if choice is not None:
            self.chat_select.value = choice

    # The button plumbing is the live widget's: a refused action shows its ValueError, play
    # skips a tick while the previous one still draws.
    _on_play = LiveEngineWidget._on_play
    _safely = LiveEngineWidget._safely
    _say = LiveEngineWidget._say
