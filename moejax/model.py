"""A decoder-only transformer whose FFN slots are dense or MoE by layout.

Legend: B batch, S sequence length, T = B*S tokens, d model width, V
vocabulary, K expert slots per token, E routed experts, f expert hidden
width, F dense hidden width.

::

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits, aux = model(tokens, train=True, rng=key)   # f32[B, S, V], dict

Each block is pre-norm: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x)), where
ffn is a :class:`~moejax.nn.ffn.DenseFFN` or a
:class:`~moejax.nn.moe_block.MoEFFN` (``cfg.is_moe_layer(i)``), optionally
wrapped in a mixture-of-depths router (``cfg.is_mod_layer(i)``).

``aux``:

- ``loss`` f32[]: what the trainer adds to the cross-entropy: the sum over MoE
  layers of their weighted balance/z losses (``losses['total']``) plus the
  mixture-of-depths membership losses.
- ``moe``: ``{'layer_<i>': layer aux}`` per MoE layer i: ``losses``,
  ``metrics``, ``load`` f32[E], ``num_dropped``, and the routing decision
  ``expert_ids`` int32[B, S, K], ``weights`` f32[B, S, K], ``valid``
  bool[B, S, K] for specialisation analysis (sparse layers; tokens a MoD
  block skipped have valid False).
- ``mod``: ``{'layer_<i>': {'selected' bool[B, S], 'scores' f32[B, S],
  'loss'}}`` per mixture-of-depths block.

Router state (the aux-loss-free bias) lives in
:class:`~moejax.nn.moe_block.RouterStateVar` leaves, outside ``nnx.Param``;
a train-mode call writes the controller's update into them (see
:mod:`moejax.nn.moe_block`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, ModelConfig
from moejax.nn.attention import CausalSelfAttention
from moejax.nn.ffn import DenseFFN, ffn_params
from moejax.nn.mod import MoDBlock
from moejax.nn.moe_block import ExpertParallel, MoEFFN, RouterStateVar

__all__ = ["Transformer", "Block", "RouterStateVar", "ExpertParallel", "dense_equivalent",
           "active_ffn_params", "param_count", "check_buildable"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_buildable(cfg: ModelConfig) -> None:
  """Raises ConfigError for valid configs this model does not implement."""
  if cfg.attention == "mla":
    raise ConfigError("model.attention", cfg.attention,
                      "multi-head latent attention is only counted by the accounting "
                      "code, the model does not implement it",
                      "use model.attention='mha' (GQA through model.n_kv_heads)")
  if cfg.encoder_layers:
    raise ConfigError("model.encoder_layers", cfg.encoder_layers,
                      "the model is decoder-only", "set model.encoder_layers=0")
  if cfg.attn_head_dim % 2:
    raise ConfigError("model.head_dim", cfg.attn_head_dim,
                      "rotary embeddings rotate feature pairs, so the head width must be even",
                      "pick an even head_dim (or d_model / n_heads)")


class Block(nnx.Module):
  """One pre-norm transformer block: x[B, S, d] -> (x[B, S, d], moe aux or None)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs,
               shared_experts: Optional[dict] = None,
               expert_parallel: Optional[ExpertParallel] = None):
    dtype, d = _DTYPES[cfg.compute_dtype], cfg.d_model
    norm = lambda: nnx.RMSNorm(d, epsilon=1e-6, dtype=dtype, param_dtype=jnp.float32,
                               rngs=rngs)
    self.attn_norm = norm()
    self.attn = CausalSelfAttention(d, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim,
                                    use_bias=cfg.attention_bias, rope_base=cfg.rope_base,
                                    dtype=dtype, rngs=rngs)
    self.ffn_norm = norm()
    self.is_moe = cfg.is_moe_layer(layer)
    self.scmoe = self.is_moe and cfg.moe_schedule == "scmoe"
    if self.scmoe and expert_parallel is not None:
      raise ConfigError("model.moe_schedule", cfg.moe_schedule,
                        "the ScMoE block calls the single-device layer; expert "
                        "parallelism is wired for the serial schedule only",
                        "use model.moe_schedule='serial' or parallel.expert=1")
    if self.scmoe:
      from moejax.nn.scmoe import ScMoEFFN  # shortcut-connected schedule (moejax.nn.scmoe)
      self.ffn = ScMoEFFN(d, cfg.moe, dtype=dtype, rngs=rngs, shared_experts=shared_experts)
    elif self.is_moe:
      self.ffn = MoEFFN(d, cfg.moe, dtype=dtype, rngs=rngs, shared_experts=shared_experts,
                        expert_parallel=expert_parallel)
    else:
      self.ffn = DenseFFN(d, cfg.dense_ff_width, cfg.dense_activation, dtype=dtype,
                          rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, token_ids: jax.Array, *,
               train: bool = False, rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = (), shortcut: Optional[jax.Array] = None,
               return_tap: bool = False):
    """return_tap: also return h, the normalized FFN input (the next ScMoE block's shortcut)."""
    x = x + self.attn(self.attn_norm(x), positions)
    h = self.ffn_norm(x)
    if self.scmoe:
      out, aux = self.ffn(h, shortcut, token_ids, train=train, rng=rng, axis_names=axis_names)
    elif self.is_moe:
      out, aux = self.ffn(h, token_ids, train=train, rng=rng, axis_names=axis_names)
    else:
      out, aux = self.ffn(h), None
    return (x + out, aux, h) if return_tap else (x + out, aux)


class Transformer(nnx.Module):
  """Decoder-only LM: tokens int[B, S] -> (logits f32[B, S, V], aux).

  Expert sharing: the MoE layers, in order, form groups of
  ``cfg.expert_sharing_group``; every layer of a group uses the routed expert
  weights of the group's first layer (same nnx.Param objects) and its own
  router, shared experts and router state.

  ``expert_parallel``: every MoE block runs its layer expert-parallel on that
  mesh (:class:`~moejax.nn.moe_block.ExpertParallel`; the trainer passes it
  when ``parallel.expert > 1``); None: the single-device layer.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
               expert_parallel: Optional[ExpertParallel] = None):
    check_buildable(cfg)
    self.cfg = cfg
    dtype, d = _DTYPES[cfg.compute_dtype], cfg.d_model
    self.embed = nnx.Embed(cfg.vocab_size, d, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    blocks, group_experts, n_moe = [], None, 0
    for i in range(cfg.n_layers):
      share = None
      if cfg.is_moe_layer(i):
        share = group_experts if n_moe % cfg.expert_sharing_group else None
      block = Block(cfg, i, rngs=rngs, shared_experts=share,
                    expert_parallel=expert_parallel)
      if cfg.is_moe_layer(i):
        if n_moe % cfg.expert_sharing_group == 0:
          group_experts = block.ffn.params.get("experts")
        n_moe += 1
      if cfg.is_mod_layer(i):
        block = MoDBlock(block, d, capacity=cfg.mod_capacity, gate=cfg.mod_gate,
                         aux_loss_coef=cfg.mod_aux_loss_coef, rngs=rngs)
      blocks.append(block)
    self.blocks = nnx.List(blocks)
    self.final_norm = nnx.RMSNorm(d, epsilon=1e-6, dtype=dtype, param_dtype=jnp.float32,
                                  rngs=rngs)
    if not cfg.tie_embeddings:
      # The head runs in float32 whatever the compute dtype: logits feed a
      # softmax over V, where bf16 rounding is a visible loss error.
      self.lm_head = nnx.Linear(d, cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                                param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, train: bool = False,
               rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = ()) -> tuple[jax.Array, dict]:
    """tokens int[B, S] -> (logits f32[B, S, V], aux); see the module docstring.

    rng: key for router noise / jitter (training); layer i uses fold_in(rng, i).
    axis_names: mesh axes to reduce global MoE statistics over under shard_map.
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Transformer: tokens must be int[B, S], got {tokens.dtype}"
                       f"{list(tokens.shape)}; add a batch axis / cast to int32")
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = self.embed(tokens)
    aux = {"loss": jnp.zeros((), jnp.float32), "moe": {}, "mod": {}}
    tap = None  # ScMoE: the previous block's normalized FFN input
    for i, block in enumerate(self.blocks):
      key = None if rng is None else jax.random.fold_in(rng, i)
      kw = dict(train=train, rng=key, axis_names=axis_names)
      if isinstance(block, MoDBlock):
        x, moe_aux, mod_aux = block(x, positions, tokens, **kw)
        aux["mod"][f"layer_{i}"] = mod_aux
        aux["loss"] = aux["loss"] + mod_aux["loss"]
      elif self.cfg.moe_schedule == "scmoe":
        x, moe_aux, tap = block(x, positions, tokens, shortcut=tap, return_tap=True, **kw)
      else:
        x, moe_aux = block(x, positions, tokens, **kw)
      if moe_aux is not None:
        aux["moe"][f"layer_{i}"] = moe_aux
        aux["loss"] = aux["loss"] + moe_aux["losses"]["total"].astype(jnp.float32)
    x = self.final_norm(x).astype(jnp.float32)
    if self.cfg.tie_embeddings:
      # T5's convention for a tied head: rescale by d^-1/2, since the
      # embedding is initialised at unit scale for the input side.
      logits = self.embed.attend(x) * (self.cfg.d_model ** -0.5)
      logits = logits.astype(jnp.float32)
    else:
      logits = self.lm_head(x)
    return logits, aux


def param_count(model: nnx.Module, filter=nnx.Param) -> int:
  """Number of scalars in the model's ``filter`` state (shared weights once).

  Equals ``accounting.budget(cfg).total`` except for heterogeneous experts
  (``moe.expert_widths``), whose stacked arrays hold zero padding up to the
  widest expert that the accounting does not count.
  """
  return sum(int(v.size) for v in jax.tree.leaves(nnx.state(model, filter)))


def _moe_ffn_active(cfg: ModelConfig) -> float:
  """Expected active FFN params per token of one MoE layer: routed + shared experts.

  The conventions are :mod:`moejax.topology.accounting`'s: K E / (E + Z)
  FFN slots per token (the rest land on zero-computation experts), c experts
  per token for expert choice, top_k for top-p, each at the mean expert size.
  The router's d*E weights are not FFN params.
  """
  moe = cfg.moe
  if moe.kind != "sparse":
    raise ConfigError("moe.kind", moe.kind,
                      "a per-token active FFN width is defined for routed (sparse) layers",
                      "build the dense baseline by hand for soft / peer layers")
  from moejax.topology import accounting  # one convention for "active", not a copy of it
  comps = accounting.moe_components(moe, cfg.d_model, seq_len=1)
  return sum(comps[name].active for name in ("routed_experts", "shared_experts")
             if name in comps)


def active_ffn_params(cfg: ModelConfig) -> float:
  """Active FFN params per token summed over all layers."""
  dense = ffn_params(cfg.d_model, cfg.dense_ff_width, cfg.dense_activation)
  return sum(_moe_ffn_active(cfg) if cfg.is_moe_layer(i) else dense
             for i in range(cfg.n_layers))


def dense_equivalent(cfg: ModelConfig) -> ModelConfig:
  """The dense baseline (moe=None) with the same active FFN params per token.

  Every layer gets one width F. With ``moe_layout='all'`` it uses the
  experts' activation and F = K*f + K_s*f_s exactly (for swiglu and gelu
  alike: both count (3 or 2)*d per hidden unit). With dense layers in the
  layout, F is the layer average of the active FFN params, in the dense
  activation, rounded to the nearest integer (the mismatch is then at most
  n_layers * 3d / 2 params). Attention, embeddings, MoD and dtype are kept;
  router params (d*E per layer) are not matched.
  """
  if cfg.moe is None:
    return cfg
  act = cfg.moe.activation if all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)) \
      else cfg.dense_activation
  per_layer = active_ffn_params(cfg) / cfg.n_layers
  width = max(1, int(round(per_layer / ffn_params(cfg.d_model, 1, act))))
  return dataclasses.replace(cfg, moe=None, dense_ff_width=width, dense_activation=act,
                             moe_layout="all", first_dense_layers=0, expert_sharing_group=1)
