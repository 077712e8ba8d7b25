"""EPO's goal score per scripted style and role, before and after training, of finished epo.py runs.

    python benchmarks/epo_bench.py RUN_DIR [RUN_DIR ...]

The variants x seeds of EPO and its ablations run as learning.py configurations (keep their run
directories with `--keep-runs DIR`), e.g.

    python benchmarks/learning.py --script epo --variants epo= prm_none="--prm none" \\
        ones="--weights ones" --seeds 7 8 9 --parallel 2 --out /tmp/epo.jsonl --keep-runs runs

and report.py's epo tables give their before -> after. This script adds what the tables leave out:
the goal score (0-10) per (scripted style, role) of each run's first and last evaluation, read from
the per-game scores epo.py's evaluation logs (`per_opponent`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def per_opponent(cfg, ev):
    """The sampled evaluation's goal score per (scripted style, role) of a run (its config.json and an
    evaluation row), from `eval/goal_score_episodes`: epo.py's `evaluate` plays the test tasks style by
    style (`--eval-opponents`, else the game's styles), role by role (the game's players). Runs written
    before that list was logged carry the cells themselves (`eval/vs_<style>/<role>/goal_score`)."""
    import envs

    scores = ev.get("eval/goal_score_episodes")
    if scores is None or cfg["env_id"] not in envs.TWO_PLAYER:
        return {tuple(k.split("/")[1:3]): v for k, v in ev.items()
                if k.startswith("eval/vs_") and k.endswith("/goal_score")}
    probe = envs.make(cfg["env_id"], **cfg.get("env_kwargs", {}))
    cells = [(f"vs_{style}", role) for style in (cfg.get("eval_opponents") or probe.opponent_styles())
             for role in probe.players]
    n = len(scores) // len(cells)
    if n * len(cells) != len(scores):
        raise ValueError(f"{len(scores)} evaluation games do not split into {len(cells)} (style, role) cells")
    return {cell: float(np.mean(scores[k * n:(k + 1) * n])) for k, cell in enumerate(cells)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", help="finished epo.py run directories (with summary.json)")
    args = p.parse_args(argv)
    rows = []
    for d in map(Path, args.run_dirs):
        if not (d / "summary.json").is_file():
            sys.exit(f"error: {d} has no summary.json (not a finished epo.py run)")
        cfg, summary = (json.loads((d / f).read_text()) for f in ("config.json", "summary.json"))
        first, last = per_opponent(cfg, summary["first_eval"]), per_opponent(cfg, summary["last_eval"])
        rows.append((f"{cfg.get('exp_name')} seed {cfg.get('seed')}", first, last))
    cells = sorted({c for _, first, _ in rows for c in first})
    print("| run | " + " | ".join(f"{style[3:]} / {role}" for style, role in cells) + " |")
    print("|---|" + "---|" * len(cells))
    for name, first, last in rows:
        print(f"| {name} | " + " | ".join(f"{first.get(c, float('nan')):.2f} -> {last.get(c, float('nan')):.2f}"
                                        for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
