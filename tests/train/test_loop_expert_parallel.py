"""Expert parallelism in the trainer: parallel.expert=2 on 4 simulated devices logs the 1-device run.

The device count must be set before JAX initialises, which this pytest
process has already done with one device, so the expert-parallel run is this
module run as a script (``python -m tests.train.test_loop_expert_parallel
DATA_DIR WORKDIR OUT_JSON``) with JAX_NUM_CPU_DEVICES=4: a ('data', 'fsdp',
'expert') = (2, 1, 2) mesh, the tiny config's 4 experts 2 per device,
dropless capacity dispatch (ep_moe_layer's default; no token is dropped). The
runs have one MoE multi-token prediction block, expert-parallel like a main layer.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax.config import ConfigError
from moejax.train import checkpoint as ckpt_lib
from moejax.train import loop, metrics_log
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

STEPS = 4
DEVICES = 4
MTP = dict(model__mtp_depth=1, model__mtp_ffn="moe")


def _config(data_dir: str, **overrides):
  return helpers.experiment("tiny", data_dir, train__steps=STEPS, train__warmup_steps=1,
                            train__log_every=1, train__eval_every=0, train__checkpoint_every=0,
                            **overrides)


def _router_biases(cfg, workdir: str) -> dict[str, list[float]]:
  """{'<layer>': bias} of the run's final checkpoint."""
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train))
  ckpt = ckpt_lib.Checkpointer(workdir, cfg.train.keep_checkpoints, read_only=True)
  try:
    tree, _ = ckpt.restore(STEPS, abstract.checkpoint_tree())
  finally:
    ckpt.close()
  rs = tree["router_state"]
  blocks = {str(i): rs["blocks"][i] for i in range(cfg.model.n_layers)}
  blocks.update({f"mtp_{k + 1}": rs["mtp"][k]["block"] for k in range(cfg.model.mtp_depth)})
  return {name: np.asarray(b["ffn"]["router_state"]["bias"], np.float64).tolist()
          for name, b in blocks.items()}


def _child(data_dir: str, workdir: str, out_json: str) -> None:
  """The expert-parallel run, with checks that it really is one."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from moejax import data as data_lib  # pylint: disable=g-import-not-at-top
  assert jax.device_count() == DEVICES, jax.devices()
  cfg = _config(data_dir, parallel__expert=2, **MTP)
  layout = loop.device_layout(cfg)
  mesh = layout.expert_parallel.mesh
  assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 2}, mesh.shape
  tx = make_optimizer(cfg.train)
  graphdef, state = step_lib.init_state(cfg, tx, layout.expert_parallel)
  state = layout.put_state(state)
  for tree in (state.params, state.opt_state):  # weights and their Adam moments alike
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
      where = jax.tree_util.keystr(path)
      want = P()
      if "['experts']" in where:  # E over 'expert', d over 'fsdp' (size 1 here)
        want = P("expert", None, "fsdp") if "w_down" in where else P("expert", "fsdp", None)
      assert leaf.sharding.spec == want, (where, leaf.sharding)
  batch = layout.put_batch(next(data_lib.make_batches(cfg.data, cfg.data.train_split)))
  hlo = step_lib.make_train_step(graphdef, cfg, tx).lower(state, batch).as_text()
  assert "all_to_all" in hlo, "the step has no all_to_all: the MoE layers are not expert-parallel"
  loop.train(cfg, workdir, out=io.StringIO())
  with open(out_json, "w", encoding="utf-8") as f:
    json.dump({"bias": _router_biases(cfg, workdir)}, f)


@pytest.mark.slow  # ~40 s on 2 cores: two tiny runs, one in a 4-device subprocess
def test_expert_parallel_matches_one_device(tmp_path, data_dir, compilation_cache):
  one, ep, out_json = (str(tmp_path / n) for n in ("one", "ep", "ep.json"))
  cfg = _config(data_dir, **MTP)
  assert jax.device_count() == 1
  loop.train(cfg, one, out=io.StringIO())
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(DEVICES),
             **compilation_cache)
  env.pop("XLA_FLAGS", None)  # a forced host device count would override the 4 devices
  done = subprocess.run([sys.executable, "-m", "tests.train.test_loop_expert_parallel",
                         data_dir, ep, out_json], cwd=helpers.ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

  want = {r["step"]: r for r in metrics_log.read_metrics(one, "train")}
  got = {r["step"]: r for r in metrics_log.read_metrics(ep, "train")}
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  for step in want:
    for key in ("loss", "ce", "aux_loss", "max_vio_batch", "drop_rate", "grad_norm",
                "mtp/loss", "max_vio_batch/mtp_1"):
      # Same global batch and routing; other reduction order: equal up to rounding.
      np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-4, atol=1e-6,
                                 err_msg=f"step {step} {key}")
    assert got[step]["drop_rate"] == 0.0  # dropless: nothing for the transport to lose
  val_one, val_ep = (metrics_log.read_metrics(d, "eval")[-1] for d in (one, ep))
  np.testing.assert_allclose(val_ep["loss"], val_one["loss"], rtol=1e-4)

  with open(out_json, encoding="utf-8") as f:
    bias_ep = json.load(f)["bias"]
  bias_one = _router_biases(cfg, one)
  unit = cfg.model.moe.balance.bias_rate
  for layer, bias in bias_one.items():
    # Sign updates: multiples of the rate, moved by global loads on both sides.
    assert np.any(np.abs(bias) >= unit / 2), f"layer {layer}: the controller never moved"
    np.testing.assert_allclose(bias_ep[layer], bias, rtol=0, atol=unit * 1e-3,
                               err_msg=f"router bias, layer {layer}")


@pytest.mark.parametrize("overrides, field, fix", [
    (dict(parallel__expert=3), "parallel.expert", "does not divide moe.topology.num_experts=4"),
    (dict(parallel__fsdp=2), "parallel.fsdp", "set parallel.expert > 1"),
    (dict(parallel__expert=2, model__moe=None), "parallel.expert", "no MoE layer"),
])
def test_bad_layout_is_a_config_error(data_dir, overrides, field, fix):
  with pytest.raises(ConfigError, match=field) as err:
    _config(data_dir, **overrides)
  assert fix in str(err.value)


def test_too_few_devices_fails_before_any_write(tmp_path, data_dir):
  # parallel.expert=2 on this process's single device: refused before the
  # workdir is created or anything is initialised or compiled.
  workdir = str(tmp_path / "run")
  cfg = _config(data_dir, parallel__expert=2)
  with pytest.raises(ConfigError, match="parallel.expert") as err:
    loop.train(cfg, workdir, out=io.StringIO())
  assert "does not divide the 1 devices" in str(err.value)
  assert not os.path.exists(workdir)


if __name__ == "__main__":
  _child(*sys.argv[1:4])
