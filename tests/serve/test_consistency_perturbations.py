"""The perturbations of the routing-consistency evaluation (moejax.serve.routing_consistency).

Tiny models: hash routing flips nothing under any perturbation; quantised
experts keep the first MoE layer's routing (the router stays float and reads
the same input); the remat perturbation reads a real recomputed selection;
a hand-made near tie flips exactly the tokens its margin allows; the Hugging
Face round trip of a Mixtral-routed model. Expert-parallel degrees 2 and 8
run in a child process on 8 simulated devices (test_consistency_ep.py).
"""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ModelConfig, RoutingConfig
from moejax.model import Transformer
from moejax.serve import perturb_numeric
from moejax.serve import perturbation as P
from moejax.serve import router_margins
from moejax.serve import routing_consistency as rc
from tests.configs import moe_config

BASE = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dense_ff_width=64)
TOKENS = np.asarray(jax.random.randint(jax.random.key(0), (4, 6), 0, 32, jnp.int32))


def _model(n_layers=2, **routing):
  cfg = ModelConfig(**{**BASE, "n_layers": n_layers},
                    moe=moe_config(num_experts=4, expert_width=16,
                                   routing=RoutingConfig.build(**routing)))
  return Transformer(cfg, rngs=nnx.Rngs(0))


def test_the_registered_perturbations():
  assert sorted(rc.PERTURBATIONS) == ["bf16", "decode", "ep1", "ep2", "ep8", "hf", "int4",
                                      "int8", "microbatch4", "remat"]
  assert all(p.description for p in rc.PERTURBATIONS.values())
  with pytest.raises(ValueError, match=r"unknown perturbations \['int3'\].*Fix: use some of"):
    rc.check_names(("bf16", "int3"))


@pytest.mark.slow  # every perturbation's forward (~30 s); bf16 on hash: tests/evaluate
def test_hash_routing_flips_nothing_under_every_perturbation():
  got = rc.measure(_model(kind="hash", top_k=2), TOKENS)
  assert list(got) == sorted(rc.PERTURBATIONS)
  ran = [n for n, row in got.items() if "n/a" not in row]
  # One process, one device: ep2 / ep8 need 8 simulated devices (the child test runs them);
  # hash routing is not a linear top-k, so Mixtral cannot express it.
  assert sorted(set(got) - set(ran)) == (["ep2", "ep8", "hf"] if jax.device_count() == 1
                                         else ["hf"])
  assert "JAX_NUM_CPU_DEVICES=8" in got["ep8"]["n/a"] or jax.device_count() >= 8
  for name in ran:
    assert got[name]["flip_rate"] == 0.0 and got[name]["token_flip_share"] == 0.0, name


def test_quantised_experts_keep_the_first_layers_routing_and_remat_reads_a_selection():
  model = _model(kind="topk", top_k=2)
  got = rc.measure(model, TOKENS, ("int8", "int4", "remat"))
  for name in ("int8", "int4"):
    assert got[name]["layer_flip_rate"]["layer_0"] == 0.0, got[name]
  assert got["remat"]["flip_rate"] == 0.0
  original, recomputed = perturb_numeric._remat(model, TOKENS)
  for sel in (original, recomputed):
    # Top-2 of 4: exactly two pairs per token, so the tap carried a selection (not zeros).
    np.testing.assert_array_equal(np.asarray(sel["layer_1"].valid).sum(-1), 2)
  ref = P.reference_selections(model, TOKENS)
  np.testing.assert_array_equal(
      np.sort(np.asarray(ref["layer_1"].expert_ids), -1),
      np.argwhere(np.asarray(recomputed["layer_1"].valid))[:, -1].reshape(4, 6, 2))


def _nudge(delta):
  """A perturbation: the first layer's selection bias of expert 2 raised by ``delta``."""
  def run(model, tokens):
    other = nnx.clone(model)
    bias = other.blocks[0].ffn.router_state.bias
    bias.set_value(bias[...].at[2].add(delta))
    return P.reference_selections(other, tokens)
  return P.Perturbation(f"nudge_{delta}", run, description="test")


def test_a_hand_made_near_tie_flips_exactly_what_its_margin_allows(monkeypatch):
  model = _model(n_layers=1, kind="topk", top_k=2, score_fn="sigmoid", gating="normalized",
                 use_bias=True)
  ffn = model.blocks[0].ffn
  # Zero router weights: every score is sigmoid(0) = 0.5, so the keys are 0.5 + bias:
  # experts 0 and 1 selected, expert 2 one margin (1e-4) below expert 1, for every token.
  ffn.params["router"]["w"].set_value(jnp.zeros_like(ffn.params["router"]["w"][...]))
  ffn.router_state.bias.set_value(jnp.asarray([1.0, 0.5, 0.4999, 0.0], jnp.float32))
  margins = router_margins.margins(model, TOKENS)["layer_0"]
  np.testing.assert_allclose(margins, np.full(TOKENS.size, 1e-4), rtol=1e-3)
  small, large = _nudge(5e-5), _nudge(2e-4)
  monkeypatch.setitem(P.PERTURBATIONS, small.name, small)
  monkeypatch.setitem(P.PERTURBATIONS, large.name, large)
  got = rc.measure(model, TOKENS, (small.name, large.name, "bf16"))
  assert got[small.name]["flip_rate"] == 0.0          # below every margin
  # Above every margin: each token swaps expert 1 for 2, 2 of its 4 pairs in the two forwards.
  assert got[large.name]["flip_rate"] == 0.5 and got[large.name]["token_flip_share"] == 1.0
  assert got["bf16"]["flip_rate"] == 0.0              # the keys do not depend on x at all


def test_margins_are_not_defined_for_expert_choice():
  assert "no per-token score ranking" in router_margins.why_not(_model(kind="expert_choice"))


def test_the_hf_round_trip_of_a_mixtral_routed_model():
  pytest.importorskip("transformers")
  pytest.importorskip("torch")
  model = _model(kind="topk", top_k=2, score_fn="softmax", gating="topk_softmax")
  got = rc.measure(model, TOKENS, ("hf",))["hf"]
  assert got["flip_rate"] == 0.0 and set(got["layer_flip_rate"]) == {"layer_0", "layer_1"}


def test_the_hf_round_trip_without_transformers_says_what_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "transformers", None)
  model = _model(kind="topk", top_k=2, score_fn="softmax", gating="topk_softmax")
  why = rc.measure(model, TOKENS, ("hf",))["hf"]["n/a"]
  assert "transformers is not installed" in why and "pip install" in why
