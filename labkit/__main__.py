"""``python -m labkit serve [options]`` (or ``labkit serve``): the OpenAI-compatible server.

    python -m labkit serve                                  # SmolLM2-135M on 127.0.0.1:8000
    python -m labkit serve --model tiny-llama --port 0      # a free port; the address is printed
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

    # a class: one key per student, on the room's network (docs/classroom.md)
    python -m labkit serve --host 0.0.0.0 --api-keys-file keys.txt --max-tokens-limit 256

    python -m labkit kernels     # compile the C++ CPU kernels for this machine now (make setup does)
"""

from __future__ import annotations

import argparse
import sys

# Parsing and --help import nothing heavy (no torch, no server): they answer at once. So the
# two values below are written out; tests check them against labkit.kernels.BACKENDS and
# labkit.server.limits.DEFAULT_MAX_BODY_BYTES.
BACKENDS = ("auto", "torch", "triton", "cpu")
DEFAULT_MAX_BODY_MIB = 1
# labkit.kernels.kv_quant.KV_CACHE_DTYPES' names, written out for the same reason (tests check them)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8", "fp8_per_token_head", "int8_per_token_head")

_CLASS_HELP = """\
A server a class shares: give each student a key (keys file: 'name:key' per line) and listen
on the room's network. Without a key, an address other than loopback is refused.
/metrics then counts requests, tokens and 401/429 rejections per key name."""


# The per-request limits' defaults, written out so that --help imports nothing heavy;
# tests/test_classroom.py checks them against labkit.server.limits.Limits().
SERVE_DEFAULTS = {"max_stop_strings": 32, "max_stop_string_length": 128, "max_stop_token_ids": 64,
                  "max_logit_bias": 300, "max_logprobs": 20, "keep_alive_timeout_s": 5.0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description="labkit: a small, real LLM server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (loopback by default).",
                       epilog=_CLASS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny-llama, or an HF path/dir")
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free one; the address is printed)")
    e = s.add_argument_group("engine")
    e.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache blocks (default: what max-num-seqs sequences of the full context can use, "
                        "within a quarter of the free memory; the banner says which)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one iteration")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one iteration")
    e.add_argument("--max-model-len", type=int, default=None, help="most tokens per sequence (prompt + output)")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    e.add_argument("--no-jump-forward", action="store_true",
                   help="decode the tokens a structured output's grammar forces one step each (same output, slower)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vllm serve takes it: e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' (docs/speculative_decoding.md)')
    e.add_argument("--attention-backend", default="auto", choices=BACKENDS,
                   help="auto (default): Triton on a GPU of compute capability 7.5+, the CPU kernels on a CPU")
    e.add_argument("--dtype", default="auto",
                   help="auto (default: float32; float16 on GPUs below compute capability 8.0, e.g. a T4), "
                        "float32, float16, bfloat16")
    e.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (default: the model's dtype), fp8 (e4m3) or int8: a quantized KV cache, one byte per "
                        "number with a scale per token and head, ~2-4x the blocks (docs/kv_quantization.md)")
    e.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for their first iteration before new ones get 429 (-1: no bound)")
    e.add_argument("--step-delay", type=float, default=0.0,
                   help="pause after each iteration in seconds (a teaching knob: watch a tiny model work)")
    a = s.add_argument_group("access (a shared server)")
    a.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accept this key ('key' or 'name:key'); repeatable. Also read: $LABKIT_API_KEY "
                        "(comma-separated)")
    a.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="accept the keys in FILE: one 'key' or 'name:key' per line, '#' comments")
    a.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen on a non-loopback address without any key (anyone who reaches it may use it)")
    a.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key even when keys are set (default: it needs one)")
    f = s.add_argument_group("limits per client")
    f.add_argument("--max-concurrent-per-key", type=int, default=None, metavar="N",
                   help="most sequences one key (without keys: one client address) may have running or "
                        "waiting; beyond, 429 at once, and requests enter the engine round-robin across "
                        "keys. Default: max_num_seqs // 8 when keys are set or the host is not loopback, "
                        "else none; 0: none")
    f.add_argument("--max-tokens-limit", type=int, default=None, metavar="N",
                   help="most tokens one request may ask for (a larger max_tokens gets 400; chat requests "
                        "without max_tokens get N). Default: the model's context")
    f.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_MIB << 20, metavar="BYTES",
                   help=f"largest request body (413 beyond; default {DEFAULT_MAX_BODY_MIB << 20}, "
                        f"{DEFAULT_MAX_BODY_MIB} MiB)")
    f.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a connection may take to send a request head (slowloris; default 10)")
    f.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request body may take to arrive (default 30)")
    f.add_argument("--stall-timeout", type=float, default=15.0, metavar="S",
                   help="seconds a client may read nothing of a response before it is cut and its request "
                        "aborted (default 15)")
    f.add_argument("--max-connections", type=int, default=None, metavar="N",
                   help="most open connections (503 beyond; default: no bound)")
    f.add_argument("--keep-alive-timeout", type=float, default=SERVE_DEFAULTS["keep_alive_timeout_s"], metavar="S",
                   help="seconds an idle kept-alive connection stays open (default %(default)g)")
    r = s.add_argument_group("limits per request (each bounds work the engine does at every step; "
                             "docs/server_api.md)")
    r.add_argument("--max-stop-strings", type=int, default=SERVE_DEFAULTS["max_stop_strings"], metavar="N",
                   help="most stop strings per request (400 beyond; default %(default)s; OpenAI allows 4)")
    r.add_argument("--max-stop-string-length", type=int, default=SERVE_DEFAULTS["max_stop_string_length"],
                   metavar="CHARS", help="longest stop string (default %(default)s characters)")
    r.add_argument("--max-stop-token-ids", type=int, default=SERVE_DEFAULTS["max_stop_token_ids"], metavar="N",
                   help="most stop_token_ids per request (default %(default)s)")
    r.add_argument("--max-logit-bias", type=int, default=SERVE_DEFAULTS["max_logit_bias"], metavar="N",
                   help="most logit_bias entries per request (default %(default)s)")
    r.add_argument("--max-logprobs", type=int, default=SERVE_DEFAULTS["max_logprobs"], metavar="K",
                   help="most alternatives per generated token in logprobs and top_logprobs (vLLM's option; "
                        "default %(default)s)")
    r.add_argument("--max-prompt-logprobs", type=int, default=None, metavar="K",
                   help="most alternatives per prompt token: prompt_logprobs, and logprobs with echo. Default: 1 "
                        "(enough to score a text) when keys are set or the host is not loopback, else 20")
    a.add_argument("--share-prefix-cache", action="store_true",
                   help="with keys, let every key's requests reuse the others' cached prompts (faster for a "
                        "shared system prompt; a student can then tell, by cached_tokens or speed, whether "
                        "someone sent a prompt). Default: each key's cache is its own")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    sub.add_parser("kernels", help="compile the C++ CPU kernels for this machine now, once (make setup does)",
                   description="Compile labkit's C++ CPU kernels for this machine, unless they are built "
                               "already, and say what the CPU backend will run. make setup runs this, so "
                               "that no notebook cell waits on a compiler.")
    return parser


def _access(args) -> tuple:
    """The key ring and limits the options ask for; ValueError names a bad option."""
    from .server.auth import load_keys
    from .server.background import check_exposure, is_loopback
    from .server.limits import SHARED_MAX_PROMPT_LOGPROBS, Limits, default_max_concurrent_per_key
    from .sampling_params import MAX_LOGPROBS
    keys = load_keys(args.api_key, args.api_keys_file)
    check_exposure(args.host, keys, args.allow_unauthenticated)
    shared = bool(keys) or not is_loopback(args.host)
    cap = args.max_concurrent_per_key
    if cap is None:
        cap = default_max_concurrent_per_key(args.max_num_seqs) if shared else 0
    if cap < 0:
        raise ValueError(f"--max-concurrent-per-key must be >= 0 (0: no cap), got {cap}")
    prompt_logprobs = args.max_prompt_logprobs
    if prompt_logprobs is None:
        prompt_logprobs = SHARED_MAX_PROMPT_LOGPROBS if shared else MAX_LOGPROBS
    limits = Limits(max_concurrent_per_key=cap or None, max_tokens=args.max_tokens_limit,
                    max_body_bytes=args.max_request_bytes, header_timeout_s=args.header_timeout,
                    body_timeout_s=args.body_timeout, stall_timeout_s=args.stall_timeout,
                    max_connections=args.max_connections, metrics_public=args.metrics_public,
                    max_stop_strings=args.max_stop_strings, max_stop_string_length=args.max_stop_string_length,
                    max_stop_token_ids=args.max_stop_token_ids, max_logit_bias=args.max_logit_bias,
                    max_logprobs=args.max_logprobs, max_prompt_logprobs=prompt_logprobs,
                    keep_alive_timeout_s=args.keep_alive_timeout,
                    share_prefix_cache=args.share_prefix_cache)
    return keys, limits


def _speculative_config(text: str | None) -> dict | None:
    """``--speculative-config``'s JSON object as a dict (None when not given); its keys are
    checked when the engine is built. ``ValueError`` for text that is not a JSON object."""
    if text is None:
        return None
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not JSON ({e}): give an object such as "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(value).__name__}")
    return value


def build_kernels() -> int:
    """``python -m labkit kernels``: the CPU extension compiled (or found compiled) here.
    Exits 0 also where it cannot be built: the CPU backend then runs its Numba kernel."""
    from .kernels import cpu_extension
    ok, sentence = cpu_extension.status()
    where = f", in {cpu_extension.build_directory()}" if ok else "; the CPU backend uses its Numba kernel"
    print(f"labkit: {sentence}{where}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "kernels":
        return build_kernels()
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        print(f"labkit serve needs the serve extra: pip install 'labkit[serve]' ({e})", file=sys.stderr)
        return 2
    from .server import AsyncEngine
    from .server.background import serve
    try:
        keys, limits = _access(args)           # before loading a model: fail fast
        speculative_config = _speculative_config(args.speculative_config)
    except ValueError as e:
        print(f"labkit serve: {e}", file=sys.stderr)
        return 2
    try:
        engine = AsyncEngine(
            model=args.model, num_blocks=args.num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            attention_backend=args.attention_backend, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
            jump_forward=not args.no_jump_forward,
            speculative_config=speculative_config,
            max_waiting=None if args.max_waiting < 0 else args.max_waiting, step_delay_s=args.step_delay)
    except ValueError as e:
        print(f"labkit serve: {e}", file=sys.stderr)
        return 2
    engine.llm.runner.kv_cache.populate()    # a long-running server: its cache's pages now, not in its first steps
    try:
        serve(engine, args.host, args.port, args.served_model_name, args.log_level, keys, limits,
              args.allow_unauthenticated)
    except KeyboardInterrupt:          # Ctrl-C: uvicorn has shut down cleanly, then re-raised it
        pass
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
