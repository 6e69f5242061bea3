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
- ``moe``: ``{'layer_<i>': layer aux}`` per MoE layer i, a dict of the
  layer's present :class:`~moejax.balance.aux.MoEAux` fields: ``losses``,
  ``metrics`` (a :class:`~moejax.balance.aux.LayerMetrics`), and for routed
  layers ``load`` f32[E], ``router_load`` f32[E_r] (the bias controller's
  input), ``num_dropped``, ``execution``,
  and the routing decision ``expert_ids`` int32[B, S, K], ``weights``
  f32[B, S, K], ``valid`` bool[B, S, K] for specialisation analysis (tokens a
  MoD block skipped have valid False).
- ``mod``: ``{'layer_<i>': {'selected' bool[B, S], 'scores' f32[B, S],
  'loss', 'metrics'}}`` per mixture-of-depths block.
- ``mtp`` (only when called with ``mtp=True`` and ``cfg.mtp_depth`` > 0): the
  multi-token prediction modules' logits, module k's f32[B, S-k, V]
  (:mod:`moejax.nn.mtp`, built after the main model's layers); ``mtp_moe``
  ``{'mtp_<k>': layer aux}`` of their MoE blocks (``cfg.mtp_ffn='moe'``),
  whose losses ``loss`` includes.

Router state (the aux-loss-free bias) lives in
:class:`~moejax.nn.moe_block.RouterStateVar` leaves, outside ``nnx.Param``.
The forward only reads it; :meth:`Transformer.apply_controllers` applies the
bias controller of every MoE layer to the loads in ``aux`` (the train step
calls it once per optimizer step, outside the gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from moejax.config import ConfigError, ModelConfig
from moejax.nn.ffn import DenseFFN, ffn_params
from moejax.nn import mtp as mtp_lib
from moejax.nn.mod import MoDBlock
from moejax.nn.moe_block import ExpertParallel, MoEFFN, RouterStateVar
from moejax.nn.scmoe import shortcut_input
from moejax.routing import replay as replay_lib
from moejax.topology import accounting
from moejax.topology import roles as roles_lib

__all__ = ["Transformer", "Block", "RouterStateVar", "ExpertParallel", "dense_equivalent",
           "dense_twin", "mtp_block_config",
           "active_ffn_params", "param_count", "check_buildable", "param_role_tree"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def check_buildable(cfg: ModelConfig) -> None:
  """Raises ConfigError for a valid config this model does not build as it stands."""
  if cfg.dense_twin != "none" and cfg.moe is not None:
    raise ConfigError("model.dense_twin", cfg.dense_twin,
                      "the dense twin is resolved when the experiment config is built",
                      "build the model from ExperimentConfig, or from "
                      "moejax.model.dense_twin(cfg, cfg.dense_twin)")


class Block(nnx.Module):
  """One pre-norm transformer block: x[B, S, d] -> (x[B, S, d], moe aux or None)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs,
               shared_experts: Optional[dict] = None,
               expert_parallel: Optional[ExpertParallel] = None):
    dtype, d = _DTYPES[cfg.compute_dtype], cfg.d_model
    norm = lambda: nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32,
                               rngs=rngs)
    self.attn_norm = norm()
    # The attention kind builds its own module (moejax.nn.attention_kinds).
    self.attn = cfg.attention_spec.build(cfg, dtype=dtype, rngs=rngs)
    self.ffn_norm = norm()
    self.is_moe = cfg.is_moe_layer(layer)
    self.scmoe = self.is_moe and cfg.moe_schedule == "scmoe"
    if self.is_moe:
      self.ffn = MoEFFN(d, cfg.moe, dtype=dtype, rngs=rngs, shared_experts=shared_experts,
                        expert_parallel=expert_parallel)
    else:
      self.ffn = DenseFFN(d, cfg.dense_ff_width, cfg.dense_activation, dtype=dtype,
                          rngs=rngs)

  def param_roles(self) -> dict:
    """The two RMSNorm scales are element-wise (attention and FFN declare their own)."""
    return {"attn_norm": roles_lib.elementwise("norm"), "ffn_norm": roles_lib.elementwise("norm")}

  def __call__(self, x: jax.Array, positions: jax.Array, token_ids: jax.Array, *,
               train: bool = False, rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = (), shortcut: Optional[jax.Array] = None,
               return_tap: bool = False, replay=None):
    """return_tap: also return h, the normalized FFN input (the next ScMoE block's shortcut).
    replay: the MoE layer's recorded selection (:class:`~moejax.routing.replay.RoutingReplay`)."""
    x = x + self.attn(self.attn_norm(x), positions)
    h = self.ffn_norm(x)
    if self.is_moe:
      routed_x = shortcut_input(h, shortcut) if self.scmoe else None
      out, aux = self.ffn(h, token_ids, train=train, rng=rng, axis_names=axis_names,
                          routed_x=routed_x, replay=replay)
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
    self.final_norm = nnx.RMSNorm(d, epsilon=cfg.norm_eps, dtype=dtype,
                                  param_dtype=jnp.float32, rngs=rngs)
    if not cfg.tie_embeddings:
      # The head runs in float32 whatever the compute dtype: logits feed a
      # softmax over V, where bf16 rounding is a visible loss error.
      self.lm_head = nnx.Linear(d, cfg.vocab_size, use_bias=False, dtype=jnp.float32,
                                param_dtype=jnp.float32, rngs=rngs)
    if cfg.mtp_depth:
      # Built last, so the main model's initial weights do not depend on MTP.
      block_cfg = mtp_block_config(cfg)
      self.mtp = nnx.List([
          mtp_lib.MTPModule(d, Block(block_cfg, cfg.n_layers + k, rngs=rngs,
                                     expert_parallel=expert_parallel),
                            norm_eps=cfg.norm_eps, dtype=dtype, rngs=rngs)
          for k in range(cfg.mtp_depth)])

  def __call__(self, tokens: jax.Array, *, train: bool = False,
               rng: Optional[jax.Array] = None,
               axis_names: Sequence[str] = (),
               replay: Optional[dict] = None, mtp: bool = False) -> tuple[jax.Array, dict]:
    """tokens int[B, S] -> (logits f32[B, S, V], aux); see the module docstring.

    rng: key for router noise / jitter (training); layer i uses fold_in(rng, i).
    axis_names: mesh axes to reduce global MoE statistics over under shard_map.
    replay: ``{'layer_<i>': RoutingReplay [B, S, K]}`` for every routed MoE
      layer (routing replay, :mod:`moejax.routing.replay`; what
      ``aux['moe'][name]['selection']`` holds after a forward): each layer
      uses the recorded experts, weighted by its router's current scores.
    mtp: also run the multi-token prediction modules (``model.mtp_depth``;
      training only): ``aux['mtp']`` holds their logits, module k's f32[B,
      S-k, V] (:mod:`moejax.nn.mtp`), and ``aux['mtp_moe']`` the layer aux of
      each MoE module block (``model.mtp_ffn='moe'``) as ``{'mtp_<k>': ...}``,
      whose losses are in ``aux['loss']``. A replay covers the main layers
      only: inference, which records one, never runs the modules, so they
      route on their own.
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"Transformer: tokens must be int[B, S], got {tokens.dtype}"
                       f"{list(tokens.shape)}; add a batch axis / cast to int32")
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    x = self.embed(tokens)
    aux = {"loss": jnp.zeros((), jnp.float32), "moe": {}, "mod": {}}
    tap = None  # ScMoE: the previous block's normalized FFN input
    if replay is not None:
      replay_lib.check_layers(replay, self.replay_layers(), "Transformer(replay=)")
    for i, block in enumerate(self.blocks):
      key = None if rng is None else jax.random.fold_in(rng, i)
      kw = dict(train=train, rng=key, axis_names=axis_names)
      if replay is not None and f"layer_{i}" in replay:
        kw["replay"] = replay[f"layer_{i}"]
      if isinstance(block, MoDBlock):
        x, moe_aux, mod_aux = self._run(block, x, positions, tokens, **kw)
        aux["mod"][f"layer_{i}"] = mod_aux
        aux["loss"] = aux["loss"] + mod_aux["loss"]
      elif self.cfg.moe_schedule == "scmoe":
        x, moe_aux, tap = self._run(block, x, positions, tokens, shortcut=tap,
                                    return_tap=True, **kw)
      else:
        x, moe_aux = self._run(block, x, positions, tokens, **kw)
      if moe_aux is not None:
        aux["moe"][f"layer_{i}"] = moe_aux
        aux["loss"] = aux["loss"] + moe_aux["losses"]["total"].astype(jnp.float32)
    if mtp and self.cfg.mtp_depth:
      # Module k's block is layer n_layers + k - 1 (DeepSeek-V3's numbering): its own key.
      keys = [None if rng is None else jax.random.fold_in(rng, self.cfg.n_layers + k)
              for k in range(self.cfg.mtp_depth)]
      aux["mtp"], moe_auxes = mtp_lib.forward(self.mtp, x, tokens, self.embed, self._logits,
                                              keys=keys, train=train, axis_names=axis_names)
      aux["mtp_moe"] = {}
      for k, moe_aux in enumerate(moe_auxes, start=1):
        if moe_aux is not None:
          aux["mtp_moe"][f"mtp_{k}"] = moe_aux
          aux["loss"] = aux["loss"] + moe_aux["losses"]["total"].astype(jnp.float32)
    return self._logits(self.final_norm(x)), aux

  def _logits(self, x: jax.Array) -> jax.Array:
    """The output head of a normalised hidden state [..., d] -> f32[..., V]."""
    x = x.astype(jnp.float32)
    if self.cfg.tie_embeddings:
      # T5's convention for a tied head: rescale by d^-1/2, since the
      # embedding is initialised at unit scale for the input side.
      return (self.embed.attend(x) * (self.cfg.d_model ** -0.5)).astype(jnp.float32)
    return self.lm_head(x)

  def param_roles(self) -> dict:
    """The embedding and the LM head are element-wise (AdamW): a row per token is a lookup,
    not a hidden matrix (Jordan et al. 2024 and Liu et al. 2025 keep both on AdamW)."""
    return {"embed": roles_lib.elementwise("embedding"), "lm_head": roles_lib.elementwise("head"),
            "final_norm": roles_lib.elementwise("norm")}

  def _run(self, block, x, *args, **kw):
    """``block(x, ...)``, rematerialised in the backward pass when ``cfg.remat``."""
    if not self.cfg.remat:
      return block(x, *args, **kw)
    # Static flags stay Python values; arrays pass through remat's arguments.
    return nnx.remat(lambda blk, x_, *a: blk(x_, *a, **kw))(block, x, *args)

  def replay_layers(self) -> tuple[str, ...]:
    """Names of the MoE layers a routing replay covers: routed, not inside a MoD block."""
    for i, b in enumerate(self.blocks):
      if isinstance(b, MoDBlock) and b.block.is_moe:
        raise ValueError(f"routing replay: layer_{i} is an MoE layer inside a mixture-of-depths "
                         "block, whose routed tokens are a per-forward choice. Fix: replay "
                         "models without mixture-of-depths MoE blocks")
    return tuple(f"layer_{i}" for i, b in enumerate(self.blocks)
                 if isinstance(b, Block) and b.is_moe and b.ffn.cfg.layer.routed)

  def moe_ffns(self) -> dict[str, MoEFFN]:
    """``{'layer_<i>': MoEFFN}`` of every MoE block (the keys of ``aux['moe']``)."""
    out = {}
    for i, block in enumerate(self.blocks):
      inner = block.block if isinstance(block, MoDBlock) else block
      if inner.is_moe:
        out[f"layer_{i}"] = inner.ffn
    return out

  def mtp_moe_ffns(self) -> dict[str, MoEFFN]:
    """``{'mtp_<k>': MoEFFN}`` of every MoE multi-token prediction block (``aux['mtp_moe']``)."""
    if not self.cfg.mtp_depth:
      return {}
    return {f"mtp_{k}": m.block.ffn for k, m in enumerate(self.mtp, start=1) if m.block.is_moe}

  def trained_moe_ffns(self) -> dict[str, MoEFFN]:
    """The MoE FFNs a training step runs: :meth:`moe_ffns` and :meth:`mtp_moe_ffns`."""
    return {**self.moe_ffns(), **self.mtp_moe_ffns()}

  def apply_controllers(self, router_loads: dict[str, jax.Array]) -> None:
    """One bias-controller step per MoE layer (MTP blocks' included), in place.

    ``router_loads``: ``{'layer_<i>' or 'mtp_<k>': f32[E_r]}``, the router loads of the
    whole global batch (``aux['moe'][name]['router_load']``, summed over
    micro-batches under gradient accumulation). Layers without a controller
    are left as they are.
    """
    for name, ffn in self.trained_moe_ffns().items():
      if name in router_loads:
        ffn.apply_controller(router_loads[name])

  def update_ideas(self, observed: dict[str, dict]) -> None:
    """One update of every MoE layer's stateful ideas, in place.

    ``observed``: ``{'layer_<i>': aux['moe'][name]['observed']}`` summed over
    the whole global batch (a layer whose ideas observe nothing may be
    absent); layers without stateful ideas are left as they are.
    """
    for name, ffn in self.trained_moe_ffns().items():
      ffn.update_ideas(observed.get(name, {}))

  def logged_state(self) -> dict:
    """``{'state/<idea>/<field>': f32[]}``: each logged idea-state field, its mean over layers."""
    per_layer = [ffn.logged_state() for ffn in self.trained_moe_ffns().values()]
    keys = sorted({k for d in per_layer for k in d})
    return {k: jnp.mean(jnp.stack([d[k] for d in per_layer if k in d])) for k in keys}


def param_role_tree(model: nnx.Module) -> Any:
  """The optimizer role (:class:`moejax.topology.roles.ParamRole`) of every ``nnx.Param``.

  A pure dict shaped like ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``
  (what the optimizer sees). Every module that owns parameters declares
  their roles (its ``param_roles()``: a dict mirroring its own parameter
  subtree, a role standing for the whole subtree under its key); the
  declaration nearest a parameter wins, and a parameter nobody declared is
  element-wise. Works on an abstract model (``nnx.eval_shape``).
  """
  declared: dict[tuple, roles_lib.ParamRole] = {}
  for path, module in nnx.iter_modules(model):
    fn = getattr(module, "param_roles", None)
    if callable(fn):
      declared.update(_flatten_roles(fn(), tuple(path)))
  undeclared = roles_lib.elementwise("undeclared")

  def role(path, _):
    keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
    for n in range(len(keys), 0, -1):
      if keys[:n] in declared:
        return declared[keys[:n]]
    return undeclared
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return jax.tree_util.tree_map_with_path(role, params)


def _flatten_roles(tree: dict, prefix: tuple) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, roles_lib.ParamRole):
      out[prefix + (key,)] = value
    else:
      out.update(_flatten_roles(value, prefix + (key,)))
  return out


def param_count(model: nnx.Module, filter=nnx.Param) -> int:
  """Number of scalars in the model's ``filter`` state (shared weights once).

  Equals ``accounting.budget(cfg).total`` except for heterogeneous experts
  (``moe.topology.expert_widths``), whose stacked arrays hold zero padding up to the
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
  if not moe.layer.routed:
    raise ConfigError("model.moe.kind", moe.kind,
                      "a per-token active FFN width is defined for routed (sparse) layers",
                      "use model.dense_twin='total' for soft / PEER layers")
  comps = accounting.moe_components(moe, cfg.d_model, seq_len=1)
  return sum(comps[name].active for name in ("routed_experts", "shared_experts")
             if name in comps)


def active_ffn_params(cfg: ModelConfig) -> float:
  """Active FFN params per token summed over all layers."""
  dense = ffn_params(cfg.d_model, cfg.dense_ff_width, cfg.dense_activation)
  return sum(_moe_ffn_active(cfg) if cfg.is_moe_layer(i) else dense
             for i in range(cfg.n_layers))


def _dense(cfg: ModelConfig, width: int, act: str) -> ModelConfig:
  return dataclasses.replace(cfg, moe=None, dense_ff_width=width, dense_activation=act,
                             moe_layout="all", first_dense_layers=0, expert_sharing_group=1,
                             moe_schedule="serial", mtp_ffn="dense")


def mtp_block_config(cfg: ModelConfig) -> ModelConfig:
  """The config a multi-token prediction module's block is built from (any layer index).

  ``mtp_ffn='dense'``: a dense FFN of ``dense_ff_width``. ``'moe'``: an MoE
  layer of ``cfg.moe`` with its own experts (never shared with the main
  layers'), in the serial schedule and outside any mixture-of-depths block.
  """
  if cfg.mtp_ffn == "moe":
    return dataclasses.replace(cfg, moe_layout="all", first_dense_layers=0,
                               expert_sharing_group=1, moe_schedule="serial", mod_every=0)
  return _dense(cfg, cfg.dense_ff_width, cfg.dense_activation)


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
  return dense_twin(cfg, "active")


def dense_twin(cfg: ModelConfig, match: str = "active") -> ModelConfig:
  """A dense model (moe=None) matching ``cfg`` in active or total parameters.

  ``active``: :func:`dense_equivalent`'s width F (same active FFN params per
  token, the equal-compute baseline). ``total``: the width whose dense model
  has the MoE model's total parameters (to the nearest hidden unit): the
  equal-memory baseline, which spends far more compute per token. Both keep
  attention, embeddings, MoD, dtype and every non-FFN field; the result has
  ``dense_twin=match`` as its label.
  """
  if match not in ("active", "total"):
    raise ConfigError("model.dense_twin", match, "unknown twin", "use 'active' or 'total'")
  if cfg.moe is None:
    return cfg
  all_moe = all(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
  act = cfg.moe.topology.activation if all_moe else cfg.dense_activation
  unit = ffn_params(cfg.d_model, 1, act)
  if match == "active":
    width = int(round(active_ffn_params(cfg) / cfg.n_layers / unit))
  else:
    target = accounting.budget(cfg, seq_len=1).total
    base = accounting.budget(_dense(cfg, 1, act), seq_len=1).total
    width = 1 + int(round((target - base) / (cfg.n_layers * unit)))
  out = _dense(cfg, max(1, width), act)
  return dataclasses.replace(out, dense_twin=match)
