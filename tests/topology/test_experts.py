"""Routed / shared expert FFNs: layout, hand-computed outputs, padding, init."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ConfigError, MoEConfig, RoutingConfig
from moejax.topology import experts
from tests.configs import moe_config

SETTINGS = hypothesis.settings(max_examples=25, deadline=None)


def _silu(z):
  return z / (1.0 + np.exp(-z))


def _gelu_tanh(z):
  return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z ** 3)))


@pytest.mark.parametrize("activation, shapes, count", [
    ("swiglu", {"w_gate_up": (2, 4, 6), "w_down": (2, 3, 4)}, 3 * 2 * 4 * 3),
    ("gelu", {"w_up": (2, 4, 3), "w_down": (2, 3, 4)}, 2 * 2 * 4 * 3),
])
def test_layout_and_count(activation, shapes, count):
  cfg = moe_config(num_experts=2, expert_width=3, activation=activation)
  p = experts.init_experts(jax.random.key(0), 4, cfg)
  assert {k: v.shape for k, v in p.items()} == shapes
  assert sum(a.size for a in p.values()) == count


def test_gate_up_layout_round_trip():
  """[w_gate | w_up] side by side on the last axis, and back, bit for bit."""
  g = jnp.arange(12.0).reshape(1, 3, 4)
  u = -jnp.arange(12.0).reshape(1, 3, 4)
  wd = jnp.ones((1, 4, 3))
  fused = experts.fused_layout({"w_gate": g, "w_up": u, "w_down": wd})
  assert set(fused) == {"w_gate_up", "w_down"}
  np.testing.assert_array_equal(fused["w_gate_up"][0, 1], [4, 5, 6, 7, -4, -5, -6, -7])
  back = experts.split_layout(fused)
  assert set(back) == {"w_gate", "w_up", "w_down"}
  np.testing.assert_array_equal(back["w_gate"], g)
  np.testing.assert_array_equal(back["w_up"], u)
  assert experts.fused_layout(fused).keys() == fused.keys()      # already fused: unchanged
  gelu = {"w_up": u, "w_down": wd}
  assert experts.fused_layout(gelu).keys() == experts.split_layout(gelu).keys() == gelu.keys()
  assert experts.hidden_width(fused) == 4


def test_gate_up_roles_are_two_matrices_per_expert():
  cfg = moe_config(num_experts=2, expert_width=3)
  r = experts.expert_roles(experts.init_experts(jax.random.key(0), 4, cfg))
  assert (r["w_gate_up"].reduction, r["w_gate_up"].output, r["w_gate_up"].output_blocks) == (
      (1,), (2,), 2)
  assert r["w_down"].output_blocks == 1


def test_init_dtype():
  cfg = moe_config(num_experts=2, expert_width=3)
  p = experts.init_experts(jax.random.key(0), 4, cfg, dtype=jnp.bfloat16)
  assert all(a.dtype == jnp.bfloat16 for a in p.values())


def test_expert_ffn_hand_computed_swiglu():
  # d=2, f=2. Hidden unit j: silu(x . w_gate[:, j]) * (x . w_up[:, j]).
  x = jnp.array([[1.0, 2.0]])
  p = {"w_gate_up": jnp.array([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, -1.0]]),  # [gate | up]
       "w_down": jnp.array([[1.0, 1.0], [0.0, 3.0]])}
  h = np.array([_silu(1.0) * 2.0, _silu(2.0) * -2.0])
  expected = np.array([h[0], h[0] + 3.0 * h[1]])
  out = experts.expert_ffn(p, x, "swiglu")
  np.testing.assert_allclose(out[0], expected, rtol=1e-6)
  # Masking the second hidden unit leaves only the first.
  out_m = experts.expert_ffn(p, x, "swiglu", jnp.array([1.0, 0.0]))
  np.testing.assert_allclose(out_m[0], [h[0], h[0]], rtol=1e-6)


def test_expert_ffn_hand_computed_gelu():
  x = jnp.array([[1.0, -1.0], [0.5, 0.0]])
  p = {"w_up": jnp.array([[1.0], [2.0]]), "w_down": jnp.array([[2.0, -1.0]])}
  pre = np.array([1.0 - 2.0, 0.5])
  expected = _gelu_tanh(pre)[:, None] * np.array([[2.0, -1.0]])
  np.testing.assert_allclose(experts.expert_ffn(p, x, "gelu"), expected, rtol=1e-6)


def test_unknown_activation():
  p = {"w_up": jnp.ones((2, 1)), "w_down": jnp.ones((1, 2))}
  with pytest.raises(ValueError, match="relu"):
    experts.expert_ffn(p, jnp.ones((1, 2)), "relu")


@functools.partial(jax.jit, static_argnums=(3,))
def _dense_vs_per_expert(p, x, mask, activation):
  """experts_dense and a vmap of expert_ffn over experts, on the same inputs."""
  one = lambda pe, xe, me: experts.expert_ffn(pe, xe, activation, me)
  return experts.experts_dense(p, x, activation, mask), jax.vmap(one)(p, x, mask)


@SETTINGS
@hypothesis.given(e=st.sampled_from([2, 3]), activation=st.sampled_from(["swiglu", "gelu"]),
                  seed=st.integers(0, 2 ** 16))
def test_experts_dense_equals_per_expert_ffn(e, activation, seed):
  # numpy inputs and one jit per (e, activation): each new shape costs a compile.
  rng = np.random.default_rng(seed)
  d, c, f = 4, 3, e
  p = {"w_up": rng.standard_normal((e, d, f)), "w_down": rng.standard_normal((e, f, d))}
  if activation == "swiglu":
    p["w_gate"] = rng.standard_normal((e, d, f))
  p = {k: v.astype(np.float32) for k, v in p.items()}
  x = rng.standard_normal((e, c, d)).astype(np.float32)
  cfg = moe_config(num_experts=e, expert_widths=tuple(range(1, e + 1)), routing=RoutingConfig(top_k=1))
  dense, per_expert = _dense_vs_per_expert(p, x, experts.width_mask(cfg), activation)
  np.testing.assert_allclose(dense, per_expert, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Heterogeneous widths.

def test_width_mask_hand_made():
  cfg = moe_config(num_experts=3, expert_widths=(2, 4, 3))
  np.testing.assert_array_equal(
      experts.width_mask(cfg),
      [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
  assert experts.width_mask(moe_config(num_experts=2, expert_width=3)).tolist() == [[1] * 3] * 2


def test_heterogeneous_init_zero_padded():
  cfg = moe_config(num_experts=3, expert_widths=(2, 4, 3))
  p = experts.split_layout(experts.init_experts(jax.random.key(1), 5, cfg))
  mask = np.asarray(experts.width_mask(cfg))
  for name in ("w_gate", "w_up"):
    w = np.asarray(p[name])  # [E, d, f]
    assert np.all(w[mask[:, None, :].repeat(5, 1) == 0] == 0)
    assert np.all(w[mask[:, None, :].repeat(5, 1) == 1] != 0)
  w = np.asarray(p["w_down"])  # [E, f, d]
  assert np.all(w[mask[:, :, None].repeat(5, 2) == 0] == 0)


def _truncated_expert(p, i, width):
  return {k: (v[i][:, :width] if k != "w_down" else v[i][:width]) for k, v in p.items()}


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_mask_makes_expert_exactly_its_width_even_with_garbage_padding(activation):
  widths = (2, 4, 3)
  cfg = moe_config(num_experts=3, expert_widths=widths, activation=activation)
  p = experts.split_layout(experts.init_experts(jax.random.key(2), 5, cfg))
  # Fill the padding with nonzero values: the mask must still cut it off.
  noise = jax.random.normal(jax.random.key(3), (3, 5, 4))
  garbage = {k: (v + noise if k != "w_down" else v + noise.transpose(0, 2, 1))
             for k, v in p.items()}
  x = jax.random.normal(jax.random.key(4), (3, 6, 5))
  garbage, split = experts.fused_layout(garbage), garbage
  out = experts.experts_dense(garbage, x, activation, experts.width_mask(cfg))
  for i, w in enumerate(widths):
    clean = experts.fused_layout(_truncated_expert(split, i, w))  # the real units only
    np.testing.assert_allclose(out[i], experts.expert_ffn(clean, x[i], activation),
                               rtol=1e-5, atol=1e-6)
  unmasked = experts.experts_dense(garbage, x, activation)
  assert not np.allclose(unmasked[0], out[0])  # the garbage would matter without it


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("use_mask", [False, True])
def test_padded_entries_get_zero_gradient(activation, use_mask):
  """Zero padding stays zero under gradient descent, with or without the mask."""
  cfg = moe_config(num_experts=2, expert_widths=(1, 3), activation=activation)
  p = experts.init_experts(jax.random.key(5), 4, cfg)
  x = jax.random.normal(jax.random.key(6), (2, 5, 4))
  mask = experts.width_mask(cfg) if use_mask else None
  loss = lambda q: jnp.sum(jnp.sin(experts.experts_dense(q, x, activation, mask)))
  grads = experts.split_layout(jax.grad(loss)(p))
  m = np.asarray(experts.width_mask(cfg))
  for name, g in grads.items():
    g = np.asarray(g)
    pad = (m[:, :, None] == 0) if name == "w_down" else (m[:, None, :] == 0)
    pad = np.broadcast_to(pad, g.shape)
    assert np.all(g[pad] == 0), name
    assert np.any(g[~pad] != 0), name


def test_init_scale_fan_in():
  """Truncated-normal variance scaling: std 1/sqrt(d) in, 1/sqrt(w_e) out."""
  d = 256
  cfg = moe_config(num_experts=2, expert_widths=(64, 256))
  p = experts.split_layout(experts.init_experts(jax.random.key(7), d, cfg))
  np.testing.assert_allclose(np.std(p["w_up"][1]), d ** -0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(p["w_gate"][0][:, :64]), d ** -0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(p["w_down"][0][:64]), 64 ** -0.5, rtol=0.05)
  np.testing.assert_allclose(np.std(p["w_down"][1]), 256 ** -0.5, rtol=0.05)
  assert np.max(np.abs(p["w_up"])) <= 2 * d ** -0.5 / 0.8796 + 1e-6  # truncated at 2 std


# ---------------------------------------------------------------------------
# Shared experts.

@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_shared_equals_sum_of_separate_experts(activation):
  ks, fs, d = 3, 2, 5
  cfg = moe_config(num_shared_experts=ks, shared_expert_width=fs, activation=activation)
  p = experts.init_shared(jax.random.key(8), d, cfg)
  assert p["w_up"].shape == (d, ks * fs) and p["w_down"].shape == (ks * fs, d)
  x = jax.random.normal(jax.random.key(9), (7, d))
  separate = 0.0
  for j in range(ks):
    cols = slice(j * fs, (j + 1) * fs)
    one = {k: (v[cols] if k == "w_down" else v[:, cols]) for k, v in p.items()}
    separate = separate + experts.expert_ffn(one, x, activation)
  np.testing.assert_allclose(experts.apply_shared(p, x), separate, rtol=1e-5, atol=1e-6)


def test_shared_width_defaults_to_expert_width():
  cfg = moe_config(num_shared_experts=2, expert_width=3)
  p = experts.init_shared(jax.random.key(0), 4, cfg)
  assert p["w_up"].shape == (4, 6) and experts.shared_width(cfg) == 3


def test_shared_sigmoid_gate():
  cfg = moe_config(num_shared_experts=1, shared_expert_width=2, shared_expert_gate=True,
                  activation="gelu")
  p = experts.init_shared(jax.random.key(10), 3, cfg)
  assert p["w_shared_gate"].shape == (3, 1)
  x = jax.random.normal(jax.random.key(11), (4, 3))
  ungated = experts.apply_shared({k: v for k, v in p.items() if k != "w_shared_gate"}, x)
  gate = 1.0 / (1.0 + np.exp(-(np.asarray(x) @ np.asarray(p["w_shared_gate"]))))
  np.testing.assert_allclose(experts.apply_shared(p, x), ungated * gate, rtol=1e-5, atol=1e-6)
  # Hand case: a zero gate vector gives sigmoid(0) = 1/2.
  p0 = dict(p, w_shared_gate=jnp.zeros((3, 1)))
  np.testing.assert_allclose(experts.apply_shared(p0, x), 0.5 * ungated, rtol=1e-6)


def test_init_shared_without_shared_experts_errors():
  with pytest.raises(ConfigError, match="num_shared_experts"):
    experts.init_shared(jax.random.key(0), 4, MoEConfig())
