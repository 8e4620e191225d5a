"""Which linear layers a LoRA config targets, with what rank and alpha: the rules apply_lora and
the memory planner share, on a plain list of (module path, out, in)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from .config import lora_scale
from .errors import ConfigError

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Target:
    """One adapter a LoRA config asks for: on the linear layer `path` (out n_out, in n_in)."""

    path: str
    n_out: int
    n_in: int
    rank: int
    alpha: float
    dropout: float = 0.0
    dora: bool = False
    rslora: bool = False

    @property
    def scale(self) -> float:
        return lora_scale(self.alpha, self.rank, self.rslora)

    @property
    def tensor_sizes(self) -> tuple:
        """Values of each trainable tensor: A (r, in), B (out, r) and, with DoRA, the
        magnitude (out,)."""
        return (self.rank * self.n_in, self.n_out * self.rank) + ((self.n_out,) if self.dora
                                                                   else ())

    @property
    def params(self) -> int:
        """Trainable parameters: A (r, in), B (out, r) and, with DoRA, the magnitude (out,)."""
        return sum(self.tensor_sizes)


def layer_index(path) -> int | None:
    """The decoder block a module path lies in (`model.layers.N.`), or None (e.g. lm_head)."""
    m = _LAYER_RE.search(path)
    return None if m is None else int(m.group(1))


def matches(path, targets):
    """`targets`: "all-linear" (every linear but the LM head), a regex (full match on the module
    path, as PEFT does), or a list of module-name suffixes."""
    if targets == "all-linear":
        return not path.endswith("lm_head")
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def pattern_value(path, patterns, default):
    """The value of the first regex in `patterns` (in the dict's order) found in `path`, else
    `default`: rank_pattern and alpha_pattern follow PEFT's rule, the first pattern that matches
    wins. (PEFT's own keys are anchored to whole module-name suffixes when an adapter_config is
    read; see adapters.peft_io.lora_config_from_peft.)"""
    for pattern, value in (patterns or {}).items():
        if pattern_found(pattern, path):
            return value
    return default


def pattern_found(pattern, path) -> bool:
    """Whether a rank/alpha pattern names the module `path` (found anywhere in it, as PEFT
    searches)."""
    return re.search(pattern, path) is not None


def _check_layers(modules, wanted):
    """ConfigError naming the lora.layers the model does not have."""
    have = {i for p, _, _ in modules if (i := layer_index(p)) is not None}
    missing = sorted((wanted or set()) - have)
    if missing:
        span = f"0 to {max(have)}" if have else "none"
        raise ConfigError(f"lora.layers: the model has no layer {', '.join(map(str, missing))} "
                          f"(its layers: {span})")


def targets_for(modules, lora) -> list[Target]:
    """The adapters a LoraConfig puts on `modules`, [(path, n_out, n_in)] of every linear layer
    that can carry one, in model order. A listed target no module matches, or a config that
    matches nothing, is a ConfigError naming the available module names."""
    wanted = None if lora.layers is None else set(lora.layers)
    _check_layers(modules, wanted)
    found = []
    for path, n_out, n_in in modules:
        if not matches(path, lora.targets):
            continue
        if wanted is not None and layer_index(path) not in wanted:
            continue
        found.append(Target(path, int(n_out), int(n_in),
                            int(pattern_value(path, lora.rank_pattern, lora.rank)),
                            float(pattern_value(path, lora.alpha_pattern, lora.alpha)),
                            lora.dropout, lora.use_dora, lora.use_rslora))
    available = ", ".join(sorted({p.rsplit(".", 1)[-1] for p, _, _ in modules}))
    if isinstance(lora.targets, list):
        for t in lora.targets:
            if any(matches(a.path, [t]) for a in found):
                continue
            if any(matches(p, [t]) for p, _, _ in modules):
                raise ConfigError(f"lora.targets: {t!r} is in none of lora.layers "
                                  f"{sorted(wanted)}")
            raise ConfigError(f"lora.targets: no module named {t!r}; available linear "
                              f"modules: {available}")
    if not found:
        raise ConfigError(f"lora.targets: {lora.targets!r} matched no linear module "
                          f"(available: {available})")
    if lora.init == "loftq":  # the SVD of an (out, in) error has min(out, in) components
        for t in found:
            if t.rank > min(t.n_out, t.n_in):
                raise ConfigError(f"lora.rank: {t.rank} for {t.path} is more than LoftQ can "
                                  f"fit to a ({t.n_out}, {t.n_in}) weight (at most "
                                  f"{min(t.n_out, t.n_in)})")
    return found


def check_patterns(lora, paths) -> None:
    """ConfigError for a lora.rank_pattern / alpha_pattern key found in none of the adapted
    module `paths` (a run's own config: a mistyped key would otherwise leave its modules at
    lora.rank / lora.alpha without a word; a PEFT adapter's patterns may name modules it skips)."""
    for name in ("rank_pattern", "alpha_pattern"):
        for key in getattr(lora, name) or {}:
            if not any(pattern_found(key, p) for p in paths):
                kinds = ", ".join(sorted({p.rsplit(".", 1)[-1] for p in paths}))
                raise ConfigError(f"lora.{name}: {key!r} is found in none of the adapted "
                                  f"modules ({kinds}, in lora.layers where set)")
