"""Model families: one folder each, found by scanning models/; adding one is adding a folder."""

from __future__ import annotations

import sys

import pytest

import models
from core.errors import BadInput
from models.mindformers_yaml import NOT_READ, expert_count


def test_shipped_families_and_presets() -> None:
    assert [f.name for f in models.families()] == ["mcore_mla", "mcore_moe", "mcore_dense", "llama"]
    assert models.presets() == [
        "megatron_core__mindformers_mcore_dense", "megatron_core__mindformers_mcore_mla",
        "megatron_core__mindformers_mcore_mla_qkv_concat", "megatron_core__mindformers_mcore_moe",
        "megatron_core_llama__mindformers_llama"]
    for name in models.presets():
        assert models.load_mapping(name).name == name
    assert models.load_mapping().name == models.DEFAULT_PRESET == "megatron_core_llama__mindformers_llama"
    assert models.demo_presets() == {"mla": "megatron_core__mindformers_mcore_mla",
                                     "moe": "megatron_core__mindformers_mcore_moe",
                                     "dense": "megatron_core__mindformers_mcore_dense",
                                     "llama": "megatron_core_llama__mindformers_llama"}
    assert models.preset_for_scheme("mindformers_mcore") == "megatron_core__mindformers_mcore_dense"
    assert models.preset_for_scheme("mindformers") is None
    assert models.preset_for_weights("w.safetensors") == "megatron_core__mindformers_mcore_dense"
    assert models.preset_for_weights("w.ckpt") is None
    with pytest.raises(BadInput, match="neither a mapping file nor a preset"):
        models.load_mapping("no_such_preset")


@pytest.mark.parametrize("cfg,preset", [
    ({"use_legacy": True, "model": {"model_config": {"num_layers": 2}}}, None),      # legacy: the default
    ({"use_legacy": False, "model": {"model_config": {"num_experts": 1}}}, "megatron_core__mindformers_mcore_dense"),
    ({"use_legacy": False, "model": {"model_config": {"num_experts": 8}}}, "megatron_core__mindformers_mcore_moe"),
    # an MoE model whose expert count comes from the model class
    ({"use_legacy": False, "model": {"model_config": {"moe_intermediate_size": 8}}},
     "megatron_core__mindformers_mcore_moe"),
    ({"use_legacy": False, "model": {"model_config": {"n_group": 1}}}, "megatron_core__mindformers_mcore_moe"),
    ({"use_legacy": False, "model": {"model_config": {"type": "DeepseekV3Config", "mla_qkv_concat": False}}},
     "megatron_core__mindformers_mcore_mla"),
])
def test_detection_from_a_config(cfg: dict, preset: str | None) -> None:
    assert models.preset_for_config(cfg) == preset


def test_expert_count() -> None:
    def mc(**kw: object) -> dict:
        return {"model": {"model_config": kw}}
    assert expert_count(mc()) == 0 and expert_count(mc(num_moe_experts=1)) == 0
    assert expert_count(mc(n_routed_experts=4)) == 4
    assert expert_count(mc(capacity_factor=1.0)) is NOT_READ


TOY_PRESET = """name: megatron_core__mindformers_toy
rules:
  - {id: embedding, kind: embedding, baseline: embedding.word_embeddings.weight,
     candidate: embedding.word_embeddings.weight}
"""
TOY_FAMILY = '''from models.family import declare

PRESET = "megatron_core__mindformers_toy"


def detect(cfg):
    mc = (cfg.get("model") or {}).get("model_config") or {}
    return PRESET if mc.get("type") == "ToyConfig" else None


FAMILY = declare(__file__, describe="a toy", order=5, detect=detect, demo_kind=None)
'''


def test_adding_a_family_is_adding_a_folder(tmp_path, monkeypatch) -> None:
    """docs/extending.md "A model family": a folder with a preset and FAMILY is found, loads by name and is
    detected from a config before the broader families; nothing else is edited."""
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "megatron_core__mindformers_toy.yaml").write_text(TOY_PRESET)
    (tmp_path / "toy" / "__init__.py").write_text(TOY_FAMILY)
    monkeypatch.setattr(models, "__path__", [*models.__path__, str(tmp_path)])
    monkeypatch.setattr(models, "_TABLE", None)
    monkeypatch.delitem(sys.modules, "models.toy", raising=False)
    try:
        assert models.families()[0].name == "toy"
        assert "megatron_core__mindformers_toy" in models.presets()
        m = models.load_mapping("megatron_core__mindformers_toy")
        assert m.map_name("embedding.word_embeddings.weight") == ["embedding.word_embeddings.weight"]
        toy = {"use_legacy": False, "model": {"model_config": {"type": "ToyConfig", "num_experts": 8}}}
        assert models.preset_for_config(toy) == "megatron_core__mindformers_toy"
        other = {"use_legacy": False, "model": {"model_config": {"num_experts": 8}}}
        assert models.preset_for_config(other) == "megatron_core__mindformers_mcore_moe"
    finally:
        sys.modules.pop("models.toy", None)
