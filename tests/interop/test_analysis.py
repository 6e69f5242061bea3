"""Routing analysis: hand-computed load / MaxVio / co-activation / trace, plots,
and text through a tiny HF model (with the experiments.analyze_routing CLI)."""

import csv
import json
import math

import numpy as np
import pytest

from moejax.config import MoEConfig, RoutingConfig
from moejax.interop import analysis
from moejax.layer import init_router_state
from moejax.topology import experts as experts_lib
from tests.configs import moe_config


def _hand_layer():
  """d = E = 4, top-2 Mixtral gating, router w = 4 I: token x picks its 2 largest coords."""
  cfg = moe_config(num_experts=4, expert_width=2,
                  routing=RoutingConfig(top_k=2, gating="topk_softmax"))
  rng = np.random.default_rng(0)
  experts = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("w_gate", (4, 4, 2)), ("w_up", (4, 4, 2)), ("w_down", (4, 2, 4)))}
  params = {"router": {"w": 4.0 * np.eye(4, dtype=np.float32)},
            "experts": experts_lib.fused_layout(experts)}
  return params, init_router_state(cfg), cfg


TOKENS = np.array([[1, .5, 0, 0],    # experts {0, 1}
                   [1, .6, 0, 0],    # {0, 1}
                   [0, 0, 1, .5],    # {2, 3}
                   [1, 0, .5, 0]],   # {0, 2}
                  np.float32)


def test_hand_computed_load_maxvio_coactivation_and_trace(tmp_path):
  lr = analysis.analyze_layer(_hand_layer(), TOKENS, name="layer 7", token_ids=[5, 6, 7, 8])
  np.testing.assert_array_equal(np.sort(lr.expert_ids, -1), [[0, 1], [0, 1], [2, 3], [0, 2]])
  np.testing.assert_array_equal(lr.load, [3, 2, 2, 1])
  assert lr.max_vio == pytest.approx(0.5)  # (3 - 2) / 2
  p = np.array([3, 2, 2, 1]) / 8
  assert lr.load_entropy == pytest.approx(-(p * np.log(p)).sum() / math.log(4), rel=1e-6)
  want_c = np.diag([3.0, 2, 2, 1])
  for i, j, n in ((0, 1, 2), (2, 3, 1), (0, 2, 1)):
    want_c[i, j] = want_c[j, i] = n
  np.testing.assert_array_equal(lr.coactivation, want_c)
  # Gates: softmax over the two chosen logits, 4 and 2 for token 0.
  e2 = math.exp(2.0)
  np.testing.assert_allclose(lr.weights[0], [e2 / (1 + e2), 1 / (1 + e2)], rtol=1e-6)

  rows = analysis.trace_rows([lr], ["a", "b", "c", "d"])
  assert rows[2] == {"layer": "layer 7", "position": 2, "token_id": 7, "token": "c",
                     "experts": "2 3", "weights": f"{lr.weights[2, 0]:.6f} {lr.weights[2, 1]:.6f}"}
  analysis.write_trace_csv(tmp_path / "t.csv", [lr, lr])
  with open(tmp_path / "t.csv") as f:
    assert len(list(csv.DictReader(f))) == 8
  summary = json.loads(json.dumps(lr.summary()))
  assert summary["load"] == [3, 2, 2, 1] and summary["top_k"] == 2

  # MaxVio_global sums the loads of batches: [3,2,2,1] + [4,0,4,0], mean 4, max 7.
  other = analysis.analyze_layer(_hand_layer(), np.repeat(TOKENS[3:], 4, 0))
  assert analysis.global_max_vio([lr, other]) == pytest.approx(0.75)
  with pytest.raises(ValueError, match="3 token ids for 4 tokens"):
    analysis.analyze_layer(_hand_layer(), TOKENS, token_ids=[1, 2, 3])
  with pytest.raises(ValueError, match=r"no input hidden states for layers \[1\]"):
    analysis.analyze_layers({0: _hand_layer(), 1: _hand_layer()}, {0: TOKENS})


def test_plots_write_pngs(tmp_path):
  pytest.importorskip("matplotlib")
  from moejax.interop import plots

  lr = analysis.analyze_layer(_hand_layer(), TOKENS, name="layer 7")
  fig = plots.plot_load(lr, tmp_path / "load.png")
  assert len(fig.axes[0].patches) == 4
  assert [p.get_height() for p in fig.axes[0].patches] == [3, 2, 2, 1]
  fig = plots.plot_coactivation(lr, tmp_path / "co.png")
  img = fig.axes[0].images[0].get_array()
  assert img[0, 1] == pytest.approx(2 / 3) and img[1, 0] == pytest.approx(1.0)
  assert np.ma.is_masked(img[0, 0]) or np.isnan(img[0, 0])
  for name in ("load.png", "co.png"):
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_text_through_tiny_model_and_hidden_states_mode(tmp_path, capsys):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  pytest.importorskip("matplotlib")
  from experiments import analyze_routing
  from moejax.interop import hf_models

  text = "for i in range(10):\n    print(i)  # 48 tokens!!\n"
  assert len(text.encode()) == 48
  summary = analyze_routing.run(str(tmp_path / "text"), model_type="qwen3_moe", text=text)
  random_model = ("a tiny qwen3_moe model, randomly initialised (seed 0) and untrained: its "
                  "routing reflects the random weights, not learned specialisation (pass "
                  "--checkpoint=DIR to analyse a trained model)")
  printed = capsys.readouterr().out.splitlines()
  assert printed[:2] == ["model: a tiny qwen3_moe model, randomly initialised (seed 0) and "
                         "untrained: its routing reflects the",
                         "  random weights, not learned specialisation (pass --checkpoint=DIR "
                         "to analyse a trained model)"]
  assert summary["model"] == random_model
  assert [e["name"] for e in summary["layers"]] == ["layer 0", "layer 1"]
  for entry in summary["layers"]:
    assert entry["tokens"] == 48 and sum(entry["load"]) == 48 * 2
    assert entry["max_abs_error_vs_hf"] < 1e-5
  out = tmp_path / "text"
  for name in ("summary.json", "trace.csv", "load_layer0.png", "coactivation_layer1.png"):
    assert (out / name).exists(), name
  with open(out / "trace.csv") as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 2 * 48 and rows[0]["token"] == "f" and rows[0]["token_id"] == str(ord("f"))

  # Hidden-states mode: a saved checkpoint and the captured layer-1 input.
  model = hf_models.tiny_model("qwen3_moe", seed=0, init_std=0.2, bias_std=0.1)
  model.save_pretrained(tmp_path / "ckpt")
  x, _ = hf_models.capture_moe_io(model, hf_models.text_to_ids(text, 256), [1])[1]
  hs = analyze_routing.run(str(tmp_path / "hs"), checkpoint=str(tmp_path / "ckpt"),
                           hidden_states=x, layers=[1])
  assert hs["layers"][0]["load"] == summary["layers"][1]["load"]
  assert hs["model"] == f"the checkpoint in {tmp_path / 'ckpt'}"
