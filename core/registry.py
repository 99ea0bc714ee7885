"""The one extension mechanism: a package's modules each define ``NAME`` (or a list ``NAMES``), collected
by scanning the package. Stages (align/stages) and sources (sources/) are found this way, so adding one
is adding a file."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any


def collect(package: str, path: list[str], single: str, many: str, skip: tuple[str, ...] = ()) -> list[Any]:
    """Every ``single`` object and every item of ``many`` lists in the modules of ``package``."""
    found: list[Any] = []
    for info in pkgutil.iter_modules(path):
        if info.name in skip:
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        found += list(getattr(mod, many, [])) + ([getattr(mod, single)] if hasattr(mod, single) else [])
    return found
