"""Reproduction: Switch top-1 capacity factor 1.0 / 1.25 / 2.0, with and without the aux loss.

Switch Transformer (Fedus et al. 2101.03961): capacity C = ceil(cf T / E);
overflow tokens skip the layer on the residual. With the aux loss (alpha
1e-2) fewer than 1% of tokens are dropped at cf 1.25; a larger cf drops less
and costs memory and padding; without the aux loss the router collapses onto
few experts and drops many tokens.

Arms on the small suite model with a Switch layer (d=64, 2 MoE layers of 8
experts of width 256, top-1, softmax, gate = the chosen probability, float32
router), 300 steps x 16 x 64 tokens: ``cf1``, ``cf1p25``, ``cf2`` each
``_aux`` (alpha 1e-2, batch scope) and ``_noaux``. Every arm has the same
total and active parameters (capacity changes only which tokens are dropped).
Size: 6 arms x 3 seeds, about 25-30 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/capacity.py --workdir=/tmp/abl/capacity
"""

from moejax.ablation.bases import small_experiment, suite_config


def _moe(cf, aux):
  return dict(topology=dict(num_experts=8, expert_width=256), execution=dict(backend="blocked"),
              routing=dict(kind="topk", top_k=1, score_fn="softmax", gating="scores"),
              balance=dict(capacity_factor=cf, aux_loss_coef=aux, aux_loss_scope="batch",
                           aux_loss_convention="switch"))


def get_config():
  arms = {}
  for cf in (1.0, 1.25, 2.0):
    for aux in (1e-2, 0.0):
      arms[f"cf{cf:g}".replace(".", "p") + f"_{'aux' if aux else 'noaux'}"] = dict(model=dict(moe=_moe(cf, aux)))
  return suite_config(
      name="capacity",
      description=__doc__,
      base=small_experiment(_moe(1.25, 1e-2)),
      arms=arms,
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="cf1p25_aux",  # Switch's recommended setting
      reproduction=True,
      effects=dict(
          drop_rate=dict(size=0.01, source="Fedus et al. 2101.03961, Sec. 2.2: with the aux "
                         "loss fewer than 1% of tokens are dropped at capacity factor 1.25"),
          val_loss=dict(size=0.01, source="the smallest difference that matters here: 1% in "
                        "perplexity (ln 1.01 nats per token)")),
      analysis=dict(comm_devices=8),
  )
