"""Learning-rate schedules: constant, linear or cosine decay after a linear warmup."""
import math


class Schedule:
    def __init__(self, kind, lr, total_steps, warmup_steps=0):
        if kind not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown schedule {kind!r}; use constant, linear or cosine")
        self.kind, self.lr = kind, float(lr)
        self.total, self.warmup = max(int(total_steps), 1), max(int(warmup_steps), 0)

    def __call__(self, step):
        """Learning rate for 1-based `step`."""
        if self.warmup and step <= self.warmup:
            return self.lr * step / self.warmup
        if self.kind == "constant":
            return self.lr
        span = max(self.total - self.warmup, 1)
        frac = min(max((step - self.warmup) / span, 0.0), 1.0)
        if self.kind == "linear":
            return self.lr * (1.0 - frac)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * frac))

    def state_dict(self):
        return {"kind": self.kind, "lr": self.lr, "total": self.total, "warmup": self.warmup}
