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


def _run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "daftrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--batch-size", "0"], "batch_size"),
        (["--steps", "0"], "steps"),
        (["--eval-samples", "0"], "eval_samples"),
        (["--eval-samples", "10001"], "eval_samples"),
        (["--bits", "3"], "bits"),
        (["--group-size", "48"], "group_size"),
        (["--lr", "0"], "lr"),
        (["--lr", "nan"], "lr"),
        (["--width", "0"], "width"),
        (["--threads", "-1"], "threads"),
        (["--seed", "-1"], "seed"),
        (["--steps", "two"], "steps"),
    ],
)
def test_demo_rejects_bad_arguments_before_training(flags, named):
    """Each bad value exits 2 at once (argparse), naming the flag and the field, before any training."""
    proc = _run_cli("demo", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    flag = flags[0]
    assert f"argument {flag}: {named} must be" in proc.stderr, proc.stderr
    assert "saved activations" not in proc.stdout and "daftrain demo:" not in proc.stdout


def test_demo_json_into_an_unwritable_place_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _run_cli("demo", "--json", str(blocker / "sub" / "out.json"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "argument --json: out_json: cannot create the directory" in proc.stderr
    assert "daftrain demo:" not in proc.stdout  # no training started
    proc = _run_cli("demo", "--json", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr


def test_demo_json_directory_is_created_before_training(tmp_path):
    out = tmp_path / "missing" / "deeper" / "demo.json"
    proc = _run_cli("demo", "--steps", "1", "--batch-size", "4", "--eval-samples", "10", "--width", "4",
                    "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["method"] for r in json.loads(out.read_text())["results"]] == ["plain", "daftrain"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("steps", 0), ("batch_size", 0), ("eval_samples", 0), ("bits", 3), ("group_size", 100), ("lr", -1.0),
     ("lr", float("inf")), ("width", 0), ("threads", -2), ("seed", -1), ("steps", 2.5), ("batch_size", True)],
)
def test_demo_args_validate_on_construction(field, value):
    from daftrain.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=f"^{field} must be"):
        DemoArgs(**{field: value})


def test_demo_runs_past_the_end_of_the_training_set(monkeypatch):
    """A run longer than the (small) training set starts over instead of training on empty batches."""
    import torch

    from daftrain.demo import run as demo_run

    real = demo_run.image_dataset

    def small(split, limit=None, **kw):  # type: ignore[no-untyped-def]
        return real(split, limit=min(limit, 8) if split == "train" else limit, **kw)

    monkeypatch.setattr(demo_run, "image_dataset", small)
    result = run_method("plain", DemoArgs(steps=3, batch_size=4, eval_samples=10, width=4))
    assert torch.isfinite(torch.tensor(result.final_loss))
