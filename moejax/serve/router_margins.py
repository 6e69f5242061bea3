"""The near-tie margin of each token at each routed layer of a model's reference forward.

Legend: B sequences, S tokens per sequence, T = B*S, d model width, E_r
router outputs, K = ``moe.routing.top_k``.

A token's margin at a layer is the gap between its K-th and (K+1)-th
selection key (:func:`moejax.evaluate.consistency.topk_margin`): the router
scores plus the selection bias where the router uses one, group-limited
(:func:`moejax.routing.topk.selection_key`), from the layer's own input and
router weights. A perturbation that moves the key by less than the margin
cannot flip that token, so the margins' histogram says where flips can land.

It applies to token-choice routers that read activations with one linear
router (``params['router']['w']``); expert choice (an expert's choice over
tokens) and hash routing (no scores) have no per-token margin. Tokens whose
(K+1)-th key is masked out by group limiting (-inf) have an infinite margin
and are left out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from moejax.evaluate import consistency as consistency_lib
from moejax.routing.logits import router_logits
from moejax.routing.scores import scores
from moejax.routing.topk import selection_key


def why_not(model) -> str:
  """'' when the model's routed layers have per-token margins, else why not."""
  cfg = model.cfg
  if cfg.moe is None or not cfg.moe.layer.routed:
    return "the model has no routed MoE layer"
  spec = cfg.moe.router
  if not (spec.token_choice and spec.reads_activations):
    return (f"router {cfg.moe.routing.kind!r} has no per-token score ranking (token_choice="
            f"{spec.token_choice}, reads_activations={spec.reads_activations})")
  if cfg.moe_schedule != "serial" or any(cfg.is_mod_layer(i) for i in range(cfg.n_layers)):
    return "margins read each MoE block's own input: serial schedule, no mixture-of-depths"
  if any("w" not in ffn.params["router"] for ffn in model.moe_ffns().values()):
    return "a router without one linear weight params['router']['w']"
  return ""


def margins(model, tokens) -> dict[str, np.ndarray]:
  """``{'layer_<i>': f32[n]}``: the finite margins of the layer's tokens (see the module doc)."""
  tokens = jnp.asarray(np.asarray(tokens), jnp.int32)
  b, s = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  cfg = model.cfg.moe
  x = model.embed(tokens)
  out = {}
  for i, block in enumerate(model.blocks):
    if block.is_moe:
      # The block's FFN input, as Block.__call__ computes it.
      h = block.ffn_norm(x + block.attn(block.attn_norm(x), positions))
      ffn = block.ffn
      logits = router_logits(ffn.params["router"]["w"][...], h.reshape(b * s, -1), cfg.routing,
                             None, False)
      bias = ffn.router_state.bias[...] if cfg.routing.use_bias else None
      key = selection_key(scores(logits, cfg.routing.score_fn), bias, cfg)
      m = np.asarray(consistency_lib.topk_margin(key, cfg.routing.top_k))
      out[f"layer_{i}"] = m[np.isfinite(m)]
    x, _ = block(x, positions, tokens)
  return out
