"""Run metrics: one JSON line per log step in metrics.jsonl, a loss plot at the end.

metrics.jsonl is appended a line at a time, so a kill can tear its last line; reading skips a
line that does not parse (saying so), and a resumed run rewrites the file atomically from the
records it kept."""
import json
import os
import warnings
from pathlib import Path

from ..fileio import atomic_path, write_text


class MetricsLog:
    """Appends metric records to output_dir/metrics.jsonl (flushed per line) and keeps them."""

    def __init__(self, output_dir, truncate_after=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = [r for r in read_records(self.path)
                        if truncate_after is None or r.get("step", 0) <= truncate_after]
        # a resumed run drops lines written after its checkpoint, then continues the file
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def write(self, record):
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def plot(self, out_path):
        """loss.png: train loss per step and eval loss where measured."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        train = [(r["step"], r["loss"]) for r in self.records if "loss" in r]
        evals = [(r["step"], r["eval_loss"]) for r in self.records if "eval_loss" in r]
        fig, ax = plt.subplots(figsize=(7, 4))
        if train:
            ax.plot(*zip(*train), label="train loss", lw=1.2)
        if evals:
            ax.plot(*zip(*evals), "o-", label="eval loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if train or evals:  # a run resumed with nothing left to train may have no records
            ax.legend()
        fig.tight_layout()
        with atomic_path(out_path, ".png") as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)


def read_records(path):
    """The metric records of a metrics.jsonl; lines that do not parse (a torn last line after a
    kill, a damaged file) are skipped with a warning naming the line."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    raw = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for i, line in enumerate(raw, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            warnings.warn(f"{path}:{i}: not a metrics record, skipped"
                          f"{' (torn by an interrupted write)' if i == len(raw) else ''}",
                          stacklevel=2)
            continue
        records.append(rec)
    return records
