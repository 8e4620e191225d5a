"""Where a fine-tuning run keeps its files: an adapter folder's (PEFT's names), and its
checkpoints in output_dir/checkpoints/step-N/."""
import re
from pathlib import Path

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
TEMPLATE = "chat_template.jinja"  # the chat template it was trained with (transformers' name)
_STEP_RE = re.compile(r"^step-(\d+)$")


def checkpoint_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dirs(output_dir) -> list[tuple[int, Path]]:
    """(step, folder) of every step-N folder of a run, oldest first (complete or not)."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(found)
