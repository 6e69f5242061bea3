"""A tiny MoE for tests and smoke runs: seconds on one CPU core.

d=32, 2 layers, 4 experts top-2 with the aux-loss-free bias, on the first 12
files of the standard library. ``python -m experiments.train
--config=configs/tiny.py --workdir=/tmp/tiny``.
"""

from moejax.train.config import experiment_config_dict


def get_config():
  return experiment_config_dict(
      model=dict(
          d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dense_ff_width=64,
          moe=dict(topology=dict(num_experts=4, expert_width=32),
                   routing=dict(kind="topk", top_k=2, score_fn="sigmoid", gating="normalized",
                                use_bias=True),
                   balance=dict(bias_update="sign", bias_rate=1e-3, aux_loss_coef=1e-3,
                                aux_loss_scope="sequence", z_loss_coef=1e-3),
                   # Pinned to the oracle it always ran with (the default was 'reference'
                   # before 'auto'): the tests' recorded runs and docs/training.md's tiny
                   # numbers keep their values; at E=4 the oracle costs little.
                   execution=dict(backend="reference"))),
      data=dict(name="python_stdlib", seq_len=32, batch_size=8, stdlib_max_files=12,
                stdlib_val_fraction=0.3),
      train=dict(steps=40, learning_rate=1e-2, warmup_steps=4, log_every=5, eval_every=20,
                 eval_batches=4, checkpoint_every=10, keep_checkpoints=2),
  )
