#!/usr/bin/env python
"""Execute the notebooks of this folder top to bottom with nbclient.

    python notebooks/run_all.py                 # full inputs, save outputs in place (what is committed)
    python notebooks/run_all.py --small         # TACO_NB_SMALL=1: small inputs (CI), in place
    python notebooks/run_all.py --small --check # execute into a temporary copy; write nothing here
    python notebooks/run_all.py 01_error_analysis.ipynb   # only the named notebook(s)

The kernel is the Python running this script (`sys.executable`, e.g. .venv/bin/python): a
kernelspec pointing at it is written to a temporary folder and used through its own kernel spec
manager, so no globally installed kernelspec is needed and a user's `python3` kernelspec (which
may point at another Python without torch) is never picked up.

In place, the figures of notebook NN (notebooks/figures/NN_*.png, .svg) are deleted before it runs,
so a figure of a CSV that no longer exists does not linger.

Environment passed to the kernel: TACO_REPO_ROOT (this repository), TACO_NB_SMALL ("1" with
--small, unset otherwise) and TACO_NB_FIGURES (notebooks/figures, or a temporary folder with
--check, so a check run never touches the committed figures).

Exit status: 0 when every notebook ran without error, 1 otherwise (the failing cell is printed).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

NB_DIR = Path(__file__).resolve().parent
ROOT = NB_DIR.parent
KERNEL_NAME = "taco-triton-nb"
CELL_TIMEOUT_S = 900


def notebooks(names=()) -> list[Path]:
    """The notebooks to run: the named ones (file names or paths) or every *.ipynb here, sorted."""
    if not names:
        return sorted(NB_DIR.glob("[0-9]*.ipynb"))
    out = []
    for n in names:
        p = Path(n)
        p = p if p.is_file() else NB_DIR / p.name
        if not p.is_file():
            raise SystemExit(f"no such notebook: {n}")
        out.append(p.resolve())
    return out


def kernel_manager(spec_dir: Path):
    """An AsyncKernelManager whose only kernelspec runs `sys.executable -m ipykernel_launcher`."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    write_kernel_spec(spec_dir / KERNEL_NAME, overrides={"display_name": f"taco-triton ({sys.executable})"})
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


def kernel_env(small: bool, figures: Path) -> dict:
    env = dict(os.environ)
    env["TACO_REPO_ROOT"] = str(ROOT)
    env["TACO_NB_FIGURES"] = str(figures)
    env.pop("TACO_NB_SMALL", None)
    if small:
        env["TACO_NB_SMALL"] = "1"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # inline, whatever the caller set
    return env


def execute(src: Path, dst: Path | None = None, *, small: bool = False, figures: Path | None = None,
            timeout: int = CELL_TIMEOUT_S, cwd: Path | None = None):
    """Run notebook `src` top to bottom; save the executed notebook to `dst` (None: don't save).

    Raises nbclient's CellExecutionError on the first failing cell. Returns (notebook, seconds).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(src), as_version=4)
    figures = Path(figures) if figures is not None else NB_DIR / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="taco-nb-kernel-") as spec_dir:
        km = kernel_manager(Path(spec_dir))
        client = NotebookClient(nb, km=km, timeout=timeout, record_timing=False,
                                extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no transport chatter
                                resources={"metadata": {"path": str(cwd or src.parent)}})
        t0 = time.perf_counter()
        client.execute(env=kernel_env(small, figures))
        seconds = time.perf_counter() - t0
    # Opened in Jupyter, the committed notebooks use the reader's own python3 kernel.
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if dst is not None:
        nbformat.write(nb, str(dst))
    return nb, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", help="notebook file names (default: every NN_*.ipynb here)")
    ap.add_argument("--small", action="store_true", help="set TACO_NB_SMALL=1 (small inputs, for CI)")
    ap.add_argument("--check", action="store_true",
                    help="execute into a temporary copy (outputs and figures discarded)")
    ap.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
    args = ap.parse_args(argv)
    try:
        import nbclient  # noqa: F401
        import ipykernel  # noqa: F401
    except ImportError as exc:
        print(f"needs nbclient, nbformat, ipykernel and matplotlib in this Python: {exc}", file=sys.stderr)
        return 1
    from nbclient.exceptions import CellExecutionError

    failed = []
    mode = "small (TACO_NB_SMALL=1)" if args.small else "full"
    with tempfile.TemporaryDirectory(prefix="taco-nb-check-") as tmp:
        for src in notebooks(args.notebooks):
            if args.check:
                dst, figures, cwd = Path(tmp) / src.name, Path(tmp) / "figures", Path(tmp)
            else:
                dst, figures, cwd = src, NB_DIR / "figures", src.parent
                # A figure named after a CSV that is gone must not outlive it: the run rewrites them all.
                for old in figures.glob(f"{src.name[:2]}_*"):
                    if old.suffix in (".png", ".svg"):
                        old.unlink()
            print(f"{src.name}: running ({mode}{', check only' if args.check else ''}) ...", flush=True)
            try:
                _, seconds = execute(src, dst, small=args.small, figures=figures, timeout=args.timeout,
                                     cwd=cwd)
            except CellExecutionError as exc:
                failed.append(src.name)
                print(f"{src.name}: FAILED\n{exc}", file=sys.stderr, flush=True)
                continue
            print(f"{src.name}: ok in {seconds:.1f} s{'' if args.check else ' (saved)'}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
