"""Fine-tuning on an engine's routing (router replay) against the trainer's own routing.

Legend: B sequences, S tokens per sequence, K selection slots.

In reinforcement learning on MoEs the rollout engine (bf16, quantised
experts, other kernels) sends some tokens to other experts than the trainer
would, and the trainer then optimises a model that did not produce the
rollouts. Router replay (R3: Megatron-Core's ``moe/router_replay.py``) trains
on the engine's recorded selection, its combine weights recomputed by the
trainer's router (docs/routing_replay.md). This module asks what replay
changes at equal budget, from one trained state and on the same batches:

- ``own``: each step trains on the trainer's own routing;
- ``replay``: each step first records the selection of a perturbed forward
  (a registered perturbation of :mod:`moejax.serve.routing_consistency`,
  e.g. ``bf16``) of the current weights on the step's batch [B, S, K], then
  trains on that recording.

Both arms start from the same parameters with a fresh optimizer (the run's
optimizer and peak learning rate, no warmup, cosine over the fine-tuning
steps) on training batches of another shuffle than pre-training's
(``data.seed + 1``). Reported (:func:`finetune_pair`): the training-loss gap
(replay minus own, mean over the steps), the recordings' flip rate against
the trainer's own selection of the same weights (mean over the steps), and
the gap of the two arms' validation loss after fine-tuning.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax import data as data_lib
from moejax.config import ConfigError
from moejax.evaluate import consistency as consistency_lib
from moejax.evaluate import validation
from moejax.serve import perturbation as perturbation_lib
from moejax.train import optim
from moejax.train import step as step_lib
from moejax.train.config import ExperimentConfig

ARMS = ("own", "replay")


def replayable(name: str) -> str:
  """'' when perturbation ``name`` can make recordings to replay, else why not."""
  from moejax.serve import routing_consistency  # pylint: disable=g-import-not-at-top
  del routing_consistency  # registers the shipped perturbations
  p = perturbation_lib.PERTURBATIONS.get(name)
  if p is None:
    return (f"is not a registered perturbation; use one of "
            f"{', '.join(sorted(perturbation_lib.PERTURBATIONS))}")
  if p.own_reference:
    return "compares two forwards of its own, so it records no single selection to replay"
  return ""


def check_options(options) -> tuple[str, int]:
  """(perturbation, steps) of ``suite.analysis.replay_finetune``, or a ConfigError naming it."""
  field = "suite.analysis.replay_finetune"
  fix = "write e.g. {'perturbation': 'bf16', 'steps': 50}"
  keys = set(options.keys()) if hasattr(options, "keys") else None
  if keys != {"perturbation", "steps"}:
    raise ConfigError(field, options, "must be a dict of 'perturbation' and 'steps'", fix)
  name, steps = options["perturbation"], options["steps"]
  why = replayable(name) if isinstance(name, str) else "is not a name"
  if why:
    raise ConfigError(f"{field}.perturbation", name, why, fix)
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ConfigError(f"{field}.steps", steps, "must be a whole number of steps >= 1", fix)
  return name, steps


def finetune_config(exp: ExperimentConfig, steps: int) -> ExperimentConfig:
  """``exp`` with the fine-tuning's schedule (``steps``, no warmup) and data shuffle."""
  train = dataclasses.replace(exp.train, steps=steps, warmup_steps=0, microbatches=1)
  return dataclasses.replace(exp, train=train,
                             data=dataclasses.replace(exp.data, seed=exp.data.seed + 1))


def train_batches(exp: ExperimentConfig, steps: int) -> list[dict]:
  it = data_lib.make_batches(exp.data, exp.data.train_split, train=True)
  return [next(it) for _ in range(steps)]


def train_selections(graphdef):
  """``(state, tokens) -> {layer: RoutingReplay}``: the selection of the training forward of
  ``state``'s next step (``train=True`` under the step's key, as ``make_train_step`` draws it)."""

  @jax.jit
  def select(state: step_lib.TrainState, tokens):
    model = nnx.merge(graphdef, state.params, state.router_state, state.other)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    return perturbation_lib.selections_of(model(tokens, train=True, rng=key)[1])

  return select


def _arm(exp, graphdef, state, step_fn, batches, record, own_selections) -> tuple:
  """(state, per-step training CE, per-step flip rates) of one arm."""
  ce, flips = [], []
  num_routed = exp.model.moe.num_routed
  for batch in batches:
    if record is not None:
      model = nnx.merge(graphdef, state.params, state.router_state, state.other)
      recorded = record(model, batch["inputs"])
      own = own_selections(state, jnp.asarray(batch["inputs"], jnp.int32))
      flips.append(consistency_lib.compare(own, recorded, num_routed).flip_rate)
      batch = {**batch, "replay": recorded}
    state, metrics = step_fn(state, batch)
    ce.append(float(metrics["ce"]))
  return state, ce, flips


def finetune_pair(exp: ExperimentConfig, model, perturbation: str, steps: int,
                  val_batches: Sequence[dict], num_domains: int) -> dict:
  """Both arms from ``model``'s weights; the columns of the module doc.

  Returns ``replay_loss_gap`` (mean training CE, replay - own), ``replay_flip_rate``
  (mean over steps), ``replay_val_gap`` (validation loss after fine-tuning,
  replay - own, on ``val_batches`` of ``num_domains`` domains), each arm's per-step training CE and the
  settings (``replay_perturbation``, ``replay_steps``).
  """
  why = replayable(perturbation)
  if why:
    raise ValueError(f"replay fine-tuning: perturbation {perturbation!r} {why}")
  if exp.model.moe is None:
    raise ValueError("replay fine-tuning: a dense model routes nothing. Fix: a MoE arm")
  ft = finetune_config(exp, steps)
  tx = optim.make_optimizer(ft.train, ft.model, ft.finetune)
  graphdef, params, router_state, other = step_lib.split_model(model)
  start = step_lib.TrainState(
      step=jnp.zeros((), jnp.int32), params=params, router_state=router_state, other=other,
      opt_state=tx.init(params), rng=jax.random.key_data(jax.random.key(ft.train.seed)))
  step_fn = step_lib.make_train_step(graphdef, ft, tx)
  batches = train_batches(ft, steps)
  record = perturbation_lib.PERTURBATIONS[perturbation].selections
  own_selections = train_selections(graphdef)
  eval_step = validation.make_eval_step(graphdef, ft.model, num_domains)  # one compile, both arms
  out: dict = {"replay_perturbation": perturbation, "replay_steps": steps}
  val = {}
  for arm in ARMS:
    state, ce, flips = _arm(ft, graphdef, start, step_fn, batches,
                            record if arm == "replay" else None, own_selections)
    out[f"replay_train_ce_{arm}"] = ce
    val[arm] = validation.evaluate(eval_step, state.params, state.router_state, state.other,
                                   val_batches)["loss"]
    if flips:
      out["replay_flip_rate"] = float(np.mean(flips))
  out["replay_loss_gap"] = float(np.mean(out["replay_train_ce_replay"])
                                 - np.mean(out["replay_train_ce_own"]))
  out["replay_val_gap"] = val["replay"] - val["own"]
  out["replay_val_loss_own"], out["replay_val_loss_replay"] = val["own"], val["replay"]
  return out
