"""The train step: gradient accumulation, remat and the once-per-step bias controller.

A fixed random batch of the tiny config (no dataset): the same tokens split
into 4 micro-batches must give the update of the one-batch step (params,
Adam moments, router bias) to float tolerance, and rematerialising the
blocks must not change the update. The tiny config balances with a
sequence-scope loss, which is per-sequence and so exact under accumulation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.train import step as step_lib
from moejax.train.optim import make_optimizer
from tests.train import helpers

B, S, STEPS = 8, 32, 3


def _batch(seed):
  k1, k2 = jax.random.split(jax.random.key(seed))
  tokens = jax.random.randint(k1, (B, S + 1), 0, 256)
  mask = jax.random.uniform(k2, (B, S)) > 0.1  # some padding: token-weighted means
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _run(tmp_path, **overrides):
  cfg = helpers.experiment("tiny", str(tmp_path), data__batch_size=B, data__seq_len=S,
                           train__steps=10, train__warmup_steps=1,
                           **{f"train__{k}" if k != "remat" else "model__remat": v
                              for k, v in overrides.items()})
  tx = make_optimizer(cfg.train)
  graphdef, state = step_lib.init_state(cfg, tx)
  step = step_lib.make_train_step(graphdef, cfg, tx)
  metrics = []
  for i in range(STEPS):
    state, m = step(state, _batch(i))
    metrics.append(m)
  return cfg, state, metrics


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory):
  return _run(tmp_path_factory.mktemp("one"))


def _close_trees(a, b, tol):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol,
                               err_msg=jax.tree_util.keystr(path))


def test_four_micro_batches_equal_one_batch(one_batch, tmp_path):
  cfg, want, m_want = one_batch
  _, got, m_got = _run(tmp_path, microbatches=4)
  _close_trees(got.params, want.params, 2e-5)
  _close_trees(got.opt_state, want.opt_state, 2e-5)
  # The bias controller ran once per step, on the loads of the whole batch.
  _close_trees(got.router_state, want.router_state, 0.0)
  steps = [int(leaf) for leaf in jax.tree.leaves(got.router_state) if leaf.ndim == 0]
  assert steps and all(s == STEPS for s in steps), steps
  biases = [np.asarray(b) for b in jax.tree.leaves(want.router_state) if b.ndim == 1]
  assert any(np.any(b != 0) for b in biases), "the controller never moved: vacuous"
  for a, b in zip(m_got, m_want):
    for key in ("loss", "ce", "aux_loss", "grad_norm"):
      np.testing.assert_allclose(float(a[key]), float(b[key]), rtol=2e-5, err_msg=key)


def test_remat_does_not_change_the_update(one_batch, tmp_path):
  _, want, _ = one_batch
  _, got, _ = _run(tmp_path, remat=True)
  # Rematerialised, the backward recomputes the forward inside a different
  # XLA program, whose fusions may sum in another order: f32 rounding, which
  # Adam's normalised update can lift to a few 1e-6 after the steps (one
  # embedding entry of 8192 was 2.5e-6 off on a slower 2-core VM). A wrong
  # remat (a stale or missing activation) is off by orders more.
  _close_trees(got.params, want.params, 1e-5)
  _close_trees(got.opt_state, want.opt_state, 1e-5)
  _close_trees(got.router_state, want.router_state, 0.0)


def test_remat_with_accumulation(one_batch, tmp_path):
  _, want, _ = one_batch
  _, got, _ = _run(tmp_path, remat=True, microbatches=2)
  _close_trees(got.params, want.params, 2e-5)
  _close_trees(got.router_state, want.router_state, 0.0)
