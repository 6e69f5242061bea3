"""The NaN / inf guard: per-step rows, the whole state, and the loop's use of both."""

from __future__ import annotations

import io
import math

import jax.numpy as jnp
import numpy as np
import pytest

from moejax.train import checkpoint as ckpt_lib
from moejax.train import guard, loop
from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers


def test_a_finite_loss_with_a_nan_gradient_norm_is_caught():
  rows = [{"loss": 6.1, "grad_norm": 3.0}, {"loss": 6.6e19, "grad_norm": math.nan}]
  assert guard.first_nonfinite_row(rows, first_step=2) == (3, "grad_norm", rows[1])
  assert guard.first_nonfinite_row(rows[:1], first_step=2) is None
  assert guard.first_nonfinite_row([{"loss": math.inf, "grad_norm": 1.0}], 7)[:2] == (7, "loss")


def test_state_guard_names_an_infinite_router_bias_and_skips_integer_leaves():
  cfg = helpers.experiment("tiny")
  _, state = step_lib.init_state(cfg, make_optimizer(cfg.train, cfg.model))
  tree = state.checkpoint_tree()
  assert guard.nonfinite_leaves(tree) == []
  rs = tree["router_state"]["blocks"][1]["ffn"]["router_state"]
  rs["bias"] = rs["bias"].at[2].set(jnp.inf)
  bad = guard.nonfinite_leaves(tree)
  assert bad == ["router_state/blocks/1/ffn/router_state/bias"]
  assert guard.describe(bad) == "router_state: 1 leaf (blocks/1/ffn/router_state/bias)"
  tree["params"]["embed"]["embedding"] = tree["params"]["embed"]["embedding"] * jnp.nan
  assert guard.nonfinite_leaves(tree)[0] == "params/embed/embedding"
  # step (int32), rng (uint32) and the controller's step counters are not checked.
  assert guard.nonfinite_leaves({"step": jnp.int32(3), "rng": jnp.zeros(2, jnp.uint32)}) == []


def test_huge_learning_rate_stops_at_the_nan_gradient_and_names_a_finite_checkpoint(
    tmp_path, data_dir):
  # Step 3 has a finite loss (6.6e19) but a NaN gradient norm: its update must
  # not be saved, and the checkpoint named "last good" must really be finite.
  cfg = helpers.experiment("tiny", data_dir, train__learning_rate=1e6, train__checkpoint_every=1,
                           train__keep_checkpoints=50, train__eval_every=0)
  workdir = str(tmp_path / "run")
  with pytest.raises(guard.NonFiniteError,
                     match=r"gradient norm is nan at step 3 .*last good checkpoint.* is step 2"):
    loop.train(cfg, workdir, out=io.StringIO())
  assert ckpt_lib.checkpoint_steps(workdir) == [1, 2]
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  restored = ckpt_lib.restore_latest(workdir, [2], abstract.checkpoint_tree())
  assert restored.step == 2 and guard.nonfinite_leaves(restored.tree) == []
  assert not (tmp_path / "run" / "run.lock").exists()  # released on the exception
  assert ckpt_lib.read_history(workdir)[-1]["event"] == "stopped"


def test_a_router_bias_gone_inf_is_never_checkpointed(tmp_path, data_dir, monkeypatch):
  # The loss and gradients stay finite (the bias only selects experts, and the
  # controller moves it outside the optimizer); only the state check sees it.
  real = step_lib.make_train_step

  def poisoned(graphdef, cfg, tx):
    train_step = real(graphdef, cfg, tx)

    def step(state, batch):
      state, metrics = train_step(state, batch)
      rs = state.router_state["blocks"][0]["ffn"]["router_state"]
      rs = dict(rs, bias=jnp.where(state.step >= 7, jnp.inf, rs["bias"]))
      blocks = list(state.router_state["blocks"]) if isinstance(
          state.router_state["blocks"], list) else dict(state.router_state["blocks"])
      blocks[0] = dict(blocks[0], ffn=dict(blocks[0]["ffn"], router_state=rs))
      return state.replace(router_state=dict(state.router_state, blocks=blocks)), metrics

    return step

  monkeypatch.setattr(loop.step_lib, "make_train_step", poisoned)
  cfg = helpers.experiment("tiny", data_dir, train__checkpoint_every=5, train__eval_every=0)
  workdir = str(tmp_path / "run")
  with pytest.raises(guard.NonFiniteError, match=(
      r"state after step 10 is not finite \(router_state: 1 leaf "
      r"\(blocks/0/ffn/router_state/bias\)\).*last good checkpoint.* is step 5")):
    loop.train(cfg, workdir, out=io.StringIO())
  assert ckpt_lib.checkpoint_steps(workdir) == [5]
  _, abstract = step_lib.abstract_state(cfg, make_optimizer(cfg.train, cfg.model))
  tree, _ = ckpt_lib.Checkpointer(workdir, 2, read_only=True).restore(
      5, abstract.checkpoint_tree())
  assert np.isfinite(np.asarray(tree["router_state"]["blocks"][0]["ffn"]["router_state"]
                                ["bias"])).all()
