"""Environment switches, read in one place (docs/environment.md lists them).

| variable                   | effect                                                         |
|----------------------------|----------------------------------------------------------------|
| TRITON_INTERPRET=1         | Triton's CPU interpreter; lets backend="triton" run on CPU     |
|                            | tensors. Triton reads it when a function is decorated by       |
|                            | `@triton.jit`: set it before taco_triton's kernels are first   |
|                            | imported (its first Triton launch imports them). If another    |
|                            | package imported Triton first, `use_interpreter_on_cpu` (or the|
|                            | first launch) rebuilds Triton's own library for the interpreter|
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
    """For scripts that run the Triton kernels on `device_type` tensors: on anything but CUDA, turn
    Triton's interpreter on (TRITON_INTERPRET=1) and make it usable now, whatever imported Triton
    before (`prepare_interpreter`). Returns `interpreting()`: True on CPU, unchanged on CUDA.

    Raises:
        RuntimeError: taco_triton's kernels were already built for a GPU in this process (see
            `prepare_interpreter`).
    """
    if device_type == "cuda":
        return interpreting()
    if not interpreting():
        os.environ["TRITON_INTERPRET"] = "1"
    prepare_interpreter()
    return True


# Triton 3.9 reads TRITON_INTERPRET (triton.knobs.runtime.interpret) each time `@triton.jit` decorates a
# function: an InterpretedFunction with it, a JITFunction for the GPU compiler without. Triton's own
# library (tl.cdiv, tl.max, tl.sum, ... in triton.language.standard) is decorated when `triton` is first
# imported, and a JITFunction refuses to be called from an interpreted kernel ("Cannot call @triton.jit'd
# outside of the scope of a kernel"). torch._dynamo imports Triton (transformers imports torch._dynamo),
# so a script cannot count on being first. taco_triton's kernels are decorated when taco_triton.kernels is
# first imported, which the first Triton launch does.
def _triton_language_interpreted() -> bool:
    standard = sys.modules.get("triton.language.standard")
    return standard is None or type(standard.cdiv).__name__ == "InterpretedFunction"


def _kernels_built_for_gpu() -> list[str]:
    """The modules of taco_triton.kernels already imported with GPU-compiled (JITFunction) kernels."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return []
    return sorted(name for name, mod in list(sys.modules.items())
                  if name.startswith("taco_triton.kernels.") and mod is not None
                  and any(isinstance(v, jit.JITFunction) for v in vars(mod).values()))


def _interpret_triton_language() -> int:
    """Rebuild Triton's own @jit library functions as the interpreter's, as `import triton` would have
    with TRITON_INTERPRET=1 set; returns how many were rebuilt. Only objects defined in triton.language
    are touched (module attributes and the tensor methods `_tensor_member_fn` made of them)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rebuilt: dict[int, object] = {}

    def swap(owner, name, value):
        if isinstance(value, JITFunction) and value.fn.__module__.startswith("triton.language"):
            new = rebuilt.setdefault(id(value), InterpretedFunction(value.fn))
            setattr(owner, name, new)

    modules = [m for n, m in list(sys.modules.items())
               if m is not None and (n == "triton.language" or n.startswith("triton.language."))]
    for mod in modules:
        for name, value in list(vars(mod).items()):
            swap(mod, name, value)
    tensor = sys.modules["triton.language.core"].tensor
    for name, value in list(vars(tensor).items()):
        swap(tensor, name, value)
    return len(rebuilt)


def prepare_interpreter() -> None:
    """Make Triton's interpreter usable in this process, given TRITON_INTERPRET=1 is set.

    Nothing to do when Triton is not imported yet (its import will read the variable) or was imported
    with it. When another package imported Triton first, Triton's own library is rebuilt for the
    interpreter, as importing Triton with the variable set would have built it. Once done (or when
    Triton came after the variable), this is one dictionary look-up.

    Raises:
        RuntimeError: taco_triton's kernels were already decorated for the GPU compiler in this process
            (taco_triton.kernels imported while TRITON_INTERPRET was unset); they cannot run on CPU
            tensors. The message names the modules.
    """
    if _triton_language_interpreted():
        return
    gpu_built = _kernels_built_for_gpu()
    if gpu_built:
        raise RuntimeError(
            "TRITON_INTERPRET=1 came too late for taco_triton's kernels: " + ", ".join(gpu_built) + " "
            "were imported while it was unset, so Triton built them for a GPU and the interpreter cannot "
            "run them on CPU tensors. Set TRITON_INTERPRET=1 (or call "
            "taco_triton.env.use_interpreter_on_cpu) before the first Triton launch, or use "
            "backend='auto'/'torch'")
    _interpret_triton_language()


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
