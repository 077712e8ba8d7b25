"""The results pipeline: benchmarks/report.py's statistics and tables against numbers computed by hand,
its marker replacement and --check, and benchmarks/learning.py end to end on a micro run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import learning  # noqa: E402
import report  # noqa: E402
import first_iteration  # noqa: E402

# ---------------------------------------------------------------------------------------------
# A toy benchmark: method "m" and baseline "b" on seeds 4, 5, 6
# ---------------------------------------------------------------------------------------------
TOY = report.Table("toy", "docs/toy.md", "graphgpo", {"m": ("Method", ""), "b": ("Base", "--step-advantage none")},
                   method="m", baselines=("b",), seeds=(4, 5, 6), parallel=1)
TOY_SUMMARY = report.Summary(rows=(("toy", "m", "b"),), power_rows=(("toy", "m", "b"),))


def line(variant, seed, before, after, change_se=0.03, wall=100.0, greedy=(0.7, 0.7), flags=None):
    """One result line as benchmarks/learning.py writes it (only what report.py reads is realistic)."""
    flags = TOY.flags(variant) if flags is None else flags
    return {"bench": "toy", "script": "graphgpo.py", "variant": variant, "variant_flags": flags, "extra_flags": [],
            "command": learning.user_command("graphgpo", seed, flags, []), "seed": seed, "env_id": "sokoban",
            "metric": "eval/success", "before": before, "before_se": 0.02, "after": after, "after_se": 0.02,
            "change": round(after - before, 10), "change_se": change_se, "fell": False,
            "greedy": {"metric": "eval/success_greedy", "before": greedy[0], "before_se": 0.03,
                       "after": greedy[1], "after_se": 0.03},
            "curve": [{"iteration": 0, "value": before, "se": 0.02}, {"iteration": 40, "value": after, "se": 0.02}],
            "credit_means": {}, "perf_means": {}, "wall_seconds": wall, "iterations": 40, "config": {},
            "tiny_policy": {"model_name": "tiny", "tiny": True, "dir": "sokoban__default__abc", "weights_sha256": "00ff"},
            "machine": {"cpu_model": "Test CPU", "cpu_count": 2, "load_average_start": [1.0, 1, 1],
                        "load_average_end": [2.0, 1, 1]},
            "git": {"commit": "0123456789abcdef", "dirty": False}, "parallel": 1, "finished_at": "2026-01-01T00:00:00Z"}


# Hand arithmetic for the fixture below (SE = sample std / sqrt(n), n = 3 seeds):
#   m: before 0.40, 0.50, 0.45 -> mean 0.45; after 0.60, 0.55, 0.65 -> mean 0.60
#      changes +0.20, +0.05, +0.20 -> mean 0.15; deviations +0.05, -0.10, +0.05; squares sum 0.015;
#      variance 0.015 / 2 = 0.0075; SE = sqrt(0.0075 / 3) = sqrt(0.0025) = 0.05
#      greedy before 0.7 (all), after 0.8, 0.7, 0.9 -> 0.8; wall 100, 300, 200 -> median 200 [100, 300]
#   b: before 0.40, 0.50, 0.45 -> 0.45; after 0.50, 0.55, 0.45 -> 1.50 / 3 = 0.50
#      changes +0.10, +0.05, 0.00 -> mean 0.05; squares 0.0025 + 0 + 0.0025 = 0.005; variance 0.0025;
#      SE = sqrt(0.0025 / 3) = 0.028868
#   paired m - b, same seed: +0.10, 0.00, +0.20 -> mean 0.10; squares 0 + 0.01 + 0.01 = 0.02;
#      variance 0.01; SE = sqrt(0.01 / 3) = 0.057735
FIXTURE = [
    line("m", 5, 0.50, 0.90),  # an older line for (m, 5): the later one below replaces it
    line("m", 4, 0.40, 0.60, wall=100.0, greedy=(0.7, 0.8)),
    line("m", 5, 0.50, 0.55, wall=300.0, greedy=(0.7, 0.7)),
    line("m", 6, 0.45, 0.65, wall=200.0, greedy=(0.7, 0.9)),
    line("b", 4, 0.40, 0.50),
    line("b", 5, 0.50, 0.55),
    line("b", 6, 0.45, 0.45),
    line("b", 6, 0.45, 0.95, flags=["--step-advantage", "gigpo"]),  # other flags: not this table's variant b
    line("b", 9, 0.45, 0.95),  # seed 9 is not one of the table's seeds
]


@pytest.fixture
def toy_records(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in FIXTURE))
    return learning.read_results(path)


def test_mean_se_by_hand():
    mean, se = report.mean_se([0.20, 0.05, 0.20])
    assert mean == pytest.approx(0.15) and se == pytest.approx(0.05)
    assert report.mean_se([0.3]) == (0.3, None)  # one seed: no spread to estimate


def test_stats_and_paired_difference_by_hand(toy_records):
    runs = report.select(TOY, toy_records)
    assert sorted(runs["m"]) == [4, 5, 6] and sorted(runs["b"]) == [4, 5, 6]
    assert runs["m"][5]["after"] == 0.55  # the last line of a repeated (variant, seed) counts
    assert runs["b"][6]["after"] == 0.45  # the line with other flags is not variant b of this table
    m, b = report.variant_stats(runs["m"]), report.variant_stats(runs["b"])
    assert (m["before"], m["after"]) == (pytest.approx(0.45), pytest.approx(0.60))
    assert (m["change"], m["change_se"]) == (pytest.approx(0.15), pytest.approx(0.05))
    assert (b["after"], b["change"], b["change_se"]) == (pytest.approx(0.50), pytest.approx(0.05),
                                                         pytest.approx(0.028868, abs=1e-6))
    assert (m["greedy_before"], m["greedy_after"]) == (pytest.approx(0.7), pytest.approx(0.8))
    assert (m["wall_median"], m["wall_min"], m["wall_max"]) == (200.0, 100.0, 300.0)
    assert m["per_seed"][4] == (pytest.approx(0.20), 0.03)
    d = report.paired(runs["m"], runs["b"])
    assert d["seeds"] == [4, 5, 6]
    assert [d["per_seed"][s] for s in (4, 5, 6)] == [pytest.approx(0.10), pytest.approx(0.0), pytest.approx(0.20)]
    assert (d["mean"], d["se"]) == (pytest.approx(0.10), pytest.approx(0.057735, abs=1e-6))


def test_paired_difference_uses_only_common_seeds(toy_records):
    runs = report.select(TOY, toy_records)
    del runs["b"][5]  # seeds 4, 6 in common: differences +0.10, +0.20 -> mean 0.15, SE = 0.070711 / sqrt(2) = 0.05
    d = report.paired(runs["m"], runs["b"])
    assert d["seeds"] == [4, 6] and d["mean"] == pytest.approx(0.15) and d["se"] == pytest.approx(0.05)
    assert report.paired(runs["m"], {}) is None


def test_earlier_defaults_select_lines_by_their_config():
    """A table whose runs had defaults the script no longer has: its commands carry the flags that restore
    them, and it takes the lines run with those flags or run without flags at those config values; a line
    run without flags at other values (the new defaults) is not its."""
    table = report.Table("toy", "docs/toy.md", "graphgpo", {"m": ("Method", "")}, method="m", baselines=(),
                         seeds=(4, 5, 6, 7), earlier="--group-size 8 --lr 0.5")
    old = dict(line("m", 4, 0.4, 0.5), config={"group_size": 8, "lr": 0.5})
    new = dict(line("m", 5, 0.4, 0.5), config={"group_size": 4, "lr": 0.5})
    flagged = dict(line("m", 6, 0.4, 0.5), extra_flags=["--group-size", "8", "--lr", "0.5"],
                   config={"group_size": 8, "lr": 0.5})
    half = dict(line("m", 7, 0.4, 0.5), config={"group_size": 8})  # no lr in its config: not a match
    assert sorted(report.select(table, [old, new, flagged, half])["m"]) == [4, 6]
    assert table.runner_command().endswith("--out docs/results/toy.jsonl -- --group-size 8 --lr 0.5")
    assert report.config_has({"group_size": 8}, ["--group-size", "8"])
    assert not report.config_has({"group_size": 4}, ["--group-size", "8"])
    # an older run: the option left to its preset (None), the value it ran with under resolved_<name>
    assert report.config_has({"learning_rate": None, "resolved_learning_rate": 0.0005},
                             ["--learning-rate", "0.0005"])
    assert not report.config_has({"learning_rate": None, "resolved_learning_rate": 0.00025},
                                 ["--learning-rate", "0.0005"])
    assert not report.config_has({"learning_rate": 0.00025, "resolved_learning_rate": 0.0005},
                                 ["--learning-rate", "0.0005"])
    with pytest.raises(ValueError):
        report.config_has({}, ["--group-size"])


def test_paired_evaluation_cells_show_both_ses(tmp_path):
    """A run whose evaluations were paired episode by episode shows its paired SE, and in brackets the SE of
    two independent evaluations; the sentence above the cells says so. Lines without `paired` (results from
    before common random numbers) show one SE."""
    recs = [dict(line("m", 4, 0.40, 0.50, change_se=0.031), paired=True, change_se_quadrature=0.047),
            line("b", 4, 0.40, 0.45)]
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = report.render_table(TOY, learning.read_results(path))
    assert "| Method change | +0.100 ± 0.031 [0.047] | +0.100 ± n/a (1 seed) |" in text
    assert "| Base change | +0.050 ± 0.030 | +0.050 ± n/a (1 seed) |" in text
    assert "paired episode by episode, with common random numbers; in brackets the SE of two independent" in text
    # 0.10 > 2 x 0.031: the paired SE decides `rose` (it would not clear 2 x 0.047)
    assert "| +0.100 ± n/a (1 seed) | 1/1 |" in text


def test_train_success_sentence_by_hand(tmp_path):
    """Runs that recorded `train_charts` get one sentence with the training rollouts' success, first → last
    quarter, averaged over those runs: Method (0.30 → 0.50, 0.40 → 0.70) is 0.350 → 0.600 over 2 runs; Base's
    seed 5 recorded none, so it is seed 4's 0.20 → 0.30 over 1 run. Without any such run: no sentence."""
    def charts(first, last):
        return {"iterations": 10, "first": {"charts/success": first, "charts/return": 9.0},
                "last": {"charts/success": last, "charts/return": 9.0}}
    recs = [dict(line("m", 4, 0.4, 0.5), train_charts=charts(0.30, 0.50)),
            dict(line("m", 5, 0.4, 0.5), train_charts=charts(0.40, 0.70)),
            dict(line("b", 4, 0.4, 0.5), train_charts=charts(0.20, 0.30)), line("b", 5, 0.4, 0.5)]
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = report.render_table(TOY, learning.read_results(path))
    assert ("quarter of the iterations, runs that recorded it): Method 0.350 → 0.600 (2 runs); "
            "Base 0.200 → 0.300 (1 run).") in text
    assert "`charts/success` of the training rollouts" in text
    path.write_text("".join(json.dumps(line(v, s, 0.4, 0.5)) + "\n" for v in "mb" for s in (4, 5)))
    assert "training rollouts" not in report.render_table(TOY, learning.read_results(path))
    # one key for the whole table: the metric's own (`charts/payoff_share` of `eval/payoff_share`) when any run
    # has it; a run with only `charts/success` is then left out, not shown under the other key's name
    share = {"iterations": 10, "first": {"charts/payoff_share": 0.40, "charts/success": 0.1},
             "last": {"charts/payoff_share": 0.46, "charts/success": 0.2}}
    recs = [dict(line("m", 4, 0.4, 0.5), metric="eval/payoff_share", train_charts=share),
            dict(line("b", 4, 0.4, 0.5), metric="eval/payoff_share", train_charts=charts(0.20, 0.30))]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = report.render_table(TOY, learning.read_results(path))
    assert "(`charts/payoff_share` of the training rollouts" in text
    assert "runs that recorded it): Method 0.400 → 0.460 (1 run)." in text


def test_window_means_by_hand():
    # 8 training iterations with charts/success 0.1 ... 0.8, and two evaluation rows that log no charts/* key:
    # a quarter is 2 iterations; first (0.1 + 0.2) / 2 = 0.15, last (0.7 + 0.8) / 2 = 0.75
    rows = [{"iteration": 0, "eval/success": 0.3}]
    rows += [{"iteration": i, "charts/success": i / 10, "charts/flag": True, "credit/x": 1.0} for i in range(1, 9)]
    rows += [{"iteration": 8, "eval/success": 0.4}]
    w = learning.window_means(rows, "charts/")
    assert w["iterations"] == 2 and list(w["first"]) == ["charts/success"]  # a bool is not a metric
    assert w["first"]["charts/success"] == pytest.approx(0.15) and w["last"]["charts/success"] == pytest.approx(0.75)
    assert learning.window_means(rows[:3], "charts/")["iterations"] == 1  # two iterations: one each, not zero
    assert learning.window_means(rows, "nothing/") == {}


def test_paired_curve_by_hand():
    def run(*points):
        return {"curve": [{"iteration": i, "value": v, "se": 0.02} for i, v in points]}

    method = {4: run((0, 0.3), (10, 0.40), (20, 0.50)), 5: run((0, 0.3), (10, 0.35), (20, 0.45)),
              6: run((0, 0.3), (10, 0.50))}
    base = {4: run((0, 0.3), (10, 0.30), (20, 0.40)), 5: run((0, 0.3), (10, 0.35), (20, 0.35)),
            6: run((0, 0.3), (20, 0.30))}
    # seed 4: (0.10 + 0.10) / 2 = 0.10; seed 5: (0.00 + 0.10) / 2 = 0.05; iteration 0 is not counted;
    # seed 6: no evaluation after iteration 0 in common -> left out. Mean 0.075, SE = 0.035355 / sqrt(2) = 0.025
    d = report.paired_curve(method, base)
    assert d["seeds"] == [4, 5]
    assert d["per_seed"][4] == pytest.approx(0.10) and d["per_seed"][5] == pytest.approx(0.05)
    assert (d["mean"], d["se"]) == (pytest.approx(0.075), pytest.approx(0.025))
    assert report.paired_curve({6: method[6]}, {6: base[6]}) is None


def test_rendered_tables_show_the_hand_numbers(toy_records):
    text = report.render_table(TOY, toy_records)
    # runs above 2 of their own SEs (0.06): m's changes 0.20, 0.05, 0.20 -> 2 of 3; b's 0.10, 0.05, 0.00 -> 1 of 3
    assert "| Method | `python graphgpo.py --seed S --torch-threads 1` | 3 | 0.450 | 0.600 | +0.150 ± 0.050 | 2/3 | " \
           "0.700 → 0.800 | 200 [100, 300] |" in text
    assert "| Base | `python graphgpo.py --seed S --torch-threads 1 --step-advantage none` | 3 | 0.450 | 0.500 | " \
           "+0.050 ± 0.029 | 1/3 |" in text
    assert "| Method change | +0.200 ± 0.030 | +0.050 ± 0.030 | +0.200 ± 0.030 | +0.150 ± 0.050 |" in text
    assert "| Method − Base (paired) | +0.100 | +0.000 | +0.200 | +0.100 ± 0.058 |" in text
    # the fixture's curves hold iteration 40 only after iteration 0: the same differences as at the end
    assert ("| Method − Base, mean over the evaluations during training (paired) | +0.100 | +0.000 | +0.200 | "
            "+0.100 ± 0.058 |") in text
    assert "[../docs/results/toy.jsonl]" not in text and "[results/toy.jsonl](results/toy.jsonl)" in text
    summary = report.render_summary(TOY_SUMMARY, {"toy": toy_records}, tables=[TOY])
    # runs > 2 own SE 2/3 and greedy 0.700 -> 0.800 as in the table; during training = the end (iteration 40 only)
    assert ("| Method | Base (`--step-advantage none`) | sokoban: `eval/success` | +0.150 ± 0.050 | 2/3 | +0.050 ± 0.029 | "
            "+0.100 ± 0.058 | +0.100 ± 0.058 | 0.700 → 0.800 | 4, 5, 6 | 200 (2 CPU cores, load 1.0-2.0) | "
            "`python graphgpo.py --seed S --torch-threads 1` |") in summary


def test_heldout_rows_by_hand(tmp_path, toy_records):
    # one held-out run of graphgpo on sokoban: 0.30 -> 0.50, change +0.20 ± 0.04; beside it the toy table's
    # method mean change over seeds, +0.15 ± 0.05 (the hand arithmetic above the fixture)
    (tmp_path / "docs/results").mkdir(parents=True)
    (tmp_path / report.HELDOUT).write_text(json.dumps(line("m", 20, 0.30, 0.50, change_se=0.04, wall=254.4)) + "\n")
    text = report.render_heldout(tmp_path, {"toy": toy_records}, tables=[TOY], summary=TOY_SUMMARY)
    assert "| graphgpo | sokoban `eval/success` | 20 | 0.300 → 0.500 | +0.200 ± 0.040 | +0.150 ± 0.050 | 254 |" in text


def test_power_by_hand(toy_records):
    runs = report.select(TOY, toy_records)
    # paired m - b: +0.10, 0.00, +0.20 -> mean 0.10, std sqrt(0.02 / 2) = 0.1 (see the fixture's arithmetic);
    # every after_se is 0.02: evaluation part sqrt(0.02^2 + 0.02^2) = 0.028284 on each seed, and its RMS;
    # resolvable 2 x 0.1 / sqrt(3) = 0.11547; seeds for the mean 0.10 at 2 SE: (2 x 0.1 / 0.10)^2 = 4
    pw = report.power(runs["m"], runs["b"])
    assert (pw["n"], pw["mean"], pw["sd"]) == (3, pytest.approx(0.10), pytest.approx(0.1))
    assert pw["eval_sd"] == pytest.approx(0.028284, abs=1e-6) and pw["resolvable"] == pytest.approx(0.11547, abs=1e-5)
    assert pw["seeds_needed"] == 4
    flipped = report.power(runs["b"], runs["m"])  # mean -0.10: no number of seeds makes it a positive effect
    assert flipped["mean"] == pytest.approx(-0.10) and flipped["seeds_needed"] is None
    assert report.power({4: runs["m"][4]}, {4: runs["b"][4]}) is None  # one seed: no spread
    text = report.render_power(TOY_SUMMARY, {"toy": toy_records}, tables=[TOY])
    # wall per seed: the slower median of the two (m 200, b 100)
    # the fixture's lines carry no "paired" flag: independent evaluations
    assert ("| Method − Base | sokoban: `eval/success` | independent | 3 | +0.100 ± 0.058 | 0.100 | 0.028 | 0.115 | 4 "
            "| 200 |") in text
    paired_records = [{**r, "paired": True} for r in toy_records]
    assert "| sokoban: `eval/success` | paired | 3 |" in report.render_power(TOY_SUMMARY, {"toy": paired_records},
                                                                          tables=[TOY])
    mixed = [{**r, "paired": r["variant"] == "m"} for r in toy_records]
    assert "| sokoban: `eval/success` | mixed | 3 |" in report.render_power(TOY_SUMMARY, {"toy": mixed}, tables=[TOY])
    assert "| Method − Base | | | fewer than 2 |" in report.render_power(TOY_SUMMARY, {}, tables=[TOY])


def test_table_without_results_says_how_to_make_them():
    text = report.render_table(TOY, [])
    assert "No results yet" in text and TOY.runner_command() in text
    assert "not run yet" in report.render_summary(TOY_SUMMARY, {}, tables=[TOY])


def test_replace_block_is_idempotent_and_leaves_other_text_alone():
    doc = "# Title\n\nbefore\n<!-- results:toy -->\nold table\n<!-- /results:toy -->\nafter\n"
    once = report.replace_block(doc, "toy", "| new |\n")
    assert once == "# Title\n\nbefore\n<!-- results:toy -->\n| new |\n<!-- /results:toy -->\nafter\n"
    assert report.replace_block(once, "toy", "| new |\n") == once
    assert report.replace_block(doc, "other", "x") is None
    mention = "Tables sit between `<!-- results:toy -->` and its closing marker.\n"  # prose, not a marker
    assert report.replace_block(mention + doc, "toy", "| new |\n") == mention + once
    with pytest.raises(report.MarkerError):
        report.replace_block("<!-- results:toy -->\nno end\n", "toy", "x")
    with pytest.raises(report.MarkerError):
        report.replace_block(doc + doc, "toy", "x")


def test_update_docs_writes_then_check_finds_a_stale_table(tmp_path, toy_records, capsys):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in toy_records))
    (tmp_path / "docs" / "toy.md").write_text("# Toy\n\n<!-- results:toy -->\n<!-- /results:toy -->\n\nend\n")
    (tmp_path / "README.md").write_text("# Readme without markers\n")
    found, stale, errors = report.update_docs(tmp_path, check=True, tables=[TOY], summary=TOY_SUMMARY)
    assert found == stale == ["docs/toy.md: results:toy"] and errors == []
    assert "docs/results.md: no <!-- results:summary --> marker" in capsys.readouterr().out
    assert "<!-- /results:toy -->\n\nend" in (tmp_path / "docs" / "toy.md").read_text()  # --check wrote nothing

    found, stale, errors = report.update_docs(tmp_path, check=False, tables=[TOY], summary=TOY_SUMMARY)
    text = (tmp_path / "docs" / "toy.md").read_text()
    assert "+0.100 ± 0.058" in text and text.startswith("# Toy\n\n<!-- results:toy -->\n") and text.endswith("\n\nend\n")
    try:  # the plot is optional: without matplotlib the table is written without its link
        import matplotlib  # noqa: F401
        assert (tmp_path / "docs" / "results" / "toy.png").is_file() and "(results/toy.png)" in text
    except ImportError:
        assert not (tmp_path / "docs" / "results" / "toy.png").exists() and "(results/toy.png)" not in text
    assert report.update_docs(tmp_path, check=True, tables=[TOY], summary=TOY_SUMMARY)[1] == []

    (tmp_path / "docs" / "toy.md").write_text(text.replace("+0.100 ± 0.058", "+0.200 ± 0.058"))  # edited by hand
    assert report.update_docs(tmp_path, check=True, tables=[TOY], summary=TOY_SUMMARY)[1] == ["docs/toy.md: results:toy"]
    (tmp_path / "README.md").write_text("<!-- results:nope -->\n<!-- /results:nope -->\n")
    assert report.update_docs(tmp_path, check=True, tables=[TOY], summary=TOY_SUMMARY)[2] == [
        "README.md: <!-- results:nope --> has no table spec in benchmarks/report.py"]


def test_every_spec_is_consistent():
    keys = [t.key for t in report.TABLES]
    assert len(keys) == len(set(keys))
    for t in report.TABLES:
        assert t.script in learning.SCRIPTS and (REPO / t.doc).is_file(), t.key
        assert t.method in t.variants and set(t.baselines) <= set(t.variants) and t.method not in t.baselines, t.key
        args = learning.parse_args(shlex_split_runner(t.runner_command()))  # the command parses as the runner's
        assert args.variants == {v: t.flags(v) for v in t.variants} and args.seeds == list(t.seeds), t.key
    assert {(k, m, b) for k, m, b in report.SUMMARY.rows} == {(t.key, t.method, b) for t in report.TABLES if t.summary
                                                              for b in t.baselines}
    assert {(k, m, b) for k, m, b in report.SUMMARY.power_rows} == {(t.key, t.method, b) for t in report.TABLES
                                                                    if t.power for b in t.baselines}
    # the cross-method table (docs/results.md): every script's default run (no `earlier` flags), one table per
    # (script, extra flags) and every script present
    summary_tables = [t for t in report.TABLES if t.summary]
    assert all(not t.earlier for t in summary_tables)
    assert len({(t.script, t.extra) for t in summary_tables}) == len(summary_tables)
    assert {t.script for t in summary_tables} == set(report.SCRIPT_ORDER)


def test_the_docs_tables_match_the_committed_results():
    """`python benchmarks/report.py --check` on this checkout: a table edited by hand, or results added
    without regenerating the tables, fails here."""
    found, stale, errors = report.update_docs(REPO, check=True)
    assert "docs/results.md: results:summary" in found
    assert stale == [] and errors == [], "run python benchmarks/report.py"


def shlex_split_runner(cmd: str) -> list[str]:
    import shlex

    words = shlex.split(cmd)
    assert words[:2] == ["python", "benchmarks/learning.py"]
    return words[2:]


# ---------------------------------------------------------------------------------------------
# benchmarks/learning.py
# ---------------------------------------------------------------------------------------------
def runner(*args, tmp=None, timeout=300):
    env = dict(os.environ, TMPDIR=str(tmp)) if tmp else None  # the runner's scratch dirs go under TMPDIR
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("args, message", [
    (["--script", "nope", "--variants", "a=", "--seeds", "1", "--out", "x.jsonl"], "--script 'nope' is not a method script"),
    (["--script", "graphgpo", "--variants", "a", "--seeds", "1", "--out", "x.jsonl"], "is not NAME=FLAGS"),
    (["--script", "graphgpo", "--variants", "a=--seed 3", "--seeds", "1", "--out", "x.jsonl"], "--seed is set by the runner"),
    (["--script", "graphgpo", "--variants", "a=", "b=", "a=", "--seeds", "1", "--out", "x.jsonl"], "given twice"),
    (["--script", "graphgpo", "--variants", "a=", "--seeds", "1", "--out", "x.json"], "must be a .jsonl file"),
])
def test_runner_bad_flags_are_one_line(args, message):
    proc = runner(*args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr, proc.stderr


MICRO = ["--tiny-preset", "micro", "--num-iterations", "1", "--tasks-per-iteration", "1", "--group-size", "2",
         "--eval-num-tasks", "2", "--max-turns", "4"]


def test_runner_end_to_end_micro(tiny_cache, tmp_path):
    import envs

    if "sokoban" not in envs.available():
        pytest.skip("envs/sokoban.py not in this checkout")
    out = tmp_path / "results" / "micro.jsonl"
    # variant "bad" passes the argument parser but fails in the run (omega must lie in (0, 1))
    args = ["--script", "graphgpo", "--variants", "grpo=--step-advantage none", "bad=--omega 1.5", "--seeds", "3",
            "--out", str(out), "--", *MICRO]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = runner(*args, tmp=scratch)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a failed run: reported, and the exit code says so
    assert "FAILED: bad seed 3" in proc.stdout + proc.stderr and "--omega must lie in (0, 1)" in proc.stdout
    recs = learning.read_results(out)
    assert len(recs) == 1, "only the run that finished is written"
    rec = recs[0]
    assert list(rec) == list(learning.RECORD_KEYS)
    assert rec["command"] == ("python graphgpo.py --seed 3 --torch-threads 1 --step-advantage none " + " ".join(MICRO))
    assert (rec["bench"], rec["script"], rec["variant"], rec["seed"]) == ("micro", "graphgpo.py", "grpo", 3)
    assert rec["variant_flags"] == ["--step-advantage", "none"] and rec["extra_flags"] == MICRO
    assert rec["metric"] == "eval/success" and rec["env_id"] == "sokoban" and rec["iterations"] == 1
    assert rec["change"] == pytest.approx(rec["after"] - rec["before"]) and rec["change_se"] >= 0
    assert rec["greedy"]["metric"] == "eval/success_greedy" and rec["greedy"]["after_se"] is not None
    assert [p["iteration"] for p in rec["curve"]] == [0, 1] and rec["curve"][-1]["value"] == rec["after"]
    assert "credit/adv_nonzero_frac" in rec["credit_means"] and rec["perf_means"]["perf/iteration_seconds"] > 0
    # one iteration: the first and the last quarter are the same iteration
    assert rec["train_charts"]["iterations"] == 1 and rec["train_charts"]["first"] == rec["train_charts"]["last"]
    assert 0 <= rec["train_charts"]["first"]["charts/success"] <= 1
    assert rec["config"]["step_advantage"] == "none" and rec["config"]["seed"] == 3
    assert rec["wall_seconds"] > 0  # recorded (how long is the benchmarks' business, not a test's)
    pol = rec["tiny_policy"]
    assert pol["tiny"] and pol["dir"] == f"sokoban__micro__{pol['recipe_hash']}" and len(pol["weights_sha256"]) == 16
    assert rec["machine"]["cpu_count"] == os.cpu_count() and len(rec["machine"]["load_average_start"]) == 3
    assert rec["machine"]["torch"] and rec["machine"]["transformers"]
    assert re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"]) and isinstance(rec["git"]["dirty"], bool)
    assert not list(scratch.glob("learning_micro_*/grpo__3")), "a written run's scratch dir is removed"
    assert list(scratch.glob("learning_micro_*/bad__3/run.log")), "a failed run's log is kept"

    again = runner("--script", "graphgpo", "--variants", "grpo=--step-advantage none", "--seeds", "3",
                   "--out", str(out), "--", *MICRO, tmp=scratch)
    assert again.returncode == 0 and "0 to run, 1 already in" in again.stdout, again.stdout + again.stderr
    assert len(learning.read_results(out)) == 1, "a run already in the results file is not run again"



def test_runner_resumes_a_killed_run_from_its_checkpoint(tiny_cache, tmp_path):
    import signal
    import time

    import envs

    if "sokoban" not in envs.available():
        pytest.skip("envs/sokoban.py not in this checkout")
    out, keep = tmp_path / "resume.jsonl", tmp_path / "keep"
    flags = [*MICRO[:2], "--num-iterations", "6", "--checkpoint-every", "1", *MICRO[4:]]
    args = [str(REPO / "benchmarks" / "learning.py"), "--script", "graphgpo", "--variants", "g=", "--seeds", "3",
            "--out", str(out), "--keep-runs", str(keep), "--", *flags]
    first = subprocess.Popen([sys.executable, *args], cwd=REPO, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not list(keep.glob("learning_resume/g__3__*/sokoban__g__3__*/checkpoint.pt")):
        assert time.time() < deadline and first.poll() is None, "no checkpoint was written"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)  # the runner and its run, as a session's end would
    first.wait()
    assert not out.exists(), "the killed run wrote no line"

    proc = runner(*args[1:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rec,) = learning.read_results(out)
    assert rec["sittings"] == 2 and rec["iterations"] == 6 and rec["wall_seconds"] > 0
    (kept,) = keep.glob("learning_resume/g__3__*")
    assert "__20" in kept.name, "a written run is kept under a new name, so a --rerun starts afresh"
    log = (kept / "run.log").read_text()
    assert log.count("$ ") == 2 and "--resume" in log.split("$ ")[2] and "(resumed)" in log
    (run_dir,) = kept.glob("sokoban__g__3__*")
    iters = [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert iters == sorted(set(iters)) and iters[0] == 0 and iters[-1] == 6, "each iteration logged once"


def test_first_iteration_clock_stops_at_the_first_training_row(tmp_path):
    m = tmp_path / "metrics.jsonl"
    assert first_iteration.first_training_row(m) is None  # not written yet
    m.write_text(json.dumps({"iteration": 0, "eval/success": 0.3}) + "\n" + '{"iteration": 1, "charts/succ')
    assert first_iteration.first_training_row(m) is None  # the evaluation before training, then a partial line
    m.write_text(json.dumps({"iteration": 0, "eval/success": 0.3}) + "\n"
                 + json.dumps({"iteration": 1, "charts/success": 0.1}) + "\n")
    assert first_iteration.first_training_row(m) == {"iteration": 1, "charts/success": 0.1}


def test_learning_summary_by_hand():
    first = {"eval/success": 0.50, "eval/success_se": 0.03}
    # change -0.12, SE sqrt(0.03^2 + 0.04^2) = 0.05: below -2 SE -> fell, and the warning says so
    s = learning.learning_summary(first, {"eval/success": 0.38, "eval/success_se": 0.04}, "eval/success")
    assert abs(s["change"] + 0.12) < 1e-12 and abs(s["change_se"] - 0.05) < 1e-12 and s["fell"] and not s["rose"]
    assert learning.learning_warning(s).startswith("WARNING: eval/success fell by more than two standard errors")
    # change -0.08 with the same SE: within noise, no warning
    s = learning.learning_summary(first, {"eval/success": 0.42, "eval/success_se": 0.04}, "eval/success")
    assert not s["fell"] and not s["rose"] and learning.learning_warning(s) is None
    # change +0.11 with the same SE: above +2 SE (0.10) -> rose; +0.09 is not
    assert learning.learning_summary(first, {"eval/success": 0.61, "eval/success_se": 0.04}, "eval/success")["rose"]
    assert not learning.learning_summary(first, {"eval/success": 0.59, "eval/success_se": 0.04}, "eval/success")["rose"]


def test_learning_summary_pairs_the_episodes_by_hand(tmp_path):
    # the same 10 episodes before and after: 4 of 10 won before, 8 after; the differences are
    # [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]: mean 0.4, sample std sqrt((4 * 0.6^2 + 6 * 0.4^2) / 9) = 0.516398,
    # SE 0.516398 / sqrt(10) = 0.163299, so +0.4 is above 2 SE (0.326599): rose
    before = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    after = [1, 1, 1, 1, 0, 0, 1, 1, 1, 1]
    first = {"eval/success": 0.4, "eval/success_se": 0.163299, "eval/success_episodes": before}
    last = {"eval/success": 0.8, "eval/success_se": 0.133333, "eval/success_episodes": after}
    s = learning.learning_summary(first, last, "eval/success")
    assert s["paired"] and abs(s["change"] - 0.4) < 1e-12 and abs(s["change_se"] - 0.163299) < 1e-6 and s["rose"]
    # two independent evaluations would give SEs 0.163299 (p 0.4) and 0.133333 (p 0.8), in quadrature
    # sqrt(0.163299^2 + 0.133333^2) = 0.210819: +0.4 is not above 2 SE
    assert abs(s["change_se_quadrature"] - 0.210819) < 1e-6
    # episodes that cannot be paired (a different count) fall back to the quadrature
    s = learning.learning_summary(first, {**last, "eval/success_episodes": after[:9]}, "eval/success")
    assert not s["paired"] and s["change_se"] == s["change_se_quadrature"] and not s["rose"]
    # a run directory's summary.json: the block of its main metric
    (tmp_path / "summary.json").write_text(json.dumps({"metric": "eval/success", "first_eval": first,
                                                       "last_eval": last}))
    assert learning.run_learning(tmp_path) == learning.learning_summary(first, last, "eval/success")
