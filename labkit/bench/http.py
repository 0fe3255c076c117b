"""``python -m labkit.bench http``: the OpenAI-compatible server under concurrent streaming clients.

    python -m labkit.bench http --url http://127.0.0.1:8000 --concurrency 1,4,16,64
    python -m labkit.bench http --model tiny-llama --concurrency 1,4,16,64   # starts its own server

At each concurrency level, that many clients (httpx, async) stream completions back to
back until ``--num-requests`` are done. Each request asks for exactly ``--max-tokens``
tokens (``ignore_eos``, greedy) after a prompt of ``--prompt-len`` token ids, distinct per
request so that the prefix cache does not help. Reported: output tokens/s and requests/s
over the level's wall time, time to first token (TTFT: send -> first token) and time per
output token (TPOT: first -> last token, per token after the first), p50 and p99.

``--vs-vllm`` starts ``labkit serve`` and then ``vllm serve`` on loopback and measures both with
vLLM's own client, ``vllm bench serve``, at concurrency 1, 8 and 32 by default: tok/s, TTFT and
TPOT (mean, p99) and labkit / vLLM for each, in one run (``labkit.bench.http_vllm``).

Loopback only: the benchmark refuses other hosts. With ``--model`` it runs
``python -m labkit serve`` in a subprocess on a free loopback port, and stops it after.

``--classroom`` simulates a class sharing one server (``docs/classroom.md``): it starts a
server with one API key per student and a per-key cap, runs the students' polite workload
alone, then again beside the worst requests the server's limits allow (one key keeping
them in flight), then beside one misbehaving key (the hog), and compares the students'
time to first token. See ``Classroom`` below for the scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
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


async def _one(http, url: str, model: str, prompt: list[int], max_tokens: int,
               headers: dict | None = None) -> Sample:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    s = Sample(ok=False, sent=time.perf_counter())
    try:
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
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
        "ttft_mean_ms": _ms(statistics.fmean(ttft)) if ttft else None,
        "tpot_mean_ms": _ms(statistics.fmean(tpot)) if tpot else None,
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


# ---- a class sharing one server --------------------------------------------------------
@dataclass(slots=True)
class Classroom:
    """A class on one server: ``num_keys`` students, each with ``concurrency`` requests
    in flight at most, ``requests_per_key`` streaming requests in all, the first ones
    spread over ``spread_s``, then ``think_s`` (at most, uniform) between one answer and
    the next question.

    The hog (its own key, its own process) meanwhile: ``hog_flood`` workers send long
    requests back to back, retrying a 429 after 10 ms whatever ``Retry-After`` says;
    ``hog_unread`` streams (n=2, long) it never reads, from sockets with a 4 KiB receive
    buffer (the issue's attack: 80 sequences, more than the batch); ``hog_oversized``
    2 MiB bodies; ``hog_bad_keys`` requests with a wrong key and as many without one;
    ``hog_idle`` connections that send nothing. Every loop is bounded in count and time.

    ``worst``: phases in which one key (its own process) keeps the costliest requests the
    server's limits allow in flight, back to back (``worst_bodies``): ``"stop"``, one
    streamed request of n = cap samples with the most and longest stop strings allowed;
    ``"generate"``, the same with every per-token option at its limit; ``"score"``, cap
    requests scoring the longest prompt with its log-probabilities."""

    num_keys: int = 30
    concurrency: int = 2
    requests_per_key: int = 3
    prompt_len: int = 32
    max_tokens: int = 16
    think_s: float = 0.3
    spread_s: float = 1.0                 # first questions spread over this long, not one burst
    cap: int = 4                          # the server's --max-concurrent-per-key
    hog_flood: int = 8
    hog_max_tokens: int = 400
    hog_unread: int = 40
    hog_oversized: int = 3
    hog_bad_keys: int = 10
    hog_idle: int = 4
    stall_timeout_s: float = 3.0
    header_timeout_s: float = 2.0
    timeout_s: float = 300.0              # the whole scenario, per phase
    worst: tuple[str, ...] = ("stop", "generate", "score")
    rounds: int = 1                       # rounds of (students alone, beside each worst request)

    def server_args(self, keys_file: str) -> list[str]:
        return ["--api-keys-file", keys_file, "--max-concurrent-per-key", str(self.cap),
                "--max-tokens-limit", str(self.hog_max_tokens), "--stall-timeout", str(self.stall_timeout_s),
                "--header-timeout", str(self.header_timeout_s), "--num-blocks", "1024"]


OTHERS = ("hog", "worst")                 # the keys that are not students


def classroom_keys(num_keys: int) -> dict[str, str]:
    """``{name: key}``: ``student01``..., ``hog`` and ``worst``; fresh random keys each run."""
    names = [f"student{i + 1:02d}" for i in range(num_keys)] + list(OTHERS)
    return {name: f"sk-labkit-{secrets.token_hex(12)}" for name in names}


def worst_bodies(model: str, vocab: int, max_model_len: int, c: Classroom) -> dict[str, dict]:
    """The costliest requests the classroom server's limits allow (its ``--max-tokens-limit``
    and per-key cap, and a shared server's defaults for the rest), by what they cost:

    * ``stop``: n = cap samples of ``max_tokens`` = the limit, streamed, each token matched
      against the most and longest stop strings allowed (none of which occurs);
    * ``generate``: n = cap samples of ``max_tokens`` = the limit after the longest prompt
      that leaves room, streamed, each token matched against the most and longest stop
      strings allowed, biased by the most ``logit_bias`` entries, penalised three ways,
      sampled with seed, top-k, top-p and min-p, with the most log-probabilities per token;
    * ``score``: the longest prompt, ``max_tokens`` 1, its ``prompt_logprobs`` and echoed
      logprobs at their limit (what an evaluation harness sends), in one JSON answer.
    """
    from ..server.limits import SHARED_MAX_PROMPT_LOGPROBS, Limits
    limits, rng = Limits(max_prompt_logprobs=SHARED_MAX_PROMPT_LOGPROBS), random.Random(7)   # a shared server's
    letters = "abcdefghijklmnopqrstuvwxyz"
    stop = [" " + "".join(rng.choice(letters) for _ in range(limits.max_stop_string_length - 1))
            for _ in range(limits.max_stop_strings)]
    lo = min(3, vocab - 1)
    ids = list(range(lo, vocab))
    # The stop token ids get a bias of -100 (banned: they cost their check and never end a
    # sample early); the rest of the bias entries nudge tokens either way.
    stop_ids = rng.sample(ids, min(len(ids), limits.max_stop_token_ids))
    bias = {str(t): -100.0 for t in stop_ids}
    for t in rng.sample([t for t in ids if str(t) not in bias], min(len(ids) - len(bias),
                                                                     limits.max_logit_bias - len(bias))):
        bias[str(t)] = rng.choice((-1.0, 1.0))
    per_token = {"stop": stop, "stop_token_ids": stop_ids, "logit_bias": bias,
                 "temperature": 1.0, "seed": 1, "top_p": 0.95, "top_k": 50, "min_p": 0.01,
                 "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    generate = {"model": model, "prompt": prompt(max_model_len - c.hog_max_tokens), "max_tokens": c.hog_max_tokens,
                "n": c.cap, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
                "logprobs": limits.max_logprobs, "return_token_ids": True, **per_token}
    score = {"model": model, "prompt": prompt(max_model_len - 1), "max_tokens": 1, "echo": True,
             "logprobs": limits.max_prompt_logprobs, "prompt_logprobs": limits.max_prompt_logprobs, **per_token}
    stops = {"model": model, "prompt": generate["prompt"], "max_tokens": c.hog_max_tokens, "n": c.cap,
             "stream": True, "ignore_eos": True, "temperature": 0, "stop": stop, "return_token_ids": True}
    return {"stop": stops, "generate": generate, "score": score}


async def _worst(http, url: str, key: str, bodies: dict[str, dict], kind: str, c: Classroom,
                 stop: asyncio.Event) -> dict:
    """Keep ``kind``'s worst requests in flight until ``stop``: reading every answer whole,
    sending the next one as soon as it ends (a 429 retried after 10 ms)."""
    body, workers = bodies[kind], (c.cap if kind == "score" else 1)
    # ok: answers read whole; chunks: streamed chunks read (a long request is in flight,
    # and served, before it ends)
    report = {"kind": kind, "requests": 0, "ok": 0, "chunks": 0, "statuses": {}, "first_error": None}
    headers = {"Authorization": f"Bearer {key}"}

    async def worker():
        while not stop.is_set():
            report["requests"] += 1
            try:
                async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                    data = b""
                    async for line in r.aiter_lines():
                        report["chunks"] += line.startswith("data: {")
                        if r.status_code != 200 or not body.get("stream"):
                            data += line.encode()
                status = str(r.status_code)
                if r.status_code == 200:
                    report["ok"] += 1
                elif r.status_code != 429 and report["first_error"] is None:
                    report["first_error"] = f"HTTP {status}: {data[:200]!r}"
            except Exception as e:  # noqa: BLE001 - counted, and the loop goes on
                status = type(e).__name__
                await asyncio.sleep(0.05)
            report["statuses"][status] = report["statuses"].get(status, 0) + 1
            if status == "429":
                await asyncio.sleep(0.01)

    tasks = [asyncio.ensure_future(worker()) for _ in range(workers)]
    await stop.wait()
    for t in tasks:                       # the students are done: abort what is in flight
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return report


async def _polite(http, url: str, model: str, key: str, prompts: list[list[int]], c: Classroom,
                  rng: random.Random) -> list[Sample]:
    headers = {"Authorization": f"Bearer {key}"}
    todo = list(prompts)
    samples: list[Sample] = []

    async def worker():
        await asyncio.sleep(rng.uniform(0, c.spread_s))
        while todo:
            prompt = todo.pop()
            samples.append(await _one(http, url, model, prompt, c.max_tokens, headers))
            await asyncio.sleep(rng.uniform(0, c.think_s))

    await asyncio.gather(*(worker() for _ in range(c.concurrency)))
    return samples


async def _hog(http, url: str, model: str, key: str, c: Classroom, stop: asyncio.Event) -> dict:
    """The misbehaving key, until ``stop`` (or its own bounds). Returns what it got."""
    statuses: dict[str, int] = {}
    host, port = urlparse(url).hostname, urlparse(url).port
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": c.hog_max_tokens, "ignore_eos": True}

    def count(what) -> None:
        statuses[str(what)] = statuses.get(str(what), 0) + 1

    async def flood():
        for _ in range(10_000):
            if stop.is_set():
                return
            try:
                r = await http.post(url + "/v1/completions", json=body, headers=auth)
                count(r.status_code)
                if r.status_code == 429:
                    await asyncio.sleep(0.01)
            except Exception as e:  # noqa: BLE001 - the hog does not care; count it
                count(type(e).__name__)
                await asyncio.sleep(0.05)

    async def oversized():
        big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
        for _ in range(c.hog_oversized):
            try:
                r = await http.post(url + "/v1/completions", content=big,
                                    headers={**auth, "Content-Type": "application/json"})
                count(r.status_code)
            except Exception as e:  # noqa: BLE001
                count(type(e).__name__)

    async def bad_keys():
        for i in range(2 * c.hog_bad_keys):
            headers = {"Authorization": f"Bearer sk-guess-{i}"} if i % 2 else {}
            r = await http.post(url + "/v1/completions", json={**body, "max_tokens": 1}, headers=headers)
            count(r.status_code)

    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []

    async def raw(payload: bytes) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        socks.append(sock)
        await loop.sock_connect(sock, (host, port))
        if payload:
            await loop.sock_sendall(sock, payload)

    unread = json.dumps({**body, "stream": True, "n": 2, "return_token_ids": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(unread)}\r\n\r\n").encode()
    async def cut(sock: socket.socket) -> None:
        """What a silent connection finally gets (a 408, once header_timeout_s has passed)."""
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 1024), c.header_timeout_s + 10)
            count(data.split(b" ")[1].decode() if data.startswith(b"HTTP/1.1 ") else "closed")
        except (asyncio.TimeoutError, OSError) as e:
            count(type(e).__name__)

    tasks: list[asyncio.Future] = []
    try:
        for _ in range(c.hog_idle):
            await raw(b"")
        idle = list(socks)
        for _ in range(c.hog_unread):
            await raw(head + unread)
        tasks = [asyncio.ensure_future(t) for t in (bad_keys(), oversized(), *(flood() for _ in range(c.hog_flood)))]
        await stop.wait()
        await asyncio.gather(*(cut(sock) for sock in idle))
    finally:
        for t in tasks:                   # the students are done: so is the hog (its requests abort)
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sock in socks:
            sock.close()
    return {"statuses": dict(sorted(statuses.items())), "unread_streams": c.hog_unread,
            "idle_connections": c.hog_idle}


def _other_main(kind: str, url: str, model: str, key: str, scenario: dict, bodies: dict | None,
                started, stop, out) -> None:
    """The other key's process: run ``_hog`` (kind ``"hog"``) or ``_worst`` (kind
    ``"stop"``/``"generate"``/``"score"``) until the parent sets ``stop``; report on ``out``."""
    import httpx

    async def main():
        done = asyncio.Event()

        async def watch():
            while not stop.is_set():
                await asyncio.sleep(0.05)
            done.set()

        watcher = asyncio.ensure_future(watch())
        c = Classroom(**scenario)
        limits = httpx.Limits(max_connections=c.hog_flood + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10), limits=limits) as http:
            asyncio.get_running_loop().call_later(0.5, started.set)
            report = await (_hog(http, url, model, key, c, done) if kind == "hog" else
                            _worst(http, url, key, bodies, kind, c, done))
        watcher.cancel()
        return report

    out.put(asyncio.run(main()))


class _OtherProcess:
    """The hog, or the worst requests' key, in a process of its own, as on another
    student's machine: its loops must not slow the students' client (and their measured
    TTFT) inside this process."""

    def __init__(self, kind: str, url: str, model: str, key: str, c: Classroom, bodies: dict | None = None):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self._started, self._stop, self._out = ctx.Event(), ctx.Event(), ctx.Queue()
        self._proc = ctx.Process(target=_other_main, daemon=True,
                                 args=(kind, url, model, key, asdict(c), bodies, self._started, self._stop,
                                       self._out))
        self._proc.start()

    async def started(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._started.is_set():
            if not self._proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the other key's process did not start")
            await asyncio.sleep(0.05)

    def stop(self, timeout: float = 60.0) -> dict | None:
        self._stop.set()
        try:
            return self._out.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - queue.Empty: it did not report in time
            return None
        finally:
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)


async def _classroom_phase(url: str, model: str, vocab: int, keys: dict[str, str], c: Classroom,
                           other: str | None, seed: int, bodies: dict | None = None) -> dict:
    """The students' workload, alone (``other`` None) or beside the hog (``"hog"``) or the
    worst requests (``"stop"``, ``"generate"``, ``"score"``: ``bodies``)."""
    import httpx
    rng = random.Random(seed)
    lo = min(3, vocab - 1)
    students = [name for name in keys if name not in OTHERS]
    prompts = {n: [[rng.randrange(lo, vocab) for _ in range(c.prompt_len)] for _ in range(c.requests_per_key)]
               for n in students}
    limits = httpx.Limits(max_connections=len(students) * c.concurrency + 8)
    hog = None if other is None else _OtherProcess(other, url, model, keys["hog" if other == "hog" else "worst"],
                                                      c, bodies)
    hog_report = None
    try:
        if hog is not None:
            await hog.started()               # the other key is at it before the students arrive
        async with httpx.AsyncClient(timeout=httpx.Timeout(60, connect=10), limits=limits) as http:
            start = time.perf_counter()
            try:
                per_key = await asyncio.wait_for(asyncio.gather(
                    *(_polite(http, url, model, keys[n], prompts[n], c, random.Random(f"{seed}-{n}"))
                      for n in students)), c.timeout_s)
            finally:
                wall = time.perf_counter() - start
    finally:
        if hog is not None:
            hog_report = hog.stop()
    samples = [s for ss in per_key for s in ss]
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    latency = [s.done - s.sent for s in ok if s.done is not None]
    errors = [s.error for s in samples if not s.ok]
    polite = {"num_keys": len(students), "num_requests": len(samples), "num_ok": len(ok),
              "num_failed": len(errors), "first_error": errors[0] if errors else None,
              "duration_s": wall, "ttft_p50_ms": _ms(percentile(ttft, 50)),
              "ttft_p99_ms": _ms(percentile(ttft, 99)), "ttft_max_ms": _ms(max(ttft, default=float("nan"))),
              "latency_p99_ms": _ms(percentile(latency, 99))}
    return {"polite": polite, "other": hog_report}


def _wait_idle(url: str, headers: dict, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once nothing runs, waits or is held (KV blocks, the gate)."""
    import httpx

    from ..server.metrics import parse_metrics
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=10).text)
        if (m["labkit_kv_blocks_used"] == 0 and m["labkit_num_requests_running"] == 0
                and m["labkit_num_requests_pending"] == 0 and m["labkit_gate_in_flight"] == 0
                and m["labkit_gate_queued"] == 0):
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def run_classroom(url: str, keys: dict[str, str], c: Classroom, seed: int = 0) -> dict:
    """Every phase against a server started with ``c.server_args`` and ``keys``: the
    students alone, beside each of ``c.worst``'s worst requests, then beside the hog.
    Returns each phase's figures, the other key's answers, and the server's numbers once
    idle again. The other keys run in spawned processes: call this from under
    ``if __name__ == "__main__":`` in a script."""
    headers = {"Authorization": f"Bearer {keys['hog']}"}
    import httpx
    data = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    model, vocab, max_len = data["id"], int(data.get("vocab_size") or 256), int(data.get("max_model_len") or 2048)
    bodies = worst_bodies(model, vocab, max_len, c)
    warm = Classroom(num_keys=c.num_keys, concurrency=c.concurrency, requests_per_key=1, prompt_len=c.prompt_len,
                     max_tokens=c.max_tokens, think_s=0.0, spread_s=0.0)
    asyncio.run(_classroom_phase(url, model, vocab, keys, warm, None, -1))   # warm-up: every batch size
    _wait_idle(url, headers)
    # Each worst request's phase runs right after a baseline of its own round and is compared
    # with it: on a shared machine the load drifts between phases minutes apart.
    rounds = []
    for r in range(c.rounds):
        one = {"baseline": asyncio.run(_classroom_phase(url, model, vocab, keys, c, None, seed + r)), "worst": {}}
        _wait_idle(url, headers)
        for kind in c.worst:
            one["worst"][kind] = asyncio.run(_classroom_phase(url, model, vocab, keys, c, kind, seed + r, bodies))
            _wait_idle(url, headers)
        rounds.append(one)
    baseline, worst = rounds[0]["baseline"], rounds[0]["worst"]
    with_hog = asyncio.run(_classroom_phase(url, model, vocab, keys, c, "hog", seed))
    m = _wait_idle(url, headers)
    polite_429 = sum(v for k, v in m.items()
                     if k.startswith("labkit_key_errors_total") and 'status="429"' in k
                     and not any(f'key="{o}"' in k for o in OTHERS))
    server = {
        "kv_blocks_total": m["labkit_kv_blocks_total"], "kv_blocks_free": m["labkit_kv_blocks_free"],
        "kv_blocks_used": m["labkit_kv_blocks_used"], "gate_in_flight": m["labkit_gate_in_flight"],
        "pool_whole": m["labkit_kv_blocks_used"] == 0 and m["labkit_kv_blocks_free"] == m["labkit_kv_blocks_total"],
        "hog_requests": m.get('labkit_key_requests_total{key="hog"}', 0),
        "hog_429": m.get('labkit_key_errors_total{key="hog",status="429"}', 0),
        "hog_413": m.get('labkit_key_errors_total{key="hog",status="413"}', 0),
        "hog_streams_stalled": m.get('labkit_key_streams_stalled_total{key="hog"}', 0),
        "students_429": polite_429,
        "unauthorized": sum(v for k, v in m.items() if k.startswith("labkit_unauthorized_total")),
        "connections_cut_header_timeout": m['labkit_connections_cut_total{reason="header_timeout"}'],
        "connections_cut_stalled": m['labkit_connections_cut_total{reason="stalled"}'],
    }
    def ratio(phase: dict, base: dict) -> float | None:
        p99, base_p99 = phase["polite"]["ttft_p99_ms"], base["polite"]["ttft_p99_ms"]
        return p99 / base_p99 if base_p99 and p99 else None

    per_round = [{"failed": sum(p["polite"]["num_failed"] for p in [one["baseline"], *one["worst"].values()]),
                  "baseline_ttft_p99_ms": one["baseline"]["polite"]["ttft_p99_ms"],
                  **{f"{kind}_ttft_p99_ms": phase["polite"]["ttft_p99_ms"] for kind, phase in one["worst"].items()},
                  **{f"{kind}_ratio": ratio(phase, one["baseline"]) for kind, phase in one["worst"].items()}}
                 for one in rounds]
    medians = {kind: statistics.median(r[f"{kind}_ratio"] for r in per_round if r[f"{kind}_ratio"] is not None)
               for kind in c.worst if any(r[f"{kind}_ratio"] is not None for r in per_round)}
    return {"model": model, "url": url, "scenario": asdict(c), "load_average": _load_average(),
            "baseline": baseline, "worst": worst, "rounds": per_round, "with_hog": with_hog,
            "ttft_p99_ratio": ratio(with_hog, rounds[-1]["baseline"]), "worst_ttft_p99_ratio": medians,
            "server": server}


def _load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _classroom_table(r: dict) -> str:
    rows = [f"{r['model']} at {r['url']}: {r['scenario']['num_keys']} students x "
            f"{r['scenario']['requests_per_key']} streaming requests ({r['scenario']['concurrency']} at a time, "
            f"{r['scenario']['max_tokens']} tokens), per-key cap {r['scenario']['cap'] or 'none'}; "
            f"load average {r['load_average']}",
            f"{'phase':<16} {'reqs':>5} {'ok':>4} {'failed':>6} {'time s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TTFT max':>9} {'p99 ratio':>9}  (ms)"]
    first = r["rounds"][0]
    phases = [("baseline", r["baseline"], None)]
    phases += [(f"worst {kind}", phase, first[f"{kind}_ratio"]) for kind, phase in r["worst"].items()]
    phases.append(("with the hog", r["with_hog"], r["ttft_p99_ratio"]))
    for name, phase, ratio in phases:
        p = phase["polite"]
        f = lambda x: f"{'-':>9}" if x is None else f"{x:9.1f}"  # noqa: E731
        rows.append(f"{name:<16} {p['num_requests']:>5} {p['num_ok']:>4} {p['num_failed']:>6} "
                    f"{p['duration_s']:>7.2f} {f(p['ttft_p50_ms'])} {f(p['ttft_p99_ms'])} {f(p['ttft_max_ms'])} "
                    f"{'-' if ratio is None else f'{ratio:.2f}x':>9}")
        if p["first_error"]:
            rows.append(f"{'':<17}first failure: {p['first_error']}")
    for i, one in enumerate(r["rounds"][1:], 2):
        rows.append(f"round {i}: students alone p99 {one['baseline_ttft_p99_ms']:.0f} ms; " + ", ".join(
            f"beside worst {kind} {one[f'{kind}_ttft_p99_ms']:.0f} ms ({one[f'{kind}_ratio']:.2f}x)"
            for kind in r["worst"]))
    if r["worst_ttft_p99_ratio"]:
        rows.append("students' TTFT p99 beside the worst requests / alone, median over rounds: " + ", ".join(
            f"{kind} {x:.2f}x" for kind, x in r["worst_ttft_p99_ratio"].items()))
    for kind, phase in r["worst"].items():
        w = phase["other"] or {}
        rows.append(f"worst {kind} (client side): {w.get('ok', 0)} of {w.get('requests', 0)} requests answered, "
                    f"{w.get('chunks', 0)} chunks streamed, {w.get('statuses')}"
                    + (f"; first error {w['first_error']}" if w.get("first_error") else ""))
    rows.append(f"hog's answers (client side): {r['with_hog']['other']['statuses']}")
    s = r["server"]
    rows.append(f"server: hog 429s {s['hog_429']:.0f}, 413s {s['hog_413']:.0f}, streams cut for stalling "
                f"{s['hog_streams_stalled']:.0f}; 401s {s['unauthorized']:.0f}; idle connections cut "
                f"{s['connections_cut_header_timeout']:.0f}; students' 429s {s['students_429']:.0f}; "
                f"KV pool {'whole' if s['pool_whole'] else 'NOT whole'} "
                f"({s['kv_blocks_free']:.0f}/{s['kv_blocks_total']:.0f} free)")
    return "\n".join(rows)


def classroom_main(args, c: Classroom) -> int:
    """``--classroom``: start a server with a fresh keys file, run, print, stop."""
    keys = classroom_keys(c.num_keys)
    with tempfile.TemporaryDirectory(prefix="labkit-classroom-") as tmp:
        path = os.path.join(tmp, "keys.txt")
        with open(path, "w") as f:
            f.write("".join(f"{name}:{key}\n" for name, key in keys.items()))
        proc, url = _start_server(args.model or "tiny-llama", c.server_args(path) + shlex.split(args.server_args))
        try:
            result = run_classroom(url, keys, c, args.seed)
        finally:
            _stop_server(proc)
    print(json.dumps(result, indent=2) if args.json else _classroom_table(result))
    phases = [result["baseline"], result["with_hog"], *result["worst"].values()]
    ok = (all(p["polite"]["num_failed"] == 0 for p in phases) and all(r["failed"] == 0 for r in result["rounds"])
          and all((p["other"] or {}).get("ok", 0) + (p["other"] or {}).get("chunks", 0) > 0
                  for p in result["worst"].values())
          and result["server"]["pool_whole"] and (result["server"]["hog_429"] > 0 or not c.cap))
    return 0 if ok else 1


def _levels(text: str, p: argparse.ArgumentParser) -> list[int]:
    """``--concurrency``'s levels, or a usage error."""
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency takes integers like 1,4,16: {text!r}")
    if not levels or min(levels) < 1:
        p.error("--concurrency levels must be >= 1")
    return levels


def vs_vllm_main(args, p: argparse.ArgumentParser) -> int:
    """``--vs-vllm``: both servers in turn (``labkit.bench.http_vllm``); print the report.
    Exit status 0 when every level of every server that ran completed without a failure.
    ``--breakdown``: the phases of online and offline steps (``labkit.bench.http_breakdown``)."""
    from . import http_vllm
    w = http_vllm.QUICK if args.quick else http_vllm.Workload()
    w = http_vllm.Workload(
        levels=tuple(_levels(args.concurrency, p)) if args.concurrency else w.levels,
        num_prompts=args.num_requests or w.num_prompts, input_len=args.prompt_len or w.input_len,
        output_len=args.max_tokens or w.output_len, dtype=args.dtype, seed=args.seed)
    args.rounds = 1 if args.rounds is None else args.rounds
    if min(w.num_prompts, w.input_len, w.output_len, args.rounds) < 1:
        p.error("--num-requests, --prompt-len, --max-tokens and --rounds must be >= 1")
    if args.breakdown:
        from . import http_breakdown
        b = http_breakdown.run_breakdown(args.model or "smollm2-135m", w, not args.no_vllm, args.dtype)
        print(json.dumps(b, indent=2) if args.json else http_breakdown.format_breakdown(b))
        return 0
    r = http_vllm.compare(args.model or "smollm2-135m", w, with_vllm=not args.no_vllm, eager=args.vllm_eager,
                          labkit_args=shlex.split(args.server_args), other_srcs=args.labkit_src,
                          rounds=args.rounds)
    print(json.dumps(r, indent=2) if args.json else http_vllm.format_report(r))
    return 0 if http_vllm.succeeded(r) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.bench http", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default=None, help="a running server (loopback), e.g. http://127.0.0.1:8000")
    where.add_argument("--model", default=None,
                       help="start a server with this model for the run (tiny-llama, smollm2-135m, ...)")
    p.add_argument("--server-args", default="", help="extra options for the started server, e.g. '--num-blocks 512'")
    p.add_argument("--concurrency", default=None,
                   help="comma-separated client counts (default 1,4,16,64; with --vs-vllm 1,8,32)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per level (default: 4 x concurrency, at least 8; with --vs-vllm 32)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request, exact: ignore_eos (default 64; with --vs-vllm 32)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens per request (default 64; with --vs-vllm 128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v = p.add_argument_group("--vs-vllm: labkit serve and vllm serve in turn, measured by vLLM's own client")
    v.add_argument("--vs-vllm", action="store_true",
                   help="start labkit serve, then vllm serve (--model, default smollm2-135m), and run "
                        "`vllm bench serve` against each at every level (labkit.bench.http_vllm)")
    v.add_argument("--no-vllm", action="store_true",
                   help="skip the vLLM half (it is skipped, with the reason, when vLLM cannot run here)")
    v.add_argument("--vllm-eager", action="store_true",
                   help="vllm serve --enforce-eager: starts faster, runs slower than its default (compiled)")
    v.add_argument("--dtype", default="float32", help="both servers' dtype (default float32)")
    v.add_argument("--labkit-src", metavar="DIR", action="append", default=[],
                   help="also run labkit serve from DIR, another checkout (e.g. `git archive` of an older "
                        "commit), first, as labkit@DIRNAME: before and after in the same run (repeatable)")
    v.add_argument("--quick", action="store_true",
                   help="a small workload (levels 1,2; 4 prompts of 16 tokens, 4 output tokens), for tests")
    v.add_argument("--breakdown", action="store_true",
                   help="where an online step's time goes, phase by phase, beside the same engine offline at "
                        "the same concurrency (labkit.bench.http_breakdown; the --vs-vllm workload)")
    k = p.add_argument_group("--classroom: a class sharing one server, with and without a misbehaving key")
    k.add_argument("--classroom", action="store_true",
                   help="run the classroom scenario (starts its own server: --model, default tiny-llama)")
    default = Classroom()
    k.add_argument("--students", type=int, default=default.num_keys, help="polite keys (default %(default)s)")
    k.add_argument("--requests-per-student", type=int, default=default.requests_per_key,
                   help="streaming requests per student (default %(default)s)")
    p.add_argument("--rounds", type=int, default=None,
                   help="--classroom: rounds of (students alone, beside each worst request), each compared with "
                        "its own baseline (default 3); --vs-vllm: measure everything this many times, the servers "
                        "in the opposite order every other round (default 1). The ratios' median is reported")
    k.add_argument("--worst", default=",".join(default.worst),
                   help="worst-request phases to run, of stop, generate, score (default: all three) or none")
    k.add_argument("--cap", type=int, default=default.cap,
                   help="the server's --max-concurrent-per-key (default %(default)s; 0: no cap, no "
                        "round-robin, to see what the gate prevents)")
    args = p.parse_args(argv)
    if args.classroom:
        if args.url:
            p.error("--classroom starts its own server with the keys it needs: use --model, not --url")
        if args.students < 1 or args.requests_per_student < 1 or (args.cap != 0 and args.cap < 2):
            p.error("--students and --requests-per-student must be >= 1, --cap >= 2 (or 0: no gate)")
        worst = tuple(w.strip() for w in args.worst.split(",") if w.strip() and w.strip() != "none")
        if any(w not in ("stop", "generate", "score") for w in worst):
            p.error(f"--worst takes stop, generate, score or none, got {args.worst!r}")
        args.rounds = 3 if args.rounds is None else args.rounds
        if args.rounds < 1:
            p.error("--rounds must be >= 1")
        return classroom_main(args, Classroom(num_keys=args.students, requests_per_key=args.requests_per_student,
                                              cap=args.cap, worst=worst, rounds=args.rounds))
    if args.vs_vllm or args.breakdown:
        if args.url:
            p.error("--vs-vllm and --breakdown start their servers themselves: use --model, not --url")
        return vs_vllm_main(args, p)
    args.concurrency = args.concurrency or "1,4,16,64"
    args.max_tokens = args.max_tokens or 64
    args.prompt_len = args.prompt_len or 64
    levels = _levels(args.concurrency, p)
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
