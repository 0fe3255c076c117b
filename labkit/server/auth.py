"""API keys: who may use the server, and under which name their usage is counted.

A key ring maps secret keys to names. An instructor hands each student a key; the server
counts requests, tokens and rejections per *name* (``/metrics`` never shows a key), and
the fair-share gate (``fairness.py``) gives each name its own queue.

Keys come from three places, all in the same format, ``key`` or ``name:key`` (the first
colon separates the name):

* ``--api-key KEY`` (repeatable);
* ``--api-keys-file FILE``: one per line; blank lines and lines starting with ``#`` skipped;
* the environment variable ``LABKIT_API_KEY`` (several separated by commas), as vLLM
  reads ``VLLM_API_KEY``.

A key without a name is called ``key-1``, ``key-2``, ... in the order read.

A client proves it holds a key with ``Authorization: Bearer <key>``, which every OpenAI
client sends (``api_key=...``). The check compares the SHA-256 digest of what was sent
with every key's digest using ``hmac.compare_digest`` and never stops early, so the time
it takes says nothing about which key, or how much of one, was right.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from pathlib import Path

ENV_VAR = "LABKIT_API_KEY"
_NAME = re.compile(r"[A-Za-z0-9_.@+-]{1,64}")     # safe in a Prometheus label, readable


class KeyRing:
    """The keys a server accepts, each with the name its usage is counted under.

    Invariants: keys are unique, non-empty and free of whitespace; names are unique and
    match ``[A-Za-z0-9_.@+-]{1,64}``. An empty ring means "no authentication".
    """

    def __init__(self, entries: list[tuple[str, str]] | None = None):
        self._digests: list[tuple[bytes, str]] = []        # (sha256(key), name)
        self._names: set[str] = set()
        for name, key in entries or ():
            self.add(key, name)

    def add(self, key: str, name: str | None = None, where: str = "") -> None:
        """Accept ``key``, counted as ``name`` (default ``key-<n>``)."""
        at = f" ({where})" if where else ""
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"an API key must be non-empty and without whitespace{at}")
        name = name if name is not None else f"key-{len(self._digests) + 1}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"key name {name!r}{at} must be 1-64 characters from A-Z a-z 0-9 _ . @ + -")
        if name in self._names:
            raise ValueError(f"key name {name!r}{at} is given twice: each key needs its own name")
        digest = _digest(key)
        if any(hmac.compare_digest(digest, d) for d, _ in self._digests):
            raise ValueError(f"the key named {name!r}{at} is the same as an earlier key")
        self._digests.append((digest, name))
        self._names.add(name)

    def add_spec(self, spec: str, where: str = "") -> None:
        """Add ``key`` or ``name:key``."""
        name, sep, key = spec.strip().partition(":")
        if sep:
            self.add(key, name, where)
        else:
            self.add(name, None, where)

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the key in an ``Authorization: Bearer <key>`` header, or None.

        Constant time in the key: every stored digest is compared, whatever matched."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = _digest(token.strip())
        found = None
        for stored, name in self._digests:
            if hmac.compare_digest(digest, stored):
                found = name
        return found

    @property
    def names(self) -> list[str]:
        return [name for _, name in self._digests]

    def __len__(self) -> int:
        return len(self._digests)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:             # never the keys
        return f"KeyRing({len(self)} keys: {', '.join(self.names[:5])}{', ...' if len(self) > 5 else ''})"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_keys(keys: list[str] | None = None, keys_file: str | os.PathLike | None = None,
              environ: dict[str, str] | None = None) -> KeyRing:
    """A ring from ``--api-key`` values, an ``--api-keys-file`` and ``LABKIT_API_KEY``
    (``environ``: default ``os.environ``). Raises ``ValueError`` naming the bad entry."""
    ring = KeyRing()
    for i, spec in enumerate(keys or ()):
        ring.add_spec(spec, f"--api-key #{i + 1}")
    if keys_file is not None:
        path = Path(keys_file)
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()     # -sig: a BOM from Notepad
        except OSError as e:
            raise ValueError(f"cannot read the API keys file {str(path)!r}: {e.strerror or e}") from None
        before = len(ring)
        for n, line in enumerate(lines, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                ring.add_spec(line, f"{path.name} line {n}")
        if len(ring) == before:
            raise ValueError(f"the API keys file {str(path)!r} holds no key "
                             "(one 'key' or 'name:key' per line)")
    env = (os.environ if environ is None else environ).get(ENV_VAR, "")
    for i, spec in enumerate(s for s in env.split(",") if s.strip()):
        ring.add_spec(spec, f"{ENV_VAR} item {i + 1}")
    return ring
