"""Every command the README and docs tell a user to run works from a shell without TRITON_INTERPRET.

The suite sets Triton's interpreter for its own process before anything is imported (conftest.py),
so an in-process test cannot see an entry point that breaks when the variable is unset: `make demo`
once failed that way (`import taco_triton` imported Triton before `demo.py` could set the variable,
and the interpreter then could not call Triton's own library). Each case here runs the smallest
invocation of one entry point in a subprocess whose environment has neither TRITON_INTERPRET nor the
suite's other switches, on this CPU-only machine, and checks it exits 0 and printed what it exists
to print. bench/te_group_check.py is left out: it needs a GPU and TransformerEngine.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = ["--tp", "2", "--compress", "none,fp8", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
              "--batch", "2", "--seq", "16", "--hidden", "32", "--ffn", "64", "--data-bytes", "65536"]


# A first run's world: the caches a newcomer starts without, each its own fresh folder.
FRESH_DIRS = {"HOME": "home", "XDG_CACHE_HOME": "home/.cache", "TRITON_CACHE_DIR": "triton-cache",
              "HF_HOME": "hf-home", "TACO_REALDATA_CACHE": "realdata"}


def clean_env(fresh: Path) -> dict:
    """This environment without what the suite sets for itself (or a user may not have), with HOME and
    every cache a run may fill pointing at empty folders under `fresh`: a warm cache once hid a demo that
    failed on every first run (loading the model imported Triton before the demo chose the interpreter)."""
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith(("TACO_", "PYTEST_", "HYPOTHESIS_"))}
    for key, sub in FRESH_DIRS.items():
        env[key] = str(fresh / sub)
        (fresh / sub).mkdir(parents=True, exist_ok=True)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# (id, argv after `python`, a regular expression the output must match); `{tmp}`: a fresh folder per case
CASES = [
    ("make-demo", ["-m", "taco_triton.demo", "--quick"], r"5\) TP=2 training"),
    ("autotune-show", ["-m", "autotune.show"], ""),
    ("autotune-sweep", ["-m", "autotune.sweep", "--device", "cpu", "--kernel", "compress", "--shapes", "2x4096",
                        "--csv", "{tmp}/sweep.csv", "--cache", "{tmp}/cache.json"], "best: warps="),
    ("train-gpt", ["-m", "taco_triton.examples.train_gpt", *TINY_TRAIN, "--quiet"], "val_loss_vs_none_%"),
    ("train-dtensor", ["-m", "taco_triton.examples.train_dtensor", *TINY_TRAIN, "--quiet"], "val_loss_vs_none_%"),
    ("train-megatron", ["-m", "taco_triton.examples.train_gpt", "--megatron", *TINY_TRAIN, "--quiet"],
     "val_loss_vs_none_%"),
    ("bench-kernels", ["bench/kernel_speed.py", "--quick", "--device", "cpu", "--sizes", "16384", "--impls",
                       "triton,eager,copy", "--csv", "{tmp}/k.csv"],
     r"decompress\s+triton\s+[\d.]+"),
    ("bench-gpu-bytes", ["bench/gpu_bytes.py", "--device", "cpu", "--codecs", "fp8_e4m3", "--dtypes", "bf16",
                         "--group-sizes", "32", "--sizes", "1000", "--hadamard", "on", "--scales", "dual",
                         "--roundings", "nearest", "--csv", "{tmp}/gb.csv"], "OUT of bound: 0 cases"),
    ("bench-host-overhead", ["bench/host_overhead.py", "--worlds", "2", "--pipelines", "1", "--calls", "2",
                             "--repeats", "1", "--csv", "{tmp}/ho.csv"], "tiny op:"),
    ("bench-aot", ["bench/aot.py", "--targets", "sm_90", "--only",
                   "kernel=compress,dtype=bf16,codec=fp8_e4m3,group_size=128,hadamard=True,rounding=nearest,"
                   "scales=dual", "--csv", "{tmp}/aot.csv"], "sm_90"),
    ("bench-calibration-margins", ["bench/calibration_margins.py", "--no-real", "--csv", "{tmp}/cm.csv"], ""),
    ("bench-real-tensors", ["bench/real_tensors.py", "--n-texts", "2", "--max-tokens", "16", "--csv", "{tmp}/rt.csv"],
     ""),
    ("bench-real-allreduce", ["bench/real_allreduce.py", "--tp", "2", "--n-texts", "2", "--max-tokens", "16",
                              "--csv", "{tmp}/ra.csv"], ""),
    ("bench-train-seeds", ["bench/train_seeds.py", "--seeds", "0", "--compress", "none,fp8", "--", *TINY_TRAIN[:2],
                           *TINY_TRAIN[4:]], "final validation loss over seeds"),
    ("bench-train-throughput", ["bench/train_throughput.py", "--no-netns", "--rates", "unlimited", "--modes",
                                "none,fp8", "--steps", "7", "--warmup", "5", "--batch", "2", "--seq", "16",
                                "--hidden", "32", "--csv", "{tmp}/tt.csv"], ""),
    ("bench-collectives", ["bench/collectives.py", "--no-netns", "--quick", "--sizes", "65536", "--rates",
                           "unlimited", "--depths", "1", "--codecs", "fp8_e4m3", "--repeats", "1", "--min-repeats",
                           "1", "--csv", "{tmp}/col.csv"], "measured rows"),
    ("notebooks-run-all", ["notebooks/run_all.py", "--small", "--check", "02_autotune_sweep.ipynb"], "ok in"),
]


@pytest.mark.parametrize("argv, says", [pytest.param(a, s, id=i) for i, a, s in CASES])
def test_entry_point_runs_without_triton_interpret(argv, says, tmp_path):
    cmd = [sys.executable, *(a.replace("{tmp}", str(tmp_path)) for a in argv)]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(tmp_path / "fresh"), capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"{' '.join(cmd)} exited {run.returncode}:\n{out[-4000:]}"
    assert re.search(says, out), f"{' '.join(cmd)} did not print {says!r}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]


SCRIPT_AFTER_IMPORT = """
import os, torch
import taco_triton as taco
import sys
assert "triton" not in sys.modules, "import taco_triton imported Triton"
os.environ["TRITON_INTERPRET"] = "1"          # after the import, as a user's own script may
x = torch.randn(4, 128)
y = taco.decompress(taco.compress(x, backend="triton"), backend="triton")
print("ok", float((y - x).norm() / x.norm()))
"""

# Triton imported first by another package, as transformers does through torch._dynamo, then the
# documented path: the kernels run in the interpreter and give the reference's bytes and values.
SCRIPT_DYNAMO_FIRST = """
import sys, torch, torch._dynamo
assert "triton" in sys.modules, "torch._dynamo no longer imports Triton: this case tests nothing"
import taco_triton as taco
from taco_triton.env import use_interpreter_on_cpu
assert use_interpreter_on_cpu("cpu")
for cfg in [taco.CompressionConfig(), taco.CompressionConfig(codec="int4", group_size=32)]:
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    c, r = taco.compress(x, cfg, backend="triton"), taco.compress(x, cfg, backend="torch")
    assert torch.equal(c.data, r.data), cfg
    assert torch.equal(taco.decompress(c, backend="triton"), taco.decompress(r, backend="torch")), cfg
print("ok")
"""

# The same with only the variable set late (no call): the first launch makes the interpreter usable.
SCRIPT_TRITON_FIRST = """
import os, torch, triton                     # Triton imported for the GPU compiler ...
os.environ["TRITON_INTERPRET"] = "1"          # ... and the interpreter asked for after it
import taco_triton as taco
x = torch.randn(4, 128)
c, r = taco.compress(x, backend="triton"), taco.compress(x, backend="torch")
assert torch.equal(c.data, r.data)
print("ok")
"""

# taco_triton's own kernels decorated for the GPU compiler: too late for the interpreter, said so.
SCRIPT_KERNELS_FIRST = """
import torch
import taco_triton.kernels.compress          # decorated while TRITON_INTERPRET is unset
from taco_triton.env import use_interpreter_on_cpu
use_interpreter_on_cpu("cpu")
"""


def _python(script, tmp_path):
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=clean_env(tmp_path), capture_output=True,
                          text=True, timeout=300)


def test_a_script_may_set_the_interpreter_after_importing_the_package(tmp_path):
    run = _python(SCRIPT_AFTER_IMPORT, tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


@pytest.mark.parametrize("script", [pytest.param(SCRIPT_DYNAMO_FIRST, id="torch._dynamo-then-use_interpreter_on_cpu"),
                                    pytest.param(SCRIPT_TRITON_FIRST, id="import-triton-then-set-the-variable")])
def test_the_interpreter_runs_the_kernels_whatever_imported_triton_first(script, tmp_path):
    run = _python(script, tmp_path)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr[-3000:]


def test_kernels_built_for_the_gpu_compiler_raise_a_clear_error_naming_them(tmp_path):
    run = _python(SCRIPT_KERNELS_FIRST, tmp_path)
    assert run.returncode != 0
    assert "TRITON_INTERPRET=1 came too late" in run.stderr, run.stderr[-3000:]
    assert "taco_triton.kernels.compress" in run.stderr, run.stderr[-3000:]
