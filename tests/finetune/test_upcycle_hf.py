"""Upcycling a Hugging Face dense decoder: a tiny random Mistral imports with its own logits, its
upcycled MoE (split 1, renormalised) reproduces them, and exports as a Mixtral that
transformers runs with the same logits. Qwen2 / Qwen3 dense are refused in one line."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # pylint: disable=g-import-not-at-top

from moejax.config import ConfigError, to_dict  # pylint: disable=g-import-not-at-top
from moejax.finetune import export as export_lib  # pylint: disable=g-import-not-at-top
from moejax.finetune import source as source_lib  # pylint: disable=g-import-not-at-top
from moejax.interop import InteropError  # pylint: disable=g-import-not-at-top
from moejax.interop import dense as hf_dense  # pylint: disable=g-import-not-at-top
from moejax.model import Transformer  # pylint: disable=g-import-not-at-top
from moejax.train import step as step_lib  # pylint: disable=g-import-not-at-top
from moejax.train.config import experiment_from_dict  # pylint: disable=g-import-not-at-top
from moejax.train.optim import make_optimizer  # pylint: disable=g-import-not-at-top

IDS = np.random.default_rng(0).integers(0, 256, (2, 16))
_MOE = {"topology": {"num_experts": 4, "expert_width": 32, "activation": "swiglu"},
        "routing": {"kind": "topk", "top_k": 2, "score_fn": "softmax", "gating": "topk_softmax"},
        "execution": {"backend": "reference"}}


def _logits(model, ids=IDS) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(ids)).logits.numpy()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
  torch.manual_seed(0)
  cfg = transformers.MistralConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   sliding_window=None, initializer_range=0.1)
  model = transformers.MistralForCausalLM(cfg).eval()
  path = tmp_path_factory.mktemp("hf") / "tiny_mistral"
  model.save_pretrained(str(path))
  return model, str(path)


def test_a_dense_mistral_imports_with_its_logits(mistral):
  model, path = mistral
  imported = hf_dense.import_dense_model(path)
  assert imported.cfg.moe is None and imported.cfg.dense_ff_width == 32
  ours = Transformer(imported.cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(ours, nnx.Param, ...)
  nnx.replace_by_pure_dict(params, imported.params)
  got, _ = nnx.merge(graphdef, params, rest)(np.asarray(IDS, np.int32))
  np.testing.assert_allclose(np.asarray(got), _logits(model), atol=1e-4)


def test_a_base_with_mla_and_mtp_still_imports_the_dense_model_as_it_is(mistral):
  """The base supplies what the checkpoint does not say (dtype, norms' defaults); the
  checkpoint's attention (q / k / v / o: multi-head) and its lack of MTP modules win."""
  from moejax.config.model import ModelConfig  # pylint: disable=g-import-not-at-top
  _, path = mistral
  base = ModelConfig(attention="mla", mtp_depth=1)
  cfg = hf_dense.import_dense_model(path, base=base).cfg
  assert cfg.attention == "mha" and cfg.mtp_depth == 0
  assert cfg.attention_options == ModelConfig().attention_options


def test_the_upcycled_mistral_keeps_its_logits_and_exports_as_mixtral(mistral, tmp_path):
  model, path = mistral
  tree = {"model": {"moe": _MOE}, "finetune": {"source": path, "source_format": "upcycle"},
          "data": {"name": "python_stdlib", "seq_len": 16, "batch_size": 2},
          "train": {"steps": 2, "warmup_steps": 1, "progress": False}}
  tree["model"] = to_dict(source_lib.source_model(path, "upcycle", tree))
  cfg = experiment_from_dict(tree)
  tx = make_optimizer(cfg.train, cfg.model, cfg.finetune)
  graphdef, state = step_lib.init_state(cfg, tx)
  state = source_lib.open_source(cfg).apply(state, tx)
  got, _ = nnx.merge(graphdef, state.params, state.router_state, state.other)(
      np.asarray(IDS, np.int32))
  want = _logits(model)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
  written = export_lib.export_params(state.params, state.router_state, cfg.model,
                                     str(tmp_path / "mixtral"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(written["weights"])).eval()
  assert type(hf).__name__ == "MixtralForCausalLM"
  np.testing.assert_allclose(_logits(hf), want, atol=1e-4)


@pytest.mark.parametrize("model_type, lacks", [("qwen2", "q/k/v biases"),
                                               ("qwen3", "q_norm / k_norm")])
def test_qwen_dense_models_are_refused_in_one_line(model_type, lacks):
  with pytest.raises(InteropError, match=f"model_type='{model_type}'.*lacks .*{lacks}"):
    hf_dense.model_config_from_hf_dense({"model_type": model_type})


def test_an_hf_moe_is_no_upcycling_source(tmp_path):
  (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
  with pytest.raises(ConfigError, match="does not convert: model_type='mixtral' is not a dense "
                     "decoder moejax reads"):
    source_lib.source_model(str(tmp_path), "upcycle", {})
