"""Survey suite 2: balancing scope (sequence-wise vs global-batch loss vs aux-loss-free, plus none).

Qwen (Qiu et al. 2501.11873): a balance loss computed per micro-batch forces
near per-sequence balance and hurts; all-reducing the expert frequencies over
the global batch lowers perplexity (8.167 -> 8.038 avg PPL at 3.4B/0.6B,
120B tokens) and gives visible domain specialisation. DeepSeek-V3 / Wang et
al.: the bias controller balances with no loss gradient at all.

Arms on the small suite model (moejax.ablation.bases: d=64, 2 MoE layers of 8
experts top-2, softmax scores), 300 steps x 16 x 64 tokens:
``none`` (no balancing), ``sequence`` (loss per sequence, alpha 1e-2),
``global`` (loss over the whole step batch of 16 sequences, alpha 1e-2: on one
device ``global`` and ``batch`` scope are the same statistic; with data
parallelism it is all-reduced over the data axis), ``lossfree`` (sign bias,
u=1e-3, sigmoid-free: the bias acts on the same softmax scores).
Size: 4 arms, about 5-8 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/balance_scope.py --workdir=/tmp/abl/balance_scope
"""

from moejax.ablation.bases import small_experiment, suite_config

_ROUTER = dict(kind="topk", top_k=2, score_fn="softmax", gating="normalized")


def _moe(aux=0.0, scope="batch", bias=False):
  return dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
              routing=dict(_ROUTER, use_bias=bias),
              balance=dict(aux_loss_coef=aux, aux_loss_scope=scope,
                           bias_update="sign" if bias else "none", bias_rate=1e-3))


def get_config():
  return suite_config(
      name="balance_scope",
      description=__doc__,
      base=small_experiment(_moe()),
      arms={
          "none": dict(model=dict(moe=_moe())),
          "sequence": dict(model=dict(moe=_moe(1e-2, "sequence"))),
          "global": dict(model=dict(moe=_moe(1e-2, "global"))),
          "lossfree": dict(model=dict(moe=_moe(bias=True))),
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="sequence",  # the micro-batch (sequence) loss Qwen improve on
      analysis=dict(comm_devices=8),
  )
