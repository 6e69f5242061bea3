"""The modern recipe at equal budget: AdamW vs Muon, the loss-free bias under Muon, MTP.

The questions a reader of DeepSeek-V3's, MaxText's or Megatron's recipes asks
before adopting them, on the small suite model (moejax.ablation.bases: d=64,
2 MoE layers of 8 experts top-2, sigmoid scores, 300 steps x 16 x 64
tokens), every arm at the same training compute:

- **AdamW vs Muon** for the same MoE (``muon_lossfree`` against the baseline
  ``adamw_lossfree``). Muon (Jordan et al. 2024) orthogonalises the update of
  each hidden matrix, here of each expert on its own; with Liu et al.'s
  update-RMS matching (arXiv 2502.16982, "Muon is scalable") it runs at
  AdamW's learning rate and schedule, and they report about 2x the
  compute-efficiency of AdamW on their MoE models.
- **Each optimizer at its own learning rate.** One learning rate can favour
  one optimizer, so both loss-free arms also run at 1e-3, 1e-2 and 3e-2
  around the base rate 3e-3 (``adamw_lossfree_lr1e-3`` ... ``_lr3e-2``,
  ``muon_lossfree_lr1e-3`` ...). An AdamW arm is compared with the baseline
  (the rate's effect), a Muon arm with the AdamW arm at its rate (the
  optimizer's effect at that rate); the best rate of each is the fair
  comparison.
- **Does the loss-free bias keep its balance advantage under Muon?** Wang et
  al. (arXiv 2408.15664, Table 2) measured it under AdamW: MaxVio_global
  0.72 with an auxiliary loss, 0.04 loss-free. ``adamw_aux`` is compared
  with ``adamw_lossfree`` and ``muon_aux`` with ``muon_lossfree``. The
  bias moves by the sign controller at u=1e-2 (the lossfree suite's reach
  for a short run); the aux arms use alpha=1e-2 and no bias.
- **MTP on vs off** (DeepSeek-V3, arXiv 2412.19437 Sec. 2.2 and Table 4: one
  module of depth 1 improves most benchmarks): ``muon_lossfree_mtp`` has one
  MTP module (loss weight 0.3) and is compared with ``muon_lossfree``. Its
  module's FLOPs are paid by fewer training tokens
  (``suite.match_compute``): compute is what is held equal, and the
  validation loss is the main next-token loss only.

Held equal: training compute within 1% (FLOPs per token x tokens), and,
except for the MTP arm (which spends more FLOPs per token on fewer tokens and
has its module's parameters, dropped at inference), total and active
parameters, FLOPs per token and tokens exactly. The optimizer is the axis.
Size: 11 arms x 3 seeds x ~2 min on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/recipe.py --workdir=/tmp/abl/recipe
"""

from moejax.ablation.bases import small_experiment, suite_config

_ROUTER = dict(kind="topk", top_k=2, score_fn="sigmoid", gating="normalized", use_bias=False)
_MTP = "muon_lossfree_mtp"
_LR = 3e-3  # moejax.ablation.bases' rate
_SWEEP = (("1e-3", 1e-3), ("1e-2", 1e-2), ("3e-2", 3e-2))


def _moe(lossfree):
  return dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
              routing=dict(_ROUTER, use_bias=lossfree),
              balance=dict(aux_loss_coef=0.0 if lossfree else 1e-2, aux_loss_scope="batch",
                           bias_update="sign" if lossfree else "none", bias_rate=1e-2))


def _arm(optimizer, lossfree, mtp_depth=0, learning_rate=_LR):
  return dict(model=dict(moe=_moe(lossfree), mtp_depth=mtp_depth),
              train=dict(optimizer=optimizer, learning_rate=learning_rate))


def get_config():
  return suite_config(
      name="recipe",
      description=__doc__,
      base=small_experiment(_moe(True)),
      arms={
          "adamw_lossfree": _arm("adamw", True),
          "adamw_aux": _arm("adamw", False),
          "muon_lossfree": _arm("muon", True),
          "muon_aux": _arm("muon", False),
          _MTP: _arm("muon", True, mtp_depth=1),
          **{f"{opt}_lossfree_lr{name}": _arm(opt, True, learning_rate=lr)
             for opt in ("adamw", "muon") for name, lr in _SWEEP},
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, compute=0.01),
      exempt={_MTP: ("total", "flops_per_token", "tokens")},
      match_compute={_MTP: "muon_lossfree"},
      baseline="adamw_lossfree",
      compare_to={"muon_aux": "muon_lossfree", _MTP: "muon_lossfree",
                  **{f"muon_lossfree_lr{n}": f"adamw_lossfree_lr{n}" for n, _ in _SWEEP}},
      seeds=(0, 1, 2),
      reproduction=True,
      effects=dict(
          val_loss=dict(size=0.02, source="the smallest difference that matters here (about 2% "
                        "in perplexity); Liu et al. 2502.16982 report Muon's gain as compute "
                        "efficiency, DeepSeek-V3 Table 4 MTP's as benchmark scores"),
          max_vio_global=dict(size=0.68, source="Wang et al. 2408.15664, Table 2 (1B): "
                              "MaxVio_global 0.72 with the aux loss, 0.04 loss-free")),
      analysis=dict(comm_devices=8),
  )
