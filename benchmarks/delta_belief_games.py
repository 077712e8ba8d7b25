"""delta_belief.py with its evaluation games measured: every evaluation also reports, per evaluated
env (`eval/` and, with --eval-env-id, `eval/ood_`), how the sampled test games were played.

    python benchmarks/delta_belief_games.py [delta_belief.py flags]    # e.g. --reward-mode starpo

It runs delta_belief.py's own `main` with `evaluate` wrapped (`with_game_metrics`), so the run is the
same as `python delta_belief.py` with the same flags (the sampled evaluation games draw their own
common random numbers, and reading a belief samples nothing), plus these keys in every evaluation row
of metrics.jsonl and summary.json:

- pass_at_{k}: the share of test targets won in any of their k = --eval-k sampled games
- num_questions: questions per sampled game
- repeated_frac, invalid_frac: the shares of all questions asked that repeat an earlier one / are not
  valid yes/no questions
- belief_curve: the mean belief b_t per turn t = 0, 1, ... over the sampled games that have b_t; the
  games that ended drop out, so later points describe the longer games. Read on every sampled game
  (delta_belief.py's `rollout` with beliefs), which costs one scoring pass per game and turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import delta_belief as db  # noqa: E402


def belief_curve(episodes, max_len):
    """Mean b_t per turn t = 0..max_len over the games that have b_t (finished games drop out)."""
    curve = []
    for t in range(max_len + 1):
        vals = [ep.beliefs[t] for ep in episodes if len(ep.beliefs) > t and np.isfinite(ep.beliefs[t])]
        curve.append(float(np.mean(vals)) if vals else None)
    while curve and curve[-1] is None:
        curve.pop()
    return curve


def game_metrics(episodes, k, max_turns) -> dict:
    """pass@k (per target, `group_id`: any of its k games won), questions per game, the repeated and
    invalid shares of all questions, and the belief curve of the sampled evaluation games."""
    n_questions = sum(ep.length for ep in episodes)
    by_target = {}
    for ep in episodes:
        by_target.setdefault(ep.group_id, []).append(ep.success)
    return {f"pass_at_{k}": float(np.mean([any(v) for v in by_target.values()])),
            "num_questions": float(np.mean([ep.length for ep in episodes])),
            "repeated_frac": float(sum(sum(ep.repeated) for ep in episodes) / max(n_questions, 1)),
            "invalid_frac": float(sum(sum(ep.invalid) for ep in episodes) / max(n_questions, 1)),
            "belief_curve": belief_curve(episodes, max_turns)}


def with_game_metrics(evaluate):
    """`evaluate` whose row also holds `game_metrics` of its sampled games (the rollout with
    `noise_keys`), which are played with their beliefs read."""

    def measured(model, tok, new_env, tasks, args, prefix, belief_message, best_of_n=0):
        rollout, played = db.rollout, {}

        def reading(*a, **kw):
            if kw.get("noise_keys") is None:  # the greedy games
                return rollout(*a, **kw)
            played["sampled"] = rollout(*a, **{**kw, "with_beliefs": True})
            return played["sampled"]

        db.rollout = reading
        try:
            row, records = evaluate(model, tok, new_env, tasks, args, prefix, belief_message, best_of_n)
        finally:
            db.rollout = rollout
        metrics = game_metrics(played["sampled"], args.eval_k, args.eval_max_turns or args.max_turns)
        return {**row, **{prefix + key: v for key, v in metrics.items()}}, records

    return measured


def main(argv: list[str]) -> None:
    import tyro

    from common.models import UserError

    args = tyro.cli(db.Args, args=argv)
    db.evaluate = with_game_metrics(db.evaluate)
    try:
        db.main(args)
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
