"""Run logs: metrics.jsonl (always; the source of truth), TensorBoard events (the `tensorboard` extra),
the loss curve as a picture (the `plot` extra, matplotlib). The field's libraries, not our own encoders."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from duolm.fileio import atomic_write
from duolm.runs import MetricsLog, read_metrics


class TensorBoardLog:
    """Every numeric field of a row as a scalar at row["step"], under RUN/tb/ (torch.utils.tensorboard)."""

    def __init__(self, logdir, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops the events a killed run wrote past its last checkpoint
        self.w = SummaryWriter(str(logdir), purge_step=None if resume_step is None else resume_step + 1)

    def __call__(self, row: dict) -> None:
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.w.add_scalar(k, v, row["step"])
        self.w.flush()

    def close(self) -> None:
        self.w.close()


def has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def open_logs(run_dir, resume_step: int | None, tensorboard: bool = True) -> list:
    """The sinks of a run: metrics.jsonl, and TensorBoard when asked for and installed."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    sinks = [MetricsLog(run_dir, resume_step)]
    if tensorboard and has_tensorboard():
        sinks.append(TensorBoardLog(Path(run_dir) / "tb", resume_step))
    return sinks


def plot_run(run_dir, panels=(("loss", "val_loss"),), log_scale: bool = False, out: str = "loss.png") -> Path | None:
    """Draw RUN/loss.png from RUN/metrics.jsonl with matplotlib: a panel per tuple of `panels`, side by side, one
    curve per metric against the step (BERT: MLM and NSP apart, so each one's learning shows).
    Returns the picture's path, or None when matplotlib is not installed (`pip install duolm[plot]`)."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.0), dpi=100, squeeze=False)
    for ax, metrics in zip(axes[0], panels):
        for name in metrics:
            points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            if points:
                ax.plot(*zip(*points), label=name.replace("_", " "), marker="o" if name.startswith("val") else None,
                        markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel("loss" if any("loss" in name for name in metrics) else "accuracy")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / out
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return path
