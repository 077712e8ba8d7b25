"""benchmarks/aria_keys.py: the table by hand from records, and a quick run on an untrained micro policy whose
numbers are checked against aria.py's own credit statistics of the same games."""

from __future__ import annotations

import json

from conftest import load_benchmark


def test_report_by_hand():
    ak = load_benchmark("aria_keys")
    base = {"model": "smollm2-135m", "env_id": "bargaining", "embedder": "hash", "games": 8, "num_steps": 45,
            "num_distinct_utterances": 17, "num_histories_exact": 35, "num_intentions": 34, "selected_k": 5,
            "reward_var_raw": 0.0385, "reward_var_aggregated": 0.03}
    recs = [{**base, "seed": 2, "num_steps": 30, "num_intentions": 12}, {**base, "seed": 1, "turns_per_key": 0},
            {**base, "seed": 1, "turns_per_key": 45 / 34}]  # the later record of seed 1 wins
    recs[0]["turns_per_key"] = 30 / 12
    text = ak.render(recs)
    # seeds in order 1, 2: 45/34 = 1.32 turns per key, 30/12 = 2.50
    assert ("| smollm2-135m | 8 | hash | 1, 2 | 45 / 30 | 17 / 17 | 35 / 35 | 34 / 12 | 1.32 / 2.50 | 5 / 5 | "
            "0.0385 -> 0.0300 / 0.0385 -> 0.0300 |") in text
    assert "Not run yet." in ak.render([])


def test_micro_run_matches_aria_own_statistics(tmp_path):
    ak = load_benchmark("aria_keys")
    import aria

    results, report = tmp_path / "k.jsonl", tmp_path / "k.md"
    ak.main(["--model-name", "tiny", "--tiny-preset", "micro", "--seeds", "3", "--games", "6", "--sizes", "3",
             "--embedders", "hash", "--results", str(results), "--report-path", str(report)])
    rows = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(r["games"], r["embedder"]) for r in rows] == [(3, "hash"), (6, "hash")]
    # the same games again, through aria.py's functions directly
    args, episodes, _, _ = ak.play("tiny", 3, 6, 1, "micro")
    vectors = aria.embed_utterances(aria.Embedder("hash", dim=args.embed_dim), episodes, args.observation_labels)
    _, stats = aria.compute_advantages(episodes, args, vectors)
    six = rows[1]
    assert six["num_steps"] == stats["credit/num_steps"] == sum(len(ep.steps) for ep in episodes)
    assert six["num_intentions"] == stats["credit/num_intentions"] <= six["num_steps"]
    assert abs(six["turns_per_key"] - six["num_steps"] / six["num_intentions"]) < 1e-12
    assert rows[0]["num_steps"] == sum(len(ep.steps) for ep in episodes[:3])
    assert "| tiny-micro | 6 | hash | 3 |" in report.read_text()
