"""``GET /metrics``: the engine's numbers in Prometheus' text format (version 0.0.4).

Gauges say how things are now (the batch, the KV pool); counters only grow (tokens,
requests, preemptions). Names start with ``labkit_``; ``parse_metrics`` reads the text
back (tests, the benchmark, the notebook).
"""

from __future__ import annotations

# (metric name, kind, stats key, help)
METRICS = [
    ("labkit_num_requests_running", "gauge", "num_requests_running", "Requests with a sequence in the running batch."),
    ("labkit_num_requests_waiting", "gauge", "num_requests_waiting", "Requests waiting to be (re)admitted to the batch."),
    ("labkit_num_requests_pending", "gauge", "num_requests_pending", "Requests not yet in any iteration (bounded by max_waiting)."),
    ("labkit_num_seqs_running", "gauge", "num_running", "Sequences in the running batch."),
    ("labkit_num_seqs_waiting", "gauge", "num_waiting", "Sequences in the waiting queue."),
    ("labkit_kv_blocks_total", "gauge", "num_total_blocks", "KV cache blocks in the pool."),
    ("labkit_kv_blocks_free", "gauge", "num_free_blocks", "KV blocks that can be allocated (free or cached-free)."),
    ("labkit_kv_blocks_used", "gauge", "num_used_blocks", "KV blocks held by at least one sequence."),
    ("labkit_kv_blocks_cached_free", "gauge", "num_cached_free_blocks", "Free KV blocks still holding a reusable prefix."),
    ("labkit_kv_usage_ratio", "gauge", "kv_usage_ratio", "Share of the KV pool held by sequences."),
    ("labkit_kv_utilization", "gauge", "kv_utilization", "Share of the slots in held blocks that hold a token."),
    ("labkit_prefix_cache_hit_rate", "gauge", "prefix_cache_hit_rate", "Share of looked-up prompt blocks found in the prefix cache."),
    ("labkit_max_waiting", "gauge", "max_waiting", "Bound on pending requests (-1: none)."),
    ("labkit_num_preemptions_total", "counter", "num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks."),
    ("labkit_prompt_tokens_total", "counter", "prompt_tokens", "Prompt tokens of admitted requests."),
    ("labkit_prompt_tokens_computed_total", "counter", "num_prompt_tokens_computed", "Prompt tokens computed (prefix-cache hits excluded)."),
    ("labkit_prompt_tokens_cached_total", "counter", "num_cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
    ("labkit_generation_tokens_total", "counter", "generation_tokens", "Tokens generated."),
    ("labkit_engine_steps_total", "counter", "num_steps", "Engine iterations run."),
    ("labkit_requests_finished_total", "counter", "requests_finished", "Requests that finished (stop or length)."),
    ("labkit_requests_aborted_total", "counter", "requests_aborted", "Requests aborted (client gone, cancelled, shutdown)."),
]
REJECTED = ("labkit_requests_rejected_total",
            "Requests the engine refused, by reason (queue_full: HTTP 429; invalid: it can never run).")


def render_metrics(stats: dict, http_errors: dict[int, int] | None = None) -> str:
    """The text of ``/metrics`` from ``AsyncEngine.stats()`` and the error responses sent
    (``{status code: count}``)."""
    stats = dict(stats)
    total = stats.get("num_total_blocks") or 0
    stats["kv_usage_ratio"] = stats.get("num_used_blocks", 0) / total if total else 0.0
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
