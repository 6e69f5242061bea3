"""Cached decoding of a :class:`~moejax.model.Transformer`: prefill, then one token per step.

Legend: B batch (prompts), P prompt slots (the longest prompt), S new tokens
of one call (P at prefill, 1 per decode step), C cache slots (P + new
tokens), d model width, V vocabulary, K expert slots per token, E FFN
experts, L_moe MoE layers.

::

    dec = Decoder(model)                           # checks the model is decodable
    caches = dec.init_caches(batch=B, capacity=C)
    logits, caches, info = dec.extend(tokens, positions, write, caches, index=0)   # prefill
    logits, caches, info = dec.extend(next_tok[:, None], pos[:, None], ones, caches, index=P)

:func:`moejax.serve.generate.generate` wraps this into prompts in, text out.

The walk over the model's blocks lives here, not in ``moejax.model``: it is
``Block.__call__`` with the attention swapped for its cached call
(:meth:`~moejax.nn.attention.CausalSelfAttention.extend`) and the FFN slots
called as the model calls them (``block.ffn(h, token_ids, train=False)``),
so MoE routing, shared / zero-computation experts, PEER and ScMoE run the
model's own code. A test checks, for every decodable configuration, that
cached decoding gives the logits of the model's full forward at every
position.

What decoding does with each MoE choice (:func:`check_decodable`):

- **Causal token-choice routers** (top-k softmax / sigmoid, group-limited,
  hash, top-p, hierarchical, zero-computation and shared experts, PEER):
  decoded as they are; a token's experts depend on that token alone.
- **Capacity** (``moe.balance.capacity_factor``): at inference the layer runs
  *dropless*. Which tokens an expert drops depends on the other tokens of
  the batch (and on their order), so a capacity-limited layer gives a
  token different outputs in a full forward, at prefill and in a decode
  step of B tokens; dropless is what serving systems run (Mixtral, Qwen and
  DeepSeek inference code have no capacity) and what a trained capacity
  model's exported HF layer computes. Decoding a capacity-trained model
  therefore equals the full forward of its dropless twin (same weights),
  not its training-time forward when that forward dropped tokens.
- **Expert choice** and **Soft MoE** are refused: each expert picks tokens
  (or mixes slots) over the whole sequence, so a token's output depends on
  later tokens; there is no one-token-at-a-time computation of the trained
  function.
- **Mixture-of-depths** blocks pick the top-k tokens of a sequence, which is
  not causal either. Decoding uses the paper's causal rule (Raposo et al.
  2404.02258, Sec. 3.5): token t goes through the block iff sigmoid(r_t) >
  0.5, i.e. its router score r_t > 0, scaled by its gate as in training; the
  cache marks a skipped token's slot invalid, so later tokens of that block
  attend only to processed tokens, as in training. This matches the trained
  function only as far as the router learned to predict top-k membership
  (``model.mod_aux_loss_coef`` > 0); :func:`causal_mod_forward` is the
  full-sequence function of the same rule, and the test checks decoding
  against it.

Jitting: one compile per (B, S, C) shape; the model is split once into a
static graphdef and a state pytree, and the caches are donated, so a decode
step updates them in place.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, ModelConfig, apply_overrides
from moejax.config.registry import ROUTERS
from moejax.nn.mod import MoDBlock
from moejax.nn.scmoe import shortcut_input
from moejax.routing import replay as replay_lib
from moejax.serve import quantize as quant_lib

# Config paths this module reads and writes, in one place.
FIELD_MOE_KIND = "model.moe.kind"
FIELD_ROUTER_KIND = "model.moe.routing.kind"
FIELD_CAPACITY = "model.moe.balance.capacity_factor"
FIELD_BACKEND = "model.moe.execution.backend"

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _get(cfg: ModelConfig, field: str) -> Any:
  """The value at a ``model.a.b`` path of a ModelConfig."""
  value = cfg
  for part in field.split(".")[1:]:
    value = getattr(value, part)
  return value


# ---------------------------------------------------------------------------
# What can be decoded.

def check_decodable(cfg: ModelConfig) -> None:
  """Raises ConfigError, naming the field and why, for models with a non-causal MoE layer.

  Mixture-of-depths and capacity are not refused (see the module docstring).
  """
  if cfg.moe is None:
    return
  moe = cfg.moe
  if not moe.layer.causal:
    raise ConfigError(
        FIELD_MOE_KIND, moe.kind,
        f"{moe.layer.why_not_causal}: it is not causal and cannot be decoded one token at "
        "a time", "decode a model with moe.kind='sparse' and a token-choice router, or 'peer'")
  if moe.layer.routed and not moe.router.causal:
    causal = [n for n in ROUTERS.names() if ROUTERS.get(n).causal]
    raise ConfigError(
        FIELD_ROUTER_KIND, moe.routing.kind,
        f"{moe.router.why_not_causal}, so whether token t reaches an expert depends on later "
        "tokens: it is not causal and cannot be decoded one token at a time",
        f"decode a causal router ({', '.join(causal)})")


def serving_config(cfg: ModelConfig, backend: Optional[str] = None) -> ModelConfig:
  """The config decoding runs: dropless (capacity_factor=None), optionally another backend."""
  if cfg.moe is None:
    return cfg
  changes: dict[str, Any] = {}
  if cfg.moe.layer.routed and _get(cfg, FIELD_CAPACITY) is not None:
    changes[FIELD_CAPACITY] = None
  if backend is not None:
    changes[FIELD_BACKEND] = backend
  if not changes:
    return cfg
  # apply_overrides validates the result like any config (a bad backend name is an error).
  return apply_overrides(cfg, {k.removeprefix("model."): v for k, v in changes.items()})


def serving_model(model: nnx.Module, backend: Optional[str] = None) -> nnx.Module:
  """``model`` rebuilt with :func:`serving_config` and the same state (no copy when equal).

  The rebuild is abstract (``nnx.eval_shape``): no random init of a second
  set of weights; the original state is then put in place.
  """
  cfg = serving_config(model.cfg, backend)
  if cfg == model.cfg:
    return model
  new = nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0)))
  nnx.update(new, nnx.state(model))
  return new


# ---------------------------------------------------------------------------
# The walk over the blocks.

def _attention_of(block) -> Any:
  inner = block.block if isinstance(block, MoDBlock) else block
  return inner.attn


def _dense_block(block, x, positions, token_ids, cache, index, write, tap, replay=None):
  """``Block.__call__`` with the cached attention: (x, cache, moe aux or None, FFN input h)."""
  a, cache = block.attn.extend(block.attn_norm(x), positions, cache, index, write)
  x = x + a
  h = block.ffn_norm(x)
  if block.is_moe:
    quant_lib.materialize(block.ffn)  # quantised experts -> compute dtype, this layer only
  if block.is_moe:
    # ScMoE: the routed experts read the previous block's FFN input (the tap).
    out, aux = block.ffn(h, token_ids, train=False,
                         routed_x=shortcut_input(h, tap) if block.scmoe else None,
                         replay=replay)
  else:
    out, aux = block.ffn(h), None
  return x + out, cache, aux, h


def _mod_block(block: MoDBlock, x, positions, token_ids, cache, index, write):
  """A mixture-of-depths block under the causal rule: processed iff router score > 0."""
  scores = block.router(x.astype(jnp.float32))[..., 0]  # [B, S]
  selected = scores > 0.0  # sigmoid(r) > 0.5
  out, cache, aux, _ = _dense_block(block.block, x, positions, token_ids, cache, index,
                                    write & selected, None)
  g = jax.nn.sigmoid(scores) if block.gate == "sigmoid" else scores
  x_out = jnp.where(selected[..., None], x + (g[..., None] * (out - x)).astype(x.dtype), x)
  if aux is not None and "valid" in aux:
    aux = dict(aux, valid=aux["valid"] & selected[..., None])
  return x_out, cache, aux, selected


def _head(model, x: jax.Array) -> jax.Array:
  """Final norm and LM head, as ``Transformer.__call__`` ends."""
  x = model.final_norm(x).astype(jnp.float32)
  if model.cfg.tie_embeddings:
    return (model.embed.attend(x) * (model.cfg.d_model ** -0.5)).astype(jnp.float32)
  return model.lm_head(x)


def _touched(aux: dict, write: jax.Array, num_experts: int) -> jax.Array:
  """int32[]: distinct FFN experts that at least one written token of this call used."""
  ids, valid = aux["expert_ids"], aux["valid"] & write[..., None]  # [B, S, K]
  valid = valid & (ids < num_experts)
  hit = jnp.zeros((num_experts,), bool).at[jnp.where(valid, ids, num_experts)].set(
      True, mode="drop")
  return jnp.sum(hit).astype(jnp.int32)


def extend_model(model, tokens: jax.Array, positions: jax.Array, write: jax.Array,
                 caches: tuple, index: jax.Array, *, last_only: bool = False,
                 replay: Optional[dict] = None):
  """One cached call of the whole model (not jitted; :class:`Decoder` jits it).

  Args:
    model: a decodable Transformer (:func:`check_decodable`).
    tokens, positions: int32[B, S] new token ids and their rotary positions.
    write: bool[B, S] tokens that later queries may attend to (False: padding).
    caches: one cache per block (its attention's: :class:`~moejax.nn.attention.KVCache`,
      :class:`~moejax.nn.mla.LatentCache`).
    index: int32[] cache slot of the first new token.
    last_only: return logits of the last new token only ([B, 1, V]).
    replay: ``{'layer_<i>': RoutingReplay [B, S, K]}``, the new tokens' recorded
      selection in every routed MoE layer (routing replay,
      :mod:`moejax.routing.replay`): the experts are the recorded ones, their
      weights the router's of this call.

  Returns:
    (logits f32[B, S or 1, V], new caches, info) where info has
    ``experts_touched`` int32[L_moe] (distinct FFN experts the written tokens
    used, per MoE layer), ``expert_ids`` / ``valid`` per MoE layer
    ([B, S, K]) and ``mod_selected`` bool[B, S] per MoD block.
  """
  x = model.embed(tokens)
  new_caches, touched, routing, mod_sel = [], [], {}, {}
  tap = None
  if replay is not None:
    replay_lib.check_layers(replay, model.replay_layers(), "extend_model(replay=)")
  for i, (block, cache) in enumerate(zip(model.blocks, caches)):
    if isinstance(block, MoDBlock):
      x, cache, aux, sel = _mod_block(block, x, positions, tokens, cache, index, write)
      mod_sel[f"layer_{i}"] = sel
    else:
      x, cache, aux, tap = _dense_block(block, x, positions, tokens, cache, index, write, tap,
                                        None if replay is None else replay.get(f"layer_{i}"))
    new_caches.append(cache)
    if aux is not None and "expert_ids" in aux:
      routing[f"layer_{i}"] = {"expert_ids": aux["expert_ids"], "valid": aux["valid"]}
      touched.append(_touched(aux, write, model.cfg.moe.num_experts))
  if last_only:
    x = x[:, -1:]
  info = {"experts_touched": jnp.stack(touched) if touched else jnp.zeros((0,), jnp.int32),
          "routing": routing, "mod_selected": mod_sel}
  return _head(model, x), tuple(new_caches), info


def causal_mod_forward(model, tokens: jax.Array):
  """Full-sequence logits f32[B, S, V] of a model whose MoD blocks use the causal rule.

  The reference for decoding MoD models: every block runs over the whole
  sequence (through an empty cache of S slots); for models without MoD
  blocks it is the model's own forward up to rounding.
  """
  b, s = tokens.shape
  caches = init_caches(model, b, s)
  positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  logits, _, _ = extend_model(model, tokens, positions, jnp.ones((b, s), bool), caches,
                              jnp.zeros((), jnp.int32))
  return logits


def init_caches(model, batch: int, capacity: int) -> tuple:
  """Empty caches (one per block, its attention kind's) of ``capacity`` slots, compute dtype."""
  dtype = _DTYPES[model.cfg.compute_dtype]
  return tuple(_attention_of(block).init_cache(batch, capacity, dtype)
               for block in model.blocks)


def cache_bytes(caches: tuple) -> int:
  """Bytes the caches hold (keys, values and the validity masks)."""
  return sum(int(a.nbytes) for a in jax.tree.leaves(caches))


# ---------------------------------------------------------------------------
# The jitted decoder.

@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(5,))
def _extend_jit(graphdef, state, tokens, positions, write, caches, index, last_only,
                replay=None):
  model = nnx.merge(graphdef, state)
  return extend_model(model, tokens, positions, write, caches, index, last_only=last_only,
                      replay=replay)


class Decoder:
  """A decodable model split for jit: cached calls of the whole model.

  Args:
    model: a Transformer (float or with experts quantised by
      :func:`moejax.serve.quantize.quantize_model`).
    backend: optional MoE execution backend for serving (default: the
      model's own ``moe.execution.backend``).

  Capacity-limited MoE layers run dropless (module docstring). Raises
  ConfigError for non-causal MoE layers.
  """

  def __init__(self, model: nnx.Module, *, backend: Optional[str] = None):
    check_decodable(model.cfg)
    model = serving_model(model, backend)
    self.cfg: ModelConfig = model.cfg
    self.graphdef, self.state = nnx.split(model)

  @property
  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.state)

  def init_caches(self, batch: int, capacity: int) -> tuple:
    return init_caches(self.model, batch, capacity)

  def extend(self, tokens, positions, write, caches, index, *, last_only: bool = False,
             replay: Optional[dict] = None):
    """Jitted :func:`extend_model`; ``caches`` is donated (do not reuse it).
    ``replay``: the new tokens' recorded selections, as :func:`extend_model`'s."""
    c = caches[0].valid.shape[1]  # every attention kind's cache has its validity mask
    s = tokens.shape[1]
    if isinstance(index, int) and index + s > c:
      raise ValueError(f"cache overflow: {s} new tokens at slot {index} exceed the cache's "
                       f"{c} slots. Fix: init_caches(capacity >= {index + s})")
    return _extend_jit(self.graphdef, self.state, jnp.asarray(tokens, jnp.int32),
                       jnp.asarray(positions, jnp.int32), jnp.asarray(write, bool), caches,
                       jnp.asarray(index, jnp.int32), last_only, replay)
