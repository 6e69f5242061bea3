"""``execution.backend='auto'``, the default: the fast path unless the oracle is asked for.

``gmm.resolve_backend(name, platform)`` reads the backends' ``auto_on``
capability in ``gmm.AUTO_ORDER``; the platforms here are hand-made names,
so the GPU / TPU choices are checked on CPU.
"""

import dataclasses
import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.config.files import load_config_file, repo_root
from moejax.execution import executor as executor_lib
from moejax.execution import gmm, pallas_gpu, pallas_tpu, parallel
from moejax.train.config import ExperimentConfig, experiment_from_dict


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choice")
def test_a_default_config_runs_the_grouped_fast_path_on_cpu():
  # Before 'auto' the default was the oracle: every expert on every token.
  ex = executor_lib.local_executor(C.MoEConfig())
  assert isinstance(ex, executor_lib.LocalExecutor) and ex.backend == "blocked"
  ref = C.MoEConfig(execution=C.ExecutionConfig(backend="reference"))
  assert isinstance(executor_lib.local_executor(ref), executor_lib.ReferenceExecutor)


@pytest.mark.parametrize("platform, chosen", [
    ("cpu", "blocked"), ("gpu", "ragged_dot"), ("tpu", "ragged_dot"), ("metal", "ragged_dot")])
def test_auto_on_hand_made_platforms(platform, chosen):
  assert gmm.resolve_backend("auto", platform) == chosen


@pytest.mark.parametrize("name", ["reference", "blocked", "ragged_dot", "pallas_tpu", "pallas_gpu"])
def test_a_named_backend_is_kept_on_every_platform(name):
  assert {gmm.resolve_backend(name, p) for p in ("cpu", "gpu", "tpu")} == {name}


def test_the_choice_comes_from_the_backends_auto_on(swap_backend):
  # The day pallas_gpu is verified on a GPU, "gpu" joins its auto_on: nothing else changes.
  swap_backend(dataclasses.replace(pallas_gpu.BACKEND, auto_on=("gpu",)))
  assert gmm.resolve_backend("auto", "gpu") == "pallas_gpu"
  assert gmm.resolve_backend("auto", "tpu") == "ragged_dot"
  # On the platform JAX runs on, a backend whose availability objects is passed over
  # (pallas_gpu on this CPU: "this platform is 'cpu'").
  swap_backend(dataclasses.replace(pallas_gpu.BACKEND, name="pallas_tpu", auto_on=("cpu",)))
  assert gmm.get_backend("pallas_tpu").availability() is not None
  assert gmm.resolve_backend("auto", "cpu") == "blocked"


def test_a_bad_backend_is_one_error_naming_the_field_the_value_and_auto():
  with pytest.raises(C.ConfigError) as err:
    C.ExecutionConfig(backend="fastest")
  assert str(err.value).startswith("moe.execution.backend='fastest': unknown value. Fix: use "
                                   "one of auto, reference, ")
  with pytest.raises(C.ConfigError, match=r"backend='blockd'.*did you mean 'blocked'"):
    gmm.resolve_backend("blockd", "cpu")


def test_the_config_plane_accepts_auto_without_jax():
  code = ("import sys; from moejax.config import ExecutionConfig; "
          "assert ExecutionConfig().backend == 'auto'; assert 'jax' not in sys.modules")
  proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root(), capture_output=True,
                        text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr[-2000:]


def test_resolving_a_config_records_where_the_backend_came_from():
  moe = executor_lib.resolve_execution(C.MoEConfig(), "cpu")
  assert (moe.execution.backend, moe.execution.derived_from) == ("blocked", "auto on cpu")
  assert executor_lib.resolve_execution(moe, "gpu") is moe  # named now: kept
  exp = ExperimentConfig().for_platform("tpu")
  assert exp.model.moe.execution.backend == "ragged_dot"
  assert exp.model.moe.execution.derived_from == "auto on tpu"
  # Soft MoE and PEER read no backend (and refuse one): nothing to choose.
  for kind in ("soft", "peer"):
    other = C.MoEConfig(kind=kind)
    assert executor_lib.resolve_execution(other, "cpu") is other

@pytest.mark.parametrize("name", ["default", "default_bpe", "default_mixtral", "dense", "tiny"])
def test_shipped_experiments_run_the_same_backend_on_every_platform(name):
  # They name their backend (the committed results ran with it): 'auto' changes nothing there.
  cfg = experiment_from_dict(load_config_file(repo_root() / "configs" / f"{name}.py"))
  assert all(cfg.for_platform(p) is cfg for p in ("cpu", "gpu", "tpu"))


def test_expert_parallel_local_experts_resolve_auto_too():
  moe = C.MoEConfig()
  assert parallel.gmm_backend_for(moe, "cpu") == "blocked"
  assert parallel.gmm_backend_for(moe, "gpu") == "ragged_dot"
  ref = dataclasses.replace(moe, execution=C.ExecutionConfig(backend="reference"))
  assert parallel.gmm_backend_for(ref, "cpu") == "ragged_dot"  # the oracle is no grouped matmul


def test_the_public_layer_with_a_default_config_equals_the_oracle():
  cfg = C.MoEConfig(topology=C.TopologyConfig(num_experts=4, expert_width=6))
  ref = dataclasses.replace(cfg, execution=C.ExecutionConfig(backend="reference"))
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 8))
  y, _ = L.moe_layer(params, x, None, cfg)
  y_ref, _ = L.moe_layer(params, x, None, ref)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
