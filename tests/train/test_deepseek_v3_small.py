"""configs/deepseek_v3_small.py: the default model under DeepSeek-V3's recipe (MLA, the
loss-free bias, MTP, Muon) builds with the default's width, depth and active parameters,
and trains on the default corpus."""

from __future__ import annotations

import io

import pytest

from moejax.ablation import budget as budget_lib
from moejax.topology import accounting
from moejax.train import audit, loop
from tests.train import helpers


def test_the_config_is_the_default_model_with_the_recipe():
  cfg, default = helpers.experiment("deepseek_v3_small"), helpers.experiment("default")
  m, d = cfg.model, default.model
  assert (m.attention, cfg.train.optimizer, m.mtp_depth, m.mtp_ffn) == ("mla", "muon", 1, "moe")
  assert (m.d_model, m.n_layers, m.n_heads, m.moe) == (d.d_model, d.n_layers, d.n_heads, d.moe)
  assert m.moe.routing.use_bias and m.moe.balance.bias_update == "sign"
  assert (cfg.data, cfg.train.learning_rate) == (default.data, default.train.learning_rate)
  # Attention weights equal the default's; active adds only the 72-wide latent norm per layer.
  b, b_default = accounting.budget(m, 128), accounting.budget(d, 128)
  assert b.breakdown["attention"].total == b_default.breakdown["attention"].total
  assert b.active == b_default.active + 4 * 72
  assert b.breakdown["mtp"].total > 0 and b.flops_per_token > b_default.flops_per_token
  audit.audit(cfg)
  # The budget check names the optimizer that runs, with its options.
  assert budget_lib.optimizer_string(cfg).startswith("muon(momentum=0.95, nesterov=True, ")
  assert budget_lib.optimizer_string(default).startswith("adamw lr=0.003 ")


# ~20 s on 2 cores, most of it compiling; the default run covers its parts: tests/test_mtp.py
# trains with MTP, tests/test_mla.py decodes MLA, train/test_optimizers.py trains with Muon.
@pytest.mark.slow
def test_two_steps_train_on_the_default_corpus(data_dir, tmp_path):
  # A few files of the default corpus (python_stdlib), as configs/tiny.py reads it: the final
  # evaluation runs over the whole validation split.
  cfg = helpers.experiment("deepseek_v3_small", data_dir, data__batch_size=2, data__seq_len=32,
                           data__stdlib_max_files=12, data__stdlib_val_fraction=0.3,
                           train__steps=2, train__warmup_steps=1, train__log_every=1,
                           train__eval_every=0, train__checkpoint_every=0)
  out = io.StringIO()
  summary = loop.train(cfg, str(tmp_path / "run"), out=out)
  rows = helpers.rows_by_step(str(tmp_path / "run"), "train")
  assert sorted(rows) == [1, 2], out.getvalue()
  assert all(r["mtp/loss"] > 0 for r in rows.values()) and summary
