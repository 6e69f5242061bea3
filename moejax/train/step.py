"""The functional train step: state pytree in, state pytree and metrics out.

Legend: B batch, S sequence length, V vocabulary, E FFN experts.

The model is split once into a static ``graphdef`` and three pure-dict
pytrees (``nnx.split(model, nnx.Param, RouterStateVar, ...)``):

- ``params``: every ``nnx.Param``; the only thing the optimizer sees;
- ``router_state``: the MoE layers' ``RouterStateVar`` leaves (selection
  bias, controller step, the stateful ideas' state). The forward only reads them; after the optimizer
  update the step applies every layer's bias controller to the router loads
  of the whole batch (:meth:`moejax.model.Transformer.apply_controllers`),
  so the bias never flows through the optimizer or the gradient;
- ``other``: any remaining variables (none in the current model).

:class:`TrainState` holds them with the optimizer state, the step and the
base PRNG key, all plain arrays, so one ``jax.jit`` compiles the step and one
orbax call checkpoints it.
"""

from __future__ import annotations

import dataclasses

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from moejax.balance.aux import LayerMetrics
from moejax.config.registry import BALANCE_LOSS_LOG_PREFIX, BALANCE_LOSSES
from moejax.model import ExpertParallel, RouterStateVar, Transformer
from moejax.nn import adapters as adapters_lib
from moejax.nn import mtp as mtp_lib
from moejax.nn.losses import masked_cross_entropy
from moejax.train.config import ExperimentConfig
from moejax.train.optim import frozen_gradients, learning_rate_schedule

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
  ft = cfg.finetune
  if ft.lora:  # LoRA adapters of a fine-tuning run (B = 0: the model is unchanged)
    adapters_lib.attach(model, ft.lora, ft.lora_rank, ft.lora_scale,
                        jax.random.fold_in(init_key, 0x10A))
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


def _mean(vals):
  return None if not vals else jnp.mean(jnp.stack(vals).astype(jnp.float32))


def moe_layers(aux: dict) -> dict[str, dict]:
  """Every MoE layer aux a training forward returned: the main model's (``layer_<i>``) and
  the multi-token prediction blocks' (``mtp_<k>``, with ``model.mtp_ffn='moe'``)."""
  return {**aux["moe"], **aux.get("mtp_moe", {})}


def _moe_mean(aux: dict, field: str):
  """Mean over MoE layers of their ``LayerMetrics.<field>``; None if no layer fills it."""
  return _mean([getattr(layer["metrics"], field) for layer in moe_layers(aux).values()
                if getattr(layer["metrics"], field) is not None])


def _mod_mean(aux: dict, key: str):
  """Mean over mixture-of-depths blocks of ``metrics[key]``; None if no block has it."""
  return _mean([layer["metrics"][key] for layer in aux["mod"].values()
                if key in layer.get("metrics", {})])


# (LayerMetrics field, logged name), from the type; each is logged where some layer has it.
_MOE_METRICS = LayerMetrics.logged()
_MOD_METRICS = (("tokens", "mod_tokens"), ("capacity_use", "mod_capacity_use"),
                ("causal_share", "mod_causal_share"),
                ("causal_agreement", "mod_causal_agreement"))
# Logged names of the MoD metrics the ablation runner summarises.
MOD_SUMMARIZED = ("mod_capacity_use", "mod_causal_agreement")


def routing_summary(aux: dict) -> dict[str, jax.Array]:
  """Scalar routing metrics averaged over MoE (and mixture-of-depths) layers.

  max_vio_batch: each layer's (max load - mean) / mean on this batch (for
  Soft MoE the combine mass per expert, for PEER the retrievals per expert).
  Empty for a dense model without MoD blocks.
  """
  out = {}
  for mean, table in ((_moe_mean, _MOE_METRICS), (_mod_mean, _MOD_METRICS)):
    for key, name in table:
      v = mean(aux, key)
      if v is not None:
        out[name] = v
  return out


def layer_loads(aux: dict) -> dict[str, jax.Array]:
  """Per MoE layer ``<name>`` (``layer_<i>``, ``mtp_<k>``): ``max_vio_batch/<name>`` f32[]
  and ``load/<name>`` f32[E].

  The load is :attr:`LayerMetrics.load` (sparse: token copies the router
  sent to each FFN expert, before capacity; soft: combine mass); PEER layers
  have only the MaxVio of their retrievals. The loop turns the loads into
  dead-expert counts and TensorBoard histograms (:mod:`moejax.train.layer_load`).
  """
  out = {}
  for name, layer in moe_layers(aux).items():
    m = layer["metrics"]
    if m.max_vio is not None:
      out[f"max_vio_batch/{name}"] = m.max_vio
    if m.load is not None:
      out[f"load/{name}"] = m.load
  return out


def balance_loss_summary(aux: dict, balance) -> dict[str, jax.Array]:
  """``balance/<name>`` f32[]: every balance loss in the objective, shipped or registered.

  Each is its coefficient x its value summed over the MoE layers, as the
  objective counts it (so they add up to ``aux_loss`` less any
  mixture-of-depths loss); a loss whose coefficient is 0 is not in the
  objective and is not logged. ``balance``: the model's BalanceConfig (None:
  no MoE).
  """
  if balance is None:
    return {}
  out: dict[str, jax.Array] = {}
  for layer in moe_layers(aux).values():
    for name, value in (layer.get("losses") or {}).items():
      if name == "total" or not BALANCE_LOSSES.get(name).coefficient(balance):
        continue
      key = BALANCE_LOSS_LOG_PREFIX + name
      out[key] = out.get(key, 0.0) + value.astype(jnp.float32)
  return out


KIND_AUX_LOG_PREFIX = "kind/"


def kind_aux_summary(aux: dict) -> dict[str, jax.Array]:
  """``kind/<field>`` f32[]: each scalar field of the layer kinds' own aux (``kind_aux``, a
  registered kind's ``Aux``), averaged over the layers that return it, and
  ``kind/<field>/layer_<i>`` per layer. Array fields are the kind's own business (not
  logged); the shipped kinds have no aux of their own."""
  out, per_field = {}, {}
  for name, layer in moe_layers(aux).items():
    own = layer.get("kind_aux")
    if own is None:
      continue
    for field in dataclasses.fields(own):
      value = getattr(own, field.name)
      if isinstance(value, (jax.Array, float, int)) and jnp.ndim(value) == 0:
        value = jnp.asarray(value, jnp.float32)
        out[f"{KIND_AUX_LOG_PREFIX}{field.name}/{name}"] = value
        per_field.setdefault(field.name, []).append(value)
  for field, values in per_field.items():
    out[KIND_AUX_LOG_PREFIX + field] = _mean(values)
  return out


def router_loads(aux: dict) -> dict[str, jax.Array]:
  """``{'layer_<i>' or 'mtp_<k>': f32[E_r]}`` router loads of the routed MoE layers (the
  controllers' input)."""
  return {name: layer["router_load"] for name, layer in moe_layers(aux).items()
          if "router_load" in layer}


def observations(aux: dict) -> dict[str, dict]:
  """``{'layer_<i>': {idea: {name: f32}}}`` what each layer's stateful ideas observed."""
  return {name: layer["observed"] for name, layer in moe_layers(aux).items()
          if layer.get("observed")}


def make_train_step(graphdef, cfg: ExperimentConfig,
                    tx: optax.GradientTransformation) -> Callable:
  """A jitted ``step(state, batch) -> (state, metrics)``; metrics are f32[] scalars,
  except the per-layer loads ``load/layer_<i>`` f32[E] (:func:`layer_loads`).

  One step: the gradient of the batch's objective (over ``train.microbatches``
  micro-batches, summed), one optimizer update of the params, then one
  bias-controller update of every MoE layer's router state from the router
  loads of the whole batch, and one update of its stateful ideas' state
  from their observations of the whole batch, outside the differentiated
  function (so remat or accumulation cannot move either twice). The idea
  state this step's forward read is logged as ``state/<idea>/<field>``.

  A batch with a ``replay`` entry (``{'layer_<i>': RoutingReplay}`` [B, S,
  K], split into micro-batches like the tokens) trains on that recorded
  selection: the router's gradient flows through the recomputed gates only,
  and the loads the controller reads are the replayed selection's.

  The objective is the token-weighted cross-entropy of the whole batch (sum
  of per-token losses / scored tokens) plus the mean over micro-batches of
  the balance losses; with one micro-batch it is exactly mean CE + aux. With
  multi-token prediction (``model.mtp_depth``) it adds ``mtp_loss_weight``
  times the modules' mean loss (:mod:`moejax.nn.mtp`), logged as ``mtp/loss``.
  """
  schedule_lr = learning_rate_schedule(cfg.train)
  mask_frozen = frozen_gradients(cfg.model, cfg.finetune)  # identity when nothing is frozen
  nan_at = cfg.train.nan_at_step
  m = cfg.train.microbatches
  balance = cfg.model.moe.balance if cfg.model.moe is not None else None
  mtp_depth = cfg.model.mtp_depth

  def objective(params, router_state, other, batch, key, n_tokens):
    model = nnx.merge(graphdef, params, router_state, other)
    # A batch may carry a routing replay ({'layer_<i>': RoutingReplay [B, S, K]}).
    logits, aux = model(batch["inputs"], train=True, rng=key, replay=batch.get("replay"),
                        mtp=mtp_depth > 0)
    _, ce_sum, _ = masked_cross_entropy(logits, batch["targets"], batch["mask"])
    ce = ce_sum / n_tokens
    loss = ce + aux["loss"] / m
    # Token-weighted like ce (each micro-batch's share of the batch): summed, not averaged.
    sums = {}
    if mtp_depth:
      sums[mtp_lib.LOG_NAME] = mtp_lib.mtp_loss(aux["mtp"], batch["targets"], batch["mask"],
                                                n_tokens)
      loss = loss + cfg.model.mtp_loss_weight * sums[mtp_lib.LOG_NAME]
    return loss, (ce, aux["loss"], (router_loads(aux), observations(aux)),
                  {**routing_summary(aux), **balance_loss_summary(aux, balance),
                   **layer_loads(aux), **kind_aux_summary(aux)}, sums)

  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def train_step(state: TrainState, batch: Batch):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    n_tokens = jnp.maximum(jnp.sum(batch["mask"].astype(jnp.float32)), 1.0)
    args = (state.router_state, state.other)
    if m == 1:
      (loss, (ce, aux_loss, (loads, observed), summary, sums)), grads = grad_fn(
          state.params, *args, batch, key, n_tokens)
    else:
      micro = jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), batch)

      def body(carry, inputs):
        i, mb = inputs
        out, g = grad_fn(state.params, *args, mb, jax.random.fold_in(key, i), n_tokens)
        return jax.tree.map(jnp.add, carry, (out, g)), None

      zero = jax.eval_shape(grad_fn, state.params, *args, jax.tree.map(lambda a: a[0], micro),
                            key, n_tokens)
      zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zero)
      ((loss, (ce, aux_loss, (loads, observed), summary, sums)), grads), _ = jax.lax.scan(
          body, zero, (jnp.arange(m), micro))
      aux_loss = aux_loss / m                     # the mean over micro-batches
      summary = jax.tree.map(lambda v: v / m, summary)
    grads = mask_frozen(grads)
    if nan_at >= 0:  # test hook: a NaN that reaches the update, like a real one
      poison = jnp.where(state.step + 1 == nan_at, jnp.nan, 1.0)
      loss = loss * poison
      grads = jax.tree.map(lambda g: g * poison, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    model = nnx.merge(graphdef, state.params, state.router_state, state.other)
    idea_state = model.logged_state()  # what this step's forward read
    model.apply_controllers(loads)
    model.update_ideas(observed)
    _, _, router_state, _ = split_model(model)
    metrics = {"loss": loss, "ce": ce, "aux_loss": aux_loss,
               "grad_norm": optax.tree.norm(grads),
               "learning_rate": schedule_lr(state.step), **summary, **sums, **idea_state}
    new = state.replace(step=state.step + 1, params=params, router_state=router_state,
                        opt_state=opt_state)
    return new, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), metrics)

  return jax.jit(train_step)
