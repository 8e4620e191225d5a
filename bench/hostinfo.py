"""The machine a benchmark ran on, for its JSON: the hosts vary between sessions."""
import platform
from pathlib import Path


def cpu_name():
    """The CPU's model name with its family and model numbers (Linux), else the machine type:
    "AMD EPYC (family 25 model 17)" tells Zen 4 from Zen 3 where the name alone does not."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
        name = info.get("model name")
        if name:
            return f"{name} (family {info.get('cpu family')} model {info.get('model')})"
    except OSError:
        pass
    return platform.machine()
