"""Soft MoE dispatch/combine weights (Puigcerver et al. 2308.00951)."""

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import MoEConfig, RoutingConfig
from moejax.routing.soft import init_soft_params, soft_weights
from tests.routing.util import PROPS
from tests.configs import moe_config


def _cfg(e=2, p=1, **router):
  return moe_config(kind="soft", num_experts=e, slots_per_expert=p,
                   routing=RoutingConfig(**router))


def test_hand_case():
  # x rows and phi columns are unit after l2norm (scaling them changes nothing);
  # logits = [[s, 0], [0, s]] with s = scale = log 3.
  x = jnp.array([[5.0, 0.0], [0.0, 0.5]])
  params = {"phi": jnp.array([[2.0, 0.0], [0.0, 7.0]]), "scale": jnp.array(math.log(3.0))}
  d, c, logits = soft_weights(params, x, _cfg(e=2, p=1))
  np.testing.assert_allclose(logits, [[math.log(3), 0], [0, math.log(3)]], rtol=1e-6, atol=1e-7)
  # Dispatch: softmax over tokens per slot; combine: softmax over slots per token.
  np.testing.assert_allclose(d, [[0.75, 0.25], [0.25, 0.75]], rtol=1e-6)
  np.testing.assert_allclose(c, [[0.75, 0.25], [0.25, 0.75]], rtol=1e-6)


def test_dispatch_and_combine_differ_on_a_non_square_case():
  # 3 tokens, 2 slots; token 2 equals token 0, so slot 0 splits over both.
  x = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
  params = {"phi": jnp.eye(2), "scale": jnp.array(math.log(2.0))}
  d, c, _ = soft_weights(params, x, _cfg(e=2, p=1))
  np.testing.assert_allclose(d[:, 0], [0.4, 0.2, 0.4], rtol=1e-6)
  np.testing.assert_allclose(c[0], [2 / 3, 1 / 3], rtol=1e-6)


@PROPS
@hypothesis.given(ep=st.sampled_from([(2, 1), (2, 3), (4, 2)]), seed=st.integers(0, 2**16),
                  scale=st.floats(0.1, 10.0), bf16=st.booleans())
def test_columns_of_dispatch_and_rows_of_combine_sum_to_one(ep, seed, scale, bf16):
  (e, p), t, d_model = ep, 5, 16
  cfg = _cfg(e=e, p=p)
  rng = np.random.default_rng(seed)
  params = {"phi": jnp.asarray(rng.normal(size=(d_model, e * p)), jnp.float32),
            "scale": jnp.array(scale, jnp.float32)}
  x = jnp.asarray(rng.normal(size=(t, d_model)), jnp.bfloat16 if bf16 else jnp.float32)
  d, c, logits = soft_weights(params, x, cfg)
  assert d.shape == c.shape == logits.shape == (t, e * p)
  assert d.dtype == c.dtype == logits.dtype == jnp.float32
  np.testing.assert_allclose(d.sum(0), 1.0, rtol=1e-5)
  np.testing.assert_allclose(c.sum(1), 1.0, rtol=1e-5)
  assert np.all(np.abs(np.asarray(logits)) <= scale * (1 + 1e-5))  # |cos| <= 1


def test_init_shapes():
  params = init_soft_params(jax.random.key(0), 16, _cfg(e=4, p=2))
  assert params["phi"].shape == (16, 8) and params["scale"].shape == ()
  assert float(params["scale"]) == 1.0


def test_freeze_stops_gradients():
  x = jax.random.normal(jax.random.key(1), (5, 8))

  def loss(params, cfg):
    d, c, _ = soft_weights(params, x, cfg)
    return jnp.sum(d * jnp.arange(5.0)[:, None]) + jnp.sum(c ** 2)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  params = init_soft_params(jax.random.key(0), 8, _cfg(e=2, p=2))
  g = grad(params, _cfg(e=2, p=2))
  assert float(jnp.abs(g["phi"]).sum()) > 0 and float(g["scale"]) != 0
  g = grad(params, _cfg(e=2, p=2, freeze=True))
  assert float(jnp.abs(g["phi"]).sum()) == 0 and float(g["scale"]) == 0


def test_bad_shapes_are_clear_errors():
  params = init_soft_params(jax.random.key(0), 8, _cfg(e=2, p=2))
  with pytest.raises(ValueError, match="phi"):
    soft_weights(params, jnp.zeros((3, 8)), _cfg(e=4, p=2))
  with pytest.raises(ValueError, match=r"x\[T, d\]"):
    soft_weights(params, jnp.zeros((1, 3, 8)), _cfg(e=2, p=2))
