"""Hugging Face MoE block <-> moejax layer params, router state and MoEConfig.

Legend: d model width, E routed experts, f routed expert width, F = K_s f_s
total shared width.

Import::

    block = import_moe_block(model.state_dict(), model.config, layer=3)
    y, aux = moe_layer(block.params, x, block.state, block.cfg)

``source`` is a state dict or a safetensors file / checkpoint directory
(``hf_config`` then defaults to the directory's config.json). The block is
found by ``layer`` (the family's known prefixes are tried) or by an explicit
key ``prefix`` ('' for a bare block's own ``state_dict()``).

Export::

    sd, fields = export_moe_block(params, state, cfg, "deepseek_v3", layer=3)

writes the block under the family's names, in one of two layouts:

- ``checkpoint`` (default): one tensor per expert and projection, as
  released checkpoints store them (``experts.{i}.gate_proj.weight`` [f, d];
  Mixtral ``block_sparse_moe.experts.{i}.w1/w3/w2``). ``from_pretrained`` of
  transformers >= 5 fuses these on load.
- ``fused``: transformers >= 5's in-memory parameters
  (``experts.gate_up_proj`` [E, 2f, d] with W_gate rows first,
  ``experts.down_proj`` [E, d, f]), for ``module.load_state_dict``.

Tensor mapping (torch ``nn.Linear`` stores weight [out, in]; moejax einsums
take [in, out]): router ``gate.weight`` [E, d] = w.T; ``gate_proj`` /
``up_proj`` / ``down_proj`` of expert e = w_gate_up[e, :, :f].T /
w_gate_up[e, :, f:].T / w_down[e].T (transformers' fused ``gate_up_proj``
[E, 2f, d] is w_gate_up transposed per expert, gate rows first); the shared FFN likewise with F; Qwen's
``shared_expert_gate.weight`` [1, d] = w_shared_gate.T; DeepSeek-V3's
``gate.e_score_correction_bias`` [E] = RouterState.bias. Transposes are
exact, so export -> import returns bit-identical arrays.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from moejax.config import MoEConfig
from moejax.interop import families as fam
from moejax.interop.errors import (InteropError, MissingTensorError,
                                   TensorShapeError)
from moejax.interop.tensors import TensorStore, dequantize_blocks, open_source
from moejax.routing.types import RouterState

LAYOUTS = ("checkpoint", "fused")


class ImportedBlock(NamedTuple):
  """One converted MoE block: ``moe_layer(params, x, state, cfg)`` reproduces it."""

  params: dict
  state: RouterState
  cfg: MoEConfig
  prefix: str
  layout: str


class ExportedBlock(NamedTuple):
  """A moejax layer as Hugging Face tensors (numpy) and config fields."""

  state_dict: dict
  hf_fields: dict


def load_hf_config(path: str | os.PathLike) -> dict:
  """config.json of a checkpoint directory (or the json file itself) as a dict."""
  path = pathlib.Path(path)
  file = path / "config.json" if path.is_dir() else path
  if not file.exists():
    raise InteropError(f"no config.json at {str(path)!r}. Fix: pass hf_config= (the "
                       "model's config object or config.json dict)")
  return json.loads(file.read_text())


def _resolve_config(source: Any, hf_config: Any) -> Any:
  if hf_config is not None:
    return hf_config
  if isinstance(source, (str, os.PathLike)) and pathlib.Path(source).is_dir():
    return load_hf_config(source)
  raise InteropError("hf_config is required unless source is a checkpoint directory "
                     "holding config.json. Fix: pass hf_config=model.config (or the "
                     "config.json dict)")


def _join(prefix: str) -> str:
  return prefix + "." if prefix and not prefix.endswith(".") else prefix


def _resolve_prefix(store: TensorStore, family: fam.Family, hf_config: Any,
                    layer: Optional[int], prefix: Optional[str]) -> str:
  if prefix is not None:
    return _join(prefix)
  if layer is None:
    raise InteropError("which block? Fix: pass layer=<decoder layer index> or prefix=<key "
                       "prefix of the block> ('' for a bare block's state_dict)")
  try:
    layers = family.moe_layers(hf_config)
  except InteropError:
    layers = None  # a partial config (no num_hidden_layers): let the keys decide
  if layers is not None and layer not in layers:
    raise InteropError(f"layer {layer} of this {family.model_type} config is not a MoE "
                       f"layer; its MoE layers are {layers}. Fix: pick one of those")
  candidates = family.prefixes(layer)
  for cand in candidates:
    if _join(cand) + family.router_key in store:
      return _join(cand)
  raise MissingTensorError(
      _join(candidates[0]) + family.router_key, store.keys(), store.description,
      fix=f"no router of layer {layer} under {' or '.join(map(repr, candidates))}; pass "
          "prefix= if the checkpoint nests the model differently")


def _block_size(hf_config: Any) -> tuple[int, int]:
  q = fam.hf_get(hf_config, "quantization_config", default=None) or {}
  if not isinstance(q, Mapping):
    q = q.to_dict() if hasattr(q, "to_dict") else vars(q)
  return tuple(q.get("weight_block_size") or (128, 128))


class _Reader:
  """Reads, dequantises and shape-checks the tensors of one block."""

  def __init__(self, store: TensorStore, prefix: str, block: tuple[int, int]):
    self.store, self.prefix, self.block = store, prefix, block

  def __call__(self, name: str, want: tuple, why: str) -> np.ndarray:
    key = self.prefix + name
    w = self.store.get(key)
    if key + "_scale_inv" in self.store:
      w = dequantize_blocks(w, self.store.get(key + "_scale_inv"), self.block)
    if tuple(w.shape) != tuple(want):
      raise TensorShapeError(key, w.shape, want, why)
    return w

  def has(self, name: str) -> bool:
    return self.prefix + name in self.store


def import_moe_block(source: Any, hf_config: Any = None, *, layer: Optional[int] = None,
                     prefix: Optional[str] = None, base_cfg: Optional[MoEConfig] = None,
                     dtype: Any = jnp.float32) -> ImportedBlock:
  """Converts one Hugging Face MoE block to moejax params, router state and config.

  Args:
    source: state dict (torch / numpy / jax tensors), safetensors file, or
      checkpoint directory (sharded or not).
    hf_config: the model's HF config object or config.json dict (default: the
      directory's config.json).
    layer: decoder layer index; the family's module and checkpoint prefixes
      are tried (``model.layers.{layer}.mlp``, Mixtral's ``block_sparse_moe``).
    prefix: explicit key prefix of the block instead of ``layer``.
    base_cfg: MoEConfig whose non-architecture fields (capacity, backend,
      balance, router dtype / noise) the result keeps.
    dtype: parameter dtype (None keeps the checkpoint's).

  Returns:
    ImportedBlock(params, state, cfg, prefix, layout).
  """
  hf_config = _resolve_config(source, hf_config)
  family = fam.family_of(hf_config)
  cfg = fam.moe_config_from_hf(hf_config, base_cfg)
  store = open_source(source)
  p = _resolve_prefix(store, family, hf_config, layer, prefix)
  rd = _Reader(store, p, _block_size(hf_config))
  e, f = cfg.num_experts, cfg.topology.expert_width

  router_key = p + family.router_key
  router = store.get(router_key)
  if router.ndim != 2 or router.shape[0] != e:
    raise TensorShapeError(router_key, router.shape, (e, "d"), f"{e} routed experts")
  d = router.shape[1]
  hidden = fam.hf_get(hf_config, "hidden_size", default=d)
  if d != hidden:
    raise TensorShapeError(router_key, router.shape, (e, hidden), "hidden_size")

  if rd.has("experts.gate_up_proj"):
    layout = "fused"
    gu = rd("experts.gate_up_proj", (e, 2 * f, d), "[E, 2f, d], W_gate rows first")
    down = rd("experts.down_proj", (e, d, f), "[E, d, f]")
    experts = {"w_gate_up": gu.transpose(0, 2, 1), "w_down": down.transpose(0, 2, 1)}
  else:
    layout = "checkpoint"
    g, u, dn = family.expert_keys
    per = [(rd(f"experts.{i}.{g}.weight", (f, d), "[f, d]"),
            rd(f"experts.{i}.{u}.weight", (f, d), "[f, d]"),
            rd(f"experts.{i}.{dn}.weight", (d, f), "[d, f]")) for i in range(e)]
    experts = {"w_gate_up": np.stack([np.concatenate([t[0].T, t[1].T], axis=1) for t in per]),
               "w_down": np.stack([t[2].T for t in per])}

  params = {"router": {"w": router.T}, "experts": experts}
  if cfg.topology.num_shared_experts:
    width = cfg.topology.num_shared_experts * (cfg.topology.shared_expert_width or f)
    s = family.shared_key + "."
    params["shared"] = {
        "w_gate": rd(s + "gate_proj.weight", (width, d), "[F, d]").T,
        "w_up": rd(s + "up_proj.weight", (width, d), "[F, d]").T,
        "w_down": rd(s + "down_proj.weight", (d, width), "[d, F]").T,
    }
    if cfg.topology.shared_expert_gate:
      params["shared"]["w_shared_gate"] = rd(family.shared_gate_key + ".weight", (1, d),
                                             "[1, d]").T
  cast = (lambda a: jnp.asarray(a)) if dtype is None else (lambda a: jnp.asarray(a, dtype))
  params = {k: {n: cast(v) for n, v in sub.items()} for k, sub in params.items()}

  state = RouterState.zeros(cfg.num_routed)
  if family.bias_key is not None:
    bias = rd(family.bias_key, (e,), "one selection bias per routed expert")
    state = state.replace(bias=jnp.asarray(bias, jnp.float32))
  return ImportedBlock(params, state, cfg, p, layout)


def import_moe_layers(source: Any, hf_config: Any = None, *,
                      layers: Optional[Sequence[int]] = None,
                      base_cfg: Optional[MoEConfig] = None,
                      dtype: Any = jnp.float32) -> dict[int, ImportedBlock]:
  """Every MoE block of a model (or those in ``layers``), keyed by layer index."""
  hf_config = _resolve_config(source, hf_config)
  store = open_source(source)
  chosen = fam.moe_layers(hf_config) if layers is None else list(layers)
  return {i: import_moe_block(store, hf_config, layer=i, base_cfg=base_cfg, dtype=dtype)
          for i in chosen}


# ---------------------------------------------------------------------------
# Export.

def _param(params: Mapping, path: tuple, want: tuple, why: str) -> np.ndarray:
  node = params
  for k in path:
    if not isinstance(node, Mapping) or k not in node:
      where = "".join(f"[{p!r}]" for p in path)
      raise InteropError(f"params{where} is missing. Fix: export params built for this "
                         "config (moejax.layer.init_moe_params or an import)")
    node = node[k]
  arr = np.asarray(node)
  if tuple(arr.shape) != tuple(want):
    where = "".join(f"[{p!r}]" for p in path)
    raise InteropError(f"params{where} has shape {arr.shape}, expected {want} ({why}). "
                       "Fix: export params built for this config")
  return arr


def _t(a: np.ndarray, axes: tuple) -> np.ndarray:
  return np.ascontiguousarray(a.transpose(axes))


def export_moe_block(params: Mapping, state: Optional[RouterState], cfg: MoEConfig,
                     model_type: str, *, layer: Optional[int] = None,
                     prefix: Optional[str] = None, layout: str = "checkpoint"
                     ) -> ExportedBlock:
  """Converts a moejax MoE layer to a Hugging Face block of family ``model_type``.

  Args:
    params, state, cfg: the layer (``state`` may be None: zero bias).
    model_type: target family (``mixtral``, ``qwen2_moe``, ``qwen3_moe``,
      ``deepseek_v3``).
    layer / prefix: key prefix of the block (``layer`` uses the family's
      prefix for ``layout``; neither: keys relative to the block).
    layout: ``checkpoint`` (per-expert tensors, released-file names) or
      ``fused`` (transformers >= 5 module parameters).

  Returns:
    ExportedBlock(state_dict of numpy arrays, hf_fields): the HF config fields
    the block needs (model_type, hidden_size, expert counts and widths,
    routing flags); merge them into a full model config.

  Raises:
    InteropError naming each config field the family cannot express (a
    shared expert for mixtral, a bias for qwen, ...), or a params entry of
    the wrong shape. RouterState.step (a controller counter) is not exported.
  """
  if layout not in LAYOUTS:
    raise InteropError(f"layout={layout!r}: use one of {', '.join(LAYOUTS)}")
  fam.check_moe_config(cfg, "cfg")
  family = fam.get_family(model_type)
  e, f = cfg.num_experts, cfg.topology.expert_width
  router = params.get("router") if isinstance(params, Mapping) else None
  if not isinstance(router, Mapping) or "w" not in router:
    raise InteropError("params['router']['w'] is missing. Fix: export params built for "
                       "this config (moejax.layer.init_moe_params or an import)")
  w = np.asarray(router["w"])
  if w.ndim != 2 or w.shape[1] != e:
    raise InteropError(f"params['router']['w'] has shape {w.shape}, expected (d, {e}). "
                       "Fix: export params built for this config")
  d = w.shape[0]
  fields = fam.hf_fields_from_moe(cfg, model_type, d)

  if prefix is not None:
    p = _join(prefix)
  elif layer is not None:
    tmpl = family.module_prefix if layout == "fused" else family.checkpoint_prefix
    p = _join(tmpl.format(layer=layer))
  else:
    p = ""

  wgu = _param(params, ("experts", "w_gate_up"), (e, d, 2 * f), "[E, d, 2f], gate | up")
  wg, wu = wgu[..., :f], wgu[..., f:]
  wd = _param(params, ("experts", "w_down"), (e, f, d), "[E, f, d]")
  sd = {p + family.router_key: np.ascontiguousarray(w.T)}
  if layout == "fused":
    sd[p + "experts.gate_up_proj"] = _t(wgu, (0, 2, 1))
    sd[p + "experts.down_proj"] = _t(wd, (0, 2, 1))
  else:
    g, u, dn = family.expert_keys
    for i in range(e):
      sd[f"{p}experts.{i}.{g}.weight"] = np.ascontiguousarray(wg[i].T)
      sd[f"{p}experts.{i}.{u}.weight"] = np.ascontiguousarray(wu[i].T)
      sd[f"{p}experts.{i}.{dn}.weight"] = np.ascontiguousarray(wd[i].T)

  if family.shared_key is not None:
    width = cfg.topology.num_shared_experts * (cfg.topology.shared_expert_width or f)
    s = p + family.shared_key + "."
    if width:
      for hf_name, name, shape in (("gate_proj", "w_gate", (d, width)),
                                   ("up_proj", "w_up", (d, width)),
                                   ("down_proj", "w_down", (width, d))):
        arr = _param(params, ("shared", name), shape, "[d, F] / [F, d], F = K_s f_s")
        sd[s + hf_name + ".weight"] = _t(arr, (1, 0))
    else:  # the HF module still exists, with zero width
      dt = w.dtype
      sd[s + "gate_proj.weight"] = np.zeros((0, d), dt)
      sd[s + "up_proj.weight"] = np.zeros((0, d), dt)
      sd[s + "down_proj.weight"] = np.zeros((d, 0), dt)
    if family.shared_gate_key is not None:
      sg = (_param(params, ("shared", "w_shared_gate"), (d, 1), "[d, 1]") if width
            else np.zeros((d, 1), w.dtype))
      sd[p + family.shared_gate_key + ".weight"] = _t(sg, (1, 0))
  if family.bias_key is not None:
    bias = np.zeros((e,), np.float32) if state is None else np.asarray(state.bias)
    if bias.shape != (cfg.num_routed,):
      raise InteropError(f"state.bias has shape {bias.shape}, expected ({cfg.num_routed},). "
                         "Fix: pass the layer's RouterState")
    sd[p + family.bias_key] = np.ascontiguousarray(bias)
  return ExportedBlock(sd, fields)


def to_torch(state_dict: Mapping[str, Any]) -> dict:
  """numpy state dict -> torch tensors (for ``module.load_state_dict``)."""
  import torch

  return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in state_dict.items()}
