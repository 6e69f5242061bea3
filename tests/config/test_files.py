"""Config files and presets: every preset reproduces its published total and active counts within 2%."""

import pytest

from moejax.config import ModelConfig
from moejax.config import files as presets
from moejax.topology import accounting

EXPECTED = {"deepseek_v3", "gpt_oss_120b", "kimi_k2", "mixtral_8x22b", "mixtral_8x7b",
            "qwen3_235b_a22b", "switch_base_128"}


def test_list_presets():
  assert EXPECTED <= set(presets.list_presets())
  assert presets.presets_dir().name == "presets"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_matches_published(name):
  model, arch, pub = presets.load_preset(name)
  assert isinstance(model, ModelConfig)
  assert pub["source"] and pub["active_convention"] in ("matmul", "with_embedding")
  b = accounting.budget(model, arch=arch)
  active = b.active_with_embedding if pub["active_convention"] == "with_embedding" else b.active
  assert abs(accounting.relative_error(b.total, pub["total"])) < 0.02, (b.total, pub["total"])
  assert abs(accounting.relative_error(active, pub["active"])) < 0.02, (active, pub["active"])


def test_deepseek_v3_structure():
  """The counts land for the right reasons: 58 MoE layers of 257 experts + 3 dense."""
  model, arch, _ = presets.load_preset("deepseek_v3")
  assert sum(model.is_moe_layer(i) for i in range(model.n_layers)) == 58
  assert arch.attention == "mla"  # counted by the accounting, not built by the model
  parts = accounting.budget(model, arch=arch).breakdown
  expert = 3 * 7168 * 2048
  assert parts["routed_experts"].total == 58 * 256 * expert
  assert parts["shared_experts"].total == 58 * expert
  assert parts["routed_experts"].active == 58 * 8 * expert
  assert parts["dense_ffn"].total == 3 * 3 * 7168 * 18432


def test_unknown_preset_lists_valid_names():
  with pytest.raises(ValueError, match=r"unknown preset 'mixtral'.*mixtral_8x7b.*deepseek_v3"):
    presets.load_preset("mixtral")
