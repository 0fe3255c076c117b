"""The OpenAI API's request fields and response shapes, checked by hand.

Hand-written rather than pydantic models so that every mistake gets OpenAI's error body
and status (400, naming the field), not a framework's 422. Unknown fields are ignored, as
OpenAI does; a known field of the wrong type is an error, as is a value SamplingParams
rejects. Extensions beyond OpenAI's fields (vLLM's names): ``top_k``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids`` and ``return_token_ids`` (each choice, and each
streamed chunk, then carries the ``token_ids`` it adds).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..sampling_params import SamplingParams


class APIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


# ---- field types ------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int_list(v) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


def _is_str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, str) for t in v)


_KINDS = {
    "integer": _is_int,
    "number": _is_number,
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "string or list of strings": lambda v: isinstance(v, str) or _is_str_list(v),
    "list of integers": _is_int_list,
}

# Known fields (null is accepted for each, meaning "the default").
COMMON_FIELDS = {
    "model": "string", "max_tokens": "integer", "temperature": "number", "top_p": "number",
    "top_k": "integer", "seed": "integer", "n": "integer", "stop": "string or list of strings",
    "stream": "boolean", "stream_options": "object", "user": "string",
    "presence_penalty": "number", "frequency_penalty": "number",
    "ignore_eos": "boolean", "min_tokens": "integer", "stop_token_ids": "list of integers",
    "return_token_ids": "boolean",
}
COMPLETION_FIELDS = {**COMMON_FIELDS, "echo": "boolean", "suffix": "string", "best_of": "integer"}
CHAT_FIELDS = {**COMMON_FIELDS, "max_completion_tokens": "integer", "logprobs": "boolean",
               "top_logprobs": "integer"}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_types(body: dict, fields: dict[str, str]) -> None:
    for name, kind in fields.items():
        value = body.get(name)
        if value is not None and not _KINDS[kind](value):
            raise bad_request(f"'{name}' must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                              f"got {type(value).__name__} {json.dumps(value)[:60]}", param=name)


@dataclass
class Parsed:
    """A checked request: its prompts and the settings shared by all of them."""

    model: str | None
    prompts: list                      # each a string or a list of token ids
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    fill_context: bool = False         # chat without max_tokens: up to the context length
    extras: dict[str, Any] = field(default_factory=dict)


def _sampling_params(body: dict, max_tokens_field: str = "max_tokens",
                     default_max_tokens: int | None = 16) -> tuple[SamplingParams, bool]:
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported by labkit (leave it 0)", param=name)
    max_tokens = body.get(max_tokens_field)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = body.get("max_tokens")
    fill_context = max_tokens is None and default_max_tokens is None
    options = dict(
        max_tokens=max_tokens if max_tokens is not None else (default_max_tokens or 1),
        temperature=_default(body.get("temperature"), 1.0),
        top_p=_default(body.get("top_p"), 1.0),
        top_k=_default(body.get("top_k"), 0),
        seed=body.get("seed"),
        n=_default(body.get("n"), 1),
        stop=_default(body.get("stop"), []),
        stop_token_ids=_default(body.get("stop_token_ids"), []),
        ignore_eos=_default(body.get("ignore_eos"), False),
        min_tokens=_default(body.get("min_tokens"), 0),
    )
    if fill_context:                   # validated against a placeholder; set per prompt later
        options["max_tokens"] = max(1, options["min_tokens"])
    try:
        params = SamplingParams(**options)
    except ValueError as e:
        m = re.search(r"SamplingParams\.(\w+)=", str(e))
        param = m.group(1) if m else None
        if param == "max_tokens" and max_tokens_field != "max_tokens" and body.get(max_tokens_field) is not None:
            param = max_tokens_field
        raise bad_request(str(e).replace("SamplingParams.", ""), param=param) from None
    return params, fill_context


def _default(value, default):
    return default if value is None else value


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options")
    return stream, bool(include)


def parse_completion(body: dict) -> Parsed:
    """``POST /v1/completions``: prompt is a string, token ids, or a batch of either."""
    check_types(body, COMPLETION_FIELDS)
    if body.get("echo"):
        raise bad_request("'echo' is not supported by labkit", param="echo")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported by labkit", param="suffix")
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise bad_request("'best_of' is not supported by labkit (use n)", param="best_of")
    if body.get("logprobs") is not None:
        raise bad_request("'logprobs' is not supported by labkit", param="logprobs")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", param="prompt")
    if isinstance(prompt, str) or (_is_int_list(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_int_list(p) and p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_request("'prompt' must be a string, a non-empty list of token ids, or a non-empty "
                          "list of strings or of token-id lists", param="prompt")
    params, fill = _sampling_params(body)
    stream, include_usage = _stream_options(body)
    return Parsed(body.get("model"), prompts, params, stream, include_usage,
                  bool(body.get("return_token_ids")), fill)


def parse_chat(body: dict) -> Parsed:
    """``POST /v1/chat/completions``: ``messages`` (role + content) into one conversation."""
    check_types(body, CHAT_FIELDS)
    if body.get("logprobs"):
        raise bad_request("'logprobs' is not supported by labkit", param="logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):        # content parts: keep the text ones
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              param="messages")
        conversation.append({"role": m["role"], "content": content})
    params, fill = _sampling_params(body, "max_completion_tokens", default_max_tokens=None)
    stream, include_usage = _stream_options(body)
    return Parsed(body.get("model"), [conversation], params, stream, include_usage,
                  bool(body.get("return_token_ids")), fill)


# ---- responses ------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
