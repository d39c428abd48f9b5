"""Environment switches, read in one place (the README's ENVs table lists them).

| variable                   | effect                                                         |
|----------------------------|----------------------------------------------------------------|
| TRITON_INTERPRET=1         | Triton's CPU interpreter; lets backend="triton" run on CPU     |
|                            | tensors. Must be set before taco_triton.kernels is imported.   |
| TACO_TRITON_POISON_ALLOC=1 | fill library-allocated outputs with NaN / 0xFF (tests)         |

This module imports nothing heavy, so checking a switch never imports Triton.
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def poison_alloc() -> bool:
    """True when library-allocated outputs are pre-filled with poison (TACO_TRITON_POISON_ALLOC=1)."""
    return os.environ.get("TACO_TRITON_POISON_ALLOC", "0") == "1"
