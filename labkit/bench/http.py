"""``python -m labkit.bench http``: the OpenAI-compatible server under concurrent streaming clients.

    python -m labkit.bench http --url http://127.0.0.1:8000 --concurrency 1,4,16,64
    python -m labkit.bench http --model tiny-llama --concurrency 1,4,16,64   # starts its own server

At each concurrency level, that many clients (httpx, async) stream completions back to
back until ``--num-requests`` are done. Each request asks for exactly ``--max-tokens``
tokens (``ignore_eos``, greedy) after a prompt of ``--prompt-len`` token ids, distinct per
request so that the prefix cache does not help. Reported: output tokens/s and requests/s
over the level's wall time, time to first token (TTFT: send -> first token) and time per
output token (TPOT: first -> last token, per token after the first), p50 and p99.

Loopback only: the benchmark refuses other hosts. With ``--model`` it runs
``python -m labkit serve`` in a subprocess on a free loopback port, and stops it after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from ..utils import percentile


@dataclass
class Sample:
    ok: bool
    sent: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.done is None or self.tokens < 2:
            return None
        return (self.done - self.first) / (self.tokens - 1)




def _check_loopback(url: str) -> None:
    from ..server.background import is_loopback
    host = urlparse(url).hostname or ""
    if not is_loopback(host):
        raise SystemExit(f"labkit.bench http: {url} is not a loopback address; this benchmark only "
                         "targets servers on this machine (127.0.0.1, ::1, localhost)")


async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    s = Sample(ok=False, sent=time.perf_counter())
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    s.error = str(event["error"])
                    return s
                for choice in event.get("choices", []):
                    n = len(choice.get("token_ids") or ()) or (1 if choice.get("text") else 0)
                    if n and s.first is None:
                        s.first = time.perf_counter()
                    s.tokens += n
        s.done = time.perf_counter()
        s.ok = s.tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        s.error = f"{type(e).__name__}: {e}"
    return s


async def run_level(url: str, model: str, concurrency: int, num_requests: int, prompt_len: int,
                    max_tokens: int, vocab_size: int, seed: int = 0, timeout: float = 600.0) -> dict:
    import httpx
    rng = random.Random(seed * 1_000_003 + concurrency)
    lo = min(3, vocab_size - 1)
    prompts = [[rng.randrange(lo, vocab_size) for _ in range(prompt_len)] for _ in range(num_requests)]
    queue = list(range(num_requests))
    samples: list[Sample] = []

    async def worker(http):
        while queue:
            i = queue.pop()
            samples.append(await _one(http, url, model, prompts[i], max_tokens))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    tokens = sum(s.tokens for s in ok)
    errors = [s.error for s in samples if not s.ok]
    return {
        "concurrency": concurrency, "num_requests": num_requests, "num_ok": len(ok),
        "num_errors": len(errors), "first_error": errors[0] if errors else None,
        "duration_s": wall, "output_tokens": tokens,
        "output_tok_per_s": tokens / wall if wall else 0.0, "req_per_s": len(ok) / wall if wall else 0.0,
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
    }


def _ms(x: float) -> float | None:
    """Seconds to milliseconds; None (JSON null) where there was nothing to measure."""
    return None if x != x else x * 1e3


def _server_info(url: str) -> tuple[str, int, int]:
    import httpx
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    return data["id"], int(data.get("vocab_size") or 256), int(data.get("max_model_len") or 2048)


def _start_server(model: str, server_args: list[str], timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``python -m labkit serve`` on a free loopback port; returns (process, URL)."""
    cmd = [sys.executable, "-m", "labkit", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--log-level", "warning", *server_args]
    print(f"starting: {' '.join(shlex.quote(c) for c in cmd)}", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode} before listening")
            continue
        m = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)
    _stop_server(proc)
    raise SystemExit(f"the server did not start within {timeout:.0f} s")


def _stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _header(title: str) -> str:
    head = (f"{'conc':>5} {'reqs':>5} {'ok':>4} {'time s':>7} {'out tok/s':>10} {'req/s':>7} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    return "\n".join([title, head + "  (ms)", "-" * len(head)])


def _row(r: dict) -> str:
    def f(x, spec):
        return f"{'-':>9}" if x is None else format(x, spec)
    line = (f"{r['concurrency']:>5} {r['num_requests']:>5} {r['num_ok']:>4} {r['duration_s']:>7.2f} "
            f"{r['output_tok_per_s']:>10.1f} {r['req_per_s']:>7.2f} {f(r['ttft_p50_ms'], '9.1f')} "
            f"{f(r['ttft_p99_ms'], '9.1f')} {f(r['tpot_p50_ms'], '9.2f')} {f(r['tpot_p99_ms'], '9.2f')}")
    if r["num_errors"]:
        line += f"\n      {r['num_errors']} failed, e.g. {r['first_error']}"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.bench http", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="a running server (loopback), e.g. http://127.0.0.1:8000")
    where.add_argument("--model", default=None, help="start a server with this model for the run (tiny-llama, smollm2-135m, ...)")
    p.add_argument("--server-args", default="", help="extra options for the started server, e.g. '--num-blocks 512'")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    p.add_argument("--num-requests", type=int, default=None, help="requests per level (default: 4 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (exact: ignore_eos)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency takes integers like 1,4,16: {args.concurrency!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency levels must be >= 1")
    if args.max_tokens < 1 or args.prompt_len < 1:
        p.error("--max-tokens and --prompt-len must be >= 1")

    proc, rows = None, []
    if args.model:
        proc, url = _start_server(args.model, shlex.split(args.server_args))
    else:
        url = (args.url or "http://127.0.0.1:8000").rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        _check_loopback(url)
    try:
        import httpx
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"no healthy server at {url}")
            time.sleep(0.2)
        model, vocab, max_len = _server_info(url)
        if args.prompt_len + args.max_tokens > max_len:
            p.error(f"--prompt-len + --max-tokens = {args.prompt_len + args.max_tokens} exceeds the "
                    f"model's context ({max_len})")
        asyncio.run(run_level(url, model, 1, 2, args.prompt_len, 4, vocab, seed=-1))   # warm-up
        rows = []
        if not args.json:
            print(_header(f"{model} at {url}: prompt {args.prompt_len} tokens, "
                          f"{args.max_tokens} output tokens per request"), flush=True)
        for c in levels:
            n = args.num_requests or max(8, 4 * c)
            rows.append(asyncio.run(run_level(url, model, c, n, args.prompt_len, args.max_tokens, vocab, args.seed)))
            if not args.json:
                print(_row(rows[-1]), flush=True)
        if args.json:
            print(json.dumps({"model": model, "url": url, "prompt_len": args.prompt_len,
                              "max_tokens": args.max_tokens, "levels": rows}, indent=2))
    finally:
        if proc is not None:
            _stop_server(proc)
    return 0 if all(r["num_errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
