"""Config validation: every bad value fails at construction, naming field, value and fix."""

import pytest

from moejax import config as C


def moe(**kw):
  router = kw.pop("router", {})
  balance = kw.pop("balance", {})
  return C.from_dict(C.MoEConfig, {**kw, "router": router, "balance": balance})


@pytest.mark.parametrize("kw, field, needle", [
    (dict(num_experts=8, router=dict(top_k=9)), "moe.router.top_k", "exceeds moe.num_experts=8"),
    (dict(num_experts=8, router=dict(n_groups=3)), "moe.router.n_groups", "does not divide"),
    (dict(num_experts=8, router=dict(n_groups=2, topk_groups=3)), "moe.router.topk_groups", "exceeds"),
    (dict(capacity_factor=0.0), "moe.capacity_factor", "must be > 0"),
    (dict(capacity_factor=-1.25), "moe.capacity_factor", "must be > 0"),
    (dict(num_shared_experts=1, router=dict(kind="expert_choice")), "moe.num_shared_experts", "expert-choice"),
    (dict(router=dict(kind="expert_chioce")), "moe.router.kind", "did you mean 'expert_choice'"),
    (dict(router=dict(score_fn="tanh")), "moe.router.score_fn", "unknown value"),
    (dict(router=dict(gating="topk_softmax", score_fn="sigmoid")), "moe.router.gating", "score_fn='softmax'"),
    (dict(balance=dict(bias_update="sign")), "moe.balance.bias_update", "use_bias=True"),
    (dict(num_experts=8, expert_widths=[4, 4]), "moe.expert_widths", "one width per routed expert"),
    (dict(zero_experts=2, router=dict(kind="hash")), "moe.router.kind", "zero-computation"),
    (dict(router=dict(kind="hierarchical", n_families=3), num_experts=8), "moe.router.n_families", "does not divide"),
    (dict(router=dict(top_p=1.5, kind="top_p")), "moe.router.top_p", "(0, 1]"),
    (dict(capacity_factor=1.25, router=dict(kind="expert_choice")), "moe.capacity_factor", "expert choice"),
    (dict(num_experts=8, router=dict(n_groups=4, topk_groups=1, top_k=3)), "moe.router.top_k", "topk_groups"),
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
    moe(num_experts=8, router=dict(top_k=9))
  assert str(info.value) == "moe.router.top_k=9: exceeds moe.num_experts=8. Fix: set moe.router.top_k <= 8"
  assert info.value.field == "moe.router.top_k" and info.value.value == 9


def test_zero_compute_experts_count_toward_top_k_limit():
  cfg = moe(num_experts=4, zero_experts=1, copy_experts=1, router=dict(top_k=6))
  assert cfg.num_routed == 6 and cfg.num_zero_compute == 2
  with pytest.raises(C.ConfigError, match="zero-computation"):
    moe(num_experts=4, zero_experts=1, router=dict(top_k=6))


def test_unknown_keys_are_errors_with_suggestion():
  with pytest.raises(C.ConfigError, match="did you mean 'top_k'"):
    C.from_dict(C.MoEConfig, {"router": {"topk": 2}})
  with pytest.raises(C.ConfigError, match="unknown key for ModelConfig"):
    C.from_dict(C.ModelConfig, {"d_modle": 3})


def test_overrides_apply_and_validate():
  base = moe(num_experts=8)
  cfg = C.apply_overrides(base, ["router.top_k=4", "router.score_fn=sigmoid",
                                 "capacity_factor=1.25"])
  assert cfg.router.top_k == 4 and cfg.router.score_fn == "sigmoid"
  assert cfg.capacity_factor == 1.25
  assert base.router.top_k == 2  # frozen: the original is untouched
  with pytest.raises(C.ConfigError, match="unknown override key"):
    C.apply_overrides(base, {"router.top_kk": 4})
  with pytest.raises(C.ConfigError, match="exceeds"):
    C.apply_overrides(base, {"router.top_k": 9})


def test_model_config_round_trip_and_layout():
  m = C.from_dict(C.ModelConfig, {"n_layers": 6, "moe_layout": "first_dense",
                                  "first_dense_layers": 2,
                                  "moe": {"num_experts": 4, "router": {"top_k": 1}}})
  assert [m.is_moe_layer(i) for i in range(6)] == [False, False, True, True, True, True]
  assert C.from_dict(C.ModelConfig, C.to_dict(m)) == m
  every = C.apply_overrides(m, {"moe_layout": "every_other"})
  assert [every.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
  dense = C.from_dict(C.ModelConfig, {"moe": None})
  assert not dense.is_moe_layer(0)
  with pytest.raises(C.ConfigError, match="model.n_heads"):
    C.from_dict(C.ModelConfig, {"d_model": 10, "n_heads": 4})


def test_configs_are_frozen():
  cfg = moe()
  with pytest.raises(Exception):
    cfg.num_experts = 3  # type: ignore[misc]


def test_backend_names_match_the_execution_registry():
  from moejax.execution import gmm
  assert set(C.EXPERT_BACKENDS) == {"reference", *gmm.BACKENDS}
  with pytest.raises(C.ConfigError, match="did you mean 'blocked'"):
    moe(backend="blockd")
