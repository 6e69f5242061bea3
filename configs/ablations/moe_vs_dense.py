"""MoE vs dense at equal compute: how much sooner does a sparse model reach dense quality?

Switch Transformer (Fedus et al. 2101.03961): at equal FLOPs per token, a
many-expert MoE reaches the dense model's quality several times sooner: "up
to 7x increases in pre-training speed with the same computational
resources" from T5-Base / T5-Large (Switch-Base with 64 experts against
T5-Base), and a 4x speed-up of Switch-XXL over T5-XXL.

Arms, on the small suite model (d=64, 2 layers, both FFN slots MoE):
``dense`` (SwiGLU of width 256: the MoEs' active FFN width); MoEs with 8 /
16 / 64 experts at the same active parameters and FLOPs per token, top-1
(``e<E>_top1``: experts of width 256, Switch's top-1 with gates = the
router's softmax scores) and top-2 (``e<E>_top2``: width 128, GShard's
normalised top-2 gates); and ``dense_total``, a dense model with the total
parameters of ``e8_top2`` (``model.dense_twin='total'``, width ~1024): the
equal-memory bound, which spends 4x the dense FFN FLOPs (2.8x the model's
FLOPs per token).

Held equal: active parameters and forward FLOPs per token within 6% (the
router's d x E weights grow with E: 64 experts add 4.1k parameters and
8.2k FLOPs per token and layer), tokens and optimizer, exactly.
``dense_total`` is exempt from active / FLOPs (it is the other bound, by
construction).

Reported (``analysis.speedup_reference='dense'``, moejax.ablation.speedup):
per arm the steps and the training time to reach the dense model's final
validation loss (interpolated on the validation curve: every evaluation
reads the whole split, ``train.eval_batches=None``, every 30 steps), the
speed-up in steps and in time with 95% intervals over seeds (paired by
seed), the validation loss at equal steps, and tokens/s measured in the
same suite run. On CPU the grouped matmul of 64 experts is slower per
token than one dense matmul, so the time speed-up is below the step one.
Size: 8 arms x 3 seeds x 300 steps x 16 x 64 tokens; the e64 arms and
dense_total are the slowest; about an hour on 2 CPU cores. At
``--config.scale=m``: 169 min of CPU, 87 min wall as three one-seed
processes side by side (docs/ablations.md, Seeds in parallel).

  python -m experiments.ablate --config=configs/ablations/moe_vs_dense.py --workdir=/tmp/abl/moe_vs_dense
"""

from moejax.ablation.bases import small_experiment, small_moe, suite_config

STEPS = 300


def _moe(experts, top_k):
  width = 256 // top_k
  gating = "scores" if top_k == 1 else "normalized"   # Switch top-1 / GShard top-2
  return dict(model=dict(moe=dict(topology=dict(num_experts=experts, expert_width=width),
                                   routing=dict(top_k=top_k, gating=gating))))


def get_config():
  base = small_experiment(small_moe(), steps=STEPS)
  # Every evaluation on the whole validation split: the curve the crossing is read from.
  base["train"].update(eval_every=STEPS // 10, eval_batches=None)
  arms = {"dense": dict(model=dict(dense_twin="active"))}
  for k in (1, 2):
    for e in (8, 16, 64):
      arms[f"e{e}_top{k}"] = _moe(e, k)
  arms["dense_total"] = dict(model=dict(dense_twin="total"))   # of the base: e8_top2
  return suite_config(
      name="moe_vs_dense",
      description=__doc__,
      base=base,
      arms=arms,
      fixed=dict(active=0.06, flops_per_token=0.06, tokens=0.0, optimizer=0.0),
      exempt=dict(dense_total=("active", "flops_per_token")),
      seeds=(0, 1, 2),
      reproduction=True,
      effects=dict(val_loss=dict(
          size=0.02, source="the smallest difference that matters here (about 2% in "
          "perplexity); Switch reports speed-ups in steps, not a loss gap at equal steps")),
      baseline="dense",
      analysis=dict(speedup_reference="dense", comm_devices=8, latency=False),
  )
