"""Step selection shared by every dumper (framework-free): ``"1-3,10"`` -> the steps it names.

The rest of the dumper contract is in dumpers/contract.py."""

from __future__ import annotations

from collections.abc import Iterable


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
