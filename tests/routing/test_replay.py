"""Routing replay in the layer: a recorded selection, weights from the current router (R3).

Legend: B sequences, S tokens, T = B S, K slots, E experts.

* replaying a forward's own selection gives that forward bit for bit, for
  every shipped router (with capacity too: the recorded decision is taken
  before capacity, which is applied again);
* replaying another selection gives what the router gives when its scores
  are masked to that selection (the reference), the balance losses and
  loads read the replayed selection, and the gradient reaches the router
  through the recomputed weights;
* a selection of another shape, K or expert count is refused in one line.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import layer as L
from moejax.routing import topk as topk_lib
from moejax.routing.logits import router_logits
from moejax.routing.replay import RoutingReplay, apply_replay
from tests.configs import moe_config
from tests.test_layer import naive

D, B, S = 8, 2, 4
layer = jax.jit(L.moe_layer, static_argnames=("cfg", "train", "axis_names"))

CASES = {
    "mixtral": dict(routing=dict(top_k=2, gating="topk_softmax"),
                    balance=dict(aux_loss_coef=0.01, z_loss_coef=1e-3)),
    "switch_capacity": dict(routing=dict(top_k=1, gating="scores"), capacity_factor=0.75),
    "deepseek_v3": dict(num_experts=8, routing=dict(top_k=2, score_fn="sigmoid", use_bias=True,
                                                   n_groups=4, topk_groups=2,
                                                   routed_scaling_factor=2.5)),
    "expert_choice": dict(routing=dict(kind="expert_choice", capacity=2.0)),
    "hash": dict(routing=dict(kind="hash", top_k=2)),
    "top_p": dict(routing=dict(kind="top_p", top_k=3, top_p=0.5)),
    "hierarchical": dict(num_experts=8, routing=dict(kind="hierarchical", n_families=2,
                                                    top_k_families=1, top_k=2)),
    "remoe": dict(routing=dict(kind="remoe", top_k=2),
                  balance=dict(extra_losses=(("remoe_l1", 1.0),))),
}


def _cfg(name):
  return moe_config(**{"num_experts": 4, "expert_width": 6, **CASES[name]})


def _inputs(cfg, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  params = L.init_moe_params(k[0], D, cfg)
  # A router scale that spreads the scores, so a replayed selection is not a tie.
  params["router"] = jax.tree.map(lambda w: w * 30.0, params["router"])
  x = jax.random.normal(k[1], (B, S, D), jnp.float32)
  ids = jax.random.randint(k[2], (B, S), 0, 50)
  state = L.init_router_state(cfg)
  if cfg.routing.use_bias:
    state = state.replace(bias=jnp.linspace(-0.1, 0.1, cfg.num_routed))
  return params, x, ids, state


@pytest.mark.parametrize("name", sorted(CASES))
def test_replaying_a_forward_s_own_selection_is_that_forward(name):
  cfg = _cfg(name)
  params, x, ids, state = _inputs(cfg)
  y, aux = layer(params, x, state, cfg, token_ids=ids)
  y2, aux2 = layer(params, x, state, cfg, token_ids=ids, replay=aux.selection.reshape(B, S))
  np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
  for field in ("losses", "router_load", "num_dropped", "routing", "selection"):
    jax.tree.map(np.testing.assert_array_equal, getattr(aux2, field), getattr(aux, field))


def _lowest(cfg, params, x):
  """RoutingReplay [T, K]: each token's K *lowest*-scored experts (the router's last choice)."""
  logits = router_logits(params["router"]["w"], x.reshape(-1, D), cfg.routing, None, False)
  ids = jnp.argsort(logits, axis=-1)[:, :cfg.routing.top_k].astype(jnp.int32)
  return RoutingReplay(ids, jnp.ones(ids.shape, bool)), logits


def test_another_selection_equals_the_router_on_scores_masked_to_it():
  cfg = _cfg("mixtral")
  params, x, ids, state = _inputs(cfg)
  sel, logits = _lowest(cfg, params, x)
  chosen = jnp.sum(jax.nn.one_hot(sel.expert_ids, 4), axis=1) > 0      # [T, E]
  # The reference: the router's own decision when only the recorded experts can win.
  ref = topk_lib.select_topk(jnp.where(chosen, logits, -1e30), None, cfg)
  replayed = apply_replay(topk_lib.select_topk(logits, None, cfg), sel, cfg)
  own = topk_lib.select_topk(logits, None, cfg)
  assert not np.array_equal(np.sort(own.expert_ids, -1), np.sort(sel.expert_ids, -1))
  np.testing.assert_array_equal(replayed.expert_ids, sel.expert_ids)
  np.testing.assert_allclose(np.asarray(replayed.combine_weights()),
                             np.asarray(ref.combine_weights()), rtol=1e-6, atol=1e-7)
  # Scores stay this forward's: the balance losses read the router's own probabilities.
  np.testing.assert_array_equal(replayed.probs, own.probs)
  y, aux = layer(params, x, state, cfg, replay=sel.reshape(B, S))
  # The layer's output is the experts of the replayed selection, gated as the reference.
  want = naive(params, x.reshape(-1, D), ref, cfg)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-5, atol=1e-6)
  # Loads (the bias controller's input) count the replayed selection.
  counts = np.bincount(np.asarray(sel.expert_ids).reshape(-1), minlength=4)
  np.testing.assert_array_equal(np.asarray(aux.router_load), counts)


def test_gradient_reaches_the_router_through_the_recomputed_weights_only():
  cfg = _cfg("mixtral")
  params, x, ids, state = _inputs(cfg)
  sel, _ = _lowest(cfg, params, x)

  def loss(p):
    y, aux = L.moe_layer(p, x, state, cfg, train=True, replay=sel.reshape(B, S))
    return jnp.sum(y ** 2), aux

  (_, aux), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  np.testing.assert_array_equal(np.asarray(aux.selection.expert_ids), np.asarray(sel.expert_ids))
  gw = np.asarray(g["router"]["w"])
  assert np.all(np.isfinite(gw)) and np.abs(gw).max() > 0


@pytest.mark.parametrize("bad, msg", [
    (lambda s: RoutingReplay(s.expert_ids[:, :1], s.valid[:, :1]), r"replay.expert_ids has shape \(8, 1\).*K=2"),
    (lambda s: RoutingReplay(s.expert_ids[:4], s.valid[:4]), r"replay.expert_ids has shape \(4, 2\)"),
    (lambda s: RoutingReplay(s.expert_ids + 4, s.valid), r"span \[4, 7\].*4 router outputs"),
    (lambda s: RoutingReplay(s.expert_ids.astype(jnp.float32), s.valid), r"dtype float32"),
])
def test_a_selection_that_does_not_fit_is_refused_in_one_line(bad, msg):
  cfg = _cfg("mixtral")
  params, x, _, state = _inputs(cfg)
  sel, _ = _lowest(cfg, params, x)
  with pytest.raises(ValueError, match=msg) as err:
    L.moe_layer(params, x.reshape(-1, D), state, cfg, replay=bad(sel))
  assert "\n" not in str(err.value) and "Fix:" in str(err.value)


def test_a_layer_without_routing_refuses_a_replay():
  cfg = moe_config("soft", num_experts=4, expert_width=6, slots_per_expert=1)
  params = L.init_moe_params(jax.random.PRNGKey(0), D, cfg)
  x = jnp.ones((1, 4, D))
  sel = RoutingReplay(jnp.zeros((1, 4, 2), jnp.int32), jnp.ones((1, 4, 2), bool))
  with pytest.raises(ValueError, match="moe.kind='soft'.*no token routing"):
    L.moe_layer(params, x, None, cfg, replay=sel)
