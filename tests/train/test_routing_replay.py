"""Routing record and replay through the model, a recording file and the train step (issue 41).

* a forward's selections, written to a recording and read back, replay that
  forward bit for bit;
* a train step on a replayed selection the router would not make routes by
  exactly that selection, its loads (the bias controller's input) count it,
  and the router's gradient is non-zero (it flows through the recomputed
  weights);
* a recording of another model, or a replay missing a layer, is refused in
  one line.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import routing_record as record_lib
from moejax.nn.losses import masked_cross_entropy
from moejax.routing.replay import RoutingReplay
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

B, S = 2, 8


@pytest.fixture(scope="module")
def tiny():
  cfg = helpers.experiment("tiny", data__batch_size=B, data__seq_len=S, train__steps=3,
                           train__warmup_steps=1)
  tx = make_optimizer(cfg.train)
  graphdef, state = step_lib.init_state(cfg, tx)
  tokens = jax.random.randint(jax.random.key(0), (B, S + 1), 0, cfg.model.vocab_size)
  return cfg, tx, graphdef, state, tokens


def _forward(graphdef, state, tokens, replay=None):
  @jax.jit
  def run(params, router_state, other, replay):
    model = nnx.merge(graphdef, params, router_state, other)
    return model(tokens, replay=replay)
  return run(state.params, state.router_state, state.other, replay)


def _other_selection(cfg):
  """Every token on the last K experts of each layer (ids E-1, E-2, ...), all slots valid."""
  e = cfg.model.moe.num_routed
  out = {}
  for name, k in record_lib.replay_layers(cfg.model).items():
    ids = jnp.broadcast_to(jnp.arange(e - 1, e - 1 - k, -1, dtype=jnp.int32), (B, S, k))
    out[name] = RoutingReplay(ids, jnp.ones((B, S, k), bool))
  return out


def test_a_recording_replays_its_forward_bit_for_bit(tiny, tmp_path):
  cfg, _, graphdef, state, tokens = tiny
  logits, aux = _forward(graphdef, state, tokens[:, :-1])
  sel = record_lib.selections(aux)
  assert sorted(sel) == sorted(record_lib.replay_layers(cfg.model))
  path = record_lib.write_recording(str(tmp_path / "rec.npz"), sel, tokens=tokens[:, :-1],
                                    batch_index=[5, 6], cfg=cfg.model)
  rec = record_lib.read_recording(path, cfg.model)
  np.testing.assert_array_equal(rec.tokens, np.asarray(tokens[:, :-1]))
  np.testing.assert_array_equal(rec.batch_index, [5, 6])
  for name in sel:
    np.testing.assert_array_equal(rec.layers[name].expert_ids, np.asarray(sel[name].expert_ids))
    np.testing.assert_array_equal(rec.layers[name].valid, np.asarray(sel[name].valid))
  changed = np.asarray(tokens[:, :-1]).copy()
  changed[1, 2] += 1
  with pytest.raises(ValueError, match=r"differs from the recorded tokens \(token \[1, 2\]\)"):
    rec.replay(tokens=changed)
  logits2, aux2 = _forward(graphdef, state, tokens[:, :-1], rec.replay(tokens=tokens[:, :-1]))
  np.testing.assert_array_equal(np.asarray(logits2), np.asarray(logits))
  np.testing.assert_array_equal(np.asarray(aux2["loss"]), np.asarray(aux["loss"]))


def test_a_train_step_on_a_replayed_selection(tiny):
  cfg, tx, graphdef, state, tokens = tiny
  replay = _other_selection(cfg)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((B, S), bool)}
  _, own = _forward(graphdef, state, batch["inputs"])
  name = sorted(replay)[0]
  assert not np.array_equal(np.asarray(own["moe"][name]["selection"].expert_ids),
                            np.asarray(replay[name].expert_ids))  # the router chooses otherwise

  def loss(params):
    model = nnx.merge(graphdef, params, state.router_state, state.other)
    logits, aux = model(batch["inputs"], train=True, replay=replay)
    _, ce, _ = masked_cross_entropy(logits, batch["targets"], batch["mask"])
    return ce + aux["loss"], aux

  (_, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state.params)
  for layer in replay:
    np.testing.assert_array_equal(np.asarray(aux["moe"][layer]["selection"].expert_ids),
                                  np.asarray(replay[layer].expert_ids))
  router_grads = [np.asarray(g) for path, g in jax.tree_util.tree_leaves_with_path(grads)
                  if "router" in jax.tree_util.keystr(path)]
  assert router_grads and all(np.isfinite(g).all() for g in router_grads)
  assert max(np.abs(g).max() for g in router_grads) > 0

  step = step_lib.make_train_step(graphdef, cfg, tx)
  new, metrics = step(state, {**batch, "replay": replay})
  e = cfg.model.moe.num_experts
  want = np.bincount(np.asarray(replay[name].expert_ids).reshape(-1), minlength=e)
  np.testing.assert_array_equal(np.asarray(metrics[f"load/{name}"]), want)
  # The bias controller (sign rule) moved every layer's bias by the replayed loads:
  # up on the experts the replay left idle, down on the ones it loaded.
  rate = cfg.model.moe.balance.bias_rate
  biases = [np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(new.router_state)
            if "bias" in jax.tree_util.keystr(p)]
  assert len(biases) == len(replay)
  for bias in biases:
    np.testing.assert_allclose(bias, [rate, rate, -rate, -rate], rtol=1e-6)


def test_a_recording_of_another_model_is_refused_in_one_line(tiny, tmp_path):
  cfg, _, graphdef, state, tokens = tiny
  sel = _other_selection(cfg)
  path = record_lib.write_recording(str(tmp_path / "rec.npz"), sel, tokens=tokens[:, :-1],
                                    batch_index=[0, 1], cfg=cfg.model)
  more = helpers.experiment("tiny", model__n_layers=3).model
  with pytest.raises(ValueError, match=r"layers=\['layer_0', 'layer_1'\].*Fix:") as err:
    record_lib.read_recording(path, more)
  assert "\n" not in str(err.value)
  fewer = dataclasses.replace(cfg.model.moe.topology, num_experts=2)
  two = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe, topology=fewer))
  with pytest.raises(ValueError, match=r"expert_ids span \[2, 3\].*2 router outputs"):
    record_lib.read_recording(path, two)
  with pytest.raises(ValueError, match=r"missing \['layer_1'\].*Fix:"):
    _forward(graphdef, state, tokens[:, :-1], {"layer_0": sel["layer_0"]})
