"""Fine-tuning from a Hugging Face model and back: the import reproduces the HF logits before the
first step; merged and separate LoRA exports load into transformers with the same logits."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # pylint: disable=g-import-not-at-top

from moejax.config import ConfigError, to_dict  # pylint: disable=g-import-not-at-top
from moejax.finetune import export as export_lib  # pylint: disable=g-import-not-at-top
from moejax.finetune import source as source_lib  # pylint: disable=g-import-not-at-top
from moejax.interop import hf_models, load_hf_config  # pylint: disable=g-import-not-at-top
from moejax.interop import models as hf_whole  # pylint: disable=g-import-not-at-top
from moejax.interop.tensors import open_source  # pylint: disable=g-import-not-at-top
from moejax.train import step as step_lib  # pylint: disable=g-import-not-at-top
from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
from moejax.train.optim import make_optimizer  # pylint: disable=g-import-not-at-top

IDS = np.random.default_rng(0).integers(0, 256, (2, 24))


def _save(model, path) -> str:
  model.save_pretrained(str(path))
  return str(path)


def _hf_logits(model, ids=IDS) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(ids)).logits.numpy()


def _experiment(source, data_dir, **finetune):
  model = hf_whole.model_config_from_hf(load_hf_config(source))
  return experiment_from_dict({
      "model": to_dict(model),
      "data": {"name": "python_stdlib", "seq_len": 24, "batch_size": 2, "stdlib_max_files": 12,
               "stdlib_val_fraction": 0.3, "data_dir": data_dir},
      "train": {"steps": 4, "warmup_steps": 1, "log_every": 2, "progress": False},
      "finetune": {"source": source, "source_format": "hf", **finetune}})


def _initial(cfg):
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, state = step_lib.init_state(cfg, tx)
  state = source_lib.open_source(cfg).apply(state, tx)
  return graphdef, state


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
  model = hf_models.tiny_model("mixtral", init_std=0.1)
  return model, _save(model, tmp_path_factory.mktemp("hf") / "tiny_mixtral")


@pytest.mark.parametrize("lora", [
    pytest.param((), marks=pytest.mark.slow),  # zero adapters: the same import, checked by the other
    ("attention", "experts"),
])
def test_init_from_a_tiny_hf_mixtral_reproduces_its_logits(mixtral_dir, ft_data_dir, lora):
  model, path = mixtral_dir
  cfg = _experiment(path, ft_data_dir, lora=lora, lora_rank=2 if lora else 0)
  assert cfg.model.norm_eps == model.config.rms_norm_eps and cfg.model.n_kv_heads == 2
  graphdef, state = _initial(cfg)
  got, _ = nnx.merge(graphdef, state.params, state.router_state, state.other)(IDS)
  np.testing.assert_allclose(np.asarray(got), _hf_logits(model), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", [
    # Both slow (~9 s each): tests/interop/test_whole_models.py checks both imports by default.
    pytest.param("qwen3_moe", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_init_from_a_tiny_hf_qwen3_moe_or_deepseek_v3_reproduces_its_logits(
    tmp_path, ft_data_dir, model_type):
  """The whole-model families beyond Mixtral as fine-tuning sources (LoRA on their own
  attention projections: Qwen3's q / k / v / o, DeepSeek-V3's latent projections)."""
  model = hf_models.tiny_model(model_type, init_std=0.1, bias_std=0.1)
  cfg = _experiment(_save(model, tmp_path / model_type), ft_data_dir,
                    lora=("attention", "experts"), lora_rank=2)
  graphdef, state = _initial(cfg)
  got, _ = nnx.merge(graphdef, state.params, state.router_state, state.other)(IDS)
  np.testing.assert_allclose(np.asarray(got), _hf_logits(model), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # an edge of the import the default run's Mixtral does not have
def test_a_tied_head_imports_as_an_untied_copy(tmp_path, ft_data_dir):
  model = hf_models.tiny_model("mixtral", init_std=0.1, tie_word_embeddings=True)
  path = _save(model, tmp_path / "tied")
  graphdef, state = _initial(_experiment(path, ft_data_dir))
  got, _ = nnx.merge(graphdef, state.params, state.router_state, state.other)(IDS)
  np.testing.assert_allclose(np.asarray(got), _hf_logits(model), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type, missing", [
    ("qwen2_moe", r"q/k/v biases but no output-projection bias"),
])
def test_families_the_transformer_cannot_express_are_one_line_errors(tmp_path, model_type,
                                                                     missing):
  path = _save(hf_models.tiny_model(model_type), tmp_path / model_type)
  with pytest.raises(ConfigError, match=rf"^finetune\.source='.*': does not convert: "
                                        rf"model_type='{model_type}': .*lacks .*{missing}") as e:
    source_lib.source_model(path, "hf")
  assert "\n" not in str(e.value)


def _adapted(cfg):
  """The imported model's state with random (non-zero) adapters."""
  graphdef, state = _initial(cfg)
  rng = np.random.default_rng(1)

  def fill(tree):
    if isinstance(tree, dict):
      return {k: (rng.normal(0, 0.3, np.shape(v)).astype(np.float32)
                  if k in ("b", "lora_b") else fill(v)) for k, v in tree.items()}
    return tree
  params = fill(state.params)
  logits, _ = nnx.merge(graphdef, params, state.router_state, state.other)(IDS)
  return params, state.router_state, np.asarray(logits)


def test_lora_export_merged_and_separate_load_into_transformers(mixtral_dir, ft_data_dir,
                                                                tmp_path):
  from transformers import AutoModelForCausalLM  # pylint: disable=g-import-not-at-top
  model, path = mixtral_dir
  cfg = _experiment(path, ft_data_dir, lora=("attention", "experts"), lora_rank=2,
                    lora_alpha=4.0)
  params, router_state, want = _adapted(cfg)
  merged = export_lib.export_params(params, router_state, cfg.model, str(tmp_path / "merged"),
                                    lora="merge", lora_rank=2, lora_alpha=4.0)
  hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(merged["weights"])).eval()
  np.testing.assert_allclose(_hf_logits(hf), want, rtol=1e-4, atol=1e-4)

  apart = export_lib.export_params(params, router_state, cfg.model, str(tmp_path / "apart"),
                                   lora="separate", lora_rank=2, lora_alpha=4.0)
  with open(apart["adapter_config"]) as f:
    adapter_cfg = json.load(f)
  assert adapter_cfg["r"] == 2 and adapter_cfg["lora_alpha"] == 4.0
  assert set(adapter_cfg["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                "w1", "w2", "w3"}
  # Base + scale * B @ A per adapted weight, in the released layout, equals the merged export.
  base, adapters = open_source(apart["weights"]), open_source(apart["adapters"])
  scale = 4.0 / 2
  merged_sd = open_source(merged["weights"])
  n = 0
  for key in adapters.keys():
    if not key.endswith("lora_A.weight"):
      continue
    name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
    w = base.get(name) + scale * adapters.get(key.replace("lora_A", "lora_B")) @ adapters.get(key)
    np.testing.assert_allclose(w, merged_sd.get(name), rtol=1e-5, atol=1e-6)
    n += 1
  assert n == 2 * 4 + 2 * 8 * 3   # 2 layers: 4 attention projections, 8 experts x 3 matrices


def test_separate_adapters_on_latent_attention_are_a_one_line_error():
  """MLA's kv_a / kv_b have no PEFT names (and DeepSeek-V3 interleaves their rotary rows)."""
  from moejax.interop.errors import InteropError  # pylint: disable=g-import-not-at-top
  lora = {"lora": {"lora_a": np.zeros((8, 2)), "lora_b": np.zeros((2, 4))}}
  with pytest.raises(InteropError, match=r"^lora='separate': layer 0's attention adapter on "
                                         r"'kv_a' has no PEFT name in deepseek_v3") as e:
    export_lib.peft_adapters({"blocks": {0: {"attn": {"kv_a": lora}}}}, "deepseek_v3")
  assert "\n" not in str(e.value)
