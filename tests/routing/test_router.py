"""route() and init_router_params(): dispatch, noise, freezing, precision, errors,
zero-computation experts."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import config as C
from moejax.routing.expert_choice import select_expert_choice
from moejax.routing.hierarchical import select_hierarchical
from moejax.routing import ROUTERS
from moejax.routing.router import init_router_params, route
from moejax.routing.top_p import select_top_p
from moejax.routing.topk import select_topk
from moejax.routing.types import RouterState
from tests.routing.util import PROPS, identity_route_inputs, log_rows, make_cfg, random_logits
from tests.configs import moe_config


def test_every_registered_kind_is_a_spec_with_a_route():
  from moejax.routing import RouterSpec
  assert {"topk", "expert_choice", "hash", "top_p", "hierarchical"} <= set(ROUTERS)
  for name in ROUTERS:
    spec = ROUTERS.get(name)
    assert isinstance(spec, RouterSpec) and spec.name == name
    assert type(spec).route is not RouterSpec.route, name


@pytest.mark.parametrize("kw,shapes", [
    (dict(), {"w": (32, 8)}),
    (dict(zero_experts=2, copy_experts=1, top_k=2), {"w": (32, 11)}),
    (dict(kind="hierarchical", n_families=4, top_k_families=2), {"w": (32, 8),
                                                                 "w_family": (32, 4)}),
    (dict(kind="hash"), {}),
])
def test_init_shapes(kw, shapes):
  params = init_router_params(jax.random.key(0), 32, make_cfg(num_experts=8, **kw))
  assert {k: v.shape for k, v in params.items()} == shapes
  assert all(v.dtype == jnp.float32 for v in params.values())


def test_init_scale_is_switch_truncated_normal():
  w = init_router_params(jax.random.key(0), 256, make_cfg(num_experts=64))["w"]
  std = float(jnp.std(w))
  assert abs(std - np.sqrt(0.1 / 256)) < 0.05 * np.sqrt(0.1 / 256)
  assert float(jnp.abs(w).max()) <= 2 * np.sqrt(0.1 / 256) / 0.8796 + 1e-6  # truncated at 2 sigma


LOGITS = random_logits(0, 5, 8)


@pytest.mark.parametrize("kw,select", [
    (dict(top_k=2, score_fn="sigmoid", n_groups=4, topk_groups=2),
     lambda l, c: select_topk(l, None, c)),
    (dict(kind="expert_choice"), select_expert_choice),
    (dict(kind="top_p", top_k=3), lambda l, c: select_top_p(l, None, c)),
])
def test_route_dispatches_on_kind(kw, select):
  cfg = make_cfg(num_experts=8, **kw)
  x, w = identity_route_inputs(LOGITS)
  got = route({"w": w}, x, None, cfg)
  want = select(LOGITS, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)


def test_route_hierarchical_dispatch():
  cfg = make_cfg(num_experts=8, kind="hierarchical", n_families=2, top_k_families=1)
  fam = random_logits(1, 5, 2)
  x, w = identity_route_inputs(LOGITS)
  got = route({"w": w, "w_family": fam}, x, None, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got,
               select_hierarchical(fam, LOGITS, cfg))


def test_route_reads_bias_from_state():
  cfg = make_cfg(num_experts=4, top_k=1, gating="scores", use_bias=True)
  probs = [[0.1, 0.4, 0.3, 0.2]]
  x, w = identity_route_inputs(log_rows(probs))
  state = RouterState(bias=jnp.array([0.0, 0.0, 0.0, 1.0]), step=jnp.zeros((), jnp.int32))
  r = route({"w": w}, x, state, cfg)
  np.testing.assert_array_equal(r.expert_ids, [[3]])
  np.testing.assert_allclose(r.weights, [[0.2]], rtol=1e-6)


def test_jit_matches_eager():
  cfg = make_cfg(num_experts=8, top_k=2, score_fn="sigmoid", use_bias=True, n_groups=2,
                 topk_groups=1)
  params = init_router_params(jax.random.key(0), 16, cfg)
  x = jax.random.normal(jax.random.key(1), (6, 16))
  state = RouterState(bias=jnp.linspace(-0.1, 0.1, 8), step=jnp.zeros((), jnp.int32))
  eager = route(params, x, state, cfg)
  jitted = jax.jit(route, static_argnames=("cfg", "train"))(params, x, state, cfg=cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), eager, jitted)


# ---------------------------------------------------------------------------
# Zero-computation experts (MoE++): extra router columns, ids >= num_experts.

def test_tokens_pick_zero_computation_experts():
  cfg = make_cfg(num_experts=4, zero_experts=1, copy_experts=1, top_k=2, gating="scores")
  assert cfg.num_routed == 6
  probs = [[0.05, 0.05, 0.1, 0.1, 0.5, 0.2],   # zero expert (4) first
           [0.4, 0.05, 0.05, 0.05, 0.05, 0.4],  # FFN expert 0 and copy expert 5
           [0.3, 0.25, 0.2, 0.15, 0.05, 0.05]]  # FFN experts only
  x, w = identity_route_inputs(log_rows(probs))
  r = route({"w": w}, x, None, cfg)
  np.testing.assert_array_equal(r.expert_ids, [[4, 5], [0, 5], [0, 1]])
  np.testing.assert_allclose(r.weights, [[0.5, 0.2], [0.4, 0.4], [0.3, 0.25]], rtol=1e-6)
  assert r.probs.shape == (3, 6)
  # Top-p over the same columns: token 0 stops at the zero expert (0.5 >= 0.5).
  rp = route({"w": w}, x, None, make_cfg(num_experts=4, zero_experts=1, copy_experts=1,
                                          kind="top_p", top_k=3, top_p=0.5))
  np.testing.assert_array_equal(rp.valid[0], [True, False, False])
  np.testing.assert_array_equal(rp.expert_ids[0], [4, 0, 0])


@PROPS
@hypothesis.given(kind=st.sampled_from(["topk", "top_p"]), k=st.sampled_from([1, 2, 6]),
                  seed=st.integers(0, 2**16))
def test_zero_computation_ids_in_range(kind, k, seed):
  cfg = make_cfg(num_experts=4, zero_experts=1, copy_experts=1, kind=kind, top_k=k)
  logits = random_logits(seed, 6, 6)
  r = (select_topk if kind == "topk" else select_top_p)(logits, None, cfg)
  ids = np.asarray(r.expert_ids)[np.asarray(r.valid)]
  assert ids.min() >= 0 and ids.max() < 6
  # Every column is selectable: the best-scoring column is always slot 0.
  np.testing.assert_array_equal(r.expert_ids[:, 0], np.argmax(np.asarray(logits), -1))


# ---------------------------------------------------------------------------
# Training noise.

def _identity_router(e, **kw):
  cfg = make_cfg(num_experts=e, top_k=1, **kw)
  return cfg, {"w": jnp.eye(e)}


def test_input_jitter_only_in_training():
  cfg, params = _identity_router(8, input_jitter=0.1)
  x = jax.random.normal(jax.random.key(0), (64, 8)) + 3.0  # away from 0 for the ratio
  clean = route(params, x, None, cfg)
  np.testing.assert_allclose(clean.logits, x, rtol=1e-6)
  # No noise at eval, even with a key.
  evald = route(params, x, None, cfg, rng=jax.random.key(1), train=False)
  np.testing.assert_array_equal(evald.logits, clean.logits)
  noisy = route(params, x, None, cfg, rng=jax.random.key(1), train=True)
  ratio = np.asarray(noisy.logits / x)  # w = I, so logits = x * u, u ~ U[0.9, 1.1]
  assert ratio.min() >= 0.9 - 1e-5 and ratio.max() <= 1.1 + 1e-5
  assert ratio.std() > 0.03  # uniform on [0.9, 1.1] has std 0.058
  with pytest.raises(ValueError, match="input_jitter"):
    route(params, x, None, cfg, train=True)


def test_logit_noise_only_in_training():
  cfg, params = _identity_router(8, logit_noise=0.5)
  x = jax.random.normal(jax.random.key(0), (128, 8))
  clean = route(params, x, None, cfg)
  np.testing.assert_array_equal(route(params, x, None, cfg, rng=jax.random.key(1)).logits,
                                clean.logits)
  a = route(params, x, None, cfg, rng=jax.random.key(1), train=True)
  b = route(params, x, None, cfg, rng=jax.random.key(2), train=True)
  noise = np.asarray(a.logits - clean.logits)
  assert abs(noise.std() - 0.5) < 0.05 and abs(noise.mean()) < 0.05
  assert not np.array_equal(a.logits, b.logits)
  with pytest.raises(ValueError, match="logit_noise"):
    route(params, x, None, cfg, train=True)


# ---------------------------------------------------------------------------
# Freezing and precision.

@pytest.mark.parametrize("kw", [
    dict(top_k=2),
    dict(kind="hierarchical", n_families=2, top_k_families=1, top_k=2),
])
def test_freeze_zeroes_router_weight_gradients(kw):
  x = jax.random.normal(jax.random.key(0), (6, 16))

  def loss(params, x, cfg):
    r = route(params, x, None, cfg)
    return jnp.sum(r.weights * jnp.arange(1.0, r.k + 1)) + jnp.sum(r.probs ** 2)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  cfg = make_cfg(num_experts=8, **kw)
  params = init_router_params(jax.random.key(1), 16, cfg)
  g_params, _ = grad(params, x, cfg)
  assert all(float(jnp.abs(g).sum()) > 0 for g in g_params.values())
  frozen = make_cfg(num_experts=8, freeze=True, **kw)
  g_params, g_x = grad(params, x, frozen)
  assert all(float(jnp.abs(g).sum()) == 0 for g in g_params.values())
  assert float(jnp.abs(g_x).sum()) > 0  # the gate still trains the input


def test_bf16_input_gets_float32_router_math():
  cfg = make_cfg(num_experts=8, top_k=2)
  params = init_router_params(jax.random.key(0), 64, cfg)
  x = jax.random.normal(jax.random.key(1), (16, 64), jnp.bfloat16)
  r = route(params, x, None, cfg)
  assert r.logits.dtype == r.probs.dtype == r.weights.dtype == jnp.float32
  want = np.asarray(x, np.float64) @ np.asarray(params["w"], np.float64)
  np.testing.assert_allclose(r.logits, want, rtol=1e-5, atol=1e-6)
  # A bf16 router rounds its logits to bf16: visibly different.
  r16 = route(params, x, None, make_cfg(num_experts=8, top_k=2, router_dtype="bfloat16"))
  l16 = np.asarray(r16.logits)
  np.testing.assert_array_equal(l16, np.asarray(jnp.asarray(l16).astype(jnp.bfloat16),
                                                np.float32))
  assert np.abs(l16 - want).max() > 1e-5


# ---------------------------------------------------------------------------
# Bad input.

def test_clear_errors():
  cfg = make_cfg(num_experts=8, top_k=2)
  params = init_router_params(jax.random.key(0), 16, cfg)
  with pytest.raises(ValueError, match=r"x\[T, d\]"):
    route(params, jnp.zeros((2, 3, 16)), None, cfg)
  with pytest.raises(ValueError, match=r"params\['w'\]"):
    route(params, jnp.zeros((3, 8)), None, cfg)
  biased = make_cfg(num_experts=8, top_k=2, use_bias=True)
  with pytest.raises(ValueError, match="RouterState"):
    route(params, jnp.zeros((3, 16)), None, biased)
  with pytest.raises(ValueError, match=r"\(8,\)"):
    route(params, jnp.zeros((3, 16)), RouterState.zeros(4), biased)
  with pytest.raises(ValueError, match="soft_weights"):
    route(params, jnp.zeros((3, 16)), None, moe_config(kind="soft"))
  with pytest.raises(ValueError, match="w_family"):
    route(params, jnp.zeros((3, 16)), None,
          make_cfg(num_experts=8, kind="hierarchical", n_families=2))
