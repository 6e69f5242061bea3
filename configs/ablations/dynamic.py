"""Survey suite 4: dynamic computation at equal *expected* active parameters.

Arms on the small suite model (d=64, 2 MoE layers, 8 FFN experts of width
128, softmax scores, batch aux loss 1e-2), 300 steps x 16 x 64 tokens:

- ``topk``: fixed top-2 (2 FFN experts per token);
- ``top_p``: top-p routing (Huang et al. 2403.07652), p = 0.4, at most 4
  experts; the expected count depends on how peaked the router becomes, so
  the suite reports the realised mean and variance of active experts
  (``active experts mean/var``) rather than assuming 2;
- ``zero_compute``: 8 FFN + 8 zero-computation experts (4 zero, 2 copy, 2
  constant; MoE++ 2410.07348), top-4: under balanced routing 4 x 8/16 = 2 FFN
  experts per token, the same expected active parameters as ``topk``.

Held fixed: training tokens and optimizer exactly, total parameters within 2%
(constant experts add 3d parameters each). Active parameters are not held
fixed by the checker, because the accounting counts top-p at its maximum k
(4 experts, ``active`` column) - the equality this suite targets is in
expectation, and the realised numbers are in the table.
Size: 3 arms, about 5 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/dynamic.py --workdir=/tmp/abl/dynamic
"""

from moejax.ablation.bases import small_experiment, suite_config


def _moe(kind="topk", top_k=2, top_p=0.5, zero=0, copy=0, const=0):
  return dict(topology=dict(num_experts=8, expert_width=128, zero_experts=zero,
                            copy_experts=copy, constant_experts=const),
              execution=dict(backend="blocked"),
              routing=dict(kind=kind, top_k=top_k, score_fn="softmax", gating="normalized",
                           **(dict(options=dict(top_p=top_p)) if kind == "top_p" else {})),
              balance=dict(aux_loss_coef=1e-2, aux_loss_scope="batch"))


def get_config():
  return suite_config(
      name="dynamic",
      description=__doc__,
      base=small_experiment(_moe()),
      arms={
          "topk": dict(model=dict(moe=_moe())),
          "top_p": dict(model=dict(moe=_moe("top_p", top_k=4, top_p=0.4))),
          "zero_compute": dict(model=dict(moe=_moe(top_k=4, zero=4, copy=2, const=2))),
      },
      fixed=dict(total=0.02, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="topk",  # fixed top-k
      analysis=dict(comm_devices=8),
  )
