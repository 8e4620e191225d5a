"""Which linear layers a LoRA config targets (shared by apply_lora and the memory planner)."""
import re


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
        if re.search(pattern, path):
            return value
    return default
