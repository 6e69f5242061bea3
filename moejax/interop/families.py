"""Per-family knowledge: Hugging Face config fields and tensor names <-> MoEConfig.

Legend: d model width, E routed experts, K experts per token, f routed
expert width, K_s shared experts, f_s shared expert width, G groups.

Every family name lives here (the generic layer and routers never branch on
a model name). A :class:`Family` says

- how a Hugging Face config (a ``PretrainedConfig`` or its ``config.json``
  dict) maps to a :class:`~moejax.config.MoEConfig`, and back to HF fields;
- where a MoE block's tensors sit in a checkpoint and which layers are MoE.

The four families, in transformers' own terms (``modeling_<family>.py``):

=============  ==========================================================
mixtral        softmax over E, top-K, renormalised (= softmax over the
               top-K logits: ``gating='topk_softmax'``); no shared expert.
qwen2_moe      softmax over E, top-K, renormalised iff ``norm_topk_prob``;
               one shared expert of width ``shared_expert_intermediate_size``
               scaled by sigmoid(x w_shared_gate), w_shared_gate [d, 1].
qwen3_moe      qwen2_moe without the shared expert.
deepseek_v3    sigmoid scores; selection on score + ``e_score_correction_bias``
               (RouterState.bias, use_bias=True) within the ``topk_group`` of
               ``n_group`` groups ranked by the sum of their top-2 biased
               scores; gates from the unbiased scores, renormalised iff
               ``norm_topk_prob``, times ``routed_scaling_factor``;
               ``n_shared_experts`` shared experts of width f as one FFN of
               width K_s f, ungated.
=============  ==========================================================

``moe_config(hf_config, base)`` sets every *architecture* field of the
layer (what changes its forward function) and keeps the rest from ``base``
(capacity, backend, balance losses, router dtype and noise: training and
execution choices a checkpoint does not record). Where two moejax configs
compute the same function (``topk_softmax`` vs ``normalized`` gating on
softmax scores, K_s shared experts of width f_s vs one of width K_s f_s,
``group_score='auto'`` vs ``'top2_sum'`` with a bias) the base's choice is
kept, so export -> import with ``base_cfg=cfg`` returns ``cfg`` itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from moejax.config import BalanceConfig, MoEConfig
from moejax.interop.errors import InteropError, UnsupportedArchitectureError

_MISSING = object()


def hf_get(config: Any, *names: str, default: Any = _MISSING) -> Any:
  """The first of ``names`` present in an HF config object or config.json dict."""
  for name in names:
    if isinstance(config, Mapping):
      if name in config:
        return config[name]
    elif hasattr(config, name):
      return getattr(config, name)
  if default is not _MISSING:
    return default
  model_type = hf_get(config, "model_type", default="?") if names != ("model_type",) else "?"
  raise InteropError(f"the Hugging Face config (model_type={model_type!r}) has no field "
                     f"{' / '.join(repr(n) for n in names)}. Fix: pass the model's full "
                     "config (its config.json or transformers config object)")


def _check_act(config: Any) -> None:
  act = hf_get(config, "hidden_act", default="silu")
  if act not in ("silu", "swish"):
    raise InteropError(f"hidden_act={act!r}: moejax's swiglu experts compute "
                       "down(silu(x W_gate) * (x W_up)). Fix: only silu-gated (SwiGLU) "
                       "checkpoints convert exactly")


def _gating(norm: bool, default: str, base: Optional[MoEConfig]) -> str:
  """Gating for softmax scores; topk_softmax == normalized there, so keep base's."""
  if not norm:
    return "scores"
  if base is not None and base.routing.gating in ("topk_softmax", "normalized"):
    return base.routing.gating
  return default


def _shared(total: int, gate: bool, expert_width: int, default: tuple,
            base: Optional[MoEConfig]) -> dict:
  """Shared-expert fields for one dense shared FFN of width ``total`` (= K_s f_s).

  K_s experts of width f_s and one of width K_s f_s are the same function and
  the same parameters (moejax stores shared experts as one FFN), so a base
  config with the same product is kept as it is.
  """
  if total == 0:
    keep = (base or MoEConfig()).topology
    return {"num_shared_experts": 0, "shared_expert_width": keep.shared_expert_width,
            "shared_expert_gate": keep.shared_expert_gate}
  ks, fs = default
  if base is not None and base.topology.num_shared_experts:
    eff = base.topology.shared_expert_width or expert_width
    if base.topology.num_shared_experts * eff == total:
      ks, fs = base.topology.num_shared_experts, base.topology.shared_expert_width
  return {"num_shared_experts": ks, "shared_expert_width": fs, "shared_expert_gate": gate}


def check_moe_config(cfg: Any, name: str) -> None:
  if cfg is not None and not isinstance(cfg, MoEConfig):
    raise TypeError(f"{name} must be a MoEConfig, got {type(cfg).__name__}. Fix: build it "
                    "with moejax.config.MoEConfig(...) or from_dict(MoEConfig, ...)")


def compose(base: Optional[MoEConfig], topology: dict, router: dict) -> MoEConfig:
  """``base`` with every architecture field replaced (token-choice sparse SwiGLU).

  ``topology`` fields replace ``base.topology``'s, ``router`` fields
  ``base.routing``'s; balance and execution settings of ``base`` are kept.
  """
  base = base or MoEConfig()
  # The linear top-k router has no options that change its function; a base built from a
  # config dict holds them completed (NoOptions()), which the result keeps.
  topk = dataclasses.replace(base.routing, kind="topk", options=None).spec
  options = base.routing.options if type(base.routing.options) is topk.Options else None
  router = {"kind": "topk", "options": options, **router}
  if router.get("n_groups", 1) == 1:
    router.setdefault("group_score", base.routing.group_score)  # no effect without groups
  rc = dataclasses.replace(base.routing, **router)
  tc = dataclasses.replace(base.topology, activation="swiglu", expert_widths=None,
                           zero_experts=0, copy_experts=0, constant_experts=0, **topology)
  # A base of another layer kind keeps nothing of its options (they are that kind's).
  return dataclasses.replace(base, kind="sparse", layer_options=None, topology=tc, routing=rc)


# ---------------------------------------------------------------------------
# The families.

def _mixtral_cfg(hf: Any, base: Optional[MoEConfig]) -> MoEConfig:
  _check_act(hf)
  f = hf_get(hf, "intermediate_size")
  return compose(base, {"num_experts": hf_get(hf, "num_local_experts", "num_experts"),
                        "expert_width": f, **_shared(0, False, f, (0, None), base)},
                 {"score_fn": "softmax", "top_k": hf_get(hf, "num_experts_per_tok"),
                  "gating": _gating(True, "topk_softmax", base),
                  "routed_scaling_factor": 1.0, "use_bias": False, "n_groups": 1,
                  "topk_groups": 1})


def _mixtral_fields(cfg: MoEConfig, d: int) -> dict:
  return {"model_type": "mixtral", "hidden_size": d, "hidden_act": "silu",
          "intermediate_size": cfg.topology.expert_width, "num_local_experts": cfg.num_experts,
          "num_experts_per_tok": cfg.routing.top_k}


def _qwen_cfg(hf: Any, base: Optional[MoEConfig], shared: bool) -> MoEConfig:
  _check_act(hf)
  f = hf_get(hf, "moe_intermediate_size")
  total = hf_get(hf, "shared_expert_intermediate_size") if shared else 0
  return compose(base, {"num_experts": hf_get(hf, "num_experts", "num_local_experts"),
                        "expert_width": f, **_shared(total, True, f, (1, total), base)},
                 {"score_fn": "softmax", "top_k": hf_get(hf, "num_experts_per_tok"),
                  "gating": _gating(bool(hf_get(hf, "norm_topk_prob", default=False)),
                                    "normalized", base),
                  "routed_scaling_factor": 1.0, "use_bias": False, "n_groups": 1,
                  "topk_groups": 1})


def _qwen_fields(cfg: MoEConfig, d: int, model_type: str) -> dict:
  out = {"model_type": model_type, "hidden_size": d, "hidden_act": "silu",
         "moe_intermediate_size": cfg.topology.expert_width, "num_experts": cfg.num_experts,
         "num_experts_per_tok": cfg.routing.top_k,
         "norm_topk_prob": cfg.routing.gating != "scores"}
  if model_type == "qwen2_moe":
    fs = cfg.topology.shared_expert_width or cfg.topology.expert_width
    out["shared_expert_intermediate_size"] = cfg.topology.num_shared_experts * fs
  return out


def _qwen_layers(hf: Any) -> list[int]:
  n = hf_get(hf, "num_hidden_layers")
  step = hf_get(hf, "decoder_sparse_step", default=1) or 1
  dense = set(hf_get(hf, "mlp_only_layers", default=None) or ())
  e = hf_get(hf, "num_experts", "num_local_experts")
  return [i for i in range(n) if i not in dense and e > 0 and (i + 1) % step == 0]


def _deepseek_cfg(hf: Any, base: Optional[MoEConfig]) -> MoEConfig:
  _check_act(hf)
  f = hf_get(hf, "moe_intermediate_size")
  n_shared = hf_get(hf, "n_shared_experts", default=0) or 0
  n_group = hf_get(hf, "n_group", default=1) or 1
  topk_group = 1 if n_group == 1 else hf_get(hf, "topk_group", default=1) or 1
  router = {"score_fn": "sigmoid", "top_k": hf_get(hf, "num_experts_per_tok"),
            "gating": "normalized" if hf_get(hf, "norm_topk_prob", default=True) else "scores",
            "routed_scaling_factor": float(hf_get(hf, "routed_scaling_factor", default=1.0)),
            "use_bias": True, "n_groups": n_group, "topk_groups": topk_group}
  if n_group > 1:
    # HF ranks groups by the sum of their top-2 biased scores; with use_bias
    # moejax's 'auto' resolves to the same rule.
    keep = base is not None and base.routing.group_score in ("auto", "top2_sum")
    router["group_score"] = base.routing.group_score if keep else "top2_sum"
  return compose(base, {"num_experts": hf_get(hf, "n_routed_experts", "num_local_experts"),
                        "expert_width": f,
                        **_shared(n_shared * f, False, f, (n_shared, None), base)},
                 router)


def _deepseek_fields(cfg: MoEConfig, d: int) -> dict:
  rc, f = cfg.routing, cfg.topology.expert_width
  total = cfg.topology.num_shared_experts * (cfg.topology.shared_expert_width or f)
  if total % f:
    raise InteropError(
        f"moe.topology.num_shared_experts={cfg.topology.num_shared_experts} x moe.topology.shared_expert_width="
        f"{cfg.topology.shared_expert_width} = {total} is not a multiple of moe.topology.expert_width={f}: "
        "deepseek_v3 shared experts have the routed width (n_shared_experts * "
        "moe_intermediate_size). Fix: use shared widths that sum to a multiple of "
        "expert_width")
  return {"model_type": "deepseek_v3", "hidden_size": d, "hidden_act": "silu",
          "moe_intermediate_size": f, "n_routed_experts": cfg.num_experts,
          "n_shared_experts": total // f, "num_experts_per_tok": rc.top_k,
          "n_group": rc.n_groups, "topk_group": rc.topk_groups,
          "norm_topk_prob": rc.gating == "normalized",
          "routed_scaling_factor": rc.routed_scaling_factor}


def _deepseek_layers(hf: Any) -> list[int]:
  n = hf_get(hf, "num_hidden_layers")
  first = hf_get(hf, "first_k_dense_replace", default=0) or 0
  return list(range(first, n))


@dataclasses.dataclass(frozen=True)
class Family:
  """How one Hugging Face MoE family maps onto moejax.

  Attributes:
    model_type: the HF ``config.model_type``.
    moe_config: (hf_config, base MoEConfig or None) -> MoEConfig.
    hf_fields: (MoEConfig, d) -> the HF config fields of the MoE block.
    moe_layers: hf_config -> indices of the decoder layers that are MoE.
    module_prefix: the block's module path in transformers (also its key
      prefix in ``model.state_dict()``), with ``{layer}``.
    checkpoint_prefix: the block's key prefix in released safetensors files.
    expert_keys: per-expert tensor names of W_gate, W_up, W_down in released
      checkpoints (``experts.{i}.<name>.weight``); transformers >= 5 holds
      them fused as ``experts.gate_up_proj`` [E, 2f, d] and
      ``experts.down_proj`` [E, d, f] in memory.
    shared_key: module name of the shared FFN, None without one.
    shared_gate_key: module name of the Qwen shared-expert gate, or None.
    bias_key: the router's selection-bias buffer, or None.
  """

  model_type: str
  moe_config: Callable[[Any, Optional[MoEConfig]], MoEConfig]
  hf_fields: Callable[[MoEConfig, int], dict]
  moe_layers: Callable[[Any], list[int]]
  module_prefix: str = "model.layers.{layer}.mlp"
  checkpoint_prefix: str = "model.layers.{layer}.mlp"
  expert_keys: tuple = ("gate_proj", "up_proj", "down_proj")
  router_key: str = "gate.weight"
  shared_key: Optional[str] = None
  shared_gate_key: Optional[str] = None
  bias_key: Optional[str] = None

  def prefixes(self, layer: int) -> tuple[str, ...]:
    """Candidate key prefixes of layer ``layer``'s block, in-memory layout first.

    Each also without its leading ``model.``: a base model's (not the causal
    LM's) state dict starts at ``layers.``.
    """
    full = [t.format(layer=layer) for t in (self.module_prefix, self.checkpoint_prefix)]
    out = full + [p.removeprefix("model.") for p in full]
    return tuple(dict.fromkeys(out))


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
  """Adds (or replaces) the converter of ``family.model_type``."""
  FAMILIES[family.model_type] = family
  return family


register_family(Family(
    "mixtral", _mixtral_cfg, _mixtral_fields,
    lambda hf: list(range(hf_get(hf, "num_hidden_layers"))),
    checkpoint_prefix="model.layers.{layer}.block_sparse_moe",
    expert_keys=("w1", "w3", "w2")))
register_family(Family(
    "qwen2_moe", lambda hf, base: _qwen_cfg(hf, base, shared=True),
    lambda cfg, d: _qwen_fields(cfg, d, "qwen2_moe"), _qwen_layers,
    shared_key="shared_expert", shared_gate_key="shared_expert_gate"))
register_family(Family(
    "qwen3_moe", lambda hf, base: _qwen_cfg(hf, base, shared=False),
    lambda cfg, d: _qwen_fields(cfg, d, "qwen3_moe"), _qwen_layers))
register_family(Family(
    "deepseek_v3", _deepseek_cfg, _deepseek_fields, _deepseek_layers,
    shared_key="shared_experts", bias_key="gate.e_score_correction_bias"))


def get_family(model_type: Any) -> Family:
  """The Family of ``model_type``; UnsupportedArchitectureError lists the supported."""
  if model_type not in FAMILIES:
    raise UnsupportedArchitectureError(model_type, FAMILIES)
  return FAMILIES[model_type]


def family_of(hf_config: Any) -> Family:
  return get_family(hf_get(hf_config, "model_type"))


def moe_config_from_hf(hf_config: Any, base_cfg: Optional[MoEConfig] = None) -> MoEConfig:
  """The MoEConfig of one MoE block of ``hf_config`` (see the module docstring)."""
  check_moe_config(base_cfg, "base_cfg")
  return family_of(hf_config).moe_config(hf_config, base_cfg)


def moe_layers(hf_config: Any) -> list[int]:
  """Indices of the decoder layers of ``hf_config`` whose FFN is a MoE block."""
  return family_of(hf_config).moe_layers(hf_config)


def hf_fields_from_moe(cfg: MoEConfig, model_type: str, d_model: int) -> dict:
  """HF config fields of a block of ``cfg`` in family ``model_type``.

  Raises InteropError naming every architecture field the family cannot
  express (the fields whose re-import would differ).
  """
  check_moe_config(cfg, "cfg")
  fields, diffs = _round_trip(cfg, model_type, d_model)
  if diffs:
    lines = "; ".join(f"{k}={a!r} (as {model_type} it would be {b!r})"
                      for k, (a, b) in diffs.items())
    raise InteropError(f"{model_type} cannot express {lines}. Fix: export a layer whose "
                       f"config {model_type} can hold, or pick another model_type")
  return fields


def _round_trip(cfg: MoEConfig, model_type: str, d_model: int) -> tuple[dict, dict]:
  """(the family's HF fields of ``cfg``, {field: (cfg's value, the re-imported value)})."""
  family = get_family(model_type)
  fields = family.hf_fields(cfg, d_model)
  try:
    return fields, _diff(cfg, family.moe_config(fields, cfg))
  except ValueError:
    # cfg's balancing does not fit the family's router (a bias controller, and the family
    # routes without a bias): compare the architecture alone, balancing is no part of it.
    neutral = dataclasses.replace(cfg, balance=BalanceConfig())
  try:
    again = family.moe_config(fields, neutral)
  except (InteropError, ValueError) as e:
    raise InteropError(f"{model_type} cannot express this MoEConfig: {e}") from e
  return fields, _diff(neutral, again)


def block_gaps(cfg: MoEConfig, model_type: str, d_model: int) -> list[str]:
  """What a block of ``cfg`` has that ``model_type``'s lacks, one phrase per field
  (``moe.routing.score_fn='sigmoid' (mixtral: 'softmax')``); ``[]`` when the family
  expresses it. The same round trip as the export's check; a config whose fields the
  family cannot even write (deepseek_v3 shared experts of a width that is no multiple
  of the routed width) is one phrase saying why.
  """
  check_moe_config(cfg, "cfg")
  try:
    _, diffs = _round_trip(cfg, model_type, d_model)
  except InteropError as e:
    return [str(e).split(". Fix:")[0]]
  return [f"{k}={a!r} ({model_type}: {b!r})" for k, (a, b) in diffs.items()]


def expressing_families(cfg: MoEConfig, d_model: int) -> list[str]:
  """The registered families whose MoE block computes what a layer of ``cfg`` computes."""
  return [name for name in FAMILIES if not block_gaps(cfg, name, d_model)]


def _diff(a: Any, b: Any, path: str = "moe") -> dict:
  if dataclasses.is_dataclass(a):
    out = {}
    for f in dataclasses.fields(a):
      out.update(_diff(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}"))
    return out
  return {} if a == b else {path: (a, b)}


__all__ = ["FAMILIES", "Family", "block_gaps", "expressing_families", "family_of",
           "get_family", "hf_get", "hf_fields_from_moe", "moe_config_from_hf", "moe_layers",
           "register_family"]
