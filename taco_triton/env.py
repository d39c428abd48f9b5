"""Environment switches, read in one place (docs/environment.md lists them).

| variable                   | effect                                                         |
|----------------------------|----------------------------------------------------------------|
| TRITON_INTERPRET=1         | Triton's CPU interpreter; lets backend="triton" run on CPU     |
|                            | tensors. Must be set before Triton is first imported: taco_triton|
|                            | does not import it (its first Triton launch does), so a script |
|                            | may set it after `import taco_triton` (`use_interpreter_on_cpu`)|
| TACO_TRITON_POISON_ALLOC=1 | fill library-allocated outputs with NaN / 0xFF (tests)         |
| TACO_TRITON_CHECK_COLLECTIVES | when collectives exchange the 8-byte fingerprint that     |
|                            | checks every rank called the same collective: `1` (default) on |
|                            | the first call of each (group, signature), then cached; `always`|
|                            | on every call (debugging: a host sync per call); `0` never     |
| TACO_TRITON_COMPRESS_SINGLE_RANK=1 | testing only: a group of one rank runs the compressed |
|                            | path (codec, tags, its own collectives) instead of returning   |
|                            | at once, so one GPU can test it (CUDA graphs); off by default  |
| TACO_AUTOTUNE=cached       | launch parameters of the kernels (`autotune` package):         |
|                            | `cached` (default) reads the shipped per-GPU files and the     |
|                            | user's cache; `online` also times every config on a miss and   |
|                            | caches the winner; `off` always uses the built-in heuristic.   |
| TACO_AUTOTUNE_CACHE=PATH   | the user's autotune cache file (default                        |
|                            | $XDG_CACHE_HOME or ~/.cache, then taco_triton/autotune.json)   |

This module imports nothing heavy, so checking a switch never imports Triton.
"""
from __future__ import annotations

import os
import sys


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_interpreter_on_cpu(device_type: str) -> bool:
    """For scripts that run the Triton kernels on `device_type` tensors: on anything but CUDA, set
    TRITON_INTERPRET=1 unless Triton is already imported (the choice is made when Triton and the
    kernels are imported, so setting it later would not take). Returns `interpreting()`.

    Call it before the first Triton launch; `import taco_triton` does not import Triton.
    """
    if device_type != "cuda" and not interpreting() and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreting()


def poison_alloc() -> bool:
    """True when library-allocated outputs are pre-filled with poison (TACO_TRITON_POISON_ALLOC=1)."""
    return os.environ.get("TACO_TRITON_POISON_ALLOC", "0") == "1"


AUTOTUNE_MODES = ("off", "cached", "online")


def autotune_mode() -> str:
    """TACO_AUTOTUNE: "cached" (default), "online" or "off". A typo raises rather than silently tuning."""
    mode = os.environ.get("TACO_AUTOTUNE", "").strip().lower() or "cached"
    if mode not in AUTOTUNE_MODES:
        raise ValueError(
            f"TACO_AUTOTUNE={os.environ['TACO_AUTOTUNE']!r} is not supported; allowed: {list(AUTOTUNE_MODES)}"
        )
    return mode


def autotune_cache_path() -> str:
    """The user's autotune cache file: TACO_AUTOTUNE_CACHE, else
    $XDG_CACHE_HOME (default ~/.cache)/taco_triton/autotune.json."""
    path = os.environ.get("TACO_AUTOTUNE_CACHE", "").strip()
    if path:
        return os.path.expanduser(path)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "taco_triton", "autotune.json")


def compress_single_rank() -> bool:
    """TACO_TRITON_COMPRESS_SINGLE_RANK=1: collectives on a group of one rank take the compressed
    path (for tests on one GPU; a real group of one needs no communication, so it is off)."""
    return os.environ.get("TACO_TRITON_COMPRESS_SINGLE_RANK", "0") == "1"


CHECK_MODES = ("first", "always", "never")


def check_mode(check=None) -> str:
    """When a collective exchanges its fingerprint: "first" (the first call of each (group,
    signature); the default), "always" (every call) or "never".

    `check` is the collective's argument: None follows TACO_TRITON_CHECK_COLLECTIVES (`1` or
    unset: "first", `always`, `0`: "never"); True means "first", False "never", "always" every call.
    """
    if check is None:
        raw = os.environ.get("TACO_TRITON_CHECK_COLLECTIVES", "1").strip().lower()
        if raw == "always":
            return "always"
        return "never" if raw == "0" else "first"
    if check is True or check == "first":
        return "first"
    if check is False or check == "never":
        return "never"
    if check == "always":
        return "always"
    raise ValueError(f"check must be None, True, False or 'always', got {check!r}")


def check_collectives() -> bool:
    """True (the default) when collectives verify the ranks agree on the call's signature."""
    return check_mode() != "never"
