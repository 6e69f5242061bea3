"""Tensor sources: safetensors files (single, sharded, by glob), dtypes, FP8 blocks.

No torch: safetensors' numpy API writes and reads everything here.
"""

import json
import os
import stat

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("safetensors")

from safetensors.numpy import save_file  # noqa: E402

from moejax.interop import (InteropError, MissingTensorError, dequantize_blocks,  # noqa: E402
                            import_moe_block, open_source, save_safetensors)
from moejax.topology import experts as experts_lib  # noqa: E402

D, E, F = 8, 4, 4
MIXTRAL = {"model_type": "mixtral", "hidden_size": D, "intermediate_size": F,
           "num_local_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": 1}


def _mixtral_ckpt(rng, dtype=np.float32):
  """A Mixtral layer 0 in released-checkpoint names (block_sparse_moe, w1/w3/w2)."""
  p = "model.layers.0.block_sparse_moe."
  sd = {p + "gate.weight": rng.standard_normal((E, D))}
  for i in range(E):
    sd[f"{p}experts.{i}.w1.weight"] = rng.standard_normal((F, D))
    sd[f"{p}experts.{i}.w3.weight"] = rng.standard_normal((F, D))
    sd[f"{p}experts.{i}.w2.weight"] = rng.standard_normal((D, F))
  return {k: v.astype(dtype) for k, v in sd.items()}


def test_single_file_and_exact_mapping(tmp_path):
  sd = _mixtral_ckpt(np.random.default_rng(0))
  save_safetensors(sd, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
  for src in (tmp_path, tmp_path / "model.safetensors", sd):
    block = import_moe_block(src, MIXTRAL, layer=0)
    assert block.prefix == "model.layers.0.block_sparse_moe." and block.layout == "checkpoint"
    p = block.params
    np.testing.assert_array_equal(p["router"]["w"], sd[block.prefix + "gate.weight"].T)
    ex = experts_lib.split_layout(p["experts"])
    np.testing.assert_array_equal(ex["w_gate"][2],
                                  sd[block.prefix + "experts.2.w1.weight"].T)
    np.testing.assert_array_equal(ex["w_up"][3],
                                  sd[block.prefix + "experts.3.w3.weight"].T)
    np.testing.assert_array_equal(p["experts"]["w_down"][1],
                                  sd[block.prefix + "experts.1.w2.weight"].T)
  # A directory without hf_config reads its config.json.
  assert import_moe_block(tmp_path, layer=0).cfg.num_experts == E
  # A base model's state dict (no leading 'model.') is found by layer too.
  base = {k.removeprefix("model."): v for k, v in sd.items()}
  got = import_moe_block(base, MIXTRAL, layer=0)
  assert got.prefix == "layers.0.block_sparse_moe."
  np.testing.assert_array_equal(got.params["experts"]["w_gate_up"],
                                block.params["experts"]["w_gate_up"])


def test_sharded_checkpoint_reads_only_through_the_index(tmp_path):
  sd = _mixtral_ckpt(np.random.default_rng(1))
  keys = sorted(sd)
  shards = {"model-00001-of-00002.safetensors": keys[::2],
            "model-00002-of-00002.safetensors": keys[1::2]}
  for name, ks in shards.items():
    save_file({k: sd[k] for k in ks}, str(tmp_path / name), metadata={"format": "pt"})
  index = {"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  store = open_source(tmp_path)
  assert sorted(store.keys()) == keys
  block = import_moe_block(tmp_path, MIXTRAL, layer=0)
  np.testing.assert_array_equal(block.params["experts"]["w_down"][0],
                                sd["model.layers.0.block_sparse_moe.experts.0.w2.weight"].T)
  with pytest.raises(MissingTensorError, match="'nope'"):
    store.get("nope")


def test_glob_of_files_and_empty_directory(tmp_path):
  sd = _mixtral_ckpt(np.random.default_rng(2))
  keys = sorted(sd)
  save_file({k: sd[k] for k in keys[:5]}, str(tmp_path / "a.safetensors"))
  save_file({k: sd[k] for k in keys[5:]}, str(tmp_path / "b.safetensors"))
  assert sorted(open_source(tmp_path).keys()) == keys
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(InteropError, match="no model.safetensors.index.json"):
    open_source(empty)


def test_bfloat16_checkpoint_keeps_or_casts_dtype(tmp_path):
  sd = _mixtral_ckpt(np.random.default_rng(3), ml_dtypes.bfloat16)
  save_safetensors(sd, tmp_path / "model.safetensors")
  kept = import_moe_block(tmp_path / "model.safetensors", MIXTRAL, layer=0, dtype=None)
  assert kept.params["experts"]["w_gate_up"].dtype == ml_dtypes.bfloat16
  cast = import_moe_block(tmp_path / "model.safetensors", MIXTRAL, layer=0)
  assert cast.params["experts"]["w_gate_up"].dtype == np.float32
  np.testing.assert_array_equal(cast.params["experts"]["w_gate_up"],
                                kept.params["experts"]["w_gate_up"].astype(np.float32))


def test_dequantize_blocks_by_hand():
  w = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], ml_dtypes.float8_e4m3fn)
  s = np.array([[2.0, 10.0], [0.5, 1.0]], np.float32)
  got = dequantize_blocks(w, s, (2, 2))
  np.testing.assert_array_equal(got, [[2, 4, 30], [8, 10, 60], [3.5, 4, 9]])
  with pytest.raises(InteropError, match=r"expected \(2, 2\)"):
    dequantize_blocks(w, s[:1], (2, 2))


def test_fp8_expert_weights_are_dequantised_on_import(tmp_path):
  rng = np.random.default_rng(4)
  sd = _mixtral_ckpt(rng)
  key = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
  q = sd[key].astype(ml_dtypes.float8_e4m3fn)
  sd[key] = q
  sd[key + "_scale_inv"] = np.array([[0.5, 2.0, 4.0, 1.0]], np.float32)  # blocks of 4 x 2
  cfg = {**MIXTRAL, "quantization_config": {"weight_block_size": [4, 2]}}
  save_safetensors(sd, tmp_path / "model.safetensors")
  block = import_moe_block(tmp_path / "model.safetensors", cfg, layer=0)
  want = q.astype(np.float32) * np.repeat(sd[key + "_scale_inv"], 2, axis=1)
  np.testing.assert_array_equal(experts_lib.split_layout(block.params["experts"])["w_gate"][1],
                                want.T)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_saved_file_has_the_mode_of_any_new_file_not_safetensors_private_one(tmp_path,
                                                                                 umask):
  # safetensors writes a 0600 temporary file and renames it: the export's config.json
  # was 0644 beside a 0600 model.safetensors.
  previous = os.umask(umask)
  try:
    save_safetensors({"w": np.zeros((2, 3), np.float32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
  finally:
    os.umask(previous)
  modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
  assert modes == {"model.safetensors": 0o666 & ~umask, "config.json": 0o666 & ~umask}
