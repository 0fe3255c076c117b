"""The class server, round two (issue 28): what one request may cost, whose cache it may
see, and OpenAI's answers, on a real server (tiny-llama, loopback, keys).

* per-request caps (stop strings, stop token ids, logit_bias, logprobs, prompt logprobs):
  one over the cap is a 400 naming the field, the cap and the option; one at every cap at
  once is served, and the pool is whole afterwards;
* the prefix cache is private to each key (hash and radix policies): key B's first
  request for a prompt key A has cached reports 0 cached tokens; per-key metrics count a
  key's own hits; ``--share-prefix-cache`` shares it;
* a prompt plus max_tokens beyond the context is a 400 in OpenAI's words; usage reports
  ``prompt_tokens_details.cached_tokens``; a lone surrogate is a 400 naming the field;
* 401, 413 and 429 close the connection without reading a large body; an idle kept-alive
  connection closes after its timeout; /docs and /openapi.json are off with keys;
* what a hostile student tries next: JSON nested too deep, another key's request id or
  cache namespace, a batch of prompts over the cap, one prompt of a batch over the context,
  a 1 MiB prompt (tokenized off the engine's thread).

Loopback only; every client call has a timeout; every loop is bounded.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from labkit.server import BackgroundServer, Limits, parse_metrics  # noqa: E402

pytestmark = pytest.mark.server

MODEL = "tiny-llama"                     # 512 tokens of context, a byte-level vocabulary of 384
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-9876543210", "carol": "sk-carol-5555555555"}
LIMITS = Limits(max_concurrent_per_key=4, max_tokens=64, max_stop_strings=6, max_stop_string_length=10,
                max_stop_token_ids=3, max_logit_bias=5, max_logprobs=4, max_prompt_logprobs=2,
                keep_alive_timeout_s=1.0, header_timeout_s=2.0, body_timeout_s=2.0, stall_timeout_s=3.0,
                max_body_bytes=256 * 1024)


def auth(name: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def start(**options) -> BackgroundServer:
    """20 ms between iterations: a held request stays in flight while a test looks at it."""
    limits = options.pop("limits", LIMITS)
    return BackgroundServer(model=MODEL, num_blocks=256, max_num_seqs=16, limits=limits, step_delay_s=0.02,
                            api_keys=[f"{n}:{k}" for n, k in KEYS.items()], **options)


@pytest.fixture(scope="module")
def server():
    with start(enable_prefix_caching="hash") as s:
        yield s


@pytest.fixture(scope="module")
def radix_server():
    with start(enable_prefix_caching="radix") as s:
        yield s


@pytest.fixture(autouse=True)
def every_block_free_after(request):
    """After each test, whatever it did: the servers it used return to idle, every block free."""
    yield
    used = [name for name in ("server", "radix_server") if name in request.fixturenames]
    assert used or request.node.name.startswith("test_an_instructor"), "a test here without a server"
    for name in used:
        assert_idle(request.getfixturevalue(name))


def post(s, body: dict, who: str = "alice", path: str = "/completions") -> httpx.Response:
    return httpx.post(s.base_url + path, json=body, headers=auth(who), timeout=TIMEOUT)


def metrics(s) -> dict[str, float]:
    r = httpx.get(s.url + "/metrics", headers=auth("carol"), timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return parse_metrics(r.text)


def assert_idle(s, timeout: float = 30.0) -> dict[str, float]:
    """Nothing running, waiting or held: every block free (cached-free counts as free)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(s)
        if (m["labkit_kv_blocks_used"] == 0 and m["labkit_num_requests_running"] == 0
                and m["labkit_num_requests_pending"] == 0 and m["labkit_gate_in_flight"] == 0):
            allocator = s.engine.llm.allocator
            allocator.check_invariants()
            assert allocator.num_free_blocks == allocator.num_blocks
            return m
        assert time.monotonic() < deadline, f"the server did not return to idle: {m}"
        time.sleep(0.05)


def error_of(r: httpx.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


# ---- per-request caps -------------------------------------------------------------------
OVER = [
    ({"stop": [f"s{i}" for i in range(7)]}, "stop", "7 strings", "at most 6 (--max-stop-strings)"),
    ({"stop": ["x" * 11]}, "stop", "11 characters", "at most 10 (--max-stop-string-length)"),
    ({"stop": "y" * 11}, "stop", "11 characters", "--max-stop-string-length"),         # one string
    ({"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", "4 token ids", "at most 3 (--max-stop-token-ids)"),
    ({"logit_bias": {str(t): 1 for t in range(6)}}, "logit_bias", "6 entries", "at most 5 (--max-logit-bias)"),
    ({"logprobs": 5}, "logprobs", "'logprobs' is 5", "at most 4 (--max-logprobs)"),
    ({"prompt_logprobs": 3}, "prompt_logprobs", "is 3", "at most 2 (--max-prompt-logprobs)"),
    ({"echo": True, "logprobs": 3}, "logprobs", "scores every prompt token", "--max-prompt-logprobs"),
]


@pytest.mark.parametrize("extra, param, what, cap", OVER, ids=[f"{o[1]}-{i}" for i, o in enumerate(OVER)])
def test_a_request_over_a_cap_gets_a_400_naming_it(server, extra, param, what, cap):
    error = error_of(post(server, {"prompt": "hi", "max_tokens": 2, **extra}))
    assert error["param"] == param and error["code"] == f"{param}_limit"
    assert what in error["message"] and cap in error["message"], error["message"]


def test_chat_top_logprobs_over_the_cap_is_named_as_chat_names_it(server):
    error = error_of(post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                   "logprobs": True, "top_logprobs": 5}, path="/chat/completions"))
    assert error["param"] == "top_logprobs" and "--max-logprobs" in error["message"]


def test_a_request_at_every_cap_at_once_is_served(server):
    """Streamed, n = the per-key cap, every per-token option at its cap, max_tokens at
    the server's limit: served whole (stop token ids banned by the bias, so it runs to
    the end), and every block is free afterwards."""
    stop_ids = [300, 301, 302]
    body = {"prompt": list(range(5, 380)), "max_tokens": LIMITS.max_tokens, "n": LIMITS.max_concurrent_per_key,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "stop": [f"\x01{i}" + "q" * 7 for i in range(LIMITS.max_stop_strings)],
            "stop_token_ids": stop_ids, "logit_bias": {**{str(t): -100 for t in stop_ids}, "7": 1, "8": -1},
            "logprobs": LIMITS.max_logprobs, "temperature": 1.0, "seed": 3, "top_p": 0.9, "top_k": 40, "min_p": 0.01,
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "return_token_ids": True}
    tokens, usage = {}, None
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=auth("bob"),
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for c in event["choices"]:
                    tokens[c["index"]] = tokens.get(c["index"], 0) + len(c["token_ids"])
                    assert c["logprobs"] is None or len(c["logprobs"]["tokens"]) == len(c["token_ids"])
                usage = event.get("usage") or usage
    assert tokens == {i: LIMITS.max_tokens for i in range(LIMITS.max_concurrent_per_key)}
    assert usage["completion_tokens"] == LIMITS.max_tokens * LIMITS.max_concurrent_per_key
    assert_idle(server)


# ---- the prefix cache, per key ------------------------------------------------------------
def cached(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("policy", ["server", "radix_server"], ids=["hash", "radix"])
def test_each_key_sees_only_its_own_cached_prompts(policy, request):
    """Both prefix-cache policies. Alice's prompt is cached for Alice only: Bob's first request for it reports 0 cached
    tokens (and so runs at the speed of a miss: nothing to time), his second his own hit.
    Naming Bob's namespace in cache_salt does not reach it. Per-key metrics count each
    key's own hits."""
    server = request.getfixturevalue(policy)
    prompt = list(range(100, 180))               # 80 tokens: 5 full blocks, 4 reusable
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    before = metrics(server)
    assert cached(post(server, body, "alice")) == 0
    assert cached(post(server, body, "alice")) == 64
    assert cached(post(server, body, "bob")) == 0                     # the done-when of the issue
    assert cached(post(server, body, "bob")) == 64
    for salt in ("key:bob", "key:alice", "bob"):                       # guessing a namespace: a miss
        assert cached(post(server, {**body, "cache_salt": salt}, "carol")) == 0
    assert cached(post(server, {**body, "cache_salt": "mine"}, "carol")) == 0
    assert cached(post(server, {**body, "cache_salt": "mine"}, "carol")) == 64     # a salt narrows, alone
    m = assert_idle(server)
    gained = {k: m[f'labkit_key_prompt_tokens_cached_total{{key="{k}"}}']
              - before.get(f'labkit_key_prompt_tokens_cached_total{{key="{k}"}}', 0) for k in KEYS}
    assert gained == {"alice": 64, "bob": 64, "carol": 64}


def test_streamed_usage_reports_cached_tokens(server):
    prompt = list(range(200, 260))
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    for expected in (0, 48):
        with httpx.stream("POST", server.base_url + "/completions", json=body, headers=auth("carol"),
                          timeout=TIMEOUT) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": expected}
    chat = {"messages": [{"role": "user", "content": "tell me about the blocks " * 4}], "max_tokens": 2}
    first = post(server, chat, "carol", "/chat/completions").json()["usage"]
    again = post(server, chat, "carol", "/chat/completions").json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] // 16 * 16 - (
        16 if first["prompt_tokens"] % 16 == 0 else 0)


def test_an_instructor_may_share_the_cache_across_keys():
    """--share-prefix-cache: a shared system prompt computed once for everyone; Bob's first
    request then hits what Alice cached (the privacy trade-off the option's help states)."""
    limits = Limits(max_concurrent_per_key=4, share_prefix_cache=True)
    with start(limits=limits, enable_prefix_caching="radix") as s:
        body = {"prompt": list(range(100, 180)), "max_tokens": 2, "temperature": 0}
        assert cached(post(s, body, "alice")) == 0
        assert cached(post(s, body, "bob")) == 64
        assert cached(post(s, {**body, "cache_salt": "private"}, "bob")) == 0    # vLLM's salt still works
        assert_idle(s)


# ---- OpenAI's answers ---------------------------------------------------------------------
def test_a_prompt_and_max_tokens_beyond_the_context_is_a_400_in_openai_words(server):
    r = post(server, {"prompt": [5] * 500, "max_tokens": 20})
    error = error_of(r)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert error["message"] == ("This model's maximum context length is 512 tokens, however you requested 520 "
                                "tokens (500 in your prompt; 20 for the completion). Please reduce your prompt; "
                                "or completion length.")
    long_chat = {"messages": [{"role": "user", "content": "x" * 470}], "max_tokens": 60}
    error = error_of(post(server, long_chat, path="/chat/completions"))
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, you requested ")
    assert "in the messages, 60 in the completion). Please reduce the length of the messages or completion." \
        in error["message"]
    error = error_of(post(server, {"messages": [{"role": "user", "content": "x" * 600}]}, path="/chat/completions"))
    assert "However, your messages resulted in" in error["message"] and error["code"] == "context_length_exceeded"
    # without max_tokens, chat gets what the prompt leaves (here less than the server's limit of 64)
    r = post(server, {"messages": [{"role": "user", "content": "x" * 430}], "ignore_eos": True},
             path="/chat/completions")
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == 512 and u["completion_tokens"] < LIMITS.max_tokens
    # one prompt of a batch over the context: a 400, and none of the batch ran
    before = metrics(server)
    error = error_of(post(server, {"prompt": [[5, 6, 7], [5] * 510], "max_tokens": 8}))
    assert "510 in your prompt; 8 for the completion" in error["message"]
    m = assert_idle(server)
    assert m["labkit_generation_tokens_total"] == before["labkit_generation_tokens_total"]


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
    (b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    (b'{"prompt": "ok", "max_tokens": 2, "stop": ["\\ud83d"]}', "stop"),
    (b'{"prompt": "ok", "max_tokens": 2, "user": "\\udc00"}', "user"),
    (b'{"prompt": "ok", "max_tokens": 2, "metadata": {"\\ud800": "key"}}', "metadata"),
    (b'{"prompt": "ab\xed\xa0\x80c", "max_tokens": 2}', "prompt"),        # the surrogate's raw bytes
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, raw, param):
    r = httpx.post(server.base_url + "/completions", content=raw, timeout=TIMEOUT,
                   headers={**auth("alice"), "Content-Type": "application/json"})
    error = error_of(r)
    assert error["param"] == param and error["code"] == "invalid_unicode"
    assert "lone UTF-16 surrogate" in error["message"]


def test_a_surrogate_pair_is_one_character_and_is_served(server):
    r = httpx.post(server.base_url + "/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}',
                   headers={**auth("alice"), "Content-Type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    messages = {"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}
    error = error_of(httpx.post(server.base_url + "/chat/completions", content=json.dumps(messages).replace(
        "\\\\", "\\").encode(), headers={**auth("alice"), "Content-Type": "application/json"}, timeout=TIMEOUT))
    assert error["param"] == "messages" and "messages[0].content" in error["message"]


# ---- cheap refusals ---------------------------------------------------------------------
def push_body(port: int, head: bytes, limit: int = 200 << 20) -> tuple[bytes, int, float]:
    """Send ``head`` then body bytes until the server stops taking them (or ``limit``),
    reading what it answers meanwhile. Returns (answer, bytes sent, seconds)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    answer, sent, start = bytearray(), 0, time.monotonic()

    def read():
        try:
            while chunk := sock.recv(65536):
                answer.extend(chunk)
        except OSError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        sock.sendall(head)
        chunk = b"x" * 65536
        while sent < limit and time.monotonic() - start < 20:
            sent += sock.send(chunk)
    except OSError:
        pass                                  # reset by the server: what we want
    elapsed = time.monotonic() - start
    reader.join(10)
    sock.close()
    return bytes(answer), sent, elapsed


def head(path: str = "/v1/completions", key: str | None = None, length: int = 200 << 20) -> bytes:
    auth_line = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth_line}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def test_refusals_close_the_connection_without_reading_the_body(server):
    """A 200 MiB upload without a key, with a declared size over the limit, or from a key at
    its cap: the answer comes at once, then the connection closes. The server takes at most
    a few MiB of socket buffers, never the 200 MiB (a server that drained the body would take
    it all, at loopback speed, in well under the 20 s allowed)."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        answer, sent, elapsed = push_body(server.port, head(path))
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower()
        assert sent < 32 << 20 and elapsed < 10, (sent, elapsed)
    answer, sent, _ = push_body(server.port, head(key=KEYS["alice"], length=LIMITS.max_body_bytes + 1))
    assert answer.startswith(b"HTTP/1.1 413") and sent < 32 << 20
    hold = {"prompt": [5, 6, 7], "max_tokens": 64, "ignore_eos": True, "n": LIMITS.max_concurrent_per_key,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=hold, headers=auth("carol"),
                      timeout=TIMEOUT) as held:
        lines = held.iter_lines()             # kept: a dropped iterator closes the connection
        next(lines)
        at_cap = metrics(server)['labkit_key_concurrency{key="carol"}']      # carol is at her cap now
        answer, _, _ = push_body(server.port, head(key=KEYS["carol"], length=LIMITS.max_body_bytes),
                                 limit=LIMITS.max_body_bytes)
        assert answer.startswith(b"HTTP/1.1 429") and b"retry-after" in answer.lower(), (at_cap, answer[:300])
        assert b"connection: close" in answer.lower()
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    assert_idle(server)


def test_an_idle_kept_alive_connection_is_closed(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with sock:
        for _ in range(2):                       # in use within the timeout: kept
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b'{"status":"ok"}'):
                chunk = sock.recv(4096)
                assert chunk, f"closed while answering: {answer!r}"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(LIMITS.keep_alive_timeout_s / 3)
        start = time.monotonic()
        sock.settimeout(LIMITS.keep_alive_timeout_s + 5)
        assert sock.recv(4096) == b""            # then idle: closed by the server
        assert time.monotonic() - start < LIMITS.keep_alive_timeout_s + 2


def test_the_startup_heap_is_frozen(server):
    """The model's and torch's objects are out of the garbage collector's reach (``heap.py``):
    a full collection set off by requests' garbage walks only what requests made."""
    import gc
    assert gc.get_freeze_count() > 100_000


def test_docs_and_openapi_are_off_with_keys(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=TIMEOUT).status_code == 404
        assert httpx.get(server.url + path, headers=auth("alice"), timeout=TIMEOUT).status_code == 404


# ---- what a hostile student tries next -----------------------------------------------------
def test_json_nested_too_deep_is_a_400_not_a_crash(server):
    for raw in (b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        r = httpx.post(server.base_url + "/completions", content=raw, timeout=TIMEOUT,
                       headers={**auth("alice"), "Content-Type": "application/json"})
        assert r.status_code == 400, r.text
    assert post(server, {"prompt": "still serving", "max_tokens": 1}).status_code == 200


def test_a_request_id_lives_in_its_key_namespace(server):
    """Bob holds a request with X-Request-Id "r1"; Alice sending the same id is not refused
    as a duplicate (she cannot occupy or probe Bob's ids), and both get their answers."""
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=TIMEOUT,
                      headers={**auth("bob"), "X-Request-Id": "r1"}) as held:
        lines = held.iter_lines()             # kept: a dropped iterator closes the connection
        next(lines)
        r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1}, timeout=TIMEOUT,
                       headers={**auth("alice"), "X-Request-Id": "r1"})
        assert r.status_code == 200 and r.json()["id"] == "r1"
        r = httpx.post(server.base_url + "/completions", json={"prompt": "x", "max_tokens": 1}, timeout=TIMEOUT,
                       headers={**auth("bob"), "X-Request-Id": "r1"})
        assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]     # his own, twice
    assert_idle(server)


def test_bad_cache_salts_are_400s(server):
    for salt in ("", 5, ["a"]):
        assert post(server, {"prompt": "x", "max_tokens": 1, "cache_salt": salt}).status_code == 400


def test_a_batch_over_the_cap_is_refused_before_any_prompt_is_tokenized(server):
    before = server.engine.stats()["prompt_tokens"]
    calls = []
    real = server.engine.tokenize

    async def counting(prompt):
        calls.append(prompt)
        return await real(prompt)

    server.engine.tokenize = counting
    try:
        error = error_of(post(server, {"prompt": ["x"] * 5000, "max_tokens": 1}))
    finally:
        del server.engine.tokenize
    assert "5000 sequences" in error["message"] and calls == []
    assert server.engine.stats()["prompt_tokens"] == before


def test_a_large_prompt_is_tokenized_off_the_engine_thread(server):
    """A text prompt of ~250 KB (over the context: a 400) is tokenized on the tokenizer's
    thread, never on the engine's, which serves a running stream meanwhile."""
    threads = []
    tokenizer = server.engine.tokenizer
    real = tokenizer.encode

    def recording(*a, **k):
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    tokenizer.encode = recording
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/completions", json=body, headers=auth("bob"),
                          timeout=TIMEOUT) as running:
            lines = running.iter_lines()
            next(lines)
            error = error_of(post(server, {"prompt": "word " * 50_000, "max_tokens": 1}))
            assert error["code"] == "context_length_exceeded"
            assert sum(1 for line in lines if line.startswith("data: {")) > 0       # it went on
    finally:
        del tokenizer.encode
    assert threads and all(name.startswith("labkit-tokenize") for name in threads), threads
    assert_idle(server)
