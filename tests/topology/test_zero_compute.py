"""Zero-computation experts (MoE++): zero, copy and constant outputs."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig
from moejax.topology import zero_compute
from tests.configs import moe_config


def _cfg(zero=0, copy=0, const=0):
  return moe_config(num_experts=4, zero_experts=zero, copy_experts=copy, constant_experts=const)


def test_params_layout():
  p = zero_compute.init_zero_compute(jax.random.key(0), 5, _cfg(1, 1, 3))
  assert p["w_c"].shape == (3, 5, 2) and p["v"].shape == (3, 5)
  assert zero_compute.init_zero_compute(jax.random.key(0), 5, _cfg(2, 1, 0)) == {}


def test_order_and_values_hand_made():
  cfg = _cfg(zero=1, copy=2, const=2)
  x = jnp.array([[1.0, 0.0, 2.0], [0.0, -1.0, 1.0]])
  v = jnp.array([[10.0, 20.0, 30.0], [-1.0, -2.0, -3.0]])
  # Constant expert 0: logits x W_c[0] = [ln 3 * x_0, 0]; for token 0 that is
  # softmax([ln 3, 0]) = [3/4, 1/4]; for token 1 (x_0 = 0) it is [1/2, 1/2].
  w0 = jnp.zeros((3, 2)).at[0, 0].set(jnp.log(3.0))
  # Constant expert 1: all-zero W_c -> a = [1/2, 1/2] for every token.
  w_c = jnp.stack([w0, jnp.zeros((3, 2))])
  out = zero_compute.apply_zero_compute({"w_c": w_c, "v": v}, x, cfg)
  assert out.shape == (2, 5, 3)
  np.testing.assert_array_equal(out[:, 0], 0.0)
  np.testing.assert_array_equal(out[:, 1], x)
  np.testing.assert_array_equal(out[:, 2], x)
  np.testing.assert_allclose(out[0, 3], 0.75 * x[0] + 0.25 * v[0], rtol=1e-6)
  np.testing.assert_allclose(out[1, 3], 0.5 * x[1] + 0.5 * v[0], rtol=1e-6)
  np.testing.assert_allclose(out[:, 4], 0.5 * x + 0.5 * v[1], rtol=1e-6)


def test_no_zero_compute_experts():
  out = zero_compute.apply_zero_compute({}, jnp.ones((3, 4)), _cfg())
  assert out.shape == (3, 0, 4)


def test_constant_mixing_weights_sum_to_one():
  """a1 + a2 = 1, so with v = x the constant expert returns x."""
  cfg = _cfg(const=3)
  p = zero_compute.init_zero_compute(jax.random.key(1), 6, cfg)
  x = jax.random.normal(jax.random.key(2), (1, 6))
  p = dict(p, v=jnp.broadcast_to(x, (3, 6)))
  out = zero_compute.apply_zero_compute(p, x, cfg)
  np.testing.assert_allclose(out[0], jnp.broadcast_to(x, (3, 6)), rtol=1e-5)


def test_init_scales():
  p = zero_compute.init_zero_compute(jax.random.key(3), 512, _cfg(const=4))
  np.testing.assert_allclose(np.std(p["v"]), 1.0, rtol=0.05)
  np.testing.assert_allclose(np.std(p["w_c"]), 512 ** -0.5, rtol=0.1)
