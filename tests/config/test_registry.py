"""A registry of ideas reads as the name -> idea mapping the docs call it."""

import pytest

from moejax.config.registry import BALANCE_LOSSES, ROUTERS, UnknownNameError


def test_a_registry_is_subscriptable_by_name_like_a_mapping():
  topk = ROUTERS["topk"]
  assert topk is ROUTERS.get("topk") and topk.name == "topk"
  assert dict(ROUTERS) == dict(ROUTERS.items())  # keys() and __getitem__: dict() reads it
  assert list(ROUTERS.keys()) == list(ROUTERS) and ROUTERS.values()[0] is ROUTERS.items()[0][1]
  assert BALANCE_LOSSES["z_loss"].coef_field == "z_loss_coef"


def test_an_unknown_name_is_a_key_error_of_one_line_with_the_close_name():
  with pytest.raises(KeyError) as e:
    ROUTERS["topkk"]  # pylint: disable=pointless-statement
  assert isinstance(e.value, UnknownNameError)
  text = str(e.value)
  assert text.startswith("moe.routing.kind='topkk': no router of that name is registered. "
                         "Fix: did you mean 'topk'?"), text
  assert "\n" not in text and not text.startswith('"')
