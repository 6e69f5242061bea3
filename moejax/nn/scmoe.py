"""Shortcut-connected MoE (ScMoE, Cai et al. arXiv 2404.05019), ``model.moe_schedule='scmoe'``.

Legend: B batch, S sequence length, d model width.

In the serial schedule an MoE block computes

    x' = x + attn(norm_a(x));  h = norm_f(x');  x'' = x' + shared(h) + routed(h)

so the routed experts' dispatch all-to-all can only start after the block's
attention, and everything after it waits for the combine. ScMoE feeds the
routed experts a *shortcut* from the previous block instead:

    routed input  = h_prev = norm_f of block i-1 (what block i-1's FFN reads)
    x'' = x' + shared(h) + routed(h_prev)

The routed branch then depends on nothing computed in block i-1's FFN or in
block i's attention and shared experts, so its all-to-all (and expert
compute) can run while they do; XLA's scheduler is free to overlap them
because the data dependency is gone. The paper pairs dense and MoE blocks
(``moe_layout='every_other'``) and taps the preceding block's intermediate
representation; we tap block i-1's normalized FFN input, which costs no extra
parameter, so a ScMoE arm has exactly the parameters and FLOPs of its serial
arm (the equal-budget "serial EP vs ScMoE" ablation).

Shared experts (``moe.num_shared_experts``) stay on the current
representation, as the paper's shared expert does; routed and
zero-computation experts, the router, its losses and its state all read the
shortcut.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax

from moejax.nn.moe_block import MoEFFN, _aux_for_model, _assign, values


class ScMoEFFN(MoEFFN):
  """The FFN slot of a ScMoE block: (h[B, S, d], h_prev[B, S, d]) -> (y[B, S, d], aux).

  Same parameters and router state as :class:`MoEFFN` for the same config.
  """

  def __call__(self, x: jax.Array, shortcut: Optional[jax.Array], token_ids: jax.Array, *,
               train: bool = False, rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = ()) -> tuple[jax.Array, dict]:
    """x: this block's normalized FFN input; shortcut: the previous block's."""
    from moejax import layer as layer_lib
    from moejax.topology import experts as experts_lib
    if shortcut is None or shortcut.shape != x.shape:
      raise ValueError(f"ScMoE block needs the previous block's FFN input of shape {x.shape}, "
                       f"got {None if shortcut is None else shortcut.shape}. Fix: the first "
                       "layer cannot be a ScMoE block (model.moe_layout='every_other')")
    params = values(self.params)
    params = {k: (v if k == "router" else jax.tree.map(lambda a: a.astype(self.dtype), v))
              for k, v in params.items()}
    shared = params.pop("shared", None)
    routed_cfg = dataclasses.replace(self.cfg, num_shared_experts=0, shared_expert_width=None,
                                     shared_expert_gate=False)
    y, new_state, aux = layer_lib.moe_layer(
        params, shortcut, values(self.router_state), routed_cfg, token_ids=token_ids,
        rng=rng, train=train, axis_names=axis_names)
    if shared is not None:
      d = x.shape[-1]
      y = y + experts_lib.apply_shared(shared, x.reshape(-1, d)).reshape(x.shape).astype(
          y.dtype)
    if train:
      _assign(self.router_state, new_state)
    return y.astype(x.dtype), _aux_for_model(aux, x.shape[:2])

