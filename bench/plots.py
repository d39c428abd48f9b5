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
