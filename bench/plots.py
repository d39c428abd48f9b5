"""What the benchmarks' figures share: pyplot without a display, and saving a figure as a PNG."""
from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str, dpi: int = 110) -> None:
    """Write `fig` to `path` (its folder created) and close it."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def paired_curves(curves, path: str, order: list[str], title: str) -> None:
    """Two panels from training curves (`mode`, `seed`, `step`, `val_loss` columns): the validation
    loss over training per mode (mean over seeds), and the paired change against mode "none" of the
    same seed and step (mean over seeds, the seeds' range shaded). `order`: the modes first drawn,
    in this order (others after them); `title`: the left panel's, before ": mean over seeds ..."."""
    plt = pyplot()
    val = curves.dropna(subset=["val_loss"])
    wide = val.pivot_table(index=["seed", "step"], columns="mode", values="val_loss")
    delta = 100 * (wide.div(wide["none"], axis=0) - 1)
    modes = [m for m in order if m in wide.columns] + sorted(set(wide.columns) - set(order))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, m in enumerate(modes):
        color = f"C{i}"  # one colour per mode in both panels
        mean = wide[m].groupby("step").mean()
        ax1.plot(mean.index, mean.to_numpy(), label="none (bf16)" if m == "none" else m, lw=1.2, color=color)
        if m != "none":
            by_step = delta[m].groupby("step")
            ax2.plot(by_step.mean().index, by_step.mean().to_numpy(), label=m, lw=1.2, color=color)
            ax2.fill_between(by_step.min().index, by_step.min().to_numpy(), by_step.max().to_numpy(),
                             color=color, alpha=0.12)
    seeds = ", ".join(str(int(s)) for s in sorted(curves.seed.unique()))
    ax1.set(xlabel="step", ylabel="validation loss", title=f"{title}: mean over seeds {seeds}")
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set(xlabel="step", ylabel="vs none, same seed and step (%)",
            title="paired difference: mean, shaded min..max over seeds")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, path)


def paired_run_arguments(ap, modes: str, quick_help: str) -> None:
    """The command line the paired training benchmarks share (seeds, modes, steps, outputs, and a
    redraw of the figure from the curves CSV)."""
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: %(default)s)")
    ap.add_argument("--compress", default=modes, help="modes, as train_gpt's --compress; must include none")
    ap.add_argument("--steps", type=int, default=1000, help="training steps per run (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--csv", default=None, help="write one row per (mode, seed) here")
    ap.add_argument("--curves-csv", default=None, help="write every evaluated step of every run here")
    ap.add_argument("--plot", default=None, help="draw the loss curves into this PNG (needs matplotlib)")
    ap.add_argument("--plot-only", action="store_true", help="train nothing: redraw --plot from --curves-csv")


def redraw_only(args, ap, plot) -> bool:
    """With --plot-only, redraw --plot from --curves-csv with `plot(curves, path)`; True if it did."""
    if not args.plot_only:
        return False
    if not (args.plot and args.curves_csv):
        ap.error("--plot-only needs --plot and --curves-csv")
    import pandas as pd

    plot(pd.read_csv(args.curves_csv), args.plot)
    return True
