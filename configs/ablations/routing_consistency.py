"""Routing consistency of the shipped routers at equal budget: which router flips least?

An MoE routes on a discrete choice over continuous scores, so a numerical
change can send a token to other experts (docs/routing_replay.md). Seven
routers on the small suite model (moejax.ablation.bases: d=64, 2 MoE layers
of 8 experts, 2 per token), 300 steps x 16 x 64 tokens, 3 seeds:

- ``topk``: softmax top-2 with the batch balance loss, alpha = 1e-2 (baseline);
- ``lossfree``: sigmoid scores with the aux-loss-free sign bias (Wang et al.
  2408.15664), u = 1e-2, no balance loss;
- ``grouped``: softmax top-2 limited to the best 2 of 4 expert groups
  (group-limited routing), groups ranked by the sum of their two best
  scores (DeepSeek-V3's ``top2_sum``; ranked by their best score, V2's
  ``max``, a top-2 choice always lies in the best 2 groups and the limit
  never binds), alpha = 1e-2;
- ``expert_choice``: each expert picks its top tokens, capacity 2 (Zhou et al.
  2202.09368), no balance loss;
- ``sbase``: S-BASE (Clark et al. 2202.01169): Sinkhorn-balanced top-2 in
  training, greedy top-2 in evaluation (so every measurement here reads the
  greedy choice), no balance loss;
- ``remoe``: ReMoE (Wang, Zhu and Chen 2412.14711): ReLU gates with the
  adaptive L1 penalty steering to 2 active experts per token; its count varies
  per token, so a flip can add or drop an expert, not only swap one;
- ``hash``: experts fixed by the token id (Roller et al. 2106.04426): the
  control that cannot flip.

After training, each arm's final checkpoint is measured on the routing
sample's validation batches under bf16 compute, int8 and int4 experts, cached
decoding (n/a for expert choice), 4 micro-batches, the forward remat
recomputes, and the Hugging Face round trip (top-k only: Mixtral expresses no
other router). Then the layer under expert parallelism
over 1, 2 and 8 devices: the suite's process has one CPU device, so ep2 and
ep8 run in a child process on 8 simulated devices that restores the same
checkpoint (moejax.serve.consistency_child). Each becomes a ``flip rate
<perturbation>`` column with a verdict against top-k.

Then each arm's final weights are fine-tuned twice for 50 steps on the same
batches (moejax.ablation.replay_finetune): on the trainer's own routing, and
on the routing a bf16 forward of the current weights recorded for each
batch, replayed with weights recomputed by the float32 router (router
replay, "R3"), as a trainer replays an inference engine's rollouts. The
columns: the recordings' flip rate against the trainer's own routing (its
training-mode choice: for S-BASE the Sinkhorn assignment, so its rate also
counts where that differs from the greedy top-k an engine runs), and the
training and validation loss gaps, replayed minus own. Hash routing has no
router weights, hence the 3% tolerance on parameters. Size: 7 arms x 3 seeds of the small model; the
measurement adds one forward per perturbation over the first 4 validation
batches (decoding: one step per position).

  python -m experiments.ablate --config=configs/ablations/routing_consistency.py --workdir=/tmp/abl/routing_consistency
"""

from moejax.ablation.bases import small_experiment, suite_config

PERTURBATIONS = ("bf16", "int8", "int4", "decode", "microbatch4", "remat", "ep1", "ep2", "ep8",
                 "hf")
# An inference engine in bf16 against a float32 trainer, the common RL set-up.
REPLAY_FINETUNE = {"perturbation": "bf16", "steps": 50}


def _moe(kind="topk", score_fn="softmax", aux=1e-2, bias=False, options=None, extra=(),
         **routing):
  return dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
              routing=dict(kind=kind, top_k=2, score_fn=score_fn,
                           gating="scores" if kind == "expert_choice" else "normalized",
                           use_bias=bias, **({"options": options} if options else {}),
                           **routing),
              balance=dict(aux_loss_coef=aux, aux_loss_scope="batch",
                           bias_update="sign" if bias else "none", bias_rate=1e-2,
                           extra_losses=list(extra)))


def get_config():
  return suite_config(
      name="routing_consistency",
      description=__doc__,
      base=small_experiment(_moe()),
      arms={
          "topk": dict(model=dict(moe=_moe())),
          "lossfree": dict(model=dict(moe=_moe(score_fn="sigmoid", aux=0.0, bias=True))),
          "grouped": dict(model=dict(moe=_moe(n_groups=4, topk_groups=2,
                                              group_score="top2_sum"))),
          "expert_choice": dict(model=dict(moe=_moe("expert_choice", aux=0.0,
                                                    options=dict(capacity=2.0)))),
          "sbase": dict(model=dict(moe=_moe("sbase", aux=0.0))),
          "remoe": dict(model=dict(moe=_moe("remoe", aux=0.0, extra=[("remoe_l1", 1.0)]))),
          "hash": dict(model=dict(moe=_moe("hash", aux=0.0))),
      },
      fixed=dict(total=0.03, active=0.03, flops_per_token=0.03, tokens=0.0, optimizer=0.0),
      seeds=(0, 1, 2),
      baseline="topk",
      analysis=dict(comm_devices=8, latency=False, routing_consistency=PERTURBATIONS,
                    replay_finetune=REPLAY_FINETUNE),
  )
