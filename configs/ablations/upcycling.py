"""Sparse upcycling: keep training the dense model, upcycle it (with or without
drop-upcycling), or train the MoE from scratch, at equal tokens and compute.

Published claims (docs/finetune.md): upcycled models beat dense continuation for
the same extra compute, and an MoE trained from scratch needs substantially more
compute to catch up (Komatsuzaki et al. 2022, arXiv 2212.05055); drop-upcycling,
re-initialising half of each expert's FFN units, recovers expert diversity
(specialisation) faster than plain upcycling and ends lower (Nakamura et al. 2025,
arXiv 2502.19261).

Source (``suite.source``, trained first, once per seed): the small suite model
made dense, FFN width F = 256, pre-trained SOURCE_STEPS steps. Then, for
EXTRA_STEPS more steps each (same tokens, same optimizer, a fresh warm-up and
cosine schedule):

- ``dense_continue``: the dense source trains on;
- ``upcycle``: the source upcycled to the small suite MoE, E=8 top-2 with
  expert width 128: the dense FFN split in two halves (fine-grained
  upcycling, ``finetune.upcycle.split=2``), each half copied into 4 experts,
  W_down x 2 and a uniform (zero) router, so the first forward is exactly the
  dense model's and the active FFN width is the dense one (equal FLOPs per
  token);
- ``drop_upcycle``: the same with ``finetune.upcycle.drop=0.5``;
- ``scratch``: the same MoE from a random initialisation, trained
  SOURCE_STEPS + EXTRA_STEPS steps: the dense pre-training's tokens plus the
  additional ones.

Held fixed: ``tokens`` and ``optimizer`` (the additional training),
``total_tokens`` (the arm's tokens plus its source's) and ``compute`` (training FLOPs plus the source's; the router's d x E FLOPs per
token make the MoE arms ~1% dearer). ``scratch`` is exempt from ``tokens``
and ``optimizer`` (it has more steps by design), ``dense_continue`` from
``total`` (the dense model holds 1/3 of the MoE's parameters). Compared: upcycle vs dense
continuation (the baseline), drop-upcycling vs upcycling, scratch vs upcycling.
Size: 3 source runs + 4 arms x 3 seeds; SOURCE_STEPS=300, EXTRA_STEPS=150
steps of 16 x 64 tokens.

  python -m experiments.ablate --config=configs/ablations/upcycling.py --workdir=/tmp/abl/upcycling
"""

import copy

from moejax.ablation.bases import eval_every, small_experiment, small_moe, suite_config

SOURCE_STEPS, EXTRA_STEPS = 300, 150
_MOE = small_moe()   # E=8, expert width 128, softmax top-2, normalised gates, aux loss 1e-2


def _steps(steps: int) -> dict:
  return dict(steps=steps, eval_every=eval_every(steps), checkpoint_every=steps // 3)


def get_config():
  source = small_experiment(None, steps=SOURCE_STEPS)
  source["model"]["moe"] = None
  base = small_experiment(copy.deepcopy(_MOE), steps=EXTRA_STEPS)
  base["finetune"] = dict(source="suite:source", source_format="upcycle",
                          upcycle=dict(split=2, router_init="uniform"))
  no_upcycle = dict(split=1, router_init="fresh")
  return suite_config(
      name="upcycling",
      description=__doc__,
      source=source,
      base=base,
      arms={
          "dense_continue": dict(model=dict(moe=None),
                                 finetune=dict(source_format="moejax", upcycle=no_upcycle)),
          "upcycle": {},
          "drop_upcycle": dict(finetune=dict(upcycle=dict(drop=0.5))),
          "scratch": dict(finetune=dict(source="", source_format="moejax", upcycle=no_upcycle),
                          train=_steps(SOURCE_STEPS + EXTRA_STEPS)),
      },
      fixed=dict(tokens=0.0, optimizer=0.0, total_tokens=0.0, compute=0.02),
      exempt=dict(scratch=("tokens", "optimizer"), dense_continue=("total",)),
      seeds=(0, 1, 2),
      baseline="dense_continue",
      compare_to=dict(drop_upcycle="upcycle", scratch="upcycle"),
      analysis=dict(comm_devices=8, latency=False),
  )
