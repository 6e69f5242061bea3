"""Idea state in the train step: exact values after a few steps, logged, checkpointed, unchanged trees.

A balance loss registered from this test declares two fields (a step counter
and a token count) and reads the counter as its value, so every number is
known by hand: after s optimizer steps of B x S tokens (in two micro-batches),
the state holds s and s B S in every MoE layer, the step's row logs the state
its forward read (s - 1 steps), and ``balance/<name>`` is its coefficient x
(s - 1) x the MoE layers. The state rides in the router state through a
checkpoint; a config without stateful ideas stores exactly the tree it did
before ideas had state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.balance import register_loss
from moejax.config.registry import BALANCE_LOSSES
from moejax.routing import IdeaState
from moejax.train import checkpoint as ckpt_lib
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

B, S, STEPS, COEF = 8, 32, 3, 0.5
NAME = "step_counter"


def _init(cfg):
  return {"steps": jnp.zeros((), jnp.int32), "tokens": jnp.zeros((), jnp.float32)}


def _observe(result, cfg, *, state, context):
  return {"tokens": context.num_tokens}


def _update(own, seen, cfg):
  return {"steps": own["steps"] + 1, "tokens": own["tokens"] + seen["tokens"]}


def _counter(result, cfg, *, batch_shape, axis_names, state):
  return state[NAME]["steps"].astype(jnp.float32)


@pytest.fixture(scope="module")
def counter():
  register_loss(NAME, state=IdeaState(_init, _update, _observe))(_counter)
  yield
  BALANCE_LOSSES.unregister(NAME)


def _batch(seed):
  tokens = jax.random.randint(jax.random.key(seed), (B, S + 1), 0, 256)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((B, S), bool)}


def _setup(tmp_path, **overrides):
  cfg = helpers.experiment("tiny", str(tmp_path), data__batch_size=B, data__seq_len=S,
                           train__steps=10, train__warmup_steps=1, **overrides)
  tx = make_optimizer(cfg.train)
  graphdef, state = step_lib.init_state(cfg, tx)
  return cfg, tx, graphdef, state


def _ideas(router_state):
  """[{idea: {field: value}}] of every MoE layer, in layer order."""
  out = []
  def visit(tree):
    if isinstance(tree, dict):
      if "router_state" in tree:
        out.append(tree["router_state"].get("ideas"))
      for k in sorted(tree, key=str):
        if k != "router_state":
          visit(tree[k])
  visit(router_state)
  return out


@pytest.fixture(scope="module")
def trained(counter, tmp_path_factory):
  cfg, tx, graphdef, state = _setup(
      tmp_path_factory.mktemp("counter"), train__microbatches=2,
      model__moe__balance__extra_losses=((NAME, COEF),))
  step = step_lib.make_train_step(graphdef, cfg, tx)
  rows = []
  for i in range(STEPS):
    state, m = step(state, _batch(i))
    rows.append({k: float(v) for k, v in m.items() if v.ndim == 0})
  return cfg, tx, graphdef, step, state, rows


def test_state_after_a_few_steps_is_exact_in_every_layer(trained):
  _, _, _, _, state, _ = trained
  layers = _ideas(state.router_state)
  assert len(layers) == 2
  for ideas in layers:
    assert set(ideas) == {NAME}
    assert int(ideas[NAME]["steps"]) == STEPS
    assert float(ideas[NAME]["tokens"]) == STEPS * B * S  # both micro-batches counted once


def test_rows_log_the_state_the_forward_read_and_the_loss_that_read_it(trained):
  _, _, _, _, _, rows = trained
  assert [r[f"state/{NAME}/steps"] for r in rows] == [0.0, 1.0, 2.0]
  assert [r[f"state/{NAME}/tokens"] for r in rows] == [0.0, B * S, 2.0 * B * S]
  assert [r[f"balance/{NAME}"] for r in rows] == [COEF * s * 2 for s in range(STEPS)]


def test_state_rides_through_a_checkpoint_and_the_next_step_is_identical(trained, tmp_path):
  cfg, tx, _, step, state, _ = trained
  _, abstract = step_lib.abstract_state(cfg, tx)
  with ckpt_lib.Checkpointer(str(tmp_path), keep=1) as ckpt:
    ckpt.save(STEPS, state.checkpoint_tree(), {"position": STEPS})
    ckpt.wait()
    tree, _ = ckpt.restore(STEPS, abstract.checkpoint_tree())
  restored = step_lib.TrainState(**tree)
  want, _ = step(state, _batch(STEPS))
  got, _ = step(restored, _batch(STEPS))
  for a, b in zip(jax.tree.leaves(want.router_state), jax.tree.leaves(got.router_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert [int(i[NAME]["steps"]) for i in _ideas(got.router_state)] == [STEPS + 1] * 2


def test_a_config_without_stateful_ideas_stores_the_tree_it_did_before(tmp_path):
  _, _, _, state = _setup(tmp_path)
  paths = {jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_leaves_with_path(state.router_state)}
  assert paths and all(p.endswith(("['bias']", "['step']")) for p in paths), sorted(paths)
  assert _ideas(state.router_state) == [None, None]


def test_a_logged_field_must_be_a_scalar_of_the_state():
  from moejax.routing import state as state_lib  # pylint: disable=g-import-not-at-top
  from tests.configs import moe_config  # pylint: disable=g-import-not-at-top
  vec = IdeaState(lambda cfg: {"ema": jnp.zeros((4,))}, lambda own, seen, cfg: own,
                  logged=("ema",))
  register_loss("vector_state", state=vec)(lambda result, cfg, *, batch_shape, axis_names: 0.0)
  try:
    cfg = moe_config(num_experts=4, balance=dict(extra_losses=(("vector_state", 1.0),)))
    with pytest.raises(ValueError, match=r"'vector_state': logged field 'ema' has shape "
                                         r"\(4,\); a logged field is a scalar"):
      state_lib.logged(cfg, state_lib.init(cfg))
  finally:
    BALANCE_LOSSES.unregister("vector_state")


def test_a_checkpoint_from_before_the_idea_had_state_resumes_from_its_initial_value(tmp_path):
  # A plugin rule trained without state, then given a counter (no observe) starting at 7.
  from moejax.balance import register_bias_rule  # pylint: disable=g-import-not-at-top
  from moejax.config.registry import BIAS_RULES  # pylint: disable=g-import-not-at-top

  def rule(load, mean, rate):
    return rate * jnp.sign(mean - load)

  overrides = dict(model__moe__balance__bias_update="grows_state")
  register_bias_rule("grows_state")(rule)
  try:
    cfg, _, _, old = _setup(tmp_path / "cfg", **overrides)
    with ckpt_lib.Checkpointer(str(tmp_path / "run"), keep=1) as ckpt:
      ckpt.save(0, old.checkpoint_tree(), {"position": 0})
      ckpt.wait()
  finally:
    BIAS_RULES.unregister("grows_state")
  counter = IdeaState(lambda cfg: {"n": jnp.asarray(7, jnp.int32)},
                      lambda own, seen, cfg: {"n": own["n"] + 1})
  register_bias_rule("grows_state", state=counter)(rule)
  try:
    cfg, tx, graphdef, _ = _setup(tmp_path / "cfg", **overrides)
    _, abstract = step_lib.abstract_state(cfg, tx)
    got = ckpt_lib.restore_latest(str(tmp_path / "run"), [0], abstract.checkpoint_tree(), cfg)
    assert got.verified and got.step == 0
    state = step_lib.TrainState(**got.tree)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(old.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [int(i["grows_state"]["n"]) for i in _ideas(state.router_state)] == [7, 7]
    state, m = step_lib.make_train_step(graphdef, cfg, tx)(state, _batch(0))
    assert float(m["state/grows_state/n"]) == 7.0  # what the forward read
    assert [int(i["grows_state"]["n"]) for i in _ideas(state.router_state)] == [8, 8]
  finally:
    BIAS_RULES.unregister("grows_state")
