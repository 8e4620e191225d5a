"""The RAM a run can still get (packlora.memory.fit): Linux's MemAvailable, capped by a cgroup."""
from packlora.memory.fit import available_ram


def _files(tmp_path, meminfo=None, limit=None, current=None):
    mem, cg = tmp_path / "meminfo", tmp_path / "cgroup"
    cg.mkdir(parents=True)
    if meminfo is not None:
        mem.write_text(meminfo)
    if limit is not None:
        (cg / "memory.max").write_text(f"{limit}\n")
        (cg / "memory.current").write_text(f"{current}\n")
    return mem, cg


MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n"


def test_meminfo_alone(tmp_path):
    assert available_ram(*_files(tmp_path, MEMINFO)) == 20000000 * 1024
    assert available_ram(*_files(tmp_path / "b", MEMINFO, "max", 5)) == 20000000 * 1024


def test_a_cgroup_limit_caps_it(tmp_path):
    mem, cg = _files(tmp_path, MEMINFO, 8 << 30, 3 << 30)
    assert available_ram(mem, cg) == 5 << 30
    mem, cg = _files(tmp_path / "b", MEMINFO, 1 << 30, 2 << 30)  # over its limit already
    assert available_ram(mem, cg) == 0


def test_unreadable_is_none(tmp_path):
    assert available_ram(*_files(tmp_path)) is None
    assert available_ram(*_files(tmp_path / "b", "MemTotal: 5 kB\n")) is None
    mem, cg = _files(tmp_path / "c", None, "garbage", 1)
    assert available_ram(mem, cg) is None


def test_this_machine():
    have = available_ram()
    assert have is None or 0 < have < 1 << 50
