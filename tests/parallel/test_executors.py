"""The expert-parallel executors: the registry, the choice from config, agreement with the oracle.

* Registering a taken name, or looking up a name nothing registered, is a
  clear error; the registered names are exactly the config's.
* :func:`moejax.execution.parallel.select` picks, for every (dispatch,
  dispatch_unit, ragged_impl) and platform, the expected executor class and
  transport (or refuses native ragged off GPU/TPU).
* Every registered executor, on every transport the platform runs, equals
  ``ReferenceExecutor`` (outputs and gradients) on 8 simulated CPU devices
  (executors_child.py, in a fresh process: the device count is fixed when
  JAX starts). A new registered class is picked up here automatically.
"""

import itertools
import pathlib

import pytest

from moejax import config as C
from moejax.config import registry as config_registry
from moejax.execution import dispatch, parallel, registry, transport
from tests.parallel import children

CHILD = pathlib.Path(__file__).with_name("executors_child.py")


def test_registering_a_taken_name_raises():
  reg = registry.Registry("test strategy")

  @reg.register
  class First:
    name = "same"

  class Second:
    name = "same"
  with pytest.raises(registry.RegistryError, match=r"'same' is already registered \(by .*First\)"):
    reg.register(Second)
  assert reg.get("same") is First
  # The real table too: a second 'token' executor is refused, the first kept.
  with pytest.raises(registry.RegistryError, match="already registered"):
    @registry.register_dispatch
    class AnotherToken(dispatch.TokenExecutor):
      name = "token"
  assert registry.EXECUTORS.get("token") is dispatch.TokenExecutor
  with pytest.raises(registry.RegistryError, match="already registered"):
    registry.register_transport(transport.PaddedTransport)


def test_unknown_or_unnamed_is_a_clear_error():
  with pytest.raises(C.ConfigError, match=r"^parallel\.dispatch_unit='warp': no "
                                          r"executor of that name.*token"):
    registry.EXECUTORS.get("warp")
  with pytest.raises(C.ConfigError, match="parallel.dispatch_unit='warp'"):
    C.ParallelConfig(dispatch_unit="warp")
  with pytest.raises(registry.RegistryError, match="needs a `name`"):
    registry.Registry("x").register(type("Nameless", (), {}))


def test_registered_names_are_the_configs():
  assert set(config_registry.executor_names(True)) == {"token", "copy", "node"}
  assert {"grouped", "reference"} <= set(config_registry.executor_names(False))
  assert set(registry.TRANSPORTS.names()) == set(registry.TRANSPORT_NAMES)
  for name in config_registry.executor_names(True):
    cls = registry.EXECUTORS.get(name)
    assert issubclass(cls, dispatch.ExpertParallelExecutor) and cls.name == name


UNIT_CLASS = {"copy": dispatch.CopyExecutor, "token": dispatch.TokenExecutor,
              "node": dispatch.NodeExecutor}


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_select_picks_the_class_and_transport_of_every_combination(platform):
  combos = itertools.product(config_registry.DISPATCHES, config_registry.executor_names(True),
                             config_registry.RAGGED_IMPLS)
  for dispatch_name, unit, impl in combos:
    pcfg = C.ParallelConfig(dispatch=dispatch_name, dispatch_unit=unit, ragged_impl=impl)
    native = platform != "cpu"
    if dispatch_name == "capacity":
      want = transport.PaddedTransport
    elif impl == "native" and not native:
      with pytest.raises(parallel.RaggedUnsupportedError, match="emulated"):
        parallel.select(pcfg, platform)
      continue
    elif impl == "emulated" or not native:
      want = transport.EmulatedRaggedTransport
    else:
      want = transport.NativeRaggedTransport
    cls, got = parallel.select(pcfg, platform)
    what = (platform, dispatch_name, unit, impl)
    assert cls is UNIT_CLASS[unit], what
    assert type(got) is want, what
    # XLA:CPU's runtime does not order a switch's collectives (collective_order).
    assert got.bucket_switch == (platform != "cpu"), what


def test_executor_capabilities():
  assert not dispatch.CopyExecutor.deduplicates
  assert dispatch.TokenExecutor.deduplicates and dispatch.NodeExecutor.deduplicates
  assert dispatch.NodeExecutor.needs_nodes and not dispatch.TokenExecutor.needs_nodes
  assert transport.NativeRaggedTransport.exact_wire
  assert not transport.EmulatedRaggedTransport.exact_wire
  assert transport.NativeRaggedTransport.platforms == parallel.NATIVE_RAGGED_PLATFORMS
  assert transport.PaddedTransport.platforms is None


# Two transports x two cases per executor, one jit each (~15 s on an idle machine), every
# executor this test run selected in one child. The node unit's two hops compile twice the
# collectives (~40 s on a shared one): slow-only (and copy: tests/conftest.py's SLOW).
@pytest.fixture(scope="module")
def selected_executors(request):
  """{name: its section of the output} of one child checking every executor selected here."""
  return children.run_child(CHILD, *children.selected(request, "name"))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "node" else n
                                  for n in config_registry.executor_names(True)])
def test_executor_agrees_with_reference(name, selected_executors):
  out = selected_executors[name]
  assert out.endswith(f"OK {name}"), out
