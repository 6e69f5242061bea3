"""Weight-only expert quantisation (moejax.serve.quantize): codes by hand, bounds, bytes, forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig, MoEConfig, RoutingConfig
from moejax.layer import init_moe_params, moe_layer
from moejax.model import Transformer
from moejax.serve import Decoder
from moejax.serve import quantize as q
from moejax.topology import experts as experts_lib
from tests.serve.test_decode import decode_logits
from tests.configs import moe_config

# [I=2, O=2], contraction on axis 0 (a shared expert's w_up layout).
W = jnp.asarray([[1.0, -0.5], [0.25, 2.0]], jnp.float32)


@pytest.mark.parametrize("bits,codes,scales", [
    # s = absmax / 127.5 per column; 1.0 / s = 127.5 rounds to 128 and clips to 127.
    (8, [[127, -32], [32, 127]], [1 / 127.5, 2 / 127.5]),
    # s = absmax / 7.5; 0.25 / s = 1.875 -> 2, -0.5 / s = -1.875 -> -2, 7.5 -> 7.
    (4, [[7, -2], [2, 7]], [1 / 7.5, 2 / 7.5]),
])
def test_per_channel_codes_and_scales_by_hand(bits, codes, scales):
  qa = q.quantize_array(W, q.QuantConfig(bits=bits, scale_dtype="float32"), contract_axis=0)
  np.testing.assert_array_equal(np.asarray(qa.qvalue, np.int32), codes)
  np.testing.assert_allclose(np.asarray(qa.scale).reshape(-1), scales, rtol=1e-7)
  want = np.asarray(codes, np.float64) * np.asarray(scales)[None, :]
  np.testing.assert_allclose(q.dequantize_array(qa), want, rtol=1e-6)
  assert qa.qvalue.dtype == q.BITS[bits]


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (8, 4), (4, 4)])
def test_round_trip_error_is_at_most_half_a_step(bits, group):
  w = jax.random.normal(jax.random.key(0), (3, 16, 5)) * jnp.arange(1, 6)  # [E, I, O]
  qcfg = q.QuantConfig(bits=bits, group_size=group, scale_dtype="float32")
  err = np.abs(np.asarray(q.dequantize_array(q.quantize_array(w, qcfg, 1))) - np.asarray(w))
  g = group or 16
  absmax = np.abs(np.asarray(w)).reshape(3, 16 // g, g, 5).max(axis=2, keepdims=True)
  step = absmax / ((127 if bits == 8 else 7) + 0.5)
  bound = np.broadcast_to(step / 2, (3, 16 // g, g, 5)).reshape(3, 16, 5)
  assert np.all(err <= bound * (1 + 1e-4))  # s / 2, up to float32 rounding of w / s
  assert err.max() > 0.25 * bound.max()  # the bound is not vacuous


def test_bytes_of_quantized_arrays():
  w = jnp.ones((2, 4, 3), jnp.float32)
  per_channel = q.weight_bytes({"w": q.quantize_array(w, q.QuantConfig(bits=4), 1)})
  # 24 int4 codes packed two per byte = 12 bytes; scales [2, 1, 3] float16 = 12 bytes.
  assert (per_channel["quantized_codes"], per_channel["scales"]) == (12, 12)
  grouped = q.weight_bytes({"w": q.quantize_array(w, q.QuantConfig(bits=8, group_size=2), 1)})
  assert (grouped["quantized_codes"], grouped["scales"]) == (24, 2 * 2 * 3 * 2)
  assert q.weight_bytes({"w": w})["total"] == 24 * 4


def test_bad_quant_configs():
  with pytest.raises(ConfigError, match="quant.bits=3"):
    q.QuantConfig(bits=3)
  with pytest.raises(ConfigError, match="quant.group_size=3"):
    q.quantize_array(jnp.ones((2, 4, 3)), q.QuantConfig(group_size=3), 1)


def _moe_cfg(**kw) -> MoEConfig:
  return moe_config(num_experts=4, expert_width=32, num_shared_experts=1,
                   shared_expert_gate=True, routing=RoutingConfig(top_k=2), **kw)


def test_layer_params_quantized_keep_router_and_gate_float():
  cfg = _moe_cfg()
  params = init_moe_params(jax.random.key(0), 32, cfg)
  qp = q.quantize_params(params, q.QuantConfig(bits=8))
  assert all(q.is_quantized(qp["experts"][k]) for k in ("w_gate_up", "w_down"))
  assert all(q.is_quantized(qp["shared"][k]) for k in ("w_gate", "w_up", "w_down"))
  assert not q.is_quantized(qp["shared"]["w_shared_gate"])
  assert not q.is_quantized(qp["router"]["w"])
  assert not q.is_quantized(params["experts"]["w_gate_up"])  # the input is not modified
  x = jax.random.normal(jax.random.key(1), (16, 32))
  want = moe_layer(params, x, None, cfg)[0]
  got = moe_layer(q.dequantize_params(qp), x, None, cfg)[0]
  assert float(jnp.max(jnp.abs(got - want))) < 1e-2 * float(jnp.max(jnp.abs(want)))


@pytest.mark.parametrize("group_size", [None, 16])
def test_gate_up_quantized_as_its_two_matrices(group_size):
  """Scales are per output column (and input group), so [W_gate | W_up] quantised as one
  array dequantises to exactly W_gate and W_up quantised apart."""
  qcfg = q.QuantConfig(bits=4, group_size=group_size)
  w = init_moe_params(jax.random.key(1), 32, _moe_cfg())["experts"]["w_gate_up"]
  joint = q.dequantize_array(q.quantize_array(w, qcfg, 1))
  apart = [q.dequantize_array(q.quantize_array(h, qcfg, 1))
           for h in experts_lib.split_gate_up(w)]
  np.testing.assert_array_equal(joint, experts_lib.fuse_gate_up(*apart))


@pytest.fixture(scope="module")
def models():
  cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                    dense_ff_width=64, moe_layout="all", expert_sharing_group=3,
                    moe=_moe_cfg(backend="blocked"))
  return cfg, Transformer(cfg, rngs=nnx.Rngs(0))


# RMS logit error relative to the logits' RMS. Expected scale: rounding noise of
# step / sqrt(12) per weight, step = absmax / (q_max + 1/2) ~ 2.5 sigma / 7.5 for int4 on
# Gaussian weights of fan-in 32: ~10% (int4), ~0.6% (int8).
# int4 per channel is slow-only: int4 per group and int8 per channel cover both
# code paths (bits, grouping) in the default run.
@pytest.mark.parametrize("bits,group,tol", [
    (8, None, 0.02), pytest.param(4, None, 0.15, marks=pytest.mark.slow), (4, 8, 0.15)])
def test_quantized_model_forward_close_to_float_and_decodes(models, bits, group, tol):
  cfg, float_model = models
  tokens = jax.random.randint(jax.random.key(2), (2, 10), 0, 32, jnp.int32)
  want = np.asarray(q.forward(float_model, tokens)[0])
  model = q.quantize_model(Transformer(cfg, rngs=nnx.Rngs(0)), q.QuantConfig(bits=bits, group_size=group))
  experts = model.blocks[0].ffn.params["experts"]["w_gate_up"]
  assert q.is_quantized(experts.get_value())
  # One shared set of routed experts (expert_sharing_group=3): quantised once, same object.
  assert model.blocks[2].ffn.params["experts"]["w_gate_up"] is experts
  assert not q.is_quantized(model.blocks[0].ffn.params["router"]["w"].get_value())
  got = np.asarray(q.forward(model, tokens)[0])
  rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
  assert 0 < rel < tol
  # Cached decoding of the quantised model equals its own full forward.
  dec = decode_logits(Decoder(model), np.asarray(tokens), (3, 6))
  np.testing.assert_allclose(dec, got, atol=2e-5, rtol=0)
  # Memory: routed + shared expert weights shrink to ~bits/32 of float32 (+ scales).
  ratio = (q.weight_bytes(nnx.state(model, nnx.Param))["total"]
           / q.weight_bytes(nnx.state(float_model, nnx.Param))["total"])
  assert ratio < (0.6 if bits == 8 else 0.5)
