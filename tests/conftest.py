"""Suite-wide test settings: the 10-minute budget of the default run, and known noise.

**The default run's budget.** ``python -m pytest -q -m "not slow"`` (the
README's second command) must end in under 10 minutes on 2 CPU cores. The
tests listed in :data:`SLOW` are the most expensive of the suite (seconds to
tens of seconds each, measured with ``--durations``), and :data:`SLOW_CASES`
the cases of parametrised tests beyond a representative few; each is marked ``slow`` here,
with the default-run test that still covers the same code path named next to
it, so the default run keeps one case of every mechanism and ``-m slow``
runs the rest:

    python -m pytest -q -m slow      # the long tests, these included

**No ignored-exception noise.** The reads orbax abandons when a damaged
checkpoint fails to restore (which tests do on purpose) end inside the
restore (moejax.train.event_loops), so nothing is
reported later as "Exception ignored in" or "Event loop is closed";
tests/train/test_resume.py checks it.
"""

from __future__ import annotations

import os
import re

import pytest

from tests import fast_compile

# The fast-compile XLA:CPU flags (why: tests/fast_compile.py), set before JAX starts its
# backend, so the binaries the tests launch inherit them.
fast_compile.install()

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
    # Added when a slower 2-core VM took the default run to 11 min:
    "train/test_train_multihost.py::test_two_processes_of_the_binary_equal_one_process_step_by_step":
        "parallel/test_multiprocess.py (two processes equal one device) and this file's "
        "kill-one-process test",
    "results/test_report.py::test_report_command_regenerates_tables_and_values":
        "test_committed_results_md_is_what_results_json_generate and the other report tests",
    "results/test_notebooks.py::"
    "test_committed_notebook_outputs_are_those_of_a_fresh_execution[routing_analysis]":
        "the same check for ablation_results; routing_analysis executes in "
        "test_notebook_executes_on_a_suite_directory",
    "test_binaries.py::test_print_config_shows_every_field_and_dry_run_writes_nothing":
        "test_ablate_print_config_and_dry_run and finetune/test_binaries.py's dry run",
    "test_binaries.py::test_uncreatable_workdir_and_data_dir_are_one_line":
        "train/test_config.py::test_binary_refuses_a_bad_config_before_creating_the_workdir",
    "test_binaries.py::test_pallas_backend_on_cpu_is_refused_before_the_workdir_then_blocked_runs":
        "the platform refusals of execution/test_gmm_backends.py and test_permute.py",
    "finetune/test_hf.py::test_init_from_a_tiny_hf_mixtral_reproduces_its_logits[lora1]":
        "the [lora0] case and test_lora_export_merged_and_separate_load_into_transformers",
    "serve/test_quantize.py::test_quantized_model_forward_close_to_float_and_decodes[4-8-0.15]":
        "the [4-None-0.15] and [8-None-0.02] cases",
    "plugins/test_plugin_router.py::"
    "test_train_binary_trains_it_and_a_fresh_process_reads_the_run_back":
        "test_ablate_runs_it_as_an_arm_with_budget_and_load_metrics and train/test_load.py",
    "test_quiet_logs.py::test_generate_prints_no_log_lines_and_verbosity_brings_them_back":
        "test_load_keeps_orbax_quiet_unless_the_caller_logs_at_debug; serve/test_binaries.py",
    # Added when the default run reached 9 min 55 s on CI:
    "ablation/test_ablate_multihost.py::test_a_process_other_than_0_writes_nothing":
        "parallel/test_multiprocess.py (two processes) and ablation/test_runner.py (the suite)",
    "results/test_notebooks.py::test_notebook_executes_on_a_suite_directory[ablation_results]":
        "test_committed_notebook_outputs_are_those_of_a_fresh_execution[ablation_results]",
    "serve/test_binaries.py::test_generate_cli_batch_and_quantized":
        "serve/test_generate.py and serve/test_quantize.py (the same paths in process)",
    "finetune/test_binaries.py::test_accounting_with_a_workdir_prints_every_option_then_fine_tunes":
        "test_dry_run_and_print_config_read_the_source_and_write_nothing; finetune/test_train.py",
    "test_bench.py::test_a_failing_variant_is_a_row_and_exit_status_1_naming_it":
        "the other experiments.bench tests in the same file",
    "train/test_resume.py::test_execution_backend_is_not_part_of_the_run":
        "test_a_run_stored_before_auto_resumes_with_auto (a backend change resumes, in process)",
    "evaluate/test_validation.py::test_per_document_sums_add_up_and_match_a_direct_computation":
        "ablation/test_runner.py: a suite run's per-document losses add up to its val_loss",
    "ablation/test_power.py::test_report_effects_annotates_committed_summaries_from_their_suite_files":
        "test_annotate_says_bounded_or_the_seeds_that_would_resolve and test_plan_rows_from_a_"
        "pilot_summary (the same annotation on hand-made summaries)",
    "data/test_bpe.py::test_tiny_bpe_run_trains_end_to_end":
        "the tokenizer and data tests of data/test_bpe.py; test_binaries.py's train runs",
}

# Parametrised tests of which only some cases run by default: the test's nodeid (as in
# SLOW, without the case) -> (a regular expression over the case ids marked slow, what
# covers them in the default run).
SLOW_CASES = {
    "ablation/test_scale.py::test_every_shipped_suite_passes_its_budget_check_at_every_rung":
        (r".*-[sl]", "the m rung of every suite; ablation/test_budget.py checks rung s"),
    "execution/test_grouped_ffn.py::test_fused_fine_tile_sizes_match_unfused":
        (r"counts[123]", "the [counts0] case and test_fused_many_experts_matches_unfused"),
    "execution/test_grouped_ffn.py::test_matches_naive_loop_outputs_and_grads":
        (r"(blocked_fused_big_tile|blocked_fused_classes|blocked_unfused|blocked_permute"
         r"|whole_group|whole_group_fallback)-gelu",
         "each executor's swiglu case; both activations on blocked_fused and ragged_dot"),
    "serve/test_decode.py::test_moe_decode_equals_forward":
        (r"(sigmoid_bias_groups_blocked|top_p|hierarchical)-.*",
         "the top-k, hash, zero-computation and shared-expert cases"),
    "test_binaries.py::test_misspelt_override_key_is_one_line_with_the_hint":
        (r".*top_kk.*", "the other misspelt keys (train, ablate, a moved field)"),
    "test_workdir_preflight.py::test_each_writing_binary_refuses_before_any_output":
        (r"train-args1-.*", "train's /sys case and every other binary's"),
    "execution/test_gmm_backends.py::test_outputs_and_gradients_match_ragged_dot":
        (r"(blocked|whole_group|pallas_tpu)-(single_group|all_empty)",
         "their uneven_empty_tail and clamped_last_tile cases; ragged_dot's every case"),
}


# Files whose tests need the interop extra (torch, transformers, safetensors): marked
# `interop` (`-m interop` runs them alone); without the extra they skip, naming it.
INTEROP = ("interop/", "finetune/test_hf.py")


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    key = item.nodeid.split("tests/", 1)[-1]
    test, _, case = key.partition("[")
    cases = SLOW_CASES.get(test)
    if key in SLOW or (cases and case and re.fullmatch(cases[0], case[:-1])):
      item.add_marker(pytest.mark.slow)
    if key.startswith(INTEROP):
      item.add_marker(pytest.mark.interop)


# JAX's persistent compilation cache: options and the environment variables that carry
# them into the binaries the tests launch.
_CACHE = {"jax_compilation_cache_dir": "JAX_COMPILATION_CACHE_DIR",
          "jax_persistent_cache_min_compile_time_secs": "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
          "jax_persistent_cache_min_entry_size_bytes": "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"}


# Only programs that take this long to compile are written to the cache. Writing every
# program (0 s) costs more than it saves: the hundreds of one-operation programs of eager
# jnp calls compile in milliseconds each, and serialising and writing each of them made
# tests/test_layer_golden.py 10% dearer than no cache at all (33.9 vs 30.8 CPU-s), while
# at 0.3 s it cost what no cache costs (31.7) and the binaries' train steps (seconds) still
# hit: tests/plugins/test_plugin_router.py 57.0 CPU-s at 0 s, 54.8 at 0.3 s, 63.0 without
# a cache (measured with `-n 0` under /usr/bin/time at a load of ~5, 2026-12-02).
MIN_CACHED_COMPILE_S = 0.3


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the whole run: every worker and every binary launched.

  Most of the suite's time on 2 CPU cores is XLA compiling the same few tiny
  programs again: each test builds its model afresh (a new jit, so no
  in-memory hit), each xdist worker compiles for itself, and each launched
  binary starts cold. Keyed by the program's HLO, the cache only returns an
  executable for the same computation. It lives in this run's temporary
  directory (shared by the xdist workers), so a run never reads an older
  run's entries. Returns the environment variables that point a subprocess at it.
  """
  import jax  # pylint: disable=g-import-not-at-top
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # the run's directory, above this worker's own
  path = str(base / "jax_cache")
  os.makedirs(path, exist_ok=True)
  values = {"jax_compilation_cache_dir": path,
            "jax_persistent_cache_min_compile_time_secs": MIN_CACHED_COMPILE_S,
            "jax_persistent_cache_min_entry_size_bytes": 0}
  previous = {name: getattr(jax.config, name) for name in _CACHE}
  saved_env = {var: os.environ.get(var) for var in _CACHE.values()}
  for name, value in values.items():
    jax.config.update(name, value)
    os.environ[_CACHE[name]] = str(value)
  yield {_CACHE[name]: str(value) for name, value in values.items()}
  for name, value in previous.items():
    jax.config.update(name, value)
  for var, value in saved_env.items():
    if value is None:
      os.environ.pop(var, None)
    else:
      os.environ[var] = value


@pytest.fixture(scope="session", autouse=True)
def no_user_peak_calibration(tmp_path_factory):
  """An empty moejax cache directory for this run (and the binaries it launches): a
  developer's ``experiments.bench --suite=peak`` calibration (moejax.train.mfu) would
  otherwise change which MFU the tests' runs print. A test that wants one writes it here."""
  previous = os.environ.get("MOEJAX_CACHE_DIR")
  path = str(tmp_path_factory.mktemp("moejax_cache"))
  os.environ["MOEJAX_CACHE_DIR"] = path
  yield path
  if previous is None:
    os.environ.pop("MOEJAX_CACHE_DIR", None)
  else:
    os.environ["MOEJAX_CACHE_DIR"] = previous
