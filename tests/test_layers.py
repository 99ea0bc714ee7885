"""The folders tell the story: every import points down the layer stack, and no two units import each other.

Data flows one way (dumpers -> run store -> comparators -> findings -> reports, the procedure and CLI on top).
This test parses every module (no import is executed) and fails on an import that points upward, on one
that closes a cycle between units, and on a framework import in the framework-free layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (module prefix, rank): a module may import its own unit or a unit of strictly lower rank.
LAYERS: list[tuple[str, int]] = [
    ("align.core", 0),             # errors, findings, run store, runs, mapping + presets
    ("align.sources", 1),          # files users already have: logs, TensorBoard, configs
    ("dumpers", 1),                # code that runs inside a training process
    ("comparators", 2),            # numpy/pandas comparisons -> findings
    ("reports", 3),                # findings -> html, figures, summary.json
    ("align.checks", 4),           # config checklist, data checks
    ("align.checkpoints", 4),      # framework tensor / checkpoint files (frameworks imported lazily)
    ("align.convert_weights", 5),  # checkpoint conversion through the mapping (reads align.checkpoints)
    ("align.examples", 4),
    ("align.stages", 5),           # the stage registry: one file per stage
    ("align.procedure", 6),        # runs the registry, writes the report
    ("align.report_args", 6),      # `align report` arguments -> procedure Inputs (CLI and demo)
    ("demo", 7),                   # makes runs, then calls the procedure
    ("align.cli", 8),
    ("align.__main__", 9),
    ("align", 8),                  # the package's own __init__
]
PACKAGES = ("align", "dumpers", "comparators", "reports", "demo")
FRAMEWORKS = ("torch", "mindspore", "mindformers", "megatron")
# Layers a user with only logs installs: no framework import at all, not even a lazy one, except where a
# checkpoint format is read or written (convert_weights, imported only by that command).
FRAMEWORK_FREE = ("align.core", "align.sources", "align.checks", "align.stages", "align.procedure", "align.report_args",
                  "comparators", "reports")


def unit_of(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    return best


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """Absolute module names imported anywhere in the file (lazy imports count), with their line."""
    tree = ast.parse(path.read_text(), str(path))
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` may name a submodule: count pkg.sub when it exists as a file
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = root.joinpath(*sub.split("."))
                found.append((sub if target.with_suffix(".py").is_file() or target.is_dir() else base,
                              node.lineno))
    return found


def project_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    edges: dict[str, set[str]] = {}
    for path in files:
        mod = module_name(path, root)
        src = unit_of(mod)
        assert src is not None, f"{mod}: not in LAYERS; place it in a layer"
        for target, line in imports_of(path, root):
            top = target.split(".")[0]
            where = f"{path.relative_to(root)}:{line}"
            if top in FRAMEWORKS and src[0].startswith(FRAMEWORK_FREE):
                bad.append(f"{where}: {mod} imports framework {target}")
            if top not in PACKAGES:
                continue
            dst = unit_of(target)
            if dst is None or dst[0] == src[0]:
                continue
            edges.setdefault(src[0], set()).add(dst[0])
            if dst[1] >= src[1]:
                bad.append(f"{where}: {mod} (layer {src[1]}) imports {target} (layer {dst[1]}): upward")
    # cycles between units (possible only among units of one rank, but checked for any)
    for a, outs in edges.items():
        for b in outs:
            if a in edges.get(b, set()):
                bad.append(f"cycle: {a} <-> {b}")
    return bad


def test_every_import_points_down() -> None:
    bad = violations(project_modules())
    assert not bad, "\n".join(bad)


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The checker itself: a comparator importing the procedure must fail it."""
    fake_root = tmp_path
    (fake_root / "comparators").mkdir()
    (fake_root / "align" / "core").mkdir(parents=True)
    (fake_root / "comparators" / "bad.py").write_text("from align.procedure import report\n")
    (fake_root / "align" / "core" / "ok.py").write_text("import numpy\n")
    (fake_root / "align" / "core" / "fw.py").write_text("def f():\n    import torch\n")
    bad = violations(sorted(fake_root.rglob("*.py")), fake_root)
    assert any("comparators.bad" in b and "upward" in b for b in bad), bad
    assert any("framework torch" in b for b in bad), bad
    assert not any("align.core.ok" in b for b in bad)
