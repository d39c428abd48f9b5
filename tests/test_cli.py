"""The command-line tools say what is wrong and exit non-zero, or succeed on a fresh machine."""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import taco_triton as taco
from autotune import show
from taco_triton.examples import train_dtensor, train_gpt

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def _load(relpath: str):
    return load_script(ROOT / relpath)


def test_show_on_a_fresh_machine_says_nothing_is_tuned_and_succeeds(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TACO_AUTOTUNE_CACHE", str(tmp_path / "never-written.json"))
    assert show.main([]) == 0
    assert "no user cache yet" in capsys.readouterr().out


def test_show_of_a_named_missing_file_fails(tmp_path, capsys):
    assert show.main(["--cache", str(tmp_path / "typo.json")]) == 1
    assert "no such file" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--steps", "3"], "--steps (3) must exceed --warmup (5)"),
    (["--steps", "5", "--warmup", "5"], "--steps (5) must exceed --warmup (5)"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--modes", "fp8,int8"], "including 'none'"),
    (["--modes", "none,fp9"], "got ['none', 'fp9']"),
], ids=["steps-below-warmup", "steps-equal-warmup", "negative-warmup", "zero-batch", "no-baseline", "unknown-mode"])
def test_train_throughput_rejects_arguments_that_measure_nothing(argv, says, capsys):
    tool = _load("bench/train_throughput.py")
    with pytest.raises(SystemExit) as exit_:
        tool.main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err


def test_autotune_typo_raises_in_the_interpreter_too(monkeypatch):
    monkeypatch.setenv("TACO_AUTOTUNE", "onlien")
    with pytest.raises(ValueError, match="TACO_AUTOTUNE='onlien'"):
        taco.compress(torch.randn(4, 128), backend="triton")


def test_test_device_cuda_without_a_gpu_stops_with_a_message():
    # CUDA_VISIBLE_DEVICES="" hides any GPU, so this checks the same thing on every machine
    env = dict(os.environ, TACO_TEST_DEVICE="cuda", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                          "tests/test_config.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "TACO_TEST_DEVICE=cuda, but torch" in run.stderr and "sees no CUDA device" in run.stderr


class _Parsed(Exception):
    """Raised instead of parsing: carries the CLI's finished parser."""


CLIS = ["bench/kernel_speed.py", "bench/gpu_bytes.py", "bench/collectives.py", "bench/real_tensors.py", "bench/train_throughput.py",
        "autotune.sweep", "autotune.show", "taco_triton.examples.train_gpt", "taco_triton.demo",
        "notebooks/run_all.py", "bench/noise_ratio.py", "bench/convergence.py"]


@pytest.mark.parametrize("cli", CLIS)
def test_every_flag_has_help_text(cli, monkeypatch):
    def capture(parser, *args, **kwargs):
        raise _Parsed(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    mod = _load(cli) if cli.endswith(".py") else importlib.import_module(cli)
    with pytest.raises(_Parsed) as parsed:
        mod.main([])
    missing = [a.option_strings for a in parsed.value.args[0]._actions if not a.help]
    assert not missing, f"{cli}: flags without help: {missing}"


def _exit_code(main, argv):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's error exit
        return e.code


def _one_clear_line(err: str) -> bool:
    lines = [ln for ln in err.strip().splitlines() if ln.strip() and not ln.startswith("usage:")
             and not ln.startswith("  ")]  # argparse's usage block precedes its error line
    return len(lines) == 1 and "error" in lines[0] and "Traceback" not in err


def _sweep_cases(tmp):
    (tmp / "folder").mkdir(exist_ok=True)
    cases = {
        "device_bogus": ["--device", "bogus"],
        "cache_is_a_folder": ["--cache", str(tmp / "folder")],
        "cache_unwritable": ["--cache", "/proc/taco-autotune.json"],
        "csv_unwritable": ["--csv", "/proc/taco-sweep.csv"],
        "kernel_comma": ["--kernel", ","],
        "shapes_comma": ["--shapes", ","],
        "time_budget_negative": ["--time-budget", "-1"],
        "shape_overflows": ["--shapes", "99999999999x99999999"],
    }
    if not torch.cuda.is_available():
        cases["device_cuda_on_cpu_torch"] = ["--device", "cuda"]
    return cases


SWEEP_CASES = [
    "device_bogus", "cache_is_a_folder", "cache_unwritable", "csv_unwritable", "kernel_comma", "shapes_comma",
    "time_budget_negative", "shape_overflows", "device_cuda_on_cpu_torch"]


@pytest.mark.parametrize("case", SWEEP_CASES)
def test_sweep_user_error_is_one_line_and_exit_2(case, tmp_path, capsys):
    """Before: tracebacks (bad --device, --cache, --csv after the timing) or exit 0 with nothing
    done (--kernel ',', --shapes ',', --time-budget -1, a shape no tensor can hold)."""
    from autotune import sweep

    cases = _sweep_cases(tmp_path)
    if case not in cases:
        pytest.skip("torch sees a CUDA device")
    argv = ["--shapes", "4096", "--max-configs", "1", "--repeats", "1", "--cache", str(tmp_path / "c.json")]
    assert _exit_code(sweep.main, argv + cases[case]) == 2
    assert _one_clear_line(capsys.readouterr().err)


def test_sweep_where_every_config_fails_exits_1(tmp_path, capsys):
    """Before: exit 0 although nothing was timed (every config failed to allocate)."""
    from autotune import sweep

    argv = ["--shapes", str(2**40), "--max-configs", "1", "--repeats", "1", "--cache", str(tmp_path / "c.json")]
    assert _exit_code(sweep.main, argv) == 1
    assert "every config failed" in capsys.readouterr().err


KERNELS_CASES = {
    "sizes_zero": ["--sizes", "0"],
    "sizes_comma": ["--sizes", ","],
    "hidden_zero": ["--hidden", "0"],
    "impls_comma": ["--impls", ","],
    "csv_unwritable": ["--csv", "/proc/taco-kernels.csv"],
    "time_budget_negative": ["--time-budget", "-1"],
}


@pytest.mark.parametrize("case", sorted(KERNELS_CASES))
def test_bench_kernels_user_error_is_one_line_and_exit_2(case, capsys):
    """Before: ZeroDivisionError (--sizes 0, --hidden 0), a traceback after the timing (an
    unwritable --csv), exit 0 with an empty CSV (--impls ',')."""
    from pathlib import Path

    from .helpers import load_script

    kernels = load_script(Path(__file__).resolve().parents[1] / "bench" / "kernel_speed.py")
    argv = ["--device", "cpu", "--impls", "copy", "--sizes", "64K"] + KERNELS_CASES[case]
    assert _exit_code(kernels.main, argv) == 2
    assert _one_clear_line(capsys.readouterr().err)


@pytest.mark.parametrize("main, prog, says", [
    (train_gpt.main, "python -m taco_triton.examples.train_gpt", "Train a small GPT"),
    (train_dtensor.main, "python -m taco_triton.examples.train_dtensor", "DTensor"),
    (lambda argv: load_script(ROOT / "bench/netns.py").main(argv), "python bench/netns.py", "throttled namespace"),
], ids=["train_gpt", "train_dtensor", "bench-netns"])
def test_help_describes_its_own_command_and_exits_zero(main, prog, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"usage: {prog} ") and says in out, out[:400]


def test_no_bench_script_hides_an_installed_module():
    """`python bench/x.py` puts bench/ first on sys.path, so a script named like an installed module hides
    that module from everything the script imports: bench/kernels.py hid Hugging Face's `kernels`, which
    transformers imports when it loads a model (and tests that put bench/ on their path hid it from the
    rest of the session)."""
    import importlib.machinery

    bench = (ROOT / "bench").resolve()
    path = [p for p in sys.path if Path(p or ".").resolve() not in (bench, ROOT)]
    hidden = sorted(f.stem for f in bench.glob("*.py")
                    if f.stem in sys.builtin_module_names or importlib.machinery.PathFinder.find_spec(f.stem, path))
    assert not hidden, f"bench/ scripts named like installed modules: {hidden}"
