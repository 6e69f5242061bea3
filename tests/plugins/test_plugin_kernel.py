"""A grouped-matmul kernel registered from outside the package runs the layer, by config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as layer_lib
from moejax.config import ConfigError, ExecutionConfig, plugins as plugins_lib
from moejax.execution import gmm
from moejax.execution import executor as executor_lib
from tests.configs import moe_config
from tests.plugins import loop_kernel

MODULE = "tests.plugins.loop_kernel"


def test_the_plugin_kernel_is_a_registered_backend_with_its_origin():
  assert gmm.get_backend("masked_loop") is loop_kernel.BACKEND
  assert gmm.backend_names()[: len(gmm.BACKENDS)] == gmm.BACKENDS  # shipped first
  assert "masked_loop" in gmm.backend_names()
  assert gmm.KERNELS.plugins()["masked_loop"] == MODULE
  assert ExecutionConfig(backend="masked_loop").backend == "masked_loop"
  assert ExecutionConfig(large_group_backend="masked_loop",
                         large_group_rows=8).large_group_backend == "masked_loop"


def test_gmm_and_tgmm_agree_with_ragged_dot():
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=(13, 6)), jnp.float32)
  rhs = jnp.asarray(rng.normal(size=(4, 6, 5)), jnp.float32)
  sizes = jnp.asarray([3, 0, 6, 2], jnp.int32)          # 11 rows, 2 past the groups
  for transpose in (False, True):
    w = jnp.swapaxes(rhs, 1, 2) if transpose else rhs
    got = gmm.gmm(lhs, w, sizes, backend="masked_loop", transpose_rhs=transpose)
    want = gmm.gmm(lhs, w, sizes, backend="ragged_dot", transpose_rhs=transpose)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  grad = jnp.asarray(rng.normal(size=(13, 5)), jnp.float32)
  np.testing.assert_allclose(gmm.tgmm(lhs, grad, sizes, backend="masked_loop"),
                             gmm.tgmm(lhs, grad, sizes, backend="ragged_dot"),
                             rtol=1e-5, atol=1e-5)


def test_the_layer_runs_the_plugin_kernel_and_equals_the_reference():
  cfg = moe_config(num_experts=4, expert_width=8, routing=dict(top_k=2),
                   backend="masked_loop")
  ref = moe_config(num_experts=4, expert_width=8, routing=dict(top_k=2),
                   backend="reference")
  assert executor_lib.local_executor(cfg).backend == "masked_loop"
  x = jax.random.normal(jax.random.PRNGKey(1), (10, 16))
  params = layer_lib.init_moe_params(jax.random.PRNGKey(0), 16, cfg)

  def loss(p, c):
    y, _ = layer_lib.moe_layer(p, x, None, c)
    return jnp.sum(y ** 2), y

  (l1, y1), g1 = jax.value_and_grad(loss, has_aux=True)(params, cfg)
  (l2, y2), g2 = jax.value_and_grad(loss, has_aux=True)(params, ref)
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_run_naming_the_kernel_records_its_module():
  tree = {"model": {"moe": {"execution": {"backend": "masked_loop"}}}}
  (record,) = plugins_lib.used(tree)
  assert record["module"] == MODULE and record["ideas"] == [
      {"registry": "grouped-matmul backend", "name": "masked_loop",
       "field": "model.moe.execution.backend"}]


def test_an_unknown_kernel_lists_the_plugins_too():
  with pytest.raises(ConfigError, match="masked_loop"):
    ExecutionConfig(backend="masked_lop")
  with pytest.raises(gmm.GmmError, match="did you mean 'masked_loop'"):
    gmm.get_backend("masked_lop")
