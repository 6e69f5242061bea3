"""Sparse upcycling: a dense source becomes the run's MoE (``finetune.source_format='upcycle'``).

Legend: L layers, d model width, F dense hidden width, G split
(``finetune.upcycle.split``), f = F / G expert width, E experts, K top-k,
n = round(r f) re-initialised hidden units per expert (drop ratio r).

The source is a dense moejax run (``configs/dense.py``, any
``model.dense_twin``) or a dense Hugging Face decoder moejax computes
exactly (Mistral, Llama: :mod:`moejax.interop.dense`), found by what the
directory holds (checkpoints/ or a config.json with a ``model_type``). The
run's model config says which layers are MoE (``model.moe_layout``:
``all``, ``every_other``, ``first_dense`` from layer
``first_dense_layers``), E, K and the gating; everything else must be the
source's. :func:`upcycle_params` builds the run's first weights:

- embeddings, attention, norms, the head and the FFNs of layers that stay
  dense: copies of the source's;
- each MoE layer's experts from its layer's dense FFN (the options of
  :class:`~moejax.config.finetune.UpcycleConfig`): W_gate, W_up [d, F] ->
  [E, d, f] and W_down [F, d] -> [E, f, d], expert e taking hidden units
  [s f, (s + 1) f) of slice s = e mod G; then drop-upcycling's
  re-initialised units, the noise, and W_down x G / routed_scaling_factor
  when ``renormalize``;
- the router: the fresh initialisation of the run (``router_init='fresh'``)
  or zeros (``'uniform'``); the router state (selection bias) fresh.

Why the first forward is the dense model's (``renormalize``, no noise, no
drop): an MoE layer computes sum_k g_k W_down,e_k^T h_e_k(x). With G = 1
every expert is the dense FFN, so the sum is (sum_k g_k) FFN(x) = FFN(x) for
gates summing to 1. With G > 1 the K chosen experts must hold each slice
K / G times, each slice's units then weigh G sum of its g_k = G (K / G) / K
= 1 with equal gates: a uniform router (its ties go to experts 0..K-1, one
of each slice per G) gives exactly that.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import ConfigError, ModelConfig, MoEConfig, from_dict
from moejax.config.finetune import UpcycleConfig
from moejax.finetune import source as source_lib
from moejax.topology import experts as experts_lib
from moejax.train.config import ExperimentConfig

FIELD = source_lib.FIELD
# Model fields of the run that upcycling sets (the rest must be the source's).
MOE_FIELDS = ("moe", "moe_layout", "first_dense_layers", "mtp_ffn")
# Fields that do not change a parameter or the function (or are labels).
_FREE = ("moe", "moe_layout", "first_dense_layers", "dense_twin", "expert_sharing_group",
         "moe_schedule", "remat", "compute_dtype", "mtp_ffn")
_SALT = 0x5C1E   # folded into train.seed: the upcycling draws are not the init's


def expert_count(up: UpcycleConfig, f: int) -> int:
  """n: hidden units drop-upcycling re-initialises per expert, round(r f) (half up)."""
  return int(math.floor(up.drop * f + 0.5))


def drop_mask(key: jax.Array, e: int, f: int, n: int) -> jax.Array:
  """bool[E, f]: exactly n True per row (each expert's own draw)."""
  keys = jax.random.split(key, e)
  ranks = jax.vmap(lambda k: jax.random.permutation(k, f))(keys)   # [E, f] a permutation
  return ranks < n


def upcycle_ffn(dense: dict, moe: MoEConfig, up: UpcycleConfig, key: jax.Array) -> dict:
  """One dense FFN -> the stacked experts of an MoE layer (see the module doc).

  dense: {'w_gate'?, 'w_up': {'kernel': [d, F]}, 'w_down': {'kernel': [F, d]}}.
  Returns the routed-expert layout of :mod:`moejax.topology.experts`:
  {'w_gate_up': [E, d, 2f], 'w_down'} (gated) or {'w_up': [E, d, f], 'w_down'}
  (each matrix is sliced, dropped and noised as its own [E, d, f] first).
  """
  g, e = up.split, moe.num_experts
  big_f, d = dense["w_down"]["kernel"].shape
  f = big_f // g
  slot = np.arange(e) % g
  names = [n for n in ("w_gate", "w_up", "w_down") if n in dense]
  src = {n: jnp.asarray(dense[n]["kernel"], jnp.float32) for n in names}
  out = {}
  for n in names:
    w = src[n]
    out[n] = (w.reshape(g, f, d)[slot] if n == "w_down"
              else jnp.transpose(w.reshape(d, g, f), (1, 0, 2))[slot])
  k_drop, k_noise, k_fill = jax.random.split(key, 3)
  n_drop = expert_count(up, f)
  if n_drop:
    mask = drop_mask(k_drop, e, f, n_drop)
    for i, n in enumerate(names):
      fresh = jnp.mean(src[n]) + jnp.std(src[n]) * jax.random.normal(
          jax.random.fold_in(k_fill, i), out[n].shape)
      m = mask[:, :, None] if n == "w_down" else mask[:, None, :]
      out[n] = jnp.where(m, fresh, out[n])
  if up.noise:
    for i, n in enumerate(names):
      out[n] = out[n] + up.noise * jnp.std(src[n]) * jax.random.normal(
          jax.random.fold_in(k_noise, i), out[n].shape)
  if up.renormalize:
    out["w_down"] = out["w_down"] * (g / moe.routing.routed_scaling_factor)
  return experts_lib.fused_layout(out)


def _inner(block: dict) -> dict:
  """A block's own params (a mixture-of-depths block wraps it as ``block``)."""
  return block["block"] if "block" in block and "ffn" not in block else block


def upcycle_params(dense_params: dict, model: ModelConfig, up: UpcycleConfig,
                   seed: int) -> dict:
  """The run's params from a dense model's (pure dicts; the router absent = fresh, or a zeros
  map for ``router_init='uniform'``: :func:`moejax.finetune.source._overlay`)."""
  out = dict(dense_params)
  out["blocks"] = {}
  base = jax.random.fold_in(jax.random.PRNGKey(seed), _SALT)
  for i, block in dense_params["blocks"].items():
    block = dict(block)
    inner = dict(_inner(block))
    if model.is_moe_layer(int(i)):
      inner["ffn"] = _upcycled(inner["ffn"], model, up, jax.random.fold_in(base, int(i)))
    if "block" in block and "ffn" not in block:
      block["block"] = inner
    else:
      block = inner
    out["blocks"][i] = block
  if model.mtp_ffn == "moe" and "mtp" in dense_params:
    # An MoE multi-token prediction block (model.mtp_ffn) upcycles its dense FFN likewise.
    out["mtp"] = {}
    for k, module in dense_params["mtp"].items():
      block = dict(module["block"])
      block["ffn"] = _upcycled(block["ffn"], model, up,
                               jax.random.fold_in(base, model.n_layers + int(k)))
      out["mtp"][k] = {**module, "block": block}
  return out


def _upcycled(ffn: dict, model: ModelConfig, up: UpcycleConfig, key: jax.Array) -> dict:
  """A dense FFN's params as an MoE FFN's: upcycled experts, the router fresh or zeros."""
  layer = {"experts": upcycle_ffn(ffn, model.moe, up, key)}
  if up.router_init == "uniform":
    layer["router"] = jnp.zeros_like
  return {"params": layer}


def _dense_source(cfg: ExperimentConfig, path: str):
  """(dense ModelConfig, step or None, load() -> dense params, kind) of the source."""
  kind = source_lib.detect_format(path)
  if kind == "moejax":
    src_cfg, step = source_lib.moejax_run(cfg, path)
    return src_cfg.model, step, lambda: source_lib.moejax_weights(src_cfg, path, step)[0], kind
  if cfg.finetune.source_step >= 0:
    raise ConfigError("finetune.source_step", cfg.finetune.source_step,
                      "a Hugging Face model directory has no checkpoint steps", "use -1")
  from moejax.interop import InteropError, load_hf_config  # pylint: disable=g-import-not-at-top
  from moejax.interop import dense as hf_dense  # pylint: disable=g-import-not-at-top
  try:
    hf_config = load_hf_config(path)
    model = hf_dense.model_config_from_hf_dense(hf_config, cfg.model)
  except InteropError as e:
    raise ConfigError(FIELD, path, f"does not convert: {e}".rstrip("."),
                      "pass a dense Mistral / Llama checkpoint directory") from e
  return model, None, lambda: hf_dense.import_dense_model(path, hf_config,
                                                          base=cfg.model).params, kind


def check_compatible(dense: ModelConfig, model: ModelConfig, up: UpcycleConfig,
                     where: str) -> None:
  """ConfigError unless ``model`` is ``dense`` with MoE layers upcycling can fill."""
  if dense.moe is not None:
    raise ConfigError(FIELD, where, "is already an MoE (model.moe is set); upcycling starts "
                      "from a dense model", "fine-tune it with finetune.source_format='moejax'"
                      " (or 'hf'), or pass a dense run (configs/dense.py)")
  differ = [f"model.{f.name}: source {getattr(dense, f.name)!r}, here "
            f"{getattr(model, f.name)!r}" for f in dataclasses.fields(ModelConfig)
            if f.name not in _FREE + ("dense_ff_width", "dense_activation")
            and getattr(dense, f.name) != getattr(model, f.name)]
  if differ:
    raise ConfigError(FIELD, where, "differs from this run outside the FFNs "
                      f"({'; '.join(differ[:3])})",
                      "take every non-MoE model field from the source (experiments.finetune "
                      "does), or pick a source of this model")
  top, width = model.moe.topology, dense.dense_ff_width
  if top.activation != dense.dense_activation:
    raise ConfigError("model.moe.topology.activation", top.activation, f"differs from the "
                      f"source's dense FFN ({dense.dense_activation!r})",
                      f"set it to {dense.dense_activation!r}")
  if top.expert_width * up.split != width:
    raise ConfigError("model.moe.topology.expert_width", top.expert_width,
                      f"times finetune.upcycle.split={up.split} is not the source's dense width "
                      f"{width}", f"set expert_width={width // up.split} (or split="
                      f"{max(1, width // top.expert_width)}), dividing {width}")
  dense_layers = [i for i in range(model.n_layers) if not model.is_moe_layer(i)]
  if dense_layers and (model.dense_ff_width, model.dense_activation) != (
      width, dense.dense_activation):
    raise ConfigError("model.dense_ff_width", model.dense_ff_width, f"layers {dense_layers} stay "
                      f"dense and copy the source's FFN of width {width} "
                      f"({dense.dense_activation})", f"set model.dense_ff_width={width} and "
                      f"dense_activation={dense.dense_activation!r}")


def _check_shapes(cfg: ExperimentConfig, dense: ModelConfig, where: str) -> None:
  """The upcycled tree has exactly the run's parameter shapes (the router aside: fresh)."""
  abstract, _ = source_lib.abstract_base(dense)
  got = jax.eval_shape(lambda p: upcycle_params(
      p, cfg.model, dataclasses.replace(cfg.finetune.upcycle, router_init="fresh"), 0), abstract)
  have = source_lib._shapes(got)  # pylint: disable=protected-access
  want, _ = source_lib.base_shapes(cfg.model)
  for key in sorted(set(have) | set(want)):
    if have.get(key) != want.get(key) and not (key not in have and "/router/" in f"/{key}/"):
      raise ConfigError(FIELD, where, f"upcycles to other parameter shapes than this run's "
                        f"({key}: upcycled {have.get(key, 'absent')}, here "
                        f"{want.get(key, 'absent')})", "match the run's model to the source")


def open_upcycle(cfg: ExperimentConfig, path: str) -> source_lib.Source:
  """The checked upcycling source of ``cfg`` (reads configs and shapes only)."""
  dense, step, load_dense, kind = _dense_source(cfg, path)
  up = cfg.finetune.upcycle
  check_compatible(dense, cfg.model, up, path)
  _check_shapes(cfg, dense, path)
  moe = cfg.model.moe
  layers = [i for i in range(cfg.model.n_layers) if cfg.model.is_moe_layer(i)]
  notes = (f"model.moe: upcycled from the {'moejax run' if kind == 'moejax' else 'Hugging Face'}"
           f" dense FFNs in layers {layers} (E={moe.num_experts} top-{moe.routing.top_k}, split "
           f"{up.split}, noise {up.noise:g}, drop {up.drop:g}, renormalize {up.renormalize}, "
           f"router {up.router_init})",)
  load = lambda: (upcycle_params(load_dense(), cfg.model, up, cfg.train.seed), None)
  return source_lib.Source(path, "upcycle", step, dense, notes, load)


def default_moe(dense: ModelConfig, split: int = 1) -> dict:
  """The MoE of an upcycled run whose config names none: E=8 top-2 of the dense FFN's
  activation, expert width F / split, softmax scores with renormalised top-k gates."""
  return {"topology": {"num_experts": 8, "expert_width": dense.dense_ff_width // split,
                       "activation": dense.dense_activation},
          "routing": {"kind": "topk", "top_k": 2, "score_fn": "softmax",
                      "gating": "normalized"}}


def upcycled_model(dense: ModelConfig, spec: Optional[dict] = None, split: int = 1) -> ModelConfig:
  """``dense`` with the MoE layers of ``spec`` (the run's ``model`` section: only
  :data:`MOE_FIELDS`; default :func:`default_moe`)."""
  spec = dict(spec or {})
  extra = sorted(set(spec) - set(MOE_FIELDS))
  if extra:
    raise ConfigError(f"model.{extra[0]}", spec[extra[0]], "is the dense source's when "
                      "upcycling", f"set only {', '.join(MOE_FIELDS)} in the model section")
  moe = spec.get("moe") or default_moe(dense, split)
  moe = moe if isinstance(moe, MoEConfig) else from_dict(MoEConfig, moe, "model.moe")
  return dataclasses.replace(dense, moe=moe, dense_twin="none",
                             moe_layout=spec.get("moe_layout", "all"),
                             first_dense_layers=spec.get("first_dense_layers", 0),
                             mtp_ffn=spec.get("mtp_ffn", "dense"))


def _model(ft_source: str, tree: dict) -> ModelConfig:
  path = os.path.expanduser(ft_source)
  kind = source_lib.detect_format(path)
  if kind == "moejax":
    dense = source_lib.source_model(ft_source, "moejax")
  else:
    from moejax.interop import InteropError, load_hf_config  # pylint: disable=g-import-not-at-top
    from moejax.interop import dense as hf_dense  # pylint: disable=g-import-not-at-top
    try:
      dense = hf_dense.model_config_from_hf_dense(load_hf_config(path))
    except InteropError as e:
      raise ConfigError(FIELD, ft_source, f"does not convert: {e}".rstrip("."),
                        "pass a dense Mistral / Llama checkpoint directory") from e
  split = dict(dict(tree.get("finetune") or {}).get("upcycle") or {}).get("split", 1)
  return upcycled_model(dense, tree.get("model"), split)


FORMAT = source_lib.register_format(source_lib.SourceFormat(
    "upcycle", open_upcycle, _model, "dense source, upcycled:"))

__all__ = ["FORMAT", "MOE_FIELDS", "check_compatible", "default_moe", "drop_mask",
           "expert_count", "open_upcycle", "upcycle_ffn", "upcycle_params", "upcycled_model"]
