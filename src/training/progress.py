"""The training steps' progress on the console: a rich bar in a terminal; in a file or a pipe
(a job's log, `nohup`), plain lines: the first step, each evaluation, one at least
PLAIN_EVERY_S seconds after the last line, and the last step (a bar there would be drawn once,
at the end, cut to 80 columns)."""
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress

PLAIN_EVERY_S = 10.0


class Progress:
    """Step, loss, lr, tokens/s and peak memory as the steps go (quiet when disabled)."""

    def __init__(self, total, start=0, enabled=True, console=None):
        self.bar, self.total, self.plain = None, total, False
        if not enabled:
            return
        console = console or Console()
        if not (console.is_terminal or console.is_jupyter):
            self.plain, self.console, self._last = True, console, -PLAIN_EVERY_S
            return
        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                console=console)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, step, info, evaluated=False):
        if self.plain:
            now = time.monotonic()
            if evaluated or step >= self.total or now - self._last >= PLAIN_EVERY_S:
                self._last = now
                self.log(f"train {step}/{self.total}  {info}")
        elif self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)

    def log(self, text):
        if self.bar is not None:
            self.bar.console.log(text)
        else:
            print(text, file=self.console.file if self.plain else None, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.stop()
