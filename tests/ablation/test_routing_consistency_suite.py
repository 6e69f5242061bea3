"""The routing_consistency suite and its per-arm columns (issue 41).

The suite loads with its seven routers at equal budget and top-k as the
baseline; a perturbation name nothing registered is refused at load, before
training; the columns list is the registry's; the analysis step turns a
model's measurement into ``flip_rate_<name>`` columns (hash routing: 0) with
the reasons of those that did not apply.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.ablation import analysis as analysis_lib
from moejax.ablation import columns
from moejax.ablation import suite as suite_lib
from moejax.config import ConfigError, ModelConfig, RoutingConfig
from moejax.model import Transformer
from moejax.serve import routing_consistency as rc
from tests.ablation import helpers
from tests.configs import moe_config

PATH = os.path.join(helpers.ROOT, "configs", "ablations", "routing_consistency.py")


def test_the_suite_loads_with_the_shipped_routers_and_top_k_as_baseline():
  suite = suite_lib.load_suite(PATH)
  assert [a.name for a in suite.arms] == ["topk", "lossfree", "grouped", "expert_choice", "sbase",
                                          "remoe", "hash"]
  assert suite.baseline == "topk" and suite.seeds == (0, 1, 2)
  kinds = {a.name: a.experiment.model.moe.routing.kind for a in suite.arms}
  assert kinds["hash"] == "hash" and kinds["expert_choice"] == "expert_choice"
  names = suite.analysis["routing_consistency"]
  assert set(names) <= set(rc.PERTURBATIONS) and {"ep1", "ep2", "ep8"} <= set(names)


def test_an_unknown_perturbation_is_refused_at_load():
  tree = suite_lib.load_suite_file(PATH)
  tree["analysis"]["routing_consistency"] = ("bf16", "fp6")
  with pytest.raises(ConfigError, match=r"suite\.analysis\.routing_consistency.*fp6.*pick from"):
    suite_lib.suite_from_dict(tree)


def test_the_columns_are_the_registered_perturbations():
  assert columns.CONSISTENCY_PERTURBATIONS == tuple(sorted(rc.PERTURBATIONS))
  for name in rc.PERTURBATIONS:
    assert f"flip_rate_{name}" in columns.VERDICT_METRICS
    assert columns.METRICS[f"flip_rate_{name}"][2] == -1   # fewer flips are better


def test_the_analysis_columns_of_a_hash_model():
  cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    dense_ff_width=64,
                    moe=moe_config(num_experts=4, expert_width=16,
                                   routing=RoutingConfig.build(kind="hash", top_k=2)))
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (4, 6), 0, 32, jnp.int32))
  got = analysis_lib.routing_consistency(model, [{"inputs": tokens[:2]}, {"inputs": tokens[2:]}],
                                         ("bf16", "int4", "hf"))
  assert got["flip_rate_bf16"] == 0.0 and got["flip_rate_int4"] == 0.0
  assert got["token_flip_share_bf16"] == 0.0 and got["consistency_tokens"] == 24
  # Not a Mixtral router (or, without the interop extra, no transformers): n/a with its reason.
  assert "flip_rate_hf" not in got and got["consistency_na"]["hf"]
  assert "margin_median" not in got   # hash routing has no scores, so no margins
