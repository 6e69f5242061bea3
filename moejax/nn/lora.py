"""LoRA adapters (Hu et al. 2106.09685): W + (alpha / r) A B with A random and B zero.

Legend: B batch, S sequence length, d model width, E routed experts, i / o
the input / output width of an adapted matrix, r the adapter rank.

Two kinds, the same formula:

- :class:`LoRALinear`: an ``nnx.LoRALinear`` (flax's adapter on a Linear:
  ``lora.lora_a`` [i, r], ``lora.lora_b`` [r, o]) whose adapter output is
  scaled by alpha / r. It takes over an existing ``nnx.Linear``'s kernel
  (and bias), so the base weights keep their paths in the params tree
  (``attn/q_proj/kernel``) and a checkpoint of the base model loads into it
  as it is; only ``.../lora/lora_a`` and ``lora_b`` are new.
- MoE adapters (:func:`init_moe_adapters`): per routed expert, A_e [E, i, r]
  and B_e [E, r, o] on each expert matrix (w_gate, w_up [E, d, f], w_down
  [E, f, d]), and A [i, r], B [r, o] on a shared expert's matrices. A gated
  expert stack stores W_gate and W_up as one ``w_gate_up`` [E, d, 2f]; they
  are still two matrices with an adapter each (rank r apiece, not one rank-r
  adapter across both), merged into their own half.
  :func:`merge_adapters` forms W_e + (alpha / r) A_e B_e *before* the MoE
  layer runs, so the executor sees ordinary expert weights: every grouped-
  matmul backend, the reference executor and expert parallelism run the
  adapted experts unchanged, and the gradient reaches A_e and B_e through
  the merge. The price is one merged copy of the expert weights per layer
  in the forward (what :mod:`moejax.finetune.accounting` counts), instead
  of per-token rank-r products that would need a second grouped matmul.

Parameters added by rank r: r (i + o) per adapted matrix, times E for an
expert stack. B starts at zero, so an adapted model computes exactly what
its base model computes until the first update.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.topology import experts as experts_lib
from moejax.topology import roles

# Expert / shared-expert matrices that get adapters (the shared expert's gate
# [d, 1] is a scalar gate, not a projection, and is left alone).
ADAPTED_KEYS = ("w_gate", "w_up", "w_down")


class LoRAParam(nnx.LoRAParam):
  """A LoRA adapter weight (an ``nnx.Param``: the optimizer sees it)."""


class LoRALinear(nnx.LoRALinear):
  """``base(x) + (alpha / r) x A B``, sharing ``base``'s kernel and bias Variables."""

  def __init__(self, base: nnx.Linear, rank: int, scale: float, *, rngs: nnx.Rngs):
    super().__init__(base.in_features, base.out_features, lora_rank=rank,
                     use_bias=base.use_bias, dtype=base.dtype, param_dtype=base.param_dtype,
                     lora_dtype=base.dtype, lora_param_dtype=base.param_dtype,
                     lora_param_type=LoRAParam, rngs=rngs)
    self.kernel = base.kernel
    if base.use_bias:
      self.bias = base.bias
    self.lora_scale = float(scale)

  def param_roles(self) -> dict:
    """The adapters A [in, r] and B [r, out] are element-wise (AdamW), as in every LoRA recipe;
    the base kernel keeps the role its owner declared."""
    return {"lora": roles.elementwise("adapter")}

  def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
    y = nnx.Linear.__call__(self, x, out_sharding=out_sharding)
    return y + self.lora(x) * jnp.asarray(self.lora_scale, y.dtype)


def adapter_params(shape: tuple, rank: int) -> int:
  """Parameters of one adapter on a matrix [..., i, o]: prod(...) * r * (i + o)."""
  *lead, i, o = shape
  n = 1
  for s in lead:
    n *= s
  return n * rank * (i + o)


def init_adapter(key: jax.Array, shape: tuple, rank: int) -> dict:
  """{'a': [..., i, r] he-uniform (fan-in i, flax's LoRA default), 'b': [..., r, o] zeros}."""
  *lead, i, o = shape
  init = nnx.initializers.he_uniform(in_axis=-2, out_axis=-1,
                                     batch_axis=tuple(range(len(lead))))  # per expert
  a = init(key, (*lead, i, rank), jnp.float32)
  return {"a": a, "b": jnp.zeros((*lead, rank, o), jnp.float32)}


def _matrices(params: Mapping[str, Any]) -> dict:
  """{name: shape} of the adapted matrices of a params group, 'w_gate_up' [..., 2f] seen
  as its two halves 'w_gate' and 'w_up' [..., f]."""
  shapes = {k: tuple(v.shape) for k, v in params.items()}
  if experts_lib.GATE_UP in shapes:
    *lead, two_f = shapes.pop(experts_lib.GATE_UP)
    shapes["w_gate"] = shapes["w_up"] = (*lead, two_f // 2)
  return {k: shapes[k] for k in ADAPTED_KEYS if k in shapes}


def init_moe_adapters(key: jax.Array, params: Mapping[str, Any], targets, rank: int) -> dict:
  """Adapters for a MoE layer's params: ``targets`` among ``experts`` and ``shared``.

  Returns ``{sub: {matrix: {'a', 'b'}}}`` for every matrix of
  :data:`ADAPTED_KEYS` the layer's ``params[sub]`` has ('w_gate' and 'w_up'
  for a stored 'w_gate_up').
  """
  out = {}
  for sub in targets:
    if sub not in params:
      continue
    mats = _matrices(params[sub])
    keys = jax.random.split(jax.random.fold_in(key, len(sub)), len(mats))
    out[sub] = {k: init_adapter(kk, shape, rank) for (k, shape), kk in zip(mats.items(), keys)}
  return out


def merge_adapters(params: Mapping[str, Any], adapters: Mapping[str, Any],
                   scale: float) -> dict:
  """``params`` with W + scale * A B for every adapter (W_e + scale A_e B_e per expert)."""
  out = dict(params)
  for sub, mats in adapters.items():
    merged = dict(out[sub])
    deltas = {k: jnp.matmul(ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32))
              for k, ab in mats.items()}
    if experts_lib.GATE_UP in merged and {"w_gate", "w_up"} & set(deltas):
      # Each half of [W_gate | W_up] gets its own matrix's update (zero without one).
      w = merged[experts_lib.GATE_UP]
      zero = jnp.zeros(w.shape[:-1] + (w.shape[-1] // 2,), jnp.float32)
      deltas[experts_lib.GATE_UP] = experts_lib.fuse_gate_up(deltas.pop("w_gate", zero),
                                                              deltas.pop("w_up", zero))
    for k, delta in deltas.items():
      w = merged[k]
      merged[k] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    out[sub] = merged
  return out


def merge_tree(params: Any, scale: float) -> Any:
  """A model's pure-dict params with every adapter merged into its base weights and dropped.

  ``{'kernel', 'lora': {'lora_a', 'lora_b'}}`` (a :class:`LoRALinear`)
  becomes ``{'kernel': kernel + scale a b}``; a MoE layer's ``adapters``
  subtree is merged into its ``params`` (:func:`merge_adapters`). Trees
  without adapters come back unchanged (as new dicts).
  """
  if not isinstance(params, Mapping):
    return params
  out = {k: merge_tree(v, scale) for k, v in params.items() if k not in ("lora", "adapters")}
  lora = params.get("lora")
  if isinstance(lora, Mapping) and "lora_a" in lora:
    delta = jnp.matmul(jnp.asarray(lora["lora_a"], jnp.float32),
                       jnp.asarray(lora["lora_b"], jnp.float32))
    k = out["kernel"]
    out["kernel"] = (jnp.asarray(k, jnp.float32) + scale * delta).astype(jnp.asarray(k).dtype)
  adapters = params.get("adapters")
  if isinstance(adapters, Mapping) and "params" in out:
    out["params"] = merge_adapters(out["params"], adapters, scale)
  return out


def split_tree(params: Any) -> tuple[Any, dict]:
  """(base params without adapters, {path: adapter subtree}) of a pure-dict params tree."""
  adapters: dict = {}

  def walk(node, path):
    if not isinstance(node, Mapping):
      return node
    base = {}
    for k, v in node.items():
      if k in ("lora", "adapters"):
        adapters[path + (k,)] = v
      else:
        base[k] = walk(v, path + (k,))
    return base

  return walk(params, ()), adapters
