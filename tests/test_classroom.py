"""A server a class shares: API keys, no exposure by accident, a fair share per key, limits.

* keys: files, environment, names; 401 with OpenAI's body; constant-time lookup; /health open;
* a non-loopback address without a key refuses to start (before a model loads);
* the admission gate: a cap per key (429 + Retry-After at once), round-robin across keys;
* limits: max_tokens cap, body size (413), slow bodies and silent connections (408, slowloris),
  a stream whose client stops reading (cut, aborted, blocks freed, counted per key);
* the classroom load test: 30 polite keys beside a hog, on a real server in a subprocess.

Loopback only; every client call has a timeout; every loop is bounded.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from labkit.server import BackgroundServer, parse_metrics  # noqa: E402
from labkit.server import auth as auth_module  # noqa: E402
from labkit.server.auth import ENV_VAR, KeyRing, load_keys  # noqa: E402
from labkit.server.background import ExposureError, check_exposure  # noqa: E402
from labkit.server.fairness import AdmissionGate, OverCapError  # noqa: E402
from labkit.server.limits import Limits, default_max_concurrent_per_key  # noqa: E402

MODEL = "tiny-llama"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"


# ---- keys -------------------------------------------------------------------------------
def test_keys_from_options_file_and_environment(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("\ufeff# the class of 2026\r\n\nalice:sk-a1\r\n  sk-anon  \nbob:sk-b:with-colon\n")
    ring = load_keys(["teacher:sk-t"], path, environ={ENV_VAR: "sk-env1, ta:sk-env2"})
    assert ring.names == ["teacher", "alice", "key-3", "bob", "key-5", "ta"]
    assert ring.name_of("Bearer sk-a1") == "alice"
    assert ring.name_of("bearer   sk-anon") == "key-3"
    assert ring.name_of("Bearer sk-b:with-colon") == "bob"       # the first colon splits
    assert ring.name_of("Bearer sk-env1") == "key-5"
    for bad in (None, "", "sk-a1", "Basic sk-a1", "Bearer ", "Bearer sk-a", "Bearer sk-a1x"):
        assert ring.name_of(bad) is None, bad
    assert "sk-" not in repr(ring)


@pytest.mark.parametrize("entries, message", [
    (["a:k1", "b:k1"], "same as an earlier key"),
    (["a:k1", "a:k2"], "given twice"),
    (["bad name:k1"], "must be 1-64 characters"),
    (["a:"], "non-empty"),
    (["a:two words"], "non-empty and without whitespace"),
])
def test_bad_keys_are_refused_with_a_reason(entries, message):
    with pytest.raises(ValueError, match=message):
        load_keys(entries, environ={})


def test_keys_file_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_keys(keys_file=tmp_path / "missing.txt", environ={})
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_keys(keys_file=empty, environ={})
    bad = tmp_path / "bad.txt"
    bad.write_text("a:k1\nb:k1\n")
    with pytest.raises(ValueError, match="bad.txt line 2"):
        load_keys(keys_file=bad, environ={})


def test_key_lookup_compares_every_key(monkeypatch):
    """Constant time: a match on the first key still compares all the others."""
    ring = KeyRing([(f"s{i}", f"sk-{i}") for i in range(20)])
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counting)
    assert ring.name_of("Bearer sk-0") == "s0"
    assert len(calls) == 20
    calls.clear()
    assert ring.name_of("Bearer sk-none") is None
    assert len(calls) == 20


# ---- exposure and the CLI ---------------------------------------------------------------
def test_non_loopback_without_a_key_is_refused():
    for host in ("0.0.0.0", "::", "192.168.1.10"):
        with pytest.raises(ExposureError, match="--api-key.*--allow-unauthenticated"):
            check_exposure(host, KeyRing())
        check_exposure(host, KeyRing([("a", "k")]))              # a key: fine
        check_exposure(host, KeyRing(), allow_unauthenticated=True)
    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure(host, KeyRing())
    with pytest.raises(ExposureError):                            # checked before a model loads
        BackgroundServer(host="0.0.0.0", model="no-such-model")


def test_banner_says_who_can_reach_the_server():
    from labkit.server.background import describe_access
    private = describe_access("127.0.0.1", KeyRing(), Limits())
    assert "from this machine only" in private and "no per-client cap" in private
    shared = describe_access("0.0.0.0", KeyRing([("alice", "k1"), ("bob", "k2")]),
                             Limits(max_concurrent_per_key=8, max_tokens=256))
    assert "from the network" in shared and "2 API keys (alice, bob)" in shared
    assert "at most 8 sequences" in shared and "max_tokens <= 256" in shared and "/metrics needs a key" in shared
    assert "k1" not in shared
    open_ = describe_access("0.0.0.0", KeyRing(), Limits())
    assert "with no API key (anyone who reaches it may use it)" in open_


def test_cli_refuses_before_loading_a_model(capsys, monkeypatch):
    from labkit.__main__ import main
    monkeypatch.delenv(ENV_VAR, raising=False)
    start = time.monotonic()
    assert main(["serve", "--host", "0.0.0.0", "--model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0 without an API key" in err and "--api-keys-file" in err
    assert main(["serve", "--api-key", "a:k", "--api-key", "b:k", "--model", "no-such-model"]) == 2
    assert "same as an earlier key" in capsys.readouterr().err
    assert main(["serve", "--max-concurrent-per-key", "-1", "--model", "no-such-model"]) == 2
    assert time.monotonic() - start < 10


def test_cli_backends_and_help(capsys):
    from labkit.__main__ import _parser, main
    from labkit.kernels.backend import BACKENDS
    serve = _parser()._subparsers._group_actions[0].choices["serve"]
    action = next(a for a in serve._actions if a.dest == "attention_backend")
    assert tuple(action.choices) == BACKENDS and "cpu" in action.choices
    assert main([]) == 2
    assert "serve" in capsys.readouterr().out


def test_limits_are_checked():
    assert default_max_concurrent_per_key(64) == 8 and default_max_concurrent_per_key(4) == 1
    for bad in (dict(max_tokens=0), dict(max_concurrent_per_key=-1), dict(max_body_bytes=10),
                dict(stall_timeout_s=0), dict(max_tokens=True), dict(max_stop_strings=-1),
                dict(max_stop_string_length=0), dict(max_logprobs=21), dict(max_prompt_logprobs=-1),
                dict(max_logit_bias=True), dict(keep_alive_timeout_s=0)):
        with pytest.raises(ValueError):
            Limits(**bad)


def test_cli_limits_reach_the_server(monkeypatch):
    """The CLI's written-out defaults are Limits' own (its --help imports no server), and
    every per-request option lands in the Limits the server gets."""
    from labkit.__main__ import SERVE_DEFAULTS, _access, _parser
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert {name: getattr(Limits(), name) for name in SERVE_DEFAULTS} == SERVE_DEFAULTS
    _, limits = _access(_parser().parse_args(["serve", "--model", "tiny-llama"]))
    assert {name: getattr(limits, name) for name in SERVE_DEFAULTS} == SERVE_DEFAULTS
    assert limits.share_prefix_cache is False and limits.max_prompt_logprobs == 20      # private: vLLM's
    _, shared = _access(_parser().parse_args(["serve", "--api-key", "a:k"]))
    assert shared.max_prompt_logprobs == 1                                               # shared: scoring only
    args = _parser().parse_args(["serve", "--api-key", "a:k", "--max-stop-strings", "4", "--max-stop-string-length",
                                 "16", "--max-stop-token-ids", "2", "--max-logit-bias", "10", "--max-logprobs", "5",
                                 "--max-prompt-logprobs", "0", "--keep-alive-timeout", "2.5", "--share-prefix-cache"])
    _, limits = _access(args)
    assert (limits.max_stop_strings, limits.max_stop_string_length, limits.max_stop_token_ids, limits.max_logit_bias,
            limits.max_logprobs, limits.max_prompt_logprobs, limits.keep_alive_timeout_s,
            limits.share_prefix_cache) == (4, 16, 2, 10, 5, 0, 2.5, True)
    with pytest.raises(ValueError, match="max_logprobs"):
        _access(_parser().parse_args(["serve", "--max-logprobs", "50"]))


# ---- the admission gate, without HTTP ---------------------------------------------------
def test_gate_cap_and_round_robin():
    """Budget 2: A's four requests and B's one. B goes in before A's last two (round robin),
    where FCFS would have put it behind them. The cap refuses at once; places balance."""
    async def main():
        gate = AdmissionGate(cap=4, budget=2)
        order = []

        async def ask(client, tag):
            ticket = await gate.acquire(client, 1)
            order.append(tag)
            return ticket

        a1, a2 = await ask("A", "A1"), await ask("A", "A2")            # room: in at once
        waiting = [asyncio.ensure_future(ask("A", "A3")), asyncio.ensure_future(ask("A", "A4"))]
        await asyncio.sleep(0)
        waiting.append(asyncio.ensure_future(ask("B", "B1")))
        await asyncio.sleep(0)
        assert gate.num_queued == 3 and gate.clients["A"].concurrency == 4
        with pytest.raises(OverCapError):                              # A is at its cap
            await gate.acquire("A", 1)
        with pytest.raises(ValueError, match="at most 4"):
            await gate.acquire("C", 5)
        gate.release(a1)
        gate.release(a2)
        tickets = await asyncio.gather(*waiting[:1], waiting[2])        # A3 and B1 got the places
        assert order == ["A1", "A2", "A3", "B1"] and not waiting[1].done()
        for t in tickets:
            gate.release(t)
        a4 = await waiting[1]
        gate.release(a4)
        gate.release(a4)                                               # idempotent
        assert gate.in_flight == 0 and gate.num_queued == 0
        assert all(u.concurrency == 0 for u in gate.clients.values())
        assert gate.clients["A"].requests == 4 and gate.clients["B"].requests == 1

    asyncio.run(asyncio.wait_for(main(), 10))


def test_gate_withdraws_a_cancelled_wait():
    async def main():
        gate = AdmissionGate(cap=2, budget=1)
        first = await gate.acquire("A", 1)
        waiter = asyncio.ensure_future(gate.acquire("B", 1))
        await asyncio.sleep(0)
        assert gate.clients["B"].queued == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.clients["B"].concurrency == 0 and gate.num_queued == 0
        gate.release(first)
        assert gate.in_flight == 0

    asyncio.run(asyncio.wait_for(main(), 10))


# ---- a keyed server ---------------------------------------------------------------------
# Small buffers (4 KiB) so that an unread stream stalls long before its request could end.
LIMITS = Limits(max_concurrent_per_key=8, max_tokens=200, max_body_bytes=64 * 1024, header_timeout_s=1.0,
                body_timeout_s=1.0, stall_timeout_s=2.0, write_buffer_bytes=4096)


@pytest.fixture(scope="module")
def server():
    """Keys for alice and bob; 10 ms between iterations, so that a long request stays
    running while a test looks at it."""
    with BackgroundServer(model=MODEL, num_blocks=512, max_num_seqs=32, step_delay_s=0.01,
                          api_keys=[f"alice:{ALICE}", f"bob:{BOB}"], limits=LIMITS) as s:
        yield s


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def metrics(s, key: str = ALICE) -> dict[str, float]:
    r = httpx.get(s.url + "/metrics", headers=auth(key), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def wait_until_idle(s, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(s)
        if (m["labkit_kv_blocks_used"] == 0 and m["labkit_num_requests_running"] == 0
                and m["labkit_gate_in_flight"] == 0 and m["labkit_gate_queued"] == 0):
            return m
        assert time.monotonic() < deadline, f"the server did not return to idle: {m}"
        time.sleep(0.05)


@pytest.mark.server
def test_401_without_a_valid_key(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for headers, reason in (({}, "missing"), (auth("sk-wrong"), "invalid"), ({"Authorization": ALICE}, "invalid")):
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
            r = (httpx.get(server.url + path, headers=headers, timeout=TIMEOUT) if path == "/v1/models" else
                 httpx.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT))
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200     # open
    assert httpx.get(server.url + "/metrics", timeout=TIMEOUT).status_code == 401    # needs a key
    r = httpx.post(server.base_url + "/completions", json=body, headers=auth(BOB), timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    text = httpx.get(server.url + "/metrics", headers=auth(BOB), timeout=TIMEOUT).text
    assert ALICE not in text and BOB not in text                                        # names only
    m = parse_metrics(text)
    assert m['labkit_unauthorized_total{reason="missing"}'] >= 3
    assert m['labkit_unauthorized_total{reason="invalid"}'] >= 6
    assert m['labkit_key_requests_total{key="bob"}'] >= 1
    assert m['labkit_key_generation_tokens_total{key="bob"}'] >= 2


@pytest.mark.server
def test_openai_client_with_a_key(server):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=server.base_url, api_key=ALICE, timeout=30, max_retries=0)
    out = good.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    bad = openai.OpenAI(base_url=server.base_url, api_key="sk-nope", timeout=30, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=3)


@pytest.mark.server
def test_over_the_cap_gets_429_at_once_and_others_go_on(server):
    """Alice holds 8 sequences (one request, n=8): her next request gets 429 with
    Retry-After at once; Bob is served meanwhile; a request larger than the cap is a 400."""
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "n": 8, "stream": True}
    with httpx.Client(timeout=TIMEOUT, headers=auth(ALICE)) as http:
        with http.stream("POST", server.base_url + "/completions", json=body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()         # kept: a dropped iterator closes the connection
            next(lines)                                               # running now
            start = time.monotonic()
            r = http.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 429 and time.monotonic() - start < 5
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert "limit per client is 8" in r.json()["error"]["message"]
            r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 2},
                           headers=auth(BOB), timeout=TIMEOUT)
            assert r.status_code == 200
            assert metrics(server)['labkit_key_concurrency{key="alice"}'] == 8
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1, "n": 9},
                   headers=auth(BOB), timeout=TIMEOUT)
    assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]
    m = wait_until_idle(server)
    assert m['labkit_key_errors_total{key="alice",status="429"}'] >= 1
    assert m['labkit_key_concurrency{key="alice"}'] == 0


@pytest.mark.server
def test_max_tokens_limit(server):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 201},
                   headers=auth(BOB), timeout=TIMEOUT)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens" and r.json()["error"]["code"] == "max_tokens_limit"
    # a chat request without max_tokens gets the limit as its default, not the whole context
    r = httpx.post(server.base_url + "/chat/completions", headers=auth(BOB), timeout=TIMEOUT,
                   json={"messages": [{"role": "user", "content": "go"}], "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200


def raw_request(port: int, head: bytes, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    if head:
        sock.sendall(head)
    return sock


def read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data


@pytest.mark.server
def test_body_limits(server):
    big = b'{"prompt": "' + b"x" * (100 * 1024) + b'"}'
    r = httpx.post(server.base_url + "/completions", content=big, timeout=TIMEOUT,
                   headers={**auth(BOB), "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a body that starts and never ends: 408 after body_timeout_s
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {BOB}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"").encode()
    start = time.monotonic()
    with raw_request(server.port, head) as sock:
        answer = read_all(sock, 10)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 8
    assert metrics(server)['labkit_key_errors_total{key="bob",status="413"}'] >= 1


@pytest.mark.server
@pytest.mark.slow
def test_silent_and_trickling_connections_are_cut(server):
    """Slowloris: a connection that sends nothing, and one that sends its request head a
    byte at a time, are closed after header_timeout_s (1 s here), with a 408."""
    before = metrics(server)['labkit_connections_cut_total{reason="header_timeout"}']
    start = time.monotonic()
    silent = raw_request(server.port, b"")
    trickle = raw_request(server.port, b"P")
    for byte in b"OST /v1/completions HTTP/1.1\r\n":                 # 0.1 s per byte: too slow
        time.sleep(0.1)
        try:
            trickle.send(bytes([byte]))
        except OSError:
            break
    for sock in (silent, trickle):
        with sock:
            assert read_all(sock, 10).startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < 8
    assert metrics(server)['labkit_connections_cut_total{reason="header_timeout"}'] == before + 2
    # a kept-alive client that sends its next request promptly is not affected
    with httpx.Client(timeout=TIMEOUT, headers=auth(BOB)) as http:
        for _ in range(3):
            assert http.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200
            time.sleep(1.2)


@pytest.mark.server
def test_a_stream_nobody_reads_is_cut_and_freed(server):
    """A client that stops reading: the server buffers a bounded amount, then cuts the
    connection after stall_timeout_s, aborts the request and frees its KV blocks."""
    before = metrics(server)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "n": 8, "stream": True,
                       "return_token_ids": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALICE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    with raw_request(server.port, head, rcvbuf=4096):
        deadline = time.monotonic() + 120
        while metrics(server)['labkit_key_streams_stalled_total{key="alice"}'] == \
                before.get('labkit_key_streams_stalled_total{key="alice"}', 0):
            assert time.monotonic() < deadline, "the unread stream was never cut"
            time.sleep(0.2)
    m = wait_until_idle(server)
    assert m['labkit_connections_cut_total{reason="stalled"}'] == \
        before['labkit_connections_cut_total{reason="stalled"}'] + 1
    assert m["labkit_requests_aborted_total"] == before["labkit_requests_aborted_total"] + 1
    assert m["labkit_generation_tokens_total"] - before["labkit_generation_tokens_total"] < 8 * 200
    assert m["labkit_kv_blocks_free"] == m["labkit_kv_blocks_total"]


@pytest.mark.server
def test_round_robin_through_http():
    """max_num_seqs=2: Alice's four queued requests do not keep Bob's one waiting behind
    all of them: his goes in before her fourth (FCFS would start it last)."""
    with BackgroundServer(model=MODEL, num_blocks=128, max_num_seqs=2, step_delay_s=0.01,
                          api_keys=[f"alice:{ALICE}", f"bob:{BOB}"],
                          limits=Limits(max_concurrent_per_key=4)) as s:
        first_token: dict[str, float] = {}

        def ask(key, tag):
            body = {"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", s.base_url + "/completions", json=body, headers=auth(key),
                              timeout=TIMEOUT) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        first_token.setdefault(tag, time.monotonic())

        threads = [threading.Thread(target=ask, args=(ALICE, f"A{i}")) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while True:          # Bob asks once Alice has two requests running and two queued
            m = parse_metrics(httpx.get(s.url + "/metrics", headers=auth(BOB), timeout=TIMEOUT).text)
            # Alice's gauge appears with her first request: until then she has none running
            if m.get('labkit_key_concurrency{key="alice"}', 0) == 4 and m["labkit_gate_queued"] == 2:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.01)
        threads.append(threading.Thread(target=ask, args=(BOB, "B")))
        threads[-1].start()
        for t in threads:
            t.join(60)
        assert len(first_token) == 5, first_token
        order = sorted(first_token, key=first_token.get)
        assert order.index("B") < 4, order           # FCFS would have put Bob last
        m = parse_metrics(httpx.get(s.url + "/metrics", headers=auth(BOB), timeout=TIMEOUT).text)
        assert m["labkit_gate_in_flight"] == 0 and m['labkit_key_requests_total{key="alice"}'] == 4


@pytest.mark.server
def test_without_keys_per_address_and_a_queued_client_that_leaves():
    """No keys: the cap is per client address (all of loopback here). A request queued in
    the gate whose client goes away is withdrawn; an engine refusal gives its places back."""
    with BackgroundServer(model=MODEL, num_blocks=128, max_num_seqs=1, step_delay_s=0.01,
                          limits=Limits(max_concurrent_per_key=2)) as s:
        def gauges():
            m = parse_metrics(httpx.get(s.url + "/metrics", timeout=TIMEOUT).text)
            return m.get('labkit_key_concurrency{key="127.0.0.1"}', 0), m["labkit_gate_queued"]

        def until(want, timeout=20.0):
            deadline = time.monotonic() + timeout
            while gauges() != want:
                assert time.monotonic() < deadline, (gauges(), want)
                time.sleep(0.02)

        long = {"prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.base_url + "/completions", json=long, timeout=TIMEOUT) as held:
            lines = held.iter_lines()
            next(lines)
            body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
            queued = raw_request(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            until((2, 1))                                     # running 1 + queued 1 = the cap
            r = httpx.post(s.base_url + "/completions", json={"prompt": "y", "max_tokens": 1}, timeout=TIMEOUT)
            assert r.status_code == 429
            queued.close()                                    # gives up while waiting
            until((1, 0))
        until((0, 0))
        r = httpx.post(s.base_url + "/completions", json={"prompt": "x" * 600, "max_tokens": 1}, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert gauges() == (0, 0)
        m = parse_metrics(httpx.get(s.url + "/metrics", timeout=TIMEOUT).text)     # no keys: open
        assert m['labkit_key_errors_total{key="127.0.0.1",status="429"}'] == 1
        assert m["labkit_gate_in_flight"] == 0 and m["labkit_kv_blocks_used"] == 0


# ---- the classroom load test --------------------------------------------------------------
# The bound is loose on purpose: on a shared 2-core runner the same workload's TTFT p99 varies
# 2-5x from run to run, and the hog's ~100 refused requests a second take CPU from the engine
# (0.5-2 s more). Without the gate the students' TTFT p99 is 20-30 s, or nobody is served.
TTFT_FACTOR, TTFT_SLACK_MS = 3.0, 2000.0


@pytest.mark.server
@pytest.mark.slow
def test_classroom_load():
    """30 polite keys, two requests in flight each, beside one hog (40 unread streams,
    a flood of long requests retried at once, 2 MiB bodies, wrong keys, silent
    connections), on ``python -m labkit serve`` in a subprocess. The students' TTFT p99
    stays within TTFT_FACTOR x (+ TTFT_SLACK_MS) of the same workload without the hog; no
    student request fails or gets a 429; the hog gets 429s, 413s and 401s; the KV pool is
    whole at the end."""
    import os
    import tempfile

    from labkit.bench.http import Classroom, _start_server, _stop_server, classroom_keys, run_classroom
    c = Classroom(requests_per_key=2, timeout_s=240)        # worst phases: "generate" and "score"
    keys = classroom_keys(c.num_keys)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "keys.txt")
        with open(path, "w") as f:
            f.write("".join(f"{n}:{k}\n" for n, k in keys.items()))
        proc, url = _start_server(MODEL, c.server_args(path), timeout=120)
        try:
            r = run_classroom(url, keys, c)
        finally:
            _stop_server(proc)
    base, hog, server = r["baseline"]["polite"], r["with_hog"]["polite"], r["server"]
    assert base["num_failed"] == 0 and hog["num_failed"] == 0, (base["first_error"], hog["first_error"])
    assert base["num_ok"] == hog["num_ok"] == c.num_keys * c.requests_per_key
    assert hog["ttft_p99_ms"] <= TTFT_FACTOR * base["ttft_p99_ms"] + TTFT_SLACK_MS, r
    # The worst requests the limits allow, kept in flight by one key, and answered; the
    # students beside them served (the 2x figure is the benchmark's, in docs/classroom.md).
    for kind in c.worst:
        phase = r["worst"][kind]
        assert phase["polite"]["num_failed"] == 0, (kind, phase["polite"]["first_error"])
        assert phase["other"]["ok"] + phase["other"]["chunks"] >= 1, (kind, phase["other"])    # served
        assert not phase["other"]["first_error"], (kind, phase["other"])
        assert phase["polite"]["ttft_p99_ms"] <= TTFT_FACTOR * base["ttft_p99_ms"] + TTFT_SLACK_MS, (kind, r)
    assert server["students_429"] == 0
    assert server["hog_429"] > 0 and server["hog_413"] >= 1 and server["unauthorized"] >= 2 * c.hog_bad_keys
    assert server["connections_cut_header_timeout"] >= c.hog_idle
    assert server["pool_whole"] and server["gate_in_flight"] == 0, server
