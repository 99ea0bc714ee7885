"""Model families: one folder each (``models/<family>/``), found by scanning this package.

A family's folder holds its mapping preset(s) (YAML, named by the file's stem) and an ``__init__.py`` that
declares ``FAMILY`` (:class:`models.family.Family`): how to tell the family from a parsed MindFormers YAML,
the run name scheme or weights suffix that implies it, and the demo's ``--model`` kind if the demo builds
it. Adding a family is adding a folder (docs/extending.md). The table is built on first use.

Preset names resolve here (``load_mapping``); ``mapping`` itself reads files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import BadInput
from core.registry import collect
from mapping import Mapping
from models.family import Family

# The preset when nothing says which: Megatron-core <-> MindFormers' legacy Llama (models/llama).
DEFAULT_PRESET = "megatron_core_llama__mindformers_llama"

_TABLE: list[Family] | None = None


def families() -> list[Family]:
    """Every family, in detection order."""
    global _TABLE
    if _TABLE is None:
        found: list[Family] = collect(__name__, __path__, "FAMILY", "FAMILIES")
        seen: dict[str, str] = {}
        for f in found:
            for p in f.presets:
                if p in seen:
                    raise BadInput(f"preset {p} is declared by families {seen[p]} and {f.name}")
                seen[p] = f.name
        _TABLE = sorted(found, key=lambda f: (f.order, f.name))
    return _TABLE


def family(name: str) -> Family:
    for f in families():
        if f.name == name:
            return f
    raise BadInput(f"{name}: no such model family; known: {', '.join(f.name for f in families())}")


def presets() -> list[str]:
    """Every shipped preset's name."""
    return sorted(p for f in families() for p in f.presets)


def preset_path(name: str) -> Path | None:
    """The YAML file of preset ``name``, or None."""
    for f in families():
        if name in f.presets:
            return f.preset_path(name)
    return None


def load_mapping(name_or_file: str | Path | None = None) -> Mapping:
    """A preset name (see ``presets()``; None: :data:`DEFAULT_PRESET`) or a path to a YAML mapping file."""
    ref = str(name_or_file or DEFAULT_PRESET)
    path = Path(ref)
    if not path.is_file():
        found = preset_path(ref)
        if found is None or not found.is_file():
            raise BadInput(f"{ref}: neither a mapping file nor a preset (presets: {', '.join(presets())})")
        path = found
    return Mapping.load(path)


def preset_for_config(cfg: dict[str, Any]) -> str | None:
    """The preset a parsed MindFormers YAML's model needs (the first family, in order, that claims it)."""
    for f in families():
        if f.detect is not None:
            preset = f.detect(cfg)
            if preset is not None:
                return preset
    return None


def preset_for_scheme(name_scheme: str | None) -> str | None:
    """The preset of the family whose runs carry ``name_scheme`` (run metadata), or None."""
    for f in families():
        if name_scheme and f.name_scheme == name_scheme:
            return f.main_preset
    return None


def preset_for_weights(path: str | Path) -> str | None:
    """The preset of the family whose MindFormers weights files end like ``path``, or None."""
    for f in families():
        if f.weights_suffix and str(path).endswith(f.weights_suffix):
            return f.main_preset
    return None


def preset_for_names(*named: tuple[list[str], str], prefer: str | None = None) -> str | None:
    """The preset that covers the most of these tensor names, each list on its side (``(names, "baseline")``
    for Megatron's, ``(names, "candidate")`` for MindFormers'; ignored names count as covered), or None when
    none covers any. Among presets covering as many, ``prefer`` wins if it is one of them, then the one with
    the fewest rules left unused (mcore names are the same on both sides, so a dense checkpoint is covered by
    the MLA presets too; they leave their MLA rules unused), then the family asked first. Why from names: a
    checkpoint carries no config, and its names tell MoE (a router, experts), MLA (linear_q_down_proj,
    linear_kv_down_proj ...) and the legacy Llama (model.layers.N.attention.wq ...) apart."""
    best = _coverage(named, prefer)
    return best[0] if best is not None else None


def _coverage(named: tuple[tuple[list[str], str], ...], prefer: str | None = None
              ) -> tuple[str, list[str]] | None:
    """The best preset for ``named`` (see ``preset_for_names``) and the names it leaves uncovered."""
    best, best_score, best_left = None, (0, False, 0), []
    for f in families():
        # a family's presets differ on one side only (MLA's mla_qkv_concat: MindFormers' names); the family
        # offers the first (its main preset first) covering the most, ``prefer`` on a tie
        mine, mine_score, mine_left = None, (0, False), []
        for preset in f.presets:
            m = load_mapping(preset)
            covered, used, left = 0, set(), []
            for names, side in named:
                for n in names:
                    hit = m.match(n, side)
                    if hit is not None:
                        used.add(hit.rule.id)
                    if hit is not None or m.ignored(n, side):
                        covered += 1
                    else:
                        left.append(n)
            if covered and (covered, preset == prefer) > mine_score:
                mine, mine_score, mine_left = preset, (covered, preset == prefer), left
                unused = len(m.rules) - len(used)
        if mine is not None and (*mine_score, -unused) > best_score:
            best, best_score, best_left = mine, (*mine_score, -unused), mine_left
    return (best, best_left) if best is not None else None


def preset_for_checkpoint(names: list[str], side: str, weights_file: str | Path, where: str) -> str:
    """The preset for converting one checkpoint, from its tensor names (``side``: ``baseline`` for Megatron's,
    ``candidate`` for MindFormers'): the preset that covers every name (MoE: a router and experts; MLA:
    linear_q_down_proj / linear_kv_down_proj; the legacy Llama: model.layers.N.attention.wq ...). The
    MindFormers file's format only breaks a tie the names leave: a dense Megatron GPT's names are the same for
    the mcore dense and the legacy Llama presets, so .safetensors (MindFormers 2.x) means mcore, a .ckpt the
    legacy Llama. A checkpoint no preset covers is bad input, naming a few of the names left over."""
    names = list(names)
    prefer = preset_for_weights(weights_file) or DEFAULT_PRESET
    if not names:   # nothing to tell by: the format's preset, whose checks then say the file holds no tensors
        return prefer
    best = _coverage(((names, side),), prefer=prefer)
    if best is not None and not best[1]:
        return best[0]
    if best is None:
        left, closest = names, ""
    else:
        left, closest = best[1], f" ({len(best[1])} of {len(names)} match no rule of the closest, {best[0]})"
    shown = ", ".join(repr(n) for n in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    raise BadInput(f"{where}: no preset covers its tensor names{closest}: {shown}; "
                   f"pass --mapping with a preset (align mapping list) or a mapping file")


def demo_presets() -> dict[str, str]:
    """The demo's model kinds (``--model``) -> the preset of their family."""
    return {f.demo_kind: f.main_preset for f in families() if f.demo_kind}


__all__ = ["DEFAULT_PRESET", "Family", "demo_presets", "families", "family", "load_mapping", "preset_for_checkpoint",
           "preset_for_config", "preset_for_names", "preset_for_scheme", "preset_for_weights", "preset_path",
           "presets"]
