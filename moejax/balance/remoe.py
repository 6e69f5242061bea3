"""ReMoE's L1 penalty (``remoe_l1``): lambda x the mean L1 of a token's ReLU gates.

The router (``routing.kind='remoe'``, :mod:`moejax.routing.remoe`) declares
lambda as its state and moves it once per optimizer step toward the target
active experts per token; this loss reads it (Wang, Zhu and Chen, arXiv
2412.14711, Sections 3.3-3.4). Used as ``moe.balance.extra_losses=(('remoe_l1',
1.0),)``: the coefficient there multiplies lambda (1.0 is the paper's
objective), and the penalty is logged as ``balance/remoe_l1``.

Legend: T tokens on this device, N T the tokens of the batch, E FFN experts,
k = routing.top_k the target.

    plain:     L = lambda mean_t sum_e g[t, e]
    balanced:  L = lambda mean_t sum_e f[e] g[t, e],  f[e] = E / (k N T) sum_t 1[g[t, e] > 0]

f is the expert's share of the active slots of the whole batch (through the
routing context, without gradient), so a busy expert's gates are pushed down
harder. The mean over tokens is this device's; the expert-parallel layer
averages the devices' values (equal shares), which is the batch's mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moejax.balance.rules import register_loss

ROUTER = "remoe"  # the router whose state holds lambda


@register_loss("remoe_l1")
def remoe_l1(result, cfg, *, batch_shape, axis_names, context, state):
  del batch_shape, axis_names
  if ROUTER not in state:
    raise ValueError(f"moe.balance.extra_losses: 'remoe_l1' reads the state of "
                     f"routing.kind='{ROUTER}', but the router is {cfg.routing.kind!r}. Fix: "
                     f"set moe.routing.kind='{ROUTER}' or remove 'remoe_l1'")
  e = cfg.num_experts
  gates = result.combine_weights()[:, :e]                       # [T, E], >= 0
  if cfg.routing.opts.balanced:
    share = context.mean((gates > 0).astype(jnp.float32))       # [E], the batch's
    f = jax.lax.stop_gradient(share * e / cfg.routing.top_k)
    per_token = jnp.sum(gates * f, axis=-1)
  else:
    per_token = jnp.sum(gates, axis=-1)
  return state[ROUTER]["coef"] * jnp.mean(per_token)
