"""Benchmarks: ``python -m labkit.bench WHAT`` (``__main__.COMMANDS`` lists them)."""


def table_header(columns: list[tuple[str, str]]) -> str:
    """A fixed-width table's column names, each as wide as its format (``(name, "{:>10.3f}")``
    pairs; every format is at least as wide as its name)."""
    return "  ".join(f"{name:<{_width(fmt)}}" if "<" in fmt else f"{name:>{_width(fmt)}}" for name, fmt in columns)


def table_line(columns: list[tuple[str, str]], row: dict) -> str:
    """One row of that table."""
    return "  ".join(fmt.format(row[name]) for name, fmt in columns)


def _width(fmt: str) -> int:
    return int("".join(c for c in fmt.split(":")[1].split(".")[0] if c.isdigit()))
