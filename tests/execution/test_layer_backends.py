"""The MoE layer with an execution backend equals the reference layer.

Outputs and gradients (params and x), for every router kind, zero-computation
and shared experts, heterogeneous widths, capacity dropping and GELU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.configs import moe_config
from moejax import config as C
from moejax import layer as L

D = 8

CASES = {
    "mixtral": dict(routing=dict(top_k=2, gating="topk_softmax")),
    "switch_capacity": dict(routing=dict(top_k=1, gating="scores"), capacity_factor=0.75),
    "deepseek_v3": dict(num_experts=8, num_shared_experts=1,
                        routing=dict(top_k=2, score_fn="sigmoid", use_bias=True, n_groups=4,
                                    topk_groups=2, routed_scaling_factor=2.5)),
    "expert_choice": dict(routing=dict(kind="expert_choice", capacity=2.0)),
    "hash": dict(routing=dict(kind="hash", top_k=1)),
    "top_p_zero_compute": dict(zero_experts=1, copy_experts=1, constant_experts=1,
                               routing=dict(kind="top_p", top_k=3, top_p=0.5)),
    "hierarchical": dict(num_experts=8, routing=dict(kind="hierarchical", n_families=2,
                                                    top_k_families=1, top_k=2)),
    "gelu_heterogeneous": dict(activation="gelu", expert_widths=(2, 6, 4, 6)),
}


def make(backend, **kw):
  base = dict(num_experts=4, expert_width=6, backend=backend)
  base.update(kw)
  return moe_config(**base)


def _layer_and_grads(cfg):
  @jax.jit
  def run(params, x, ids):
    def loss(p, x):
      y, aux = L.moe_layer(p, x, None, cfg, token_ids=ids)
      return jnp.sum(jnp.sin(y)) + aux.losses["total"], y
    (_, y), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    return y, grads
  return run


@pytest.mark.parametrize("name", sorted(CASES))
def test_blocked_layer_equals_reference_layer(name):
  ref_cfg = make("reference", **CASES[name])
  params = L.init_moe_params(jax.random.PRNGKey(0), D, ref_cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, D))
  ids = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, 256)
  y0, g0 = _layer_and_grads(ref_cfg)(params, x, ids)
  y1, g1 = _layer_and_grads(make("blocked", **CASES[name]))(params, x, ids)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("name", ["mixtral", "top_p_zero_compute", "gelu_heterogeneous",
                                  "switch_capacity"])
def test_whole_group_layer_equals_reference_layer(name):
  ref_cfg = make("reference", **CASES[name])
  params = L.init_moe_params(jax.random.PRNGKey(0), D, ref_cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, D))
  ids = jax.random.randint(jax.random.PRNGKey(2), (2, 9), 0, 256)
  y0, g0 = _layer_and_grads(ref_cfg)(params, x, ids)
  y1, g1 = _layer_and_grads(make("whole_group", **CASES[name]))(params, x, ids)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=str(path))


def test_ragged_dot_layer_equals_reference_layer():
  case = CASES["deepseek_v3"]
  params = L.init_moe_params(jax.random.PRNGKey(0), D, make("reference", **case))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, D))
  ids = jnp.zeros((2, 9), jnp.int32)
  y0, g0 = _layer_and_grads(make("reference", **case))(params, x, ids)
  y1, g1 = _layer_and_grads(make("ragged_dot", **case))(params, x, ids)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_layer_in_interpret_mode_equals_reference_layer(backend):
  # The layer reaches the Pallas kernels through moe.execution.interpret on CPU.
  case = CASES["mixtral"]
  params = L.init_moe_params(jax.random.PRNGKey(0), D, make("reference", **case))
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 6, D))
  ids = jnp.zeros((1, 6), jnp.int32)
  y0, g0 = _layer_and_grads(make("reference", **case))(params, x, ids)
  y1, g1 = _layer_and_grads(make(backend, interpret=True, **case))(params, x, ids)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
