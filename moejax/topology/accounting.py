"""Parameter and FLOP accounting for any :class:`~moejax.config.ModelConfig`.

Legend: V vocabulary, d model width, L decoder layers, L_enc encoder layers,
H query heads, H_kv key/value heads, h head width, S sequence length, E routed
FFN experts, Z zero-computation experts, J constant experts, K slots per
token, w_e width of expert e, f_s shared-expert width, p Soft MoE slots per
expert, N = n^2 PEER experts, D PEER query width.

Conventions (what every number in :class:`Budget` means):

- **total**: every trainable parameter: the input embedding table, the LM
  head when untied, attention, dense FFNs, routed / shared / zero-computation
  experts, routers, PEER and Soft MoE parameters, norms. The aux-loss-free
  selection bias is router *state*, not a parameter, and is not counted. Not
  modelled (each under 0.05% of every preset): QK-norm weights, attention
  sinks, biases inside expert FFNs, T5 relative-position biases.
- **active**: the expected number of parameters one token uses in a forward
  pass under balanced routing, by the *matmul convention*: every weight that
  multiplies the token's activations counts, including the LM head (V d),
  while the input embedding table does not (a token reads one row of it).
  This is the convention of DeepSeek-V3 ("36.6B activated, including 0.9B for
  the output head") and of the gpt-oss model card. Other publishers (Mistral,
  Qwen) also count the input table: that is ``Budget.active_with_embedding``.
  Routed experts count expected slots x mean expert size: K E / (E + Z) FFN
  slots for token-choice routers (the rest land on zero-computation experts),
  c experts per token for expert choice with capacity c, router.top_k (its
  maximum) for top-p. ``active_max`` bounds it: every slot on the widest
  expert (every expert, for expert choice).
- **flops_per_token**: forward FLOPs of one token, 2 per multiply-accumulate:
  2 x the active matmul parameters, plus the attention mixing at sequence
  length S: 2 S H d_qk for QK^T and 2 S H d_v for AV per attention layer,
  every token attending to all S positions (the convention of Hoffmann et
  al. 2203.15556, App. F; a causal mask halves this on average, sliding
  windows cut it further: not modelled). Soft MoE adds its dispatch and
  combine mixing (2 d E p each per token) and PEER its sub-key scoring
  (2 n D per head: the sub-keys are shared by the H heads but each head
  scores them). Elementwise work (norms, activations, softmax, the
  zero-computation mixing) is not counted. Training is about 3x forward.
- **Encoder-decoder** (T5 / Switch, ``accounting.encoder_layers > 0``): one token is
  counted through both stacks, the convention behind "FLOP-matched to
  T5-Base"; cross-attention attends over S encoder positions.
- **Mixture-of-depths** blocks process a fraction c of the tokens: their
  active parameters and FLOPs are scaled by c (attention mixing by c^2, as
  selected tokens only see selected tokens), plus a d-wide router.
- **Expert sharing** (``expert_sharing_group`` g): g consecutive MoE layers
  share one set of routed expert weights, counted once in total.
- **Multi-token prediction** (``mtp_depth`` D, :mod:`moejax.nn.mtp`): the
  ``mtp`` component. Its parameters are in total; they are not active
  (inference drops the modules, DeepSeek-V3's 37B activated excludes them),
  but their training FLOPs are in flops_per_token: per module and token the
  [2d, d] projection, one block (attention with its mixing at S, a dense FFN
  of ``dense_ff_width`` or, with ``mtp_ffn='moe'``, an MoE layer counted as a
  main one: all its parameters, its active ones' FLOPs) and the shared LM
  head again (2 V d).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from moejax.config import ArchitectureConfig, ModelConfig, MoEConfig
from moejax.config.registry import ATTENTIONS

COMPONENTS = ("embedding", "lm_head", "attention", "dense_ffn", "routed_experts",
              "shared_experts", "router", "zero_compute", "peer", "soft_moe",
              "mod_router", "mtp", "norms")


@dataclasses.dataclass(frozen=True)
class Component:
  """Parameters and FLOPs of one part of the model, summed over its layers.

  total: parameters; active / active_max: expected and maximal parameters
  used per token; flops: forward FLOPs per token.
  """

  total: int = 0
  active: float = 0.0
  active_max: float = 0.0
  flops: float = 0.0

  def __add__(self, other: "Component") -> "Component":
    return Component(self.total + other.total, self.active + other.active,
                     self.active_max + other.active_max, self.flops + other.flops)

  def scaled(self, frac: float, flops_frac: Optional[float] = None) -> "Component":
    """The same parameters, used by a fraction of the tokens."""
    return Component(self.total, self.active * frac, self.active_max * frac,
                     self.flops * (frac if flops_frac is None else flops_frac))


def _dense(params: int) -> Component:
  """A matmul every token uses in full."""
  return Component(params, params, params, 2.0 * params)


@dataclasses.dataclass(frozen=True)
class Budget:
  """The parameter and compute budget of one model config.

  Attributes:
    total: all trainable parameters.
    active: expected parameters used per token (matmul convention, see the
      module docstring: LM head in, input embedding table out).
    active_max: upper bound of ``active`` over routing outcomes.
    flops_per_token: forward FLOPs per token at ``seq_len``.
    seq_len: the S of the attention (and Soft MoE group) FLOPs.
    input_embedding: parameters of the input embedding table that ``active``
      leaves out (0 when it is tied to the LM head, which ``active`` counts).
    components: (name, Component) pairs in :data:`COMPONENTS` order, only the
      ones present; ``breakdown`` gives them as a dict.
  """

  total: int
  active: float
  active_max: float
  flops_per_token: float
  seq_len: int
  input_embedding: int
  components: tuple

  @property
  def breakdown(self) -> dict[str, Component]:
    return dict(self.components)

  @property
  def active_with_embedding(self) -> float:
    """``active`` plus the input embedding table (Mistral / Qwen convention)."""
    return self.active + self.input_embedding

  @property
  def non_embedding_total(self) -> int:
    b = self.breakdown
    return self.total - b["embedding"].total - b.get("lm_head", Component()).total


# ---------------------------------------------------------------------------
# Per-layer pieces.

def ffn_params(d_model: int, width: int, activation: str) -> int:
  """One bias-free FFN of hidden width w: (3 for swiglu, 2 for gelu) d w."""
  return (3 if activation == "swiglu" else 2) * d_model * width


def attention_kind(cfg: ModelConfig, arch: ArchitectureConfig = ArchitectureConfig()):
  """(AttentionSpec, options) counted for ``cfg``: the model's own ``model.attention``, or
  the kind a preset's accounting section names in its place (``accounting.attention``)."""
  if arch.attention is None:
    return cfg.attention_spec, cfg.attention_options
  spec = ATTENTIONS.get(arch.attention, "accounting.attention")
  return spec, spec.options_from_architecture(arch)


def attention_params(cfg: ModelConfig, arch: ArchitectureConfig = ArchitectureConfig()) -> int:
  """Weights of one self-attention block (norms excluded), as its attention kind counts them.

  MHA / GQA / MQA: q [d, H h], k and v [d, H_kv h], o [H h, d], plus biases
  when ``attention_bias``. MLA (DeepSeek-V2/V3): the query is q [d, H (h_nope
  + h_rope)] or, with q_lora_rank r_q > 0, q_a [d, r_q] then q_b [r_q, H
  (h_nope + h_rope)]; kv_a [d, r_kv + h_rope] compresses keys / values (plus
  the shared rope key), kv_b [r_kv, H (h_nope + h_v)] expands them, o [H h_v,
  d].
  """
  spec, opts = attention_kind(cfg, arch)
  return spec.params(cfg, opts)


def attention_mix_flops(cfg: ModelConfig, seq_len: int,
                        arch: ArchitectureConfig = ArchitectureConfig()) -> float:
  """QK^T and AV FLOPs of one token in one attention block over S positions."""
  spec, opts = attention_kind(cfg, arch)
  return spec.mix_flops(cfg, opts, seq_len)


def _attention_norm_params(cfg: ModelConfig, arch: ArchitectureConfig) -> int:
  """Norms inside attention (MLA's latent RMSNorms)."""
  spec, opts = attention_kind(cfg, arch)
  return spec.norm_params(cfg, opts)


def moe_components(moe: MoEConfig, d_model: int, seq_len: int) -> dict[str, Component]:
  """Components of one MoE FFN slot: the layer kind's ``components`` (any ``moe.kind``)."""
  moe.check_resolved("moejax.topology.accounting")
  return moe.layer.components(moe, d_model, seq_len)


def peer_components(moe: MoEConfig, d_model: int, seq_len: int) -> dict[str, Component]:
  """PEER: N^2 singleton experts, h heads of top-k retrieval over product keys."""
  del seq_len
  d = d_model
  o = moe.layer_options
  h, n, dk, k = o.heads, o.num_keys, o.key_dim, o.top_k
  per_expert = (3 if moe.topology.activation == "swiglu" else 2) * d
  query = h * d * dk + 2 * h * dk  # W_q and the query LayerNorm
  keys = n * dk  # two halves of n sub-keys, D/2 wide
  total = n * n * per_expert + query + keys
  active = h * k * per_expert + query + keys
  flops = 2.0 * (h * k * per_expert + h * d * dk) + 2.0 * h * n * dk
  return {"peer": Component(total, active, active, flops)}


def soft_components(moe: MoEConfig, d_model: int, seq_len: int) -> dict[str, Component]:
  """Soft MoE: every expert processes its p slots per group of S tokens."""
  d = d_model
  sizes = [ffn_params(d, w, moe.topology.activation) for w in moe.widths]
  out: dict[str, Component] = {}
  # Each group of S tokens (one sequence) fills E p slots; every expert
  # processes its p slots, so a token's share is p sum_e size_e / S.
  p = moe.layer_options.slots_per_expert
  share = p * sum(sizes) / seq_len
  out["routed_experts"] = Component(sum(sizes), share, share, 2.0 * share)
  slots = moe.topology.num_experts * p
  phi = d * slots
  # logits (the phi matmul), then dispatch and combine: 2 d E p FLOPs each.
  out["soft_moe"] = Component(phi + 1, phi, phi, 2.0 * phi + 4.0 * d * slots)
  return out


def sparse_components(moe: MoEConfig, d_model: int, seq_len: int) -> dict[str, Component]:
  """Routed experts (by the router spec's slots), router, shared and zero-compute experts."""
  del seq_len
  d = d_model
  sizes = [ffn_params(d, w, moe.topology.activation) for w in moe.widths]
  mean_e, max_e = sum(sizes) / len(sizes), max(sizes)
  out: dict[str, Component] = {}
  spec = moe.router
  slots, slots_max = spec.slots(moe)  # (expected, maximal) FFN-expert slots per token
  active = slots * mean_e
  # A token-choice router fills at most K slots; otherwise a token may reach every expert.
  max_active = slots_max * max_e if spec.token_choice else float(sum(sizes))
  out["routed_experts"] = Component(sum(sizes), active, max_active, 2.0 * active)
  r = moe.routing
  router = spec.param_count(d, moe)  # counted from the spec's parameter shapes
  if router:
    flops = spec.router_flops(d, moe)
    out["router"] = Component(router, router, router, flops)
  if moe.topology.num_shared_experts:
    fs = moe.topology.shared_expert_width or moe.topology.expert_width
    shared = moe.topology.num_shared_experts * ffn_params(d, fs, moe.topology.activation)
    shared += d if moe.topology.shared_expert_gate else 0
    out["shared_experts"] = _dense(shared)
  if moe.topology.constant_experts:
    # Constant expert j: W_c[j] [d, 2] and v_j [d]; only W_c is a matmul.
    j = moe.topology.constant_experts
    frac = (r.top_k if spec.token_choice else 0) * j / moe.num_routed
    out["zero_compute"] = Component(j * 3 * d, frac * 3 * d, 0.0, frac * 2.0 * 2 * d)
  return out


# ---------------------------------------------------------------------------
# The whole model.

def _stack_layers(cfg: ModelConfig, arch: ArchitectureConfig) -> list[tuple[str, int]]:
  """(stack, index) of every layer: encoder layers first, then decoder."""
  return ([("encoder", i) for i in range(arch.encoder_layers)]
          + [("decoder", i) for i in range(cfg.n_layers)])


def budget(cfg: ModelConfig, seq_len: int = 4096,
           arch: ArchitectureConfig = ArchitectureConfig()) -> Budget:
  """Parameter and FLOP budget of ``cfg`` (conventions: module docstring).

  Args:
    cfg: any ModelConfig (dense, sparse, soft or PEER MoE, MHA/GQA).
    seq_len: S for the attention mixing FLOPs and the Soft MoE group size.
    arch: accounting-only parts of a published architecture the model does
      not build (MLA, an encoder stack; :class:`moejax.config.ArchitectureConfig`,
      from a preset's ``accounting`` section).
  """
  if seq_len <= 0:
    raise ValueError(f"seq_len={seq_len}: must be > 0")
  d = cfg.d_model
  acc: dict[str, Component] = {}

  def add(name: str, comp: Component) -> None:
    acc[name] = acc.get(name, Component()) + comp

  table = cfg.vocab_size * d
  add("embedding", Component(table, 0.0, 0.0, 0.0))
  # The LM head is a matmul every token does; when tied its weights are the
  # embedding table (already in total), so only its use is counted.
  add("lm_head", Component(0 if cfg.tie_embeddings else table, table, table, 2.0 * table))

  attn = attention_params(cfg, arch)
  mix = attention_mix_flops(cfg, seq_len, arch)
  cross = arch.encoder_layers > 0
  moe_seen: dict[str, int] = {"encoder": 0, "decoder": 0}
  for stack, i in _stack_layers(cfg, arch):
    layer: dict[str, Component] = {}
    n_attn = 2 if (stack == "decoder" and cross) else 1
    layer["attention"] = Component(n_attn * attn, n_attn * attn, n_attn * attn,
                                   n_attn * (2.0 * attn + mix))
    norms = (n_attn + 1) * d + n_attn * _attention_norm_params(cfg, arch)
    layer["norms"] = Component(norms, norms, norms, 0.0)
    if cfg.is_moe_layer(i):
      for name, comp in moe_components(cfg.moe, d, seq_len).items():
        if name == "routed_experts" and moe_seen[stack] % cfg.expert_sharing_group:
          comp = dataclasses.replace(comp, total=0)  # shares the group's first copy
        layer[name] = comp
      moe_seen[stack] += 1
    else:
      layer["dense_ffn"] = _dense(ffn_params(d, cfg.dense_ff_width, cfg.dense_activation))
    if stack == "decoder" and cfg.is_mod_layer(i):
      c = cfg.mod_capacity
      layer = {name: comp.scaled(c) for name, comp in layer.items()}
      # Selected tokens attend only to the c S selected positions.
      a = layer["attention"]
      layer["attention"] = dataclasses.replace(
          a, flops=c * n_attn * (2.0 * attn + c * mix))
      layer["mod_router"] = _dense(d)
    for name, comp in layer.items():
      add(name, comp)
  if cfg.mtp_depth:
    add("mtp", mtp_component(cfg, seq_len))
  n_final = 1 + (1 if cross else 0)
  add("norms", Component(n_final * d, n_final * d, n_final * d, 0.0))

  comps = tuple((name, acc[name]) for name in COMPONENTS if name in acc)
  return Budget(
      total=sum(c.total for _, c in comps),
      active=sum(c.active for _, c in comps),
      active_max=sum(c.active_max for _, c in comps),
      flops_per_token=sum(c.flops for _, c in comps),
      seq_len=seq_len,
      input_embedding=0 if cfg.tie_embeddings else table,
      components=comps,
  )


def mtp_component(cfg: ModelConfig, seq_len: int) -> Component:
  """The D multi-token prediction modules (module docstring): params, not active, FLOPs."""
  d = cfg.d_model
  spec, opts = cfg.attention_spec, cfg.attention_options
  matmul = 2 * d * d + spec.params(cfg, opts)
  if cfg.mtp_ffn == "moe":
    ffn = moe_components(cfg.moe, d, seq_len).values()
    ffn_total, ffn_flops = sum(c.total for c in ffn), sum(c.flops for c in ffn)
  else:
    ffn_total = ffn_params(d, cfg.dense_ff_width, cfg.dense_activation)
    ffn_flops = 2.0 * ffn_total
  norms = 5 * d + spec.norm_params(cfg, opts)  # hidden, embedding, 2 block, head norms
  flops = (2.0 * matmul + ffn_flops + spec.mix_flops(cfg, opts, seq_len)
           + 2.0 * cfg.vocab_size * d)
  return Component(cfg.mtp_depth * (matmul + ffn_total + norms), 0.0, 0.0,
                   cfg.mtp_depth * flops)


# ---------------------------------------------------------------------------
# Text table.

def human(n: float) -> str:
  """12345678 -> '12.35M'; 1.2e12 -> '1.20T'."""
  for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f}{unit}"
  return f"{n:.0f}" if float(n).is_integer() else f"{n:.2f}"


def _align(rows: list[list[str]]) -> list[str]:
  widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
  fmt = lambda r: "  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                            for j, (c, w) in enumerate(zip(r, widths)))
  return [fmt(rows[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows[1:]]


def _published_active(b: Budget, pub: Mapping) -> float:
  """Ours, in the publisher's convention (see :func:`budget_table`)."""
  if pub.get("active_convention") == "with_embedding":
    return b.active_with_embedding
  return b.active


def budget_table(budgets: Mapping[str, Budget],
                 published: Optional[Mapping[str, Mapping]] = None) -> str:
  """Aligned text tables: a summary row per model, then the breakdown.

  Args:
    budgets: label -> Budget (columns / rows in insertion order).
    published: optional label -> {'total', 'active', 'active_convention'}:
      adds the published numbers and our % error. ``active_convention``
      'with_embedding' compares ``active_with_embedding``, anything else
      ``active`` (the matmul convention of this module).

  Returns:
    The summary table (total, active, active with the input table, active
    upper bound, forward GFLOPs per token, and published numbers with %
    error), a blank line, and the per-component breakdown as
    "total / active" cells, one column per model.
  """
  published = published or {}
  head = ["model", "total", "active", "active+emb", "active max", "GFLOPs/tok"]
  if published:
    head += ["pub total", "pub active", "err total", "err active"]
  summary = [head]
  for label, b in budgets.items():
    row = [label, human(b.total), human(b.active), human(b.active_with_embedding),
           human(b.active_max), f"{b.flops_per_token / 1e9:.3f}"]
    if published:
      pub = published.get(label)
      if pub:
        conv = "+emb" if pub.get("active_convention") == "with_embedding" else ""
        row += [human(pub["total"]), human(pub["active"]) + conv,
                f"{100 * relative_error(b.total, pub['total']):+.2f}%",
                f"{100 * relative_error(_published_active(b, pub), pub['active']):+.2f}%"]
      else:
        row += ["-"] * 4
    summary.append(row)

  names = [c for c in COMPONENTS if any(c in b.breakdown for b in budgets.values())]
  breakdown = [["component (total / active)"] + list(budgets)]
  for n in names:
    cells = []
    for b in budgets.values():
      c = b.breakdown.get(n)
      cells.append("-" if c is None else f"{human(c.total)} / {human(c.active)}")
    breakdown.append([n] + cells)

  seqs = ", ".join(str(s) for s in sorted({b.seq_len for b in budgets.values()}))
  note = (f"S={seqs}. active: params per token, matmul convention (LM head in, input "
          "embedding table out); active+emb adds the input table; '+emb' marks "
          "publishers counting it.")
  return "\n".join(_align(summary) + [""] + _align(breakdown) + [note])


def relative_error(ours: float, published: float) -> float:
  """(ours - published) / published."""
  if published == 0:
    return math.inf
  return ours / published - 1.0
