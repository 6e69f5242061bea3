"""Weight-only int8 / int4 quantisation of expert weights for inference (qwix storage).

Legend: E routed experts, I a weight's input (contraction) width, O its
output width, g group size, d model width, f expert hidden width.

What is quantised: the routed experts' ``w_gate_up`` [E, d, 2f] (W_gate and
W_up side by side: every output column has its own scales, so this is the
quantisation of the two matrices apart) or ``w_up`` [E, d, f] and
``w_down`` [E, f, d], and the shared experts' ``w_gate`` / ``w_up`` [d, F_s],
``w_down`` [F_s, d]: the weights that hold almost all of an MoE's
parameters. What stays in float: the router (its top-k is a discrete
decision that small errors flip), the Qwen shared-expert gate, zero- and
constant-computation experts, attention, embeddings, LM head and norms, as
in the published weight-only quantisations of Mixtral / DeepSeek (GPTQ,
AWQ, bitsandbytes keep embeddings, head, norms and routers in 16 bits).
PEER and Soft MoE layers are left in float.

Scheme (symmetric absmax, per output channel or per group of the input):
for each expert e, output column o and group G of g consecutive input rows
(per-channel: G = all I rows),

    s[e, G, o] = max_{i in G} |w[e, i, o]| / (q_max + 1/2),   q = round(w / s) clipped to
    [-q_max - 1, q_max],  w_hat = q * s

with q_max = 127 (int8) or 7 (int4). The + 1/2 (qwix's choice) lets the
largest weight use the top bucket fully: |w / s| <= q_max + 1/2 before
rounding, so every weight has |w - w_hat| <= s / 2 (the largest is clipped
from q_max + 1/2 to q_max: an error of exactly s / 2). Storage: I*O*bits/8
bytes of codes plus one scale per (e, G, o) in ``scale_dtype``.

Implementation: :func:`qwix.quantize` makes the ``QArray`` (int8 / int4
codes + scales; XLA stores int4 packed, two per byte) that replaces each
expert weight in the model's ``nnx.Param``; :func:`materialize`, called
inside the jitted forward right before a layer's experts run, dequantises
that layer's weights to float (``qwix.dequantize``) and the layer runs its
usual grouped-matmul backend on them. The execution kernels are untouched;
the price is that a layer's float weights exist transiently during its
call (a fused int4 x bf16 grouped matmul, e.g. ``qwix.ragged_dot`` on TPU,
would avoid it).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from moejax.config import ConfigError, MoEConfig

BITS = {8: jnp.int8, 4: jnp.int4}
SCALE_DTYPES = ("float32", "bfloat16", "float16")
# Expert-weight keys quantised, per parameter group; anything else stays float.
# [E, I, O]; 'w_gate' / 'w_up': a layer built before the gate|up layout
ROUTED_KEYS = ("w_gate_up", "w_gate", "w_up", "w_down")
SHARED_KEYS = ("w_gate", "w_up", "w_down")   # [I, O]; 'w_shared_gate' stays float


@dataclasses.dataclass(frozen=True)
class QuantConfig:
  """bits: 8 or 4. group_size: None = one scale per output channel (per expert);
  g = one scale per g consecutive input rows of each output channel (g divides I).
  scale_dtype: storage dtype of the scales (float16, as GPTQ / AWQ store them)."""

  bits: int = 8
  group_size: Optional[int] = None
  scale_dtype: str = "float16"

  def __post_init__(self):
    if self.bits not in BITS:
      raise ConfigError("quant.bits", self.bits, "weight-only quantisation is int8 or int4",
                        "use bits=8 or bits=4")
    if self.group_size is not None and self.group_size <= 0:
      raise ConfigError("quant.group_size", self.group_size, "must be > 0",
                        "use None (per channel) or a group size such as 64 or 128")
    if self.scale_dtype not in SCALE_DTYPES:
      raise ConfigError("quant.scale_dtype", self.scale_dtype, "unknown scale dtype",
                        f"use one of {', '.join(SCALE_DTYPES)}")

  @classmethod
  def parse(cls, text: str) -> "QuantConfig":
    """'int8', 'int4' (per channel) or 'int4_g32' (groups of 32 input rows)."""
    m = re.fullmatch(r"int(\d+)(?:_g(\d+))?", text)
    if not m:
      raise ConfigError("quant", text, "is not int<bits>[_g<group>]",
                        "write e.g. int8, int4 or int4_g32")
    return cls(bits=int(m.group(1)), group_size=int(m.group(2)) if m.group(2) else None)

  @property
  def label(self) -> str:
    return f"int{self.bits}" + (f"-g{self.group_size}" if self.group_size else "-channel")


def quantize_array(w: jax.Array, qcfg: QuantConfig, contract_axis: int) -> qwix.QArray:
  """w [..., I, ...] -> QArray: per-channel or per-group scales along ``contract_axis``.

  Every axis but the contraction axis keeps its own scales (expert axis,
  output channels); the contraction axis is reduced whole (per channel) or
  in groups of ``group_size``.
  """
  axis = contract_axis % w.ndim
  width = w.shape[axis]
  tiled = {}
  if qcfg.group_size is not None and qcfg.group_size < width:
    if width % qcfg.group_size:
      raise ConfigError("quant.group_size", qcfg.group_size,
                        f"does not divide the input width {width} of a weight of shape "
                        f"{tuple(w.shape)}", "pick a divisor of the expert widths and d_model")
    tiled = {axis: qcfg.group_size}
  channel = tuple(a for a in range(w.ndim) if a != axis)
  q = qwix.quantize(w.astype(jnp.float32), BITS[qcfg.bits], channelwise_axes=channel,
                    tiled_axes=tiled)
  return dataclasses.replace(q, scale=q.scale.astype(qcfg.scale_dtype))


def dequantize_array(q: qwix.QArray, dtype=jnp.float32) -> jax.Array:
  """codes * scales in ``dtype`` (the scales are cast up first, then multiplied)."""
  return qwix.dequantize(dataclasses.replace(q, scale=q.scale.astype(jnp.float32))).astype(dtype)


def is_quantized(x: Any) -> bool:
  return isinstance(x, qwix.QArray)


def _quantize_group(group: Mapping[str, Any], keys, contract_axis, qcfg, get, put):
  for key in keys:
    if key in group and not is_quantized(get(group[key])):
      put(group, key, quantize_array(get(group[key]), qcfg, contract_axis))


def quantize_params(params: Mapping[str, Any], qcfg: QuantConfig) -> dict:
  """A MoE layer's params dict (``moejax.layer.init_moe_params`` layout) with
  routed and shared expert weights replaced by QArrays; the rest as it was."""
  out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in params.items()}
  put = lambda g, k, v: g.__setitem__(k, v)
  if "experts" in out and "router" in out and not isinstance(out.get("peer"), Mapping):
    _quantize_group(out["experts"], ROUTED_KEYS, 1, qcfg, lambda v: v, put)
  if "shared" in out:
    _quantize_group(out["shared"], SHARED_KEYS, 0, qcfg, lambda v: v, put)
  return out


def dequantize_params(params: Any, dtype=jnp.float32) -> Any:
  """Every QArray leaf of a pytree replaced by its float value."""
  return jax.tree.map(lambda v: dequantize_array(v, dtype) if is_quantized(v) else v,
                      params, is_leaf=is_quantized)


# ---------------------------------------------------------------------------
# NNX models.

def moe_ffns(model: nnx.Module):
  """Every routed-expert FFN module (MoEFFN or ScMoEFFN) of a sparse layer."""
  for _, node in nnx.iter_graph(model):
    params = getattr(node, "params", None)
    cfg = getattr(node, "cfg", None)
    if (isinstance(node, nnx.Module) and isinstance(params, Mapping) and "experts" in params
        and isinstance(cfg, MoEConfig) and cfg.layer.routed):
      yield node


def quantize_model(model: nnx.Module, qcfg: QuantConfig) -> nnx.Module:
  """Quantises the expert weights of every sparse MoE layer of ``model`` in place.

  Each routed / shared expert ``nnx.Param`` then holds a ``qwix.QArray``
  (the float array is released). Expert weights shared across layers
  (``expert_sharing_group``) are quantised once. Run the model through
  :class:`moejax.serve.decode.Decoder` or :func:`forward`, which dequantise
  inside the jitted call; ``model(tokens)`` itself would fail on a QArray.
  Returns ``model``.
  """
  seen: set[int] = set()
  for ffn in moe_ffns(model):
    for group, keys, axis in ((ffn.params.get("experts"), ROUTED_KEYS, 1),
                              (ffn.params.get("shared"), SHARED_KEYS, 0)):
      if group is None:
        continue
      for key in keys:
        var = group.get(key)
        if var is None or id(var) in seen:
          continue
        seen.add(id(var))
        if not is_quantized(var.get_value()):
          var.set_value(quantize_array(var.get_value(), qcfg, axis))
  return model


def materialize(module: nnx.Module) -> None:
  """Replaces every QArray-valued Variable under ``module`` by its float value, in place.

  Call it only on a model merged inside a jitted function (a throwaway
  copy): on the caller's model it would undo the quantisation.
  """
  for _, node in nnx.iter_graph(module):
    if isinstance(node, nnx.Variable) and is_quantized(node.get_value()):
      node.set_value(dequantize_array(node.get_value(), jnp.float32))


@functools.partial(jax.jit, static_argnums=0)
def forward_split(graphdef, state, tokens: jax.Array) -> tuple[jax.Array, dict]:
  """:func:`forward` on a split model (``nnx.split``): one compile per graphdef and shape."""
  model = nnx.merge(graphdef, state)
  materialize(model)
  return model(tokens, train=False)


def forward(model: nnx.Module, tokens: jax.Array) -> tuple[jax.Array, dict]:
  """``model(tokens, train=False)`` jitted, with quantised experts dequantised inside."""
  graphdef, state = nnx.split(model)
  return forward_split(graphdef, state, jnp.asarray(tokens, jnp.int32))


# ---------------------------------------------------------------------------
# Memory.

def weight_bytes(tree: Any) -> dict:
  """Bytes of a params pytree: ``total``, ``quantized_codes``, ``scales``, ``float``.

  QArray codes count bits / 8 per element (int4: half a byte, as stored
  packed); scales and float leaves count their dtype's itemsize.
  """
  codes = scales = floats = 0

  def visit(v):
    nonlocal codes, scales, floats
    v = v.get_value() if isinstance(v, nnx.Variable) else v
    if is_quantized(v):
      bits = jnp.iinfo(v.qvalue.dtype).bits
      codes += v.qvalue.size * bits // 8
      scales += v.scale.size * v.scale.dtype.itemsize
    elif hasattr(v, "dtype") and hasattr(v, "size"):
      floats += v.size * jnp.dtype(v.dtype).itemsize

  jax.tree.map(visit, tree, is_leaf=lambda v: is_quantized(v) or isinstance(v, nnx.Variable))
  return {"total": codes + scales + floats, "quantized_codes": codes, "scales": scales,
          "float": floats}
