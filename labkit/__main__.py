"""``python -m labkit serve [options]`` (or ``labkit serve``): the OpenAI-compatible server.

    python -m labkit serve                                  # SmolLM2-135M on 127.0.0.1:8000
    python -m labkit serve --model tiny-llama --port 0      # a free port; the address is printed
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description="labkit: a small, real LLM server.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (loopback by default).")
    s.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), tiny-llama, or an HF path/dir")
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    s.add_argument("--port", type=int, default=8000, help="port (0: any free one; the address is printed)")
    e = s.add_argument_group("engine")
    e.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from a memory budget)")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one iteration")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one iteration")
    e.add_argument("--max-model-len", type=int, default=None, help="most tokens per sequence (prompt + output)")
    e.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    e.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    e.add_argument("--dtype", default="float32", help="float32 (default), float16, bfloat16")
    e.add_argument("--max-waiting", type=int, default=256,
                   help="requests that may wait for their first iteration before new ones get 429 (-1: no bound)")
    e.add_argument("--step-delay", type=float, default=0.0,
                   help="pause after each iteration in seconds (a teaching knob: watch a tiny model work)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
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
        engine = AsyncEngine(
            model=args.model, num_blocks=args.num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            attention_backend=args.attention_backend, dtype=args.dtype,
            max_waiting=None if args.max_waiting < 0 else args.max_waiting, step_delay_s=args.step_delay)
    except ValueError as e:
        print(f"labkit serve: {e}", file=sys.stderr)
        return 2
    try:
        serve(engine, args.host, args.port, args.served_model_name, args.log_level)
    except KeyboardInterrupt:          # Ctrl-C: uvicorn has shut down cleanly, then re-raised it
        pass
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
