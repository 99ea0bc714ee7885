"""What a model family declares (one folder under models/, its ``FAMILY``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    """A model family: its mapping presets (YAML files in its folder, named by their stem) and how to tell it.

    ``detect(cfg)``: the preset a parsed MindFormers YAML needs when the config is this family's, else None;
    families are asked in ``order`` (first answer wins), so a narrower family (MLA) goes before a broader one
    (dense). A family without ``detect`` is chosen only by name or as the default. ``name_scheme``: a
    candidate run whose metadata names this scheme (and no config says otherwise) gets the first preset;
    ``weights_suffix``: a MindFormers weights file with this suffix breaks a tie a checkpoint's tensor names leave
    between this family and another (convert-weights: names choose the preset, ``models.preset_for_checkpoint``).
    ``demo_kind``: the demo's ``--model`` value for this family (demo/ holds the tiny model), if it has one.
    """

    name: str
    folder: Path
    presets: tuple[str, ...]
    describe: str
    order: int = 100
    detect: Callable[[dict[str, Any]], str | None] | None = None
    name_scheme: str | None = None
    weights_suffix: str | None = None
    demo_kind: str | None = None

    @property
    def main_preset(self) -> str:
        return self.presets[0]

    def preset_path(self, preset: str) -> Path:
        return self.folder / f"{preset}.yaml"


def declare(module_file: str, main: str | None = None, **fields: Any) -> Family:
    """The family of the folder holding ``module_file`` (its ``__init__.py``): named after the folder, its
    presets every ``*.yaml`` there, ``main`` first (the one a name scheme, a weights suffix or the demo
    implies), else in name order."""
    folder = Path(module_file).resolve().parent
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    if main is not None:
        if main not in names:
            raise ValueError(f"{folder}: no preset {main}.yaml")
        names.remove(main)
        names.insert(0, main)
    return Family(name=folder.name, folder=folder, presets=tuple(names), **fields)
