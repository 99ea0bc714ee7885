"""Step selection shared by every dumper (framework-free)."""

from __future__ import annotations

from collections.abc import Iterable


class NonFiniteError(RuntimeError):
    """Raised by a dumper's ``end_step`` only when ``stop_on_nan`` asked for it, after the trace is written."""


def parse_steps(spec: str | int | Iterable[int] | None) -> frozenset[int] | None:
    """``None`` = every step; ``"1-3,10"``, an int or an iterable of ints = those steps."""
    if spec is None:
        return None
    if isinstance(spec, int):
        return frozenset([spec])
    if isinstance(spec, str):
        out: set[int] = set()
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            if "-" in part:
                a, b = part.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(part))
        return frozenset(out)
    return frozenset(int(s) for s in spec)
