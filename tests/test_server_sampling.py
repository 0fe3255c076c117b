"""The server's sampling API (issue 19): logprobs, echo, penalties, and no silent ignores.

Against a real loopback server on tiny-llama:

* every field of the ``openai`` package's request types (read from its TypedDicts, so a
  new OpenAI field fails here until it is classified) either works end to end or is
  refused with a 400 naming it; unknown fields are refused too;
* chat ``logprobs``/``top_logprobs`` and completions ``logprobs``/``echo`` carry the
  engine's own log-probabilities (equal to the offline ``LLM``'s), streamed or not, and
  the official ``openai`` client reads them;
* the penalties, ``logit_bias``, ``min_p`` and ``top_k`` reach the sampler: the server's
  tokens equal the offline API's with the same ``SamplingParams``, and differ from (or,
  for the cut-offs, collapse to) plain greedy where they must.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.bench import costs  # noqa: E402
from labkit.model.loader import tiny_config  # noqa: E402
from labkit.server import BackgroundServer, parse_metrics  # noqa: E402
from labkit.server.limits import Limits  # noqa: E402

pytestmark = pytest.mark.server

MODEL = "tiny-llama"
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
MESSAGES = [{"role": "user", "content": "Tell me a story about a paged cache."}]
PROMPT = "Once upon a time, a block table"


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(model=MODEL, num_blocks=256, max_num_seqs=16) as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, num_blocks=256)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=TIMEOUT)


def stream_events(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed response (``data: [DONE]`` must end it)."""
    events = []
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return events
                events.append(json.loads(line[len("data: "):]))
    raise AssertionError("the stream ended without data: [DONE]")


def wait_until_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = parse_metrics(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)
        if m["labkit_kv_blocks_used"] == 0 and m["labkit_num_requests_running"] == 0:
            return
        assert time.monotonic() < deadline, f"the server did not return to idle: {m}"
        time.sleep(0.05)


def chat_prompt(offline) -> str:
    return offline.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


# ---- the request-field table ------------------------------------------------------------
def openai_fields(module_name: str) -> set[str]:
    """Every field of an OpenAI request type (the TypedDicts' keys, streaming included)."""
    openai = pytest.importorskip("openai")
    module = getattr(getattr(openai.types, "chat") if module_name == "chat" else openai.types,
                     "completion_create_params")
    fields: set[str] = set()
    for name in dir(module):
        cls = getattr(module, name)
        if name.startswith("CompletionCreateParams") and hasattr(cls, "__required_keys__"):   # a TypedDict
            fields |= set(cls.__required_keys__) | set(cls.__optional_keys__)
    assert {"model", "temperature", "stream"} <= fields, fields
    return fields


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(n):
    return lambda body: body["usage"]["completion_tokens"] == n


def _choices(n):
    return lambda body: len(body["choices"]) == n


# field -> (value, what a response shows when it works; None: refused with a 400).
# Values are not the defaults: each must do something. The effects of the penalties,
# logit_bias, seed, top_p and temperature are checked against the offline API below.
COMMON = {
    "model": (MODEL, lambda b: b["model"] == MODEL),
    "max_tokens": (3, _tokens(3)),
    "n": (2, _choices(2)),
    "seed": (7, _choices(1)),
    "stop": (["\n\n"], _choices(1)),
    "temperature": (0.7, _choices(1)),
    "top_p": (0.5, _choices(1)),
    "presence_penalty": (1.5, _choices(1)),
    "frequency_penalty": (1.5, _choices(1)),
    "logit_bias": ({"65": 100}, lambda b: set(b["choices"][0]["token_ids"]) == {65}),
    "user": ("student-7", _choices(1)),
    "stream": (True, None),               # checked on its own: the answer is SSE
    "stream_options": ({"include_usage": True}, None),
}
CHAT_EXPECT = {
    **COMMON,
    "messages": (MESSAGES, lambda b: b["choices"][0]["message"]["role"] == "assistant"),
    "max_completion_tokens": (3, _tokens(3)),
    "logprobs": (True, lambda b: len(b["choices"][0]["logprobs"]["content"]) == b["usage"]["completion_tokens"]),
    "top_logprobs": (2, lambda b: all(len(c["top_logprobs"]) == 2 for c in b["choices"][0]["logprobs"]["content"])),
    "metadata": ({"course": "labkit"}, _choices(1)),
    "safety_identifier": ("hash-of-user", _choices(1)),
    "prompt_cache_key": ("lesson-3", _choices(1)),
    "response_format": ({"type": "json_object"},          # structured outputs: tests/test_server_structured.py
                        lambda b: b["choices"][0]["message"]["content"].startswith("{")),
    # refused
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {}}}], "refused"),
    "tool_choice": ("auto", "refused"),
    "parallel_tool_calls": (False, "refused"),
    "functions": ([{"name": "f", "parameters": {}}], "refused"),
    "function_call": ("auto", "refused"),
    "audio": ({"voice": "alloy", "format": "wav"}, "refused"),
    "modalities": (["text", "audio"], "refused"),
    "prediction": ({"type": "content", "content": "x"}, "refused"),
    "reasoning_effort": ("low", "refused"),
    "verbosity": ("low", "refused"),
    "web_search_options": ({}, "refused"),
    "store": (True, "refused"),
    "service_tier": ("flex", "refused"),
    "prompt_cache_retention": ("24h", "refused"),
    "prompt_cache_options": ({}, "refused"),
    "moderation": ({}, "refused"),
}
COMPLETION_EXPECT = {
    **COMMON,
    "prompt": (PROMPT, _choices(1)),
    "logprobs": (2, lambda b: len(b["choices"][0]["logprobs"]["tokens"]) == b["usage"]["completion_tokens"]),
    "echo": (True, lambda b: b["choices"][0]["text"].startswith(PROMPT)),
    "best_of": (3, "refused"),
    "suffix": ("The end.", "refused"),
}
CASES = [("chat", f) for f in sorted(CHAT_EXPECT)] + [("completions", f) for f in sorted(COMPLETION_EXPECT)]


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_the_table_covers_every_openai_field(kind):
    table = CHAT_EXPECT if kind == "chat" else COMPLETION_EXPECT
    missing = openai_fields(kind) - set(table)
    assert not missing, f"OpenAI {kind} fields with no row in this test's table: {sorted(missing)}"


@pytest.mark.parametrize("kind,field", CASES)
def test_each_openai_field_works_or_is_refused(server, kind, field):
    value, expect = (CHAT_EXPECT if kind == "chat" else COMPLETION_EXPECT)[field]
    base = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    base.update({"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT})
    if field == "top_logprobs":
        base["logprobs"] = True
    if field == "response_format":
        del base["ignore_eos"]              # a grammar decides where the output ends: refused with one
    body = {**base, field: value}
    path = "/chat/completions" if kind == "chat" else "/completions"
    if expect == "refused":
        r = post(server, path, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and field in error["message"], error
        assert error["code"] == "unsupported_parameter"
    elif field in ("stream", "stream_options"):
        events = stream_events(server, path, {**body, "stream_options": {"include_usage": True}})
        assert events[-1]["usage"]["completion_tokens"] == 4
        assert sum(len(c.get("token_ids", [])) for e in events for c in e["choices"]) == 4
    else:
        out = _ok(post(server, path, body))
        assert expect(out), out


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_unknown_fields_are_refused_by_name(server, path):
    body = {"model": MODEL, "max_tokens": 2, "best_effort_json": True}
    body.update({"messages": MESSAGES} if path.startswith("/chat") else {"prompt": PROMPT})
    r = post(server, path, body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "best_effort_json"
    assert "Unrecognized request argument supplied: best_effort_json" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,field,value", [
    ("/chat/completions", "response_format", {"type": "text"}),     # the default format
    ("/chat/completions", "tool_choice", "none"),
    ("/chat/completions", "store", False),
    ("/chat/completions", "service_tier", "auto"),
    ("/chat/completions", "modalities", ["text"]),
    ("/chat/completions", "tools", None),                           # null: the default
    ("/completions", "suffix", ""),
    ("/completions", "best_of", 1),
])
def test_values_that_mean_the_default_are_accepted(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, field: value}
    body.update({"messages": MESSAGES} if path.startswith("/chat") else {"prompt": PROMPT})
    assert post(server, path, body).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", {"top_logprobs": 3}, "top_logprobs"),                  # without logprobs
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 2}, "logprobs"),                          # chat's is a boolean
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"logprobs": -1}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),                            # completions' is an int
    ("/completions", {"echo": "yes"}, "echo"),
    ("/completions", {"logit_bias": {"token": 5}}, "logit_bias"),
    ("/completions", {"logit_bias": {"-3": 5}}, "logit_bias"),
    ("/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/completions", {"logit_bias": {"5": "high"}}, "logit_bias"),
    ("/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),              # past the vocabulary
    ("/completions", {"logit_bias": [5]}, "logit_bias"),
    ("/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/completions", {"min_p": 1.5}, "min_p"),
    ("/completions", {"best_of": 2, "n": 1}, "best_of"),
    ("/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/completions", {"max_tokens": 0, "echo": True, "logprobs": 1}, "max_tokens"),    # scoring: ask 1
    ("/completions", {"prompt_logprobs": -1, "echo": True, "logprobs": 2}, "prompt_logprobs"),
    ("/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),     # vLLM: not streamed
    ("/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_bad_sampling_values_get_a_400_naming_the_field(server, path, body, param):
    body = {"model": MODEL, "max_tokens": 2, **body}
    body.update({"messages": MESSAGES} if path.startswith("/chat") else {"prompt": PROMPT})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- logprobs: the engine's numbers, in OpenAI's shapes ---------------------------------
def test_completion_logprobs_equal_the_offline_apis(server, offline):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 3, "return_token_ids": True}
    choice = _ok(post(server, "/completions", body))["choices"][0]
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))[0]
    o = ref.outputs[0]
    assert choice["token_ids"] == o.token_ids
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([step[t].logprob for t, step in zip(o.token_ids, o.logprobs)],
                                                 abs=1e-5)
    decode = offline.tokenizer.decode
    assert lp["tokens"] == [decode([t]) for t in o.token_ids]
    for top, step in zip(lp["top_logprobs"], o.logprobs):
        by_text: dict[str, float] = {}
        for t, x in sorted(step.items(), key=lambda item: item[1].rank):
            by_text.setdefault(decode([t]), x.logprob)
        assert top == pytest.approx(by_text, abs=1e-5)
        assert 3 <= len(step) <= 4
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))


def test_echo_prepends_the_prompt_and_its_logprobs(server, offline):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "echo": True}
    out = _ok(post(server, "/completions", body))
    choice = out["choices"][0]
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2,
                                                  prompt_logprobs=2))[0]
    assert choice["text"] == PROMPT + ref.outputs[0].text
    lp = choice["logprobs"]
    n_prompt = len(ref.prompt_token_ids)
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert len(lp["tokens"]) == n_prompt + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [step[t].logprob for t, step in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    want += [step[t].logprob for t, step in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # the prompt's blocks are in the prefix cache now: a second asker still gets every logprob
    again = _ok(post(server, "/completions", body))["choices"][0]["logprobs"]
    assert again["token_logprobs"][0] is None
    assert again["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    # echo without logprobs: the text only, and token prompts echo their decoded text
    plain = _ok(post(server, "/completions", {**body, "logprobs": None, "prompt": ref.prompt_token_ids}))
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["text"] == offline.tokenizer.decode(ref.prompt_token_ids) + ref.outputs[0].text
    streamed = stream_events(server, "/completions", {**body, "logprobs": None})
    assert "".join(c["text"] for e in streamed for c in e["choices"]) == PROMPT + ref.outputs[0].text
    assert streamed[0]["choices"][0]["text"] == PROMPT           # the echo is the first chunk


def test_vllm_prompt_logprobs_extension(server, offline):
    """vLLM's ``prompt_logprobs``: per prompt token ``{"<id>": {logprob, rank,
    decoded_token}}`` (the first None), on each completions choice and on a chat answer;
    alongside echo it asks for its own k, and each answer keeps to its own."""
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
            "echo": True, "logprobs": 1}
    choice = _ok(post(server, "/completions", body))["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for token, entry, step in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:]):
        assert str(token) in entry and 3 <= len(entry) <= 4
        assert entry[str(token)]["logprob"] == pytest.approx(step[token].logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == step[token].rank
        assert entry[str(token)]["decoded_token"] == offline.tokenizer.decode([token])
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])   # echo keeps logprobs=1
    plain = _ok(post(server, "/completions", {**body, "prompt_logprobs": None}))["choices"][0]
    assert "prompt_logprobs" not in plain
    chat = _ok(post(server, "/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                   "prompt_logprobs": 0}))
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_chat_logprobs_shape_and_values(server, offline):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
    choice = _ok(post(server, "/chat/completions", body))["choices"][0]
    ref = offline.generate(chat_prompt(offline), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                                logprobs=3))[0].outputs[0]
    content = choice["logprobs"]["content"]
    assert choice["token_ids"] == ref.token_ids and len(content) == 5
    for entry, token, step in zip(content, ref.token_ids, ref.logprobs):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] == pytest.approx(step[token].logprob, abs=1e-5)
        # tiny-llama's ids 0..255 are the bytes themselves: bytes are the token's own, not
        # the UTF-8 of its (possibly U+FFFD) text
        if token < 256:
            assert entry["bytes"] == [token]
        else:
            assert bytes(entry["bytes"]).decode() == entry["token"]
        ranked = sorted(step.items(), key=lambda item: item[1].rank)[:3]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx([x.logprob for _, x in ranked],
                                                                             abs=1e-5)
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6   # greedy: chosen is top
    none = _ok(post(server, "/chat/completions", {**body, "logprobs": False, "top_logprobs": None}))
    assert none["choices"][0]["logprobs"] is None
    zero = _ok(post(server, "/chat/completions", {**body, "top_logprobs": 0}))
    assert all(e["top_logprobs"] == [] for e in zero["choices"][0]["logprobs"]["content"])


def _concat_completion_logprobs(events, index):
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for e in events:
        for c in e["choices"]:
            if c["index"] == index:
                text += c["text"]
                for k in out:
                    out[k] += (c["logprobs"] or {}).get(k, [])
    return text, out


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_equal_the_whole_answer(server, echo):
    body = {"model": MODEL, "prompt": [PROMPT, "A second prompt"], "max_tokens": 7, "temperature": 0.8,
            "seed": 11, "n": 2, "ignore_eos": True, "logprobs": 2, "echo": echo}
    whole = _ok(post(server, "/completions", body))
    events = stream_events(server, "/completions", body)
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        text, lp = _concat_completion_logprobs(events, choice["index"])
        assert text == choice["text"]
        assert lp["tokens"] == choice["logprobs"]["tokens"]
        assert lp["text_offset"] == choice["logprobs"]["text_offset"]
        assert lp["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
        assert (lp["token_logprobs"][0] is None) == echo
    wait_until_idle(server)


def test_streamed_chat_logprobs_equal_the_whole_answer(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2,
            "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    whole = _ok(post(server, "/chat/completions", body))
    events = stream_events(server, "/chat/completions", body)
    for choice in whole["choices"]:
        streamed = [entry for e in events for c in e["choices"] if c["index"] == choice["index"]
                    and c["logprobs"] for entry in c["logprobs"]["content"]]
        assert [s["token"] for s in streamed] == [w["token"] for w in choice["logprobs"]["content"]]
        assert [s["logprob"] for s in streamed] == pytest.approx(
            [w["logprob"] for w in choice["logprobs"]["content"]], abs=1e-6)


def test_a_stop_string_cuts_text_but_logprobs_follow_the_tokens(server, offline):
    free = _ok(post(server, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                                              "temperature": 0, "ignore_eos": True}))["choices"][0]["text"]
    stop = next((free[i:i + 2] for i in range(2, len(free) - 1) if free[i:i + 2].isprintable()), None)
    if stop is None:
        pytest.skip("tiny-llama's greedy text has no printable pair to stop on")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "logprobs": 1, "return_token_ids": True}
    choice = _ok(post(server, "/completions", body))["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"])
    events = stream_events(server, "/completions", body)
    _, lp = _concat_completion_logprobs(events, 0)
    assert lp["tokens"] == choice["logprobs"]["tokens"]


def test_the_openai_client_receives_logprobs(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="labkit", timeout=60, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(isinstance(c.logprob, float) and c.logprob <= 0 and c.bytes for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs and choice.logprobs.content
                for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                     echo=True)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == comp.usage.prompt_tokens + 4
    assert comp.choices[0].text.startswith(PROMPT)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])


# ---- penalties and cut-offs reach the sampler --------------------------------------------
GREEDY = dict(max_tokens=40, temperature=0.0, ignore_eos=True)   # greedy repeats from ~24 on


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 4.0},
    {"frequency_penalty": -2.0, "presence_penalty": -1.0}, {"logit_bias": {"66": 100}},
    {"logit_bias": {"__top__": -100}},
])
def test_penalties_and_bias_pass_through(server, offline, extra):
    plain = offline.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0].token_ids
    if "logit_bias" in extra and "__top__" in extra["logit_bias"]:
        extra = {"logit_bias": {str(plain[0]): -100}}       # ban greedy's first token
    params = SamplingParams(**GREEDY, **extra)               # it takes the JSON string keys too
    want = offline.generate(PROMPT, params)[0].outputs[0].token_ids
    assert want != plain, f"{extra} changed nothing offline: a useless case"
    body = {"model": MODEL, "prompt": PROMPT, "return_token_ids": True, **GREEDY, **extra}
    got = _ok(post(server, "/completions", body))["choices"][0]["token_ids"]
    assert got == want
    chat = _ok(post(server, "/chat/completions", {"model": MODEL, "messages": MESSAGES, "return_token_ids": True,
                                                    **GREEDY, **extra}))["choices"][0]["token_ids"]
    assert chat == offline.generate(chat_prompt(offline), params)[0].outputs[0].token_ids


@pytest.mark.parametrize("cut", [{"min_p": 1.0}, {"top_k": 1}])
def test_min_p_and_top_k_pass_through(server, offline, cut):
    """At temperature 2 a seeded sample wanders; min_p=1 or top_k=1 leaves only the most
    likely token, so the answer collapses to greedy's."""
    greedy = offline.generate(PROMPT, SamplingParams(**GREEDY))[0].outputs[0].token_ids
    hot = {**GREEDY, "temperature": 2.0, "seed": 5}
    body = {"model": MODEL, "prompt": PROMPT, "return_token_ids": True, **hot}
    wild = _ok(post(server, "/completions", body))["choices"][0]["token_ids"]
    assert wild != greedy
    assert _ok(post(server, "/completions", {**body, **cut}))["choices"][0]["token_ids"] == greedy
    wait_until_idle(server)


def test_logprob_bytes_are_the_tokens_own_on_smollm2():
    """Byte-level BPE splits a CJK character or an emoji across tokens whose texts are
    U+FFFD; their bytes must still add up to the exact UTF-8 of the text."""
    from transformers import AutoTokenizer

    from labkit.model.loader import fetch_default_model
    from labkit.server.protocol import TokenNames

    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model())
    names = TokenNames(tokenizer)
    text = " area café 日本 😀 naïve"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in names.text(i) for i in ids), "no split character: a useless case"
    assert b"".join(bytes(names.bytes(i)) for i in ids) == text.encode()
    eos = tokenizer.eos_token_id                   # a special token: the UTF-8 of its text
    assert bytes(names.bytes(eos)).decode() == names.text(eos) == tokenizer.eos_token


@pytest.mark.slow
def test_costs_benchmark_measures_every_option_beside_a_plain_request():
    """``python -m labkit.bench costs`` (the README runs it with --rounds 2): one short round
    in a fresh process (it freezes its heap as the server does), every scenario measured, and
    the table it prints without --json."""
    run = subprocess.run([sys.executable, "-m", "labkit.bench", "costs", "--rounds", "1", "--steps", "5",
                          "--batch", "4", "--max-tokens", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert (result["model"], result["batch"], result["rounds"], result["steps_per_round"]) == ("tiny-llama", 4, 1, 5)
    rows = result["rows"]
    expected = costs.scenarios(tiny_config().vocab_size, Limits())
    assert len(rows) == len(expected) == len({r["scenario"] for r in rows})   # (names carry the run's limits)
    assert rows[0]["scenario"].startswith("plain") and not rows[0]["beyond_limits"]
    assert [r["beyond_limits"] for r in rows] == [s.beyond_limits for s in expected]
    for r in rows:
        assert 0 < r["step_p50_ms"] <= r["step_p99_ms"] and r["step_mean_ms"] > 0, r
        assert abs(r["vs_plain"] - r["step_p50_ms"] / rows[0]["step_p50_ms"]) < 1e-9, r
    printed = costs.table(result)
    assert all(r["scenario"] in printed for r in rows) and printed.count("[beyond limits]") == sum(
        r["beyond_limits"] for r in rows)
    bad = subprocess.run([sys.executable, "-m", "labkit.bench", "costs", "--rounds", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--rounds" in bad.stderr
