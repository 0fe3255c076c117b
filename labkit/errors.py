"""Why a request is refused: the exceptions raised for a request that can never be served.

Every check that refuses a request (``SamplingParams.validate``, ``Engine.add_request``,
the scheduler's ``check_request`` in ``labkit/scheduler/checks.py``,
``AsyncEngine.add_request``) raises one of these, and changes nothing: the engine goes on
serving the others. Each names the request field at fault, ``param`` (OpenAI's name for
it: ``"prompt"``, ``"n"``, ``"max_tokens"``, ...; None when no one field is), and the kind
of refusal, ``code``. The HTTP server builds OpenAI's error body from these two attributes
(``labkit/server/errors.py``); nothing reads the message to learn what went wrong, so the
message is free to explain it to a person.

All of them are ``ValueError``: whoever catches ``ValueError`` (``LLM.generate``, turning a
refusal into an error output; the tests) catches them too.

    RequestError               a request that can never be served as asked (the base)
    ├── InvalidParameter       a value that means no request (``top_p=0``, a token id outside the vocabulary)
    ├── LimitExceeded          a valid value beyond what this engine is set up for (``n`` over ``max_num_seqs``)
    ├── ContextLengthExceeded  a prompt, with its output, longer than the model or the KV cache allows
    └── DuplicateRequestId     an id that an unfinished request holds already
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served as asked. ``param``: the request's field at
    fault (None: no field in particular); ``code``: the kind of refusal (None: unnamed)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class InvalidParameter(RequestError):
    """A value that defines no request, on any engine: ``temperature=-1``, an empty prompt,
    a token id outside the vocabulary."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message, param, "invalid_value")


class LimitExceeded(RequestError):
    """A value that is fine in itself but beyond a limit this engine (or server) is
    configured with: more samples than ``max_num_seqs``, more beams than a batch holds.
    Another configuration could serve it; this one never will."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message, param, "limit_exceeded")


class ContextLengthExceeded(RequestError):
    """A prompt, with the tokens it asks for, longer than the model's context, than the
    whole KV cache, or than one iteration can recompute. ``param`` is ``"prompt"`` (the
    server says ``"messages"`` for a chat request): shortening it, or asking for fewer
    tokens, is the fix. OpenAI's code."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message, param, "context_length_exceeded")


class DuplicateRequestId(RequestError):
    """A request id that an unfinished request holds already. No field is at fault (the
    id comes from the caller, or a header), so ``param`` is None."""

    def __init__(self, message: str):
        super().__init__(message, None, "duplicate_request_id")
