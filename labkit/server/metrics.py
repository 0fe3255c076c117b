"""``GET /metrics``: the engine's numbers in Prometheus' text format (version 0.0.4).

Gauges say how things are now (the batch, the KV pool); counters only grow (tokens,
requests, preemptions). Names start with ``labkit_``; ``parse_metrics`` reads the text
back (tests, the benchmark, the notebook).
"""

from __future__ import annotations

# (metric name, kind, stats key, help)
METRICS = [
    ("labkit_num_requests_running", "gauge", "num_requests_running", "Requests with a sequence in the running batch."),
    ("labkit_num_requests_waiting", "gauge", "num_requests_waiting",
     "Requests waiting to be (re)admitted to the batch."),
    ("labkit_num_requests_pending", "gauge", "num_requests_pending",
     "Requests not yet in any iteration (bounded by max_waiting)."),
    ("labkit_num_seqs_running", "gauge", "num_running", "Sequences in the running batch."),
    ("labkit_num_seqs_waiting", "gauge", "num_waiting", "Sequences in the waiting queue."),
    ("labkit_kv_blocks_total", "gauge", "num_total_blocks", "KV cache blocks in the pool."),
    ("labkit_kv_blocks_free", "gauge", "num_free_blocks", "KV blocks that can be allocated (free or cached-free)."),
    ("labkit_kv_blocks_used", "gauge", "num_used_blocks", "KV blocks held by at least one sequence."),
    ("labkit_kv_blocks_cached_free", "gauge", "num_cached_free_blocks",
     "Free KV blocks still holding a reusable prefix."),
    ("labkit_kv_cache_usage", "gauge", "kv_cache_usage",
     "Share of the KV blocks held by sequences (vLLM's KV-cache usage)."),
    ("labkit_held_slot_fill", "gauge", "held_slot_fill",
     "Share of the slots in held blocks that hold a token (0 when none is held)."),
    ("labkit_prefix_cache_hit_rate", "gauge", "prefix_cache_hit_rate",
     "Share of looked-up prompt blocks found in the prefix cache."),
    ("labkit_max_waiting", "gauge", "max_waiting", "Bound on pending requests (-1: none)."),
    ("labkit_num_preemptions_total", "counter", "num_preemptions",
     "Sequences preempted (recomputed later) for lack of KV blocks."),
    ("labkit_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("labkit_prompt_tokens_computed_total", "counter", "num_prompt_tokens_computed",
     "Prompt tokens computed (prefix-cache hits excluded)."),
    ("labkit_prompt_tokens_cached_total", "counter", "num_cached_prompt_tokens",
     "Prompt tokens served from the prefix cache."),
    ("labkit_generation_tokens_total", "counter", "num_generated_tokens", "Tokens generated."),
    ("labkit_engine_steps_total", "counter", "num_steps", "Engine iterations run."),
    ("labkit_requests_finished_total", "counter", "requests_finished", "Requests that finished (stop or length)."),
    ("labkit_requests_aborted_total", "counter", "requests_aborted",
     "Requests aborted (client gone, cancelled, shutdown)."),
    ("labkit_prefix_cache_queries_total", "counter", "num_prefix_cache_queries",
     "Full prompt blocks looked up in the device prefix cache."),
    ("labkit_prefix_cache_hits_total", "counter", "num_prefix_cache_hits",
     "Full prompt blocks found in the device prefix cache."),
    # The host tier behind the prefix cache (only with kv_offloading_size).
    ("labkit_kv_offload_blocks", "gauge", "num_host_cached_blocks", "Cached KV blocks kept in the host tier now."),
    ("labkit_kv_offloaded_blocks_total", "counter", "num_offloaded_blocks",
     "Cached KV blocks the device evicted and the host tier copied in."),
    ("labkit_kv_offloaded_bytes_total", "counter", "kv_offloaded_bytes", "Bytes copied device -> host tier."),
    ("labkit_prefix_cache_host_queries_total", "counter", "num_host_cache_queries",
     "Full prompt blocks looked up in the host tier (after a device miss)."),
    ("labkit_prefix_cache_host_hits_total", "counter", "num_host_cache_hits",
     "Full prompt blocks found in the host tier and copied back instead of recomputed."),
    ("labkit_kv_loaded_bytes_total", "counter", "kv_loaded_bytes", "Bytes copied host tier -> device."),
    # Speculative decoding (only when the engine speculates), vLLM's spec_decode_* names.
    ("labkit_spec_decode_num_drafts_total", "counter", "spec_decode_num_drafts",
     "Sequence-steps that verified at least one guessed token."),
    ("labkit_spec_decode_num_draft_tokens_total", "counter", "spec_decode_num_draft_tokens",
     "Guessed tokens verified."),
    ("labkit_spec_decode_num_accepted_tokens_total", "counter", "spec_decode_num_accepted_tokens",
     "Guessed tokens the target kept."),
    ("labkit_spec_decode_acceptance_rate", "gauge", "spec_decode_acceptance_rate",
     "Accepted / verified guessed tokens since the start."),
    ("labkit_spec_decode_mean_acceptance_length", "gauge", "spec_decode_mean_acceptance_length",
     "Tokens a drafting step gives a sequence on average: 1 + accepted / drafts."),
]
REJECTED = ("labkit_requests_rejected_total",
            "Requests the engine refused, by reason (queue_full: HTTP 429; invalid: it can never run).")


def render_metrics(stats: dict, http_errors: dict[int, int] | None = None) -> str:
    """The text of ``/metrics`` from ``AsyncEngine.stats()`` and the error responses sent
    (``{status code: count}``)."""
    stats = dict(stats)
    if stats.get("max_waiting") is None:
        stats["max_waiting"] = -1
    lines = []
    for name, kind, key, help_text in METRICS:
        value = stats.get(key)
        if value is None:
            continue
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
    name, help_text = REJECTED
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter",
              f'{name}{{reason="queue_full"}} {_number(stats.get("rejected_queue_full", 0))}',
              f'{name}{{reason="invalid"}} {_number(stats.get("rejected_invalid", 0))}']
    lines += ["# HELP labkit_http_errors_total Error responses sent, by HTTP status.",
              "# TYPE labkit_http_errors_total counter"]
    lines += [f'labkit_http_errors_total{{status="{code}"}} {n}' for code, n in sorted((http_errors or {}).items())]
    alive = 1 if stats.get("engine_alive", True) else 0
    lines += ["# HELP labkit_engine_alive 1 while the engine loop runs.", "# TYPE labkit_engine_alive gauge",
              f"labkit_engine_alive {alive}"]
    return "\n".join(lines) + "\n"


def _number(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name" or 'name{labels}': value}`` from Prometheus text (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


# ---- per key (a class's shared server) -----------------------------------------------
# (metric name, kind, ClientUsage attribute, help). Labelled key="<the key's name>" (never
# the key), or the client address when the server has no keys.
KEY_METRICS = [
    ("labkit_key_requests_total", "counter", "requests", "Requests admitted into the engine, per key name."),
    ("labkit_key_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens of the key's requests."),
    ("labkit_key_prompt_tokens_cached_total", "counter", "cached_tokens",
     "Prompt tokens of the key's requests served from the prefix cache (hits on the key's own prompts "
     "unless the server shares the cache across keys)."),
    ("labkit_key_generation_tokens_total", "counter", "generation_tokens", "Tokens generated for the key."),
    ("labkit_key_concurrency", "gauge", "concurrency",
     "Sequences the key has running or waiting (what the cap bounds)."),
    ("labkit_key_queued", "gauge", "queued", "Sequences of the key waiting in the gate for their round-robin turn."),
    ("labkit_key_streams_stalled_total", "counter", "stalled", "Streams aborted because the client stopped reading."),
]


def render_client_metrics(gate, auth_failures: dict[str, int], connections) -> str:
    """The per-key part of ``/metrics``: each ``ClientUsage`` in ``gate.clients`` (its
    counters, its error responses by status), the gate's totals, the 401s by reason
    (``missing``/``invalid`` key), and the connections the guards cut (``connections``:
    a ``limits.ConnectionStats``)."""
    clients = sorted(gate.clients.items())
    lines = []
    for name, kind, attr, help_text in KEY_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{key="{_label(c)}"}} {getattr(u, attr)}' for c, u in clients]
    lines += ["# HELP labkit_key_errors_total Error responses to the key's requests, by HTTP status "
              "(429: over its share).",
              "# TYPE labkit_key_errors_total counter"]
    lines += [f'labkit_key_errors_total{{key="{_label(c)}",status="{code}"}} {n}'
              for c, u in clients for code, n in sorted(u.errors.items())]
    cap = -1 if gate.cap is None else gate.cap
    lines += ["# HELP labkit_max_concurrent_per_key Cap on each key's running + waiting sequences (-1: none).",
              "# TYPE labkit_max_concurrent_per_key gauge", f"labkit_max_concurrent_per_key {cap}",
              "# HELP labkit_gate_in_flight Sequences handed by the gate to the engine, not finished.",
              "# TYPE labkit_gate_in_flight gauge", f"labkit_gate_in_flight {gate.in_flight}",
              "# HELP labkit_gate_queued Requests waiting in the gate for their key's turn.",
              "# TYPE labkit_gate_queued gauge", f"labkit_gate_queued {gate.num_queued}",
              "# HELP labkit_unauthorized_total Requests refused with 401, by reason (no key, wrong key).",
              "# TYPE labkit_unauthorized_total counter"]
    lines += [f'labkit_unauthorized_total{{reason="{r}"}} {n}' for r, n in sorted(auth_failures.items())]
    lines += ["# HELP labkit_connections_cut_total Connections closed by the server's guards "
              "(header_timeout: no request head in time; stalled: the client stopped reading).",
              "# TYPE labkit_connections_cut_total counter",
              f'labkit_connections_cut_total{{reason="header_timeout"}} {connections.header_timeouts}',
              f'labkit_connections_cut_total{{reason="stalled"}} {connections.stalled}']
    return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A Prometheus label value, escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
