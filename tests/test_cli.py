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


CLIS = ["bench/kernels.py", "bench/gpu_bytes.py", "bench/collectives.py", "bench/real_tensors.py", "bench/train_throughput.py",
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
