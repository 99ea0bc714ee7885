"""TensorBoard import: event files written by torch's SummaryWriter with Megatron's tag names."""

from __future__ import annotations

import math

import pytest

from core.errors import BadInput
from sources import detect, load_run

torch_tb = pytest.importorskip("torch.utils.tensorboard")


def test_megatron_tags(tmp_path):
    w = torch_tb.SummaryWriter(log_dir=str(tmp_path / "tb"))
    for step in range(1, 11):  # what Megatron's training_log writes
        w.add_scalar("lm loss", 10.0 - step * 0.1, step)
        w.add_scalar("lm loss vs samples", 10.0 - step * 0.1, step * 16)
        w.add_scalar("grad-norm", 1.0 if step != 7 else float("nan"), step)
        w.add_scalar("learning-rate", 1e-4 * step, step)
    w.close()
    assert detect(tmp_path / "tb") == "tensorboard"
    run = load_run(tmp_path / "tb")
    assert run.series("loss").to_dict() == pytest.approx({s: 10.0 - s * 0.1 for s in range(1, 11)})
    assert math.isnan(run.series("grad_norm")[7])
    assert run.series("lr")[10] == pytest.approx(1e-3)
    assert "lm_loss_vs_samples" not in run.scalars


def test_corrupt_event_file(tmp_path):
    d = tmp_path / "tb"
    d.mkdir()
    (d / "events.out.tfevents.123.host").write_bytes(b"\x10\x00\x00\x00garbage" * 10)
    with pytest.raises(BadInput) as err:
        load_run(d)
    assert "events.out.tfevents" in str(err.value)


def test_mindformers_tags_keep_lm_loss_and_total_loss_apart(tmp_path):
    """Tags as MindFormers' MFLossMonitor and TrainingStateMonitor write them (tensorboardX, its writer)."""
    tbx = pytest.importorskip("tensorboardX")
    w = tbx.SummaryWriter(log_dir=str(tmp_path / "tb"))
    for step in range(1, 6):
        w.add_scalar("loss", 5.0 - 0.1 * step + 0.02, global_step=step)          # lm + aux + MTP
        w.add_scalar("loss vs samples", 5.0, global_step=step * 8)
        w.add_scalar("lm-loss", 5.0 - 0.1 * step, global_step=step)
        w.add_scalar("mtp-loss", 0.015, global_step=step)
        w.add_scalar("load-balancing-loss", 0.005, global_step=step)
        w.add_scalar("grad-norm", 1.5, global_step=step)
        w.add_scalar("learning-rate", 1e-4, global_step=step)
        w.add_scalar("local_norm/decoder.layers.0.mlp.linear_fc1.weight", 0.25 * step, global_step=step)
        w.add_scalar("local_norm/embedding.word_embeddings.weight", 0.5, global_step=step)
    w.close()
    run = load_run(tmp_path / "tb")
    assert run.series("loss").to_dict() == pytest.approx({s: 5.0 - 0.1 * s for s in range(1, 6)})
    assert run.series("total_loss")[3] == pytest.approx(4.72)
    assert run.series("mtp_loss")[1] == pytest.approx(0.015)
    assert run.series("load_balancing_loss")[1] == pytest.approx(0.005)
    t = run.local_norm_table(2).set_index("name")["norm"]
    assert t["decoder.layers.0.mlp.linear_fc1.weight"] == pytest.approx(0.5)
    assert t["embedding.word_embeddings.weight"] == pytest.approx(0.5)


def test_mindformers_loss_alone_is_the_lm_loss(tmp_path):
    tbx = pytest.importorskip("tensorboardX")
    w = tbx.SummaryWriter(log_dir=str(tmp_path / "tb"))
    for step in range(1, 4):
        w.add_scalar("loss", 3.0 + step, global_step=step)
    w.close()
    run = load_run(tmp_path / "tb")
    assert run.series("loss")[2] == pytest.approx(5.0) and "total_loss" not in run.scalars
    assert any("lm loss" in n for n in run.notes)


def test_mindformers_tags_lm_loss_and_named_local_norms(tmp_path):
    """The tags MindFormers 2.x writes (MFLossMonitor / TrainingStateMonitor, through tensorboardX)."""
    tbx = pytest.importorskip("tensorboardX")
    w = tbx.SummaryWriter(logdir=str(tmp_path / "tb"))
    names = ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight"]
    for step in range(1, 4):
        w.add_scalar("loss", 5.0 - step * 0.1 + 0.3, global_step=step)      # lm + aux + mtp
        w.add_scalar("lm-loss", 5.0 - step * 0.1, global_step=step)
        w.add_scalar("mtp-loss", 0.25, global_step=step)
        w.add_scalar("grad-norm", 1.5, global_step=step)
        for i, name in enumerate(names):
            w.add_scalar(f"local_norm/{name}", 0.1 * (i + 1) * step, global_step=step)
    w.close()
    run = load_run(tmp_path / "tb")
    assert run.series("loss").to_dict() == pytest.approx({s: 5.0 - s * 0.1 for s in range(1, 4)})
    assert run.series("total_loss").to_dict() == pytest.approx({s: 5.3 - s * 0.1 for s in range(1, 4)})
    assert run.meta["loss_key"] == "lm_loss" and any("total_loss" in n for n in run.notes)
    table = run.local_norm_table(2)
    assert sorted(table.name) == sorted(names)
    assert dict(zip(table.name, table.norm, strict=True)) == pytest.approx({names[0]: 0.2, names[1]: 0.4})


# --- issue 24: one damaged record no longer drops every later step without a word ------------------------------

def _written(tmp_path, steps=50):
    w = torch_tb.SummaryWriter(log_dir=str(tmp_path / "tb"))
    for step in range(1, steps + 1):
        w.add_scalar("lm loss", 10.0 - step * 0.01, step)
        w.add_scalar("grad-norm", 1.0 + step, step)
    w.close()
    (f,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    return f


def _offsets(data: bytes) -> list[int]:
    import struct
    out, pos = [], 0
    while pos < len(data):
        out.append(pos)
        pos += 12 + struct.unpack_from("<Q", data, pos)[0] + 4
    return out


@pytest.mark.parametrize("where", ["data", "length", "length_crc", "data_crc"])
def test_a_flipped_byte_skips_that_record_only_and_says_so(tmp_path, where):
    """Measured: one flipped byte in a record dropped every later step (whose records still pass their
    checksums), with no note. Now the reader resynchronises on the next verified record."""
    f = _written(tmp_path)
    data = bytearray(f.read_bytes())
    offs = _offsets(bytes(data))
    k = len(offs) // 2
    at = offs[k] + {"data": 14, "length": 0, "length_crc": 9, "data_crc": offs[k + 1] - offs[k] - 2}[where]
    data[at] ^= 0x10
    f.write_bytes(bytes(data))
    run = load_run(tmp_path / "tb")
    loss, gn = run.series("loss").to_dict(), run.series("grad_norm").to_dict()
    lost = {s for s in range(1, 51) if s not in loss} | {s for s in range(1, 51) if s not in gn}
    assert len(lost) == 1 and max(loss) == max(gn) == 50          # one record, one scalar lost; later steps read
    for s, v in loss.items():
        assert v == pytest.approx(10.0 - s * 0.01)
    for s, v in gn.items():
        assert v == pytest.approx(1.0 + s)
    assert any("skipped 1 damaged region" in n for n in run.notes)


def test_an_event_file_cut_mid_record_keeps_the_complete_ones(tmp_path):
    f = _written(tmp_path)
    data = f.read_bytes()
    offs = _offsets(data)
    f.write_bytes(data[: offs[-3] + 7])
    run = load_run(tmp_path / "tb")
    assert any("ends inside a record" in n for n in run.notes)
    assert all(v == pytest.approx(10.0 - s * 0.01) for s, v in run.series("loss").items())
