"""The OpenAI-compatible server, for real: uvicorn on a free loopback port, tiny-llama.

* 32 concurrent streaming clients get exactly the offline API's greedy tokens and text;
* a client that disconnects mid-stream has its request aborted and its blocks freed;
* bad requests get their status and OpenAI's error body, queue overflow gets 429, while a
  long request streams on to completion; afterwards the KV pool is whole again.

Every client call has a timeout; nothing leaves the loopback interface.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.server import BackgroundServer, parse_metrics  # noqa: E402

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


# ---- fixtures -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with BackgroundServer(model=MODEL, num_blocks=256, max_num_seqs=64, max_waiting=256) as s:
        yield s


@pytest.fixture(scope="module")
def small_server():
    """One sequence at a time and one waiting request at most: easy to fill up."""
    with BackgroundServer(model=MODEL, num_blocks=64, max_num_seqs=1, max_waiting=1, step_delay_s=0.01) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, num_blocks=256)


def metrics(url: str) -> dict[str, float]:
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    return parse_metrics(r.text)


def wait_until_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["labkit_kv_blocks_used"] == 0 and m["labkit_num_requests_running"] == 0
                and m["labkit_num_requests_pending"] == 0 and m["labkit_num_seqs_waiting"] == 0):
            return m
        assert time.monotonic() < deadline, f"the server did not return to idle: {m}"
        time.sleep(0.05)


def sse_events(lines):
    """The JSON payloads of an SSE stream, up to ``data: [DONE]`` (which must come)."""
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", f"unexpected SSE line {line!r}"
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without data: [DONE]")


# ---- basics ----------------------------------------------------------------------------
def test_health_models_metrics(server):
    assert server.url.startswith("http://127.0.0.1:")
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = httpx.get(server.base_url + "/models", timeout=TIMEOUT).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    m = metrics(server.url)
    assert m["labkit_kv_blocks_total"] == 256 and m["labkit_kv_blocks_free"] == 256
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert "# TYPE labkit_generation_tokens_total counter" in text
    assert "# TYPE labkit_kv_blocks_used gauge" in text
    # a private server (no keys) describes its API; one with keys does not (test_server_limits.py)
    assert httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()["info"]["title"] == "labkit"


def test_concurrent_streams_equal_offline(server, offline):
    """32 streaming clients at staggered times get the offline API's greedy output."""
    rng = random.Random(0)
    cases = []
    for i in range(32):
        max_tokens = rng.randint(4, 24)
        if i % 8 == 7:
            messages = [{"role": "user", "content": f"Question {i}: " + "why? " * rng.randint(1, 6)}]
            cases.append(("chat", messages, max_tokens))
        elif i % 4 == 3:
            cases.append(("ids", [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))], max_tokens))
        else:
            cases.append(("text", f"Prompt {i}: " + "lorem ipsum " * rng.randint(0, 8), max_tokens))

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0)  # noqa: E731
    expected = []
    for kind, prompt, n in cases:
        if kind == "chat":
            expected.append(offline.chat(prompt, greedy(n), use_tqdm=False)[0].outputs[0])
        else:
            expected.append(offline.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0])

    async def client(http, i):
        kind, prompt, n = cases[i]
        await asyncio.sleep(0.004 * i)
        body = {"model": MODEL, "max_tokens": n, "temperature": 0, "stream": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        if kind == "chat":
            path, body["messages"] = "/chat/completions", prompt
        else:
            path, body["prompt"] = "/completions", prompt
        tokens, text, finish, usage = [], "", None, None
        async with http.stream("POST", server.base_url + path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines()]
        for event in sse_events(lines):
            if event.get("usage"):
                usage = event["usage"]
                continue
            (choice,) = event["choices"]
            tokens += choice["token_ids"]
            text += choice["delta"].get("content", "") if kind == "chat" else choice["text"]
            finish = choice["finish_reason"] or finish
        return tokens, text, finish, usage

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=64)) as http:
            return await asyncio.wait_for(asyncio.gather(*(client(http, i) for i in range(32))), 60)

    results = asyncio.run(main())
    for i, ((tokens, text, finish, usage), want) in enumerate(zip(results, expected)):
        assert tokens == want.token_ids, f"request {i} ({cases[i][0]}): tokens differ from LLM.generate"
        assert text == want.text, f"request {i}: text differs from LLM.generate"
        assert finish == want.finish_reason
        assert usage["completion_tokens"] == len(want.token_ids)
    m = wait_until_idle(server.url)
    assert m["labkit_requests_finished_total"] >= 32


def test_stop_string_streamed_text_equals_offline(server, offline):
    """Text that may begin a stop string is held back, so the stream never shows text
    that the stop string later cuts away."""
    prompt = "The stop string test"
    full = offline.generate(prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) >= 12, "tiny-llama produced too little text for this test"
    stop = text[len(text) // 2: len(text) // 2 + 3]
    want = offline.generate(prompt, SamplingParams(max_tokens=40, temperature=0, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=TIMEOUT) as r:
        events = list(sse_events(r.iter_lines()))
    streamed = "".join(e["choices"][0]["text"] for e in events)
    assert streamed == want.text and stop not in streamed
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_async_engine_cancelled_task_aborts(server):
    """Cancelling the task that reads a stream aborts the request (no HTTP involved)."""
    engine = server.engine

    async def reader(seen):
        async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True)):
            seen.append(len(out.outputs[0].token_ids))

    async def main():
        seen = []
        task = asyncio.ensure_future(reader(seen))
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(main(), 30))
    wait_until_idle(server.url)


def test_idle_engine_sleeps(server):
    """With nothing to do, the engine thread blocks: it uses (almost) no CPU time."""
    tid = server.engine._thread.native_id
    stat = f"/proc/self/task/{tid}/stat"
    try:
        open(stat).close()
    except OSError:
        pytest.skip("needs Linux /proc to read a thread's CPU time")

    def cpu_ticks():
        fields = open(stat).read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])      # utime + stime

    wait_until_idle(server.url)
    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 2, "the idle engine thread is busy-waiting"


def test_non_streaming_batch_and_n(server):
    body = {"model": MODEL, "prompt": ["abc", [5, 6, 7]], "n": 2, "max_tokens": 5,
            "temperature": 0.8, "seed": 1, "return_token_ids": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion"
    assert [c["index"] for c in sorted(out["choices"], key=lambda c: c["index"])] == [0, 1, 2, 3]
    assert all(len(c["token_ids"]) == 5 and c["finish_reason"] == "length" for c in out["choices"])
    assert out["usage"] == {"prompt_tokens": 3 + 3, "completion_tokens": 20, "total_tokens": 26,
                            "prompt_tokens_details": {"cached_tokens": 0}}      # 3-token prompts: no full block
    # the same seed gives the same samples again
    again = httpx.post(server.base_url + "/completions", json=body, timeout=TIMEOUT).json()
    key = lambda o: sorted((c["index"], c["token_ids"]) for c in o["choices"])  # noqa: E731
    assert key(again) == key(out)


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="labkit", timeout=30, max_retries=0)
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)


def test_disconnect_mid_stream_frees_blocks(server):
    before = metrics(server.url)
    body = {"model": MODEL, "prompt": "a long story " * 8, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", server.base_url + "/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(6):             # a few chunks: the request is running now
                next(lines)
            busy = metrics(server.url)
            assert busy["labkit_num_requests_running"] == 1 and busy["labkit_kv_blocks_used"] > 0
        # leaving the block closes the connection mid-stream
    after = wait_until_idle(server.url)
    assert after["labkit_requests_aborted_total"] == before["labkit_requests_aborted_total"] + 1
    assert after["labkit_generation_tokens_total"] - before["labkit_generation_tokens_total"] < 400


# ---- errors ---------------------------------------------------------------------------
LONG = "x" * 600       # tiny-llama: one token per byte, context 512

BAD_REQUESTS = [
    # (name, path, body (dict, or raw bytes), status, param)
    ("invalid json", "/completions", b'{"prompt": "a", ', 400, None),
    ("not an object", "/completions", b'[1, 2]', 400, None),
    ("unknown field", "/completions", {"prompt": "a", "whatever": 1}, 400, "whatever"),
    ("no prompt", "/completions", {"max_tokens": 2}, 400, "prompt"),
    ("prompt wrong type", "/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens wrong type", "/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("max_tokens bool", "/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
    ("temperature wrong type", "/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("stop wrong type", "/completions", {"prompt": "a", "stop": [1]}, 400, "stop"),
    ("stream wrong type", "/completions", {"prompt": "a", "stream": "yes"}, 400, "stream"),
    ("temperature -1", "/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("top_p 0", "/completions", {"prompt": "a", "top_p": 0}, 400, "top_p"),
    ("n = 0", "/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("max_tokens = 0", "/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("token id out of range", "/completions", {"prompt": [1, 10**6]}, 400, "prompt"),
    ("prompt too long", "/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("chat prompt too long", "/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("messages wrong type", "/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("unknown model", "/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model"),
]


@pytest.mark.slow
def test_bad_requests_while_a_long_request_streams(small_server):
    """Each bad request gets its status and OpenAI's error body; one more request than the
    queue holds gets 429; a long request streams on to completion meanwhile."""
    url = small_server.base_url
    long_done = threading.Event()
    long_result: dict = {}
    first_chunk = threading.Event()

    def long_request():
        body = {"model": MODEL, "prompt": "tell me everything", "max_tokens": 300, "ignore_eos": True,
                "temperature": 0, "stream": True, "return_token_ids": True}
        tokens, finish = [], None
        try:
            with httpx.stream("POST", url + "/completions", json=body, timeout=TIMEOUT) as r:
                long_result["status"] = r.status_code
                for event in sse_events(r.iter_lines()):
                    (choice,) = event["choices"]
                    tokens += choice["token_ids"]
                    finish = choice["finish_reason"] or finish
                    first_chunk.set()
        finally:
            long_result.update(tokens=tokens, finish=finish)
            first_chunk.set()
            long_done.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    assert first_chunk.wait(20), "the long request produced nothing"
    queued = {"prompt": "a", "max_tokens": 1}

    with httpx.Client(timeout=TIMEOUT) as http:
        for name, path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(url + path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(url + path, json=body)
            assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert isinstance(error["message"], str) and error["message"], name
            assert error["param"] == param, f"{name}: param {error['param']!r}"
        assert not long_done.is_set(), "the long request ended before the bad ones were answered"

        # this one waits behind the long request; here the queue holds one request: fill it,
        # and the next gets 429
        with http.stream("POST", url + "/completions", json={**queued, "stream": True}) as waiting:
            assert waiting.status_code == 200
            r = http.post(url + "/completions", json={"prompt": "b", "max_tokens": 1})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full" and r.headers.get("retry-after") == "1"
            assert metrics(small_server.url)["labkit_num_requests_pending"] == 1
        # the waiting client left before its turn: its request is dropped

    assert long_done.wait(30), "the long request did not finish"
    assert long_result["status"] == 200
    assert long_result["finish"] == "length" and len(long_result["tokens"]) == 300
    m = wait_until_idle(small_server.url)
    num_400 = sum(status == 400 for *_, status, _ in BAD_REQUESTS)
    assert m['labkit_http_errors_total{status="400"}'] == num_400
    assert m['labkit_http_errors_total{status="404"}'] == 1
    assert m['labkit_http_errors_total{status="429"}'] == 1
    assert m['labkit_requests_rejected_total{reason="queue_full"}'] == 1
    # the engine refuses token ids out of range; a prompt over the context never reaches it
    # (the server counts its tokens first and answers as OpenAI does)
    assert m['labkit_requests_rejected_total{reason="invalid"}'] >= 1
    assert m["labkit_requests_aborted_total"] == 1


def test_pool_is_whole_at_the_end(server, small_server):
    for s in (server, small_server):
        m = wait_until_idle(s.url)
        assert m["labkit_kv_blocks_free"] == m["labkit_kv_blocks_total"]
        allocator = s.engine.llm.allocator
        assert allocator.num_free_blocks == allocator.num_blocks
        assert s.engine.num_unfinished == 0
        assert httpx.get(s.url + "/health", timeout=TIMEOUT).status_code == 200
