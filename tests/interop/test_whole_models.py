"""Whole Qwen3-MoE and DeepSeek-V3 models <-> the moejax Transformer, against transformers.

Each case is a tiny random HF model (or a moejax model of the imported config): the import
reproduces the HF logits, a moejax model exported loads in transformers with the moejax
logits, HF -> moejax -> HF returns the state dict bit for bit, and moejax -> HF -> moejax
returns the params and the config. Multi-token prediction: the export leaves it out with one
line; an import keeps the MTP layers a checkpoint holds, dense or MoE. Unsupported HF field values are
one-line errors. Tolerance: the Mixtral whole-model tests' (rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from moejax.interop import hf_models, save_safetensors  # noqa: E402
from moejax.interop import models as whole  # noqa: E402
from moejax.interop.errors import InteropError  # noqa: E402
from moejax.model import RouterStateVar, Transformer  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 256, (2, 24))
TOL = dict(rtol=1e-4, atol=1e-5)

# (id, model_type, tiny-config overrides): every layout and attention variant once.
CASES = [
    ("qwen3", "qwen3_moe", {}),
    ("qwen3-first-dense", "qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0],
                                        "norm_topk_prob": False}),
    ("qwen3-every-other", "qwen3_moe", {"decoder_sparse_step": 2}),  # slow: a third layout
    # group-limited routing (4 groups, best 2), scaled gates, 2 shared experts, 1 dense layer,
    # interleaved rotary rows.
    ("dsv3", "deepseek_v3", {}),
    ("dsv3-q-latent-half-split-rope", "deepseek_v3",
     {"q_lora_rank": 12, "rope_interleave": False, "first_k_dense_replace": 0,
      "n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
]
SLOW = {"qwen3-every-other"}   # the default run checks two Qwen3 layouts
PARAMS = [pytest.param(c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else [])
          for c in CASES]


def _hf(model_type, overrides, seed=0):
  return hf_models.tiny_model(model_type, seed=seed, init_std=0.1, bias_std=0.1, **overrides)


def _logits(model, ids=IDS) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(ids)).logits.numpy()


def _moejax_logits(cfg, params, router_state, ids=IDS, **kw):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, params, router_state)(np.asarray(ids, np.int32), **kw)


def _random_moejax(cfg, seed):
  """A moejax model of ``cfg`` with random weights and selection biases (params, state)."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda a: np.asarray(a) if a.ndim == 1 else
                        (rng.standard_normal(a.shape) * 0.1).astype(np.float32), params)
  state = nnx.to_pure_dict(nnx.state(model, RouterStateVar))
  state = jax.tree.map(lambda a: (rng.standard_normal(a.shape) * 0.1).astype(np.float32)
                       if a.ndim == 1 else a, state)
  return params, state


def _save(sd, hf_config, path):
  path.mkdir(parents=True, exist_ok=True)
  save_safetensors(sd, path / "model.safetensors")
  (path / "config.json").write_text(json.dumps(hf_config))
  return path


@pytest.mark.parametrize("case", PARAMS)
def test_import_reproduces_the_hf_logits(case, tmp_path):
  _, model_type, overrides = case
  hf = _hf(model_type, overrides)
  hf.save_pretrained(tmp_path)
  imported = whole.import_model(tmp_path)   # config.json and safetensors from the directory
  cfg = imported.cfg
  assert cfg.moe_layout == {"qwen3-first-dense": "first_dense", "qwen3-every-other":
                            "every_other", "dsv3": "first_dense"}.get(case[0], "all")
  assert cfg.attention == ("mla" if model_type == "deepseek_v3" else "mha")
  got, _ = _moejax_logits(cfg, imported.params, imported.router_state)
  np.testing.assert_allclose(np.asarray(got), _logits(hf), **TOL)


@pytest.mark.parametrize("case", PARAMS)
def test_a_moejax_model_exported_loads_in_transformers_with_its_logits(case, tmp_path):
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  _, model_type, overrides = case
  hf = _hf(model_type, overrides)
  cfg = whole.import_model(hf.state_dict(), hf.config).cfg
  params, state = _random_moejax(cfg, seed=3)
  want, _ = _moejax_logits(cfg, params, state)
  sd, hf_config = whole.export_model(params, state, cfg, model_type)
  loaded = AutoModelForCausalLM.from_pretrained(_save(sd, hf_config, tmp_path / "out")).eval()
  assert type(loaded).__name__ == hf_config["architectures"][0]
  np.testing.assert_allclose(_logits(loaded), np.asarray(want), **TOL)


@pytest.mark.parametrize("case", PARAMS)
def test_round_trips_are_exact(case):
  _, model_type, overrides = case
  hf = _hf(model_type, overrides)
  want = {k: v.numpy() for k, v in hf.state_dict().items()}
  imported = whole.import_model(hf.state_dict(), hf.config)
  sd, hf_config = whole.export_model(imported.params, imported.router_state, imported.cfg,
                                     model_type, layout="fused")
  if overrides.get("rope_interleave", True):  # export writes interleaved rows
    assert sorted(sd) == sorted(want)
    for k in want:
      np.testing.assert_array_equal(sd[k], want[k], err_msg=k)
  # moejax -> HF -> moejax: the same params, router state and (with base) config.
  back = whole.import_model(sd, hf_config, base=imported.cfg)
  assert back.cfg == imported.cfg
  for a, b in zip(jax.tree.leaves((back.params, back.router_state["blocks"])),
                  jax.tree.leaves((imported.params, imported.router_state["blocks"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_rotary_permutation_is_what_makes_deepseek_v3_match():
  """Imported as if its rotary rows were half-split, an interleaved checkpoint differs."""
  hf = _hf("deepseek_v3", {})
  wrong = whole.import_model(hf.state_dict(), {**hf.config.to_dict(), "rope_interleave": False})
  got, _ = _moejax_logits(wrong.cfg, wrong.params, wrong.router_state)
  assert np.abs(np.asarray(got) - _logits(hf)).max() > 1e-3


def _with_mtp(model_type="deepseek_v3", mtp_ffn="dense"):
  """A moejax DeepSeek-V3-shaped model with one MTP module, random weights."""
  hf = _hf(model_type, {})
  cfg = dataclasses.replace(whole.import_model(hf.state_dict(), hf.config).cfg, mtp_depth=1,
                            mtp_ffn=mtp_ffn)
  return cfg, *_random_moejax(cfg, seed=5)


def _mtp_tensors(module, cfg, router_state=None) -> dict:
  """The MTP module as DeepSeek's checkpoints hold it (layer L), written here by hand; an
  MoE block's FFN (with its module's ``router_state``) through the main layers' writer."""
  from moejax.interop import deepseek_v3  # pylint: disable=g-import-not-at-top
  d, lp = cfg.d_model, f"model.layers.{cfg.n_layers}."
  proj = np.asarray(module["proj"]["kernel"]).T           # [d, 2d]: [hidden | embedding]
  block = module["block"]
  sd = {lp + "enorm.weight": module["embed_norm"]["scale"],
        lp + "hnorm.weight": module["hidden_norm"]["scale"],
        lp + "eh_proj.weight": np.concatenate([proj[:, d:], proj[:, :d]], axis=1),
        lp + "shared_head.norm.weight": module["head_norm"]["scale"],
        lp + "input_layernorm.weight": block["attn_norm"]["scale"],
        lp + "post_attention_layernorm.weight": block["ffn_norm"]["scale"]}
  sd.update({f"{lp}self_attn.{k}": v
             for k, v in deepseek_v3.attention_tensors(block["attn"], cfg).items()})
  if router_state is not None:
    from moejax.interop import export_moe_block  # pylint: disable=g-import-not-at-top
    from moejax.routing.types import RouterState  # pylint: disable=g-import-not-at-top
    rs = router_state["block"]["ffn"]["router_state"]
    sd.update(export_moe_block(block["ffn"]["params"], RouterState(**rs), cfg.moe,
                               "deepseek_v3", prefix=lp + "mlp").state_dict)
  else:
    sd.update({f"{lp}mlp.{hf}.weight": np.asarray(block["ffn"][ours]["kernel"]).T
               for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"),
                                ("down_proj", "w_down"))})
  return {k: np.ascontiguousarray(np.asarray(v)) for k, v in sd.items()}


def test_export_leaves_mtp_out_with_one_line(capsys):
  cfg, params, state = _with_mtp()
  sd, hf_config = whole.export_model(params, state, cfg, "deepseek_v3")
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["note: deepseek_v3 export leaves out the 1 multi-token prediction module(s) "
                 "(model.mtp_depth=1): transformers has no MTP module; the exported model is "
                 "the main model, which is all that inference runs"]
  assert hf_config["num_nextn_predict_layers"] == 0
  assert not any(k.startswith(f"model.layers.{cfg.n_layers}.") for k in sd)
  # Without MTP, nothing is printed.
  whole.export_model(params, state, dataclasses.replace(cfg, mtp_depth=0), "deepseek_v3")
  assert capsys.readouterr().err == ""


def test_import_keeps_the_mtp_layers_a_checkpoint_holds(capsys):
  cfg, params, state = _with_mtp()
  sd, hf_config = whole.export_model(params, state, cfg, "deepseek_v3")
  sd.update(_mtp_tensors(params["mtp"][0], cfg))
  back = whole.import_model(sd, {**hf_config, "num_nextn_predict_layers": 1})
  assert back.cfg.mtp_depth == 1
  for a, b in zip(jax.tree.leaves(back.params["mtp"]), jax.tree.leaves(params["mtp"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, want = _moejax_logits(cfg, params, state, mtp=True)
  _, got = _moejax_logits(back.cfg, back.params, back.router_state, mtp=True)
  np.testing.assert_allclose(np.asarray(got["mtp"][0]), np.asarray(want["mtp"][0]), rtol=1e-6)


def test_import_keeps_an_moe_mtp_layer_with_its_selection_bias(capsys):
  """DeepSeek-V3's own MTP layer has an MoE FFN: it becomes an MoE MTP block
  (model.mtp_ffn='moe') with the same experts, router and e_score_correction_bias."""
  cfg, params, state = _with_mtp(mtp_ffn="moe")
  sd, hf_config = whole.export_model(params, state, cfg, "deepseek_v3")
  assert not any(k.startswith(f"model.layers.{cfg.n_layers}.") for k in sd)
  sd.update(_mtp_tensors(params["mtp"][0], cfg, state["mtp"][0]))
  assert f"model.layers.{cfg.n_layers}.mlp.gate.e_score_correction_bias" in sd
  capsys.readouterr()
  back = whole.import_model(sd, {**hf_config, "num_nextn_predict_layers": 1})
  assert capsys.readouterr().err == ""
  assert (back.cfg.mtp_depth, back.cfg.mtp_ffn) == (1, "moe")
  for a, b in zip(jax.tree.leaves((back.params["mtp"], back.router_state["mtp"])),
                  jax.tree.leaves((params["mtp"], state["mtp"]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  _, want = _moejax_logits(cfg, params, state, mtp=True)
  _, got = _moejax_logits(back.cfg, back.params, back.router_state, mtp=True)
  np.testing.assert_allclose(np.asarray(got["mtp"][0]), np.asarray(want["mtp"][0]), rtol=1e-6)
  assert list(got["mtp_moe"]) == ["mtp_1"]


def test_mtp_layers_of_two_ffn_kinds_keep_the_first_kind_with_a_note(capsys):
  cfg, params, state = _with_mtp()
  sd, hf_config = whole.export_model(params, state, cfg, "deepseek_v3")
  sd.update(_mtp_tensors(params["mtp"][0], cfg))
  second = {k.replace(f".{cfg.n_layers}.", f".{cfg.n_layers + 1}."): v
            for k, v in _mtp_tensors(params["mtp"][0], cfg).items()}
  second[f"model.layers.{cfg.n_layers + 1}.mlp.gate.weight"] = np.zeros((8, cfg.d_model),
                                                                         np.float32)
  sd.update(second)
  capsys.readouterr()
  back = whole.import_model(sd, {**hf_config, "num_nextn_predict_layers": 2})
  assert (back.cfg.mtp_depth, back.cfg.mtp_ffn) == (1, "dense")
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"note: MTP layer {cfg.n_layers + 1} of this "
                                             "checkpoint has a moe FFN")


@pytest.mark.parametrize("model_type, field, value, message", [
    ("deepseek_v3", "rope_parameters", {"rope_type": "yarn", "factor": 40.0,
                                        "rope_theta": 10000.0},
     r"^rope_type='yarn': moejax's rotary embedding is the unscaled one"),
    ("deepseek_v3", "scoring_func", "softmax", r"^scoring_func='softmax': moejax imports "),
    ("deepseek_v3", "rms_norm_eps", 1e-5, r"^rms_norm_eps=1e-05: transformers normalises "),
    ("qwen3_moe", "attention_bias", True, r"^attention_bias=True: "),
    ("qwen3_moe", "mlp_only_layers", [1], r"^mlp_only_layers=\[1\] with decoder_sparse_step=1 "
                                          r"makes layers \[0\] MoE"),
])
def test_an_unsupported_hf_field_value_is_one_line(model_type, field, value, message):
  hf_config = hf_models.tiny_config(model_type).to_dict()
  hf_config[field] = value
  with pytest.raises(InteropError, match=message) as e:
    whole.model_config_from_hf(hf_config)
  assert "\n" not in str(e.value) and "Fix: " in str(e.value)


def test_export_names_what_deepseek_v3_cannot_hold():
  cfg, params, state = _with_mtp()
  bad = dataclasses.replace(cfg, moe_layout="every_other", first_dense_layers=0)
  with pytest.raises(InteropError, match=r"^deepseek_v3 cannot express this model: "
                                         r"model\.moe_layout='every_other'") as e:
    whole.export_model(params, state, bad, "deepseek_v3")
  assert "\n" not in str(e.value)


def test_configs_deepseek_v3_small_exports_and_loads_in_transformers(tmp_path, capsys):
  """The shipped DeepSeek-V3-shaped config (MLA, the selection bias, MTP) exports, loads in
  transformers with the moejax logits, and imports back to the same main model."""
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  from tests.train.helpers import experiment  # pylint: disable=g-import-not-at-top
  cfg = experiment("deepseek_v3_small").model
  assert cfg.attention == "mla" and cfg.mtp_depth == 1 and cfg.moe.routing.use_bias
  params, state = _random_moejax(cfg, seed=7)
  want, _ = _moejax_logits(cfg, params, state)
  sd, hf_config = whole.export_model(params, state, cfg, "deepseek_v3")
  assert capsys.readouterr().err.startswith("note: deepseek_v3 export leaves out the 1 ")
  loaded = AutoModelForCausalLM.from_pretrained(_save(sd, hf_config, tmp_path / "hf")).eval()
  np.testing.assert_allclose(_logits(loaded), np.asarray(want), **TOL)
  back = whole.import_model(tmp_path / "hf", base=cfg)
  assert back.cfg == dataclasses.replace(cfg, mtp_depth=0)
  main = {k: v for k, v in params.items() if k != "mtp"}
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(main)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
