"""Did EPO's greedy strategist get worse? Its greedy evaluation replayed per game, start vs end, paired.

epo.py logs the greedy goal score as one mean over the test games (sampled evaluation has per-game
scores and a paired SE, greedy has neither). This replays the greedy evaluation of finished runs: the
starting policy (the run's model and shipped adapter, as `epo.py` loads it) and each run's final
weights (its saved adapter), on the same test games (each task in each role against each scripted
style). It gives the per-game change, its paired SE, how many games rose and fell, overall and per
opponent style, and in how many games the run's first and last sampled evaluation scored what greedy
play scores (equal scores: an upper bound on the games sampled exactly as greedy play). Greedy decoding
is deterministic, so the replayed means should equal the ones the runs logged (checked, printed as
`logged`).

    python benchmarks/epo_greedy.py RUN_DIR [RUN_DIR ...]          # e.g. the kept SmolLM2 runs
    python benchmarks/epo_greedy.py --out docs/results/epo_greedy_smollm2.json RUN_DIR ...

A RUN_DIR is the directory of a finished epo.py run (config.json, metrics.jsonl, summary.json,
adapter/). Runs that share a model and env share the starting policy's evaluation. One torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import epo as E  # noqa: E402

ADAPTER = "adapter/adapter_model.safetensors"  # a finished run's final LoRA weights (epo.save_adapter)


def setup(run_dir: Path):
    """The run's resolved arguments and its test games, as epo.main builds them."""
    import envs

    saved = json.loads((run_dir / "config.json").read_text())  # the run's arguments, as resolved
    fields = {f.name for f in dataclasses.fields(E.Args)}
    args = E.Args(**{k: v for k, v in saved.items() if k in fields and k != "resume"})
    args, new_env, probe, _ = E.make_env(args)
    players = list(probe.players) if args.env_id in envs.TWO_PLAYER else ["agent"]
    styles = list(args.eval_opponents) or (list(probe.opponent_styles())
                                           if args.env_id in envs.TWO_PLAYER else [])
    tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]
    specs = ([(t, r, s) for s in styles for r in players for t in tasks] if styles
             else [(t, "agent", "") for t in tasks])
    policy = E.strategist_policy(args)
    real = not (policy.is_tiny or policy.sft)
    return args, new_env, players, specs, real


def greedy_scores(model, tok, args, new_env, players, specs, real) -> list[float]:
    """One greedy game per spec, in evaluate's order: the strategist's goal score in each."""
    games = [new_env(t, {p: "policy" if p == r else s for p in players}) for t, r, s in specs]
    with torch.no_grad():
        return [float(ep.score) for ep in E.rollout(model, tok, games, args, 0.0, greedy=True,
                                                      real=real)]


def paired(before, after, specs) -> dict:
    d = np.subtract(after, before)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0
    by_style = defaultdict(list)
    for (_, role, style), x in zip(specs, d):
        by_style[style or "agent"].append(float(x))
    return {"before": float(np.mean(before)), "after": float(np.mean(after)),
            "change": float(d.mean()), "change_se": se, "games": len(d),
            "rose": int((d > 0).sum()), "fell": int((d < 0).sum()), "same": int((d == 0).sum()),
            "change_by_style": {k: float(np.mean(v)) for k, v in sorted(by_style.items())},
            "games_before": [float(x) for x in before], "games_after": [float(x) for x in after]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from common.models import load_policy
    from common.tiny import strategist_overrides

    start_cache, rows = {}, []
    for run_dir in a.run_dirs:
        if not (run_dir / "summary.json").is_file() or not (run_dir / ADAPTER).is_file():
            sys.exit(f"{run_dir}: no summary.json or {ADAPTER}; pass the directory of a finished "
                     "epo.py run (one saved with --save-model, the default)")
        args, new_env, players, specs, real = setup(run_dir)
        model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                                 load_in_4bit=args.load_in_4bit, lora_r=args.lora_r,
                                 lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                 tiny_overrides=strategist_overrides(args.env_id))
        key = (args.model_name, args.env_id, args.tiny_preset, tuple(map(tuple, specs)))
        if key not in start_cache:
            start_cache[key] = greedy_scores(model, tok, args, new_env, players, specs, real)
        set_peft_model_state_dict(model, load_file(str(run_dir / ADAPTER)))  # the final weights
        end = greedy_scores(model, tok, args, new_env, players, specs, real)
        evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                 if line.strip() and "eval/goal_score_greedy" in line]
        logged = [r["eval/goal_score_greedy"] for r in evals
                  if r.get("eval/goal_score_greedy") is not None]
        sampled = [r for r in evals if r.get("eval/goal_score_episodes")]
        row = {"run": run_dir.resolve().parent.name, "exp_name": args.exp_name, "seed": args.seed,
               "prm": args.prm, "iterations": args.num_iterations,
               "logged_before": logged[0] if logged else None,
               "logged_after": logged[-1] if logged else None,
               **paired(start_cache[key], end, specs),
               # the last sampled evaluation per game (same order): equal to greedy where sampling
               # at the evaluation temperature picks the greedy strategy at every turn
               "sampled_after_games": sampled[-1]["eval/goal_score_episodes"] if sampled else None}
        if sampled:
            row["sampled_equal_greedy_after"] = int(np.sum(np.isclose(row["sampled_after_games"], end)))
            row["sampled_equal_greedy_before"] = int(np.sum(np.isclose(
                sampled[0]["eval/goal_score_episodes"], start_cache[key])))
        rows.append(row)
        print(f"{args.exp_name} seed {args.seed}: greedy goal score {row['before']:.3f} -> "
              f"{row['after']:.3f} ({row['change']:+.3f} ± {row['change_se']:.3f} paired, "
              f"{row['games']} games: {row['rose']} rose, {row['fell']} fell); logged "
              f"{row['logged_before']:.3f} -> {row['logged_after']:.3f}; sampled game scores equal "
              f"to greedy {row.get('sampled_equal_greedy_before')} -> "
              f"{row.get('sampled_equal_greedy_after')} of {row['games']}; by style "
              + ", ".join(f"{k} {v:+.2f}" for k, v in row["change_by_style"].items()), flush=True)
    d = [r["change"] for r in rows]
    if len(d) > 1:
        print(f"over {len(d)} runs: mean change {np.mean(d):+.3f} ± "
              f"{np.std(d, ddof=1) / math.sqrt(len(d)):.3f} (SE over runs)")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
