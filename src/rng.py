"""CountingRng: a random generator whose whole state is (seed, draws), for array modules whose
own generators cannot save and restore their state (cupy's keep it on the GPU).

Each draw makes a fresh generator of the array module, seeded from (seed, draw number), so a
saved state replays the same numbers on resume and in recomputed (checkpointed) dropout. Its bit
generator is Philox 4x32-10: cupy's default, XORWOW, sets up each of its ~270k per-thread states
(about 13 MB on an H100) with cuRAND's skip-ahead to a subsequence, a slow init for every draw
(each dropout mask), where Philox's init only sets a counter."""
import warnings

import numpy as np


def is_counting_state(value):
    """Whether a saved generator state is a CountingRng's (else numpy's bit generator's)."""
    return isinstance(value, dict) and bool(value.get("counting_rng"))


class CountingRng:
    """The subset of numpy's Generator API packlora draws from: random, standard_normal,
    uniform."""

    def __init__(self, xp, seed=None):
        self.xp = xp
        self._bits = getattr(xp.random, "Philox4x3210", None) or xp.random.Philox  # cupy, numpy
        self.seed = int(np.random.SeedSequence().entropy % (1 << 63)) if seed is None else int(seed)
        self.draws = 0

    @property
    def state(self):
        return {"counting_rng": True, "bits": self._bits.__name__, "seed": self.seed,
                "draws": self.draws}

    @state.setter
    def state(self, value):
        if not is_counting_state(value):
            raise ValueError(f"not a CountingRng state: {value!r:.80}")
        saved = value.get("bits", "the array module's default generator")  # before Philox
        if saved != self._bits.__name__:
            warnings.warn(f"the saved random state drew from {saved}, this generator from "
                          f"{self._bits.__name__}: dropout goes on with other masks than the "
                          "run that saved it would have drawn", stacklevel=2)
        self.seed, self.draws = int(value["seed"]), int(value["draws"])

    def _next(self):
        key = np.random.SeedSequence([self.seed, self.draws]).generate_state(2, np.uint32)
        self.draws += 1
        return self.xp.random.Generator(self._bits(int(key[0]) | (int(key[1]) << 32)))

    def random(self, size=None, dtype=np.float64):
        return self._next().random(size, dtype=dtype)

    def standard_normal(self, size=None, dtype=np.float64):
        return self._next().standard_normal(size, dtype=dtype)

    def uniform(self, low=0.0, high=1.0, size=None):
        return self._next().uniform(low, high, size)
