"""The demo's printed report: process peak memory next to saved bytes (the runs are tested in test_cli.py)."""

from __future__ import annotations

from daftrain.demo.run import DemoResult, format_table


def _result(method: str, saved: int, peak: int, summary: str = "") -> DemoResult:
    return DemoResult(method=method, saved_activation_bytes=saved, peak_rss_bytes=peak, step_time_s=0.5,
                      final_loss=1.0, test_accuracy=0.5, data_source="test", first_step_time_s=0.75,
                      stats_summary=summary)


def test_table_shows_the_process_peak_and_its_ratio_to_plain() -> None:
    summary = "saved tensors: ...; process peak: RSS 475 MB"
    plain, packed = _result("plain", 600_000_000, 950_000_000), _result("daftrain", 43_000_000, 475_000_000, summary)
    table = format_table([plain, packed])
    lines = table.splitlines()
    peak = lines.index(next(line for line in lines if line.startswith("process peak RSS (MB)")))
    assert lines[peak].split()[-2:] == ["950", "475"]
    assert lines[peak + 1].split()[-4:] == ["1.00x", "less", "2.00x", "less"]
    assert lines[peak - 2].startswith("saved activations (MB)")  # right below the saved bytes
    assert any(line.startswith("first step (s)") and line.split()[-2:] == ["0.75", "0.75"] for line in lines)
    assert lines[-1] == f"daftrain, last step: {summary}"


def test_plain_has_no_stats_line() -> None:
    table = format_table([_result("plain", 1, 1), _result("plain", 1, 1)])
    assert "last step" not in table
