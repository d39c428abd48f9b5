"""Runtime lookup of tuned launch parameters: what `taco_triton.kernels._launch` calls per launch.

Importing this module registers `lookup` with the kernels (`_launch.register_tuned_lookup`);
`import taco_triton` imports it, so every launch on a GPU consults it.

    lookup(kernel, device, dtype, config, numel) -> {"num_warps": .., "num_stages": ..} | None

None means "no tuned config": the caller uses its heuristic. TACO_AUTOTUNE selects the mode:

    off      None always; no file is read.
    cached   (default) the shipped file autotune/tuned/<normalised gpu name>.json, then the
             user's cache (TACO_AUTOTUNE_CACHE, default ~/.cache/taco_triton/autotune.json).
    online   as cached; on a miss, time every config of the space on this problem
             (`triton.testing.do_bench`, median) and store the winner in the user's cache.
             Under TRITON_INTERPRET=1 or off-GPU the space is the heuristic alone: nothing is
             timed and None is returned.

Cost: the first lookup reads TACO_AUTOTUNE and TACO_AUTOTUNE_CACHE, the first of each (kernel,
device, dtype, config, size bucket) reads the files; every later one is a dict lookup (~2 us).
Changing those variables in a running process takes effect after `reset()`. Importing this
module makes no CUDA call.

Distributed jobs. Configs do not change results for compress/decompress beyond reduction order,
but every rank should run the same one (reproducible bytes, pinned results). In online mode,
when torch.distributed is initialised with more than one rank, each new key is agreed on
collectively: rank 0 of the tuning group looks it up (and tunes it on a miss), then
`broadcast_choice` sends its answer to every rank, which uses it whatever its own cache says.
That is a collective, so every rank of the group must launch the same kernels (same keys) in
the same order, which tensor-parallel code does; the group is the world unless
`tuning_group(pg)` says otherwise (use the TP group when pipeline stages tune independently).
Tune before capturing CUDA graphs: a broadcast or a timing cannot run inside a capture.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from pathlib import Path

import torch

from taco_triton import env
from taco_triton.config import CompressionConfig
from taco_triton.kernels import _launch

from . import cache, meta, registry, space

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
"""The shipped tuned files, one per GPU (`shipped_path`)."""

# (kernel, device, dtype, config, bucket) -> choice or None.
_MEMO: dict[tuple, dict | None] = {}
_MISSING = object()
# TACO_AUTOTUNE / TACO_AUTOTUNE_CACHE as read on the first lookup after import or reset().
_SWITCHES: dict = {"read": False, "off": False, "mode": None, "path": None}
# path -> usable entries of that file (loaded once per process).
_FILES: dict[str, dict] = {}
_LOCK = threading.Lock()
_GROUP: contextvars.ContextVar = contextvars.ContextVar("taco_autotune_group", default=None)


class TuningWarning(RuntimeWarning):
    """Online tuning could not run or could not store its result."""


def reset() -> None:
    """Forget everything read or decided in this process: the TACO_AUTOTUNE* switches, the files,
    the choices. Call it after changing those variables or editing a cache file in-process."""
    with _LOCK:
        _MEMO.clear()
        _FILES.clear()
        _SWITCHES.update(read=False, off=False, mode=None, path=None)
        cache.reset_warnings()


def shipped_path(device_name: str) -> Path:
    """The shipped tuned file for a device name.

    Args:
        device_name: the GPU's name (`torch.cuda.get_device_name`), normalised into the file name.

    Returns:
        The path under `TUNED_DIR` (it may not exist).
    """
    return TUNED_DIR / f"{cache.normalise_gpu_name(device_name)}.json"


def _entries(path: str) -> dict:
    if path not in _FILES:
        _FILES[path] = cache.load(path, meta.triton_version())
    return _FILES[path]


def cached_choice(key: cache.Key, user_path: str) -> tuple[dict | None, str]:
    """Look `key` up in the shipped file, then in the user's cache.

    Args:
        key: the launch's cache key (kernel, device, dtype, config, size bucket, Triton version).
        user_path: the user's cache file.

    Returns:
        (config, where from): the stored launch parameters and "shipped <path>" or
        "user cache <path>"; (None, "") on a miss.
    """
    name = str(key)
    for label, path in (("shipped", str(shipped_path(key.device))), ("user cache", user_path)):
        entry = _entries(path).get(name)
        if entry is not None:
            return dict(entry["config"]), f"{label} {path}"
    return None, ""


# --- distributed agreement -------------------------------------------------------------------


@contextlib.contextmanager
def tuning_group(group):
    """Agree on online-tuned configs within `group` inside this `with` block.

    Args:
        group: a torch.distributed process group (e.g. the TP group); None is the world.

    Yields:
        Nothing; the group applies until the block ends.
    """
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


def _dist_group():
    """The group online choices are agreed in, or None outside a multi-rank torch.distributed job."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = _GROUP.get()
    if dist.get_world_size(group) <= 1:
        return None
    return group if group is not None else dist.group.WORLD


def is_group_leader(group=None) -> bool:
    """Whether this rank looks a key up for its group.

    Args:
        group: a torch.distributed process group; None is the world.

    Returns:
        True on rank 0 of `group`, and when torch.distributed is not running.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def broadcast_choice(choice: dict | None, group=None) -> dict | None:
    """Every rank of `group` (default: the world) gets rank 0's `choice` (a config dict or None).

    A collective: every rank of the group must call it. Outside torch.distributed it returns
    `choice` unchanged. Uses `dist.broadcast_object_list`, so it works on gloo and NCCL alike
    (on NCCL the object travels through the current CUDA device).

    Args:
        choice: this rank's config dict, or None (rank 0's is the one kept).
        group: a torch.distributed process group; None is the world.

    Returns:
        Rank 0's choice.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return choice
    src = dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0
    box = [dict(choice) if choice is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


# --- online tuning ---------------------------------------------------------------------------


def _tuning_target(device: torch.device) -> bool:
    """Configs can only be told apart on a GPU running compiled kernels."""
    return device.type == "cuda" and not env.interpreting()


def _bench(fn) -> dict:
    """do_bench median of one config (a seam the tests replace)."""
    return meta.time_cuda(fn, repeats=1)


def tune(
    kernel: str, device: torch.device, dtype: torch.dtype, config: CompressionConfig, numel: int, key: cache.Key,
    user_path: str,
) -> dict | None:
    """Time every candidate on this problem, store the winner in the user's cache, return it.

    None (the heuristic) under the interpreter or off-GPU, where the space collapses to the
    heuristic, and when nothing could be timed (each failure is one warning, never an error).

    Args:
        kernel: the kernel's name in the registry ("compress", "decompress", ...).
        device: the device the launch runs on.
        dtype: the input dtype.
        config: the compression config.
        numel: elements of the problem timed.
        key: the cache key the winner is stored under.
        user_path: the user's cache file.

    Returns:
        The winner's {"num_warps", "num_stages"}, or None.
    """
    if not _tuning_target(device):
        return None
    try:
        ks = registry.spec(kernel)
    except registry.KernelUnavailable as exc:
        warnings.warn(f"taco_triton autotune: {exc}; using the heuristic", TuningWarning, stacklevel=4)
        return None
    cands = space.candidates(kernel, config, dtype, interpreter=False)
    results = []
    try:
        for params in cands:
            try:
                fn, _nbytes = ks.build(numel, dtype, config, device, params)
                results.append((_bench(fn), params))
            except Exception as exc:  # e.g. out of registers/shared memory for one config: skip it
                warnings.warn(f"taco_triton autotune: {kernel} {params} failed on {key}: {exc!r}", TuningWarning,
                              stacklevel=4)
    finally:
        registry.release()
    if not results:
        return None
    best_t, best = min(results, key=lambda r: r[0]["median_ms"])
    entry = cache.make_entry(
        key, best, median_ms=best_t["median_ms"], p20_ms=best_t["p20_ms"], p80_ms=best_t["p80_ms"],
        source="online", numel=numel, candidates=len(cands), torch=meta.torch_version(),
        git_commit=meta.git_commit(), date=meta.utc_now(),
    )
    try:
        _FILES[user_path] = cache.update(user_path, key.triton, {str(key): entry})
    except OSError as exc:
        cache.warn_once(user_path, f"cannot store tuned configs ({exc}); they are kept in memory only")
    return dict(best)


# --- the lookup ------------------------------------------------------------------------------


def lookup(
    kernel: str, device: torch.device, dtype: torch.dtype, config: CompressionConfig, numel: int
) -> dict | None:
    """The tuned launch parameters of one launch (see the module docstring for the modes).

    Args:
        kernel: the kernel's name ("compress", "decompress", ...).
        device: the device the launch runs on.
        dtype: the input dtype.
        config: the compression config.
        numel: elements of the launch (looked up by size bucket).

    Returns:
        {"num_warps", "num_stages"}, or None for the heuristic.
    """
    # Hot path (every launch): one dict lookup, ~2 us on a 2-core CPU.
    if _SWITCHES["off"]:
        return None
    memo_key = (kernel, device, dtype, config, cache.bucket(numel))
    found = _MEMO.get(memo_key, _MISSING)
    if found is _MISSING:
        with _LOCK:
            found = _MEMO.get(memo_key, _MISSING)
            if found is _MISSING:
                found = _MEMO[memo_key] = _decide(kernel, device, dtype, config, numel)
    return dict(found) if found is not None else None


def _read_switches() -> None:
    """Read TACO_AUTOTUNE / TACO_AUTOTUNE_CACHE once (os.environ lookups cost microseconds)."""
    mode = env.autotune_mode()  # validated here: a typo raises on the first launch
    _SWITCHES.update(read=True, off=mode == "off", mode=mode, path=env.autotune_cache_path())


def _decide(kernel, device, dtype, config, numel) -> dict | None:
    if not _SWITCHES["read"]:
        _read_switches()
        if _SWITCHES["off"]:
            return None
    mode, user_path = _SWITCHES["mode"], _SWITCHES["path"]
    name, cc = meta.device_identity(device)
    key = cache.Key.of(kernel, name, cc, meta.triton_version(), dtype, config, numel)
    if mode != "online":
        return cached_choice(key, user_path)[0]
    group = _dist_group()
    choice = None
    if group is None or is_group_leader(group):
        choice = cached_choice(key, user_path)[0]
        if choice is None:
            choice = tune(kernel, device, dtype, config, numel, key, user_path)
    if group is not None:
        choice = broadcast_choice(choice, group)
    return choice


# Resolved per call rather than registering the function object, so that replacing `lookup` on this
# module (as the tests do) reaches the kernels too.
_launch.register_tuned_lookup(lambda *problem: lookup(*problem))
