"""The folders tell the story: every import points down the layer stack, and no two units import each other.

Data flows one way (dumpers -> run store -> comparators -> findings -> reports, the procedure and CLI on top).
This test parses every module (no import is executed) and fails on an import that points upward, on one
that closes a cycle between units, and on a framework import in the framework-free layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The stack, bottom up, by folder: a module may import modules of its own folder and of folders of strictly
# lower rank. Each folder that holds modules is placed here (a sub-folder not listed takes its parent's place),
# so a new folder must say where it stands.
LAYERS: list[tuple[str, int]] = [
    ("core", 0),              # errors, findings, dtypes, atomic outputs, the registry helper
    ("runstore", 1),          # the one format: writer, reader, a run in memory
    ("mapping", 2),           # the name-mapping engine and its transforms
    ("models", 3),            # one folder per model family: its presets, detection from a config
    ("sources", 4),           # files users already have -> runs (logs, TensorBoard, msprobe, golden values)
    ("checkpoints", 4),       # framework checkpoint / tensor files (frameworks imported lazily), conversion
    ("dumpers", 4),           # code that runs inside a training process
    ("comparators", 5),       # numpy/pandas comparisons -> findings
    ("reports", 6),           # findings -> html, figures, summary.json
    ("align/checks", 7),      # config checklist, data checks
    ("align/stages", 8),      # the stage registry: one file per stage
    ("align/procedure", 9),   # runs the registry, writes the report; `align report` arguments
    ("demo", 10),             # makes runs, then calls the procedure
    ("align/cli", 11),        # one module per verb, the demo's among them
    ("align", 12),            # `python -m align`
]
PACKAGES = ("core", "runstore", "mapping", "models", "sources", "checkpoints", "dumpers", "comparators", "reports",
            "align", "demo")
FRAMEWORKS = ("torch", "mindspore", "mindformers", "megatron")
# Folders a user with only logs installs: no framework import at all, not even a lazy one (checkpoints/ and
# dumpers/ read or run the frameworks; the CLI reaches them only inside a verb's run()).
FRAMEWORK_FREE = ("core", "runstore", "mapping", "models", "sources", "comparators", "reports", "align/checks",
                  "align/stages", "align/procedure", "align/cli")


def unit_of(folder: str) -> tuple[str, int] | None:
    """The listed folder that holds ``folder`` (itself or its nearest listed parent), with its rank."""
    best = None
    for prefix, rank in LAYERS:
        if folder == prefix or folder.startswith(prefix + "/"):
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


def folder_of(module: str, root: Path = ROOT) -> str | None:
    """The folder that holds ``module`` (a package is its own folder); None outside the project."""
    path = root.joinpath(*module.split("."))
    if path.is_dir():
        return path.relative_to(root).as_posix()
    if path.with_suffix(".py").is_file():
        return path.parent.relative_to(root).as_posix()
    return None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one folder (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(files: list[Path], root: Path = ROOT) -> list[str]:
    bad = []
    edges: dict[str, set[str]] = {}     # folder -> folders it imports (every folder its own node)
    for path in files:
        mod = module_name(path, root)
        folder = path.parent.relative_to(root).as_posix()
        src = unit_of(folder)
        assert src is not None, f"{folder}/: not in LAYERS; place it in the stack"
        for target, line in imports_of(path, root):
            top = target.split(".")[0]
            where = f"{path.relative_to(root)}:{line}"
            if top in FRAMEWORKS and src[0].startswith(FRAMEWORK_FREE):
                bad.append(f"{where}: {mod} imports framework {target}")
            dst_folder = folder_of(target, root) if top in PACKAGES else None
            if dst_folder is None:
                continue
            if dst_folder != folder:
                edges.setdefault(folder, set()).add(dst_folder)
            dst = unit_of(dst_folder)
            if dst is None or dst[0] == src[0]:
                continue
            if dst[1] >= src[1]:
                bad.append(f"{where}: {mod} ({src[0]}/, rank {src[1]}) imports {target} ({dst[0]}/, rank {dst[1]}): "
                           "not below it")
    bad += [f"folder cycle: {' <-> '.join(c)}" for c in cycles(edges)]
    return bad


def test_every_import_points_down() -> None:
    bad = violations(project_modules())
    assert not bad, "\n".join(bad)


def test_every_folder_is_placed() -> None:
    folders = {p.parent.relative_to(ROOT).as_posix() for p in project_modules()}
    assert not [f for f in sorted(folders) if unit_of(f) is None]


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The checker itself: a comparator importing the procedure, a framework in the ground floor, and two
    sub-folders of one place importing each other must all fail it."""
    root = tmp_path
    for d in ("comparators", "align/procedure", "core", "sources/a", "sources/b"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "comparators" / "bad.py").write_text("from align.procedure import report\n")
    (root / "core" / "ok.py").write_text("import numpy\n")
    (root / "core" / "fw.py").write_text("def f():\n    import torch\n")
    (root / "sources" / "a" / "x.py").write_text("from sources.b import y\n")
    (root / "sources" / "b" / "y.py").write_text("from sources.a import x\n")
    bad = violations(sorted(root.rglob("*.py")), root)
    assert any("comparators.bad" in b and "not below" in b for b in bad), bad
    assert any("framework torch" in b for b in bad), bad
    assert any(b == "folder cycle: sources/a <-> sources/b" for b in bad), bad
    assert not any("core.ok" in b for b in bad)
