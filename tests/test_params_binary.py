"""The params binary, run as a user would (subprocess)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args):
  return subprocess.run([sys.executable, "-m", "experiments.params", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_preset_table():
  r = _run("--preset=mixtral_8x7b")
  assert r.returncode == 0, r.stderr
  assert "mixtral_8x7b" in r.stdout and "46.70B" in r.stdout and "12.90B+emb" in r.stdout
  assert "routed_experts" in r.stdout and "GFLOPs/tok" in r.stdout
  assert "-0.16%" in r.stdout  # 12.88B with the input table vs 12.9B published


def test_bad_preset_lists_valid_names():
  r = _run("--preset=mixtral")
  assert r.returncode != 0
  out = r.stdout + r.stderr
  assert "unknown preset 'mixtral'" in out and "deepseek_v3" in out and "switch_base_128" in out


def test_config_file_with_override_and_typo():
  path = "configs/presets/mixtral_8x7b.py"
  r = _run(f"--config={path}", "--config.model.moe.topology.num_experts=64", "--seq_len=2048")
  assert r.returncode == 0, r.stderr
  assert "mixtral_8x7b (overridden)" in r.stdout  # published numbers no longer apply
  assert "S=2048" in r.stdout
  bad = _run(f"--config={path}", "--config.model.moe.topology.num_expert=64")
  assert bad.returncode != 0 and "num_experts" in bad.stderr


def test_all_presets_one_table():
  r = _run("--preset=all")
  assert r.returncode == 0, r.stderr
  summary = r.stdout.split("\n\n")[0].splitlines()[2:]
  assert sorted(line.split()[0] for line in summary) == [
      "deepseek_v3", "gpt_oss_120b", "kimi_k2", "mixtral_8x22b", "mixtral_8x7b",
      "qwen3_235b_a22b", "switch_base_128"]


def test_memory_table_reproduces_the_seed_figures():
  r = _run("--preset=mixtral_8x22b", "--device_gb=80")
  assert r.returncode == 0, r.stderr
  row = next(line for line in r.stdout.splitlines()
             if line.startswith("mixtral_8x22b") and "(" in line)
  assert "281.24 (4)" in row  # bf16 weights: 281 GB, four 80 GB GPUs
  r = _run("--preset=mixtral_8x7b", "--memory=false")
  assert r.returncode == 0 and "KV/token" not in r.stdout
  bad = _run("--preset=mixtral_8x7b", "--group_size=-1")
  assert bad.returncode != 0 and "--group_size=-1" in bad.stderr


def test_memory_table_quantizes_only_the_named_components():
  # gpt-oss-120b as released: MXFP4 experts (4 bits, one 8-bit scale per 32), the rest bf16.
  r = _run("--preset=gpt_oss_120b", "--quantized=routed_experts", "--group_size=32",
           "--scale_bits=8")
  assert r.returncode == 0, r.stderr
  assert "65.17 (1)" in r.stdout and "routed_experts matrices" in r.stdout
  bad = _run("--preset=gpt_oss_120b", "--quantized=embedding")
  assert bad.returncode != 0 and "cannot quantise" in bad.stderr
