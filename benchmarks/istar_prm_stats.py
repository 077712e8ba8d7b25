"""What iStar's implicit PRM learned in a run, measured from what istar.py logs: every training iteration
with the PRM writes one `train_step_rewards` record to samples.jsonl (the step rewards of Eq. 1 as the PRM
scored them before its update on that iteration, each step's trajectory and env input, and the
trajectories' DPO labels, groups and tasks; docs/istar.md, "Logged metrics").

    python benchmarks/istar_prm_stats.py runs/sokoban__istar__1__1795828070 [RUN_DIR ...]

Per iteration (`iteration_stats`): the held-out pair accuracy `prm/heldout_pair_acc` (the iteration's new
(positive, negative) pairs of one task, scored by the PRM trained on the earlier iterations only: the
fraction with S(τ+) > S(τ-), a tie counts as wrong) and the mean margin `prm/heldout_margin`; the step
rewards' mean, mean |r| and means over the steps of positive and of negative trajectories
(`credit/step_reward_*`); with the run's env, `credit/step_reward_progress_corr`, the Pearson correlation of
the step rewards with each step's change of env progress, found by replaying the episodes. Per run
(`run_stats`, which benchmarks/learning.py records as `method_stats`): `prm_heldout_pair_acc`, the held-out
pair accuracy pooled over the first and over the last quarter of the iterations, with a standard error that
takes the task group as the unit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TAG = "train_step_rewards"


def pair_counts(step_rewards, traj_index, traj_success, traj_group, reduce="mean"):
    """The PRM's pairs as it scores them now: per group with pairs, its pairs and how many the PRM
    ranks right (S(τ+) > S(τ-); a tie is wrong), and over all pairs the accuracy, the mean margin
    S(τ+) - S(τ-) and the DPO loss (NaN without pairs). Returns a dict: groups, correct, pairs (per
    group), acc, margin, loss."""
    from istar import preference_pairs, trajectory_scores

    traj_index = torch.as_tensor(traj_index, dtype=torch.long)
    grp = torch.as_tensor(traj_group)
    pairs = preference_pairs(traj_success, traj_group)
    if pairs.shape[0] == 0:
        nan = float("nan")
        return {"groups": [], "correct": np.zeros(0), "pairs": np.zeros(0), "acc": nan,
                "margin": nan, "loss": nan}
    s = trajectory_scores(torch.as_tensor(step_rewards).double(), traj_index, len(grp), reduce)
    d = s[pairs[:, 0]] - s[pairs[:, 1]]
    pair_group = grp[pairs[:, 0]]
    groups = torch.unique(pair_group)
    return {"groups": groups.tolist(),
            "correct": np.array([float((d[pair_group == g] > 0).sum()) for g in groups]),
            "pairs": np.array([float((pair_group == g).sum()) for g in groups]),
            "acc": float((d > 0).double().mean()), "margin": float(d.mean()),
            "loss": float(-F.logsigmoid(d).mean())}


def pooled_pair_accuracy(correct, pairs):
    """Accuracy over the pairs of many groups, Σ correct / Σ pairs, and its standard error with the
    group as the unit (a group's pairs share trajectories, so they are not independent): with n_g
    pairs and c_g right in group g, acc = Σ c_g / Σ n_g and
    SE = sqrt(G / (G - 1) Σ_g (c_g - acc n_g)²) / Σ n_g (0 for one group).
    Returns (acc, se); (NaN, NaN) without pairs."""
    c, n = np.asarray(correct, dtype=np.float64), np.asarray(pairs, dtype=np.float64)
    if n.sum() == 0:
        return float("nan"), float("nan")
    acc, num_groups = c.sum() / n.sum(), len(n)
    se = (math.sqrt(num_groups / (num_groups - 1) * ((c - acc * n) ** 2).sum()) / n.sum()
          if num_groups > 1 else 0.0)
    return float(acc), float(se)


def heldout_summary(heldout, num_iterations):
    """The PRM's held-out pair accuracy pooled over the pairs of the first and of the last quarter
    of the iterations, with standard errors (`pooled_pair_accuracy`). `heldout`: per iteration with
    the PRM, (iteration, correct, pairs) per group with pairs."""
    q = max(1, num_iterations // 4)
    out = {}
    for name, lo, hi in (("first_quarter", 1, q),
                         ("last_quarter", num_iterations - q + 1, num_iterations)):
        rows = [(c, n) for it, c, n in heldout if lo <= it <= hi]
        c = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0)
        n = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0)
        acc, se = pooled_pair_accuracy(c, n)
        out[name] = {"iterations": [lo, hi], "acc": acc if n.sum() else None,  # null: no pairs
                     "se": se if n.sum() else None, "pairs": int(n.sum()), "groups": len(n)}
    return out


def pearson(x, y):
    """Pearson correlation over the finite pairs; nan when fewer than 3 or a constant side."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def records(run_dir):
    """(iteration, record) of every `train_step_rewards` line of the run's samples.jsonl, in order."""
    path = Path(run_dir) / "samples.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [(r["iteration"], r) for r in map(json.loads, filter(str.strip, lines)) if r.get("tag") == TAG]


def run_env(config):
    """The env factory of a run, from its config.json (istar.py's own `make_env`)."""
    import istar

    names = {f.name for f in dataclasses.fields(istar.Args)}
    return istar.make_env(istar.Args(**{k: v for k, v in config.items() if k in names}))[1]


def _progress(env, info=None):
    """The env's progress (info["progress"], or env.progress() after reset); nan if unknown."""
    p = (info or {}).get("progress")
    if p is None and info is None:
        p = env.progress()
    try:
        return float(p) if p is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def progress_deltas(rec, new_env):
    """Each step's change of env progress (NaN where unknown), replaying the iteration's episodes from
    their env inputs. Exact where an invalid action changes no state (Sokoban): the record holds "" for
    every invalid step, whatever text the env saw."""
    actions = {}
    for traj, action in zip(rec["traj"], rec["action"]):
        actions.setdefault(traj, []).append(action)
    out = []
    for traj, task in enumerate(rec["task_id"]):
        env = new_env()
        env.reset(task)
        before = _progress(env)
        for action in actions.get(traj, []):
            now = _progress(env, env.step(action).info)
            out.append(now - before)
            before = now
    return out


def iteration_stats(rec, reduce="mean", new_env=None):
    """The PRM's statistics of one iteration's record (see the module docstring); the progress
    correlation only with `new_env` (or from `progress_delta`, which older records hold)."""
    r = np.asarray(rec["step_reward"], dtype=np.float64)
    out = {}
    if "traj" in rec:
        held = pair_counts(r, rec["traj"], rec["positive"], rec["group"], reduce)
        succ = np.asarray(rec["positive"], dtype=bool)[np.asarray(rec["traj"], dtype=np.int64)]
        out = {"prm/heldout_pair_acc": held["acc"], "prm/heldout_margin": held["margin"],
               "credit/step_reward_mean": float(r.mean()) if len(r) else 0.0,
               "credit/step_reward_abs_mean": float(np.abs(r).mean()) if len(r) else 0.0,
               "credit/step_reward_success_mean": float(r[succ].mean()) if succ.any() else math.nan,
               "credit/step_reward_failure_mean": (float(r[~succ].mean()) if (~succ).any()
                                                   else math.nan)}
    if "progress_delta" in rec:
        prog = [math.nan if d is None else d for d in rec["progress_delta"]]
    elif new_env is not None and "action" in rec:
        prog = progress_deltas(rec, new_env)
    else:
        return out
    out["credit/step_reward_progress_corr"] = pearson(r, prog)
    return out


def run_stats(run_dir):
    """`prm_heldout_pair_acc` of an iStar run with the PRM, for its summary (benchmarks/learning.py)."""
    config = json.loads((Path(run_dir) / "config.json").read_text())
    recs = records(run_dir)
    if "dpo_reduce" not in config or config["alpha"] == 0 or any("traj" not in r for _, r in recs):
        return {}  # not iStar, --alpha 0, or a run that wrote it to its summary.json
    held = []
    for it, rec in recs:
        c = pair_counts(rec["step_reward"], rec["traj"], rec["positive"], rec["group"],
                        config["dpo_reduce"])
        held.append((it, c["correct"], c["pairs"]))
    return {"prm_heldout_pair_acc": heldout_summary(held, config["num_iterations"])}


def main(argv):
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    for run_dir in map(Path, argv):
        config = json.loads((run_dir / "config.json").read_text())
        new_env = run_env(config)
        print(run_dir)
        for it, rec in records(run_dir):
            st = iteration_stats(rec, config["dpo_reduce"], new_env)
            print(f"  iteration {it}: " + ", ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in st.items()))
        print("  " + json.dumps(run_stats(run_dir)))


if __name__ == "__main__":
    main(sys.argv[1:])
