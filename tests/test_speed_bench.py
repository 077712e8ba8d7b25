"""benchmarks/speed.py: the seconds per phase of a run and the before/after table, against numbers by hand."""

from __future__ import annotations

import json
import math

from conftest import load_benchmark


def _run_dir(tmp_path, rows):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_phases_split_the_wall_time_by_hand(tmp_path):
    speed = load_benchmark("speed")
    rows = [{"iteration": 0, "eval/success": 0.1, "perf/eval_seconds": 4.0},
            {"iteration": 1, "charts/success": 0.2, "perf/rollout_seconds": 2.0, "perf/credit_seconds": 0.5,
             "perf/update_seconds": 3.0, "perf/iteration_seconds": 6.0},
            {"iteration": 2, "charts/success": 0.3, "perf/rollout_seconds": 1.0, "perf/credit_seconds": 0.5,
             "perf/update_seconds": 2.0, "perf/iteration_seconds": 4.0, "eval/success": 0.2,
             "perf/eval_seconds": 5.0, "perf/prm_seconds": 0.25, "perf/old_logprob_seconds": 0.5}]
    run = _run_dir(tmp_path, rows)
    # wall 30: evaluations 4 + 5 = 9, iterations 6 + 4 = 10, so start-up and the rest 30 - 19 = 11; credit
    # 0.5 + 0.5 and iStar's PRM step 0.25; update 3 + 2 and iStar's old-policy log-probs 0.5
    p = speed.phases(run, 30.0)
    assert p == {"startup": 11.0, "eval": 9.0, "rollout": 3.0, "credit": 1.25, "update": 5.5, "wall": 30.0,
                 "iterations": 2}
    # the training metrics drop every clock key and keep the rest, row by row
    assert speed.training_metrics(run) == [{"iteration": 0, "eval/success": 0.1},
                                           {"iteration": 1, "charts/success": 0.2},
                                           {"iteration": 2, "charts/success": 0.3, "eval/success": 0.2}]
    # equal on the keys both runs logged; a key one run dropped is no difference, a changed value is
    a = speed.training_metrics(run)
    assert speed.same_metrics(a, [{k: v for k, v in r.items() if k != "charts/success"} for r in a])
    assert not speed.same_metrics(a, [a[0], a[1], {**a[2], "eval/success": 0.25}])
    assert not speed.same_metrics(a, a[:2])
    # the largest relative difference: 0.3 vs 0.30003 -> 3e-5 / 0.30003 = 9.999e-5; rows or text differ: inf
    assert speed.largest_difference(a, a) == 0.0
    near = [a[0], a[1], {**a[2], "charts/success": 0.30003}]
    assert abs(speed.largest_difference(a, near) - 0.00003 / 0.30003) < 1e-12
    assert speed.largest_difference(a, a[:2]) == math.inf
    assert speed.largest_difference(a, [a[0], a[1], {**a[2], "charts/success": "x"}]) == math.inf


def test_report_takes_medians_and_ratios_by_hand(tmp_path):
    speed = load_benchmark("speed")
    machine = {"cpu_model": "cpu", "cpu_count": 2}

    def line(arm, rep, wall, update, same=True):
        seconds = {"startup": 5.0, "eval": 10.0, "rollout": 4.0, "credit": 1.0, "update": update, "wall": wall}
        return {"label": "a -> b", "script": "graphgpo", "arm": arm, "repeat": rep, "full": False,
                "seconds": seconds, "same_metrics": same, "machine": machine}

    lines = [line("before", 0, 40.0, 20.0), line("after", 0, 30.0, 10.0),
             line("before", 1, 44.0, 22.0), line("after", 1, 28.0, 12.0),
             line("before", 2, 42.0, 30.0), line("after", 2, 29.0, 11.0)]
    out = tmp_path / "speed.jsonl"
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = speed.report(out, tmp_path / "speed.md")
    # medians: wall 42 before, 29 after (ratio 0.69); update 22 before, 11 after (0.50)
    assert "| graphgpo | wall | 42.0 (40.0-44.0) | 29.0 (28.0-30.0) | 0.69 | 3 | yes |" in text
    assert "| graphgpo | update | 22.0 (20.0-30.0) | 11.0 (10.0-12.0) | 0.50 | 3 | yes |" in text
    assert "| graphgpo | eval | 10.0 (10.0-10.0) | 10.0 (10.0-10.0) | 1.00 | 3 | yes |" in text
    lines[3]["same_metrics"] = False  # one repeat whose arms differ: not the same computation
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "| graphgpo | wall | 42.0 (40.0-44.0) | 29.0 (28.0-30.0) | 0.69 | 3 | no |" in speed.report(out, tmp_path / "speed.md")
    # the same episodes, losses moved in the last digits: the largest difference over the repeats is shown
    for x, d in zip(lines, [None, 0.0, None, 2e-7, None, 5e-8]):
        x["largest_difference"] = d
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "| graphgpo | wall | 42.0 (40.0-44.0) | 29.0 (28.0-30.0) | 0.69 | 3 | 2e-07 |" in speed.report(out, tmp_path / "speed.md")
    lines[3]["largest_difference"] = 0.01  # a success rate moved: no
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert "| 0.69 | 3 | no |" in speed.report(out, tmp_path / "speed.md")
