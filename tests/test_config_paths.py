"""Paths inside a recorded config resolve relative to that config (or the run store that recorded it), not the
working folder (issue 36, item 4); and the checklist never says "all N settings match" while some were not
read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from align.checks import config as cc
from align.cli import main
from runstore import RunWriter
from tests.test_check_config import _docs_replay_yaml

MG = {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 16, "num_layers": 2,
      "tensor_model_parallel_size": 1}


def _megatron_store(path: Path) -> Path:
    """A Megatron run store of 2 micro-batches of 2 per step, with its loss and arguments."""
    meta = {"framework": "megatron-lm", "parallel": {"tp": 1, "pp": 1, "dp": 1},
            "config": {"kind": "megatron_args", "values": MG}}
    with RunWriter(path, rank=0, meta=meta) as w:
        for step in (1, 2, 3, 4):
            tokens = np.arange(4 * 16).reshape(4, 16) % 50
            w.put_array(step, "batch/tokens", tokens, {"micro_batches": 2})
            w.put_array(step, "batch/labels", np.roll(tokens, -1, axis=1), {"micro_batches": 2})
            w.log_scalars(step, {"loss": 10.0 - 0.5 * step})
            w.finish_step()
    return path


def _mindformers_store(path: Path, cfg: dict) -> Path:
    meta = {"framework": "mindformers", "parallel": {"tp": 1, "pp": 1, "dp": 1},
            "config": {"kind": "mindformers_yaml", "values": cfg}}
    with RunWriter(path, rank=0, meta=meta) as w:
        for step in (1, 2, 3, 4):
            w.log_scalars(step, {"loss": 10.0 - 0.5 * step + 1e-6})
            w.finish_step()
    return path


def test_relative_data_dir_of_a_yaml_resolves_against_the_yaml(tmp_path, monkeypatch) -> None:
    store = _megatron_store(tmp_path / "runs" / "megatron_run")
    cfg = _docs_replay_yaml(Path("../runs/megatron_run"))          # relative to the YAML's folder
    (tmp_path / "configs").mkdir()
    y = tmp_path / "configs" / "mf.yaml"
    y.write_text(yaml.safe_dump(cfg))
    elsewhere = tmp_path / "a" / "elsewhere"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    rows = {r.key: r for r in cc.compare_configs(MG, cfg, base=cc.config_bases(y, is_file=True))[0]}
    gbs = rows["global_batch_size"]
    assert (gbs.mindformers, gbs.status) == (4, "match") and str(store.resolve()) in gbs.note, gbs
    # without a base (the old behaviour) the working folder would be used: not found, check by hand
    assert {r.key: r for r in cc.compare_configs(MG, cfg)[0]}["global_batch_size"].status == "check"


def test_check_config_from_another_folder(tmp_path, monkeypatch, capsys) -> None:
    _megatron_store(tmp_path / "runs" / "megatron_run")
    cfg = _docs_replay_yaml(Path("../runs/megatron_run"))
    (tmp_path / "configs").mkdir()
    y = tmp_path / "configs" / "mf.yaml"
    y.write_text(yaml.safe_dump(cfg))
    args = tmp_path / "args.json"
    args.write_text(json.dumps(MG))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    main(["check-config", str(args), str(y), "--json", "-"])
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["global_batch_size"]["status"] == "match", rows["global_batch_size"]


def test_a_stores_recorded_yaml_resolves_its_data_dir_near_the_store(tmp_path, monkeypatch) -> None:
    """`align report` from another folder: the candidate store's recorded YAML names `data_dir: megatron_run`
    (relative to the folder MindFormers ran in, which holds both runs): found beside the store."""
    base = _megatron_store(tmp_path / "runs" / "megatron_run")
    cand = _mindformers_store(tmp_path / "runs" / "mf_run", _docs_replay_yaml(Path("megatron_run")))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    main(["report", "-q", str(base), str(cand), "--out", str(tmp_path / "r")])
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    rows = {r["key"]: r for r in s["stages"]["checklist"]["rows"]}
    gbs = rows["global_batch_size"]
    assert gbs["status"] == "match" and str(base.resolve()) in gbs["note"], gbs


@pytest.mark.parametrize("unread", [[], ["hidden_dropout", "init_method_std"]])
def test_the_checklist_says_how_many_settings_were_not_read(unread) -> None:
    from align.stages.checklist import match_message

    rows = [cc.Row("num_layers", 2, 2, "match"), cc.Row("seq_length", 16, 16, "match")]
    rows += [cc.Row(k, 0.1, "not read", "not read") for k in unread]
    text = match_message(rows)
    if not unread:
        assert text.startswith("all 2 compared settings match")
    else:
        assert "all" not in text.split("(")[0] and text.startswith("2 compared settings match")
        assert text.endswith("; 2 not read: check by hand: hidden_dropout, init_method_std")
