"""Will a fine-tune fit in this machine's RAM: its planned peak against the memory available now,
before it loads anything (a run that does not fit is otherwise killed by the kernel mid-way,
or swaps the machine to a crawl)."""
from pathlib import Path

from .._env import local_ranks
from ..errors import ConfigError, ModelError
from .planner import plan

CGROUP = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")


def _meminfo_available(path=MEMINFO):
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root=CGROUP):
    """A cgroup v2 limit (a container's, a scheduler's job) less what the group uses, or None
    where there is no limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def available_ram(meminfo=MEMINFO, cgroup=CGROUP):
    """Bytes this process can still get: Linux's MemAvailable, capped by the cgroup's room;
    None where neither can be read (then nothing is checked)."""
    known = [b for b in (_meminfo_available(meminfo), _cgroup_room(cgroup)) if b is not None]
    return min(known) if known else None


def check_fits(cfg, ranks=1):
    """ConfigError, naming the numbers and the ways out, when a CPU run's planned peak (times
    the ranks that share this machine) exceeds the RAM available. cfg: a resolved RunConfig;
    a GPU run is not planned here (its memory is the GPU's)."""
    if not cfg.device.startswith("cpu"):
        return
    try:
        rep = plan(cfg, ranks=ranks)
    except ModelError:
        return  # no model to plan: the run's loading says what is wrong, in its own words
    have = available_ram()
    here = local_ranks() if ranks > 1 else 1
    need = rep["plan"]["peak_bytes"] * here
    if have is None or need <= have:
        return
    ways = "Lower train.batch_size or data.max_seq_len"
    if not rep["run"]["grad_checkpointing"]:
        on = rep["plan"]["checkpointing"]["on"]["peak_bytes"] * here
        ways += f", or set train.grad_checkpointing: true (plans {_mib(on)} MiB)"
    ranks_here = f" ({here} ranks on this machine)" if here > 1 else ""
    raise ConfigError(f"this run plans {_mib(need)} MiB of RAM at its peak{ranks_here} and "
                      f"{_mib(have)} MiB are available: it would be killed for memory. {ways}; "
                      "`packlora memory-report` shows where it goes; --no-memory-check runs it "
                      "anyway")


def _mib(n):
    """Whole MiB for a one-line error (the report's tables keep one decimal: report.mib)."""
    return f"{n / 2**20:,.0f}"
