"""The functional train step: state pytree in, state pytree and metrics out.

Legend: B batch, S sequence length, V vocabulary, E FFN experts.

The model is split once into a static ``graphdef`` and three pure-dict
pytrees (``nnx.split(model, nnx.Param, RouterStateVar, ...)``):

- ``params``: every ``nnx.Param``; the only thing the optimizer sees;
- ``router_state``: the MoE layers' ``RouterStateVar`` leaves (selection
  bias, controller step). A train-mode forward writes the controller's update
  into them; the step reads it back out of the merged model, so the bias
  flows from the model's own controller, never through the optimizer;
- ``other``: any remaining variables (none in the current model).

:class:`TrainState` holds them with the optimizer state, the step and the
base PRNG key, all plain arrays, so one ``jax.jit`` compiles the step and one
orbax call checkpoints it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from moejax.model import ExpertParallel, RouterStateVar, Transformer
from moejax.train.config import ExperimentConfig
from moejax.train.losses import masked_cross_entropy
from moejax.train.optim import learning_rate_schedule

Batch = dict[str, jax.Array]


@struct.dataclass
class TrainState:
  """Everything a run needs to continue exactly; a pytree of arrays.

  Attributes:
    step: int32[] optimizer steps done.
    params / router_state / other: the model's pure-dict states (see module).
    opt_state: the optax state over ``params``.
    rng: uint32[2] raw key data of the run's base key; step s uses
      ``fold_in(key, s)``, so the stream of keys does not depend on where a
      run was interrupted.
  """

  step: jax.Array
  params: Any
  router_state: Any
  other: Any
  opt_state: Any
  rng: jax.Array

  def checkpoint_tree(self) -> dict:
    """The state as the plain dict that orbax saves and restores."""
    return {f: getattr(self, f) for f in
            ("step", "params", "router_state", "other", "opt_state", "rng")}


def split_model(model: nnx.Module):
  """(graphdef, params, router_state, other) with pure-dict states."""
  graphdef, params, router_state, other = nnx.split(model, nnx.Param, RouterStateVar, ...)
  return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(router_state), nnx.to_pure_dict(other)


_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _build(cfg: ExperimentConfig, tx: optax.GradientTransformation, holder: dict,
           expert_parallel: Optional[ExpertParallel]) -> TrainState:
  init_key, run_key = jax.random.split(jax.random.key(cfg.train.seed))
  model = Transformer(cfg.model, rngs=nnx.Rngs(params=init_key),
                      expert_parallel=expert_parallel)
  graphdef, params, router_state, other = split_model(model)
  holder["graphdef"] = graphdef
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, router_state=router_state,
                    other=other, opt_state=tx.init(params), rng=jax.random.key_data(run_key))


def init_state(cfg: ExperimentConfig, tx: optax.GradientTransformation,
               expert_parallel: Optional[ExpertParallel] = None):
  """(graphdef, TrainState) of a freshly initialised model (seed ``cfg.train.seed``).

  ``expert_parallel`` (the trainer's mesh when ``parallel.expert > 1``) goes
  into the graphdef, so the merged model runs its MoE layers expert-parallel;
  the initial values do not depend on it.

  Initialisation runs under one ``jax.jit`` (op by op it would dispatch and
  compile every initialiser separately), compiled without LLVM's expensive
  passes: it runs once, and the PRNG and truncated-normal code otherwise
  takes seconds to optimise on CPU.
  """
  holder: dict = {}
  options = _FAST_COMPILE if jax.default_backend() == "cpu" else None
  state = jax.jit(lambda: _build(cfg, tx, holder, expert_parallel),
                  compiler_options=options)()
  return holder["graphdef"], state


def abstract_state(cfg: ExperimentConfig, tx: optax.GradientTransformation,
                   expert_parallel: Optional[ExpertParallel] = None):
  """(graphdef, TrainState of ShapeDtypeStructs): shapes without any compute."""
  holder: dict = {}
  shapes = jax.eval_shape(lambda: _build(cfg, tx, holder, expert_parallel))
  return holder["graphdef"], shapes


def _layer_mean(aux: dict, key: str):
  """Mean over MoE layers of ``aux['moe'][layer]['metrics'][key]``; None if no layer has it."""
  vals = [layer["metrics"][key] for layer in aux["moe"].values()
          if key in layer.get("metrics", {})]
  return None if not vals else jnp.mean(jnp.stack(vals).astype(jnp.float32))


def routing_summary(aux: dict) -> dict[str, jax.Array]:
  """Scalar routing metrics averaged over MoE layers (empty for a dense model).

  max_vio is MaxVio_batch: each layer's (max load - mean) / mean on this batch.
  """
  out = {}
  for key, name in (("max_vio", "max_vio_batch"), ("drop_rate", "drop_rate"),
                    ("active_mean", "active_experts_mean"),
                    ("active_var", "active_experts_var"),
                    ("load_entropy", "load_entropy")):
    v = _layer_mean(aux, key)
    if v is not None:
      out[name] = v
  return out


def make_train_step(graphdef, cfg: ExperimentConfig,
                    tx: optax.GradientTransformation) -> Callable:
  """A jitted ``step(state, batch) -> (state, metrics)``; metrics are f32[] scalars."""
  schedule_lr = learning_rate_schedule(cfg.train)
  nan_at = cfg.train.nan_at_step

  def train_step(state: TrainState, batch: Batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def loss_fn(params):
      model = nnx.merge(graphdef, params, state.router_state, state.other)
      logits, aux = model(batch["inputs"], train=True, rng=key)
      ce, _, _ = masked_cross_entropy(logits, batch["targets"], batch["mask"])
      loss = ce + aux["loss"]
      if nan_at >= 0:  # test hook: a NaN that reaches the gradients, like a real one
        loss = loss * jnp.where(state.step + 1 == nan_at, jnp.nan, 1.0)
      _, _, new_router, new_other = nnx.split(model, nnx.Param, RouterStateVar, ...)
      return loss, (ce, aux, nnx.to_pure_dict(new_router), nnx.to_pure_dict(new_other))

    (loss, (ce, aux, router_state, other)), grads = jax.value_and_grad(
        loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "ce": ce, "aux_loss": aux["loss"],
               "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule_lr(state.step),
               **routing_summary(aux)}
    new = state.replace(step=state.step + 1, params=params, router_state=router_state,
                        other=other, opt_state=opt_state)
    return new, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)

  return jax.jit(train_step)
