"""`--resume RUN_DIR`: a run killed mid-way and resumed ends with the metrics and the adapter of the same run
left alone (micro tiny policy, one torch thread, so both are deterministic on one machine). The same
comparison shows that two runs of one command with one seed write the same metrics (the killed run's
iterations before the kill are its own); a run with another seed writes others (checked once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, _script_env, adapter_tensors, load_benchmark, read_metrics

# Per script: a micro run of 4 iterations with a checkpoint after each.
COMMON = ["--model-name", "tiny", "--tiny-preset", "micro", "--torch-threads", "1", "--num-iterations", "4",
          "--checkpoint-every", "1", "--eval-every", "2", "--eval-num-tasks", "2", "--lora-r", "4", "--lora-alpha", "8"]
RESUME = {
    "graphgpo.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "4"],
    # positives: no invalid action, so the PRM has pairs and its replay buffer fills
    "istar.py": ["--tasks-per-iteration", "2", "--group-size", "2", "--max-turns", "4", "--positive-threshold",
                 "-0.05", "--sokoban-reward", "sparse"],
    "delta_belief.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "3", "--eval-k", "1",
                        "--max-new-tokens", "10"],
    "aria.py": ["--games-per-iteration", "4", "--eval-k", "1", "--max-new-tokens", "10", "--eval-opponents", "fair"],
    "epo.py": ["--episodes-per-iteration", "4", "--num-epochs", "2", "--trajectories-per-step", "2",
               "--eval-opponents", "fair"],
}


def _deterministic(rows: list[dict]) -> list[dict]:
    """The metrics without the wall-clock ones (seconds, shares of time, tokens per second)."""
    clock = ("perf/", "_seconds", "_time_frac")
    return [{k: v for k, v in r.items() if not any(c in k for c in clock)} for r in rows]


def _run(script: str, args: list, out: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / script), *args, "--output-dir", str(out)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("script", sorted(RESUME))
def test_killed_run_resumes_to_the_same_metrics(script, tiny_cache, method_pool, tmp_path):
    args = [*COMMON, *RESUME[script]]
    whole = method_pool(script, *args, out=tmp_path / "whole")
    other = method_pool(script, *args, "--seed", "4", out=tmp_path / "other") if script == "graphgpo.py" else None
    env = _script_env(tiny_cache)
    proc = _run(script, args, tmp_path / "killed", env)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:  # kill it once iteration 2 is logged
        runs = list((tmp_path / "killed").glob("*/metrics.jsonl"))
        if runs and any(json.loads(line)["iteration"] >= 2 and "charts/success" in json.loads(line)
                        for line in runs[0].read_text().splitlines() if line.strip()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    output = proc.communicate()[0]
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{output[-3000:]}"
    run_dir = next((tmp_path / "killed").iterdir())
    assert not (run_dir / "summary.json").exists()
    resumed = subprocess.run([sys.executable, str(REPO / script), "--resume", str(run_dir)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "(resumed)" in resumed.stdout
    reference = whole.result()
    assert _deterministic(read_metrics(run_dir)) == _deterministic(read_metrics(reference))
    a, b = adapter_tensors(run_dir), adapter_tensors(reference)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    learning = load_benchmark("learning").run_learning
    assert learning(run_dir) == learning(reference)
    if other is not None:  # the equality above is not vacuous
        assert _deterministic(read_metrics(other.result())) != _deterministic(read_metrics(reference))


def test_resume_without_a_checkpoint_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(REPO / "graphgpo.py"), "--resume", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "error: --resume" in proc.stderr and "no checkpoint.pt" in proc.stderr
