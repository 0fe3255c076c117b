"""What a request asks its output to match: ``StructuredOutputsParams`` (vLLM's names).

Exactly one constraint per request:

* ``json``: a JSON Schema (a dict or its text); the output is one JSON value valid against it;
* ``json_object=True``: any JSON object (OpenAI's JSON mode);
* ``regex``: the whole output matches the regular expression;
* ``choice``: the output is one of these strings;
* ``grammar``: a context-free grammar, in EBNF (GBNF, llama.cpp's dialect: ``root ::= ...``)
  or in Lark.

Each is turned into an XGrammar ``Grammar`` here, without a tokenizer: parsing it is how a
bad schema or regex is found, when the request is made, with a message that names the
problem. Compiling it against a vocabulary (``labkit.structured.compiler``) comes later,
once per distinct spec. Importing this module does not import XGrammar: a request that asks
for no structure never loads it.
"""

from __future__ import annotations

import functools
import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputsParams:
    """The constraint a request's output must satisfy; give exactly one of ``json``,
    ``json_object``, ``regex``, ``choice``, ``grammar``.

    ``disable_any_whitespace``: JSON is written compactly (``{"a": 1, "b": [2, 3]}``: one
    space after ``:`` and ``,``, none elsewhere) instead of allowing any whitespace between
    tokens. labkit's default is True, unlike vLLM's: small models given the freedom tend to
    emit whitespace until ``max_tokens`` runs out, and a compact layout leaves stretches the
    grammar forces, which jump-forward decoding skips. Pass False for vLLM's behaviour.
    ``disable_additional_properties``: an object schema that says nothing about
    ``additionalProperties`` allows none (OpenAI's strict mode; XGrammar's default here).
    ``disable_fallback`` is accepted for code written against vLLM (labkit has one backend,
    XGrammar, so there is nothing to fall back to).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = True
    disable_fallback: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``KINDS``."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: give exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) if given else 'none'}")
        return given[0]

    def key(self) -> tuple:
        """The spec in a hashable, canonical form: equal keys compile to the same grammar.
        (A schema's property order is kept: it is the order the output writes them in.)"""
        kind = self.kind
        if kind == "json":
            value: Any = _json.dumps(_schema(self.json), ensure_ascii=False, separators=(",", ":"))
        elif kind == "choice":
            value = tuple(self.choice)
        elif kind == "json_object":
            value = True
        else:
            value = getattr(self, kind)
        return (kind, value, self.disable_any_whitespace, self.disable_additional_properties)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the problem: not exactly one constraint, a value of the
        wrong type, a schema, regex or grammar that does not parse, an empty choice."""
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"StructuredOutputsParams.{name}={getattr(self, name)!r}: must be True or False")
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object" and value is not True:
            raise ValueError(f"StructuredOutputsParams.json_object={value!r}: must be True (or None)")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"StructuredOutputsParams.{kind}: must be a non-empty string, got {value!r:.80}")
        if kind == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"StructuredOutputsParams.choice: must be a non-empty list of non-empty strings, "
                                 f"got {value!r:.80}")
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"StructuredOutputsParams.json: must be a JSON Schema (a dict or its JSON text), "
                             f"got {type(value).__name__}")
        parse_grammar(self.key())

    def describe(self) -> str:
        """A short human-readable summary, for logs and widgets."""
        kind = self.kind
        if kind == "json":
            schema = _schema(self.json)
            return f"json schema {schema.get('title') or schema.get('type', '')}".strip()
        if kind == "choice":
            return f"choice of {len(self.choice)}"
        if kind == "json_object":
            return "json object"
        return f"{kind} {getattr(self, kind)[:40]!r}"


def _schema(value: str | dict) -> dict:
    """A JSON Schema given as a dict or as text, as a dict (``ValueError`` if it is neither)."""
    if isinstance(value, dict):
        return value
    try:
        schema = _json.loads(value)
    except _json.JSONDecodeError as e:
        raise ValueError(f"StructuredOutputsParams.json: not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"StructuredOutputsParams.json: a JSON Schema is an object, got {type(schema).__name__}")
    return schema


_DATA_KEYS = ("enum", "const", "default", "examples")   # values, not schemas: left as they are


def _length_as_pattern(node):
    """``node`` (a JSON Schema, or part of one) with each length-bounded string written as
    the same bound on a pattern: ``{"type": "string", "maxLength": 20}`` becomes
    ``{"type": "string", "pattern": "^[\\s\\S]{0,20}$"}``. XGrammar 0.2 compiles ``minLength``
    and ``maxLength`` to a character class that admits raw control characters, which JSON
    forbids inside strings (XGrammar issue #800); its pattern path writes only valid JSON
    strings. (It also refuses escapes there, so such strings hold no ``\\"``: valid, and
    narrower.)"""
    if isinstance(node, list):
        return [_length_as_pattern(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _length_as_pattern(v)) for k, v in node.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = "^[\\s\\S]{%d,%s}$" % (lo, "" if hi is None else hi)
    return out


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose sentences are exactly ``choices`` (JSON string escapes are
    EBNF's too: quotes, backslashes and newlines in a choice stay literal)."""
    return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=256)
def parse_grammar(key: tuple):
    """The XGrammar ``Grammar`` of a spec ``key`` (``StructuredOutputsParams.key()``), parsed
    without a tokenizer; ``ValueError`` naming the problem when it does not parse. Cached:
    a request's params are validated more than once on their way in."""
    import xgrammar as xgr

    kind, value, compact, strict = key
    try:
        if kind == "json":
            schema = _length_as_pattern(_json.loads(value))
            return xgr.Grammar.from_json_schema(_json.dumps(schema), any_whitespace=not compact, strict_mode=strict)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not compact, strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(list(value)))
        if "::=" in value:
            return xgr.Grammar.from_ebnf(value)
        return xgr.Grammar.from_lark(value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"StructuredOutputsParams.{kind}: {_xgrammar_message(e)}") from None


def _xgrammar_message(e: Exception) -> str:
    """XGrammar's error without its C++ source location (``[12:10:59] /project/cpp/x.cc:94: ``)."""
    text = str(e).strip()
    head, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1] if ": " in rest else rest
    return text.splitlines()[0] if text else type(e).__name__
