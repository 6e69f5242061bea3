"""The parameter audit: the parameters a run initialises against the analytic accounting.

Every budget number of a run (total and active parameters, FLOPs per token;
:mod:`moejax.ablation.budget`) comes from :func:`moejax.topology.accounting.budget`,
which counts each component from the config under its own assumptions (a
router is d x E_r, a shared expert one FFN, ...). Nothing else checks those
assumptions, so a component whose init holds parameters the accounting does
not know would pass a 0%-tolerance budget check between arms that differ.

:func:`audit` closes that gap. It initialises the model abstractly (the
trainer's own build, :func:`moejax.train.step.abstract_state`, under
``jax.eval_shape``: shapes only, no memory, no compute), sorts every
``nnx.Param`` leaf into an accounting component by its path (:data:`TABLE`),
and compares each component's initialised count with the accounting's
``Component.total``. Any difference raises :class:`AuditError`, one line::

  budget audit: arm 'cosine': component 'router' has 4160 parameters initialised
  but the accounting counts 4096 (+64). Fix: ...

What the init holds beyond ``accounting.budget`` by design, added to the
expected counts here (both computed from the config, not from the init):

- ``routed_experts``: heterogeneous expert widths (``moe.topology.expert_widths``)
  are stored as one stack of E x max width, zero-padded and masked past each
  expert's width; the accounting counts the real widths, the audit expects
  the padding on top (one stack per expert-sharing group);
- ``lora_adapters``: LoRA adapters of a fine-tuning run, counted by
  :func:`moejax.finetune.adapters.lora_param_count` (``ArmBudget.total``
  adds that count to the accounting's total).

Accounting-only parts of a preset's published architecture (an attention
kind counted in place of the model's, an encoder stack: ``ArchitectureConfig``)
are not built by the model and not audited;
the budget of a run is the accounting of what it builds, as audited here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax

from moejax.config import ModelConfig
from moejax.nn.adapters import lora_param_count
from moejax.topology import accounting
from moejax.train.config import ExperimentConfig

LORA = "lora_adapters"
UNMAPPED = "unmapped"
COMPONENTS = accounting.COMPONENTS + (LORA,)

# The component of a parameter, by its path in the params tree
# (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``), first rule that matches:
#
#   path                                        component
#   .../lora*/..., .../adapters/...             lora_adapters
#   embed/...                                   embedding
#   lm_head/...                                 lm_head
#   final_norm/...                              norms
#   mtp/...                                     mtp (multi-token prediction modules)
#   blocks/i/[block/]ffn/params/<sub>/...       MOE_SUBTREES[sub] (router: the layer kind's
#                                               router_component; Soft MoE: soft_moe)
#   blocks/i/[block/]attn/<x>_norm/...          norms (inside the attention: MLA's latents)
#   blocks/i/[block/]<module>/...               BLOCK_MODULES[module]
#   anything else                               unmapped (the accounting counts 0)
#
# ``block/`` is the inner block of a mixture-of-depths wrapper, whose own
# ``router`` is the MoD router.
TOP_MODULES = {"embed": "embedding", "lm_head": "lm_head", "final_norm": "norms", "mtp": "mtp"}
MOE_SUBTREES = {"router": "router", "experts": "routed_experts", "shared": "shared_experts",
                "zero_compute": "zero_compute", "peer": "peer"}
BLOCK_MODULES = {"attn": "attention", "attn_norm": "norms", "ffn_norm": "norms",
                 "ffn": "dense_ffn", "router": "mod_router"}

# What to change when a component's init and accounting disagree.
_FIX = {
    "router": "make the router's parameter shapes (its spec's param_shapes, which the "
              "accounting counts) match what its init creates",
    "soft_moe": "make accounting.moe_components count what routing/soft.init_soft_params creates",
    "routed_experts": "make accounting.moe_components count what topology/experts.init_experts "
                      "creates",
    "shared_experts": "make accounting.moe_components count what topology/experts.init_shared "
                      "creates",
    "zero_compute": "make accounting.moe_components count what "
                    "topology/zero_compute.init_zero_compute creates",
    "peer": "make accounting.moe_components count what topology/peer.init_peer creates",
    LORA: "make finetune/adapters.lora_param_count count what finetune/adapters.attach creates",
    UNMAPPED: "give the parameter a component in moejax/train/audit.py's TABLE and count it in "
              "moejax/topology/accounting.py",
}
_FIX_DEFAULT = ("make moejax/topology/accounting.py count what the model initialises for this "
                "component (or the init match the accounting)")


class AuditError(ValueError):
  """The initialised parameters of a component differ from the accounting's count."""


@dataclasses.dataclass(frozen=True)
class ComponentAudit:
  """One component: parameters initialised vs counted (accounting + documented extras)."""

  name: str
  initialised: int
  expected: int
  paths: tuple = ()   # a few example paths of the component's leaves

  @property
  def ok(self) -> bool:
    return self.initialised == self.expected


def _key(k) -> str:
  return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def component_of(keys: Sequence[Any], layer: Any = None) -> str:
  """The accounting component of the parameter at path ``keys`` (see the table above).

  ``layer``: the MoE layer kind (``cfg.moe.layer``); its ``router_component``
  names what its ``router`` subtree is counted as (Soft MoE: ``soft_moe``).
  """
  keys = [str(k) for k in keys]
  if any(k.startswith("lora") or k == "adapters" for k in keys):
    return LORA
  if not keys:
    return UNMAPPED
  if keys[0] in TOP_MODULES:
    return TOP_MODULES[keys[0]]
  if keys[0] != "blocks" or len(keys) < 3:
    return UNMAPPED
  rest = keys[2:]
  if rest[0] == "block" and len(rest) > 1:  # inside a mixture-of-depths wrapper
    rest = rest[1:]
  elif rest[0] == "router":
    return "mod_router"
  if rest[0] == "ffn" and len(rest) > 2 and rest[1] == "params":
    if rest[2] == "router" and layer is not None:
      return layer.router_component
    return MOE_SUBTREES.get(rest[2], UNMAPPED)
  if rest[0] == "router":  # a router module inside the inner block: not one we know
    return UNMAPPED
  if rest[0] == "attn" and len(rest) > 1 and rest[1].endswith("_norm"):
    return "norms"  # norms inside an attention kind (MLA's latent norms)
  return BLOCK_MODULES.get(rest[0], UNMAPPED)


def initialised_counts(params: Any, model: ModelConfig) -> tuple[dict, dict]:
  """({component: parameters}, {component: example paths}) of a params tree.

  ``params``: the model's ``nnx.Param`` state as a pure dict (arrays or
  ShapeDtypeStructs; shared weights appear once).
  """
  kind = model.moe.layer if model.moe is not None else None
  counts: dict = {}
  paths: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    keys = [_key(k) for k in path]
    comp = component_of(keys, kind)
    counts[comp] = counts.get(comp, 0) + int(leaf.size)
    if len(paths.setdefault(comp, [])) < 2:
      paths[comp].append("/".join(keys))
  return counts, paths


def _padding(model: ModelConfig) -> int:
  """Zero padding of heterogeneous expert stacks: E x max width minus the real widths."""
  moe = model.moe
  if moe is None or not moe.layer.expert_bank or moe.topology.expert_widths is None:
    return 0
  d, act, widths = model.d_model, moe.topology.activation, list(moe.widths)
  per_stack = sum(accounting.ffn_params(d, max(widths) - w, act) for w in widths)
  n_moe = sum(1 for i in range(model.n_layers) if model.is_moe_layer(i))
  stacks = -(-n_moe // model.expert_sharing_group)
  return stacks * per_stack


def expected_counts(model: ModelConfig, lora: Sequence[str] = (), lora_rank: int = 0) -> dict:
  """{component: parameters the init should hold}: accounting totals + documented extras."""
  b = accounting.budget(model, seq_len=1)  # totals do not depend on S
  out = {name: int(c.total) for name, c in b.components if c.total}
  pad = _padding(model)
  if pad:
    out["routed_experts"] = out.get("routed_experts", 0) + pad
  if lora:
    out[LORA] = int(lora_param_count(model, lora, lora_rank))
  return out


def abstract_params(exp: ExperimentConfig) -> Any:
  """The params tree (ShapeDtypeStructs) the trainer initialises for ``exp``; no compute."""
  import optax  # pylint: disable=g-import-not-at-top
  from moejax.train import step as step_lib  # pylint: disable=g-import-not-at-top
  return step_lib.abstract_state(exp, optax.identity())[1].params


def compare(model: ModelConfig, params: Any, lora: Sequence[str] = (),
            lora_rank: int = 0) -> list[ComponentAudit]:
  """Every component of the init or the accounting, in :data:`COMPONENTS` order."""
  got, paths = initialised_counts(params, model)
  want = expected_counts(model, lora, lora_rank)
  names = [c for c in COMPONENTS + (UNMAPPED,) if c in got or c in want]
  return [ComponentAudit(n, got.get(n, 0), want.get(n, 0), tuple(paths.get(n, ())))
          for n in names]


def _message(label: str, bad: Sequence[ComponentAudit]) -> str:
  parts = []
  for c in bad:
    diff = c.initialised - c.expected
    where = f" (e.g. {', '.join(c.paths)})" if c.paths and c.name == UNMAPPED else ""
    parts.append(f"component '{c.name}'{where} has {c.initialised} parameters initialised but "
                 f"the accounting counts {c.expected} ({diff:+d}). Fix: "
                 f"{_FIX.get(c.name, _FIX_DEFAULT)}")
  return (f"budget audit: {label}: " + "; ".join(parts) +
          " (every budget number comes from the accounting, so arms it miscounts "
          "cannot be compared)")


def audit(exp: ExperimentConfig, params: Any = None,
          label: str = "this run") -> list[ComponentAudit]:
  """Raises AuditError unless every component of ``exp``'s init matches the accounting.

  Args:
    exp: the experiment (its model and, for a fine-tuning run, its LoRA adapters).
    params: its params tree when already built (real or abstract); None: built
      abstractly with :func:`abstract_params`.
    label: who is audited, for the message (``"arm 'cosine'"``, ``"this run"``).

  Returns:
    The per-component comparison (all equal).
  """
  if params is None:
    params = abstract_params(exp)
  ft = exp.finetune
  lora = tuple(ft.lora) if ft.lora else ()
  return _checked(compare(exp.model, params, lora, ft.lora_rank), label)


def audit_model(model: ModelConfig, params: Any = None,
                label: str = "model") -> list[ComponentAudit]:
  """:func:`audit` of a bare ModelConfig (a preset): its Transformer, no adapters."""
  if params is None:
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from moejax.model import Transformer  # pylint: disable=g-import-not-at-top

    def build():
      m = Transformer(model, rngs=nnx.Rngs(0))
      return nnx.to_pure_dict(nnx.state(m, nnx.Param))
    params = jax.eval_shape(build)
  return _checked(compare(model, params), label)


def _checked(rows: list[ComponentAudit], label: str) -> list[ComponentAudit]:
  bad = [r for r in rows if not r.ok]
  if bad:
    raise AuditError(_message(label, bad))
  return rows


def table(rows: Sequence[ComponentAudit]) -> str:
  """Aligned text: component, initialised, expected."""
  lines = [f"{'component':<16} {'initialised':>14} {'accounting':>14}"]
  lines += [f"{r.name:<16} {r.initialised:>14,} {r.expected:>14,}" for r in rows]
  return "\n".join(lines)
