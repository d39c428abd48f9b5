"""bench/gpu_bytes.py in Triton's interpreter: it finds the bytes identical where the project
expects them to be (no Hadamard, dual scales), and reports a corrupted kernel output as a
difference out of bound, with exit code 1."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
#: One config family on fp16 (Triton's interpreter misreads bf16 subnormals; the script leaves
#: them out of bf16 inputs there), one size under one tile.
TINY = ["--device", "cpu", "--codecs", "fp8_e4m3", "--dtypes", "fp16", "--group-sizes", "32", "--scales", "dual",
        "--sizes", "1000"]


@pytest.fixture(scope="module")
def tool():
    return load_script(ROOT / "bench" / "gpu_bytes.py")


def _run(tool, tmp_path, argv):
    csv = tmp_path / "bytes.csv"
    rc = tool.main(TINY + argv + ["--csv", str(csv)])
    return rc, pd.read_csv(csv, keep_default_na=False)


def test_bytes_identical_without_hadamard_for_every_kernel(tool, tmp_path, capsys):
    rc, df = _run(tool, tmp_path, ["--hadamard", "off"])
    assert rc == 0
    assert len(df) == 2 * len(tool.KERNELS)  # nearest and stochastic x every kernel
    assert set(df["kernel"]) == set(tool.KERNELS) and set(df["rounding"]) == {"nearest", "stochastic"}
    assert (df["expect"] == "identical").all()
    codec = df[df["kernel"].isin(["compress", "decompress"])]
    assert (codec["verdict"] == tool.IDENTICAL).all() and (codec["bytes_differ"] == 0).all()
    # the reduce's sum starts from +0 where the reference's starts from the first rank's term, so a
    # zero that is -0 on every rank may come out +0: equal values, reported as such
    red = df[df["kernel"].str.startswith("reduce")]
    assert ((red["verdict"] == tool.IDENTICAL) | red["note"].str.startswith("values equal:")).all()
    assert set(red["ranks"]) <= {2, 3, 4}
    assert (df["device"] == "cpu-interpreter").all() and (df["git_commit"] != "").all()
    assert "OUT of bound: 0 cases" in capsys.readouterr().out


def _flip(real, position):
    """`real` with bit 6 of byte `position` of its output flipped (an FP8 code's top exponent bit;
    in the high byte of an fp16 value, its exponent's top bit)."""
    def corrupted(*args, **kwargs):
        out = real(*args, **kwargs).clone()
        out.reshape(-1).view(torch.uint8)[position] ^= 0x40
        return out
    return corrupted


@pytest.mark.parametrize("kernel, hadamard, position", [
    ("compress", "off", 5),       # a path that must be bit-identical: any difference is out of bound
    ("compress", "on", 5),        # judged by the format's bound on the codes
    ("reduce_dense", "on", 41),   # judged by the decoder's summation bound
], ids=["compress-noH", "compress-H", "reduce_dense-H"])
def test_a_flipped_byte_is_out_of_bound_and_exits_1(tool, tmp_path, monkeypatch, capsys, kernel, hadamard, position):
    name = "gpu_compress" if kernel == "compress" else "gpu_reduce"
    monkeypatch.setattr(tool, name, _flip(getattr(tool, name), position))
    rc, df = _run(tool, tmp_path, ["--hadamard", hadamard, "--roundings", "nearest", "--kernels", kernel])
    assert rc == 1
    assert len(df) == 1
    row = df.iloc[0]
    assert row["verdict"] == tool.OUT, row.to_dict()
    if kernel == "compress":
        assert row["bytes_differ"] == 1 and row["codes_differ"] == 1 and row["scales_differ"] == 0
    else:  # the transform's summation order moves a few more output bytes, all within the bound
        assert row["note"].startswith("1 elements beyond the decoder's summation bound"), row["note"]
    assert row["elems_differ"] >= 1 and row["max_abs_diff"] > 0
    out = capsys.readouterr().out
    assert "OUT of bound: 1 cases" in out and kernel in out.split("OUT of bound: 1 cases")[1]


def test_time_budget_stops_after_the_first_case(tool, tmp_path, capsys):
    rc, df = _run(tool, tmp_path, ["--hadamard", "off", "--roundings", "nearest", "--kernels", "compress,decompress",
                                   "--time-budget", "0.001"])
    assert rc == 0 and len(df) == 1
    assert "1 cases not run" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_reference_is_within_the_bounds_the_script_judges_by(tool, dtype):
    """A control: on the script's inputs (subnormals, near-maximum values, NaN and Inf groups)
    the reference's own wire buffers, compressed and reduced, are within the bounds a kernel's
    differing bytes are judged by; otherwise a GPU run would call a correct kernel out of bound."""
    from taco_triton import bounds, reference

    u = bounds.U_DOT["interpreter"]
    failures = []
    # nearest rounding: stochastic doubles the grid term of the same bound (tests/test_properties.py)
    for cfg in tool.configs(tool.parse_args(["--group-sizes", "32", "--dtypes", dtype, "--roundings", "nearest"])):
        x = tool.make_input(1000, tool.DTYPES[dtype], 0)
        finite = torch.isfinite(reference.to_groups(x, cfg.group_size)).all(dim=1)
        ok, why = tool.wire_within_bound(x, reference.compress_reference(x, cfg), cfg, u, finite)
        if not ok:
            failures.append(f"compress {cfg}: {why}")
        bufs = tool.rank_buffers(1000, cfg, tool.DTYPES[dtype], 3, 0)
        acc = tool.transformed_sum(bufs, 1000, cfg, 1.0)
        x_sum = (reference.hadamard_inverse(acc.double()) if cfg.hadamard else acc).reshape(-1).float()
        ok, why = tool.wire_within_bound(x_sum, reference.reduce_reference(bufs, 1000, cfg), cfg, u,
                                         torch.isfinite(acc).all(dim=1))
        if not ok:
            failures.append(f"reduce {cfg}: {why}")
    assert not failures, failures
