"""The balancing zoo at equal budget: aux loss, loss-free bias, S-BASE and ReMoE.

Four ways to keep experts balanced on the small suite model (moejax.ablation.bases:
d=64, 2 MoE layers of 8 experts, 2 per token, softmax scores), 300 steps x
16 x 64 tokens, 3 seeds:

- ``aux``: top-2 with the Switch/GShard batch balance loss, alpha = 1e-2 (baseline);
- ``lossfree``: top-2 with the aux-loss-free sign bias (Wang et al. 2408.15664),
  u = 1e-2, no balance loss;
- ``sbase``: S-BASE (Clark et al. 2202.01169): Sinkhorn-balanced top-2 in
  training, greedy top-2 in evaluation, no balance loss;
- ``remoe``: ReMoE (Wang, Zhu and Chen 2412.14711): ReLU gates with the adaptive
  L1 penalty steering to 2 active experts per token.

Every arm declares 2 experts per token, so the budget check holds them equal; ReMoE's
realised count varies per token, and the run's realised-budget table and the
summary compare the arms on what they computed (docs/ablations.md, The budget of
what ran). Size: 4 arms x 3 seeds x about 2 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/balancing.py --workdir=/tmp/abl/balancing
"""

from moejax.ablation.bases import small_experiment, suite_config


def _moe(kind="topk", aux=0.0, bias=False, extra=()):
  return dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
              routing=dict(kind=kind, top_k=2, score_fn="softmax", gating="normalized",
                           use_bias=bias),
              balance=dict(aux_loss_coef=aux, aux_loss_scope="batch",
                           bias_update="sign" if bias else "none", bias_rate=1e-2,
                           extra_losses=list(extra)))


def get_config():
  return suite_config(
      name="balancing",
      description=__doc__,
      base=small_experiment(_moe(aux=1e-2)),
      arms={
          "aux": dict(model=dict(moe=_moe(aux=1e-2))),
          "lossfree": dict(model=dict(moe=_moe(bias=True))),
          "sbase": dict(model=dict(moe=_moe(kind="sbase"))),
          "remoe": dict(model=dict(moe=_moe(kind="remoe", extra=[("remoe_l1", 1.0)]))),
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="aux",
      analysis=dict(comm_devices=8),
  )
