"""The OpenAI API's request fields and response shapes, checked by hand.

Hand-written rather than pydantic models so that every mistake gets OpenAI's error body
and status (400, naming the field), not a framework's 422. Nothing is silently ignored:
a field labkit does not know is refused as OpenAI refuses it ("Unrecognized request
argument supplied"), a field it knows but does not implement (``tools``,
``audio``, ...: ``UNSUPPORTED``) is refused unless its value means the default,
and only fields that label a request without changing its output (``user``,
``metadata``, ...: ``LABELS``) are accepted and not used. A known field of the wrong type
is an error, as is a value SamplingParams rejects. ``response_format`` (``text``,
``json_object``, ``json_schema``) constrains the output with a grammar, on chat and
completions alike (``structured_outputs``). Extensions beyond OpenAI's fields
(vLLM's names): ``structured_outputs`` (``{"json": schema}``, ``{"regex": ...}``,
``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": true}``), ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids``, ``return_token_ids`` (each choice, and each
streamed chunk, then carries the ``token_ids`` it adds), ``prompt_logprobs``
(not streamed; vLLM's ``prompt_logprobs`` in the answer) and ``cache_salt`` (the
request's prefix-cache namespace). ``docs/server_api.md`` has the table.

Text must be valid Unicode: a lone UTF-16 surrogate (``"\\ud800"`` in JSON) anywhere in
the body is a 400 naming the field, before anything reaches the tokenizer.

Log-probabilities come in OpenAI's two shapes, built from the engine's ``Logprob``
records (raw log-softmax of the model's logits): chat's ``logprobs.content`` (a list of
``{token, logprob, bytes, top_logprobs}``) and the legacy completions'
``{tokens, token_logprobs, top_logprobs, text_offset}``; vLLM's ``prompt_logprobs``
extension answers ``[null, {"<token id>": {logprob, rank, decoded_token}}, ...]``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..model.loader import BYTE_OF_CHAR
from ..sampling_params import MAX_LOGPROBS, SamplingParams
from ..structured import StructuredOutputsParams


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

# Implemented fields (null is accepted for each, meaning "the default").
COMMON_FIELDS = {
    "model": "string", "max_tokens": "integer", "temperature": "number", "top_p": "number",
    "top_k": "integer", "min_p": "number", "seed": "integer", "n": "integer",
    "stop": "string or list of strings", "stream": "boolean", "stream_options": "object",
    "presence_penalty": "number", "frequency_penalty": "number", "repetition_penalty": "number",
    "logit_bias": "object",
    "ignore_eos": "boolean", "min_tokens": "integer", "stop_token_ids": "list of integers",
    "return_token_ids": "boolean", "prompt_logprobs": "integer", "cache_salt": "string",
    "response_format": "object", "structured_outputs": "object",
}
# Accepted and not used: they label a request (for the caller's own bookkeeping), they
# do not change what is generated.
LABELS = {"user": "string", "metadata": "object", "safety_identifier": "string",
          "prompt_cache_key": "string"}
COMPLETION_FIELDS = {**COMMON_FIELDS, **LABELS, "prompt": None, "echo": "boolean",
                     "logprobs": "integer", "best_of": "integer"}
CHAT_FIELDS = {**COMMON_FIELDS, **LABELS, "messages": None, "max_completion_tokens": "integer",
               "logprobs": "boolean", "top_logprobs": "integer"}

# Known but not implemented: refused with a 400 naming the field, unless the value means
# what labkit does anyway (each predicate says which values those are; null always is).
_NO: Callable[[Any], bool] = lambda v: False
UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v == "",
}
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "tools": _NO, "tool_choice": lambda v: v == "none", "parallel_tool_calls": _NO,
    "functions": _NO, "function_call": lambda v: v == "none",
    "audio": _NO, "modalities": lambda v: v == ["text"], "prediction": _NO,
    "reasoning_effort": _NO, "verbosity": _NO, "web_search_options": _NO, "moderation": _NO,
    "store": lambda v: v is False,                       # labkit keeps no completions
    "service_tier": lambda v: v in ("auto", "default"),  # one tier: the only one there is
    "prompt_cache_retention": _NO, "prompt_cache_options": _NO,
}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it
    (including text that is not valid Unicode: ``check_unicode``)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except RecursionError:                # "[[[[..." nested beyond Python's recursion limit
        raise bad_request("the request body is nested too deeply to be a request") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    # A lone surrogate can only come from a \u escape or from raw surrogate bytes (which
    # json.loads passes through): without either, there is nothing to look for.
    if b"\\u" in raw or b"\xed" in raw:
        check_unicode(body)
    return body


def check_unicode(body: dict) -> None:
    """Refuse (400, naming the field) a string or key holding a lone UTF-16 surrogate:
    JSON can spell one (``"\\ud800"``), but it is no character, has no UTF-8 form, and
    the tokenizer would fail on it with a message of its own."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                char = value[e.start]
                top = re.match(r"[^.\[]*", path).group(0) or None
                raise bad_request(f"'{path}' is not valid Unicode: it holds a lone UTF-16 surrogate "
                                  f"(\\u{ord(char):04x}) at character {e.start}; send text as UTF-8 (a surrogate "
                                  "must come in a high-low pair, which JSON decodes into one character)",
                                  param=top, code="invalid_unicode") from None
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                stack.append((item, f"{path}.{key}" if path else str(key)))
                stack.append((key, (f"{path}." if path else "") + "<key>"))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value))))


def check_fields(body: dict, fields: dict[str, str | None],
                 unsupported: dict[str, Callable[[Any], bool]]) -> None:
    """Refuse (400, naming it) a field labkit does not know, one it knows but does not
    implement (unless its value means the default), and a known field of the wrong type."""
    for name, value in body.items():
        if name in fields:
            continue
        if name not in unsupported:
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                              code="unsupported_parameter")
        if value is not None and not unsupported[name](value):
            raise bad_request(f"'{name}' is not supported by labkit ({json.dumps(value)[:60]}); "
                              "see docs/server_api.md for the fields it implements", param=name,
                              code="unsupported_parameter")
    for name, kind in fields.items():
        value = body.get(name)
        if kind is not None and value is not None and not _KINDS[kind](value):
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
    logprobs: int | None = None        # alternatives per token to report (None: no logprobs)
    echo: bool = False                 # completions: the prompt (and its logprobs) comes first
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt's logprobs, k alternatives
    chat: bool = False                 # from /v1/chat/completions (names fields, words errors)
    cache_salt: str | None = None      # vLLM's: the request's own prefix-cache namespace
    extras: dict[str, Any] = field(default_factory=dict)


def _sampling_params(body: dict, max_tokens_field: str = "max_tokens",
                     default_max_tokens: int | None = 16, logprobs: int | None = None,
                     prompt_logprobs: int | None = None,
                     renames: dict[str, str] | None = None) -> tuple[SamplingParams, bool]:
    """``renames``: SamplingParams field -> the request field to blame for a bad value."""
    structured, structured_field = _structured_outputs(body)
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
        presence_penalty=_default(body.get("presence_penalty"), 0.0),
        frequency_penalty=_default(body.get("frequency_penalty"), 0.0),
        repetition_penalty=_default(body.get("repetition_penalty"), 1.0),
        min_p=_default(body.get("min_p"), 0.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured,
    )
    if fill_context:                   # validated against a placeholder; set per prompt later
        options["max_tokens"] = max(1, options["min_tokens"])
    try:
        params = SamplingParams(**options)
    except ValueError as e:
        param = getattr(e, "param", None)      # InvalidParameter names its SamplingParams field
        param = (renames or {}).get(param, param)
        if param == "structured_outputs":
            param = structured_field
        if param == "max_tokens" and max_tokens_field != "max_tokens" and body.get(max_tokens_field) is not None:
            param = max_tokens_field
        raise bad_request(str(e).replace("SamplingParams.", ""), param=param, code=getattr(e, "code", None)) from None
    return params, fill_context


def _default(value, default):
    return default if value is None else value


#: What each ``response_format`` type may hold (OpenAI's keys).
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _structured_outputs(body: dict) -> tuple[StructuredOutputsParams | None, str | None]:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (one of them) as labkit's
    ``StructuredOutputsParams``, and the request field it came from; a 400 naming that field
    for anything it cannot be (a schema, regex or grammar that does not parse included).
    ``strict`` is accepted either way: labkit's mask always holds the output to the schema."""
    fmt, ext = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and fmt.get("type") != "text" and ext is not None:
        raise bad_request("give 'response_format' or 'structured_outputs', not both", param="structured_outputs")
    if ext is not None:
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(set(ext) - known)
        if unknown:
            raise bad_request(f"'structured_outputs.{unknown[0]}' is not a field labkit knows (it takes "
                              f"{', '.join(sorted(known))})", param="structured_outputs")
        return _structured(lambda: StructuredOutputsParams(**ext), "structured_outputs"), "structured_outputs"
    if fmt is None:
        return None, None
    kind = fmt.get("type")
    if kind not in _FORMAT_KEYS:
        raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got "
                          f"{json.dumps(kind)[:40]}", param="response_format")
    extra = sorted(set(fmt) - _FORMAT_KEYS[kind])
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: response_format.{extra[0]}",
                          param="response_format")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("Missing required parameter: 'response_format.json_schema' (an object with 'name' and "
                          "'schema')", param="response_format")
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if extra:
        raise bad_request(f"Unrecognized request argument supplied: response_format.json_schema.{extra[0]}",
                          param="response_format")
    name = spec.get("name")
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)):
        raise bad_request("'response_format.json_schema.name' is required: up to 64 letters, digits, '_' or '-'",
                          param="response_format")
    if not isinstance(spec.get("schema"), dict):
        raise bad_request("Missing required parameter: 'response_format.json_schema.schema' (a JSON Schema object)",
                          param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", param="response_format")
    return (_structured(lambda: StructuredOutputsParams(json=spec["schema"]), "response_format",
                        "response_format.json_schema.schema"), "response_format")


def _structured(make: Callable[[], StructuredOutputsParams], field_name: str,
                where: str | None = None) -> StructuredOutputsParams:
    """``make()``, or a 400 naming ``field_name`` (the request's field) and ``where`` in it
    (default: the ``StructuredOutputsParams`` field the message names)."""
    try:
        return make()
    except (TypeError, ValueError) as e:
        text = str(e).removeprefix("StructuredOutputsParams")
        m = re.match(r"\.(\w+)", text)
        where = where or (f"{field_name}.{m.group(1)}" if m else field_name)
        reason = text.split(": ", 1)[1] if ": " in text else text.lstrip(".: ")
        raise bad_request(f"'{where}': {reason}", param=field_name) from None


def _prompt_logprobs(body: dict, stream: bool, also: int | None = None) -> tuple[int | None, int | None]:
    """vLLM's ``prompt_logprobs`` extension: (what the request asked, what the engine must
    compute: the larger of that and ``also``, the prompt logprobs ``echo`` needs)."""
    asked = body.get("prompt_logprobs")
    if asked is None:
        return None, also
    if not 0 <= asked <= MAX_LOGPROBS:
        raise bad_request(f"'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {asked}",
                          param="prompt_logprobs")
    if stream:
        raise bad_request("'prompt_logprobs' is not available with streaming (use echo with logprobs)",
                          param="prompt_logprobs")
    return asked, asked if also is None else max(asked, also)


def _logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids as JSON strings ("50256") -> bias in [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not re.fullmatch(r"\d+", key):
            raise bad_request(f"'logit_bias' keys must be token ids (strings of digits), got {key!r}",
                              param="logit_bias")
        out[int(key)] = value
    return out


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not salt:
        raise bad_request("'cache_salt' must be a non-empty string if provided", param="cache_salt")
    return salt


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(body.get("stream"))
    options = body.get("stream_options") or {}
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", param="stream_options")
    return stream, bool(include)


def parse_completion(body: dict) -> Parsed:
    """``POST /v1/completions``: prompt is a string, token ids, or a batch of either."""
    check_fields(body, COMPLETION_FIELDS, UNSUPPORTED_COMPLETION)
    if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n"):
        raise bad_request("'best_of' other than n is not supported by labkit (use n)", param="best_of",
                          code="unsupported_parameter")
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
    logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
    stream, include_usage = _stream_options(body)
    asked, prompt_k = _prompt_logprobs(body, stream, logprobs if echo else None)
    params, fill = _sampling_params(body, logprobs=logprobs, prompt_logprobs=prompt_k,
                                    renames={"prompt_logprobs": "logprobs"})
    return Parsed(body.get("model"), prompts, params, stream, include_usage,
                  bool(body.get("return_token_ids")), fill, logprobs=logprobs, echo=echo,
                  prompt_logprobs=asked, cache_salt=_cache_salt(body), extras=_extras(body))


def _extras(body: dict) -> dict[str, Any]:
    """What the server needs besides the settings: the field a grammar came from (to blame)."""
    return {"structured_field": "structured_outputs" if body.get("structured_outputs") is not None
            else "response_format"}


def parse_chat(body: dict) -> Parsed:
    """``POST /v1/chat/completions``: ``messages`` (role + content) into one conversation."""
    check_fields(body, CHAT_FIELDS, UNSUPPORTED_CHAT)
    top = body.get("top_logprobs")
    if top and not body.get("logprobs"):
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
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
    stream, include_usage = _stream_options(body)
    asked, _ = _prompt_logprobs(body, stream)
    params, fill = _sampling_params(body, "max_completion_tokens", default_max_tokens=None,
                                    logprobs=logprobs, prompt_logprobs=asked,
                                    renames={"logprobs": "top_logprobs"})
    return Parsed(body.get("model"), [conversation], params, stream, include_usage,
                  bool(body.get("return_token_ids")), fill, logprobs=logprobs, prompt_logprobs=asked,
                  chat=True, cache_salt=_cache_salt(body), extras=_extras(body))


# ---- responses ------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV
    came from the prefix cache (always there, 0 on a miss, as OpenAI sends it)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


# ---- log-probabilities ------------------------------------------------------------------
class TokenNames:
    """Each token's text and bytes, as the logprobs of a response name them (cached).

    The text is ``decoded_token`` when the engine filled it in, else the tokenizer's
    ``decode([id])``. The bytes are the token's own bytes: for a byte-level BPE tokenizer
    (GPT-2's scheme, SmolLM2's and tiny-llama's) read from the token's characters, so a
    token that holds half of a UTF-8 character reports its true bytes, not U+FFFD's;
    otherwise the UTF-8 of its text (SentencePiece byte tokens ``<0xNN>``: that byte).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int, lp=None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if token_id not in self._text:
            self._text[token_id] = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                                    else f"token_id:{token_id}")
        return self._text[token_id]

    def bytes(self, token_id: int) -> list[int]:
        if token_id not in self._bytes:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) if self.tokenizer is not None else None
            if self.byte_level and piece and all(ch in BYTE_OF_CHAR for ch in piece):
                raw = [BYTE_OF_CHAR[ch] for ch in piece]
            elif piece and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                raw = [int(piece[3:5], 16)]
            else:
                raw = list(self.text(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return self._bytes[token_id]


def _by_rank(step: dict, chosen: int | None = None, top: int | None = None) -> list[tuple[int, Any]]:
    """A step's entries, most likely first; with ``top``: only the ``top`` most likely and
    ``chosen`` (the engine may have computed more alternatives than this answer shows)."""
    ranked = sorted(step.items(), key=lambda item: item[1].rank)
    if top is None:
        return ranked
    return [(t, lp) for t, lp in ranked if lp.rank <= top or t == chosen]


def chat_logprobs(names: TokenNames, token_ids: list[int], steps: list[dict], top: int) -> dict:
    """Chat's ``logprobs`` for these tokens: ``{"content": [{token, logprob, bytes,
    top_logprobs: [the ``top`` most likely, each {token, logprob, bytes}]}, ...]}``."""
    content = []
    for token_id, step in zip(token_ids, steps, strict=True):
        chosen = step[token_id]
        content.append({
            "token": names.text(token_id, chosen), "logprob": chosen.logprob, "bytes": names.bytes(token_id),
            "top_logprobs": [{"token": names.text(t, lp), "logprob": lp.logprob, "bytes": names.bytes(t)}
                             for t, lp in _by_rank(step)[:top]]})
    return {"content": content}


def completion_logprobs(names: TokenNames, token_ids: list[int], steps: list[dict | None],
                        text_offset: int = 0, top: int | None = None) -> dict:
    """The legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (the chosen token and the k most likely, most likely first, as ``{text: logprob}``;
    null where ``steps`` has None: the prompt's first token) and ``text_offset`` (each
    token's offset in the choice's text, from ``text_offset`` on, adding up token texts)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, step in zip(token_ids, steps, strict=True):
        chosen = step[token_id] if step is not None else None
        text = names.text(token_id, chosen)
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob if chosen is not None else None)
        entries = None
        if step is not None:             # tokens of the same text: the most likely one's
            entries = {}
            for t, lp in _by_rank(step, token_id, top):
                entries.setdefault(names.text(t, lp), lp.logprob)
        out["top_logprobs"].append(entries)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def vllm_prompt_logprobs(names: TokenNames, token_ids: list[int], steps: list[dict | None],
                         top: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` answer: per prompt token, None (the first) or
    ``{"<token id>": {logprob, rank, decoded_token}}`` for the token and the ``top`` most likely."""
    return [None if step is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": names.text(t, lp)}
             for t, lp in _by_rank(step, token_id, top)}
            for token_id, step in zip(token_ids, steps, strict=True)]
