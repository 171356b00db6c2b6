"""Budget parsing, dynamic budgets and the system readers (against a fake /proc and cgroup tree)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daftrain.budget import budgets
from daftrain.budget.budgets import Budget, BudgetError, BudgetTooSmallError, parse_bytes, read_system_memory


@pytest.mark.parametrize(("text", "expected"), [
    ("600MB", 600_000_000), ("600 mb", 600_000_000), ("1.5GiB", int(1.5 * 2**30)), ("2e9", 2_000_000_000),
    ("512", 512), ("64KiB", 65536), (1024, 1024), (2.5e6, 2_500_000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "MB", "12 parsecs", "-5MB", -1, float("nan"), float("inf"), True, None, [1]])
def test_parse_bytes_rejects(bad):
    with pytest.raises(BudgetError):
        parse_bytes(bad)


@pytest.mark.parametrize(("share", "fraction"), [("50%", "0.5"), ("12.5 %", "0.125"), (0.5, "0.5"), ("0.25", "0.25")])
def test_a_share_of_memory_is_refused_naming_budget_system(share, fraction):
    # "50%" or 0.5 was read as a size: an error, or a budget of 0 bytes (truncated) that no plan fits.
    with pytest.raises(BudgetError, match=rf"pass daftrain\.Budget\.system\({fraction}\)"):
        Budget(share)


def test_budget_fixed_and_callable():
    assert Budget("600MB").bytes() == 600_000_000
    assert not Budget(100).is_dynamic
    limit = {"now": "1GB"}
    b = Budget(lambda: limit["now"])
    assert b.is_dynamic and b.bytes() == 10**9
    limit["now"] = 5 * 10**8
    assert b.bytes() == 5 * 10**8
    assert Budget(b).bytes() == 5 * 10**8
    limit["now"] = "-3GB"
    with pytest.raises(BudgetError):
        b.bytes()


V1_UNLIMITED = "9223372036854771712"  # what a v1 cgroup without a limit reports on 64-bit kernels


def _write(d: Path, **files: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("_", ".", 1)).write_text(text + "\n")


def _fake_tree(tmp_path: Path, cgroup: str, avail_kb: int | None = 50 * 2**20) -> tuple[Path, Path]:
    """A fake /proc (``cgroup`` is /proc/self/cgroup's text; no meminfo if ``avail_kb`` is None) and an
    empty cgroup mount root; tests add the cgroup files they need with ``_write``."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if avail_kb is not None:
        (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {avail_kb} kB\n")
    root.mkdir()
    return root, proc


def _v2_tree(tmp_path: Path, cg_max: str, cg_cur: str, avail_kb: int = 50 * 2**20) -> tuple[Path, Path]:
    root, proc = _fake_tree(tmp_path, "0::/job/worker\n", avail_kb)
    _write(root / "job" / "worker", memory_max=cg_max, memory_current=cg_cur)
    _write(root / "job", memory_max="max", memory_current="1")
    return root, proc


def _v1_tree(tmp_path: Path, limit: str, usage: str, avail_kb: int = 50 * 2**20,
             parent_limit: str = V1_UNLIMITED) -> tuple[Path, Path]:
    """A hybrid machine: the v2 tree at unified/ without the memory controller, memory under v1."""
    root, proc = _fake_tree(tmp_path, "5:cpu,cpuacct:/elsewhere\n4:memory:/job/worker\n0::/\n", avail_kb)
    _write(root / "unified", cgroup_controllers="hugetlb")
    _write(root / "cpu,cpuacct" / "elsewhere", memory_limit_in_bytes="1", memory_usage_in_bytes="1")
    _write(root / "memory", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=str(10**9))
    _write(root / "memory" / "job", memory_limit_in_bytes=parent_limit, memory_usage_in_bytes=str(700 * 2**20))
    _write(root / "memory" / "job" / "worker", memory_limit_in_bytes=limit, memory_usage_in_bytes=usage)
    return root, proc


def test_cgroup_limit_wins_over_meminfo(tmp_path):
    root, proc = _v2_tree(tmp_path, str(800 * 2**20), str(300 * 2**20))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "cgroup v2"
    assert mem.cgroup_max == 800 * 2**20 and mem.cgroup_current == 300 * 2**20
    assert mem.cgroup_path == root / "job" / "worker"
    assert mem.available == 500 * 2**20  # 800 MiB - 300 MiB, tighter than 50 GiB of MemAvailable


def test_unlimited_cgroup_falls_back_to_meminfo(tmp_path):
    root, proc = _v2_tree(tmp_path, "max", str(300 * 2**20), avail_kb=2 * 2**20)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "meminfo"
    assert mem.cgroup_max is None and mem.cgroup_path is None
    assert mem.available == 2 * 2**30


def test_meminfo_wins_when_tighter_than_the_cgroup(tmp_path):
    root, proc = _v2_tree(tmp_path, str(8 * 2**30), str(2**30), avail_kb=2**20)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "meminfo"
    assert mem.cgroup_max == 8 * 2**30  # still reported
    assert mem.available == 2**30


def test_v2_ancestor_with_less_room_binds(tmp_path):
    root, proc = _v2_tree(tmp_path, str(2000 * 2**20), str(100 * 2**20))
    _write(root / "job", memory_max=str(1000 * 2**20), memory_current=str(900 * 2**20))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_path, mem.available) == ("cgroup v2", root / "job", 100 * 2**20)


def test_v2_under_unified_on_a_hybrid_machine(tmp_path):
    root, proc = _fake_tree(tmp_path, "0::/job\n")
    _write(root / "unified" / "job", memory_max=str(2**30), memory_current=str(2**28))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_path, mem.available) == ("cgroup v2", root / "unified" / "job", 3 * 2**28)


def test_v1_limit_on_a_hybrid_machine(tmp_path):
    root, proc = _v1_tree(tmp_path, str(800 * 2**20), str(300 * 2**20))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "cgroup v1"
    assert (mem.cgroup_max, mem.cgroup_current) == (800 * 2**20, 300 * 2**20)
    assert mem.cgroup_path == root / "memory" / "job" / "worker"
    assert mem.available == 500 * 2**20


def test_v1_huge_limit_means_unlimited(tmp_path):
    root, proc = _v1_tree(tmp_path, V1_UNLIMITED, str(300 * 2**20), avail_kb=2 * 2**20)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_max, mem.available) == ("meminfo", None, 2 * 2**30)


def test_v1_ancestor_with_less_room_binds(tmp_path):
    root, proc = _v1_tree(tmp_path, V1_UNLIMITED, str(300 * 2**20), parent_limit=str(1000 * 2**20))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_path, mem.available) == ("cgroup v1", root / "memory" / "job", 300 * 2**20)


def test_v1_memory_among_other_controllers(tmp_path):
    root, proc = _fake_tree(tmp_path, "3:cpu,memory:/job\n")
    _write(root / "memory" / "job", memory_limit_in_bytes=str(2**30), memory_usage_in_bytes=str(2**29))
    assert read_system_memory(cgroup_root=root, proc=proc).available == 2**29


def test_container_without_cgroup_namespace_reads_the_mount_root(tmp_path):
    """/proc/self/cgroup names /docker/<id>, but the container's mount shows that cgroup as its root."""
    root, proc = _fake_tree(tmp_path, "4:memory:/docker/0123abcd\n0::/\n")
    _write(root / "memory", memory_limit_in_bytes=str(2**30), memory_usage_in_bytes=str(2**28))
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_path, mem.available) == ("cgroup v1", root / "memory", 3 * 2**28)


@pytest.mark.parametrize("missing", ["proc_cgroup", "usage", "limit", "unparsable"])
def test_missing_cgroup_files_fall_back_to_meminfo(tmp_path, missing):
    root, proc = _v1_tree(tmp_path, str(800 * 2**20), str(300 * 2**20), avail_kb=2**20)
    worker = root / "memory" / "job" / "worker"
    if missing == "proc_cgroup":
        (proc / "self" / "cgroup").unlink()
    elif missing == "usage":
        (worker / "memory.usage_in_bytes").unlink()
    elif missing == "limit":
        (worker / "memory.limit_in_bytes").unlink()
    else:
        (worker / "memory.limit_in_bytes").write_text("eight hundred\n")
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert (mem.source, mem.cgroup_max, mem.available) == ("meminfo", None, 2**30)


def test_no_meminfo_falls_back_to_psutil(tmp_path):
    pytest.importorskip("psutil")
    root, proc = _fake_tree(tmp_path, "0::/\n", avail_kb=None)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "psutil" and mem.mem_available is not None and mem.mem_available > 0


def test_system_budget_follows_the_cgroup_every_read(tmp_path, monkeypatch):
    """``Budget.system`` reads the cgroup again at every ``bytes()``: another process in the cgroup
    taking 400 MiB lowers it by ``fraction`` of that, and freeing it restores it."""
    root, proc = _v1_tree(tmp_path, str(2000 * 2**20), str(500 * 2**20))
    usage = root / "memory" / "job" / "worker" / "memory.usage_in_bytes"
    monkeypatch.setattr(budgets, "read_system_memory", lambda: read_system_memory(cgroup_root=root, proc=proc))
    monkeypatch.setattr(budgets, "current_rss_bytes", lambda: 300 * 2**20)
    b = Budget.system(0.5)
    assert b.bytes() == 300 * 2**20 + 750 * 2**20
    usage.write_text(str(900 * 2**20))
    assert b.bytes() == 300 * 2**20 + 550 * 2**20
    usage.write_text(str(500 * 2**20))
    assert b.bytes() == 300 * 2**20 + 750 * 2**20


# -- a real cgroup ---------------------------------------------------------------------------------

def _own_memory_cgroup() -> tuple[int, Path] | None:
    """(version, directory) of this process's cgroup in the hierarchy holding the memory controller,
    where a child cgroup would get a memory limit."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return 1, Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        if hid == "0" and not controllers:
            for base in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
                d = base / path.lstrip("/")
                try:
                    if "memory" in (d / "cgroup.subtree_control").read_text().split():
                        return 2, d
                except OSError:
                    continue
    return None


@pytest.fixture
def memory_cgroup():
    """A child of this process's memory cgroup (v1 or v2) limited to 1 GiB, removed afterwards.
    Skipped only where the machine does not let this process create one."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup this process may create children in (the file-backed trees above cover "
                    "the reader)")
    version, parent = found
    path = parent / f"daftrain-test-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            pytest.skip(f"creating a cgroup under {parent} is not permitted ({exc.strerror})")
        raise
    try:
        (path / ("memory.limit_in_bytes" if version == 1 else "memory.max")).write_text(str(2**30))
        yield version, path
    finally:
        for _ in range(50):  # the processes that were in it may take a moment to leave
            try:
                path.rmdir()
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.1)


_IN_CGROUP = r"""
import json, os, subprocess, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))  # join before allocating anything: what follows is charged to the cgroup
from daftrain.budget.budgets import Budget, read_system_memory
budget = Budget.system(1.0)
def snap():
    m = read_system_memory()
    return {"source": m.source, "max": m.cgroup_max, "current": m.cgroup_current, "path": str(m.cgroup_path),
            "budget": budget.bytes()}
out = [snap()]
hog = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(128 << 20); b[::4096] = b'x' * 32768; "
                        "print(flush=True); sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
hog.stdout.readline()
out.append(snap())
hog.stdin.close()
hog.wait()
out.append(snap())
print(json.dumps(out))
"""


def test_reader_sees_a_real_cgroup_limit_and_what_another_process_adds(memory_cgroup):
    """In a real 1 GiB memory cgroup, a second process touching 128 MiB raises the usage the reader sees
    and lowers ``Budget.system(1.0)`` by as much; when it exits both come back."""
    version, path = memory_cgroup
    proc = subprocess.run([sys.executable, "-c", _IN_CGROUP, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, held, after = json.loads(proc.stdout.splitlines()[-1])
    mib = 2**20
    for snap in (before, held, after):
        assert (snap["source"], snap["max"], snap["path"]) == (f"cgroup v{version}", 2**30, str(path)), snap
    assert 128 * mib <= held["current"] - before["current"] <= 176 * mib, (before, held)
    assert 120 * mib <= before["budget"] - held["budget"] <= 176 * mib, (before, held)
    assert abs(after["current"] - before["current"]) < 32 * mib, (before, after)
    assert abs(after["budget"] - before["budget"]) < 32 * mib, (before, after)


def test_system_budget_reads_real_machine():
    b = Budget.system(0.5)
    assert b.is_dynamic
    mem = read_system_memory()
    assert mem.process_rss > 0 < b.bytes()
    assert b.bytes() >= mem.process_rss
    with pytest.raises(BudgetError):
        Budget.system(0)


def test_too_small_error_names_required_budget():
    err = BudgetTooSmallError(100_000_000, 345_678_901)
    assert err.required_bytes == 345_678_901
    assert "345678901 bytes" in str(err) and "345.7 MB" in str(err)


@pytest.mark.parametrize(("text", "expected"), [
    ("4.1GB", 4_100_000_000), ("4.1 MB", 4_100_000), ("2.01MB", 2_010_000), ("64.1kB", 64_100),
    ("547.5 MB", 547_500_000),
])
def test_parse_bytes_reads_decimals_exactly(text, expected):
    """Floats read "4.1GB" as 4099999999 bytes: one byte short of a budget an error message named."""
    assert parse_bytes(text) == expected


def test_too_small_error_shows_a_figure_that_fits():
    """The figure in the message is rounded up, so the budget written as shown is enough."""
    err = BudgetTooSmallError(100_000_000, 547_430_000)
    assert "547.5 MB" in str(err) and "547.4 MB" not in str(err)
    assert parse_bytes("547.5 MB") >= err.required_bytes


@pytest.mark.parametrize(("bad", "what"), [
    ("12 parsecs", "use B, kB, MB"), ("-5MB", "write e.g. '600MB'"), (-1, "pass bytes >= 0"),
    (float("nan"), "pass bytes or e.g. '600MB'"),
    ([1], "pass bytes or a string like '600MB'"), ("MB", "write e.g. '600MB'"),
])
def test_parse_bytes_errors_say_what_to_pass(bad, what):
    with pytest.raises(BudgetError, match="memory size") as info:
        parse_bytes(bad)
    assert what in str(info.value)


def test_system_budget_fraction_error_names_it():
    with pytest.raises(BudgetError, match=r"Budget.system fraction must be in \(0, 1\], e.g. 0.9"):
        Budget.system(1.5)
