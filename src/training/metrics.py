"""Run metrics: one JSON line per log step in metrics.jsonl, a loss plot at the end, progress."""
import json
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class MetricsLog:
    """Appends metric records to output_dir/metrics.jsonl (flushed per line) and keeps them."""

    def __init__(self, output_dir, truncate_after=None):
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records = []
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    rec = json.loads(line)
                    if truncate_after is None or rec.get("step", 0) <= truncate_after:
                        self.records.append(rec)
        # a resumed run drops lines written after its checkpoint, then continues the file
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records),
                             encoding="utf-8")

    def write(self, record):
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

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
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_path, dpi=110)
        plt.close(fig)


class Progress:
    """A rich progress bar with step, loss, lr, tokens/s and peak memory (quiet when disabled)."""

    def __init__(self, total, start=0, enabled=True):
        self.bar = None
        if not enabled:
            return
        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, step, info):
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)

    def log(self, text):
        if self.bar is not None:
            self.bar.console.log(text)
        else:
            print(text, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
