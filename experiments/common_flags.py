"""The flags several user binaries share, each defined here once with one wording.

A binary that has one calls its function at import (``_DRY_RUN = common_flags.dry_run()``),
which defines the flag in absl's namespace and returns its holder. Each function is named
after its flag.
"""

from __future__ import annotations

from absl import flags

# The flags belong to the binary that calls a function here (absl then lists them under
# it in --help and --helpfull, as when each binary defined its own), not to this module.
flags.disclaim_key_flags()

_HELP = {
    "take_over_lock": "Take over the workdir's lock when it names a run on another host (a "
                      "requeued job whose previous node is gone), whatever the age of its "
                      "heartbeat; a live run on this host is still refused "
                      "(moejax.train.lock).",
    "print_config": "Print the resolved config as JSON (every field, defaults included; a "
                    "suite: its base experiment and each arm's changes) and exit.",
    "dry_run": "Validate the config and --workdir, print the budget and what would happen; "
               "write nothing.",
    "extend": "Allow train.steps above the stored run's (--config.train.steps; a suite: "
              "--config.base.train.steps) and train the extra steps, recorded in "
              "history.jsonl. The cosine schedule is stretched from the resumed step: not "
              "identical to a fresh longer run.",
    "step": "Checkpoint step to read (default: the newest kept one).",
    "json_out": "Write the results here as JSON.",
    "repeats": "Timed runs per variant, median taken (default: the binary's own, in its "
               "docstring).",
    "seed": "PRNG seed (what it seeds: the binary's docstring).",
}


def _shared(define, name: str, default, flag_values: flags.FlagValues) -> flags.FlagHolder:
  """Defines ``name`` once per process: binaries imported side by side (tests, notebooks)
  share the definition instead of failing with DuplicateFlagError."""
  if name in flag_values:
    return flags.FlagHolder(flag_values, flag_values[name])
  return define(name, default, _HELP[name], flag_values=flag_values)


def json_out(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return _shared(flags.DEFINE_string, "json_out", None, flag_values)


def repeats(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  """None when not given: each binary applies its own default."""
  return _shared(flags.DEFINE_integer, "repeats", None, flag_values)


def seed(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return _shared(flags.DEFINE_integer, "seed", 0, flag_values)


def take_over_lock(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return flags.DEFINE_bool("take_over_lock", False, _HELP["take_over_lock"],
                           flag_values=flag_values)


def print_config(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return flags.DEFINE_bool("print_config", False, _HELP["print_config"],
                           flag_values=flag_values)


def dry_run(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return flags.DEFINE_bool("dry_run", False, _HELP["dry_run"], flag_values=flag_values)


def extend(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return flags.DEFINE_bool("extend", False, _HELP["extend"], flag_values=flag_values)


def step(flag_values: flags.FlagValues = flags.FLAGS) -> flags.FlagHolder:
  return flags.DEFINE_integer("step", None, _HELP["step"], flag_values=flag_values)
