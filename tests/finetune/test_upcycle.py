"""Sparse upcycling (moejax.finetune.upcycle): the first forward is the dense model's, every
non-FFN tensor is copied, drop-upcycling re-initialises exactly round(r f) units per expert,
fine-grained experts are the dense FFN's slices, bad options are one ConfigError line."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, ModelConfig
from moejax.config.finetune import FinetuneConfig, UpcycleConfig, check_upcycle_model
from moejax.finetune import source as source_lib
from moejax.finetune import upcycle as up_lib
from moejax.model import Transformer
from moejax.topology import experts as experts_lib

# d=16, 2 layers, dense width F=32: small enough that every forward is milliseconds.
DENSE = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, dense_ff_width=32,
                    moe=None)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


def _moe(e=4, k=2, width=32, gating="normalized", **routing):
  return {"topology": {"num_experts": e, "expert_width": width, "activation": "swiglu"},
          "routing": {"kind": "topk", "top_k": k, "score_fn": "softmax", "gating": gating,
                      **routing},
          "execution": {"backend": "reference"}}


def _pure(model):
  _, params, state, _ = nnx.split(model, nnx.Param, nnx.Variable, ...)
  return nnx.to_pure_dict(params), nnx.to_pure_dict(state)


def _dense_params():
  return _pure(Transformer(DENSE, rngs=nnx.Rngs(0)))[0]


def _upcycled(run: ModelConfig, up: UpcycleConfig, dense_params=None, seed=0):
  """(upcycled Transformer, its params, the fresh params it started from)."""
  fresh_model = Transformer(run, rngs=nnx.Rngs(1))
  graphdef, params, state, rest = nnx.split(fresh_model, nnx.Param, nnx.Variable, ...)
  fresh = nnx.to_pure_dict(params)
  new = source_lib._overlay(fresh, up_lib.upcycle_params(  # pylint: disable=protected-access
      dense_params or _dense_params(), run, up, seed))
  nnx.replace_by_pure_dict(params, new)
  return nnx.merge(graphdef, params, state, rest), new, fresh


def _dense_logits():
  model = Transformer(DENSE, rngs=nnx.Rngs(0))
  return np.asarray(model(TOKENS)[0])


@pytest.mark.parametrize("gating, layout", [("normalized", {}), ("topk_softmax", {}),
                                            ("normalized", {"moe_layout": "every_other"})])
def test_first_forward_equals_the_dense_model(gating, layout):
  run = up_lib.upcycled_model(DENSE, {"moe": _moe(gating=gating), **layout})
  model, _, _ = _upcycled(run, UpcycleConfig())
  np.testing.assert_allclose(np.asarray(model(TOKENS)[0]), _dense_logits(), atol=2e-5)


def test_fine_grained_experts_are_the_dense_slices_and_the_uniform_router_reproduces_it():
  run = up_lib.upcycled_model(DENSE, {"moe": _moe(e=4, k=2, width=16)}, split=2)
  dense = _dense_params()
  model, params, _ = _upcycled(run, UpcycleConfig(split=2, router_init="uniform"), dense)
  np.testing.assert_allclose(np.asarray(model(TOKENS)[0]), _dense_logits(), atol=2e-5)
  for i in (0, 1):
    ex, ffn = params["blocks"][i]["ffn"]["params"]["experts"], dense["blocks"][i]["ffn"]
    assert ex["w_gate_up"].shape == (4, 16, 32)
    ex = experts_lib.split_layout(ex)
    assert ex["w_up"].shape == (4, 16, 16) and ex["w_down"].shape == (4, 16, 16)
    for e in range(4):
      s = slice(16 * (e % 2), 16 * (e % 2 + 1))
      np.testing.assert_array_equal(ex["w_gate"][e], ffn["w_gate"]["kernel"][:, s])
      np.testing.assert_array_equal(ex["w_up"][e], ffn["w_up"]["kernel"][:, s])
      # renormalize: x split / routed_scaling_factor (here 2), so 2 experts at gate 1/2 add up
      np.testing.assert_array_equal(ex["w_down"][e], 2 * ffn["w_down"]["kernel"][s])
    np.testing.assert_array_equal(params["blocks"][i]["ffn"]["params"]["router"]["w"], 0.0)


def test_every_non_ffn_tensor_is_copied_and_the_router_is_fresh():
  run = up_lib.upcycled_model(DENSE, {"moe": _moe()})
  dense = _dense_params()
  _, params, fresh = _upcycled(run, UpcycleConfig(), dense)
  flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  dense_flat = dict(jax.tree_util.tree_flatten_with_path(dense)[0])
  copied = [p for p in flat if "ffn" not in jax.tree_util.keystr(p)]
  assert len(copied) == len([p for p in dense_flat if "ffn" not in jax.tree_util.keystr(p)])
  for path in copied:
    np.testing.assert_array_equal(flat[path], dense_flat[path])
  for i in (0, 1):
    np.testing.assert_array_equal(params["blocks"][i]["ffn"]["params"]["router"]["w"],
                                  fresh["blocks"][i]["ffn"]["params"]["router"]["w"])


def test_drop_upcycling_reinitialises_exactly_round_r_f_units_per_expert():
  run = up_lib.upcycled_model(DENSE, {"moe": _moe(e=4)})
  dense = _dense_params()
  up = UpcycleConfig(drop=0.3, renormalize=False)   # round(0.3 x 32) = round(9.6) = 10
  assert up_lib.expert_count(up, 32) == 10 and up_lib.expert_count(
      dataclasses.replace(up, drop=0.5 / 32), 32) == 1   # 0.5 rounds up
  experts = experts_lib.split_layout(
      up_lib.upcycle_params(dense, run, up, seed=3)["blocks"][1]["ffn"]["params"]["experts"])
  ffn = dense["blocks"][1]["ffn"]
  changed = {}
  for name in ("w_gate", "w_up"):
    diff = np.asarray(experts[name]) != np.asarray(ffn[name]["kernel"])[None]   # [E, d, f]
    assert np.all(diff.any(axis=1) == diff.all(axis=1))   # whole columns, never parts
    changed[name] = diff.all(axis=1)                       # [E, f]
  down = np.asarray(experts["w_down"]) != np.asarray(ffn["w_down"]["kernel"])[None]  # [E, f, d]
  changed["w_down"] = down.all(axis=2)
  assert np.all(down.any(axis=2) == changed["w_down"])
  np.testing.assert_array_equal(changed["w_gate"].sum(axis=1), [10] * 4)
  np.testing.assert_array_equal(changed["w_up"], changed["w_gate"])     # the same units
  np.testing.assert_array_equal(changed["w_down"], changed["w_gate"])
  assert len({tuple(np.flatnonzero(r)) for r in changed["w_gate"]}) > 1   # drawn per expert


def test_noise_makes_the_experts_differ_and_zero_noise_keeps_exact_copies():
  run = up_lib.upcycled_model(DENSE, {"moe": _moe(e=4)})
  dense = _dense_params()
  for noise, same in ((0.0, True), (0.01, False)):
    ex = up_lib.upcycle_params(dense, run, UpcycleConfig(noise=noise), 0)["blocks"][0]["ffn"]
    w = np.asarray(experts_lib.split_layout(ex["params"]["experts"])["w_up"])
    assert np.array_equal(w[0], w[1]) == same
  rel = np.std(w - np.asarray(dense["blocks"][0]["ffn"]["w_up"]["kernel"])[None]) / np.std(
      np.asarray(dense["blocks"][0]["ffn"]["w_up"]["kernel"]))
  assert 0.008 < rel < 0.012


@pytest.mark.parametrize("fields, match", [
    ({"drop": 1.5}, "finetune.upcycle.drop=1.5: must be in"),
    ({"split": 0}, "finetune.upcycle.split=0"),
    ({"noise": -1}, "finetune.upcycle.noise=-1"),
    ({"router_init": "zero"}, "finetune.upcycle.router_init='zero': unknown value"),
    ({"renormalize": "yes"}, "finetune.upcycle.renormalize='yes': must be True or False"),
])
def test_bad_upcycling_options_are_one_line(fields, match):
  with pytest.raises(ConfigError, match=match):
    UpcycleConfig(**fields)


def test_upcycling_options_need_the_upcycle_format():
  with pytest.raises(ConfigError, match="finetune.upcycle=.*source_format='moejax' does not "
                     "upcycle. Fix: set finetune.source_format='upcycle'"):
    FinetuneConfig(source="/x", upcycle=UpcycleConfig(drop=0.5))


@pytest.mark.parametrize("moe, up, match", [
    (_moe(gating="scores"), UpcycleConfig(), "finetune.upcycle.renormalize=True: needs combine "
     "weights that sum to 1"),
    (_moe(e=3, k=2), UpcycleConfig(split=2), "finetune.upcycle.split=2: does not divide "
     "model.moe.topology.num_experts=3"),
    (dict(_moe(), topology={**_moe()["topology"], "num_shared_experts": 1}), UpcycleConfig(),
     "model.moe.topology.num_shared_experts=1: has no dense counterpart"),
])
def test_models_upcycling_cannot_fill_are_refused(moe, up, match):
  run = up_lib.upcycled_model(DENSE, {"moe": moe})
  with pytest.raises(ConfigError, match=match):
    check_upcycle_model(run, up)


@pytest.mark.parametrize("change, match", [
    (dict(width=16), "model.moe.topology.expert_width=16: times finetune.upcycle.split=1 is "
     "not the source's dense width 32"),
    (dict(d_model=32), "differs from this run outside the FFNs \\(model.d_model: source 16, "
     "here 32"),
])
def test_a_source_of_another_shape_is_refused(change, match):
  run = up_lib.upcycled_model(DENSE, {"moe": _moe(width=change.get("width", 32))})
  if "d_model" in change:
    run = dataclasses.replace(run, d_model=change["d_model"])
  with pytest.raises(ConfigError, match=match):
    up_lib.check_compatible(DENSE, run, UpcycleConfig(), "/src")


def test_an_moe_source_is_refused():
  moe_src = up_lib.upcycled_model(DENSE, {"moe": _moe()})
  with pytest.raises(ConfigError, match="is already an MoE"):
    up_lib.check_compatible(moe_src, moe_src, UpcycleConfig(), "/src")


def test_only_moe_fields_come_from_the_config():
  with pytest.raises(ConfigError, match="model.d_model=8: is the dense source's"):
    up_lib.upcycled_model(DENSE, {"d_model": 8})
  run = up_lib.upcycled_model(DENSE, None, split=2)
  assert (run.moe.num_experts, run.moe.routing.top_k, run.moe.topology.expert_width) == (8, 2, 16)


def test_an_moe_mtp_block_upcycles_from_the_dense_one():
  """model.mtp_ffn='moe': the dense source's MTP block FFN becomes experts too, so the
  modules' first predictions are the dense model's."""
  dense_cfg = dataclasses.replace(DENSE, mtp_depth=1)
  dense_model = Transformer(dense_cfg, rngs=nnx.Rngs(0))
  run = up_lib.upcycled_model(dense_cfg, {"moe": _moe(), "mtp_ffn": "moe"})
  up_lib.check_compatible(dense_cfg, run, UpcycleConfig(), "/src")
  model, params, _ = _upcycled(run, UpcycleConfig(), _pure(dense_model)[0])
  assert params["mtp"][0]["block"]["ffn"]["params"]["experts"]["w_gate_up"].shape == (4, 16, 64)
  _, want = dense_model(TOKENS, mtp=True)
  _, got = model(TOKENS, mtp=True)
  np.testing.assert_allclose(np.asarray(got["mtp"][0]), np.asarray(want["mtp"][0]), atol=2e-5)
  assert list(got["mtp_moe"]) == ["mtp_1"]
