"""Layer 3: widgets and figures that show the engine at work, read from the real engine.

* the **block view** (``block_figure``): the physical KV block pool and one sequence's
  block table, drawn from ``snapshot(engine)`` or ``allocator_snapshot(allocator, tables)``;
* ``LiveEngineWidget``: step / play / add / fork / abort on a live engine, block view redrawn;
* replays: ``Recording`` (one snapshot per iteration), ``record_trace``, ``record_engine``,
  ``ReplayWidget`` (slider in the kernel), ``replay_figure`` / ``export_html`` (kernel-free
  plotly animation for slides);
* the **scheduler timeline** (``timeline_figure``, ``compare_schedulers``): Gantt chart of
  requests over iterations with KV usage beneath, static vs continuous batching;
* the **waste chart** (``waste_figure``, ``compare_waste``, ``live_waste``): the vLLM paper's
  Figure 2 categories, from ``labkit.memory.waste``;
* the **sampler's view** (``sampling_figure``, ``sampling_data``): the model's top-k
  distribution at each generated step, from the engine's logprobs, and what temperature,
  top-k, top-p, min-p and penalties make of it, computed by labkit's sampler.
* the **radix view** (``radix_figure``, ``radix_data``, ``RadixTreeWidget``): the radix tree
  of cached prefixes (``enable_prefix_caching="radix"``) with each node's hits and references
  and the next eviction victim, redrawn as chats arrive, continue and branch.
* the **beam view** (``BeamTree``, ``beam_figure``, ``BeamWidget``, ``beam_animation``): a beam
  search's tree, each beam's block table with the shared blocks' reference counts, and the
  device and host pools, step by step through forks, deaths and swaps; ``record_engine_beams``
  records a real engine's beam search for it.
* the **grammar's view** (``trace_grammar``, ``grammar_figure``, ``grammar_data``): at each step of a
  constrained generation (``structured_outputs``), the model's most likely tokens, which of them
  the grammar allowed, how many tokens it allowed in all, and the tokens jump-forward drafted.
* the **verifier's view** (``record_speculation``, ``speculation_figure``, ``speculation_data``,
  ``speculation_text``): at each step of speculative decoding, the guesses, which the target kept,
  and the KV slots they took while verifying and gave back after.

* the **tiers' view** (``record_tiers``, ``tier_figure``, ``tier_figure_dict``): the device pool
  and the host tier behind the prefix cache, step by step, with the blocks each step copied
  down (an eviction the tier kept) and back up (a hit instead of a recompute).

Importing ``labkit.viz`` is light: plotly and ipywidgets load when a figure or widget is
first built (``pip install 'labkit[lab]'`` provides them). Figure functions return plain
``go.Figure``s (call ``.show()``); their ``*_data`` / ``*_dict`` twins return plain data.
"""

from __future__ import annotations

import importlib

# name -> module that defines it; loaded on first access (PEP 562) to keep the import light.
_EXPORTS = {
    "seq_label": "pool", "request_of": "pool", "live_sequences": "pool", "live_tables": "pool",
    "pool_view": "pool", "table_view": "pool", "status_view": "pool", "snapshot": "pool",
    "allocator_snapshot": "pool", "status_line": "pool",
    "block_figure": "blocks", "block_figure_dict": "blocks",
    "ColorMap": "colors",
    "fork_sequence": "fork",
    "Recording": "replay", "record_engine": "replay", "record_trace": "replay",
    "replay_figure": "replay", "export_html": "replay",
    "ReplayWidget": "replay_widget",
    "LiveEngineWidget": "live", "make_sim_engine": "live",
    "timeline_data": "timeline", "timeline_figure": "timeline", "compare_schedulers": "timeline",
    "simulate_policies": "timeline",
    "waste_data": "waste_chart", "waste_figure": "waste_chart", "compare_waste": "waste_chart",
    "fragmented_layout": "waste_chart", "live_waste": "waste_chart",
    "sampling_data": "sampling", "sampling_figure": "sampling", "StepView": "sampling",
    "radix_data": "radix", "radix_figure_dict": "radix", "radix_figure": "radix",
    "radix_tree_of": "radix", "RadixTreeWidget": "radix", "make_radix_engine": "radix",
    "BeamTree": "beams", "beam_figure": "beams", "beam_figure_dict": "beams", "BeamWidget": "beams",
    "beam_animation": "beams", "demo_tree": "beams", "record_engine_beams": "beams",
    "GrammarStep": "structured", "trace_grammar": "structured", "grammar_data": "structured",
    "grammar_figure": "structured",
    "record_speculation": "speculative", "speculation_data": "speculative", "speculation_figure": "speculative",
    "speculation_text": "speculative",
    "record_tiers": "tiers", "tier_snapshot": "tiers", "tier_figure_dict": "tiers", "tier_figure": "tiers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'labkit.viz' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
