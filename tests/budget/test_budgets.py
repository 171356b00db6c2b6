"""Budget parsing, dynamic budgets and the system readers (against a fake /proc and cgroup tree)."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _fake_tree(tmp_path: Path, cg_max: str, cg_cur: str, avail_kb: int) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/job/worker\n")
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemFree: 1 kB\nMemAvailable: {avail_kb} kB\n")
    d = root / "job" / "worker"
    d.mkdir(parents=True)
    (d / "memory.max").write_text(cg_max + "\n")
    (d / "memory.current").write_text(cg_cur + "\n")
    (root / "job" / "memory.max").write_text("max\n")
    (root / "job" / "memory.current").write_text("1\n")
    return root, proc


def test_cgroup_limit_wins_over_meminfo(tmp_path):
    root, proc = _fake_tree(tmp_path, str(800 * 2**20), str(300 * 2**20), avail_kb=50 * 2**20)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "cgroup"
    assert mem.cgroup_max == 800 * 2**20
    assert mem.available == 500 * 2**20  # 800 MiB - 300 MiB, tighter than 50 GiB of MemAvailable


def test_unlimited_cgroup_falls_back_to_meminfo(tmp_path):
    root, proc = _fake_tree(tmp_path, "max", str(300 * 2**20), avail_kb=2 * 2**20)
    mem = read_system_memory(cgroup_root=root, proc=proc)
    assert mem.source == "meminfo"
    assert mem.cgroup_max is None
    assert mem.available == 2 * 2**30


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
