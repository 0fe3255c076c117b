"""Small arithmetic shared by every layer (no imports from labkit, so any module may use it)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers: how many size-``b`` pieces hold ``a`` items.

    ``cdiv(33, 16) == 3``: 33 tokens need three 16-slot blocks. Integer-only, so it is exact
    where ``math.ceil(a / b)`` would round through a float.
    """
    return -(-a // b)
