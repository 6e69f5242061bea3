"""Config validation: every bad value fails at construction, naming field, value and fix."""

import math

import pytest

from moejax import config as C
from tests.configs import moe_config as moe


@pytest.mark.parametrize("kw, field, needle", [
    (dict(num_experts=8, routing=dict(top_k=9)), "moe.routing.top_k",
     "exceeds moe.topology.num_experts=8"),
    (dict(num_experts=8, routing=dict(n_groups=3)), "moe.routing.n_groups", "does not divide"),
    (dict(num_experts=8, routing=dict(n_groups=2, topk_groups=3)), "moe.routing.topk_groups",
     "exceeds"),
    (dict(capacity_factor=0.0), "moe.balance.capacity_factor", "must be > 0"),
    (dict(capacity_factor=-1.25), "moe.balance.capacity_factor", "must be > 0"),
    (dict(num_shared_experts=1, routing=dict(kind="expert_choice")),
     "moe.topology.num_shared_experts", "not token choice"),
    (dict(routing=dict(kind="expert_chioce")), "moe.routing.kind", "did you mean 'expert_choice'"),
    (dict(routing=dict(score_fn="tanh")), "moe.routing.score_fn", "unknown value"),
    (dict(routing=dict(gating="topk_softmax", score_fn="sigmoid")), "moe.routing.gating",
     "score_fn='softmax'"),
    (dict(balance=dict(bias_update="sign")), "moe.balance.bias_update", "use_bias=True"),
    (dict(num_experts=8, expert_widths=[4, 4]), "moe.topology.expert_widths",
     "one width per routed expert"),
    (dict(zero_experts=2, routing=dict(kind="hash")), "moe.routing.kind", "zero-computation"),
    (dict(routing=dict(kind="hierarchical", n_families=3), num_experts=8),
     "moe.routing.options.n_families", "does not divide"),
    (dict(routing=dict(top_p=1.5, kind="top_p")), "moe.routing.options.top_p", "(0, 1]"),
    (dict(capacity_factor=1.25, routing=dict(kind="expert_choice")),
     "moe.balance.capacity_factor", "sets its own per-expert capacity"),
    (dict(num_experts=8, routing=dict(n_groups=4, topk_groups=1, top_k=3)), "moe.routing.top_k",
     "topk_groups"),
    (dict(balance=dict(device_loss_coef=0.05)), "moe.balance.device_loss_coef",
     "loss_num_devices=1"),
])
def test_bad_moe_configs_name_field_value_and_fix(kw, field, needle):
  with pytest.raises(C.ConfigError) as info:
    moe(**kw)
  msg = str(info.value)
  assert msg.startswith(field + "="), msg
  assert needle in msg
  assert "Fix:" in msg


def test_error_message_format_is_exact():
  with pytest.raises(C.ConfigError) as info:
    moe(num_experts=8, routing=dict(top_k=9))
  assert str(info.value) == ("moe.routing.top_k=9: exceeds moe.topology.num_experts=8. "
                             "Fix: set moe.routing.top_k <= 8")
  assert info.value.field == "moe.routing.top_k" and info.value.value == 9


@pytest.mark.parametrize("kw, field", [
    (dict(capacity_factor=math.nan), "moe.balance.capacity_factor"),
    (dict(capacity_factor=math.inf), "moe.balance.capacity_factor"),
    (dict(balance=dict(aux_loss_coef=math.nan)), "moe.balance.aux_loss_coef"),
    (dict(routing=dict(use_bias=True), balance=dict(bias_update="sign", bias_rate=math.inf)),
     "moe.balance.bias_rate"),
    (dict(routing=dict(routed_scaling_factor=math.inf)), "moe.routing.routed_scaling_factor"),
    (dict(routing=dict(logit_noise=math.nan)), "moe.routing.logit_noise"),
    (dict(routing=dict(kind="top_p", top_p=math.nan)), "moe.routing.options.top_p"),
    (dict(routing=dict(input_jitter=math.nan)), "moe.routing.input_jitter"),
])
def test_nan_and_inf_are_refused(kw, field):
  """NaN fails every comparison (so `value < 0` checks let it through) and inf passes `> 0`."""
  with pytest.raises(C.ConfigError, match=f"^{field}=(nan|inf): must be finite"):
    moe(**kw)


def test_zero_compute_experts_count_toward_top_k_limit():
  cfg = moe(num_experts=4, zero_experts=1, copy_experts=1, routing=dict(top_k=6))
  assert cfg.num_routed == 6 and cfg.num_zero_compute == 2
  with pytest.raises(C.ConfigError, match="zero-computation"):
    moe(num_experts=4, zero_experts=1, routing=dict(top_k=6))


def test_unknown_keys_are_errors_with_suggestion():
  with pytest.raises(C.ConfigError, match="did you mean 'top_k'"):
    C.from_dict(C.MoEConfig, {"routing": {"topk": 2}})
  with pytest.raises(C.ConfigError, match="unknown key for ModelConfig"):
    C.from_dict(C.ModelConfig, {"d_modle": 3})


@pytest.mark.parametrize("tree, new", [
    ({"moe": {"num_experts": 4}}, "model.moe.topology.num_experts"),
    ({"moe": {"router": {"top_k": 1}}}, "model.moe.routing"),
    ({"moe": {"capacity_factor": 1.25}}, "model.moe.balance.capacity_factor"),
    ({"moe": {"backend": "blocked"}}, "model.moe.execution.backend"),
    ({"kv_lora_rank": 64}, "moved to model.attention_options.kv_lora_rank"),
])
def test_old_field_paths_name_the_new_place(tree, new):
  with pytest.raises(C.ConfigError) as info:
    C.from_dict(C.ModelConfig, tree, "model")
  assert new in str(info.value) and str(info.value).count("\n") == 0


def test_moved_hint_for_command_line_overrides():
  assert C.moved_hint("model.moe.num_experts") == "moved to model.moe.topology.num_experts"
  assert C.moved_hint("parallel.gmm_backend") == "moved to model.moe.execution.backend"
  assert C.moved_hint("model.moe.topology.num_experts") is None


@pytest.mark.parametrize("kind, kw, field", [
    ("soft", dict(routing=dict(use_bias=True)), "moe.routing.use_bias"),
    ("soft", dict(balance=dict(aux_loss_coef=1e-2)), "moe.balance.aux_loss_coef"),
    ("soft", dict(balance=dict(z_loss_coef=1e-3)), "moe.balance.z_loss_coef"),
    ("soft", dict(num_shared_experts=1), "moe.topology.num_shared_experts"),
    ("soft", dict(backend="blocked"), "moe.execution.backend"),
    ("peer", dict(routing=dict(score_fn="sigmoid")), "moe.routing.score_fn"),
    ("peer", dict(balance=dict(bias_update="sign")), "moe.balance.bias_update"),
    ("peer", dict(num_experts=4), "moe.topology.num_experts"),
])
def test_fields_a_layer_kind_cannot_honour_are_refused(kind, kw, field):
  with pytest.raises(C.ConfigError) as info:
    moe(kind, **kw)
  assert str(info.value).startswith(field + "=") and "has no effect" in str(info.value)


def test_overrides_apply_and_validate():
  base = moe(num_experts=8)
  cfg = C.apply_overrides(base, ["routing.top_k=4", "routing.score_fn=sigmoid",
                                 "balance.capacity_factor=1.25"])
  assert cfg.routing.top_k == 4 and cfg.routing.score_fn == "sigmoid"
  assert cfg.balance.capacity_factor == 1.25
  assert base.routing.top_k == 2  # frozen: the original is untouched
  with pytest.raises(C.ConfigError, match="unknown override key"):
    C.apply_overrides(base, {"routing.top_kk": 4})
  with pytest.raises(C.ConfigError, match="exceeds"):
    C.apply_overrides(base, {"routing.top_k": 9})
  with pytest.raises(C.ConfigError, match="moved to topology.num_experts"):
    C.apply_overrides(base, {"num_experts": 4})


def test_model_config_round_trip_and_layout():
  m = C.from_dict(C.ModelConfig, {"n_layers": 6, "moe_layout": "first_dense",
                                  "first_dense_layers": 2,
                                  "moe": {"topology": {"num_experts": 4},
                                          "routing": {"top_k": 1}}})
  assert [m.is_moe_layer(i) for i in range(6)] == [False, False, True, True, True, True]
  assert C.from_dict(C.ModelConfig, C.to_dict(m)) == m
  every = C.apply_overrides(m, {"moe_layout": "every_other"})
  assert [every.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
  dense = C.from_dict(C.ModelConfig, {"moe": None})
  assert not dense.is_moe_layer(0)
  with pytest.raises(C.ConfigError, match="model.n_heads"):
    C.from_dict(C.ModelConfig, {"d_model": 10, "n_heads": 4})
  with pytest.raises(C.ConfigError, match="model.moe_layout='every_other': has no effect"):
    C.from_dict(C.ModelConfig, {"moe": None, "moe_layout": "every_other"})


def test_configs_are_frozen():
  cfg = moe()
  with pytest.raises(Exception):
    cfg.kind = "soft"  # type: ignore[misc]


def test_registries_are_the_one_list_the_code_implements():
  from moejax.execution import gmm
  from moejax.routing import router
  assert C.EXPERT_BACKENDS == ("auto", "reference", *gmm.BACKENDS)
  assert router.ROUTERS is C.ROUTERS
  assert set(C.ROUTERS.names()) >= {"topk", "expert_choice", "hash", "top_p", "hierarchical"}
  with pytest.raises(C.ConfigError, match="did you mean 'blocked'"):
    moe(backend="blockd")
