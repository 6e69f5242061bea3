"""Survey suite 3: execution topology, serial expert parallelism vs ScMoE overlap.

ScMoE (Cai et al. 2404.05019): the routed experts of block i read block
i-1's representation through a shortcut, so their all-to-all can overlap the
dense/shared computation; 1.49x training / 1.82x inference speed-up over
top-2 MoE at equal or better quality (paper scale, real interconnect).

Arms (model.moe_schedule, moejax.nn.scmoe): the small suite model with 4
layers alternating dense and MoE (``moe_layout='every_other'``: the first
block must be dense for ScMoE), each MoE block 8 experts of width 128 top-2
plus one shared expert of width 128, batch aux loss 1e-2; ``serial`` and
``scmoe`` have identical parameters and FLOPs. 300 steps x 16 x 64 tokens.

What this measures at our scale: quality (validation loss) of the shortcut,
routing statistics, and the all-to-all volume the realised routing would
send over 8 expert-parallel devices (analytic accounting). The training
itself runs on one device; the overlap (exposed communication) needs a timed
multi-device step on real hardware and is reported n/a with that reason.
Size: 2 arms, about 3-5 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/topology.py --workdir=/tmp/abl/topology
"""

from moejax.ablation.bases import small_experiment, suite_config

_MOE = dict(topology=dict(num_experts=8, expert_width=128, num_shared_experts=1,
                          shared_expert_width=128),
            execution=dict(backend="blocked"),
            routing=dict(kind="topk", top_k=2, score_fn="softmax", gating="normalized"),
            balance=dict(aux_loss_coef=1e-2, aux_loss_scope="batch"))


def get_config():
  return suite_config(
      name="topology",
      description=__doc__,
      base=small_experiment(_MOE, n_layers=4, moe_layout="every_other"),
      arms={
          "serial": dict(model=dict(moe_schedule="serial")),
          "scmoe": dict(model=dict(moe_schedule="scmoe")),
      },
      fixed=dict(total=0.0, active=0.0, flops_per_token=0.0, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="serial",  # the serial schedule
      analysis=dict(comm_devices=8),
  )
