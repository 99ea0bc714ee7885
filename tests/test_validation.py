"""Issue 14: every structured input is checked against its declared schema and refused with one line that
names the file and the key; what is not a regular file is refused; outputs never go through a symlink."""

from __future__ import annotations

import json
import os
import threading

import pytest
import yaml

from core.errors import BadInput
from mapping import Mapping
from models import DEFAULT_PRESET, preset_path
from reports.writer import ReportInput, write_report
from runstore import RunWriter
from runstore.run import open_store
from sources import detect
from sources.configs import read_megatron, read_mindformers


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    for p in parts:
        assert p in msg, (p, msg)
    return msg


def test_mapping_of_the_wrong_shape_names_file_and_key(tmp_path):
    spec = yaml.safe_load(preset_path(DEFAULT_PRESET).read_text())
    spec["rules"][2]["transform"] = {"op": "split_qkv", "parts": "three"}
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(spec))
    with pytest.raises(BadInput) as err:
        Mapping.load(p)
    _one_line(err, str(p), "rules[2].transform.parts", "expected integer")
    p.write_bytes(b"rules:\n  - baseline: a\xff\n")
    with pytest.raises(BadInput) as err:
        Mapping.load(p)
    _one_line(err, str(p), "not UTF-8", "byte 0xff at offset 22")
    p.write_text("rules: []\nmodules:\n  - {baseline: 're:x(', candidate: y}\n")
    with pytest.raises(BadInput) as err:
        Mapping.load(p)
    _one_line(err, str(p), "modules[0].baseline")


def test_meta_json_and_scalar_lines_of_the_wrong_type(tmp_path):
    root = tmp_path / "run"
    with RunWriter(root, meta={"framework": "megatron-core"}) as w:
        w.log_scalars(1, {"loss": 2.0})
    meta = json.loads((root / "meta.json").read_text())
    meta["parallel"] = {"tp": "2x"}
    (root / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(BadInput) as err:
        open_store(root)
    _one_line(err, "meta.json", "parallel.tp", "expected integer")
    meta["parallel"] = {"tp": 2}
    (root / "meta.json").write_text(json.dumps(meta))
    (root / "scalars" / "rank_00000.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": "2", "loss": 1.9}\n')
    with pytest.raises(BadInput) as err:
        open_store(root)
    _one_line(err, "rank_00000.jsonl:2", "'step'")
    (root / "scalars" / "rank_00000.jsonl").write_text('{"step": 1, "loss": 2.0}\n[1, 2]\n')
    with pytest.raises(BadInput) as err:
        open_store(root)
    _one_line(err, "rank_00000.jsonl:2", "expected an object")


def test_config_files_of_the_wrong_shape(tmp_path):
    y = tmp_path / "mf.yaml"
    y.write_text(yaml.safe_dump({"optimizer": {"betas": "0.9,0.95"}}))
    with pytest.raises(BadInput) as err:
        read_mindformers(y)
    _one_line(err, str(y), "optimizer.betas")
    j = tmp_path / "args.json"
    j.write_text(json.dumps({"hidden_size": "4096x", "lr": 1e-4}))
    with pytest.raises(BadInput) as err:
        read_megatron(j)
    _one_line(err, str(j), "hidden_size")


def test_fifo_and_device_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    got: list[str] = []

    def probe() -> None:
        for path in (fifo, "/dev/zero"):
            try:
                detect(path)
            except BadInput as exc:
                got.append(str(exc))

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "detect() blocked on a FIFO"
    assert "FIFO" in got[0] and str(fifo) in got[0] and "device" in got[1]


def test_report_out_that_is_a_file_a_dangling_link_or_holds_a_symlinked_folder(tmp_path):
    inp = ReportInput(runs=[], stages={})
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    for out in (a_file, dangling):
        with pytest.raises(BadInput) as err:
            write_report(inp, out)
        _one_line(err, str(out))
    assert not (tmp_path / "nowhere").exists() and a_file.read_text() == "x"
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "figures").symlink_to(elsewhere)
    with pytest.raises(BadInput) as err:
        write_report(inp, out)
    _one_line(err, "figures", "symlink")
    assert list(elsewhere.iterdir()) == [] and not (out / "summary.json").exists()
    (out / "figures").unlink()
    (out / "summary.json").symlink_to(elsewhere / "victim.json")   # a file link is replaced, not followed
    data = write_report(inp, out)
    assert data["verdict"] == "warn" and not (elsewhere / "victim.json").exists()
    assert not (out / "summary.json").is_symlink()
