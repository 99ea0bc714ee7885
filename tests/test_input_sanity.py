"""Input sanity before any compare (issue 36, item 4): the same input twice, a byte copy or a run whose every
loss equals the baseline's bit for bit is a warning naming the inputs, never a plain pass; a MindFormers
baseline with a Megatron candidate is a warning that says to swap them; an ``--out`` that cannot be written
is refused before anything is read; an unreadable input is bad input (exit 2, one line naming the file)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from align.cli import main
from demo.example_logs import write_examples

STEPS = 60      # above MIN_IDENTICAL_PRINTED: logs print about 7 digits


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_examples(tmp_path_factory.mktemp("logs"), STEPS, "none", None)


def report(out: Path, *runs: Path | str, capsys: pytest.CaptureFixture[str] | None = None) -> tuple[int, dict]:
    rc = main(["report", "-q", *map(str, runs), "--out", str(out)])
    return rc, json.loads((out / "summary.json").read_text())


def sanity(summary: dict) -> list[dict]:
    return [f for f in summary["findings"] if f["stage"] == "input_sanity"]


def test_the_stage_runs_first() -> None:
    from align.stages import registry

    first = registry()[0]
    assert first.name == "input_sanity" and first.needs and first.capture


def test_the_same_file_twice_is_a_warning_that_names_it(logs, tmp_path) -> None:
    base = logs["baseline"]
    rc, s = report(tmp_path / "r", base, base)
    (f,) = sanity(s)
    assert rc == 0 and s["stages"]["input_sanity"]["verdict"] == "warn" and s["verdict"] != "pass"
    assert f["metric"] == "same_input" and f["component"] == "inputs" and str(base) in f["message"]
    assert "same file" in f["message"]


def test_a_symlink_to_the_baseline_is_the_same_file(logs, tmp_path) -> None:
    link = tmp_path / "link.log"
    link.symlink_to(logs["baseline"])
    _, s = report(tmp_path / "r", logs["baseline"], link)
    (f,) = sanity(s)
    assert f["verdict"] == "warn" and f["metric"] == "same_input" and str(link) in f["message"]


def test_a_byte_copy_is_a_warning_naming_both_files(logs, tmp_path) -> None:
    copy = tmp_path / "copy.log"
    shutil.copyfile(logs["baseline"], copy)
    _, s = report(tmp_path / "r", logs["baseline"], copy)
    (f,) = sanity(s)
    assert f["verdict"] == "warn" and f["metric"] == "identical_content"
    assert str(logs["baseline"]) in f["message"] and str(copy) in f["message"] and "byte" in f["message"]


def test_a_store_imported_from_the_baseline_log_has_its_losses_bit_for_bit(logs, tmp_path) -> None:
    """Different bytes (a folder against a log), the same run: every loss equal bit for bit is suspicious."""
    assert main(["import", str(logs["baseline"]), "--out", str(tmp_path / "store")]) == 0
    _, s = report(tmp_path / "r", logs["baseline"], tmp_path / "store")
    (f,) = sanity(s)
    assert f["verdict"] == "warn" and f["metric"] == "identical_losses" and f["value"] == STEPS
    assert "bit for bit" in f["message"] and "suspicious" in f["message"] and str(tmp_path / "store") in f["message"]


def test_two_run_stores_with_the_same_scalars_are_suspicious(logs, tmp_path) -> None:
    assert main(["import", str(logs["baseline"]), "--out", str(tmp_path / "a")]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    meta = tmp_path / "b" / "meta.json"
    meta.write_text(meta.read_text().replace('"megatron-lm"', '"megatron-lm" ', 1))   # other bytes, same run
    _, s = report(tmp_path / "r", tmp_path / "a", tmp_path / "b")
    assert [f["metric"] for f in sanity(s)] == ["identical_losses"]


def test_swapped_roles_say_to_swap_them(logs, tmp_path) -> None:
    rc, s = report(tmp_path / "r", logs["candidate"], logs["baseline"])
    (f,) = sanity(s)
    assert rc in (0, 1) and f["verdict"] == "warn" and f["metric"] == "roles_swapped"
    assert "swap" in f["message"] and str(logs["candidate"]) in f["message"] and str(logs["baseline"]) in f["message"]
    # the hint is the command with the runs the right way round
    assert f"align report {logs['baseline']} {logs['candidate']}" in f["message"]


def test_a_swapped_lr0_pair_says_to_swap_it(logs, tmp_path) -> None:
    rc = main(["report", "-q", str(logs["baseline"]), str(logs["candidate"]), "--lr0", str(logs["candidate"]),
               str(logs["baseline"]), "--out", str(tmp_path / "r")])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    (f,) = sanity(s)
    assert rc in (0, 1) and f["verdict"] == "warn" and f["metric"] == "lr0_roles_swapped"
    assert f"--lr0 {logs['baseline']} {logs['candidate']}" in f["message"]


def test_a_clean_pair_passes_and_says_what_was_checked(logs, tmp_path) -> None:
    _, s = report(tmp_path / "r", logs["baseline"], logs["candidate"])
    (f,) = sanity(s)
    assert s["stages"]["input_sanity"]["verdict"] == "pass" and f["verdict"] == "pass"
    assert "different inputs" in f["message"] and "swapped roles" in f["message"]
    assert s["stages"]["input_sanity"]["sides"] == {"baseline": "megatron", "candidate": "mindformers"}


def test_a_short_log_pair_printing_the_same_digits_is_not_suspicious(logs, tmp_path) -> None:
    """Logs print about 7 digits: a pair that agrees to 1e-7 prints the same losses for a while."""
    from align.stages.input_sanity import MIN_IDENTICAL_PRINTED

    short = write_examples(tmp_path / "short", MIN_IDENTICAL_PRINTED - 1, "none", None)
    assert main(["import", str(short["baseline"]), "--out", str(tmp_path / "store")]) == 0
    _, s = report(tmp_path / "r", short["baseline"], tmp_path / "store")
    (f,) = sanity(s)
    assert f["verdict"] == "pass" and "bit for bit at only" in f["message"], f


def test_the_lr0_pair_given_twice_is_said(logs, tmp_path) -> None:
    rc = main(["report", "-q", str(logs["baseline"]), str(logs["candidate"]), "--lr0", str(logs["baseline"]),
               str(logs["baseline"]), "--out", str(tmp_path / "r")])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    (f,) = sanity(s)
    assert rc in (0, 1) and f["metric"] == "same_input" and "lr=0 baseline and the lr=0 candidate" in f["message"]


def test_two_steps_of_equal_losses_are_not_enough_to_warn(tmp_path) -> None:
    """One or two steps of a well-aligned pair may print the same digits: no warning below three."""
    from align.stages.input_sanity import MIN_IDENTICAL_STEPS, identical_scalars
    from runstore.run import Run, make_series

    a = Run("a", "megatron_log", scalars={"loss": make_series([1, 2], [10.5, 10.25], "loss")})
    b = Run("b", "mindformers_log", scalars={"loss": make_series([1, 2, 3], [10.5, 10.25, 9.0], "loss")})
    n, equal = identical_scalars(a, b)
    assert n == 2 < MIN_IDENTICAL_STEPS and equal == ["loss"]
    c = Run("c", "mindformers_log", scalars={"loss": make_series([1, 2], [10.5, 10.250000000000002], "loss")})
    assert identical_scalars(a, c) == (2, [])


# -- --out checked before any work --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["file", "dangling symlink", "file as parent", "unwritable parent"])
def test_an_out_that_cannot_be_written_is_refused_before_reading(kind, logs, tmp_path, capsys, monkeypatch) -> None:
    """The baseline does not exist: an --out check that came after loading would name the baseline."""
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("x")
    elif kind == "dangling symlink":
        out.symlink_to(tmp_path / "nowhere")
    elif kind == "file as parent":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        out = ro / "out"
        real = os.access
        monkeypatch.setattr("core.outputs.os.access",
                            lambda p, mode, **kw: False if Path(p) == ro else real(p, mode, **kw))
    rc = main(["report", "-q", str(tmp_path / "missing.log"), str(logs["candidate"]), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(out) in err[0] and "missing.log" not in err[0], err


def test_import_checks_its_out_before_reading_the_source(tmp_path, capsys) -> None:
    (tmp_path / "out").write_text("x")
    rc = main(["import", str(tmp_path / "missing.log"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(tmp_path / "out") in err[0] and "missing" not in err[0], err


@pytest.mark.parametrize("verb", ["capture-env", "check-data", "check-config"])
def test_other_verbs_check_their_output_file_first(verb, tmp_path, capsys) -> None:
    target = tmp_path / "dir_not_file"
    target.mkdir()
    argv = {"capture-env": ["capture-env", "--framework", "torch", "--data", str(tmp_path / "missing"),
                            "--out", str(target)],
            "check-data": ["check-data", str(tmp_path / "missing"), "--json", str(target)],
            "check-config": ["check-config", str(tmp_path / "missing.log"), str(tmp_path / "missing.yaml"),
                             "--json", str(target)]}[verb]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(target) in err[0] and "missing" not in err[0], err


# -- unreadable inputs: bad input (exit 2, one line), not an internal error ---------------------------------
def _deny(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """Reading ``victim`` fails with EACCES, as for a file without read permission (the tests run as root,
    where chmod does not stop a read)."""
    import builtins
    import io

    real_open, real_io_open = builtins.open, io.open

    def guarded(opener):
        def fake(file, *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and Path(file) == victim:
                raise PermissionError(13, "Permission denied", str(file))
            return opener(file, *args, **kwargs)
        return fake

    monkeypatch.setattr(builtins, "open", guarded(real_open))
    monkeypatch.setattr(io, "open", guarded(real_io_open))


@pytest.mark.parametrize("verb", ["report", "import"])
def test_an_unreadable_log_is_bad_input(verb, logs, tmp_path, capsys, monkeypatch) -> None:
    victim = tmp_path / "b.log"
    shutil.copyfile(logs["baseline"], victim)
    _deny(monkeypatch, victim)
    argv = (["report", "-q", str(victim), str(logs["candidate"])] if verb == "report" else ["import", str(victim)])
    rc = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(victim) in err[0] and "Permission denied" in err[0] and "internal error" not in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_unreadable_file_inside_a_run_store_is_bad_input(logs, tmp_path, capsys, monkeypatch) -> None:
    assert main(["import", str(logs["baseline"]), "--out", str(tmp_path / "store")]) == 0
    victim = tmp_path / "store" / "meta.json"
    _deny(monkeypatch, victim)
    rc = main(["report", "-q", str(tmp_path / "store"), str(logs["candidate"]), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "meta.json" in err[0] and "internal error" not in err[0], err


@pytest.mark.parametrize("flag", ["--conversion", "--baseline-config", "--candidate-config", "--baseline-env"])
def test_a_folder_where_a_file_belongs_is_bad_input(flag, logs, tmp_path, capsys) -> None:
    folder = tmp_path / "a_folder.yaml"
    folder.mkdir()
    rc = main(["report", "-q", str(logs["baseline"]), str(logs["candidate"]), flag, str(folder),
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(folder) in err[0] and "internal error" not in err[0], err
    if flag.endswith("-config"):
        assert f"{flag.split('-')[2]}'s config file" in err[0], err


def test_an_os_error_anywhere_in_a_verb_is_one_line_exit_2(tmp_path, monkeypatch, capsys) -> None:
    """The last line of defence: an OSError a reader did not turn into BadInput still names its file."""
    import align.cli.check_data as verb

    def denied(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "secret.npy"))

    monkeypatch.setattr(verb, "run", denied)
    rc = main(["check-data", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"align: error: {tmp_path / 'secret.npy'}: Permission denied"], err


@pytest.mark.parametrize("verb", ["convert-weights", "demo", "isolate"])
def test_verbs_that_work_for_minutes_refuse_a_bad_out_first(verb, tmp_path, capsys) -> None:
    """A dangling symlink (convert-weights) or a file (demo, isolate) as --out: refused before any input is
    read, any framework imported or any model built."""
    out = tmp_path / "out"
    if verb == "convert-weights":
        out.symlink_to(tmp_path / "nowhere" / "x.safetensors")
        argv = ["convert-weights", "--to", "mindformers", str(tmp_path / "missing.pt"), "--out", str(out),
                "--num-heads", "2"]
    elif verb == "demo":
        out.write_text("x")
        argv = ["demo", "--example-logs", "--out", str(out)]
    else:
        out.write_text("x")
        argv = ["isolate", str(tmp_path / "missing"), "--candidate-yaml", str(tmp_path / "missing.yaml"),
                "--candidate-ckpt", str(tmp_path / "missing.ckpt"), "--out", str(out)]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(out) in err[0] and "missing" not in err[0], err


@pytest.mark.parametrize("where", [".", "report"])
def test_an_out_inside_an_input_is_refused_before_reading(where, logs, tmp_path, capsys) -> None:
    """The report must not land in the run store it reads (nor in a folder inside it)."""
    assert main(["import", str(logs["candidate"]), "--out", str(tmp_path / "cand")]) == 0
    out = tmp_path / "cand" / where
    rc = main(["report", "-q", str(tmp_path / "missing.log"), str(tmp_path / "cand"), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "written into the input" in err[0] and "missing.log" not in err[0], err
    assert not (tmp_path / "cand" / "report").exists() and not (tmp_path / "cand" / "report.html").exists()
