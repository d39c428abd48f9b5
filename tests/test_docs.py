"""Every Python block of README.md and of the pages under docs/ runs as written, on CPU.

One documented substitution: `device="cuda"` becomes `device="cpu"`. A block whose first line is
`# torchrun --nproc-per-node N ...` runs on N gloo ranks under torchrun; every other block runs in
a fresh interpreter. Each runs in an empty directory with this checkout first on the path. The
blocks assert what they claim; the estimate table's figures must be what its block prints.

A block that appears word for word in several files (the README repeats three of the docs'
examples) runs once, under the id of its first appearance: the README comes first.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = re.compile(r"#\s*torchrun --nproc-per-node (\d+)")
README_MAX_LINES = 250
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(id, code) of every ```python block; the id is the section heading it sits under."""
    blocks, heading, seen = [], "top", {}
    for m in re.finditer(r"^(#{1,3} [^\n]+)$|^```python\n(.*?)^```", text, re.S | re.M):
        if m.group(1):
            heading = re.sub(r"[^a-z0-9]+", "-", m.group(1).lstrip("#").strip().lower()).strip("-")
            continue
        seen[heading] = seen.get(heading, 0) + 1
        blocks.append((heading if seen[heading] == 1 else f"{heading}-{seen[heading]}", m.group(2)))
    return blocks


def all_blocks() -> list[tuple[str, Path, str]]:
    """(id "file::heading", file, code) of every block in README.md and docs/, each code once."""
    out, seen = [], set()
    for path in DOC_FILES:
        rel = path.relative_to(ROOT).as_posix()
        for heading, code in python_blocks(path.read_text()):
            if code not in seen:
                seen.add(code)
                out.append((f"{rel}::{heading}", path, code))
    return out


BLOCKS = all_blocks()


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


def test_the_pages_have_the_blocks_this_test_expects():
    ids = {i for i, _, _ in BLOCKS}
    assert {"README.md::three-examples", "README.md::three-examples-2", "README.md::three-examples-3",
            "docs/guides/collectives.md::every-argument-on-two-ranks", "docs/guides/dtensor.md::dtensor-torch-native-tp",
            "docs/speed/index.md::when-compression-pays-off", "docs/choosing-a-config.md::per-site-a-policy",
            "docs/guides/codec.md::error-bounds-you-can-test-against"} <= ids, sorted(ids)
    assert sum(bool(TORCHRUN.match(code)) for _, _, code in BLOCKS) >= 3


def test_the_readme_examples_are_the_docs_examples():
    """The README's three examples are copies of the docs' (so they run once and cannot drift)."""
    docs_code = {code for path in DOC_FILES[1:] for _, code in python_blocks(path.read_text())}
    readme = python_blocks((ROOT / "README.md").read_text())
    assert len(readme) == 3 and all(code in docs_code for _, code in readme)


def test_the_readme_fits_in_its_limit():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the rest belongs in docs/"


@pytest.mark.parametrize("path, code", [(p, c) for _, p, c in BLOCKS], ids=[i for i, _, _ in BLOCKS])
def test_block_runs(path, code, tmp_path):
    run = run_block(code, tmp_path)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    if "taco.estimate(" in code:
        check_estimate_table(path.read_text(), run.stdout)


def check_estimate_table(page: str, stdout: str) -> None:
    """Each row of the page's estimate table holds the numbers its block printed for that link."""
    rows = re.findall(r"^\| (.+?), \d+ Gbit/s \| ([\d.]+) ms \| ([\d.]+) ms \| (\d+) / (\d+) GB/s \|$", page, re.M)
    assert len(rows) >= 3, "estimate table not found"
    for name, native, compressed, serial, overlapped in rows:
        line = next((ln for ln in stdout.splitlines() if ln.startswith(name)), None)
        assert line is not None, f"{name!r} not printed:\n{stdout}"
        printed = re.search(r"native\s+([\d.]+) ms, compressed >=\s+([\d.]+) ms;.*exceed\s+(\d+) GB/s \(\s*(\d+) GB/s", line)
        assert printed and printed.groups() == (native, compressed, serial, overlapped), (line, name)
