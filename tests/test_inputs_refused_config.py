"""Issue 38: configs and other wrong or hostile inputs are read right or refused in one line.

Printed MindFormers parallel configs in msrun logs (models/mindformers_parallel.py), the MoE layer pattern
(align/stages/aux_losses.py), check-config's inputs (sources/configs.py, sources/input_kind.py), capture-env's
--out / --data, and a MindFormers record written ``],loss:`` without the space.
"""

from __future__ import annotations

import json
import os
import pprint
from pathlib import Path

import pytest
import yaml

from align.cli import main
from align.stages.aux_losses import moe_pattern
from core.errors import BadInput
from models.mindformers_parallel import MAX_LAYERS, layer_stages, strategy_from_yaml
from sources.mindformers_log import parse_mindformers_dir, parse_mindformers_log

DATA = Path(__file__).resolve().parent / "data"
CONFIGS = DATA / "configs"
MF_LOG = DATA / "mindformers_train.log"
SCRIPT = CONFIGS / "megatron_qwen3_32b.sh"
YAML = CONFIGS / "pretrain_qwen3_32b_4k.yaml"


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err and "\n" not in err, (rc, err)
    return err


# --- printed parallel configs in msrun worker logs ---------------------------------------------------------------

def _msrun(tmp_path: Path, **changes) -> Path:
    """Two worker logs (DP=2) whose printed config (MindFormers pprints it before training) has ``changes``."""
    cfg = {"parallel_config": {"data_parallel": 2, "model_parallel": 1, "pipeline_stage": 1},
           "parallel": {"parallel_mode": 1}, "model": {"model_config": {"num_layers": 2, "offset": 0}}}
    for key, value in changes.items():
        *blocks, name = key.split(".")
        d = cfg
        for part in blocks:
            d = d.setdefault(part, {})
        d[name] = value
    folder = tmp_path / "msrun_log"
    folder.mkdir()
    steps = MF_LOG.read_text()
    for rank in (0, 1):
        (folder / f"worker_{rank}.log").write_text(pprint.pformat(cfg, width=100) + "\n" + steps)
    return folder


@pytest.mark.parametrize(("key", "value", "said"), [
    ("parallel.parallel_mode", [1], "parallel_mode must be 0-3"),
    ("model.model_config.num_layers", "x", "num_layers must be an integer"),
    ("model.model_config.offset", "abc", "offset must be an integer or a list"),
    ("model.model_config.num_layers", 10**12, f"num_layers must be an integer from 1 to {MAX_LAYERS}"),
    ("parallel_config.pipeline_stage", 2.0, "pipeline_stage must be an integer"),
    ("parallel_config.use_seq_parallel", "False", "use_seq_parallel must be True or False"),
    ("parallel_config", [1, 2], "parallel_config must be a mapping"),
])
def test_a_hostile_printed_parallel_config_is_noted_and_the_losses_read_right(tmp_path, key, value, said) -> None:
    """Types and sizes no MindFormers run has: the layout is not read (a note says why), nothing is sized
    from the number, and the losses are the log's (TypeError / ValueError / MemoryError escaped before)."""
    with pytest.raises(BadInput, match=said) as e:
        strategy_from_yaml(yaml.safe_load(json.dumps({"parallel_config": {}, "parallel": {}, "model": {}}))
                           | _nested(key, value))
    assert "\n" not in str(e.value)
    run = parse_mindformers_dir(_msrun(tmp_path, **{key: value}))
    assert any(said in n and "parallel_config in the printed config not read" in n for n in run.notes), run.notes
    assert run.meta["parallel"] == {"world_size": 2}
    assert run.series("loss").to_dict() == parse_mindformers_log(MF_LOG).series("loss").to_dict()


def _nested(key: str, value: object) -> dict:
    out: dict = {}
    d = out
    *blocks, name = key.split(".")
    for part in blocks:
        d = d.setdefault(part, {})
    d[name] = value
    return out


def test_a_sane_printed_config_still_gives_the_layout(tmp_path) -> None:
    run = parse_mindformers_dir(_msrun(tmp_path))
    assert run.meta["parallel"]["dp"] == 2 and run.meta["parallel"]["world_size"] == 2


def test_layer_counts_are_bounded_before_anything_is_allocated() -> None:
    with pytest.raises(BadInput, match="num_layers 1000000000000"):
        layer_stages(10**12, 2, 0)
    with pytest.raises(BadInput, match="offset must be"):
        layer_stages(4, 2, "abc")
    assert layer_stages(4, 2, [1, -1]) == [0, 0, 0, 1]
    # MoE pattern: the counts are checked before the list is built
    assert moe_pattern(10**12, 1) is None
    assert moe_pattern(4, "([1]*999999999999)") is None
    assert moe_pattern(4, "([0]*1+[1]*999999999999)") is None
    assert moe_pattern(4, None, 10**12) == [0, 0, 0, 0]          # k >= layers: every layer dense
    assert moe_pattern(4, "([0]*1+[1]*3)") == [0, 1, 1, 1] and moe_pattern(4, None, 1) == [0, 1, 1, 1]


# --- a MindFormers record without the space after the step bracket ----------------------------------------------

@pytest.mark.parametrize("which", ["one", "all"])   # the careful line reader, and the bulk reader
def test_a_record_written_without_the_space_keeps_its_loss(tmp_path, which) -> None:
    """MFLossMonitor writes ``step:[%5d/%5d], loss:[..]`` (callback.py); a copy with ``],loss:`` is the same
    record."""
    lines = MF_LOG.read_text().splitlines()
    steps = [i for i, ln in enumerate(lines) if "], loss:" in ln]
    for i in (steps[1:2] if which == "one" else steps):
        lines[i] = lines[i].replace("], loss:", "],loss:", 1)
    p = tmp_path / "mf.log"
    p.write_text("\n".join(lines) + "\n")
    run, ref = parse_mindformers_log(p), parse_mindformers_log(MF_LOG)
    for key in ref.scalars:
        assert run.series(key).to_dict() == ref.series(key).to_dict(), key
    assert run.notes == ref.notes


# --- check-config: nulls, wrong kinds, invalid UTF-8, hostile counts ---------------------------------------------

def _yaml_with(tmp_path: Path, edit) -> Path:
    cfg = yaml.safe_load(YAML.read_text())
    edit(cfg)
    p = tmp_path / "mf.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def test_null_data_parallel_is_refused_as_mindformers_refuses_it(tmp_path, capsys) -> None:
    y = _yaml_with(tmp_path, lambda c: c["parallel_config"].update(data_parallel=None))
    err = _one_line_exit_2(capsys, ["check-config", str(SCRIPT), str(y)])
    assert "parallel_config.data_parallel': expected integer, got null" in err and str(y) in err


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("env") / "env.json"
    assert main(["capture-env", "--framework", "torch", "--out", str(out)]) == 0
    return out


def test_check_config_refuses_an_environment_capture_on_either_side(capture, capsys) -> None:
    err = _one_line_exit_2(capsys, ["check-config", str(capture), str(YAML)])
    assert err.endswith(f"{capture}: an environment capture (align capture-env), not Megatron arguments "
                        "(a log with its arguments block, a launch script, or JSON arguments)"), err
    err = _one_line_exit_2(capsys, ["check-config", str(SCRIPT), str(capture)])
    assert "an environment capture (align capture-env), not a MindFormers YAML config" in err, err


def test_check_config_refuses_other_wrong_kinds_by_name(tmp_path, capsys) -> None:
    anyjson = tmp_path / "any.json"
    anyjson.write_text('{"a": 1, "b": [2]}')
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"num_layers": 2, "hidden_size": "\xff\xfe"}')
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"verdict": "pass", "stages": {}, "findings": []}))
    cases = [
        ([str(anyjson), str(YAML)], "JSON holds none of Megatron's arguments"),
        ([str(SCRIPT), str(anyjson)], "holds none of a MindFormers config's sections"),
        ([str(bad), str(YAML)], "JSON is not UTF-8 text (byte 0xff at offset 34)"),
        ([str(YAML), str(YAML)], "a MindFormers YAML config, not Megatron arguments"),
        ([str(MF_LOG), str(YAML)], "a MindFormers training log, not Megatron arguments"),
        ([str(SCRIPT), str(SCRIPT)], "a launch script, not a MindFormers YAML config"),
        ([str(summary), str(YAML)], "a report's summary.json (align report), not Megatron arguments"),
    ]
    for argv, said in cases:
        err = _one_line_exit_2(capsys, ["check-config", *argv])
        assert said in err, (argv, err)


def test_report_names_what_a_wrong_input_looks_like(capture, tmp_path, capsys) -> None:
    err = _one_line_exit_2(capsys, ["report", "-q", str(capture), str(MF_LOG), "--out", str(tmp_path / "r")])
    assert f"{capture}: an environment capture (align capture-env), not a run" in err
    err = _one_line_exit_2(capsys, ["report", "-q", str(MF_LOG), str(YAML), "--out", str(tmp_path / "r")])
    assert f"{YAML}: a MindFormers YAML config, not a run" in err


@pytest.mark.parametrize(("side", "edit", "said"), [
    ("yaml", lambda c: c["model"]["model_config"].update(num_layers=10**12), "num_layers': 1000000000000 is more"),
    ("yaml", lambda c: c["parallel_config"].update(pipeline_stage=10**12), "pipeline_stage': 1000000000000 is more"),
    ("yaml", lambda c: c["model"]["model_config"].update(offset=[0, 0, 0, 10**12]), "offset': more entries"),
    ("megatron", ("--bf16", "--bf16 --num-layers 1000000000000"), "num_layers': 1000000000000 is more"),
    ("megatron", ("PP=4", "PP=1000000000000"), "pipeline_model_parallel_size': 1000000000000 is more"),
])
def test_check_config_bounds_counts_before_sizing_lists(tmp_path, capsys, side, edit, said) -> None:
    if side == "yaml":
        y, s = _yaml_with(tmp_path, edit), SCRIPT
    else:
        y, s = YAML, tmp_path / "train.sh"
        s.write_text(SCRIPT.read_text().replace(*edit))
    err = _one_line_exit_2(capsys, ["check-config", str(s), str(y)])
    assert said in err, err


# --- capture-env: --out onto a dangling symlink, --data on a device or FIFO --------------------------------------

def test_capture_env_refuses_a_dangling_out_link_and_special_data(tmp_path, capsys) -> None:
    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "nowhere" / "x.json")
    err = _one_line_exit_2(capsys, ["capture-env", "--framework", "torch", "--out", str(link)])
    assert "dangling symlink" in err and link.is_symlink() and os.readlink(link) == str(tmp_path / "nowhere" / "x.json")
    fifo = tmp_path / "data.bin"
    os.mkfifo(fifo)
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"x")
    (folder / "z.bin").symlink_to("/dev/zero")
    out = tmp_path / "c.json"
    for data, said in (("/dev/zero", "/dev/zero: is a device, not a regular dataset file"),
                       (str(fifo), f"{fifo}: is a FIFO, not a regular dataset file"),
                       (str(folder), f"{folder / 'z.bin'}: is a device, not a regular dataset file"),
                       (str(tmp_path / "missing"), "no such dataset file or folder")):
        err = _one_line_exit_2(capsys, ["capture-env", "--framework", "torch", "--out", str(out), "--data", data])
        assert said in err, err
        assert not out.exists()


def test_weights_and_data_verbs_name_a_wrong_kind(capture, tmp_path, capsys) -> None:
    """compare-weights, capture-env --weights and check-data given another kind of input say what it is."""
    dump = DATA / "mindspore_dump" / "base"
    for path, looks in ((capture, "an environment capture (align capture-env)"), (dump, "a MindSpore dump folder"),
                        (YAML, "a MindFormers YAML config")):
        err = _one_line_exit_2(capsys, ["compare-weights", str(path), str(path), "--out", str(tmp_path / "w")])
        assert f"{path}: {looks}, not a checkpoint" in err, err
        err = _one_line_exit_2(capsys, ["capture-env", "--framework", "torch", "--weights", str(path), "--out",
                                        str(tmp_path / "c.json")])
        assert f"{path}: {looks}, not a checkpoint" in err, err
        err = _one_line_exit_2(capsys, ["check-data", str(path)])
        assert f"{path}: {looks}, not a run store or a step_N/rank_R batch dump" in err, err
