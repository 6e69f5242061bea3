"""Serving memory accounting (moejax.topology.memory): hand-computed bytes and the seeds' figures."""

from __future__ import annotations

import pytest

from moejax.config import ModelConfig, RoutingConfig
from moejax.config import files as presets
from moejax.topology import accounting, memory
from tests.configs import moe_config


def _tiny() -> ModelConfig:
  # d=4, V=8, one layer, 2 query heads of width 2, 1 KV head, 2 SwiGLU experts of width 4.
  return ModelConfig(vocab_size=8, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1,
                     dense_ff_width=4, moe=moe_config(num_experts=2, expert_width=4,
                                                    routing=RoutingConfig(top_k=1)))


def test_tiny_model_bytes_by_hand():
  cfg = _tiny()
  # embedding 32 + head 32 + attention (q 16, k 8, v 8, o 16) 48 + norms 12
  # + experts 2 * 3 * 16 = 96 + router 8 = 228 parameters.
  assert accounting.budget(cfg).total == 228
  mats = memory.matrices(cfg)
  assert mats["attention"] == [(4, 4, 1), (4, 2, 2), (4, 4, 1)]
  assert mats["routed_experts"] == [(4, 4, 2), (4, 4, 1)] * 2
  fmts = memory.standard_formats(group_size=2, scale_bits=16)
  assert memory.weight_memory(cfg, fmts["fp32"]).total == 228 * 4
  assert memory.weight_memory(cfg, fmts["bf16"]).total == 228 * 2
  int4 = memory.weight_memory(cfg, fmts["int4"])
  # 144 quantised params at 4 bits = 72 bytes; scales: attention 8 + 4 + 4 + 8, experts
  # 2 * (8 + 8 + 8): 72 scales * 2 bytes = 144; 84 other params at 16 bits = 168 bytes.
  assert (int4.quantized_params, int4.high_params, int4.scale_bytes) == (144, 84, 144)
  assert int4.total == 72 + 144 + 168
  per_channel = memory.weight_memory(
      cfg, memory.standard_formats(group_size=None, scale_bits=32)["int8"])
  # One scale per output column: attention 4 + 2 + 2 + 4, experts 2 * (4 + 4 + 4) = 36.
  assert per_channel.scale_bytes == 36 * 4 and per_channel.total == 144 + 144 + 168
  assert dict(int4.components)["router"] == 8 * 2  # routers stay at 16 bits


def test_kv_cache_mha_gqa_mla_and_mod():
  cfg = _tiny()
  assert memory.kv_numbers_per_token(cfg) == 2 * 1 * 2
  assert memory.kv_bytes(cfg, context=10, batch=3, bits=16) == 4 * 2 * 10 * 3
  mixtral = presets.load_preset("mixtral_8x7b").model
  assert memory.kv_bytes_per_token(mixtral) == 32 * 2 * 8 * 128 * 2  # 128 KiB
  dsv3, arch, _ = presets.load_preset("deepseek_v3")
  # MLA caches the 512-wide latent and the 64-wide rotary key: 61 * 576 * 2 bytes.
  assert memory.kv_bytes_per_token(dsv3, arch=arch) == 61 * 576 * 2 == 70272
  mod = ModelConfig(vocab_size=8, d_model=4, n_layers=2, n_heads=2, moe=None, mod_every=2,
                    mod_capacity=0.25)
  assert memory.kv_numbers_per_token(mod) == 2 * 2 * 2 * (1 + 0.25)


def test_devices_needed():
  assert memory.devices_needed(160e9, 80) == 2
  assert memory.devices_needed(160e9 + 1, 80) == 3
  assert memory.devices_needed(1.0, 80) == 1
  with pytest.raises(ValueError, match="device_gb"):
    memory.devices_needed(1.0, 0)


def test_seed_figures_mixtral_8x22b_bf16_needs_four_80gb_gpus():
  cfg = presets.load_preset("mixtral_8x22b").model
  bf16 = memory.weight_memory(cfg, memory.standard_formats()["bf16"])
  assert bf16.params == pytest.approx(141e9, rel=0.03)
  assert bf16.total == pytest.approx(280e9, rel=0.03)
  assert memory.devices_needed(bf16.total, 80) == 4


def test_seed_figures_mixtral_8x7b_int4_is_about_25gb():
  cfg = presets.load_preset("mixtral_8x7b").model
  # Attention and expert matrices at 4 bits, groups of 128 with fp16 scales; embeddings,
  # LM head, norms and router at 16 bits (AutoGPTQ / AutoAWQ Mixtral checkpoints).
  int4 = memory.weight_memory(cfg, memory.standard_formats(group_size=128)["int4"])
  assert int4.total == pytest.approx(25e9, rel=0.03)
  assert 4.1 < int4.bits_per_param < 4.3


def test_bad_formats():
  with pytest.raises(ValueError, match="cannot quantise"):
    memory.WeightFormat("x", 4, quantized=("embedding",))
  with pytest.raises(ValueError, match="group_size"):
    memory.WeightFormat("x", 4, group_size=0)
