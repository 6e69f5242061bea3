"""Clear errors: unsupported architectures, missing tensors, wrong shapes, and
configs a family cannot express. Numpy state dicts only: no torch needed."""

import dataclasses

import numpy as np
import pytest

from moejax.config import ConfigError, MoEConfig, RoutingConfig
from moejax.interop import (FAMILIES, InteropError, MissingTensorError, TensorShapeError,
                            UnsupportedArchitectureError, export_moe_block,
                            import_moe_block, moe_config_from_hf)
from tests.configs import moe_config

D = 8
QWEN2 = {"model_type": "qwen2_moe", "hidden_size": D, "moe_intermediate_size": 4,
         "shared_expert_intermediate_size": 6, "num_experts": 4, "num_experts_per_tok": 2,
         "norm_topk_prob": True, "num_hidden_layers": 2}
DSV3 = {"model_type": "deepseek_v3", "hidden_size": D, "moe_intermediate_size": 4,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
        "num_hidden_layers": 3, "first_k_dense_replace": 1}


def _qwen2_sd(prefix="model.layers.1.mlp."):
  rng = np.random.default_rng(0)
  r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  sd = {prefix + "gate.weight": r(4, D), prefix + "shared_expert_gate.weight": r(1, D)}
  for i in range(4):
    sd[f"{prefix}experts.{i}.gate_proj.weight"] = r(4, D)
    sd[f"{prefix}experts.{i}.up_proj.weight"] = r(4, D)
    sd[f"{prefix}experts.{i}.down_proj.weight"] = r(D, 4)
  for n, shape in (("gate_proj", (6, D)), ("up_proj", (6, D)), ("down_proj", (D, 6))):
    sd[f"{prefix}shared_expert.{n}.weight"] = r(*shape)
  return sd


def test_unsupported_model_type_names_it_and_the_supported_list():
  with pytest.raises(UnsupportedArchitectureError) as info:
    import_moe_block({}, {"model_type": "llama", "hidden_size": 8}, layer=0)
  msg = str(info.value)
  assert "'llama'" in msg
  for name in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"):
    assert name in msg and name in FAMILIES
  with pytest.raises(UnsupportedArchitectureError, match="did you mean 'qwen2_moe'"):
    moe_config_from_hf({"model_type": "qwen2moe"})
  cfg = moe_config(num_experts=4, expert_width=4)
  with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):
    export_moe_block({}, None, cfg, "gpt2")


def test_missing_expert_tensor_names_the_key():
  sd = _qwen2_sd()
  assert import_moe_block(sd, QWEN2, layer=1).layout == "checkpoint"
  del sd["model.layers.1.mlp.experts.3.down_proj.weight"]
  with pytest.raises(MissingTensorError) as info:
    import_moe_block(sd, QWEN2, layer=1)
  assert info.value.key == "model.layers.1.mlp.experts.3.down_proj.weight"
  assert "'model.layers.1.mlp.experts.3.down_proj.weight' is missing" in str(info.value)
  assert isinstance(info.value, KeyError)


def test_missing_router_and_shared_gate_name_their_keys():
  sd = _qwen2_sd()
  with pytest.raises(MissingTensorError, match=r"'model\.layers\.0\.mlp\.gate\.weight'"):
    import_moe_block(sd, QWEN2, layer=0)
  del sd["model.layers.1.mlp.shared_expert_gate.weight"]
  with pytest.raises(MissingTensorError, match="shared_expert_gate.weight"):
    import_moe_block(sd, QWEN2, layer=1)


def test_missing_deepseek_bias_names_the_key():
  sd = {"p.gate.weight": np.zeros((4, D), np.float32),
        "p.experts.gate_up_proj": np.zeros((4, 8, D), np.float32),
        "p.experts.down_proj": np.zeros((4, D, 4), np.float32)}
  for n, shape in (("gate_proj", (4, D)), ("up_proj", (4, D)), ("down_proj", (D, 4))):
    sd[f"p.shared_experts.{n}.weight"] = np.zeros(shape, np.float32)
  with pytest.raises(MissingTensorError, match=r"'p\.gate\.e_score_correction_bias'"):
    import_moe_block(sd, DSV3, prefix="p")
  sd["p.gate.e_score_correction_bias"] = np.ones(4, np.float32)
  block = import_moe_block(sd, DSV3, prefix="p")
  np.testing.assert_array_equal(block.state.bias, np.ones(4))


def test_wrong_shape_names_key_and_shapes():
  sd = _qwen2_sd()
  sd["model.layers.1.mlp.experts.2.up_proj.weight"] = np.zeros((5, D), np.float32)
  with pytest.raises(TensorShapeError, match=r"experts\.2\.up_proj\.weight.*\(5, 8\).*\(4, 8\)"):
    import_moe_block(sd, QWEN2, layer=1)
  with pytest.raises(TensorShapeError, match="hidden_size"):
    import_moe_block(_qwen2_sd(), {**QWEN2, "hidden_size": 16}, layer=1)


def test_dense_layer_and_missing_location_are_explained():
  with pytest.raises(InteropError, match=r"layer 0 .* not a MoE layer.*\[1, 2\]"):
    import_moe_block({}, DSV3, layer=0)
  with pytest.raises(InteropError, match="layer=.*prefix="):
    import_moe_block(_qwen2_sd(), QWEN2)
  with pytest.raises(InteropError, match="hf_config is required"):
    import_moe_block(_qwen2_sd(), None, layer=1)


def test_config_errors():
  with pytest.raises(InteropError, match="hidden_act='gelu'"):
    moe_config_from_hf({**QWEN2, "hidden_act": "gelu"})
  missing = {k: v for k, v in QWEN2.items() if k != "moe_intermediate_size"}
  with pytest.raises(InteropError, match="'moe_intermediate_size'"):
    moe_config_from_hf(missing)
  with pytest.raises(TypeError, match="base_cfg must be a MoEConfig"):
    moe_config_from_hf(QWEN2, {"capacity_factor": 1.0})
  # A base whose training-only fields contradict the checkpoint still fails
  # config validation, naming the field.
  base = moe_config(routing=RoutingConfig(use_bias=True), balance=dataclasses.replace(
      MoEConfig().balance, bias_update="sign"))
  with pytest.raises(ConfigError, match="bias_update"):
    moe_config_from_hf(QWEN2, base)


def test_bad_sources():
  with pytest.raises(InteropError, match="does not exist"):
    import_moe_block("/nonexistent/model.safetensors", QWEN2, layer=1)
  with pytest.raises(InteropError, match="cannot read tensors from a list"):
    import_moe_block([1, 2], QWEN2, layer=1)


def _layer(cfg, d=D):
  e, f = cfg.num_experts, cfg.topology.expert_width
  z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
  p = {"router": {"w": z(d, e)},
       "experts": {"w_gate_up": z(e, d, 2 * f), "w_down": z(e, f, d)}}
  if cfg.topology.num_shared_experts:
    w = cfg.topology.num_shared_experts * (cfg.topology.shared_expert_width or f)
    p["shared"] = {"w_gate": z(d, w), "w_up": z(d, w), "w_down": z(w, d)}
  return p


@pytest.mark.parametrize("model_type,cfg,field", [
    ("mixtral", moe_config(num_experts=4, expert_width=4, num_shared_experts=1),
     "moe.topology.num_shared_experts=1"),
    ("qwen3_moe", moe_config(num_experts=4, expert_width=4, routing=RoutingConfig(
        score_fn="sigmoid", gating="normalized")), "moe.routing.score_fn='sigmoid'"),
    ("qwen2_moe", moe_config(num_experts=4, expert_width=4, num_shared_experts=1),
     "moe.topology.shared_expert_gate=False"),
    ("deepseek_v3", moe_config(num_experts=4, expert_width=4), "moe.routing.score_fn='softmax'"),
    ("deepseek_v3", moe_config(num_experts=4, expert_width=4, routing=RoutingConfig(
        score_fn="sigmoid", use_bias=False)), "moe.routing.use_bias=False"),
    ("deepseek_v3", moe_config(num_experts=4, expert_width=4, num_shared_experts=1,
                              shared_expert_width=6, routing=RoutingConfig(
                                  score_fn="sigmoid", use_bias=True)), "not a multiple"),
    ("deepseek_v3", moe_config(num_experts=4, expert_width=4, routing=RoutingConfig(
        score_fn="sigmoid", use_bias=True, n_groups=2, topk_groups=1, group_score="max")),
     "moe.routing.group_score='max'"),
    ("mixtral", moe_config(num_experts=4, expert_width=4, expert_widths=(4, 4, 2, 2)),
     "moe.topology.expert_widths=(4, 4, 2, 2)"),
    ("mixtral", moe_config(num_experts=4, expert_width=4, routing=RoutingConfig(
        routed_scaling_factor=2.0)), "moe.routing.routed_scaling_factor=2.0"),
])
def test_export_rejects_what_the_family_cannot_express(model_type, cfg, field):
  with pytest.raises(InteropError, match=field.replace("(", r"\(").replace(")", r"\)")):
    export_moe_block(_layer(cfg), None, cfg, model_type)


def test_export_checks_params_and_layout():
  cfg = moe_config(num_experts=4, expert_width=4, routing=RoutingConfig(gating="topk_softmax"))
  params = _layer(cfg)
  params["experts"]["w_gate_up"] = np.zeros((4, D, 5), np.float32)
  with pytest.raises(InteropError, match=r"params\['experts'\]\['w_gate_up'\] has shape"):
    export_moe_block(params, None, cfg, "mixtral")
  with pytest.raises(InteropError, match=r"params\['router'\]\['w'\] is missing"):
    export_moe_block({}, None, cfg, "mixtral")
  with pytest.raises(InteropError, match="layout='sharded'"):
    export_moe_block(_layer(cfg), None, cfg, "mixtral", layout="sharded")


# ---------------------------------------------------------------------------
# Whole models (experiments.export_hf): the default model and its Mixtral-routed twin.

def _model(name):
  from tests.train.helpers import experiment  # pylint: disable=g-import-not-at-top
  return experiment(name).model


def test_a_default_model_block_names_its_fields_not_its_balancing():
  """configs/default.py's layer as a Mixtral block: the two routing fields Mixtral lacks.

  (Before, re-importing under Mixtral's router failed on the bias controller and the
  error named moe.balance.bias_update, which is no part of the block.)"""
  cfg = _model("default").moe
  with pytest.raises(InteropError) as e:
    export_moe_block(_layer(cfg), None, cfg, "mixtral")
  assert str(e.value) == (
      "mixtral cannot express moe.routing.score_fn='sigmoid' (as mixtral it would be "
      "'softmax'); moe.routing.use_bias=True (as mixtral it would be False). Fix: export a "
      "layer whose config mixtral can hold, or pick another model_type")
  from moejax.interop import expressing_families  # pylint: disable=g-import-not-at-top
  assert expressing_families(cfg, 128) == ["deepseek_v3"]


def test_the_default_model_as_mixtral_names_what_it_has_and_the_fix():
  from moejax.interop import models  # pylint: disable=g-import-not-at-top
  with pytest.raises(InteropError) as e:
    models.hf_config_of(_model("default"), "mixtral")
  assert str(e.value) == (
      "mixtral cannot express this model: model.moe.routing.score_fn='sigmoid' (mixtral: "
      "'softmax'); model.moe.routing.use_bias=True (mixtral: False). Its MoE blocks are "
      "deepseek_v3 blocks (moejax.interop.export_moe_block writes them one by one); as a "
      "whole deepseek_v3 model it has model.attention='mha' (DeepSeek-V3 attends with "
      "multi-head latent attention: 'mla') (configs/deepseek_v3_small.py is a model that "
      "fits). Fix: train a model with those fields as mixtral has them and export that run "
      "(configs/default_mixtral.py is configs/default.py routed as mixtral routes: softmax "
      "top-2, no selection bias)")
  # The config the fix names exports, and differs from the default model only in routing.
  twin = _model("default_mixtral")
  hf = models.hf_config_of(twin, "mixtral")
  assert (hf["num_local_experts"], hf["num_experts_per_tok"], hf["hidden_size"]) == (16, 2, 128)
  default = _model("default")
  assert dataclasses.replace(twin, moe=default.moe) == default


def test_whole_model_families_the_transformer_cannot_compute_are_one_line_with_the_fix():
  from moejax.interop import models  # pylint: disable=g-import-not-at-top
  with pytest.raises(InteropError) as e:
    models.hf_config_of(_model("default"), "qwen2_moe")
  assert str(e.value) == (
      "model_type='qwen2_moe': a whole moejax model cannot be written as qwen2_moe: its "
      "attention is attention with q/k/v biases but no output-projection bias "
      "(model.attention_bias puts a bias on all four projections or none), which the moejax "
      "Transformer lacks (its MoE blocks alone export: moejax.interop.export_moe_block). Fix: "
      "export as model_type='mixtral' a model mixtral expresses (e.g. a run of "
      "configs/default_mixtral.py)")


def test_the_default_model_as_deepseek_v3_names_its_attention_and_the_config_that_fits():
  from moejax.interop import models  # pylint: disable=g-import-not-at-top
  with pytest.raises(InteropError) as e:
    models.hf_config_of(_model("default"), "deepseek_v3")
  assert str(e.value) == (
      "deepseek_v3 cannot express this model: model.attention='mha' (DeepSeek-V3 attends with "
      "multi-head latent attention: 'mla'). Fix: train a model with those fields as "
      "deepseek_v3 has them and export that run (configs/deepseek_v3_small.py is "
      "configs/default.py with DeepSeek-V3's multi-head latent attention (its MTP module is "
      "left out of an export))")
  assert models.hf_config_of(_model("deepseek_v3_small"), "deepseek_v3")["kv_lora_rank"] == 72
  with pytest.raises(InteropError, match=r"^mixtral cannot express this model: model\.moe="
                                         r"None: no sparse MoE layer"):
    models.hf_config_of(_model("dense"), "mixtral")
