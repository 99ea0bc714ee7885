"""The stage registry on run stores made here with the run-store writer (framework-free, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from align.cli import main
from align.stages import registry
from runstore import RunWriter

GUIDE_ORDER = ["input_sanity", "checklist", "conversion", "data_checks", "evidence_totals", "step1_loss",
               "step1_local_norm", "rerun_check", "layer_tensors", "isolation", "moe_routing",
               "step2_loss", "optimizer", "lr0_run", "band", "long_run", "divergence_data", "grad_norm",
               "norm_trajectories", "spikes", "lr_schedule", "aux_losses", "nonfinite", "nan_trace"]
NAMES = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]


def batch(step: int, seq: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    t = rng.integers(2, 100, size=(2, seq + 1))
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": np.ones((2, seq), dtype=np.float32)}


def make_run(path: Path, *, steps: int = 40, loss_shift: float = 0.0, diverge_at: int | None = None,
             bad_batch_at: int | None = None, norms_scale: float = 1.0, meta: dict | None = None) -> Path:
    with RunWriter(path, rank=0, meta={"framework": "megatron-core", **(meta or {})}) as w:
        for s in range(1, steps + 1):
            loss = 10.0 - 0.05 * s + loss_shift + (0.5 if diverge_at and s >= diverge_at else 0.0)
            b = batch(s)
            if bad_batch_at is not None and s == bad_batch_at:
                b["tokens"] = b["tokens"] + 1
            for k, v in b.items():
                w.put_array(s, f"batch/{k}", v)
            w.put_table(s, "local_norm", {"name": np.array(NAMES, dtype=object),
                                          "norm": np.array([1.0, 0.5, 2.0]) * norms_scale,
                                          "numel": np.array([10, 4, 10]), "tp_partition_dim": np.array([-1] * 3),
                                          "tp_rank": np.zeros(3, dtype=np.int64),
                                          "tp_size": np.ones(3, dtype=np.int64)})
            w.log_scalars(s, {"loss": loss, "grad_norm": 1.0, "lr": 1e-3})
            w.finish_step()
    return path


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_registry_runs_in_the_guides_order() -> None:
    assert [s.name for s in registry()] == GUIDE_ORDER
    for s in registry():
        assert s.needs and s.capture, s.name


def test_divergence_shows_the_data_around_it(tmp_path: Path) -> None:
    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", diverge_at=25, bad_batch_at=25)
    code = main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "r"), "--sustain", "5"])
    s = summary(tmp_path / "r")
    assert code == 1 and s["stages"]["long_run"]["divergence_step"] == 25
    div = s["stages"]["divergence_data"]
    assert div["verdict"] == "fail"
    rows = {r["step"]: r for r in div["rows"]}
    assert sorted(rows) == [22, 23, 24, 25, 26, 27]
    assert rows[25]["same_batch"] is False and rows[24]["same_batch"] is True
    assert rows[24]["baseline_tokens_sha1"] and rows[24]["baseline_loss_mask_sum"] == 16.0
    # the same data stage names the first step whose batch differs
    assert s["stages"]["data_checks"]["same_data"]["first_different_step"] == 25
    assert any(f["metric"] == "batch_differs" and f["value"] == 25 for f in s["findings"])


def test_dtype_from_meta_sets_local_norm_tolerance(tmp_path: Path) -> None:
    """A 0.5% norm difference warns on a float32 pair and passes a bf16 pair (8 bits of mantissa)."""
    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", norms_scale=1.005)
    main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "f32")])
    assert summary(tmp_path / "f32")["stages"]["step1_local_norm"]["verdict"] == "warn"
    bf = {"dtypes": {"params": "bfloat16", "compute": "bfloat16", "grads": "float32"}}
    b16 = make_run(tmp_path / "b16", meta=bf)
    c16 = make_run(tmp_path / "c16", norms_scale=1.005, meta=bf)
    main(["report", "-q", str(b16), str(c16), "--out", str(tmp_path / "bf16")])
    st = summary(tmp_path / "bf16")["stages"]["step1_local_norm"]
    assert st["verdict"] == "pass" and st["dtype"] == "bfloat16"


def mcore_yaml(**model_config: object) -> dict:
    """A MindFormers 2.x YAML as the MindSpore dumper records it in meta.json (the bare dict)."""
    mc = {"type": "Qwen3Config", "num_hidden_layers": 2, "num_attention_heads": 4, "compute_dtype": "float32",
          **model_config}
    return {"use_legacy": False, "model": {"model_config": mc}}


@pytest.mark.parametrize("model_config,mapping,dtype", [
    ({}, "megatron_core__mindformers_mcore_dense", "float16"),
    ({"use_flash_attention": False}, "megatron_core__mindformers_mcore_dense", "float32"),
    ({"num_experts": 4, "num_experts_per_tok": 2}, "megatron_core__mindformers_mcore_moe", "float16"),
    ({"multi_latent_attention": True, "mla_qkv_concat": False, "n_routed_experts": 4},
     "megatron_core__mindformers_mcore_mla", "float32"),      # MLA's attention has no float16 cast
    ({"compute_dtype": "bfloat16"}, "megatron_core__mindformers_mcore_dense", "float32"),
])
def test_mcore_candidate_config_picks_mapping_and_attention_precision(tmp_path: Path, model_config: dict,
                                                                       mapping: str, dtype: str) -> None:
    """A MindFormers 2.x candidate needs no --mapping (its model picks the mcore preset) and no tolerance
    flags: flash attention (on by default) computes a float32 run's attention in float16, so the local norms
    are judged at float16. (A bf16 run records its own dtypes; this one recorded none: float32.)"""
    from align.stages import Evidence, Inputs

    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", meta={"framework": "mindformers", "config": mcore_yaml(**model_config)})
    ev = Evidence.load(Inputs(str(b), str(c)))
    assert ev.mapping == mapping and "2.x config" in ev.mapping_source
    assert ev.dtype[0] == dtype
    assert ev.update_dtype[0] == "float32"     # the optimizer check steps on given gradients: no attention
    import shutil

    from models import DEFAULT_PRESET, preset_path
    mine = str(shutil.copy(preset_path(DEFAULT_PRESET), tmp_path / "x.yaml"))    # --mapping wins over the config
    assert Evidence.load(Inputs(str(b), str(c), mapping=mine)).mapping == mine
    assert Evidence.load(Inputs(str(b), str(b))).mapping == "megatron_core_llama__mindformers_llama"


@pytest.mark.parametrize("model_config,family", [
    # pretrain_deepseek3_671b.yaml as shipped
    ({"model_type": "deepseek_v3", "multi_latent_attention": True, "mla_qkv_concat": False,
      "num_nextn_predict_layers": 1, "mtp_loss_factor": 0.3}, "mla"),
    # MindFormers' default: TransformerConfig.mla_qkv_concat True (DeepseekV3Config has no such field)
    ({"multi_latent_attention": True, "n_routed_experts": 4}, "mla_qkv_concat"),
    ({"multi_latent_attention": True, "mla_qkv_concat": True}, "mla_qkv_concat"),
    ({"multi_latent_attention": True, "mla_qkv_concat": "False"}, "mla"),
    ({"type": "DeepseekV3Config", "n_routed_experts": 4}, "mla_qkv_concat"),   # DeepSeek-V3 is MLA unless told
    ({"model_type": "deepseek_v3", "multi_latent_attention": False, "n_routed_experts": 4}, "moe"),
    ({"mla_qkv_concat": True}, "dense"),                                        # no MLA: the flag means nothing
])
def test_mcore_family_reads_mla_qkv_concat(tmp_path: Path, model_config: dict, family: str) -> None:
    """DeepSeek-V3's attention names depend on mla_qkv_concat: False (shipped YAMLs) keeps Megatron's
    linear_q_down_proj / ..._up_proj, True or unset fuses them (linear_qkv, linear_qb, linear_kvb), so the
    report picks the preset that names them."""
    from align.stages import Evidence, Inputs
    from models import preset_for_config

    cfg = mcore_yaml(**model_config)
    assert preset_for_config(cfg) == f"megatron_core__mindformers_mcore_{family}"
    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", meta={"framework": "mindformers", "config": cfg})
    assert Evidence.load(Inputs(str(b), str(c))).mapping == f"megatron_core__mindformers_mcore_{family}"


def test_no_common_step_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = make_run(tmp_path / "b", steps=5)
    c = tmp_path / "c"
    with RunWriter(c, rank=0, meta={}) as w:
        for s in range(100, 105):
            w.log_scalars(s, {"loss": 9.0})
    assert main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "r")]) == 2
    assert "no step in common" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_strict_makes_warn_exit_1(tmp_path: Path) -> None:
    b = make_run(tmp_path / "b")
    c = make_run(tmp_path / "c", norms_scale=1.005)
    assert main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "r")]) == 0
    assert summary(tmp_path / "r")["verdict"] == "warn"
    assert main(["report", "-q", "--strict", str(b), str(c), "--out", str(tmp_path / "r2")]) == 1


def test_checklist_from_config_files(tmp_path: Path) -> None:
    b, c = make_run(tmp_path / "b"), make_run(tmp_path / "c")
    (tmp_path / "train.sh").write_text("torchrun pretrain_gpt.py --num-layers 2 --hidden-size 64 "
                                       "--num-attention-heads 4 --norm-epsilon 1e-5 --lr 1e-3\n")
    cfg = {"model": {"model_config": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "rms_norm_eps": 1e-6}},
           "lr_schedule": {"learning_rate": 1e-3}}
    (tmp_path / "mf.yaml").write_text(yaml.safe_dump(cfg))
    main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "r"), "--baseline-config",
          str(tmp_path / "train.sh"), "--candidate-config", str(tmp_path / "mf.yaml")])
    st = summary(tmp_path / "r")["stages"]["checklist"]
    assert st["verdict"] == "fail"
    bad = [r for r in st["rows"] if r["status"] == "mismatch"]
    assert "norm_eps" in [r["key"] for r in bad], bad
    assert "hidden_size" not in [r["key"] for r in bad]
    # without them, the checklist says what to capture
    main(["report", "-q", str(b), str(c), "--out", str(tmp_path / "r2")])
    st2 = summary(tmp_path / "r2")["stages"]["checklist"]
    assert st2["verdict"] == "skipped" and "--baseline-config" in st2["capture"]


def test_extending_doc_stage_example_runs(tmp_path: Path) -> None:
    """docs/extending.md's stage file, executed as written, on two stores: it is a valid Stage."""
    import importlib.util
    import re

    import pandas as pd

    from align.stages import Evidence, FigureContext, Inputs, Stage
    from core.findings import skipped

    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(# align/stages/loss_scale.py.*?)```", text, re.S).group(1)
    (tmp_path / "loss_scale.py").write_text(code)
    spec = importlib.util.spec_from_file_location("loss_scale_example", tmp_path / "loss_scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert isinstance(mod.STAGE, Stage)
    b, c = make_run(tmp_path / "b"), make_run(tmp_path / "c")
    ev = Evidence.load(Inputs(str(b), str(c)))
    assert mod.STAGE.run(ev).verdict == "skipped"            # no loss_scale in these runs
    for run, scales in ((b, [8.0] * 5), (c, [8.0, 4.0, 2.0, 1.0, 0.5])):
        with RunWriter(run, rank=0) as w:
            for s, v in enumerate(scales, 1):
                w.log_scalars(s, {"loss_scale": v})
    res = mod.STAGE.run(Evidence.load(Inputs(str(b), str(c))))
    assert res.verdict == "warn" and res.findings[0].value == 4
    # its figure, declared now and drawn when asked (as the report's writer does)
    ctx = FigureContext(pd.DataFrame(), {"baseline": "baseline: b", "candidate": "candidate: c"}, {"loss_scale": res})
    assert mod.STAGE.figures(skipped("loss_scale", "none"), ctx) == []
    (fig,) = mod.STAGE.figures(res, ctx)
    assert fig.file == "loss_scale.png" and not (tmp_path / fig.file).exists()
    png = fig.draw(tmp_path / fig.file)
    assert png.startswith(b"\x89PNG") and (tmp_path / fig.file).read_bytes() == png


def test_extending_doc_source_example_is_detected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/extending.md's source file, imported as written and added to the dispatch table, opens a CSV."""
    import importlib.util
    import re

    import sources as sources

    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(# sources/csv_losses.py.*?)```", text, re.S).group(1)
    (tmp_path / "csv_losses.py").write_text(code)
    spec = importlib.util.spec_from_file_location("csv_losses_example", tmp_path / "csv_losses.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sources, "_TABLE", sorted([*sources.sources(), mod.SOURCE], key=lambda s: s.order))
    (tmp_path / "a.csv").write_text("step,loss\n1,10.5\n2,10.25\n")
    assert sources.detect(tmp_path / "a.csv") == "csv_losses"
    assert sources.load_run(tmp_path / "a.csv").series("loss")[2] == 10.25
    assert [s.kind for s in sources.sources()][:2] == ["runstore", "golden_values"]


def test_report_on_two_msprobe_dumps_names_the_perturbed_layer(tmp_path: Path) -> None:
    """`align report PT_DUMP MS_DUMP` (real msprobe 26.2.0 dumps, tests/data/msprobe): the layer stage runs
    through the mapping and names the layer whose weight the MindSpore side perturbed; other stages skip."""
    data = Path(__file__).resolve().parent / "data" / "msprobe"
    assert main(["report", "-q", str(data / "pt"), str(data / "ms"), "--out", str(tmp_path / "r")]) == 0
    s = summary(tmp_path / "r")
    st = s["stages"]["layer_tensors"]
    assert st["verdict"] == "warn" and s["stages"]["step1_loss"]["verdict"] == "skipped"
    first = [f for f in s["findings"] if f["stage"] == "layer_tensors" and "first departing forward" in f["message"]]
    assert first and first[0]["component"] == "decoder.layers.1.mlp.linear_fc2"
    # an msprobe dump against a log has nothing in common to compare: bad input, one line
    b = make_run(tmp_path / "b")
    assert main(["report", "-q", str(b), str(data / "ms"), "--out", str(tmp_path / "r2")]) == 2


def test_import_out_that_is_a_file_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("x")
    log = tmp_path / "m.log"
    log.write_text(" iteration        1/      10 | consumed samples:            8 | lm loss: 1.000000E+01 |\n")
    assert main(["import", str(log), "--out", str(tmp_path / "afile")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
