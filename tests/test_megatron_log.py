"""Megatron-LM log importer on real log text (the line DESIGN.md quotes) and its damaged variants."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from core.errors import BadInput
from sources.configs import parse_arguments_block
from sources.megatron_log import parse_megatron_log

# Verbatim from a Megatron-LM run (DESIGN.md).
REAL = ("[2024-05-01 10:12:31] iteration      250/    1000 | consumed samples:         4000 | elapsed time per "
        "iteration (ms): 824.3 | learning rate: 8.956362E-05 | global batch size:    16 | lm loss: 6.923337E+00 | "
        "loss scale: 4096.0 | grad norm: 1.479 | num zeros: 430.0 | number of skipped iterations:   0 | number of "
        "nan iterations:   0 |")


def line(it: int, loss: str = "6.923337E+00", gnorm: str = "1.479", total: int = 1000) -> str:
    return REAL.replace("iteration      250/    1000", f"iteration {it:>8}/{total:>8}") \
        .replace("lm loss: 6.923337E+00", f"lm loss: {loss}").replace("grad norm: 1.479", f"grad norm: {gnorm}")


def write(tmp_path: Path, text: str, name: str = "train.log") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_every_field_of_the_real_line(tmp_path):
    run = parse_megatron_log(write(tmp_path, REAL + "\n"))
    got = {k: float(s.iloc[0]) for k, s in run.scalars.items()}
    assert got == {"consumed_samples": 4000.0, "elapsed_ms": 824.3, "lr": 8.956362e-05, "global_batch_size": 16.0,
                   "loss": 6.923337, "loss_scale": 4096.0, "grad_norm": 1.479, "num_zeros": 430.0,
                   "skipped_iterations": 0.0, "nan_iterations": 0.0}
    assert list(run.series("loss").index) == [250]
    assert run.meta["train_iters"] == 1000
    assert run.notes == []


ARGS = """------------------------ arguments ------------------------
  accumulate_allreduce_grads_in_fp32 .............. False
  adam_beta2 ...................................... 0.95
  data_path ....................................... ['1.0', '/data/wiki_text_document']
  num_layers ...................................... 24
  tensor_model_parallel_size ...................... 2
  tokenizer_type .................................. GPT2BPETokenizer
  vocab_file ...................................... None
-------------------- end of arguments ---------------------
"""


def test_arguments_block_validation_and_noise(tmp_path):
    text = (ARGS + "\x1b[32m> building GPT model ...\x1b[0m\n" + line(1, "1.100000E+01") + "\n"
            "/usr/lib/python3/site-packages/torch/cuda/__init__.py:52: UserWarning: something\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nRuntimeError: boom\n"
            + line(2, "1.000000E+01") + "\n"
            "-------------------------------------------------------------------------------------------\n"
            " validation loss at iteration 2 | lm loss value: 9.876543E+00 | lm loss PPL: 1.947352E+04 | \n"
            "-------------------------------------------------------------------------------------------\n")
    run = parse_megatron_log(write(tmp_path, text))
    assert run.series("loss").to_dict() == {1: 11.0, 2: 10.0}
    assert run.series("val_loss").to_dict() == {2: 9.876543}
    assert run.meta["config"]["values"]["num_layers"] == 24
    assert run.meta["config"]["values"]["accumulate_allreduce_grads_in_fp32"] is False
    assert run.meta["config"]["values"]["vocab_file"] is None
    assert run.meta["config"]["values"]["data_path"] == ["1.0", "/data/wiki_text_document"]
    assert run.meta["parallel"]["tp"] == 2
    assert any("traceback" in n for n in run.notes)


def test_parse_arguments_block_ignores_lines_outside():
    assert parse_arguments_block("  lr ..... 0.1\n" + ARGS)["adam_beta2"] == 0.95
    assert "lr" not in parse_arguments_block("  lr ..... 0.1\n" + ARGS)


def test_lines_wrapped_mid_word_by_a_terminal(tmp_path):
    lines = [line(i, f"{10 - i * 0.01:.6E}") for i in range(1, 21)]
    width = 80
    wrapped = []
    for ln in lines:
        wrapped += [ln[j:j + width] for j in range(0, len(ln), width)]
    run = parse_megatron_log(write(tmp_path, "\n".join(wrapped) + "\n"))
    assert len(run.series("loss")) == 20
    assert run.series("loss")[7] == pytest.approx(10 - 0.07)
    assert run.series("grad_norm").nunique() == 1
    assert any("wrapped" in n for n in run.notes)


def test_ansi_colour_and_crlf(tmp_path):
    text = "\r\n".join("\x1b[1m" + line(i).replace("lm loss:", "\x1b[33mlm loss:\x1b[0m") for i in (1, 2, 3))
    run = parse_megatron_log(write(tmp_path, text + "\r\n"))
    assert run.series("loss").tolist() == [6.923337] * 3


def test_nan_grad_norm_is_kept_as_nan_not_dropped(tmp_path):
    text = "\n".join([line(1), line(2, gnorm="nan"), line(3, loss="nan", gnorm="inf")]) + "\n"
    run = parse_megatron_log(write(tmp_path, text))
    g = run.series("grad_norm")
    assert list(g.index) == [1, 2, 3]
    assert math.isnan(g[2]) and math.isinf(g[3])
    assert math.isnan(run.series("loss")[3])


def test_log_that_stops_mid_line_keeps_complete_fields_only(tmp_path):
    cut = line(3, loss="6.123456E+00")
    cut = cut[: cut.index("lm loss: 6.12") + len("lm loss: 6.12")]  # the loss value itself is cut
    run = parse_megatron_log(write(tmp_path, "\n".join([line(1), line(2), cut])))
    assert list(run.series("loss").index) == [1, 2]  # step 3's cut loss is not trusted
    assert run.series("lr")[3] == pytest.approx(8.956362e-05)
    assert any("ends mid-line" in n for n in run.notes)


def test_garbled_value_skips_that_step_and_says_so(tmp_path):
    text = "\n".join([line(1), line(2, loss="6.9x3E+00"), line(3)])
    run = parse_megatron_log(write(tmp_path, text))
    assert list(run.series("loss").index) == [1, 3]
    assert any("iteration 2" in n and "lm loss" in n for n in run.notes)


def test_restart_repeats_iterations_last_wins(tmp_path):
    text = "\n".join([line(1, "1.0E+01"), line(2, "9.0E+00"), line(2, "8.5E+00"), line(3, "8.0E+00")])
    run = parse_megatron_log(write(tmp_path, text))
    assert run.series("loss").to_dict() == {1: 10.0, 2: 8.5, 3: 8.0}


def test_fast_and_careful_paths_agree(tmp_path):
    rng = np.random.default_rng(0)
    losses = rng.uniform(2, 10, 200)
    good = [line(i + 1, f"{v:.6E}") for i, v in enumerate(losses)]
    fast = parse_megatron_log(write(tmp_path, "\n".join(good) + "\n", "a.log"))
    # one extra field on one line forces the careful path for the whole file
    odd = good[:]
    odd[5] = odd[5].replace(" | loss scale", " | params norm: 12.5 | loss scale")
    careful = parse_megatron_log(write(tmp_path, "\n".join(odd) + "\n", "b.log"))
    assert np.array_equal(fast.series("loss").to_numpy(), careful.series("loss").to_numpy())
    assert careful.series("params_norm").to_dict() == {6: 12.5}


@pytest.mark.parametrize("content, message", [
    (b"", "empty file"),
    (b"\x00\x01\x02binary\x00" * 100, "binary"),
    (b"just some text\nwith no iteration lines at all\n", "no Megatron"),
])
def test_bad_logs(tmp_path, content, message):
    p = tmp_path / "bad.log"
    p.write_bytes(content)
    with pytest.raises(BadInput, match=message) as err:
        parse_megatron_log(p)
    assert str(p) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("use_arrow", [True, False])
def test_bulk_number_readers_agree_with_the_careful_path(tmp_path, monkeypatch, use_arrow):
    """pyarrow (when installed) and pandas read the same numbers, NaN included, as the field-by-field path."""
    if use_arrow:
        pytest.importorskip("pyarrow")
    import sources.megatron_log as ml
    real = ml._read_numbers
    monkeypatch.setattr(ml, "_read_numbers", lambda t, n, u: real(t, n, u, use_arrow))
    rng = np.random.default_rng(1)
    lines = [line(i + 1, f"{v:.6E}", gnorm="nan" if i == 7 else f"{v / 3:.3f}")
             for i, v in enumerate(rng.uniform(2, 10, 50))]
    p = write(tmp_path, "\n".join(lines) + "\n")
    fast = ml.parse_megatron_log(p)
    assert ml._fast_columns(ml._RECORD.findall(p.read_bytes())) is not None  # the bulk path did the work
    calls = []
    monkeypatch.setattr(ml, "_read_canonical", lambda raw: None)
    monkeypatch.setattr(ml, "_fast_columns", lambda records: calls.append(1))  # force the careful path
    careful = ml.parse_megatron_log(p)
    assert calls
    for key, s in careful.scalars.items():
        np.testing.assert_array_equal(fast.series(key).to_numpy(), s.to_numpy())
    assert math.isnan(fast.series("grad_norm")[8])


# --- issue 14: every readable value is kept -------------------------------------------------------------

# Megatron-DeepSpeed's training_log (megatron/training.py): the same head, its own extra fields.
DEEPSPEED = (" iteration       10/    1000 | consumed samples:          160 | consumed tokens:       327680 | "
             "elapsed time per iteration (ms): 1523.4 | learning rate: 1.500E-05 | global batch size:    16 | "
             "lm loss: 1.052345E+01 | loss scale: 4096.0 | grad norm: 5.321 | actual seqlen:  2048 | "
             "number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 10.503 | "
             "tokens per gpu per second (tgs): 2688.7 | TFLOPs: 98.76 |")
# Older Megatron-LM (2020) and forks: short labels, a time in seconds, an a/b pair, text after the last '|'.
OLDER = (" iteration       20/     500 | elapsed time per iteration (s): 1.25 | lr: 3.000E-04 | "
         "lm-loss: 7.5 | loss-scale: 1.0 | grad-norm: 2.5 | skipped iterations: 0 | nan iterations: 0 | "
         "max memory allocated/reserved (MB): 13100.0/13240.9 | GPU utilization: 50.0MODEL_TFLOP/s/GPU: 123.4 | "
         "mem-alloc-GB: 12.5 GB")


def test_deepspeed_and_older_label_variants(tmp_path):
    run = parse_megatron_log(write(tmp_path, DEEPSPEED + "\n" + OLDER + "\n"))
    s = {k: v.to_dict() for k, v in run.scalars.items()}
    assert s["loss"] == {10: 10.52345, 20: 7.5}
    assert s["lr"] == {10: 1.5e-05, 20: 3e-04}
    assert s["grad_norm"] == {10: 5.321, 20: 2.5}
    assert s["loss_scale"] == {10: 4096.0, 20: 1.0}
    assert s["elapsed_ms"] == {10: 1523.4, 20: 1250.0}          # seconds read as the milliseconds the key says
    assert s["skipped_iterations"] == {10: 0.0, 20: 0.0} and s["nan_iterations"] == {10: 0.0, 20: 0.0}
    assert s["tflops_per_gpu"] == {10: 98.76}
    assert s["tokens_per_gpu_per_second_tgs"] == {10: 2688.7}
    assert s["max_memory_allocated_mb"] == {20: 13100.0}       # a/b: both kept, named from the label
    assert s["max_memory_reserved_mb"] == {20: 13240.9}
    assert s["gpu_utilization"] == {20: 50.0}                  # glued text cut at the number ...
    assert s["model_tflop_s_gpu"] == {20: 123.4}               # ... and the glued field read too
    assert s["mem_alloc_gb"] == {20: 12.5}                     # after the last '|' on a finished line
    assert not [n for n in run.notes if "unreadable" in n]


def test_one_unreadable_field_keeps_the_rest_of_the_step(tmp_path):
    text = "\n".join([line(1), line(2, loss="6.9x3E+00"), line(3, gnorm="1.4#9")]) + "\n"
    run = parse_megatron_log(write(tmp_path, text))
    assert list(run.series("loss").index) == [1, 3]          # never a wrong value: 6.9x3E+00 is not 6.9
    assert list(run.series("grad_norm").index) == [1, 2]
    assert list(run.series("lr").index) == [1, 2, 3]          # the steps keep every other field
    assert any("iteration 2" in n and "lm loss" in n for n in run.notes)
    assert any("iteration 3" in n and "grad norm" in n for n in run.notes)


def test_many_records_with_a_few_garbled_are_read_in_bulk_and_named(tmp_path):
    """Enough records for the bulk reader: the garbled ones are found by bisection, the others all read."""
    lines = [line(i, f"{10 - i * 1e-3:.6E}") for i in range(1, 501)]
    lines[99] = line(100, loss="bad")
    lines[399] = line(400, f"{10 - 0.4:.6E}").replace("| loss scale", "| params norm: 3.5 | loss scale")
    run = parse_megatron_log(write(tmp_path, "\n".join(lines) + "\n"))
    loss = run.series("loss")
    assert len(loss) == 499 and 100 not in loss.index
    assert loss[400] == pytest.approx(10 - 0.4) and run.series("params_norm").to_dict() == {400: 3.5}
    assert len(run.series("lr")) == 500
    assert [n for n in run.notes if "iteration 100" in n and "lm loss" in n]


def test_hand_trimmed_records_are_never_glued_together(tmp_path):
    """Each record cut by hand after its loss: four steps, four losses, no terminal-wrap join."""
    trimmed = [line(i, f"{7 - i * 0.1:.6E}") for i in range(1, 5)]
    trimmed = [t[: t.index(" | loss scale")] for t in trimmed]
    run = parse_megatron_log(write(tmp_path, "\n".join(trimmed) + "\n"))
    assert run.series("loss").to_dict() == pytest.approx({1: 6.9, 2: 6.8, 3: 6.7, 4: 6.6})
    assert not any("re-joined" in n for n in run.notes)


def test_a_single_wrapped_record_among_unwrapped_ones(tmp_path):
    """A terminal of width W: only the one record longer than W is cut (the others fit)."""
    short = [line(i).replace(" | number of skipped iterations:   0 | number of nan iterations:   0 |", " |")
             for i in range(1, 6)]
    long = line(6, "5.500000E+00")
    width = max(len(x) for x in short) + 5
    wrapped = [long[:width], long[width:]]
    text = "\n".join(short[:3] + wrapped + short[3:5]) + "\n"
    run = parse_megatron_log(write(tmp_path, text))
    assert run.series("loss")[6] == 5.5
    assert run.series("nan_iterations").to_dict() == {6: 0.0}
    assert len(run.series("loss")) == 6
    assert any("re-joined 1" in n for n in run.notes)


def test_wrap_exactly_after_a_separator(tmp_path):
    """The cut falls right after a '|': the first piece looks complete, the second continues the fields."""
    lines = [line(i) for i in range(1, 4)]
    cut = lines[1].index("| lm loss") + 1
    width = cut
    pieces = []
    for ln in lines:
        pieces += [ln[j:j + width] for j in range(0, len(ln), width)]
    run = parse_megatron_log(write(tmp_path, "\n".join(pieces) + "\n"))
    assert len(run.series("loss")) == 3 and len(run.series("nan_iterations")) == 3


def test_arguments_block_with_elided_lines_and_abbreviation(tmp_path):
    from align.checks.config import megatron_common
    text = ("using world size: 64, data-parallel size: 8, context-parallel size: 1, hierarchical context-parallel "
            "sizes: Nonetensor-model-parallel size: 8, pipeline-model-parallel size: 1\n"
            "------------------------ arguments ------------------------\n"
            "  adam_beta1 ...................................... 0.9\n"
            "  adam_beta2 ...................................... 0.95\n"
            "  ...\n"
            "  hidden_size ..................................... 4096\n"
            "-------------------- end of arguments ---------------------\n" + line(1) + "\n")
    block = parse_arguments_block(text)
    assert block["adam_beta2"] == 0.95 and block.abbreviated
    run = parse_megatron_log(write(tmp_path, text))
    assert run.meta["parallel"] == {"tp": 8, "pp": 1, "dp": 8, "world_size": 64}
    from sources.configs import read_megatron
    args, kind = read_megatron(write(tmp_path, text, "args.log"))
    common, _ = megatron_common(args)
    assert common["tp"] == 8                       # from the 'using world size' line, not the default 1
    assert common["weight_decay"] is None          # not in the abbreviated block: unknown, not 0.01
    assert common["hidden_dropout"] is None and common["norm_eps"] is None


def test_run_with_no_world_line_keeps_unknown_sizes_unknown(tmp_path):
    text = ARGS.replace("  tensor_model_parallel_size ...................... 2\n", "") + line(1) + "\n"
    run = parse_megatron_log(write(tmp_path, text))
    assert run.meta.get("parallel", {}).get("tp") is None


def test_a_few_nul_bytes_are_removed_and_noted(tmp_path):
    """A crash or a copy can leave NUL bytes in a text log: they are dropped (and said), the steps kept."""
    text = "\n".join([line(1), line(2), line(3)]) + "\n"
    data = text.encode().replace(b"lm loss: 6.92", b"lm loss: 6.\x00\x0092", 1)
    p = tmp_path / "nul.log"
    p.write_bytes(data)
    run = parse_megatron_log(p)
    assert run.series("loss").to_dict() == {1: 6.923337, 2: 6.923337, 3: 6.923337}
    assert any("2 NUL" in n for n in run.notes)


def test_seconds_read_the_same_in_bulk_and_field_by_field(tmp_path):
    lines = [f" iteration {i:>8}/     500 | elapsed time per iteration (s): 1.25 | lm loss: 7.5 |"
             for i in range(1, 101)]
    bulk = parse_megatron_log(write(tmp_path, "\n".join(lines) + "\n", "a.log"))
    lines[50] = lines[50].replace("lm loss: 7.5", "lm loss: 7.5x1")
    mixed = parse_megatron_log(write(tmp_path, "\n".join(lines) + "\n", "b.log"))
    assert set(bulk.series("elapsed_ms")) == {1250.0} and len(bulk.series("elapsed_ms")) == 100
    assert set(mixed.series("elapsed_ms")) == {1250.0} and len(mixed.series("elapsed_ms")) == 100
    assert len(mixed.series("loss")) == 99


def test_check_config_on_an_abbreviated_block_reports_unknown_not_default(tmp_path, capsys):
    """The log says TP 8 and weight decay is not in the trimmed block: no 'tp 1' and no default 0.01."""
    import json

    import yaml

    from align.cli import main
    text = ("using world size: 8, data-parallel size: 1, context-parallel size: 1, tensor-model-parallel size: 8, "
            "pipeline-model-parallel size: 1\n------------------------ arguments ------------------------\n"
            "  adam_beta2 ...................................... 0.95\n  ...\n"
            "  hidden_size ..................................... 64\n"
            "-------------------- end of arguments ---------------------\n")
    log = write(tmp_path, text)
    mf = tmp_path / "mf.yaml"
    mf.write_text(yaml.safe_dump({"optimizer": {"betas": [0.9, 0.95], "weight_decay": 0.1},
                                  "parallel_config": {"model_parallel": 8},
                                  "model": {"model_config": {"hidden_size": 64}}}))
    out = tmp_path / "cc.json"
    main(["check-config", str(log), str(mf), "--json", str(out)])
    rows = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["tp"]["status"] == "match" and rows["tp"]["megatron"] == 8
    assert rows["weight_decay"]["megatron"] is None and rows["weight_decay"]["status"] == "check"
    assert rows["adam_beta2"]["status"] == "match" and rows["hidden_size"]["status"] == "match"


def test_text_after_the_last_separator_on_every_line_is_read(tmp_path):
    """A fork that prints a memory figure after the record's last '|': the bulk reader must not drop it."""
    lines = [line(i, f"{9 - i * 1e-3:.6E}") + f" mem-alloc-GB: {10 + i * 0.5:.1f} GB" for i in range(1, 201)]
    run = parse_megatron_log(write(tmp_path, "\n".join(lines) + "\n"))
    assert len(run.series("loss")) == 200 and run.series("mem_alloc_gb")[200] == 110.0


@pytest.mark.parametrize("n", [3, 100])   # field by field, and the bulk reader
def test_an_iteration_number_beyond_any_step_index_is_noted_not_wrapped(tmp_path, n):
    lines = [line(i) for i in range(1, n)] + [line(10 ** 30)]
    run = parse_megatron_log(write(tmp_path, "\n".join(lines) + "\n"))
    assert list(run.series("loss").index) == list(range(1, n))   # no garbage step (a wrapped int64)
    assert any("beyond any step index" in note for note in run.notes)


def test_validation_line_with_a_garbled_value_keeps_the_other(tmp_path):
    text = (line(2) + "\n validation loss at iteration 2 | lm loss value: 9.876543E+00 | lm loss PPL: 1.9x4E+04 | \n"
            " validation loss at iteration 99999999999999999999999 | lm loss value: 1.0E+00 | lm loss PPL: 2.7 | \n")
    run = parse_megatron_log(write(tmp_path, text))
    assert run.series("val_loss").to_dict() == {2: 9.876543} and len(run.series("val_ppl")) == 0
    assert any("2 validation value(s) not read" in n for n in run.notes)


# --- issue 15: the bulk path for canonical logs reads exactly what the careful path reads -------------------

def _both(monkeypatch, p: Path):
    """The run read as usual and the run read with the canonical bulk path switched off."""
    import sources.megatron_log as ml
    fast = ml.parse_megatron_log(p)
    with monkeypatch.context() as mp:
        mp.setattr(ml, "_read_canonical", lambda raw: None)
        careful = ml.parse_megatron_log(p)
    return fast, careful


def _same(a, b) -> None:
    assert a.notes == b.notes and a.meta == b.meta
    assert sorted(a.scalars) == sorted(b.scalars)
    for k, s in a.scalars.items():
        assert s.index.equals(b.scalars[k].index), k
        np.testing.assert_array_equal(s.to_numpy(), b.scalars[k].to_numpy(), err_msg=k)


def _mixed_lines(stamp: bool) -> list[str]:
    rng = np.random.default_rng(15)
    pre = "[2024-05-01 10:12:31] " if stamp else ""
    out = ["using world size: 2, data-parallel size: 1, tensor-model-parallel size: 2, pipeline-model-parallel "
           "size: 1", *ARGS.splitlines(), "> building GPT model ..."]
    for i in range(1, 301):
        loss = "nan" if i == 40 else f"{rng.uniform(2, 10):.6E}"
        rec = line(i, loss, gnorm="inf" if i == 41 else f"{rng.uniform(0, 3):.3f}")
        out.append(pre + rec[rec.index("iteration"):])
        if i % 100 == 0:
            out += ["-" * 90, f" validation loss at iteration {i} | lm loss value: 9.876543E+00 | lm loss PPL: "
                    "1.947352E+04 | ", "-" * 90, f"saving checkpoint at iteration {i:7d} to /ckpt in torch_dist format"]
        if i == 150:
            out += ["/usr/lib/python3/site-packages/torch/cuda/__init__.py:52: UserWarning: something",
                    "Traceback (most recent call last):", '  File "x.py", line 1, in <module>', "RuntimeError: boom",
                    "", "   "]
    return out


@pytest.mark.parametrize("stamp", [True, False])
def test_canonical_bulk_path_matches_the_careful_path(tmp_path, monkeypatch, stamp):
    import sources.megatron_log as ml
    lines = _mixed_lines(stamp)
    restart = lines[:200] + [x for x in lines[150:] if "iteration" in x and "|" in x][:30] + lines[200:]
    for name, text in [("clean", "\n".join(lines) + "\n"), ("restart", "\n".join(restart) + "\n"),
                       ("no_final_newline", "\n".join(lines))]:
        p = write(tmp_path, text, f"{name}.log")
        assert ml._read_canonical(ml.clean_text(p.read_bytes())) is not None, name   # the bulk path read it
        fast, careful = _both(monkeypatch, p)
        _same(fast, careful)
        assert len(fast.series("loss")) == 300 and fast.series("val_loss").to_dict()[300] == 9.876543
    assert any("traceback" in n for n in fast.notes)


def test_canonical_bulk_path_steps_aside_for_damaged_lines(tmp_path, monkeypatch):
    """Garbled values, a wrapped record, a cut last line, a swapped-in field, a record glued after other
    text: the bulk path declines (or reads the same) and every result equals the careful path's."""
    import sources.megatron_log as ml
    lines = _mixed_lines(True)
    recs = [i for i, x in enumerate(lines) if "| lm loss:" in x]
    cases = {}
    g = lines[:]
    g[recs[10]] = g[recs[10]].replace("lm loss: ", "lm loss: 6.9x")
    cases["garbled"] = g
    w = lines[:]
    k = recs[20]
    w[k: k + 1] = [w[k][:100], w[k][100:]]
    cases["wrapped"] = w
    cases["cut"] = lines[: recs[-1]] + [lines[recs[-1]][:120]]
    f = lines[:]
    f[recs[30]] = f[recs[30]].replace("num zeros", "params norm")
    cases["renamed"] = f
    h = lines[:]
    h[recs[40]] = "some text " + h[recs[40]]
    cases["glued"] = h
    c = lines[:]
    c[recs[50] + 1: recs[50] + 1] = ["lm loss: 5.0 | orphan |"]
    cases["orphan"] = c
    a = lines[:]
    a[recs[60]] = a[recs[60]].replace("grad norm: ", "grad norm: 1.0/")
    cases["pair"] = a
    for name, ls in cases.items():
        p = write(tmp_path, "\n".join(ls) + ("" if name == "cut" else "\n"), f"{name}.log")
        fast, careful = _both(monkeypatch, p)
        _same(fast, careful)
    # a garbled value no longer sends the whole file to the careful path: its record is read field by field
    canon = ml._read_canonical(ml.clean_text(write(tmp_path, "\n".join(cases["garbled"]) + "\n").read_bytes()))
    assert canon is not None and canon.present is not None and not canon.present["loss"].all()
    assert ml._read_canonical(ml.clean_text(write(tmp_path, "\n".join(cases["wrapped"]) + "\n").read_bytes())) is None


def test_digit_run_reads_padded_numbers_and_refuses_anything_else():
    from sources.logtext import digit_run
    rng = np.random.default_rng(5)
    for width in (8, 9, 3):
        want = rng.integers(0, 10 ** width, 1000)
        block = np.frombuffer("".join(f"{v:{width}d}" for v in want).encode(), np.uint8).reshape(-1, width)
        assert (digit_run(block) == want).all()
    for bad in (b"  x5    ", b"1 2     ", b"        ", b"  -5    ", b"  \xd9\xa1    ", b"12  3456", b"1 234567"):
        assert digit_run(np.frombuffer(bad, np.uint8).reshape(1, 8)) is None, bad
    assert digit_run(np.frombuffer(b"  5     ", np.uint8).reshape(1, 8)).tolist() == [5]   # blanks after
    assert digit_run(np.frombuffer(b"\t  12345", np.uint8).reshape(1, 8)).tolist() == [12345]


def test_translated_reads_and_originals_undo_each_other():
    """The bulk paths translate the separators block by block as pyarrow reads (numpy for a one-byte table) and
    find the lines pyarrow hands back in the original text: the same bytes as bytes.translate, every line where
    it is, also one that ends the file unterminated, one that repeats inside a longer line, and one without any
    separator."""
    from sources.logtext import _Translating, originals
    table = bytes.maketrans(b":", b"|")
    lines = [b"a: b | c", b"x|y", b"plain text", b"a: b | c", b"k: 1 | a: b | c:", b"|", b" b | c", b"last: 1"]
    raw = b"\n".join(lines)
    big = raw * 50_000
    for tab in (table, bytes.maketrans(b",:[]/", b"|||||")):     # one mapped byte (numpy), several (translate)
        reader = _Translating(big, tab)
        blocks = [bytes(reader.read(1 << 16)) for _ in range(-(-len(big) // (1 << 16)) + 1)]
        assert b"".join(blocks) == big.translate(tab) and blocks[-1] == b""
        assert bytes(_Translating(raw, tab).read()) == raw.translate(tab)
    tr = raw.translate(table)
    picked = [1, 2, 3, 4, 5, 6, 7]
    texts = [tr.split(b"\n")[i].decode() for i in picked]
    assert originals(raw, texts, table) == [lines[i] for i in picked]
    assert originals(raw, [tr.split(b"\n")[0].decode()], table) == [lines[0]]
    assert originals(raw, ["not there"], table) is None
    assert originals(raw, [texts[1], texts[0]], table) is None     # out of order


# --- issue 24: never silently wrong: a step number or a value that did not survive is unread and noted -------

def _lines_with(n: int, k: int, old: bytes, new: bytes) -> bytes:
    """``n`` records (loss = step) with record ``k``'s ``old`` replaced by ``new``."""
    recs = [line(i, f"{float(i):.6E}").encode() for i in range(1, n + 1)]
    assert old in recs[k - 1]
    recs[k - 1] = recs[k - 1].replace(old, new, 1)
    return b"\n".join(recs) + b"\n"


@pytest.mark.parametrize("n", [5, 300])   # field by field, and the bulk readers
@pytest.mark.parametrize("head", [b"iteration 26\x00/", b"iteration 2\x006/", b"iteration \x0026/",
                                  b"iteration 26\x0c/", b"iteration \x0b26/", b"iteration 26\x01/",
                                  b"iteration 26\x1f/"])
def test_a_control_byte_in_the_step_number_leaves_that_record_unread(tmp_path, monkeypatch, n, head):
    """Measured: 'iteration 26\\x00/' (a garbled 264) overwrote step 26. A control byte next to a digit may
    stand for a digit: the record is not read (and noted), never read as a shorter number."""
    p = tmp_path / "c.log"
    p.write_bytes(_lines_with(n, 3, b"iteration        3/", head))
    fast, careful = _both(monkeypatch, p)
    _same(fast, careful)
    loss = fast.series("loss").to_dict()
    assert loss == {float(i): float(i) for i in range(1, n + 1) if i != 3}
    assert any("head" in x or "NUL" in x for x in fast.notes)


@pytest.mark.parametrize("n", [5, 300])
@pytest.mark.parametrize("value", [b"6_923", "\u0666.5".encode(), b"6.9\x0123", b"6.923\x0b", b"\x0c6.923",
                                   b"1e400", b"9" * 400, b"-1.0E+999"])
def test_a_value_that_did_not_survive_is_unread_not_reshaped(tmp_path, monkeypatch, n, value):
    """Python's float() reads '6_923' as 6923, Arabic-Indic digits, strips \\v \\f; 1e400 overflows to inf:
    each is an unreadable value (noted), the step keeps its other fields; both paths agree."""
    p = tmp_path / "v.log"
    p.write_bytes(_lines_with(n, 3, b"lm loss: 3.000000E+00", b"lm loss: " + value))
    fast, careful = _both(monkeypatch, p)
    _same(fast, careful)
    assert fast.series("loss").to_dict() == {float(i): float(i) for i in range(1, n + 1) if i != 3}
    assert fast.series("grad_norm")[3] == 1.479
    assert any("unreadable 'lm loss'" in x for x in fast.notes)


def test_an_inf_printed_as_inf_is_still_read_in_bulk(tmp_path, monkeypatch):
    p = tmp_path / "inf.log"
    p.write_bytes(_lines_with(300, 7, b"grad norm: 1.479", b"grad norm: inf"))
    import sources.megatron_log as ml
    assert ml._read_canonical(p.read_bytes()) is not None
    fast, careful = _both(monkeypatch, p)
    _same(fast, careful)
    assert math.isinf(fast.series("grad_norm")[7])
    assert [x for x in fast.notes if "may be the mean over iterations 1-2" not in x] == []   # no block: version unknown


def test_a_control_byte_in_a_validation_step_or_value_is_not_read(tmp_path):
    text = line(1) + "\n validation loss at iteration 2\x0c6 | lm loss value: 9.876543E+00 | lm loss PPL: 1.9E+04 |\n"
    run = parse_megatron_log(write(tmp_path, text))
    assert "val_loss" not in run.scalars and "val_ppl" not in run.scalars
    assert any("1 validation value(s) not read (first: iteration 2" in x for x in run.notes)
    text = line(1) + "\n validation loss at iteration 3 | lm loss value: 9_876 | lm loss PPL: 1.9E+04 |\n"
    run = parse_megatron_log(write(tmp_path, text, "b.log"))
    assert "val_loss" not in run.scalars and run.series("val_ppl").to_dict() == {3: 19000.0}
    assert any("1 validation value(s) not read" in x for x in run.notes)


# --- issue 22: from core 0.16 the line after a process's first iteration is a mean over both -------------

from comparators.scalars import compare_scalars  # noqa: E402
from runstore.run import Run, make_series  # noqa: E402
from tests.helpers.megatron_log_text import CORE_0_16_ARGS, megatron_log  # noqa: E402

LOSSES = [4.804650, 4.858390, 4.771200, 4.702031, 4.650112]
TIMES = [2150.0, 48.0, 51.0, 47.5, 49.0]      # the first iteration carries start-up
BASE_ARGS = {"log_interval": 1, "num_layers": 2, "tensor_model_parallel_size": 1, "vocab_size": 127,
             "tokenizer_type": "NullTokenizer", "make_vocab_size_divisible_by": 128, "train_iters": 5}
ARGS_0_16 = {**BASE_ARGS, **CORE_0_16_ARGS}
# A whole pre-0.16 block: Megatron prints every argument it has (450+ in core 0.12), none of the 0.16 ones.
ARGS_0_12 = {**BASE_ARGS, **{f"setting_{i:03d}": i for i in range(120)}}


def _mean12() -> float:
    return float((np.float32(LOSSES[0]) + np.float32(LOSSES[1])) / 2)


def _true_run(losses=LOSSES) -> Run:
    return Run("store", "runstore", {}, {"loss": make_series(range(1, len(losses) + 1), losses, "loss")})


def test_core_0_16_line_2_is_the_mean_of_iterations_1_and_2_and_is_read_back(tmp_path):
    """What a 0.16.1 run prints with --log-interval 1 (its accumulators kept after iteration 1): iteration 2's
    'lm loss' is the float32 mean of iterations 1 and 2; the arguments block tells the version."""
    text = megatron_log(LOSSES, TIMES, ARGS_0_16)
    assert f"lm loss: {_mean12():.6E} |" in text
    run = parse_megatron_log(write(tmp_path, text))
    w = run.meta["log_windows"]
    assert len(w) == 1 and w[0]["state"] == "recovered" and (w[0]["first"], w[0]["step"]) == (1, 2)
    assert w[0]["printed"]["loss"] == pytest.approx(_mean12(), abs=1e-6)
    loss = run.series("loss")
    err = w[0]["error"]["loss"]
    assert err < 3e-6 and abs(loss[2] - LOSSES[1]) <= err      # 2 x 4.831520E+00 - 4.804650E+00
    assert [round(loss[s], 6) for s in (1, 3, 4, 5)] == [LOSSES[0], *LOSSES[2:]]
    assert abs(run.series("elapsed_ms")[2] - TIMES[1]) <= w[0]["error"]["elapsed_ms"]   # (2150 + 48) / 2 read back
    note = [n for n in run.notes if "mean over iterations 1-2" in n]
    assert note and "save_wgrads_interval" in note[0] and "%.6E" in note[0]
    st = compare_scalars(_true_run(), run).stages["step2_loss"]
    assert st.verdict == "pass" and "recovered" in st.findings[0].message


def test_before_core_0_16_line_2_is_iteration_2(tmp_path):
    text = megatron_log(LOSSES, TIMES, ARGS_0_12, keep_first=False)
    run = parse_megatron_log(write(tmp_path, text))
    assert run.series("loss").round(6).tolist() == LOSSES
    assert "log_windows" not in run.meta and not any("mean over" in n for n in run.notes)


def test_an_unknown_version_is_weighed_both_ways_never_a_false_fail(tmp_path):
    """No arguments block: the step-2 line may be a mean or not; compared with the store's own losses, the
    printed mean fails and the read-back value passes: a warning that names the ambiguity, not a fail."""
    run = parse_megatron_log(write(tmp_path, megatron_log(LOSSES, [50.0] * 5, None)))
    assert run.series("loss")[2] == pytest.approx(_mean12(), abs=1e-6)     # kept as printed
    assert run.meta["log_windows"][0]["state"] == "ambiguous"
    assert any("may be the mean over iterations 1-2" in n for n in run.notes)
    st = compare_scalars(_true_run(), run).stages["step2_loss"]
    assert st.verdict == "warn", st.findings[0].message
    assert "not known" in st.findings[0].message and "arguments block" in st.findings[0].message
    # the same log against a run that trained differently at step 2: both readings fail
    st = compare_scalars(_true_run([LOSSES[0], 5.2, *LOSSES[2:]]), run).stages["step2_loss"]
    assert st.verdict == "fail"
    # two such logs are read the same way: a pass
    twin = parse_megatron_log(write(tmp_path, megatron_log(LOSSES, [50.0] * 5, None), "twin.log"))
    assert compare_scalars(twin, run).stages["step2_loss"].verdict == "pass"


def test_a_later_megatron_that_resets_after_line_1_is_told_by_its_elapsed_times(tmp_path):
    """A 0.16-style block over lines that reset after iteration 1 (the upstream fix, NVIDIA/Megatron-LM#7092):
    averaged, iteration 2's time would be >= (2150 ms) / 2; it prints 48 ms, so it is read as printed."""
    run = parse_megatron_log(write(tmp_path, megatron_log(LOSSES, TIMES, ARGS_0_16, keep_first=False)))
    assert run.series("loss").round(6).tolist() == LOSSES
    assert any("resets after the first printed line" in n for n in run.notes)
    assert compare_scalars(_true_run(), run).stages["step2_loss"].verdict == "pass"


def test_windows_of_other_intervals_and_a_resumed_run(tmp_path):
    """--log-interval 2 from iteration 0: lines 1 (alone) and 2 (mean of 1-2, as every release prints it):
    nothing to read back. Resumed at 4 with interval 2 (a first iteration on a boundary): line 6 averages
    iterations 4-6, read back as the mean of 5-6, as a regular line would hold."""
    losses = LOSSES + [4.6, 4.55]
    run = parse_megatron_log(write(tmp_path, megatron_log(losses, [50.0] * 7, {**ARGS_0_16, "log_interval": 2},
                                                          interval=2)))
    assert "log_windows" not in run.meta
    assert run.series("loss")[2] == pytest.approx(_mean12(), abs=1e-6)
    resumed = megatron_log(losses[3:], [50.0] * 4, {**ARGS_0_16, "log_interval": 2}, interval=2, start=3)
    run = parse_megatron_log(write(tmp_path, resumed, "resumed.log"))
    assert list(run.series("loss").index) == [4, 6]
    assert run.meta["log_windows"][0]["iterations"] == 3
    assert run.series("loss")[6] == pytest.approx((losses[4] + losses[5]) / 2, abs=3e-6)


def test_a_skipped_first_iteration_leaves_line_2_as_printed(tmp_path):
    """fp16 overflow at iteration 1: it adds no loss, so the mean printed at 2 is iteration 2's own."""
    run = parse_megatron_log(write(tmp_path, megatron_log(LOSSES, TIMES, ARGS_0_16, skipped=(1,))))
    assert 1 not in run.series("loss").index
    assert run.series("loss")[2] == pytest.approx(LOSSES[1], abs=1e-6)
    assert run.series("skipped_iterations")[2] == 1.0
    assert "log_windows" not in run.meta


def test_the_padded_vocab_line_gives_the_model_vocabulary(tmp_path):
    run = parse_megatron_log(write(tmp_path, megatron_log(LOSSES, TIMES, ARGS_0_16, vocab=(128, 256))))
    assert run.meta["data"]["vocab_size"] == 256 and run.meta["data"]["tokenizer_vocab_size"] == 128
