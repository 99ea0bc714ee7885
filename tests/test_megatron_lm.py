"""``python -m dumpers.megatron_lm``: what a user sees when Megatron-LM cannot be imported, and how the
learning rate is picked from the param groups of older Megatron-LM releases.

The launch runs in this process (``main(argv)``) on small packages written to a temporary folder that stand
for a checkout: the script's folder goes first on ``sys.path``, as ``python script.py`` does, so a package
next to the script is found the way a checkout's ``megatron`` is.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from dumpers.megatron_lm import learning_rates, main, mixed_install  # noqa: E402


def _checkout(root: Path, failing_line: str) -> Path:
    """``fakelm/training/training.py`` importing ``fakelm/training/models.py``, whose first line fails."""
    pkg = root / "fakelm" / "training"
    pkg.mkdir(parents=True)
    (root / "fakelm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "training.py").write_text("from fakelm.training import models  # noqa\n")
    (pkg / "models.py").write_text(failing_line + "\n")
    script = root / "pretrain_gpt.py"
    script.write_text("raise SystemExit('the script must not run')\n")
    return script


def _launch(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, module: str,
            script: Path) -> str:
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [m for m in sys.modules if m.split(".")[0] == "fakelm"]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as stop:
        main(["--align-out", str(tmp_path / "store"), "--align-module", module, str(script)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err   # one line
    assert not (tmp_path / "store").exists()
    return err


@pytest.mark.parametrize(("line", "cause"), [
    ("import triton_not_installed_here", "No module named 'triton_not_installed_here'"),
    ("from typing import override_not_in_this_python",
     "ImportError: cannot import name 'override_not_in_this_python' from 'typing'"),
])
def test_import_failure_inside_the_checkout_names_cause_and_file(capsys, monkeypatch, tmp_path, line,
                                                                 cause) -> None:
    script = _checkout(tmp_path, line)
    err = _launch(capsys, monkeypatch, tmp_path, "fakelm.training.training", script)
    assert "fakelm.training.training failed while importing because of " + cause in err
    assert f"(in {tmp_path / 'fakelm' / 'training' / 'models.py'}:1)" in err
    assert "not importable" not in err


def test_no_checkout_on_the_path_says_so(capsys, monkeypatch, tmp_path) -> None:
    script = _checkout(tmp_path, "x = 1")
    err = _launch(capsys, monkeypatch, tmp_path, "nolm_here.training.training", script)
    assert "nolm_here.training.training is not importable (no module named 'nolm_here')" in err
    assert "PYTHONPATH" in err and "failed while importing" not in err


def test_learning_rate_as_older_megatron_lm_logs_it() -> None:
    """Before core 0.16 param groups have no ``default_config``: training.py's loop logs the last group that
    is not ``is_decoupled_lr`` and the last decoupled one apart; from 0.16 the first ``default_config``."""
    old = [{"lr": 3e-4, "is_decoupled_lr": False}, {"lr": 1e-5, "is_decoupled_lr": True},
           {"lr": 2e-4, "is_decoupled_lr": False}]
    assert learning_rates(old) == {"lr/group_0": 3e-4, "lr/group_1": 1e-5, "lr/group_2": 2e-4, "lr": 2e-4,
                                   "decoupled_lr": 1e-5}
    new = [{"lr": 5e-5, "default_config": False}, {"lr": 3e-4, "default_config": True},
           {"lr": 2e-4, "default_config": True}]
    assert learning_rates(new)["lr"] == 3e-4
    assert "lr" not in learning_rates([{"lr": 1e-3, "default_config": False}])


def test_training_module_and_megatron_core_from_different_places_is_named(tmp_path) -> None:
    """A checkout's megatron/training over pip's megatron-core: the wrapper names both folders."""
    import types

    import megatron.core

    core_root = Path(megatron.core.__file__).resolve().parents[2]
    same = types.SimpleNamespace(__name__="megatron.training.training",
                                 __file__=str(core_root / "megatron" / "training" / "training.py"))
    assert mixed_install(same) is None
    other = types.SimpleNamespace(__name__="megatron.training.training",
                                  __file__=str(tmp_path / "megatron" / "training" / "training.py"))
    note = mixed_install(other)
    assert note is not None and str(tmp_path) in note and str(core_root) in note
    assert mixed_install(types.SimpleNamespace(__name__="megatron_lm_shape", __file__=str(tmp_path / "x.py"))) is None


def test_a_cp_rank_records_its_part_of_the_whole_sequence_the_iterator_yielded() -> None:
    """pretrain_gpt.py's iterator yields whole sequences and get_batch cuts them per CP rank afterwards: each
    rank's record is its zig-zag part (attention_mask on dim 2), the parts join back to the whole, a packed
    batch (cu_seqlens) is recorded whole, and the training item itself is untouched."""
    import numpy as np
    import torch

    from dumpers.megatron_lm import this_cp_rank
    from runstore.batches import cp_join, cp_split

    whole = {"tokens": torch.arange(2 * 16).reshape(2, 16), "labels": torch.arange(2 * 16).reshape(2, 16) + 1,
             "loss_mask": torch.ones(2, 16), "attention_mask": torch.rand(2, 1, 16, 16) > 0.5,
             "position_ids": torch.arange(16).expand(2, 16)}
    kept = {k: v.clone() for k, v in whole.items()}
    parts = [this_cp_rank(whole, 2, r) for r in range(2)]
    for key, value in whole.items():
        dim = 2 if key == "attention_mask" else 1
        for r in range(2):
            assert np.array_equal(parts[r][key].numpy(), cp_split(value.numpy(), 2, r, dim)), (key, r)
        assert np.array_equal(cp_join([p[key].numpy() for p in parts], dim), value.numpy()), key
        assert torch.equal(whole[key], kept[key])
    assert parts[0]["tokens"].shape == (2, 8) and parts[1]["tokens"][0, :4].tolist() == [4, 5, 6, 7]
    packed = {**whole, "cu_seqlens": torch.tensor([0, 16])}
    assert this_cp_rank(packed, 2, 1) is packed and this_cp_rank(whole, 1, 0) is whole
