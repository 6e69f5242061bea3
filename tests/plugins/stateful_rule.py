"""A stateful bias-controller rule from outside the package: ``ema_sign``.

The sign rule of Wang et al. (2408.15664) on an exponential moving average
of each expert's share of the routed copies instead of the step's own load.
The EMA is per-layer state declared through the public API
(``register_bias_rule(..., state=IdeaState(...))``): initialised from the
config, observed in every forward (copies per expert and the batch's token
count, sums over the whole batch), moved once per optimizer step outside the
gradient, checkpointed with the router state and logged as
``state/ema_sign/<field>``. This is the example of
``moejax/balance/rules.py``'s docstring, run as written.
"""

import jax.numpy as jnp

from moejax.balance import register_bias_rule
from moejax.routing import IdeaState

DECAY = 0.9


def _init(cfg):
  return {"ema": jnp.zeros((cfg.num_routed,), jnp.float32),
          "updates": jnp.zeros((), jnp.int32)}


def _observe(result, cfg, *, state, context):
  return {"load": context.sum(result.mask()), "tokens": context.num_tokens}


def _update(own, seen, cfg):
  share = seen["load"] / jnp.maximum(seen["tokens"], 1.0)
  return {"ema": DECAY * own["ema"] + (1 - DECAY) * share, "updates": own["updates"] + 1}


@register_bias_rule("ema_sign", state=IdeaState(_init, _update, _observe))
def ema_sign(load, mean, rate, state):
  del load, mean
  ema = state["ema_sign"]["ema"]
  return rate * jnp.sign(jnp.mean(ema) - ema)
