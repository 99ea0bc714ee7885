"""The `align` command's verb table: every verb listed in --help, help texts built from the source table, and
a verb whose optional extra is missing saying which extra to install (exit 2, one line)."""

from __future__ import annotations

import sys

import pytest

from align.cli import VERBS, build_parser, main
from sources import sources


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_verb_is_listed(capsys) -> None:
    text = _help(["--help"], capsys)
    assert all(f" {verb} " in text for verb in VERBS), text


@pytest.mark.parametrize("verb", ["report", "import"])
def test_run_kinds_come_from_the_source_table(verb, capsys) -> None:
    text = _help([verb, "--help"], capsys)
    described = [s.describe for s in sources() if not (verb == "import" and s.kind == "runstore")]
    flat = "".join(text.split())         # argparse wraps lines, also after a hyphen
    assert described and all("".join(d.split()) in flat for d in described), text


def test_a_missing_extra_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"not read: torch is missing")
    monkeypatch.setitem(sys.modules, "torch", None)     # `import torch` now raises ModuleNotFoundError
    rc = main(["convert-weights", "--to", "mindformers", str(pt), "--out", str(tmp_path / "out.safetensors"),
               "--num-heads", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "align convert-weights" in err[0] and "pip install 'xf-align[torch]'" in err[0], err
    assert not (tmp_path / "out.safetensors").exists()


def test_an_internal_error_exits_3_with_the_traceback_saved(tmp_path, monkeypatch, capsys) -> None:
    """A bug of ours is not a `fail` verdict (1) nor bad input (2): exit 3, one line naming the saved traceback."""
    import align.cli.check_data as verb

    def broken(args):
        raise ZeroDivisionError("a bug\nover two lines")

    monkeypatch.setattr(verb, "run", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    rc = main(["check-data", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3 and len(err) == 1, err
    assert "internal error in `align check-data`: ZeroDivisionError: a bug over two lines" in err[0]
    saved = [p for p in tmp_path.iterdir() if p.name.endswith(".traceback.txt")]
    assert len(saved) == 1 and str(saved[0]) in err[0]
    assert "Traceback (most recent call last)" in saved[0].read_text()


def test_a_bad_mapping_is_refused_even_where_no_stage_needs_one(tmp_path, capsys) -> None:
    from demo.example_logs import write_examples

    write_examples(tmp_path / "ex", 20, "none", None)
    bad = tmp_path / "bad.yaml"
    bad.write_text("!!python/object/apply:os.system ['echo owned']\n")
    rc = main(["report", "-q", str(tmp_path / "ex" / "megatron_baseline.log"),
               str(tmp_path / "ex" / "mindformers_candidate.log"), "--mapping", str(bad), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(bad) in err[0], err
    assert not (tmp_path / "r").exists()


def test_the_demo_without_its_frameworks_names_the_extra(tmp_path, monkeypatch, capsys) -> None:
    """The demo's runs start in their own processes: a missing framework is named before any starts."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mindspore" else real(name, *a))
    rc = main(["demo", "--out", str(tmp_path / "d"), "--steps", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "pip install 'xf-align[mindspore]'" in err[0], err
    assert not (tmp_path / "d").exists()
