"""Megatron-LM log importer on real log text (the line DESIGN.md quotes) and its damaged variants."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from align.core.errors import BadInput
from align.sources.configs import parse_arguments_block
from align.sources.megatron_log import parse_megatron_log

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
    import align.sources.megatron_log as ml
    real = ml._read_numbers
    monkeypatch.setattr(ml, "_read_numbers", lambda t, n, u: real(t, n, u, use_arrow))
    rng = np.random.default_rng(1)
    lines = [line(i + 1, f"{v:.6E}", gnorm="nan" if i == 7 else f"{v / 3:.3f}")
             for i, v in enumerate(rng.uniform(2, 10, 50))]
    p = write(tmp_path, "\n".join(lines) + "\n")
    fast = ml.parse_megatron_log(p)
    assert ml._fast_columns(ml._RECORD.findall(p.read_bytes())) is not None  # the bulk path did the work
    calls = []
    monkeypatch.setattr(ml, "_fast_columns", lambda records: calls.append(1))  # force the careful path
    careful = ml.parse_megatron_log(p)
    assert calls
    for key, s in careful.scalars.items():
        np.testing.assert_array_equal(fast.series(key).to_numpy(), s.to_numpy())
    assert math.isnan(fast.series("grad_norm")[8])
