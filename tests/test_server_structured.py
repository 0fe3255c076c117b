"""Structured outputs over HTTP: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

A real server on loopback (tiny-llama, fast): json_object and json_schema on chat and
completions, regex and choice through the extension, streaming, every refusal with OpenAI's
400 naming the field, the official ``openai`` client's ``chat.completions.parse`` returning a
typed object; and, marked slow, the default model answering every json_schema request of a
realistic workload with JSON that parses and validates (the issue's "done when").
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from labkit.server import BackgroundServer  # noqa: E402

pytestmark = pytest.mark.server

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# Small enough for random weights to finish: enums, booleans and bounded integers close fast.
FLAGS = {"type": "object",
         "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                        "size": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["colour", "ok", "size"]}
MESSAGES = [{"role": "user", "content": "Pick a colour, a flag and a size, as JSON."}]


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(model="tiny-llama", num_blocks=256, max_num_seqs=16) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=TIMEOUT)


def json_schema_format(schema: dict, name: str = "flags") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_on_chat_and_completions(server):
    for path, body in (("/chat/completions", {"messages": MESSAGES}), ("/completions", {"prompt": "JSON:"})):
        r = post(server, path, {**body, "max_tokens": 64, "temperature": 0.7, "seed": 3, "n": 3,
                                "response_format": json_schema_format(FLAGS)})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(text), FLAGS)


def test_json_object_gives_an_object(server):
    r = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "temperature": 0.0,
                                           "logit_bias": {str(ord(c)): 8 for c in '"}'},
                                           "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


def test_the_structured_outputs_extension_regex_and_choice(server):
    r = post(server, "/completions", {"prompt": "Code:", "max_tokens": 32, "temperature": 1.0, "n": 4, "seed": 1,
                                      "structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert re.fullmatch("[A-Z]{3}-[0-9]{2}", choice["text"]) and choice["finish_reason"] == "stop"
    r = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                           "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_streaming_deltas_add_up_to_valid_json(server):
    with httpx.stream("POST", server.base_url + "/chat/completions", timeout=TIMEOUT,
                      json={"messages": MESSAGES, "max_tokens": 64, "stream": True, "temperature": 0.0,
                            "response_format": json_schema_format(FLAGS)}) as r:
        assert r.status_code == 200
        text, finish = "", None
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), FLAGS)


def test_logprobs_are_after_the_mask(server):
    r = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "logprobs": True, "top_logprobs": 5,
                                           "structured_outputs": {"choice": ["apple", "berry"]}})
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert {t["token"] for t in first["top_logprobs"]} == {"a", "b"}


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "xml"}}, "response_format", "must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": FLAGS}}}, "response_format",
     "response_format.json_schema.name"),
    ({"response_format": json_schema_format({"type": "strange"})}, "response_format", 'Unsupported type "strange"'),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format", "response_format.schema"),
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs", "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "structured_outputs.pattern"),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop", "cannot be combined with structured"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 4}, "min_tokens", "cannot be combined"),
])
def test_refusals_name_the_field(server, body, param, says):
    r = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_bad_request_leaves_others_running(server):
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(post, server, "/completions", {"prompt": "x", "max_tokens": 48, "temperature": 0.0,
                                                            "response_format": json_schema_format(FLAGS)})
                for _ in range(3)]
        bad = pool.submit(post, server, "/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::="}})
        assert bad.result().status_code == 400
        assert all(g.result().status_code == 200 for g in good)


def test_openai_client_parse_returns_a_typed_object(server):
    openai = pytest.importorskip("openai")
    from enum import Enum

    from pydantic import BaseModel, conint

    class Colour(str, Enum):
        red = "red"
        green = "green"
        blue = "blue"

    class Flags(BaseModel):
        colour: Colour
        ok: bool
        size: conint(ge=0, le=9)

    client = openai.OpenAI(base_url=server.base_url, api_key="labkit", timeout=60, max_retries=0)
    reply = client.chat.completions.parse(model="tiny-llama", messages=MESSAGES, response_format=Flags,
                                          max_tokens=64, temperature=0.0)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Flags) and 0 <= parsed.size <= 9


# ---- the default model ---------------------------------------------------------------------------
@pytest.mark.slow
def test_every_json_schema_reply_of_the_default_model_parses_and_validates():
    """Through the official client against a real server on SmolLM2-135M: every answer to a
    json_schema request (the benchmark's realistic schemas, each asked twice) parses and is valid."""
    openai = pytest.importorskip("openai")
    from labkit.bench.structured import SCHEMAS, workload

    with BackgroundServer(model="smollm2-135m", max_num_seqs=8) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="labkit", timeout=600, max_retries=0)
        import concurrent.futures

        def ask(pair):
            name, message = pair
            r = client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": message}], max_tokens=256, temperature=0.0,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                         "strict": True}})
            return name, r.choices[0]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, workload(8)))
        from pydantic import BaseModel, Field

        class Event(BaseModel):
            title: str = Field(max_length=60)
            city: str = Field(max_length=30)
            attendees: int = Field(ge=0, le=100000)

        parsed = client.chat.completions.parse(
            model="smollm2-135m", max_tokens=256, temperature=0.0, response_format=Event,
            messages=[{"role": "user", "content": "A jazz concert in Montreal, as JSON: title, city, attendees."}])
        assert isinstance(parsed.choices[0].message.parsed, Event)
    for name, choice in answers:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
