"""The documented list of what changes numerics besides model and config (``numerics_env.yaml``), as data.

Why one list for both ends: the capture (dumpers/environment.py, ``align capture-env``) records what the
list names, and the comparison (comparators/environment.py) says why a difference matters from the same
entries, so a variable is never recorded without a reason or judged without having been recorded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SPEC_FILE = Path(__file__).with_name("numerics_env.yaml")
FRAMEWORKS = ("torch", "mindspore")
LEVELS = ("fail", "warn", "info")


@dataclass(frozen=True)
class Variable:
    name: str
    framework: str          # torch | mindspore | any: the side that reads it
    level: str              # fail | warn | info (info: shown, never a finding)
    why: str


@dataclass(frozen=True)
class Switch:
    """One switch of a concept: an environment variable or a framework setting, and the values that mean on
    (``"*"``: any value set)."""

    kind: str               # env | setting
    name: str
    on: tuple[Any, ...] | str

    def state(self, value: Any) -> bool | None:
        """True when ``value`` turns the switch on, False when not, None when the value is unknown (a setting
        the capture could not read). An unset variable is off."""
        if self.kind == "setting" and value is None:
            return None
        if self.on == "*":
            return value is not None and value != ""
        return value in self.on


@dataclass(frozen=True)
class Concept:
    name: str
    title: str
    level: str
    why: str
    switches: dict[str, tuple[Switch, ...]]   # framework -> its switches (none listed: always off)

    def variables(self) -> set[str]:
        return {s.name for sw in self.switches.values() for s in sw if s.kind == "env"}


@dataclass(frozen=True)
class Package:
    name: str
    level: str
    why: str


@dataclass(frozen=True)
class Spec:
    variables: dict[str, Variable]
    prefixes: dict[str, tuple[str, ...]]
    secret_words: tuple[str, ...]
    concepts: dict[str, Concept]
    packages: dict[str, Package]

    def watched(self, name: str) -> bool:
        """Whether a capture records variable ``name`` (listed, or under a listed prefix)."""
        return name in self.variables or any(name.startswith(p) for ps in self.prefixes.values() for p in ps)

    def framework_of(self, name: str) -> str:
        """The side that reads ``name`` (listed, or by its prefix; ``any`` when neither says)."""
        if name in self.variables:
            return self.variables[name].framework
        for fw, ps in self.prefixes.items():
            if any(name.startswith(p) for p in ps):
                return fw
        return "any"

    def secret(self, name: str) -> bool:
        upper = name.upper()
        return any(w in upper for w in self.secret_words)


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"{SPEC_FILE}: {what}")


@functools.lru_cache(maxsize=1)
def load_spec() -> Spec:
    """The shipped list (read once). A malformed file is our bug, not the user's: RuntimeError."""
    raw = yaml.safe_load(SPEC_FILE.read_text(encoding="utf-8"))
    _need(isinstance(raw, dict), "top level must be a mapping")
    variables = {}
    for name, v in (raw.get("variables") or {}).items():
        _need(isinstance(v, dict) and v.get("framework") in (*FRAMEWORKS, "any") and v.get("level") in LEVELS
              and isinstance(v.get("why"), str) and v["why"], f"variable {name}: needs framework, level and why")
        variables[name] = Variable(name, v["framework"], v["level"], " ".join(v["why"].split()))
    concepts = {}
    for name, c in (raw.get("concepts") or {}).items():
        _need(isinstance(c, dict) and c.get("level") in LEVELS and c.get("why") and c.get("title"),
              f"concept {name}: needs title, level and why")
        switches = {}
        for fw in FRAMEWORKS:
            items = []
            for s in c.get(fw) or []:
                kind = "env" if "env" in s else "setting"
                _need(kind in s and "when" in s, f"concept {name}.{fw}: a switch needs env or setting, and when")
                on = s["when"] if s["when"] == "*" else tuple(s["when"])
                items.append(Switch(kind, str(s[kind]), on))
            switches[fw] = tuple(items)
        concepts[name] = Concept(name, c["title"], c["level"], " ".join(c["why"].split()), switches)
    packages = {}
    for name, p in (raw.get("packages") or {}).items():
        _need(isinstance(p, dict) and p.get("level") in LEVELS and p.get("why"), f"package {name}: needs level, why")
        packages[name] = Package(name, p["level"], " ".join(p["why"].split()))
    prefixes = {k: tuple(v) for k, v in (raw.get("prefixes") or {}).items()}
    return Spec(variables, prefixes, tuple(raw.get("secret_words") or ()), concepts, packages)
