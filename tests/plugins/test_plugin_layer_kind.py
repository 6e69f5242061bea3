"""A layer kind registered from outside the package (tests/plugins/dense_mix_kind.py).

It brings its own options (moe.layer_options), declares the aux it fills and
its own aux type, and runs as the arm of a suite beside the shipped sparse
layer: budget, training, metrics and provenance ask the kind object.
"""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as layer_lib
from moejax.ablation import runner, suite as suite_lib
from moejax.balance.aux import LayerMetrics, MoEAux
from moejax.config import ConfigError, MoEConfig, from_dict
from moejax.config.registry import LAYERS
from tests.ablation import helpers
from tests.plugins import dense_mix_kind


def _cfg(**options):
  return from_dict(MoEConfig, {"kind": "dense_mix", "topology": dict(num_experts=2, expert_width=3),
                               "layer_options": options})


def test_the_kind_is_registered_with_its_options_and_its_aux():
  kind = LAYERS.get("dense_mix")
  assert LAYERS.plugins()["dense_mix"].endswith("dense_mix_kind")
  cfg = _cfg(temperature=0.5)
  assert cfg.layer is kind and cfg.layer_options == dense_mix_kind.DenseMixOptions(0.5)
  assert MoEAux.fields_of(kind) == ("losses", "metrics", "kind_aux")
  assert LayerMetrics.fields_of(kind) == ("load", "max_vio", "load_entropy")


def test_the_layer_is_the_gated_sum_of_every_expert():
  cfg = _cfg(temperature=0.5)
  params = layer_lib.init_moe_params(jax.random.PRNGKey(0), 4, cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 3, 4))
  y, aux = layer_lib.moe_layer(params, x, None, cfg)
  xs = np.asarray(x[0], np.float64)
  w = {k: np.asarray(v, np.float64) for k, v in params["experts"].items()}
  logits = xs @ np.asarray(params["router"]["w"], np.float64) / 0.5
  gate = np.exp(logits - logits.max(-1, keepdims=True))
  gate /= gate.sum(-1, keepdims=True)
  silu = lambda v: v / (1 + np.exp(-v))
  want = sum(gate[:, e:e + 1] * ((silu(xs @ w["w_gate"][e]) * (xs @ w["w_up"][e]))
                                 @ w["w_down"][e]) for e in range(2))
  np.testing.assert_allclose(np.asarray(y[0]), want, rtol=1e-5, atol=1e-6)
  # Its own aux, typed and a pytree, beside the shared fields it declares.
  assert isinstance(aux.kind_aux, dense_mix_kind.DenseMixAux) and aux.load is None
  entropy = -(gate * np.log(gate)).sum(-1).mean() / np.log(2)
  np.testing.assert_allclose(float(aux.kind_aux.gate_entropy), entropy, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(aux.metrics.load), gate.sum(0), rtol=1e-5)


def test_its_config_errors_are_one_line():
  with pytest.raises(ConfigError, match=r"^moe.layer_options.temperature=0.0: must be > 0"):
    _cfg(temperature=0.0)
  with pytest.raises(ConfigError, match=r"^moe.topology.activation='gelu': dense_mix builds "
                                        r"SwiGLU experts\. Fix: set"):
    from_dict(MoEConfig, {"kind": "dense_mix", "topology": dict(activation="gelu")})
  with pytest.raises(ConfigError, match=r"^moe.routing.top_k=1: has no effect with "
                                        r"moe.kind='dense_mix'"):
    from_dict(MoEConfig, {"kind": "dense_mix", "routing": dict(top_k=1)})


def test_the_train_step_logs_its_scalar_aux_per_layer_and_averaged():
  from moejax.train import step  # pylint: disable=g-import-not-at-top
  own = lambda e: dense_mix_kind.DenseMixAux(gate_entropy=jnp.float32(e))
  aux = {"moe": {"layer_0": {"kind_aux": own(1.0)}, "layer_1": {"losses": {}},
                 "layer_2": {"kind_aux": own(0.5)}}}
  logged = {k: float(v) for k, v in step.kind_aux_summary(aux).items()}
  assert logged == {"kind/gate_entropy/layer_0": 1.0, "kind/gate_entropy/layer_2": 0.5,
                    "kind/gate_entropy": 0.75}
  assert step.kind_aux_summary({"moe": {"layer_0": {"losses": {}}}}) == {}


# The arm: the tiny base's routing, balancing and backend back at their defaults
# (a dense mixture reads none of them), the plugin kind with its option.
_ARM = {"model": {"moe": {
    "kind": "dense_mix", "layer_options": {"temperature": 0.5},
    "routing": {"score_fn": "softmax", "use_bias": False},
    "balance": {"bias_update": "none", "aux_loss_coef": 0.0, "aux_loss_scope": "batch",
                "z_loss_coef": 0.0},
    "execution": {"backend": "auto"}}}}


@pytest.mark.slow  # trains a two-arm suite (about 40 s on 2 cores); the layer itself: above
def test_it_runs_as_a_suite_arm(tmp_path):
  base = helpers.tiny_base(steps=2)  # configs/tiny.py: d=32, E=4 experts of width 32
  base["model"]["n_layers"] = 1
  base["train"].update(eval_every=0, checkpoint_every=0)
  tree = dict(name="dense_mix_vs_sparse", description="a plugin layer kind as an arm",
              base=base, arms={"sparse": {}, "dense_mix": _ARM},
              fixed=dict(tokens=0.0), seeds=(0,), baseline="sparse",
              analysis=dict(routing_batches=1, comm_devices=4, causal_probe=False,
                            latency_reps=1))
  suite = suite_lib.suite_from_dict(tree)
  assert suite.arm("dense_mix").experiment.model.moe.layer_options.temperature == 0.5
  work = tmp_path / "suite"
  runner.run_suite(suite, str(work), out=io.StringIO(), analyse_runs=False)
  result = json.loads((work / "dense_mix" / "result.json").read_text())
  assert result["experiment"]["model"]["moe"]["kind"] == "dense_mix"
  assert result["experiment"]["model"]["moe"]["layer_options"] == {"temperature": 0.5}
  assert [p["module"] for p in result["provenance"]["plugins"]] == [
      "tests.plugins.dense_mix_kind"]
  assert np.isfinite(result["val_loss"]) and result["max_vio_batch"] is not None
  rows = [json.loads(line) for line in (work / "dense_mix" / "metrics.jsonl").open()]
  train = [r for r in rows if r.get("split") == "train"]
  assert train and all(0.0 < r["kind/gate_entropy"] <= 1.0 for r in train)  # its own aux
  summary = json.loads((work / "summary.json").read_text())
  assert set(summary["arms"]) == {"sparse", "dense_mix"}
  # The budget is the kind's own accounting: the same parameters (E experts, a d x E gate),
  # and every token runs all 4 SwiGLU experts instead of the top 2: 2 x 3 d f more active.
  sparse = json.loads((work / "sparse" / "result.json").read_text())["budget"]
  assert result["budget"]["total"] == sparse["total"]
  assert result["budget"]["active"] - sparse["active"] == 2 * 3 * 32 * 32
