"""The parameter audit: every shipped config's init matches the accounting, component by
component, and a parameter the accounting does not know is refused before any training."""

from __future__ import annotations

import copy
import dataclasses
import io
import os

import jax.numpy as jnp
import pytest

from moejax import layer as layer_lib
from moejax.ablation import budget as budget_lib
from moejax.ablation import runner, suite as suite_lib
from moejax.config import files as config_files
from moejax.topology import accounting
from moejax.train import audit
from moejax.train.config import experiment_from_dict
from tests.ablation import helpers

CONFIGS = sorted(f for f in os.listdir(os.path.join(helpers.ROOT, "configs")) if f.endswith(".py"))
PRESETS = config_files.list_presets()


def _never_train(*args, **kwargs):
  raise AssertionError("training must not start")


def _experiment(model: dict | None = None, **sections):
  """configs/tiny.py with ``model`` (and other sections) merged in; ``model['moe!']``
  replaces the MoE section instead (another layer kind keeps none of tiny's routing)."""
  model = dict(model or {})
  moe = model.pop("moe!", None)
  tree = suite_lib.merge(helpers.tiny_base(), dict(sections, model=model))
  if moe is not None:
    tree["model"]["moe"] = moe
  return experiment_from_dict(tree)


# --- (a) everything shipped passes. ------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_passes_the_audit(name):
  tree = config_files.load_config_file(os.path.join(helpers.ROOT, "configs", name))
  tree = tree.to_dict() if hasattr(tree, "to_dict") else tree
  ft = tree.get("finetune") or {}
  if ft.get("source_format") and not ft.get("source"):
    # A fine-tuning overlay (configs/upcycle.py) gets its source from experiments.finetune's
    # --source; a placeholder path lets its model be built (nothing is read from it).
    tree["finetune"] = dict(ft, source="/placeholder/source")
  exp = experiment_from_dict(tree)
  rows = audit.audit(exp, label=name)
  assert all(r.ok for r in rows)
  # The audit covers the whole init: its components sum to the accounting's total.
  assert sum(r.initialised for r in rows) == accounting.budget(exp.model).total
  assert "routed_experts" in audit.table(rows) or exp.model.moe is None


@pytest.mark.parametrize("name", helpers.SUITES)
def test_every_arm_of_every_shipped_suite_passes_the_audit(name):
  suite = suite_lib.load_suite(os.path.join(helpers.ROOT, "configs", "ablations", f"{name}.py"))
  for arm in suite.arms:
    rows = audit.audit(arm.experiment, label=f"arm {arm.name!r}")
    assert rows and all(r.ok for r in rows)
    assert audit.UNMAPPED not in {r.name for r in rows}


def _shallow(model):
  """The preset with the fewest layers that still has each of its layer kinds."""
  n = min(model.n_layers, max(2, model.first_dense_layers + 2))
  return dataclasses.replace(model, n_layers=n)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_layer_kind_passes_the_audit(name):
  model, _, _ = config_files.load_preset(name)
  audit.audit_model(_shallow(model), label=f"preset {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_at_full_depth_passes_the_audit(name):
  # Abstract (no memory), but tracing 12-94 huge layers takes 1-60 s per preset.
  model, _, _ = config_files.load_preset(name)
  rows = audit.audit_model(model, label=f"preset {name}")
  assert sum(r.initialised for r in rows) == accounting.budget(model).total


# Every layer kind the model builds, each as configs/tiny.py with one change.
HETERO = dict(topology=dict(num_experts=3, expert_widths=(16, 32, 24)))
NO_BALANCE = dict(bias_update="none", aux_loss_coef=0.0, z_loss_coef=0.0)
LAYER_KINDS = {
    "soft": {"moe!": dict(kind="soft", topology=dict(num_experts=4, expert_width=16,
                                                     slots_per_expert=2))},
    "peer": {"moe!": dict(kind="peer", topology=dict(peer_num_keys=4, peer_heads=2, peer_top_k=2,
                                                     peer_key_dim=8))},
    "shared_gated": dict(moe=dict(topology=dict(num_shared_experts=2, shared_expert_width=8,
                                                shared_expert_gate=True))),
    "zero_copy_constant": dict(moe=dict(topology=dict(zero_experts=1, copy_experts=1,
                                                      constant_experts=2))),
    "heterogeneous_widths": dict(moe=HETERO),
    "heterogeneous_shared_group": dict(moe=HETERO, n_layers=4, expert_sharing_group=2),
    "hierarchical": dict(moe=dict(routing=dict(kind="hierarchical", options=dict(n_families=2),
                                               use_bias=False), balance=NO_BALANCE)),
    "hash": dict(moe=dict(routing=dict(kind="hash", use_bias=False),
                          balance=NO_BALANCE)),
    "expert_choice": dict(moe=dict(routing=dict(kind="expert_choice", use_bias=False),
                                   balance=NO_BALANCE)),
    "top_p": dict(moe=dict(routing=dict(kind="top_p", score_fn="softmax", use_bias=False),
                           balance=NO_BALANCE)),
    "gelu_experts": dict(moe=dict(topology=dict(activation="gelu"))),
    "expert_sharing": dict(n_layers=4, expert_sharing_group=2),
    "mod_moe": dict(n_layers=4, mod_every=2),
    "mod_dense": dict(moe=None, n_layers=4, mod_every=1),
    "first_dense_every_other": dict(n_layers=5, moe_layout="first_dense", first_dense_layers=1),
    "every_other_tied_bias": dict(moe_layout="every_other", tie_embeddings=True,
                                  attention_bias=True, n_kv_heads=1),
    "scmoe": dict(n_layers=4, moe_layout="every_other", moe_schedule="scmoe"),
    "dense_twin_active": dict(dense_twin="active"),
    "dense_twin_total": dict(dense_twin="total"),
    "mla": dict(attention="mla", n_kv_heads=None, attention_options=dict(kv_lora_rank=16, qk_nope_head_dim=8,
                                                        qk_rope_head_dim=4, v_head_dim=8)),
    "mla_q_lora_mod": dict(n_layers=4, mod_every=2, attention="mla", n_kv_heads=None,
                           attention_options=dict(q_lora_rank=12, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=4,
                                                  v_head_dim=8)),
    "mtp_mla": dict(mtp_depth=2, attention="mla", n_kv_heads=None,
                    attention_options=dict(kv_lora_rank=16, qk_nope_head_dim=8,
                                           qk_rope_head_dim=4, v_head_dim=8)),
}


@pytest.mark.parametrize("kind", sorted(LAYER_KINDS))
def test_every_layer_kind_passes_the_audit(kind):
  exp = _experiment(copy.deepcopy(LAYER_KINDS[kind]))
  rows = {r.name: r for r in audit.audit(exp, label=kind)}
  assert audit.UNMAPPED not in rows
  if kind.startswith("heterogeneous"):
    # The stack is E x max width: the padding the accounting leaves out is expected on top.
    b = accounting.budget(exp.model).breakdown["routed_experts"].total
    stacks = -(-sum(exp.model.is_moe_layer(i) for i in range(exp.model.n_layers))
               // exp.model.expert_sharing_group)
    pad = stacks * 3 * exp.model.d_model * (3 * 32 - (16 + 32 + 24))
    assert rows["routed_experts"].initialised == b + pad


@pytest.mark.parametrize("lora", [("attention",), ("experts",), ("dense",),
                                  ("attention", "dense", "experts")])
def test_lora_adapters_pass_the_audit(lora):
  model = dict(n_layers=3, moe_layout="first_dense", first_dense_layers=1,
               moe=dict(topology=dict(num_shared_experts=1, shared_expert_width=8)))
  exp = _experiment(model, finetune=dict(source="/nonexistent/source", freeze=("all",),
                                         lora=lora, lora_rank=4))
  rows = {r.name: r for r in audit.audit(exp)}
  assert rows[audit.LORA].initialised > 0 and rows[audit.LORA].ok


# --- The component table. ----------------------------------------------------

def test_component_table():
  of = audit.component_of
  assert of(["embed", "embedding"]) == "embedding"
  assert of(["lm_head", "kernel"]) == "lm_head"
  assert of(["final_norm", "scale"]) == "norms"
  assert of(["blocks", "0", "attn_norm", "scale"]) == "norms"
  assert of(["blocks", "0", "attn", "q_proj", "kernel"]) == "attention"
  assert of(["blocks", "0", "attn", "q_proj", "lora", "lora_a"]) == audit.LORA
  assert of(["blocks", "0", "ffn", "adapters", "experts", "w_up", "a"]) == audit.LORA
  assert of(["blocks", "0", "ffn", "w_up", "kernel"]) == "dense_ffn"
  assert of(["blocks", "0", "ffn", "params", "router", "w"]) == "router"
  from moejax.config.registry import LAYERS
  assert of(["blocks", "0", "ffn", "params", "router", "phi"], LAYERS.get("soft")) == "soft_moe"
  assert of(["blocks", "0", "ffn", "params", "experts", "w_up"]) == "routed_experts"
  assert of(["blocks", "0", "ffn", "params", "shared", "w_up"]) == "shared_experts"
  assert of(["blocks", "0", "ffn", "params", "zero_compute", "v"]) == "zero_compute"
  assert of(["blocks", "0", "ffn", "params", "peer", "q_norm", "scale"]) == "peer"
  assert of(["blocks", "1", "router", "kernel"]) == "mod_router"
  assert of(["blocks", "1", "block", "ffn", "params", "router", "w"]) == "router"
  assert of(["blocks", "1", "block", "attn_norm", "scale"]) == "norms"
  assert of(["blocks", "0", "ffn", "params", "mystery", "w"]) == audit.UNMAPPED
  assert of(["sinks"]) == audit.UNMAPPED


# --- (b) what the accounting does not know is refused. -----------------------

def _extra_router_param(monkeypatch, extra: int):
  """Every MoE layer's router init gains a parameter of ``extra`` scalars."""
  init = layer_lib.init_moe_params

  def patched(key, d_model, cfg, *args, **kwargs):
    params = init(key, d_model, cfg, *args, **kwargs)
    params["router"] = dict(params["router"], b=jnp.zeros((extra,), jnp.float32))
    return params
  monkeypatch.setattr(layer_lib, "init_moe_params", patched)


def test_an_unknown_router_parameter_is_refused_in_one_line(monkeypatch):
  exp = _experiment()
  _extra_router_param(monkeypatch, 4)
  with pytest.raises(audit.AuditError) as e:
    audit.audit(exp, label="arm 'biased'")
  msg = str(e.value)
  assert "\n" not in msg
  router = accounting.budget(exp.model).breakdown["router"].total  # 2 layers x 32 x 4
  assert msg.startswith(f"budget audit: arm 'biased': component 'router' has {router + 8} "
                        f"parameters initialised but the accounting counts {router} (+8). Fix: ")


def test_an_unmapped_parameter_is_refused_with_its_path(monkeypatch):
  init = layer_lib.init_moe_params
  monkeypatch.setattr(layer_lib, "init_moe_params", lambda *a, **k: dict(
      init(*a, **k), mystery={"w": jnp.zeros((3,), jnp.float32)}))
  with pytest.raises(audit.AuditError, match=r"component 'unmapped' \(e\.g\. "
                     r"blocks/0/ffn/params/mystery/w.*has 6 parameters initialised but the "
                     r"accounting counts 0 \(\+6\)"):
    audit.audit(_experiment())


def test_the_budget_check_refuses_an_arm_the_accounting_miscounts(monkeypatch, tmp_path):
  # Only arm 'bias' gets the unknown parameter: the analytic budgets are equal, so the
  # 0%-tolerance check alone would pass; the audit refuses before anything is written.
  init = layer_lib.init_moe_params

  def patched(key, d_model, cfg, *args, **kwargs):
    params = init(key, d_model, cfg, *args, **kwargs)
    if cfg.routing.use_bias:
      params["router"] = dict(params["router"], b=jnp.zeros((cfg.num_routed,), jnp.float32))
    return params
  monkeypatch.setattr(layer_lib, "init_moe_params", patched)
  suite = suite_lib.suite_from_dict(helpers.tiny_suite())
  workdir = str(tmp_path / "suite")
  with pytest.raises(budget_lib.BudgetError) as e:
    runner.run_suite(suite, workdir, out=io.StringIO(), train_fn=_never_train)
  assert isinstance(e.value, budget_lib.BudgetAuditError)
  assert "\n" not in str(e.value)
  assert str(e.value).startswith("budget audit: arm 'bias': component 'router' has 264 "
                                 "parameters initialised but the accounting counts 256 (+8)")
  assert not os.path.exists(workdir)


def test_training_refuses_a_model_the_accounting_miscounts(monkeypatch, tmp_path):
  from moejax.train import loop  # pylint: disable=g-import-not-at-top
  _extra_router_param(monkeypatch, 2)
  workdir = str(tmp_path / "run")
  with pytest.raises(audit.AuditError, match="budget audit: this run: component 'router'"):
    loop.train(_experiment(), workdir, out=io.StringIO())
  assert not os.path.exists(workdir)
