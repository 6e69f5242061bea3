"""A single-device executor registered from outside the package, chosen by config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as layer_lib
from moejax.config import ConfigError, ExecutionConfig, ParallelConfig, plugins as plugins_lib
from moejax.config import registry as config_registry
from moejax.execution import executor as executor_lib
from moejax.execution import registry
from tests.configs import moe_config
from tests.plugins import dense_executor

MODULE = "tests.plugins.dense_executor"


def _cfg(**execution):
  return moe_config(num_experts=4, expert_width=8, routing=dict(top_k=2),
                    execution=execution)


def test_the_executors_are_one_registry_with_two_sides():
  assert registry.EXECUTORS.get("all_dense") is dense_executor.AllDenseExecutor
  assert {"grouped", "reference", "all_dense"} <= set(config_registry.executor_names(False))
  assert {"token", "copy", "node"} == set(config_registry.executor_names(True))
  assert registry.EXECUTORS.plugins()["all_dense"] == MODULE
  assert type(executor_lib.local_executor(_cfg(executor="all_dense"))).name == "all_dense"
  assert isinstance(executor_lib.local_executor(_cfg(executor="reference")),
                    executor_lib.ReferenceExecutor)
  assert isinstance(executor_lib.local_executor(_cfg(backend="reference")),
                    executor_lib.ReferenceExecutor)
  assert isinstance(executor_lib.local_executor(_cfg(backend="blocked")),
                    executor_lib.LocalExecutor)


def test_each_field_takes_its_own_side_only():
  with pytest.raises(ConfigError, match=r"moe\.execution\.executor='token': is not a "
                                        r"single-device executor.*all_dense"):
    ExecutionConfig(executor="token")
  with pytest.raises(ConfigError, match=r"parallel\.dispatch_unit='all_dense': is not an "
                                        r"expert-parallel executor.*token"):
    ParallelConfig(dispatch_unit="all_dense")
  with pytest.raises(ConfigError, match=r"no single-device executor of that name.*"
                                        r"'all_dense'\?.*register_executor"):
    ExecutionConfig(executor="all_dens")
  with pytest.raises(registry.RegistryError, match="expert_parallel = False"):
    registry.register_executor(type("Half", (), {"name": "half"}))


def test_the_layer_runs_the_plugin_executor_equal_to_the_reference():
  x = jax.random.normal(jax.random.PRNGKey(1), (10, 16))
  params = layer_lib.init_moe_params(jax.random.PRNGKey(0), 16, _cfg())

  def loss(p, c):
    y, _ = layer_lib.moe_layer(p, x, None, c)
    return jnp.sum(y ** 2), y

  (_, y1), g1 = jax.value_and_grad(loss, has_aux=True)(params, _cfg(executor="all_dense"))
  (_, y2), g2 = jax.value_and_grad(loss, has_aux=True)(params, _cfg(executor="reference"))
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_run_naming_the_executor_records_its_module():
  tree = {"model": {"moe": {"execution": {"executor": "all_dense"}}}}
  (record,) = plugins_lib.used(tree)
  assert record["module"] == MODULE and record["ideas"] == [
      {"registry": "executor", "name": "all_dense", "field": "model.moe.execution.executor"}]


def test_under_expert_parallelism_the_dispatch_unit_chooses():
  from tests.train import helpers  # pylint: disable=g-import-not-at-top
  with pytest.raises(ConfigError, match=r"model\.moe\.execution\.executor='all_dense': is a "
                                        r"single-device executor; with parallel\.expert=2"):
    helpers.experiment("tiny", model__moe__execution__executor="all_dense",
                       parallel__expert=2)
