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

The MoE block itself is the ordinary :class:`~moejax.nn.moe_block.MoEFFN`
called with ``routed_x=h_prev``: routed and zero-computation experts, the
router, its losses and its state read the shortcut, the shared experts
(``moe.topology.num_shared_experts``) the current representation, as the
paper's shared expert does. The same holds under expert parallelism, where
the shortcut travels through the all-to-all instead of h.
"""

from __future__ import annotations

from typing import Optional

import jax


def shortcut_input(h: jax.Array, shortcut: Optional[jax.Array]) -> jax.Array:
  """The routed input of a ScMoE block: the previous block's FFN input, checked."""
  if shortcut is None or shortcut.shape != h.shape:
    raise ValueError(f"ScMoE block needs the previous block's FFN input of shape {h.shape}, "
                     f"got {None if shortcut is None else shortcut.shape}. Fix: the first "
                     "layer cannot be a ScMoE block (model.moe_layout='every_other')")
  return shortcut
