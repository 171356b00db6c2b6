"""The daftrain command: help text, env, and a short demo run end to end."""

import json
import subprocess
import sys

import pytest

from daftrain import cli
from daftrain.demo.run import DemoArgs, DemoResult, format_table, run_method


def test_demo_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--steps", "--batch-size", "--bits", "--group-size", "--eval-samples", "--lr", "--width", "--seed"):
        assert flag in out
    assert "Training steps per method" in out


def test_env_prints_json(capsys):
    assert cli.main(["env"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"daftrain", "torch", "threads", "kernels"} <= report.keys()


def test_demo_worker_trains_and_measures():
    args = DemoArgs(steps=3, batch_size=16, eval_samples=100, width=8)
    plain, packed = run_method("plain", args), run_method("daftrain", args)
    assert packed.saved_activation_bytes * 8 < plain.saved_activation_bytes  # 2 bits: ~14x less
    for r in (plain, packed):
        assert r.step_time_s > 0 and r.peak_rss_bytes > 0 and 0 <= r.test_accuracy <= 1
    assert "Fashion-MNIST" in plain.data_source or "FALLBACK" in plain.data_source
    table = format_table([plain, packed])
    assert "saved activations (MB)" in table and "test accuracy" in table


def test_demo_command_runs_each_method_in_its_own_process(tmp_path):
    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "daftrain.cli", "demo", "--steps", "2", "--batch-size", "8",
           "--eval-samples", "50", "--width", "8", "--json", str(out)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    assert "saved activations (MB)" in proc.stdout
    results = [DemoResult(**r) for r in json.loads(out.read_text())["results"]]
    assert [r.method for r in results] == ["plain", "daftrain"]
