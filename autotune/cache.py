"""The autotune cache: its key, its JSON file format, and safe reading and writing.

Key. One tuned config is stored per

    kernel | device name | compute capability | triton version | dtype | codec | G | hadamard |
    scales | rounding | numel bucket

Everything that changes the compiled kernel or the machine is in the key. The token count is
not: size only changes the grid (the number of 4096-element programs), so numel enters as a
bucket, floor(log4(numel)): [4^b, 4^(b+1)) elements share an entry (bucket 10 = 1 Mi..4 Mi
elements, 12 = 16 Mi..64 Mi). Varying sequence lengths therefore never re-tune (the complaint
users of other libraries raise), while the regimes that matter (a grid smaller than the GPU,
a few waves, many waves) still get their own entries. Rounding is in the key as well because
stochastic rounding compiles a different kernel (an extra random stream per element).

File. One JSON object per file, the same for shipped files (autotune/tuned/<gpu>.json) and the
user's cache:

    {"schema": 1, "triton": "3.6.0", "entries": {"<key string>": {
        "key": {<the key's fields>}, "config": {"num_warps": 8, "num_stages": 1},
        "median_ms": 0.031, "p20_ms": ..., "p80_ms": ..., "source": "sweep" | "online",
        "torch": "2.11.0", "git_commit": "abc1234", "date": "2026-...Z", "candidates": 3}}}

A file written by another triton version is stale (compiled code and its best config change
between versions) and is ignored as a whole, as are files with bad JSON or another schema:
each with one warning per process, never an exception. Writes re-read the file, merge, and
replace it atomically, so concurrent writers can lose an entry (re-tuned later) but never leave
a torn file.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields

import torch

from taco_triton.config import CompressionConfig

from .space import STAGES, WARPS

SCHEMA_VERSION = 1
# The dtype a kernel's launch passes: compress its input's, decompress its output's, reduce
# torch.uint8 (it reads and writes wire bytes).
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype in keys ("bf16"); any other dtype by its torch name, never an error."""
    return DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")


class CacheWarning(RuntimeWarning):
    """A cache file was ignored (corrupt, stale, or unwritable)."""


def bucket(numel: int) -> int:
    """floor(log4(numel)) for numel >= 1 (0 for 0 and 1): the size part of the key."""
    return max(int(numel).bit_length() - 1, 0) // 2


def bucket_range(b: int) -> tuple[int, int]:
    """[lo, hi) numel range of bucket b."""
    return 4**b, 4 ** (b + 1)


def normalise_gpu_name(name: str) -> str:
    """File stem for a device name: "NVIDIA H200" -> "nvidia_h200"."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "unknown"


@dataclass(frozen=True)
class Key:
    """What a tuned config is valid for (see the module docstring)."""

    kernel: str
    device: str
    cc: str
    triton: str
    dtype: str
    codec: str
    group_size: int
    hadamard: bool
    scales: str
    rounding: str
    bucket: int

    @classmethod
    def of(
        cls, kernel: str, device: str, cc: str, triton: str, dtype: torch.dtype, config: CompressionConfig, numel: int
    ) -> Key:
        return cls(
            kernel=kernel, device=device, cc=cc, triton=triton, dtype=dtype_name(dtype), codec=config.codec,
            group_size=config.group_size, hadamard=config.hadamard, scales=config.scales, rounding=config.rounding,
            bucket=bucket(numel),
        )

    def __str__(self) -> str:
        h = "H" if self.hadamard else "noH"
        return (
            f"{self.kernel}|{self.device}|cc{self.cc}|triton{self.triton}|{self.dtype}|{self.codec}|"
            f"G{self.group_size}|{h}|{self.scales}|{self.rounding}|numel4^{self.bucket}"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Key:
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError(f"key fields {sorted(d)} != {sorted(names)}")
        return cls(**d)


# (path, reason) pairs already warned about in this process: "a single warning each".
_WARNED: set[tuple[str, str]] = set()


def warn_once(path: str, reason: str) -> None:
    if (path, reason) in _WARNED:
        return
    _WARNED.add((path, reason))
    warnings.warn(f"taco_triton autotune: ignoring {path}: {reason}", CacheWarning, stacklevel=3)


def reset_warnings() -> None:
    _WARNED.clear()


def _check_entry(name: str, e) -> None:
    if not isinstance(e, dict) or not isinstance(e.get("config"), dict) or not isinstance(e.get("key"), dict):
        raise ValueError(f"entry {name!r} lacks a 'config' or 'key' object")
    c = e["config"]
    if set(c) != {"num_warps", "num_stages"} or c["num_warps"] not in WARPS or c["num_stages"] not in STAGES:
        raise ValueError(f"entry {name!r} has config {c!r}; expected num_warps in {WARPS}, num_stages in {STAGES}")
    key = Key.from_dict(e["key"])
    if str(key) != name:
        raise ValueError(f"entry {name!r} is stored under the wrong name (its key reads {key})")


def read(path: str, triton_version: str | None) -> tuple[dict, str | None]:
    """(entries, problem) of a cache file. problem is None when the file is usable, "missing"
    when it does not exist, else why it must be ignored. `triton_version=None` skips the
    version check (the `show` tool lists stale files too)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return {}, "missing"
    except OSError as exc:
        return {}, f"unreadable ({exc.__class__.__name__}: {exc})"
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return {}, f"not valid JSON ({exc})"
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_VERSION:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        return {}, f"schema version {found!r}, this code reads {SCHEMA_VERSION}"
    entries = doc.get("entries")
    if not isinstance(entries, dict) or not isinstance(doc.get("triton"), str):
        return {}, "no 'entries' object or 'triton' version"
    try:
        for name, e in entries.items():
            _check_entry(name, e)
    except (ValueError, TypeError) as exc:
        return {}, f"bad entry: {exc}"
    if triton_version is not None and doc["triton"] != triton_version:
        return entries, f"stale: written by triton {doc['triton']}, running {triton_version}"
    return entries, None


def load(path: str, triton_version: str) -> dict:
    """Usable entries of `path` ({} when missing; {} plus one warning when corrupt or stale)."""
    entries, problem = read(path, triton_version)
    if problem is None:
        return entries
    if problem != "missing":
        warn_once(path, problem)
    return {}


def make_entry(key: Key, config: dict, **info) -> dict:
    """A cache entry for `key`: the winning config plus how it was measured (info)."""
    return {"key": key.to_dict(), "config": {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}, **info}


def update(path: str, triton_version: str, new_entries: dict) -> dict:
    """Merge `new_entries` ({key string: entry}) into the file at `path`; returns all its entries.

    A corrupt or stale file is replaced (with its one warning): its entries could not be used.
    Raises OSError when the file cannot be written (callers decide whether that is fatal).
    """
    entries, problem = read(path, triton_version)
    if problem not in (None, "missing"):
        warn_once(path, problem + " (it will be replaced)")
        entries = {}
    entries = {**entries, **new_entries}
    doc = {"schema": SCHEMA_VERSION, "triton": triton_version, "entries": dict(sorted(entries.items()))}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".autotune.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return entries
