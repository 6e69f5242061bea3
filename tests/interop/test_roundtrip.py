"""Export -> import is exact; exported blocks load into transformers and match.

Directions covered, for every family:
- HF block -> moejax -> HF (fused layout) returns the block's state dict bit for bit;
- a saved HF checkpoint (per-expert layout, Mixtral's block_sparse_moe names)
  -> moejax -> HF checkpoint layout returns the file's tensors bit for bit;
- moejax params/state/config -> HF -> moejax returns them exactly (property
  test over families and sizes), config included when base_cfg is the
  original, and the exported block computes what the moejax layer computes.
"""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

import hypothesis  # noqa: E402
import hypothesis.strategies as st  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from moejax.config import MoEConfig, RoutingConfig  # noqa: E402
from moejax.interop import (export_moe_block, hf_models, import_moe_block,  # noqa: E402
                            import_moe_layers, moe_config_from_hf, moe_layers,
                            open_source, save_safetensors, to_torch)
from moejax.routing.types import RouterState  # noqa: E402
from moejax.topology import experts as experts_lib  # noqa: E402
from tests.interop import helpers  # noqa: E402
from tests.configs import moe_config

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hf_block_fused_round_trip_is_bitwise(model_type):
  block, hf_cfg = helpers.make_block(model_type, 0, bias_std=0.5)
  want = {k: v.numpy() for k, v in block.state_dict().items()}
  imported = import_moe_block(block.state_dict(), hf_cfg, prefix="")
  assert imported.layout == "fused"
  sd, fields = export_moe_block(imported.params, imported.state, imported.cfg, model_type,
                                layout="fused")
  assert sorted(sd) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(sd[k], want[k], err_msg=k)
  # The exported fields rebuild the same MoEConfig.
  assert moe_config_from_hf(fields) == imported.cfg


@pytest.mark.parametrize("model_type", FAMILIES)
def test_saved_checkpoint_round_trip_and_model_parity(model_type, tmp_path):
  """save_pretrained files -> moejax -> checkpoint layout: the same tensors; and the
  imported layers reproduce each MoE block inside the running model."""
  model = hf_models.tiny_model(model_type, seed=1, init_std=0.2, bias_std=0.2)
  model.save_pretrained(tmp_path)
  store = open_source(tmp_path)
  layers = moe_layers(model.config)
  from_disk = import_moe_layers(tmp_path)  # config.json read from the directory
  from_memory = import_moe_layers(model.state_dict(), model.config)
  assert sorted(from_disk) == layers
  # 48 tokens and the tiny configs of the parity tests' base cases: the same
  # XLA compile serves both files.
  ids = hf_models.text_to_ids("import numpy as np  # routing through two layers",
                              model.config.vocab_size)
  assert ids.shape == (1, 48)
  io = hf_models.capture_moe_io(model, ids)
  for i in layers:
    disk, mem = from_disk[i], from_memory[i]
    assert disk.layout == "checkpoint" and mem.layout == "fused"
    _assert_tree_equal(disk.params, mem.params)
    _assert_tree_equal(disk.state.bias, mem.state.bias)
    assert disk.cfg == mem.cfg
    sd, _ = export_moe_block(disk.params, disk.state, disk.cfg, model_type, layer=i)
    assert sd, "nothing exported"
    for k, v in sd.items():
      np.testing.assert_array_equal(v, store.get(k), err_msg=k)
    assert disk.prefix.startswith(f"model.layers.{i}.")
    x, y = io[i]
    got, _, _ = helpers.apply_layer(disk.params, x[0], disk.state, disk.cfg)
    np.testing.assert_allclose(np.asarray(got), y[0], atol=1e-5 * max(1, np.abs(y).max()))


def _random_layer(rng, cfg: MoEConfig, d: int):
  e, f = cfg.num_experts, cfg.topology.expert_width
  params = {"router": {"w": rng.standard_normal((d, e))},
            "experts": {"w_gate": rng.standard_normal((e, d, f)),
                        "w_up": rng.standard_normal((e, d, f)),
                        "w_down": rng.standard_normal((e, f, d))}}
  if cfg.topology.num_shared_experts:
    width = cfg.topology.num_shared_experts * (cfg.topology.shared_expert_width or f)
    params["shared"] = {"w_gate": rng.standard_normal((d, width)),
                        "w_up": rng.standard_normal((d, width)),
                        "w_down": rng.standard_normal((width, d))}
    if cfg.topology.shared_expert_gate:
      params["shared"]["w_shared_gate"] = rng.standard_normal((d, 1))
  params["experts"] = experts_lib.fused_layout(params["experts"])
  params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
  bias = (rng.standard_normal(e) if cfg.routing.use_bias else np.zeros(e)).astype(np.float32)
  return params, RouterState(bias=bias, step=np.zeros((), np.int32))


@st.composite
def _layers(draw):
  model_type = draw(st.sampled_from(FAMILIES))
  e = draw(st.sampled_from((4, 8)))
  k = draw(st.integers(1, 3))
  f = draw(st.sampled_from((4, 8)))
  # Non-architecture fields an HF config does not carry: kept via base_cfg.
  extra = dict(capacity_factor=draw(st.sampled_from((None, 1.25))),
               backend=draw(st.sampled_from(("reference", "ragged_dot"))))
  router = dict(top_k=k, router_dtype=draw(st.sampled_from(("float32", "bfloat16"))))
  if model_type == "mixtral":
    router.update(gating=draw(st.sampled_from(("topk_softmax", "normalized"))))
    moe = {}
  elif model_type in ("qwen2_moe", "qwen3_moe"):
    router.update(gating=draw(st.sampled_from(("topk_softmax", "normalized", "scores"))))
    moe = {}
    if model_type == "qwen2_moe":
      moe = dict(num_shared_experts=draw(st.integers(1, 2)), shared_expert_gate=True,
                 shared_expert_width=draw(st.sampled_from((None, 4, 12))))
  else:
    g = draw(st.sampled_from((1, 2, 4)))
    tg = 1 if g == 1 else draw(st.integers(1, g))
    hypothesis.assume(k <= (e // g) * tg and e // g >= 2)
    router.update(score_fn="sigmoid", use_bias=True, n_groups=g, topk_groups=tg,
                  gating=draw(st.sampled_from(("normalized", "scores"))),
                  group_score=draw(st.sampled_from(("auto", "top2_sum"))),
                  routed_scaling_factor=draw(st.sampled_from((1.0, 2.5))))
    ks = draw(st.integers(0, 2))
    moe = dict(num_shared_experts=ks,
               shared_expert_width=draw(st.sampled_from((None, f))) if ks else None)
  cfg = moe_config(num_experts=e, expert_width=f, routing=RoutingConfig(**router), **moe, **extra)
  return model_type, cfg, draw(st.sampled_from((8, 12))), draw(st.integers(0, 2**16))


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(_layers(), st.sampled_from(("checkpoint", "fused")))
def test_moejax_round_trip_is_exact(layer, layout):
  model_type, cfg, d, seed = layer
  params, state = _random_layer(np.random.default_rng(seed), cfg, d)
  sd, fields = export_moe_block(params, state, cfg, model_type, layout=layout, layer=5)
  back = import_moe_block(sd, fields, layer=5, base_cfg=cfg, dtype=None)
  assert back.cfg == cfg
  _assert_tree_equal(back.params, params)
  np.testing.assert_array_equal(np.asarray(back.state.bias), state.bias)
  # Without base_cfg the architecture survives; equivalent choices may be
  # canonicalised, and a second trip is then a fixed point.
  plain = import_moe_block(sd, fields, layer=5)
  again = export_moe_block(plain.params, plain.state, plain.cfg, model_type, layout=layout,
                           layer=5)
  assert import_moe_block(again.state_dict, again.hf_fields, layer=5).cfg == plain.cfg
  for key in sd:
    np.testing.assert_array_equal(again.state_dict[key], sd[key])


@pytest.mark.parametrize("model_type", FAMILIES)
def test_exported_block_runs_in_transformers(model_type, tmp_path):
  """A moejax layer exported to a strict HF block computes the moejax output."""
  block0, hf_cfg0 = helpers.make_block(model_type, 4, bias_std=0.2)
  ours = import_moe_block(block0.state_dict(), hf_cfg0, prefix="")
  rng = np.random.default_rng(4)
  params, state = _random_layer(rng, ours.cfg, hf_cfg0.hidden_size)
  params = jax.tree.map(lambda a: a * 0.3, params)
  state = state.replace(bias=state.bias * 0.2)
  sd, fields = export_moe_block(params, state, ours.cfg, model_type, layout="fused")
  hf_cfg = hf_models.tiny_config(model_type, **{k: v for k, v in fields.items()
                                                 if k != "model_type"})
  block = helpers.block_class(model_type)(hf_cfg).eval()
  block.load_state_dict(to_torch(sd), strict=True)
  x = helpers.ties_free_inputs(block, hf_cfg, 48, 4)
  want, _, _ = helpers.apply_layer(params, x, state, ours.cfg)
  got = helpers.hf_forward(block, x)
  np.testing.assert_allclose(got, np.asarray(want), atol=1e-5 * max(1, np.abs(got).max()))
  # The checkpoint layout, written to safetensors, imports back identically.
  ck, _ = export_moe_block(params, state, ours.cfg, model_type, layer=0)
  save_safetensors(ck, tmp_path / "block.safetensors")
  back = import_moe_block(tmp_path / "block.safetensors", fields, layer=0, base_cfg=ours.cfg)
  _assert_tree_equal(back.params, params)


def test_the_default_models_layer_runs_as_a_deepseek_v3_block():
  """configs/default.py's MoE layer (sigmoid scores, a selection bias, no groups, no shared
  expert) is a DeepSeek-V3 block, as its whole-model export error says: exported, it
  computes in transformers what the moejax layer computes."""
  from tests.train.helpers import experiment  # pylint: disable=g-import-not-at-top
  model = experiment("default").model
  cfg = model.moe
  params, state = _random_layer(np.random.default_rng(7), cfg, model.d_model)
  params = jax.tree.map(lambda a: a * 0.1, params)
  state = state.replace(bias=state.bias * 0.2)
  sd, fields = export_moe_block(params, state, cfg, "deepseek_v3", layout="fused")
  assert (fields["n_group"], fields["n_shared_experts"], fields["norm_topk_prob"],
          fields["routed_scaling_factor"]) == (1, 0, True, 1.0)
  hf_cfg = hf_models.tiny_config("deepseek_v3", **{k: v for k, v in fields.items()
                                                    if k != "model_type"})
  block = helpers.block_class("deepseek_v3")(hf_cfg).eval()
  block.load_state_dict(to_torch(sd), strict=True)
  x = helpers.ties_free_inputs(block, hf_cfg, 48, 4)
  want, _, _ = helpers.apply_layer(params, x, state, cfg)
  got = helpers.hf_forward(block, x)
  np.testing.assert_allclose(got, np.asarray(want), atol=1e-5 * max(1, np.abs(got).max()))


def test_equivalent_configs_kept_with_base_and_canonical_without():
  """qwen2_moe: 2 shared experts of width 6 are one HF shared expert of width 12."""
  cfg = moe_config(num_experts=4, expert_width=8, num_shared_experts=2, shared_expert_width=6,
                  shared_expert_gate=True,
                  routing=RoutingConfig(top_k=2, gating="topk_softmax"))
  params, state = _random_layer(np.random.default_rng(0), cfg, 8)
  sd, fields = export_moe_block(params, state, cfg, "qwen2_moe")
  assert fields["shared_expert_intermediate_size"] == 12 and fields["norm_topk_prob"]
  assert import_moe_block(sd, fields, prefix="", base_cfg=cfg).cfg == cfg
  plain = import_moe_block(sd, fields, prefix="").cfg
  assert (plain.topology.num_shared_experts, plain.topology.shared_expert_width) == (1, 12)
  assert plain.routing.gating == "normalized"
  assert dataclasses.replace(
      plain, topology=dataclasses.replace(plain.topology, num_shared_experts=2,
                                          shared_expert_width=6),
      routing=cfg.routing) == cfg
