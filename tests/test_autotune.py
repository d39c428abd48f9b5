"""Autotuning: key and buckets, cache files (round trip, corrupt, stale), modes, the config space,
the sweep CLI end to end under the interpreter, and agreement of configs across gloo ranks.

Everything runs on CPU: online tuning's timer is replaced where a GPU would be needed, and the
sweep runs Triton's interpreter on one tiny problem. Every test points TACO_AUTOTUNE_CACHE at a
temporary file, so the user's real cache is never read or written.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from autotune import cache, meta, registry, runtime, show, space, sweep
from taco_triton.config import CODECS, GROUP_SIZES, CompressionConfig
from taco_triton.examples.ranks import free_port
from taco_triton.kernels import _launch
from taco_triton.layout import WireLayout

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
BF16 = torch.bfloat16
CFG = CompressionConfig()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A private user cache, no shipped files, default mode, and nothing remembered between tests."""
    monkeypatch.setenv("TACO_AUTOTUNE_CACHE", str(tmp_path / "user.json"))
    monkeypatch.delenv("TACO_AUTOTUNE", raising=False)
    monkeypatch.setattr(runtime, "TUNED_DIR", tmp_path / "tuned")
    runtime.reset()
    yield
    runtime.reset()


def _key(numel=8192, kernel="compress", dtype=BF16, config=CFG, device=None, cc=None, triton=None):
    name, here_cc = meta.device_identity(CPU)
    return cache.Key.of(kernel, device or name, cc or here_cc, triton or meta.triton_version(), dtype, config, numel)


def _write(path, entries: dict, triton=None):
    """Write a cache file holding {Key: (num_warps, num_stages)}."""
    new = {str(k): cache.make_entry(k, {"num_warps": w, "num_stages": s}, median_ms=0.5, source="test")
           for k, (w, s) in entries.items()}
    cache.update(str(path), triton or meta.triton_version(), new)


def _user_path() -> Path:
    return Path(os.environ["TACO_AUTOTUNE_CACHE"])


def _no_timing(*a, **k):
    raise AssertionError("nothing may be timed here")


# --- key --------------------------------------------------------------------------------------


def test_bucket_is_floor_log4():
    assert [cache.bucket(n) for n in (0, 1, 3, 4, 15, 16, 4**10 - 1, 4**10, 4**11 - 1)] == [0, 0, 0, 1, 1, 2, 9, 10, 10]
    for b in range(20):
        lo, hi = cache.bucket_range(b)
        assert cache.bucket(lo) == b == cache.bucket(hi - 1) and cache.bucket(hi) == b + 1


def test_token_counts_in_one_bucket_share_a_key():
    hidden = 4096
    same = {str(_key(tokens * hidden)) for tokens in (256, 300, 511, 1000, 1023)}  # [1 Mi, 4 Mi) elements
    assert len(same) == 1
    assert str(_key(1024 * hidden)) not in same  # 4 Mi elements: the next bucket


def test_everything_that_changes_the_kernel_or_machine_separates_keys():
    base = _key()
    variants = [
        _key(kernel="decompress"), _key(dtype=torch.float16), _key(dtype=torch.float32),
        _key(device="NVIDIA H200", cc="9.0"), _key(device="NVIDIA H100 80GB HBM3", cc="9.0"),
        _key(device="NVIDIA H200", cc="10.0"), _key(triton="0.0.1"),
        *[_key(config=CFG.replace(codec=c)) for c in CODECS if c != CFG.codec],
        *[_key(config=CFG.replace(group_size=g)) for g in GROUP_SIZES if g != CFG.group_size],
        _key(config=CFG.replace(hadamard=False)), _key(config=CFG.replace(scales="taco_fp32x2")),
        _key(config=CFG.replace(rounding="stochastic")),
    ]
    names = [str(k) for k in [base, *variants]]
    assert len(set(names)) == len(names)
    assert str(_key(config=CFG.replace(seed=7))) == str(base)  # the seed is data, not a kernel choice
    assert cache.Key.from_dict(base.to_dict()) == base
    assert cache.normalise_gpu_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"


# --- cache files ------------------------------------------------------------------------------


def test_cache_round_trip_and_lookup_hits_within_a_bucket():
    _write(_user_path(), {_key(8192): (8, 1), _key(8192, kernel="decompress"): (2, 1)})
    entries, problem = cache.read(str(_user_path()), meta.triton_version())
    assert problem is None and len(entries) == 2
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) == {"num_warps": 8, "num_stages": 1}
    assert runtime.lookup("compress", CPU, BF16, CFG, 3 * 4096) == {"num_warps": 8, "num_stages": 1}  # same bucket
    assert runtime.lookup("decompress", CPU, BF16, CFG, 5000) == {"num_warps": 2, "num_stages": 1}
    assert runtime.lookup("compress", CPU, BF16, CFG, 4**8) is None  # another bucket
    assert runtime.lookup("compress", CPU, torch.float16, CFG, 8192) is None
    assert runtime.lookup("compress", CPU, BF16, CFG.replace(group_size=64), 8192) is None
    # merging keeps what was there
    _write(_user_path(), {_key(4**8): (16, 1)})
    assert len(cache.read(str(_user_path()), meta.triton_version())[0]) == 3


def test_shipped_file_comes_before_the_user_cache(tmp_path):
    name, _ = meta.device_identity(CPU)
    shipped = runtime.shipped_path(name)
    assert shipped.parent == tmp_path / "tuned" and shipped.name == f"{cache.normalise_gpu_name(name)}.json"
    _write(shipped, {_key(): (16, 1)})
    _write(_user_path(), {_key(): (2, 1), _key(kernel="decompress"): (8, 1)})
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) == {"num_warps": 16, "num_stages": 1}
    assert runtime.lookup("decompress", CPU, BF16, CFG, 8192) == {"num_warps": 8, "num_stages": 1}


def _bad_files():
    k = _key()
    good = {str(k): cache.make_entry(k, {"num_warps": 8, "num_stages": 1})}
    return {
        "bad-json": '{"schema": 1, "triton": ',
        "not-an-object": "[1, 2, 3]",
        "other-schema": json.dumps({"schema": 99, "triton": meta.triton_version(), "entries": good}),
        "other-triton": json.dumps({"schema": 1, "triton": "0.0.1", "entries": good}),
        "bad-config": json.dumps({"schema": 1, "triton": meta.triton_version(), "entries": {
            str(k): cache.make_entry(k, {"num_warps": 3, "num_stages": 1})}}),
        "misfiled-entry": json.dumps({"schema": 1, "triton": meta.triton_version(), "entries": {
            "some other key": good[str(k)]}}),
    }


@pytest.mark.parametrize("kind", list(_bad_files()))
def test_corrupt_or_stale_file_is_ignored_with_one_warning(kind):
    _user_path().write_text(_bad_files()[kind])
    with pytest.warns(cache.CacheWarning, match="ignoring") as rec:
        assert runtime.lookup("compress", CPU, BF16, CFG, 8192) is None
        assert runtime.lookup("compress", CPU, BF16, CFG, 4**9) is None  # another key: no new warning
        assert runtime.lookup("decompress", CPU, BF16, CFG, 8192) is None
    assert len([w for w in rec if issubclass(w.category, cache.CacheWarning)]) == 1
    # the sweep and online tuning replace such a file (saying so) instead of failing
    with pytest.warns(cache.CacheWarning, match="replaced"):
        _write(_user_path(), {_key(): (8, 1)})
    assert cache.read(str(_user_path()), meta.triton_version())[1] is None


# --- modes ------------------------------------------------------------------------------------


def test_mode_off_reads_nothing(monkeypatch):
    _user_path().write_text("not json")  # would warn if it were read
    monkeypatch.setenv("TACO_AUTOTUNE", "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.lookup("compress", CPU, BF16, CFG, 8192) is None


def test_mode_cached_and_online_hit_do_not_time(monkeypatch):
    _write(_user_path(), {_key(): (8, 1)})
    monkeypatch.setattr(runtime, "_bench", _no_timing)
    for mode in ("cached", "online", " Online "):
        monkeypatch.setenv("TACO_AUTOTUNE", mode)
        runtime.reset()  # the switches are read once per process (or reset), not per launch
        assert runtime.lookup("compress", CPU, BF16, CFG, 8192) == {"num_warps": 8, "num_stages": 1}
    monkeypatch.setenv("TACO_AUTOTUNE", "off")
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) is not None  # not re-read without reset()
    runtime.reset()
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) is None
    monkeypatch.setenv("TACO_AUTOTUNE", "offline")
    runtime.reset()
    with pytest.raises(ValueError, match="TACO_AUTOTUNE='offline'.*allowed"):
        runtime.lookup("compress", CPU, BF16, CFG, 8192)


def test_online_under_the_interpreter_is_the_heuristic_without_timing(monkeypatch):
    monkeypatch.setenv("TACO_AUTOTUNE", "online")
    monkeypatch.setattr(runtime, "_bench", _no_timing)
    monkeypatch.setattr(registry, "_build_compress", _no_timing)
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) is None
    assert not _user_path().exists()
    # and kernels launched in this mode still run (launch_params answers with the heuristic)
    from taco_triton.kernels.compress import compress_triton

    x = torch.randn(2, 4096, dtype=BF16)
    assert compress_triton(x, CFG).numel() == WireLayout.of(x.numel(), CFG).nbytes


def test_online_tuning_times_every_candidate_and_stores_the_fastest(monkeypatch):
    """The GPU path with the timer faked: CPU cannot tell configs apart."""
    monkeypatch.setenv("TACO_AUTOTUNE", "online")
    monkeypatch.setattr(runtime, "_tuning_target", lambda device: True)
    built = []

    def fake_build(numel, dtype, config, device, params):
        built.append(params)
        return (lambda: None), 1

    fake_time = {2: 4.0, 4: 3.0, 8: 1.0, 16: 2.0}  # every warp count the pruned space keeps
    monkeypatch.setitem(registry.KERNELS, "compress", registry.KernelSpec(build=fake_build))
    monkeypatch.setattr(runtime, "_bench", lambda fn: dict(
        median_ms=fake_time[built[-1]["num_warps"]], p20_ms=0.0, p80_ms=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", runtime.TuningWarning)  # a candidate that fails to time is a failure here
        got = runtime.lookup("compress", CPU, BF16, CFG, 8192)
    assert built == space.candidates("compress", CFG, BF16, interpreter=False)
    assert got == {"num_warps": 8, "num_stages": 1}
    stored = cache.read(str(_user_path()), meta.triton_version())[0][str(_key())]
    assert stored["config"] == got and stored["source"] == "online" and stored["median_ms"] == 1.0
    # memoised in-process, and read back from the file by a fresh process (cached mode)
    monkeypatch.setattr(runtime, "_bench", _no_timing)
    assert runtime.lookup("compress", CPU, BF16, CFG, 9000) == got
    runtime.reset()
    monkeypatch.setenv("TACO_AUTOTUNE", "cached")
    assert runtime.lookup("compress", CPU, BF16, CFG, 8192) == got


def test_launch_params_consults_the_runtime_only_for_compiled_gpu_kernels(monkeypatch):
    seen = []
    monkeypatch.setattr(runtime, "lookup", lambda *a: seen.append(a) or {"num_warps": 16, "num_stages": 1})
    assert _launch.launch_params("compress", CPU, BF16, CFG, 8192) == _launch.heuristic("compress", CFG)
    assert not seen  # CPU / interpreter: heuristic, no lookup
    monkeypatch.setattr(_launch, "interpreting", lambda: False)
    gpu = torch.device("cuda", 0)
    assert _launch.launch_params("compress", gpu, BF16, CFG, 8192) == {"num_warps": 16, "num_stages": 1}
    assert seen == [("compress", gpu, BF16, CFG, 8192)]
    monkeypatch.setattr(runtime, "lookup", lambda *a: None)
    assert _launch.launch_params("compress", gpu, BF16, CFG, 8192) == _launch.heuristic("compress", CFG)
    with _launch.forced({"num_warps": 2, "num_stages": 3}):
        assert _launch.launch_params("decompress", gpu, BF16, CFG, 1) == {"num_warps": 2, "num_stages": 3}
    assert _launch.launch_params("compress", gpu, BF16, CFG, 8192) == _launch.heuristic("compress", CFG)


def test_uint8_keys_of_the_reduce_launch_never_fail():
    assert runtime.lookup("reduce", CPU, torch.uint8, CFG, 8192) is None
    assert "|u8|" in str(_key(kernel="reduce", dtype=torch.uint8))
    assert cache.dtype_name(torch.int16) == "int16"


# --- space ------------------------------------------------------------------------------------


def test_space_heuristic_first_pruning_rules_and_interpreter_collapse():
    for kernel, dtype in [("compress", BF16), ("decompress", torch.float32), ("reduce", torch.uint8)]:
        for g in GROUP_SIZES:
            for h in (False, True):
                cfg = CFG.replace(group_size=g, hadamard=h)
                cands = space.candidates(kernel, cfg, dtype, interpreter=False)
                assert cands[0] == _launch.heuristic(kernel, cfg)
                assert len({tuple(c.values()) for c in cands}) == len(cands)
                assert all(c in space.full_space() for c in cands)
                assert space.candidates(kernel, cfg, dtype, interpreter=True) == [cands[0]]
                assert len(space.candidates(kernel, cfg, dtype, interpreter=False, prune=False)) == 20

    def pairs(cs):
        return [(c["num_warps"], c["num_stages"]) for c in cs]

    # rule 3: 1 and 2 warps would hold more than 255 registers of the 8192-element FP32 tiles;
    # rule 1 keeps every stage (the kernels are persistent loops); the heuristic comes first
    kept = [(4, 2)] + [(w, s) for w in (4, 8, 16) for s in (1, 2, 3, 4) if (w, s) != (4, 2)]
    assert pairs(space.candidates("compress", CFG, BF16, interpreter=False)) == kept
    assert pairs(space.candidates("compress", CFG.replace(hadamard=False), BF16, interpreter=False)) == kept
    assert pairs(space.candidates("reduce", CFG, torch.uint8, interpreter=False)) == kept
    assert "registers" in space.prune_reason({"num_warps": 1, "num_stages": 1}, CFG, BF16)
    assert "16-byte vector" in space.prune_reason({"num_warps": 16, "num_stages": 1}, CFG, torch.uint8, pipelined=True)
    assert space.parse_configs("4:1, 8:2") == [{"num_warps": 4, "num_stages": 1}, {"num_warps": 8, "num_stages": 2}]
    with pytest.raises(ValueError, match="outside the space"):
        space.parse_configs("3:1")


@pytest.mark.parametrize("kernel", list(registry.KERNELS))
def test_every_registered_builder_launches_its_kernel(kernel):
    """What the sweep and online tuning time: one launch through the ordinary wrapper, forced params."""
    ks = registry.spec(kernel)
    dtype = ks.launch_dtype or BF16
    numel = 4096 + 130  # two programs, the second a masked tail
    try:
        fn, nbytes = ks.build(numel, dtype, CFG, CPU, {"num_warps": 8, "num_stages": 2})
        fn()
        wire = WireLayout.of(numel, CFG).nbytes
        expected = {"compress": numel * 2 + wire, "decompress": wire + numel * 2, "reduce": (registry.REDUCE_RANKS + 1) * wire}
        assert nbytes == expected[kernel]
        (tensors,) = registry._SLOT.values()
        for t in tensors.values():
            assert not (t.is_floating_point() and bool(t.isnan().any()))
    finally:
        registry.release()
    assert not registry._SLOT


def test_unbuilt_kernel_gives_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(registry.KERNELS, "reduce", registry.KernelSpec(build=None, unavailable="kernel 'reduce' is not available yet"))
    with pytest.raises(registry.KernelUnavailable, match="not available yet"):
        registry.spec("reduce")
    with pytest.raises(ValueError, match="unknown kernel 'gemm'"):
        registry.spec("gemm")
    assert sweep.main(["--kernel", "reduce", "--shapes", "4096"]) == 2
    assert "not available yet" in capsys.readouterr().err


def test_gpu_timer_takes_do_bench_quantiles_median_over_runs(monkeypatch):
    """meta.time_cuda's arithmetic, with do_bench faked (no GPU here)."""
    import triton.testing

    runs = iter([[1.0, 0.5, 2.0], [3.0, 1.5, 4.0], [2.0, 1.0, 9.0]])
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(kw) or next(runs))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    t = meta.time_cuda(lambda: None, repeats=3, rep_ms=20)
    assert (t["median_ms"], t["p20_ms"], t["p80_ms"], t["n_samples"]) == (2.0, 1.0, 4.0, 3)
    assert all(kw["quantiles"] == [0.5, 0.2, 0.8] and kw["rep"] == 20 for kw in calls)


# --- the sweep and show tools -----------------------------------------------------------------


def test_sweep_end_to_end_then_a_cache_hit(tmp_path, monkeypatch, capsys):
    import pandas as pd

    cache_file, csv1, csv2 = tmp_path / "sweep_cache.json", tmp_path / "a.csv", tmp_path / "b.csv"
    args = ["--kernel", "compress", "--shapes", "2x4096", "--dtype", "bf16", "--group-size", "128",
            "--cache", str(cache_file), "--repeats", "1", "--full-space", "--max-configs", "2"]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "autotune.sweep", *args, "--csv", str(csv1)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "INTERPRETER TIMINGS" in run.stdout and "timed 2 config(s), cached 1 new key(s), 0 cache hit(s)" in run.stdout
    df = pd.read_csv(csv1)
    assert set(sweep.COLUMNS) <= set(df.columns) and len(df) == 2
    # the heuristic (4 warps, 2 stages) first, then the full space in order
    assert list(zip(df.num_warps, df.num_stages)) == [(4, 2), (4, 1)] and df.best.sum() == 1
    row = df.iloc[0]
    assert (row.kernel, row["shape"], row.numel, row["dtype"], row.codec, row.group_size, bool(row.hadamard)) == (
        "compress", "2x4096", 8192, "bf16", "fp8_e4m3", 128, True)
    assert row.device == "cpu-interpreter" and bool(row.interpreter) and "interpreter" in row.timer
    assert row.logical_bytes == 8192 * 2 + CFG.bytes_per_element(8192) * 8192
    assert row.logical_gbps == pytest.approx(row.logical_bytes / (row.median_ms * 1e-3) / 1e9)
    assert df.p20_ms.le(df.median_ms).all() and df.median_ms.le(df.p80_ms).all()
    assert row.triton_version == meta.triton_version() and row.torch_version == torch.__version__
    datetime.datetime.fromisoformat(row.date.replace("Z", "+00:00"))
    entries, problem = cache.read(str(cache_file), meta.triton_version())
    assert problem is None and len(entries) == 1
    best = df[df.best].iloc[0]
    (entry,) = entries.values()
    assert entry["config"] == {"num_warps": int(best.num_warps), "num_stages": int(best.num_stages)}
    assert entry["source"] == "sweep"

    # second run, in-process: a cache hit for the same problem and for another token count in the
    # same bucket; the timer must not run.
    monkeypatch.setattr(meta, "measure", _no_timing)
    assert sweep.main([*args, "--shapes", "2x4096,3x4096", "--csv", str(csv2)]) == 0
    out = capsys.readouterr().out
    assert "timed 0 config(s), cached 0 new key(s), 2 cache hit(s)" in out
    df2 = pd.read_csv(csv2)
    assert list(df2.source) == ["cache", "cache"] and list(df2.num_warps) == [best.num_warps] * 2

    # show lists it
    assert show.main(["--cache", str(cache_file)]) == 0
    out = capsys.readouterr().out
    assert "compress" in out and "cpu-interpreter" in out and "4^6 [4,096, 16,384)" in out


def _documented_sweep(marker: str) -> list[str]:
    """The arguments of the `python -m autotune.sweep` command in docs/autotuning.md whose line
    holds `marker` (its continuation lines joined)."""
    import re
    import shlex

    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "autotuning.md").read_text(), re.S).group(1)
    commands = re.sub(r"\\\n\s*", " ", block).splitlines()
    (line,) = [c for c in commands if "autotune.sweep" in c and marker in c]
    words = shlex.split(line.split("#")[0])
    assert words[:3] == ["python", "-m", "autotune.sweep"], words
    return words[3:]


def test_the_documented_cpu_sweep_says_how_long_shows_progress_and_finishes(tmp_path):
    """Before: the documented sweep ran on CPU for hours with nothing but the CSV header written.
    The CPU command of docs/autotuning.md, as a user runs it (no TRITON_INTERPRET set): before
    timing it says how many configs and about how long, then one progress line per config on
    stderr, and it finishes."""
    import pandas as pd

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-m", "autotune.sweep", *_documented_sweep("--device cpu")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "to time: 3 config(s) of 3 problem(s), about " in run.stdout and "under the interpreter" in run.stdout
    progress = [ln for ln in run.stderr.splitlines() if ln.startswith("autotune.sweep: ")]
    assert [ln.split(",")[0] for ln in progress] == [f"autotune.sweep: {i}/3 configs" for i in (1, 2, 3)], run.stderr
    assert progress[-1].endswith("about 0 s left")
    assert "timed 3 config(s), cached 3 new key(s)" in run.stdout
    assert len(pd.read_csv(tmp_path / "sweep_cpu.csv")) == 3 and (tmp_path / "cpu_autotune.json").exists()


def test_a_long_interpreter_sweep_says_so_before_timing(tmp_path, monkeypatch, capsys):
    """The documented GPU command run on CPU: the estimate (from each kernel's seconds per element
    on one tile, here given) is every config's 1 + repeats calls plus each problem's build, and
    past LONG_S the sweep names SMOKE_SHAPE. The kernels are replaced by no-ops: nothing waits."""
    import math

    per_element = {"compress": (0.0, 40e-6), "decompress": (40e-6, 3e-6), "reduce": (40e-6, 35e-6)}
    monkeypatch.setattr(sweep, "_calibrate", lambda first, base, device: per_element)
    noop = registry.KernelSpec(build=lambda numel, dtype, config, device, params: ((lambda: None), 1))
    monkeypatch.setattr(registry, "spec", lambda kernel, need_builder=True: noop)
    args = [a for a in _documented_sweep("8192x4096") if not a.startswith("~")]
    args = [*args[: args.index("--csv")], "--device", "cpu", "--cache", str(tmp_path / "c.json")]
    assert sweep.main(args) == 0
    out = capsys.readouterr()
    numels = [8192 * 4096, 16384 * 8192]
    expected = sum(n * (build + 4 * call) for build, call in per_element.values() for n in numels)  # repeats 3
    assert f"to time: 6 config(s) of 6 problem(s), about {sweep._duration(expected)} here" in out.out
    smoke = sum(math.prod(sweep.SMOKE_SHAPE) * (build + 4 * call) for build, call in per_element.values())
    assert f"--shapes 4x4096 exercises the same machinery in about {sweep._duration(smoke)}" in out.out
    assert expected > sweep.LONG_S > smoke
    assert out.err.count("configs, ") == 6 and "6/6 configs" in out.err


def test_show_reports_ignored_and_missing_files(tmp_path, capsys):
    stale = tmp_path / "stale.json"
    _write(stale, {_key(): (8, 1)}, triton="0.0.1")
    assert show.main(["--cache", str(stale)]) == 0
    out = capsys.readouterr().out
    assert "IGNORED by the runtime: stale" in out and "compress" in out
    assert show.main(["--cache", str(tmp_path / "none.json")]) == 1
    assert show.main(["--shipped"]) == 0
    assert "no shipped tuned files" in capsys.readouterr().out


def test_no_cuda_call_at_import():
    code = (
        "import torch\n"
        "def boom(*a, **k): raise RuntimeError('CUDA touched at import')\n"
        "torch.cuda._lazy_init = boom; torch.cuda.is_available = boom; torch.cuda.device_count = boom\n"
        "import autotune, autotune.runtime, autotune.sweep, autotune.show, autotune.registry, autotune.cache\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


# --- torch.distributed: every rank runs rank 0's config ----------------------------------------


def _dist_worker(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    os.environ["TACO_AUTOTUNE"] = "online"
    os.environ["TACO_AUTOTUNE_CACHE"] = os.path.join(folder, f"rank{rank}.json")
    runtime.TUNED_DIR = Path(folder) / "no_shipped_files"
    runtime._bench = _no_timing  # rank 1 must not tune; rank 0 runs on CPU (nothing to time)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        out = {
            "direct": runtime.broadcast_choice({"num_warps": 8 if rank == 0 else 2, "num_stages": rank + 1}),
            "none": runtime.broadcast_choice(None if rank == 0 else {"num_warps": 4, "num_stages": 1}),
            # rank 0's cache says 16 warps, rank 1's says 2 (and its decompress key is cached only there)
            "lookup": runtime.lookup("compress", CPU, BF16, CFG, 8192),
            "lookup_rank1_only": runtime.lookup("decompress", CPU, BF16, CFG, 8192),
            "leader": runtime.is_group_leader(),
        }
        with runtime.tuning_group(dist.new_group([0, 1])):
            out["lookup_in_group"] = runtime.lookup("compress", CPU, BF16, CFG, 4**9)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(folder, f"result{rank}.json").write_text(json.dumps(out))


@pytest.mark.timeout(120)
def test_distributed_ranks_agree_on_rank0s_config(tmp_path):
    import torch.multiprocessing as mp

    _write(tmp_path / "rank0.json", {_key(): (16, 1), _key(4**9): (4, 1)})
    _write(tmp_path / "rank1.json", {_key(): (2, 1), _key(kernel="decompress"): (8, 1), _key(4**9): (2, 1)})
    ctx = mp.start_processes(_dist_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 90
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("distributed workers did not finish within 90 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    r0, r1 = (json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["direct"] == {"num_warps": 8, "num_stages": 1}
        assert r["none"] is None
        assert r["lookup"] == {"num_warps": 16, "num_stages": 1}
        assert r["lookup_rank1_only"] is None  # rank 0 has no entry (and cannot time on CPU): heuristic everywhere
        assert r["lookup_in_group"] == {"num_warps": 4, "num_stages": 1}
    assert r0["leader"] and not r1["leader"]
