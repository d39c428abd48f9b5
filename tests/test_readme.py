"""Every Python block of README.md runs as written, on CPU.

One documented substitution: `device="cuda"` becomes `device="cpu"`. A block whose first line is
`# torchrun --nproc-per-node N ...` runs on N gloo ranks under torchrun; every other block runs in
a fresh interpreter. Each runs in an empty directory with this checkout first on the path. The
blocks assert what they claim; the estimate table's figures must be what its block prints.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(id, code) of every ```python block; the id is the section heading it sits under."""
    blocks, heading, seen = [], "top", {}
    for m in re.finditer(r"^(#{2,3} [^\n]+)$|^```python\n(.*?)^```", text, re.S | re.M):
        if m.group(1):
            heading = re.sub(r"[^a-z0-9]+", "-", m.group(1).lstrip("#").strip().lower()).strip("-")
            continue
        seen[heading] = seen.get(heading, 0) + 1
        blocks.append((heading if seen[heading] == 1 else f"{heading}-{seen[heading]}", m.group(2)))
    return blocks


BLOCKS = python_blocks(README)


def run_block(code: str, cwd: Path) -> subprocess.CompletedProcess:
    code = code.replace('device="cuda"', 'device="cpu"')
    script = cwd / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    first = code.splitlines()[0]
    if (m := TORCHRUN.match(first)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={m.group(1)}",
               str(script)]
    else:
        cmd = [sys.executable, str(script)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_has_the_blocks_this_test_expects():
    ids = [i for i, _ in BLOCKS]
    assert {"quickstart", "collectives-and-tp-layers", "megatron-core", "when-compression-pays-off",
            "how-to-choose-a-config", "error-bounds-you-can-test-against"} <= set(ids), ids
    assert sum(bool(TORCHRUN.match(code)) for _, code in BLOCKS) >= 2


@pytest.mark.parametrize("code", [c for _, c in BLOCKS], ids=[i for i, _ in BLOCKS])
def test_block_runs(code, tmp_path):
    run = run_block(code, tmp_path)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    if "taco.estimate(" in code:
        check_estimate_table(run.stdout)


def check_estimate_table(stdout: str) -> None:
    """Each row of the README's estimate table holds the numbers its block printed for that link."""
    rows = re.findall(r"^\| (.+?), \d+ Gbit/s \| ([\d.]+) ms \| ([\d.]+) ms \| (\d+) / (\d+) GB/s \|$", README, re.M)
    assert len(rows) >= 3, "estimate table not found"
    for name, native, compressed, serial, overlapped in rows:
        line = next((ln for ln in stdout.splitlines() if ln.startswith(name)), None)
        assert line is not None, f"{name!r} not printed:\n{stdout}"
        printed = re.search(r"native\s+([\d.]+) ms, compressed >=\s+([\d.]+) ms;.*exceed\s+(\d+) GB/s \(\s*(\d+) GB/s", line)
        assert printed and printed.groups() == (native, compressed, serial, overlapped), (line, name)
