"""train.profile_steps: a jax.profiler trace of the chosen steps, and the MoE's named scopes.

The shared tiny run, resumed from its step-30 checkpoint, traces steps 33-34
and the test reads the trace: on CPU the scope names are in the ``.xplane.pb`` (the
compiled program's op metadata travels with it; the Perfetto
``.trace.json.gz`` of XLA:CPU shows only thunk names). Every phase is checked
on the lowered HLO of the expert-parallel layer on the composed ``ragged_dot``
path (dispatch, expert matmuls and combine as separate ops); the all-to-all
on the exchange itself (this process has one device, where the layer's
all_to_all over a size-1 axis is elided).
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

from moejax import config as C
from moejax import layer as L
from moejax.config import ConfigError
from moejax.execution import mesh as mesh_lib
from moejax.execution import scopes
from moejax.execution import transport
from moejax.train import loop, profiling
from tests.configs import moe_config
from tests.train import helpers


@pytest.mark.parametrize("value, problem", [
    ((0, 2), "needs 0 < a < b"), ((3, 3), "needs 0 < a < b"), ((2, 41), "needs 0 < a < b"),
    ((2,), "pair of integers"), ((1.5, 3), "pair of integers"), ("2,3", "pair of integers")])
def test_profile_steps_are_checked_before_anything_runs(value, problem):
  with pytest.raises(ConfigError, match=rf"train\.profile_steps=.*{problem}.*Fix: use two"):
    helpers.experiment("tiny", train__profile_steps=value)  # train.steps=40


def test_a_run_traces_its_profile_steps_and_the_trace_names_the_moe_phases(tiny_copy):
  # The shared tiny run resumed from step 30 (its programs are in the compilation cache):
  # profile_steps is an observation setting, so the same run resumes with it.
  cfg, workdir = tiny_copy
  shutil.rmtree(os.path.join(workdir, "checkpoints", "40"))
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, profile_steps=(32, 34)))
  out = io.StringIO()
  loop.train(cfg, workdir, out=out)
  assert f"profile of steps 33-34 written under {os.path.join(workdir, 'profile')}" in (
      out.getvalue())
  (xplane,) = profiling.trace_files(workdir)
  assert profiling.trace_files(workdir, ".trace.json.gz")  # the Perfetto view of the host
  with open(xplane, "rb") as f:
    data = f.read()
  # The tiny model runs the reference executor (no dispatch / combine ops), has no shared
  # experts and one device (no all-to-all): those scopes are checked on the HLO below.
  for scope in (scopes.ROUTE, scopes.BALANCE, scopes.EXPERT_FFN):
    assert scope.encode() in data, scope
  assert not profiling._active  # stopped


def test_a_run_resumed_past_the_first_profile_step_says_it_takes_no_trace(tmp_path):
  said = []
  p = profiling.StepProfiler(str(tmp_path), (2, 5), start_step=2, say=said.append)
  assert p.after_step(3, jnp.zeros(())) == 0.0 and not profiling._active
  assert said == ["train.profile_steps=(2, 5): this run starts at step 2, after step 2; no "
                  "trace (set later steps to take one)"]


def test_the_expert_parallel_layer_names_every_phase_in_its_hlo():
  cfg = moe_config(num_experts=4, expert_width=8, num_shared_experts=1, backend="ragged_dot",
                   routing=dict(top_k=2))
  params = L.init_moe_params(jax.random.PRNGKey(0), 8, cfg)
  mesh = mesh_lib.make_mesh(C.ParallelConfig(), cfg=cfg)

  def loss(p, x):
    y, aux = L.ep_moe_layer(p, x, None, cfg, mesh, C.ParallelConfig())
    return jnp.sum(y) + aux.losses["total"], aux.metrics  # metrics: outputs, as in training

  step = jax.jit(jax.value_and_grad(loss, has_aux=True))
  text = step.lower(params, jnp.ones((2, 4, 8))).as_text(debug_info=True)
  for scope in set(scopes.PHASES) - {scopes.ALL_TO_ALL}:
    assert scope in text, scope
  # The exchange every padded and emulated transport is built from, on a named axis of 4.
  a2a = jax.vmap(transport.all_to_all, axis_name=mesh_lib.EXPERT)
  assert scopes.ALL_TO_ALL in jax.jit(a2a).lower(jnp.ones((4, 4, 2))).as_text(debug_info=True)
