"""A plugin router whose budget under-declares what it computes.

``overreach`` selects the configured ``top_k`` experts per token (the linear
router of top-k), but its ``slots()`` declares a target of one expert per
token at most, as a variable-k router might declare the k it aims for
rather than the most it can select. The accounting then counts one expert
per token while ``top_k`` ran: the ablation runner must refuse the run at
its end, from the logged share of tokens over the declared maximum.
"""

from __future__ import annotations

from moejax import routing
from moejax.routing.logits import router_logits
from moejax.routing.topk import select_topk


class Overreach(routing.RouterSpec):
  """Top-k selection that declares (1 expected, 1 at most) FFN experts per token."""

  name = "overreach"
  supports_bias = True

  def slots(self, cfg):
    return 1.0, 1.0

  def route(self, params, x, bias, cfg, *, token_ids, rng, train):
    return select_topk(router_logits(params["w"], x, cfg.routing, rng, train), bias, cfg)


routing.register(Overreach())
