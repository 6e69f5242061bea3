"""The state of stateful ideas: which a config declares, and their init, observe and update.

A router (``RouterSpec.state``), a balance loss or a bias rule (``state=`` of
their registration) may declare an :class:`~moejax.routing.types.IdeaState`.
Each MoE layer then carries ``{idea name: {field: array}}`` in
``RouterState.ideas``: it is checkpointed with the router state, read by the
forward, and moved once per optimizer step outside the gradient
(:meth:`moejax.nn.moe_block.MoEFFN.update_ideas`, called by the train step):

    ideas = init(cfg)                                  # at model construction
    seen = observe(decision, cfg, ideas, context)      # in every forward (sums over the batch)
    ideas = update(cfg, ideas, seen_over_the_step)     # after the optimizer update

A config without a stateful idea has ``ideas == {}``, which adds nothing to
the stored tree, so checkpoints written before an idea had state load as
they are.
"""

from __future__ import annotations

import functools
import inspect
from typing import Mapping, Optional

import jax
import jax.numpy as jnp

from moejax.config.registry import BALANCE_LOSSES, BIAS_RULES, ROUTERS
from moejax.routing.types import IdeaState, RoutingContext, RoutingResult

# Each state field is logged (metrics.jsonl, TensorBoard) as state/<idea>/<field>.
STATE_LOG_PREFIX = "state/"


def declared(cfg) -> tuple[tuple[str, IdeaState], ...]:
  """``(idea name, IdeaState)`` of every stateful idea ``cfg`` (a MoEConfig) uses.

  The router of ``routing.kind``, every balance loss in the objective (a
  coefficient other than 0) and the bias rule of ``balance.bias_update``
  (unless 'none'). Two of them with one name is an error (their state would
  share a key).
  """
  if not cfg.layer.routed:
    return ()
  ideas = [ROUTERS.get(cfg.routing.kind)]
  b = cfg.balance
  for name in BALANCE_LOSSES.names():
    loss = BALANCE_LOSSES.get(name)
    if loss.coefficient(b):
      ideas.append(loss)
  if b.bias_update != "none":
    ideas.append(BIAS_RULES.get(b.bias_update))
  out: dict[str, IdeaState] = {}
  for idea in ideas:
    st = getattr(idea, "state", None)
    if st is None:
      continue
    if not isinstance(st, IdeaState):
      raise TypeError(f"{idea!r}: its state must be a moejax.routing.IdeaState, got "
                      f"{type(st).__name__}. Fix: declare state=IdeaState(init=..., update=...)")
    if idea.name in out:
      raise ValueError(f"two stateful ideas of this config are named {idea.name!r}; their "
                       "state would share one key. Fix: rename one of them")
    out[idea.name] = st
  return tuple(out.items())


def _checked(name: str, values, what: str, like: Optional[Mapping] = None) -> dict:
  if not isinstance(values, Mapping):
    raise TypeError(f"stateful idea {name!r}: {what} must return a mapping field -> array, "
                    f"got {type(values).__name__}")
  out = {str(k): jnp.asarray(v) for k, v in values.items()}
  if like is not None:
    if set(out) != set(like):
      raise ValueError(f"stateful idea {name!r}: update returned fields {sorted(out)}, its "
                       f"init declared {sorted(like)}. Fix: return every declared field")
    for k, v in out.items():
      if v.shape != like[k].shape:
        raise ValueError(f"stateful idea {name!r}: update returned {k} of shape {v.shape}, "
                         f"declared {like[k].shape}. Fix: keep each field's shape")
      out[k] = v.astype(like[k].dtype)
  return out


def init(cfg) -> dict:
  """``{idea: {field: array}}``: the first state of every stateful idea of ``cfg``."""
  return {name: _checked(name, st.init(cfg), "init") for name, st in declared(cfg)}


def read(ideas: Mapping) -> dict:
  """The state as an idea reads it: without gradient."""
  return jax.tree.map(jax.lax.stop_gradient, dict(ideas))


def observe(result: RoutingResult, cfg, ideas: Mapping, context: RoutingContext) -> dict:
  """``{idea: {name: f32}}`` what this forward saw, for the ideas that observe.

  ``result`` is the router's decision before capacity; every value is a sum
  over the batch of ``context`` (see :class:`~moejax.routing.types.IdeaState`).
  """
  out = {}
  state = read(ideas)
  for name, st in declared(cfg):
    if st.observe is not None:
      seen = st.observe(result, cfg, state=state, context=context)
      out[name] = {k: jnp.asarray(v, jnp.float32) for k, v in _checked(name, seen,
                                                                        "observe").items()}
  return out


def update(cfg, ideas: Mapping, observed: Mapping) -> dict:
  """The next ``{idea: {field: array}}`` after one optimizer step's ``observed`` (summed).

  Runs outside the gradient: state and observations are stop-gradient'ed.
  """
  state = read(ideas)
  seen_all = read(observed)
  out = dict(state)
  for name, st in declared(cfg):
    if name not in state:
      raise ValueError(f"stateful idea {name!r} has no state in this layer. Fix: build the "
                       "layer's RouterState with moejax.layer.init_router_state(cfg)")
    new = st.update(state[name], seen_all.get(name, {}), cfg)
    out[name] = _checked(name, new, "update", like=state[name])
  return out


def logged(cfg, ideas: Mapping) -> dict[str, jax.Array]:
  """``{'state/<idea>/<field>': f32[]}`` the logged fields of one layer's state."""
  out = {}
  for name, st in declared(cfg):
    fields = ideas.get(name, {})
    keys = st.logged if st.logged is not None else tuple(k for k, v in fields.items()
                                                         if jnp.ndim(v) == 0)
    for k in keys:
      if k not in fields or jnp.ndim(fields[k]) != 0:
        what = "is not one of its fields" if k not in fields else (
            f"has shape {jnp.shape(fields[k])}")
        raise ValueError(f"stateful idea {name!r}: logged field {k!r} {what}; a logged "
                         f"field is a scalar of its state ({sorted(fields)}). Fix: list "
                         "scalar fields in IdeaState.logged, or leave it None")
      out[f"{STATE_LOG_PREFIX}{name}/{k}"] = jnp.asarray(fields[k], jnp.float32)
  return out


@functools.lru_cache(maxsize=None)
def takes_state(fn) -> bool:
  """Whether ``fn`` (a route, loss or rule function) has a ``state`` parameter."""
  return "state" in inspect.signature(fn).parameters
