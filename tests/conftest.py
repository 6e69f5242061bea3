"""Suite-wide test settings: the 10-minute budget of the default run, and known noise.

**The default run's budget.** ``python -m pytest -q -m "not slow"`` (the
README's second command) must end in under 10 minutes on 2 CPU cores. The
tests listed in :data:`SLOW` are the most expensive of the suite (tens of
seconds each, measured with ``--durations``); each is marked ``slow`` here,
with the default-run test that still covers the same code path named next to
it, so the default run keeps one case of every mechanism and ``-m slow``
runs the rest:

    python -m pytest -q -m slow      # the long tests, these included

**Known noise.** orbax (0.12) restores arrays as tasks of its own event loop
and closes the loop when the first read fails, so restoring a damaged
checkpoint (which tests do on purpose) leaves read coroutines suspended;
when Python collects them it prints "Exception ignored in: <coroutine object
_read_array_index_and_device_put>" with the whole TensorStore spec, dozens of
lines per array, at some later moment. Those reports, and only those, are
dropped; every other unraisable exception is reported as before.
"""

from __future__ import annotations

import sys
import types

import pytest

# nodeid (without the file's directory prefix "tests/") -> what covers it in the default run.
SLOW = {
    "parallel/test_ep.py::test_expert_parallel_equals_single_device[topology]":
        "[routers] and [dispatch]: the same EP-vs-one-device check",
    "parallel/test_ep.py::test_expert_parallel_equals_single_device[scmoe]":
        "parallel/test_scmoe.py (ScMoE = serial) and test_ep [routers]",
    "parallel/test_ep.py::test_expert_parallel_equals_single_device[buckets]":
        "test_ep [dispatch] and parallel/test_executors.py",
    "parallel/test_executors.py::test_executor_agrees_with_reference[copy]":
        "test_executor_agrees_with_reference[token] and test_ep [dispatch]",
    "execution/test_layer_backends.py::test_blocked_layer_equals_reference_layer[deepseek_v3]":
        "the other blocked-vs-reference layer cases; execution/test_gmm_backends.py",
    "execution/test_layer_backends.py::test_blocked_layer_equals_reference_layer[expert_choice]":
        "routing/test_expert_choice.py and the other blocked-vs-reference cases",
    "execution/test_layer_backends.py::"
    "test_pallas_layer_in_interpret_mode_equals_reference_layer[pallas_gpu]":
        "[pallas_tpu] of the same test; execution/test_grouped_ffn.py's pallas_gpu cases",
    "execution/test_grouped_ffn.py::test_pallas_gpu_interpret_forward":
        "test_layer_backends [pallas_tpu]; execution/test_lowering.py lowers pallas_gpu",
    "execution/test_permute.py::test_gradients_match_one_hot_reference[pallas_tpu]":
        "test_gradients_match_one_hot_reference[xla]; the pallas_tpu forward cases",
    "train/test_loop_kill_resume.py::"
    "test_sigkill_mid_training_then_restart_matches_uninterrupted_run":
        "train/test_resume.py: resumed metrics equal the uninterrupted ones",
    "test_device_check.py::test_dry_run_runs_every_step_and_every_check_passes":
        "the device_check unit tests in the same file",
    "plugins/test_plugin_router.py::test_ep_moe_layer_runs_it_on_8_devices_like_one_device":
        "the plugin router's single-device, train and ablate tests",
    "serve/test_binaries.py::test_quantize_cli":
        "serve/test_quantize.py (quantized forward and decode)",
    "serve/test_binaries.py::test_generate_cli_errors":
        "test_cli_errors.py and tests/test_binaries.py's one-line-error checks",
    "routing/test_expert_choice.py::test_each_expert_gets_exactly_its_capacity":
        "the other expert-choice routing tests in the same file",
    "train/test_lock.py::test_two_train_processes_on_one_workdir":
        "the in-process lock tests in the same file",
}


# Files whose tests need the interop extra (torch, transformers, safetensors): marked
# `interop` (`-m interop` runs them alone); without the extra they skip, naming it.
INTEROP = ("interop/", "finetune/test_hf.py")


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    key = item.nodeid.split("tests/", 1)[-1]
    if key in SLOW:
      item.add_marker(pytest.mark.slow)
    if key.startswith(INTEROP):
      item.add_marker(pytest.mark.interop)


_ABANDONED_READ = "_read_array_index_and_device_put"
_previous_hook = sys.unraisablehook


def _drop_abandoned_orbax_reads(unraisable):
  obj = unraisable.object
  if (isinstance(obj, types.CoroutineType) and obj.__name__ == _ABANDONED_READ
      and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit)):
    return
  _previous_hook(unraisable)


sys.unraisablehook = _drop_abandoned_orbax_reads
