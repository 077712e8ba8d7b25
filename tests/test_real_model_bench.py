"""benchmarks/real_model.py without a model: the action-only prompt format on every env, the per-phase split
of each script's perf metrics, and the report built from raw JSON lines (the last record of a key wins)."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("real_model")


def test_action_format_replaces_the_think_sentence_in_every_env(bench):
    import envs

    for env_id in envs.available():
        think = bench.make_single_agent(env_id, "think")
        action = bench.make_single_agent(env_id, "action")
        task = think.task_ids("test")[0]
        think.reset(task)
        action.reset(task)
        a, b = think.messages(), action.messages()
        assert envs.INSTRUCT_FORMAT in a[0]["content"] and envs.INSTRUCT_FORMAT not in b[0]["content"], env_id
        assert b[0]["content"] == a[0]["content"].replace(envs.INSTRUCT_FORMAT, bench.ACTION_FORMAT)
        assert a[1:] == b[1:], env_id  # the user message is the same
        # the wrapped env still plays: an invalid move is an invalid action
        assert action.step("").info["invalid"] is True


def test_phases_split_each_scripts_perf_metrics(bench):
    rec = lambda perf: {"perf": {f"perf/{k}_seconds": v for k, v in perf.items()}}
    assert bench.phases(rec({"rollout": 3.0, "credit": 0.5, "update": 6.0, "iteration": 9.6})) == \
        {"rollout": 3.0, "credit": 0.5, "update": 6.0, "iteration": 9.6}
    # iStar: old log-probs belong to the update, the PRM update is its credit
    assert bench.phases(rec({"rollout": 3.0, "old_logprob": 1.0, "prm": 2.0, "update": 4.0, "iteration": 10.0})) == \
        {"rollout": 3.0, "credit": 2.0, "update": 5.0, "iteration": 10.0}
    # ARIA (embedding + clustering) and EPO (PRM) log no iteration total: the sum of the phases
    assert bench.phases(rec({"rollout": 2.0, "embed": 0.25, "cluster": 0.25, "update": 1.0})) == \
        {"rollout": 2.0, "credit": 0.5, "update": 1.0, "iteration": 3.5}
    # today's rows: every script logs its kernel as credit (ARIA's clustering inside it), and iStar's
    # PRM and ARIA's embeddings beside it
    assert bench.phases(rec({"rollout": 3.0, "old_logprob": 1.0, "prm": 2.0, "credit": 0.5, "update": 4.0,
                             "iteration": 10.5})) == {"rollout": 3.0, "credit": 2.5, "update": 5.0, "iteration": 10.5}
    assert bench.phases(rec({"rollout": 2.0, "embed": 0.3, "cluster": 0.25, "credit": 0.5, "update": 1.0,
                             "iteration": 3.8})) == {"rollout": 2.0, "credit": 0.8, "update": 1.0, "iteration": 3.8}


def test_report_is_built_from_the_raw_records(bench, tmp_path):
    zs = dict(kind="zeroshot", model="smollm2-135m", tasks=8, max_new_tokens=64, max_turns=15, invalid_rate=0.9,
              cut_rate=0.5, tokens_per_turn=40.0, turns=100, batch_seconds=10.0, batch_episodes=56,
              tokens_per_second=400.0, peak_rss_gb=1.5, threads=2, load_avg=1.9)
    timing = dict(kind="timing", model="smollm2-135m", script="graphgpo.py", env_id="sokoban", four_bit=True,
                  perf={"perf/rollout_seconds": 30.0, "perf/credit_seconds": 0.01, "perf/update_seconds": 60.0,
                        "perf/iteration_seconds": 90.1, "perf/tokens_per_second": 12.5},
                  peak_rss_gb=2.5, wall_seconds=200.0, eval_seconds=40.0, zeroshot_metric="eval/success",
                  zeroshot=0.0, zeroshot_se=0.0, invalid_rate=1.0, threads=2, args=[], load_avg=2.0)
    records = [dict(zs, env_id="sokoban", format="think", success=0.5, success_se=0.1),
               dict(timing, script="istar.py", micro_batch_size=8),  # newer rows record the micro-batch
               dict(zs, env_id="sokoban", format="think", success=0.125, success_se=0.125),  # a rerun: shown
               dict(zs, env_id="sokoban", format="action", success=0.0, success_se=0.0), timing]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "r.md"
    bench.main(["report", "--results", str(path), "--report-path", str(out), "--work-dir", str(tmp_path / "w")])
    text = out.read_text()
    assert "| sokoban | think | 0.125 ± 0.125 | 0.90 | 0.50 |" in text and "0.500 ± 0.100" not in text
    assert "| sokoban | action | 0.000 ± 0.000 |" in text
    assert text.index("| sokoban | think |") < text.index("| sokoban | action |")
    assert "| graphgpo.py | sokoban | 4-bit nf4 | 30.0 | 0.0 | 60.0 | 90.1 | 12.5 | 2.50 | – | 40 | eval/success 0.000 ± 0.000 | 2.0 |" in text
    assert "| istar.py | sokoban | 4-bit nf4 | 30.0 | 0.0 | 60.0 | 90.1 | 12.5 | 2.50 | 8 | 40 |" in text
