"""Serving memory of any :class:`~moejax.config.ModelConfig`: weights and KV cache, in bytes.

Legend: d model width, L decoder layers, H query heads, H_kv key/value
heads, h head width, r_kv MLA latent width, h_r MLA rotary key width, I / O
a weight matrix's input / output width, g quantisation group size, b bits
per weight, b_s bits per scale. GB = 1e9 bytes (what model cards and GPU
sizes quote: an "80 GB" H100 / A100).

**Weights** (:func:`weight_memory`). Parameter counts are
:func:`moejax.topology.accounting.budget`'s ``total``, less the
multi-token prediction modules, which serving drops. A
:class:`WeightFormat` stores every parameter at ``bits`` (fp32, bf16) or,
for the quantised formats (fp8, int8, int4), quantises the *matrices* of
the components in ``quantized`` and keeps everything else at ``high_bits``:

- quantised (default): attention projections, dense FFNs, routed and shared
  expert FFNs; each I x O matrix costs I O b / 8 bytes plus its scales:
  ceil(I / g) O scales per matrix with groups of g input rows (O with
  ``group_size=None``, one per output channel), b_s / 8 bytes each;
- kept at 16 bits: the input embedding, the LM head, norms, routers (and
  the Qwen shared-expert gate), MoD routers, zero-computation experts,
  PEER and Soft MoE parameters, biases. This is what the published
  weight-only quantisations of Mixtral do (AutoGPTQ / AutoAWQ skip the
  router ``gate`` and ``lm_head``, llama.cpp and bitsandbytes keep
  embeddings, norms and router in 16 bits), and it is what
  :mod:`moejax.serve.quantize` can run (there: expert matrices only).

**KV cache** (:func:`kv_bytes_per_token`): per decoder layer and token, MHA
/ GQA / MQA caches keys and values, 2 H_kv h numbers; MLA (DeepSeek-V2/V3)
caches the compressed latent and the shared rotary key, r_kv + h_r numbers
(DeepSeek-V2 paper, Table 1: (d_c + d_h^R) l elements per token). Mixture-
of-depths layers cache only the tokens they process (x capacity).
Encoder-decoder models: decoder self-attention only (cross-attention
caches are per source token).

**Devices** (:func:`devices_needed`): ceil(bytes / device bytes): the
weights alone; activations, the KV cache and runtime overhead need more
(pass their sum to budget a deployment).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from moejax.config import ArchitectureConfig, ModelConfig
from moejax.topology import accounting

GB = 1e9
QUANTIZABLE = ("attention", "dense_ffn", "routed_experts", "shared_experts")
# Trained but not served: generation drops the multi-token prediction modules.
NOT_SERVED = ("mtp",)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
  """How weights are stored.

  name: label. bits: bits per weight (per quantised weight when
  ``quantized`` is non-empty). group_size: input rows per scale (None: one
  scale per output channel). scale_bits: bits per scale. high_bits: bits
  of everything not quantised. quantized: components whose matrices are
  quantised (empty: every parameter at ``bits``, no scales).
  """

  name: str
  bits: float
  group_size: Optional[int] = 128
  scale_bits: int = 16
  high_bits: int = 16
  quantized: tuple = ()

  def __post_init__(self):
    if self.bits <= 0:
      raise ValueError(f"WeightFormat {self.name}: bits={self.bits} must be > 0")
    if self.group_size is not None and self.group_size <= 0:
      raise ValueError(f"WeightFormat {self.name}: group_size={self.group_size} must be > 0 "
                       "or None (per output channel)")
    unknown = set(self.quantized) - set(QUANTIZABLE)
    if unknown:
      raise ValueError(f"WeightFormat {self.name}: cannot quantise {sorted(unknown)}; "
                       f"quantisable components: {', '.join(QUANTIZABLE)}")


def standard_formats(group_size: Optional[int] = 128, scale_bits: int = 16,
                     quantized: Sequence[str] = QUANTIZABLE) -> dict[str, WeightFormat]:
  """fp32 / bf16 (everything at that width) and fp8 / int8 / int4 (quantised matrices)."""
  q = tuple(quantized)
  return {
      "fp32": WeightFormat("fp32", 32),
      "bf16": WeightFormat("bf16", 16),
      "fp8": WeightFormat("fp8", 8, group_size, scale_bits, quantized=q),
      "int8": WeightFormat("int8", 8, group_size, scale_bits, quantized=q),
      "int4": WeightFormat("int4", 4, group_size, scale_bits, quantized=q),
  }


# ---------------------------------------------------------------------------
# Matrices.

def _ffn_matrices(d: int, width: int, activation: str, count: int) -> list[tuple]:
  ups = 2 if activation == "swiglu" else 1
  return [(d, width, ups * count), (width, d, count)]


def _attention_matrices(cfg: ModelConfig, arch: ArchitectureConfig) -> list[tuple]:
  """(I, O, count) of one attention block's projections (biases not included)."""
  spec, opts = accounting.attention_kind(cfg, arch)
  return spec.matrices(cfg, opts)


def matrices(cfg: ModelConfig,
             arch: ArchitectureConfig = ArchitectureConfig()) -> dict[str, list[tuple]]:
  """{component: [(I, O, count)]}: the quantisable weight matrices of the whole model.

  Same layers and sharing rules as :func:`accounting.budget` (encoder and
  decoder stacks, cross-attention, MoE layout, expert sharing).
  """
  d = cfg.d_model
  out: dict[str, list[tuple]] = {name: [] for name in QUANTIZABLE}
  cross = arch.encoder_layers > 0
  seen = {"encoder": 0, "decoder": 0}
  layers = ([("encoder", i) for i in range(arch.encoder_layers)]
            + [("decoder", i) for i in range(cfg.n_layers)])
  for stack, i in layers:
    n_attn = 2 if (stack == "decoder" and cross) else 1
    out["attention"] += [(a, b, c * n_attn) for a, b, c in _attention_matrices(cfg, arch)]
    if not cfg.is_moe_layer(i):
      out["dense_ffn"] += _ffn_matrices(d, cfg.dense_ff_width, cfg.dense_activation, 1)
      continue
    moe = cfg.moe
    if moe.layer.expert_bank:
      if seen[stack] % cfg.expert_sharing_group == 0:
        for w in moe.widths:
          out["routed_experts"] += _ffn_matrices(d, w, moe.topology.activation, 1)
      t = moe.topology
      if t.num_shared_experts:
        fs = t.shared_expert_width or t.expert_width
        out["shared_experts"] += _ffn_matrices(d, t.num_shared_experts * fs, t.activation, 1)
    seen[stack] += 1
  return out


def _matrix_params(mats: list[tuple]) -> int:
  return sum(i * o * c for i, o, c in mats)


def _scales(mats: list[tuple], group_size: Optional[int]) -> int:
  if group_size is None:
    return sum(o * c for _, o, c in mats)
  return sum(math.ceil(i / group_size) * o * c for i, o, c in mats)


# ---------------------------------------------------------------------------
# Weights.

@dataclasses.dataclass(frozen=True)
class WeightMemory:
  """Bytes of a model's weights in one format.

  total: all bytes. quantized_params / high_params: parameters stored
  quantised / at ``high_bits``. scale_bytes: bytes of the scales.
  components: (name, bytes) per accounting component, scales included.
  """

  format: WeightFormat
  total: float
  params: int
  quantized_params: int
  high_params: int
  scale_bytes: float
  components: tuple

  @property
  def gb(self) -> float:
    return self.total / GB

  @property
  def bits_per_param(self) -> float:
    return 8 * self.total / self.params


def weight_memory(cfg: ModelConfig, fmt: WeightFormat,
                  arch: ArchitectureConfig = ArchitectureConfig()) -> WeightMemory:
  """Bytes of the weights of ``cfg`` stored in ``fmt`` (rules: module docstring).

  ``arch``: accounting-only parts of a preset (MLA, an encoder stack).
  """
  b = accounting.budget(cfg, seq_len=1, arch=arch)
  mats = matrices(cfg, arch) if fmt.quantized else {}
  comps, qparams, scale_bytes = [], 0, 0.0
  served = [(name, comp) for name, comp in b.components if name not in NOT_SERVED]
  for name, comp in served:
    if name in fmt.quantized:
      m = _matrix_params(mats[name])
      if m > comp.total:
        raise AssertionError(f"{name}: {m} matrix params exceed the accounting's "
                             f"{comp.total}; moejax.topology.memory.matrices is out of date")
      sb = _scales(mats[name], fmt.group_size) * fmt.scale_bits / 8
      comps.append((name, m * fmt.bits / 8 + sb + (comp.total - m) * fmt.high_bits / 8))
      qparams += m
      scale_bytes += sb
    else:
      bits = fmt.high_bits if fmt.quantized else fmt.bits
      comps.append((name, comp.total * bits / 8))
  params = sum(comp.total for _, comp in served)
  return WeightMemory(fmt, sum(v for _, v in comps), params, qparams, params - qparams,
                      scale_bytes, tuple(comps))


# ---------------------------------------------------------------------------
# KV cache and devices.

def kv_numbers_per_token(cfg: ModelConfig,
                         arch: ArchitectureConfig = ArchitectureConfig()) -> float:
  """Cached numbers per token over all decoder layers (module docstring)."""
  spec, opts = accounting.attention_kind(cfg, arch)
  per_layer = spec.cache_numbers(cfg, opts)
  return sum(per_layer * (cfg.mod_capacity if cfg.is_mod_layer(i) else 1.0)
             for i in range(cfg.n_layers))


def kv_bytes_per_token(cfg: ModelConfig, bits: int = 16,
                       arch: ArchitectureConfig = ArchitectureConfig()) -> float:
  return kv_numbers_per_token(cfg, arch) * bits / 8


def kv_bytes(cfg: ModelConfig, context: int, batch: int = 1, bits: int = 16,
             arch: ArchitectureConfig = ArchitectureConfig()) -> float:
  """KV-cache bytes of ``batch`` sequences of ``context`` tokens."""
  return kv_bytes_per_token(cfg, bits, arch) * context * batch


def devices_needed(total_bytes: float, device_gb: float = 80.0) -> int:
  """Fewest devices of ``device_gb`` GB whose memory sums to at least ``total_bytes``."""
  if device_gb <= 0:
    raise ValueError(f"device_gb={device_gb}: must be > 0")
  return max(1, math.ceil(total_bytes / (device_gb * GB) - 1e-12))


# ---------------------------------------------------------------------------
# Text table.

def memory_table(cfgs: dict[str, tuple], formats: dict[str, WeightFormat], *,
                 context: int = 4096, batch: int = 1, kv_bits: int = 16,
                 device_gb: float = 80.0) -> str:
  """Weights GB per format (devices needed in parentheses) and KV cache per model.

  ``cfgs``: label -> ModelConfig, or (ModelConfig, ArchitectureConfig) for presets.
  """
  head = ["model"] + [f"{n} GB (x{device_gb:g}GB)" for n in formats] + [
      f"KV/token KB ({kv_bits}b)", f"KV GB @ {batch}x{context}"]
  rows = [head]
  for label, entry in cfgs.items():
    cfg, arch = entry if isinstance(entry, tuple) else (entry, ArchitectureConfig())
    row = [label]
    for fmt in formats.values():
      wm = weight_memory(cfg, fmt, arch)
      row.append(f"{wm.gb:.2f} ({devices_needed(wm.total, device_gb)})")
    row += [f"{kv_bytes_per_token(cfg, kv_bits, arch) / 1e3:.1f}",
            f"{kv_bytes(cfg, context, batch, kv_bits, arch) / GB:.2f}"]
    rows.append(row)
  widths = [max(len(r[j]) for r in rows) for j in range(len(head))]
  fmt_row = lambda r: "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                                for j, (c, w) in enumerate(zip(r, widths)))
  q = next((f for f in formats.values() if f.quantized), None)
  note = "GB = 1e9 bytes; (xN) = devices of that size for the weights alone."
  if q is not None:
    scale = (f"groups of {q.group_size} input rows" if q.group_size
             else "one scale per output channel")
    note += (f" Quantised formats: {', '.join(q.quantized)} matrices at the format's bits, "
             f"{scale}, {q.scale_bits}-bit scales; embeddings, LM head, norms and routers at "
             f"{q.high_bits} bits.")
  return "\n".join([fmt_row(rows[0]), "  ".join("-" * w for w in widths)]
                   + [fmt_row(r) for r in rows[1:]] + [note])
