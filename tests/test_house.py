"""The house rules of the code, read from the source: each fused op builds its own launches, and
each fact of the wire format has one home.

A rule that names a file fails when the text it forbids appears anywhere else in the library or the
benchmarks, so a second copy of a fact (a tag width, the vector unit, the salt's formula) or a
second launch builder is caught when it is written, not when the copies drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "taco_triton").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "autotune").rglob("*.py")])


def _code(path: Path) -> str:
    """The file's code without comments and docstrings' prose lines (a rule is about code)."""
    out = []
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0]
        out.append(code)
    return "\n".join(out)


def offenders(pattern: str, homes: set[str]) -> list[str]:
    """`file:line: text` of every match of `pattern` outside `homes` (paths relative to the root)."""
    found = []
    rx = re.compile(pattern)
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        if rel in homes:
            continue
        for i, line in enumerate(_code(path).splitlines(), 1):
            if rx.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


KERNEL_OPS = {"taco_triton/kernels/compress.py", "taco_triton/kernels/decompress.py", "taco_triton/kernels/reduce.py"}


@pytest.mark.parametrize("builder", [
    "compress_launch", "compress_launches", "compress_slots_launch", "decompress_launch", "decompress_launches",
    "decompress_slots_launch", "reduce_launch", "Prepared",
])
def test_only_the_fused_ops_build_and_bind_launches(builder):
    """`ops`, the collectives' plans, p2p and bench/aot.py ask `CompressOp`, `DecompressOp` and
    `ReduceOp`: a change of a kernel's parameters is a change of its own module."""
    found = offenders(rf"\b{builder}\(", KERNEL_OPS | {"taco_triton/kernels/_launch.py"})
    assert not found, found


def test_the_rule_reader_finds_a_copy():
    """The reader sees a builder call outside its home (it would be blind if `offenders` skipped all)."""
    assert offenders(r"\bcompress_slots_launch\(", set()), "the kernel module itself calls it"
