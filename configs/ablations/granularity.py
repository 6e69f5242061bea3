"""Survey suite 1: expert granularity and a shared path, at equal total and active parameters.

DeepSeekMoE (Dai et al. 2401.06066): segmenting N experts into mN experts of
width w/m and routing mK of them keeps total and active parameters and
improves quality; isolating K_s of them as always-on shared experts improves
it further (2B: GShard 1.867 vs DeepSeekMoE 1.808 Pile loss).

Arms (``moe.topology.granularity`` / ``isolate_shared``), from the coarse layer of the small suite
model (8 experts of width 128, top-2, softmax, batch aux loss 1e-2):
``coarse``; ``fine_m2`` (16 x 64, top-4), ``fine_m4`` (32 x 32, top-8),
``fine_m8`` (64 x 16, top-16); ``coarse_shared`` (1 shared + 7 routed of width
128, top-1); ``fine_m4_shared`` (1 shared + 31 routed of width 32, top-7).
The router grows with the expert count (d x E weights), so total and active
parameters differ by up to 4.7% (fine_m8: 64-wide routers) between arms: the tolerance
is 5%, and the table shows the realised numbers.
Size: 6 arms x 300 steps x 16 x 64 tokens, about 8-10 minutes on 2 CPU cores.

  python -m experiments.ablate --config=configs/ablations/granularity.py --workdir=/tmp/abl/granularity
"""

from moejax.ablation.bases import small_experiment, suite_config

_COARSE = dict(topology=dict(num_experts=8, expert_width=128), execution=dict(backend="blocked"),
               routing=dict(kind="topk", top_k=2, score_fn="softmax", gating="normalized"),
               balance=dict(aux_loss_coef=1e-2, aux_loss_scope="batch"))


def _knobs(m, shared=0):
  """An arm: the coarse layer with DeepSeekMoE's knobs (resolved when the config is built)."""
  return dict(model=dict(moe=dict(topology=dict(granularity=m, isolate_shared=shared))))


def get_config():
  arms = {"coarse": _knobs(1)}
  for m in (2, 4, 8):
    arms[f"fine_m{m}"] = _knobs(m)
  arms["coarse_shared"] = _knobs(1, 1)
  arms["fine_m4_shared"] = _knobs(4, 1)
  return suite_config(
      name="granularity",
      description=__doc__,
      base=small_experiment(_COARSE),
      arms=arms,
      fixed=dict(total=0.05, active=0.05, flops_per_token=0.05, tokens=0.0, optimizer=0.0),
      seeds=(0,),
      baseline="coarse",  # the coarse layer
      analysis=dict(comm_devices=8),
  )
