"""Typed refusals (``labkit/errors.py``): each check raises its class, naming the field at
fault (``param``) and the kind (``code``), still a ``ValueError`` with its old message;
the server's one table (``labkit/server/errors.py``) carries both into OpenAI's error body.

* the engine, the scheduler's checks and SamplingParams raise the typed class directly
  (a simulated engine: no model, no server);
* ``api_error`` maps each exception class to its status, type, param and code;
* on a real server (tiny-llama, loopback), each kind of bad request comes back with its
  param and code in the JSON body.
"""

from __future__ import annotations

import pytest

from labkit.engine import Engine
from labkit.errors import (ContextLengthExceeded, DuplicateRequestId, InvalidParameter, LimitExceeded,
                           RequestError)
from labkit.memory import BlockAllocator
from labkit.sampling_params import BeamSearchParams, SamplingParams
from labkit.scheduler import Scheduler, StaticScheduler
from labkit.sim import SimExecutor


def sim_engine(num_blocks: int = 8, block_size: int = 4, **options) -> Engine:
    options = {"max_num_seqs": 2, "max_model_len": 64, **options}
    return Engine(Scheduler(BlockAllocator(num_blocks, block_size), **options), SimExecutor(vocab_size=100))


def refusal(call, kind: type) -> RequestError:
    with pytest.raises(kind) as info:
        call()
    assert isinstance(info.value, ValueError)      # every caller catching ValueError still does
    return info.value


# ---- the engine raises the typed class --------------------------------------------------
@pytest.mark.parametrize("name, call, kind, param, code, says", [
    ("prompt over the model", lambda e: e.add_request([1] * 64, SamplingParams(max_tokens=1)),
     ContextLengthExceeded, "prompt", "context_length_exceeded", "is too long"),
    ("more KV than the cache", lambda e: e.add_request([1] * 8, SamplingParams(max_tokens=40)),
     ContextLengthExceeded, "prompt", "context_length_exceeded", "KV cache holds"),
    ("n over max_num_seqs", lambda e: e.add_request([1, 2], SamplingParams(n=3, max_tokens=1)),
     LimitExceeded, "n", "limit_exceeded", "exceed max_num_seqs=2"),
    ("beams over max_num_seqs", lambda e: e.add_request([1, 2], BeamSearchParams(beam_width=3, max_tokens=1)),
     LimitExceeded, "beam_width", "limit_exceeded", "beams exceed max_num_seqs"),
    ("empty prompt", lambda e: e.add_request([], SamplingParams(max_tokens=1)),
     InvalidParameter, "prompt", "invalid_value", "the prompt is empty"),
    ("token id outside the vocabulary", lambda e: e.add_request([1, 100], SamplingParams(max_tokens=1)),
     InvalidParameter, "prompt", "invalid_value", "out of range"),
    ("logit_bias outside the vocabulary",
     lambda e: e.add_request([1], SamplingParams(max_tokens=1, logit_bias={100: 1.0})),
     InvalidParameter, "logit_bias", "invalid_value", "outside the vocabulary"),
])
def test_the_engine_raises_each_refusal_typed(name, call, kind, param, code, says):
    engine = sim_engine()
    error = refusal(lambda: call(engine), kind)
    assert (error.param, error.code) == (param, code), name
    assert says in str(error), name
    assert not engine.has_unfinished                       # a refusal changes nothing


def test_a_duplicate_request_id_is_typed_and_names_no_field():
    engine = sim_engine()
    engine.add_request([1, 2], SamplingParams(max_tokens=1), request_id="r")
    error = refusal(lambda: engine.add_request([3], SamplingParams(max_tokens=1), request_id="r"),
                    DuplicateRequestId)
    assert (error.param, error.code) == (None, "duplicate_request_id")
    assert str(error) == "request id 'r' is already in use"


def test_sampling_params_name_their_field():
    for options, param in (({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"),
                           ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens")):
        error = refusal(lambda: SamplingParams(**options), InvalidParameter)
        assert (error.param, error.code) == (param, "invalid_value")
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=0: must be in \(0, 1\]"):   # the old text
        SamplingParams(top_p=0)


def test_the_static_baseline_refuses_n_over_one_typed():
    engine = Engine(StaticScheduler(BlockAllocator(16, 4), max_num_seqs=2, max_model_len=32),
                    SimExecutor(vocab_size=100))
    error = refusal(lambda: engine.add_request([1], SamplingParams(n=2, max_tokens=1)), LimitExceeded)
    assert error.param == "n"


# ---- the server's one table ---------------------------------------------------------------
def test_api_error_maps_each_class():
    pytest.importorskip("fastapi")
    from labkit.server import EngineDeadError, QueueFullError
    from labkit.server.errors import api_error
    from labkit.server.fairness import OverCapError
    from labkit.server.protocol import APIError

    e = api_error(ContextLengthExceeded("too long"), prompt_param="messages")
    assert (e.status, e.type, e.param, e.code) == (400, "invalid_request_error", "messages", "context_length_exceeded")
    e = api_error(LimitExceeded("too many", "n"), prompt_param="messages")
    assert (e.status, e.param, e.code) == (400, "n", "limit_exceeded")
    e = api_error(DuplicateRequestId("taken"))
    assert (e.status, e.param, e.code) == (400, None, "duplicate_request_id")
    e = api_error(ValueError("untyped"))
    assert (e.status, e.param, e.code) == (400, None, None)
    e = api_error(QueueFullError("full"))
    assert (e.status, e.type, e.code, e.headers) == (429, "rate_limit_error", "queue_full", {"Retry-After": "1"})
    e = api_error(OverCapError("over", retry_after_s=3))
    assert (e.status, e.code, e.headers) == (429, "too_many_concurrent_requests", {"Retry-After": "3"})
    e = api_error(EngineDeadError("gone"))
    assert (e.status, e.type) == (503, "service_unavailable")
    passed = APIError(401, "who?")
    assert api_error(passed) is passed
    assert api_error(KeyError("bug")).status == 500
    assert e.body() == {"error": {"message": "gone", "type": "service_unavailable", "param": None, "code": None}}


# ---- through HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from labkit.server import BackgroundServer, Limits
    # 8 blocks of 16 tokens: a short prompt asking for 200 tokens fits the model's 512 but
    # never the KV cache. Two sequences a batch, four per client at the gate.
    with BackgroundServer(model="tiny-llama", num_blocks=8, max_num_seqs=2, step_delay_s=0.02,
                          limits=Limits(max_concurrent_per_key=4)) as s:
        yield s


def error_of(server, path: str, body: dict, headers: dict | None = None) -> dict:
    httpx = pytest.importorskip("httpx")
    r = httpx.post(server.base_url + path, json=body, headers=headers or {}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.server
@pytest.mark.parametrize("name, path, body, param, code", [
    ("more KV than the cache", "/completions", {"prompt": "hi", "max_tokens": 200},
     "prompt", "context_length_exceeded"),
    ("more KV than the cache, chat", "/chat/completions", {"messages": CHAT, "max_tokens": 200},
     "messages", "context_length_exceeded"),
    ("over the model's context", "/completions", {"prompt": [5] * 600, "max_tokens": 1},
     "prompt", "context_length_exceeded"),
    ("n over max_num_seqs", "/completions", {"prompt": "hi", "n": 3, "max_tokens": 1}, "n", "limit_exceeded"),
    ("n over max_num_seqs, chat", "/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 1},
     "n", "limit_exceeded"),
    ("a batch over the client's cap", "/completions", {"prompt": ["a"] * 5, "max_tokens": 1},
     None, "limit_exceeded"),
    ("token id outside the vocabulary", "/completions", {"prompt": [1, 10**6], "max_tokens": 1},
     "prompt", "invalid_value"),
    ("a sampling value", "/completions", {"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ("a sampling value, chat", "/chat/completions", {"messages": CHAT, "temperature": -1},
     "temperature", "invalid_value"),
])
def test_each_refusal_carries_its_param_and_code_over_http(server, name, path, body, param, code):
    error = error_of(server, path, body)
    assert (error["param"], error["code"]) == (param, code), f"{name}: {error}"


@pytest.mark.server
def test_a_duplicate_request_id_over_http(server):
    httpx = pytest.importorskip("httpx")
    held = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=held, timeout=30,
                      headers={"X-Request-Id": "dup"}) as r:
        lines = r.iter_lines()              # kept: a dropped iterator closes the connection
        next(lines)
        error = error_of(server, "/completions", {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": "dup"})
    assert (error["param"], error["code"]) == (None, "duplicate_request_id")
    assert "already in use" in error["message"]
