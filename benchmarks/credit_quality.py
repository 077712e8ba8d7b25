"""Credit quality: each method's per-turn credit against the true advantage of each turn, by Monte Carlo.

For turn t of a rollout, with s_t the state before the turn and a_t the action taken,

    A*(t) = Q(s_t, a_t) - V(s_t)

under the policy that produced the rollout: Q is the mean return of `n` continuations that play a_t
from a copy of s_t (`env.clone()`) and then follow the policy; V the mean return of `n` continuations
from another copy of s_t that sample a fresh action and follow the policy. Scripted opponents or a
self-play partner move inside the game as in the rollout (the copies carry their state). The return of
a continuation is what the method's outcome measures (success 0/1 for a single-agent env; the learner
seat's deal position for a two-player game). The standard error of A* is sqrt(var_Q / n + var_V / n).

This file holds the Monte Carlo estimator and the statistics (Spearman correlation and AUC of a credit
against A*, with bootstrap confidence intervals); `tests/test_credit_quality.py` checks the estimator
on a two-turn game whose values are worked out by hand.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

# A batched policy: the envs whose turn it is -> one action text per env (it must not step them).
Policy = Callable[[list], list]


def final_return(step) -> float:
    """The return of an episode from its last Step: 1.0 for a success, else 0.0."""
    return float(bool(step.info.get("success")))


def play_out(envs: list, policy: Policy, ret: Callable = final_return, first_actions: Optional[list] = None,
             max_steps: int = 1000) -> np.ndarray:
    """Play every env to its end with `policy` (batched: one policy call per turn for all live envs) and
    return each one's `ret(last step)`. `first_actions[i]`, when given, is env i's first move instead of
    the policy's (None: the policy's). An env that is already over returns 0."""
    out = np.zeros(len(envs))
    live = [i for i, e in enumerate(envs) if not e.done]
    forced = {i: a for i, a in enumerate(first_actions or []) if a is not None}
    for _ in range(max_steps):
        if not live:
            break
        need = [i for i in live if i not in forced]
        texts = dict(zip(need, policy([envs[i] for i in need]))) if need else {}
        texts.update({i: forced.pop(i) for i in live if i in forced})
        still = []
        for i in live:
            step = envs[i].step(texts[i])
            if step.done:
                out[i] = ret(step)
            else:
                still.append(i)
        live = still
    return out


@dataclass
class TrueAdvantage:
    """A*(t) per turn with its standard error, and the two estimates it is made of."""

    a_star: np.ndarray
    se: np.ndarray
    q: np.ndarray
    v: np.ndarray


def mc_advantages(states: Sequence, actions: Sequence[str], policy: Policy, n: int,
                  ret: Callable = final_return, seed: int = 0) -> TrueAdvantage:
    """A*(t) = Q(s_t, a_t) - V(s_t) for each (saved state, action) pair, from `n` continuations each.

    states[t]: an env (or seated game) in state s_t, before a_t; it is cloned, never stepped. All
    2 n len(states) continuations are played together, so the policy sees large batches. `seed` seeds
    python's, numpy's and torch's global generators first (a sampling policy draws from them)."""
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # a policy that needs no torch
        pass
    T = len(states)
    q_envs = [s.clone() for s in states for _ in range(n)]
    v_envs = [s.clone() for s in states for _ in range(n)]
    firsts = [a for a in actions for _ in range(n)]
    returns = play_out(q_envs + v_envs, policy, ret, first_actions=firsts + [None] * len(v_envs))
    q = returns[: T * n].reshape(T, n)
    v = returns[T * n:].reshape(T, n)
    ddof = 1 if n > 1 else 0
    se = np.sqrt(q.var(axis=1, ddof=ddof) / n + v.var(axis=1, ddof=ddof) / n)
    return TrueAdvantage(q.mean(1) - v.mean(1), se, q.mean(1), v.mean(1))


# ----------------------------------------------------------------------------------------------
# Agreement of a credit with A*
# ----------------------------------------------------------------------------------------------
def auc(credit, a_star) -> float:
    """P(credit of a turn with A* > 0 exceeds that of a turn with A* < 0), ties counted half (the
    Mann-Whitney statistic); turns with A* = 0 are left out; NaN without both kinds."""
    from scipy.stats import mannwhitneyu

    c, a = np.asarray(credit, float), np.asarray(a_star, float)
    pos, neg = c[a > 0], c[a < 0]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg)))


def spearman(credit, a_star) -> float:
    from scipy.stats import spearmanr

    c, a = np.asarray(credit, float), np.asarray(a_star, float)
    if len(c) < 3 or np.ptp(c) == 0 or np.ptp(a) == 0:
        return float("nan")
    return float(spearmanr(c, a).statistic)


def reliability(a_star, se) -> float:
    """The share of the variance of the estimated A* that is not Monte Carlo noise, 1 - mean(se^2) /
    var(A*): a correlation with A* is attenuated by about its square root."""
    a = np.asarray(a_star, float)
    var = a.var(ddof=1) if len(a) > 1 else 0.0
    return float(1.0 - np.mean(np.square(se)) / var) if var > 0 else float("nan")


def bootstrap_ci(stat: Callable, credit, a_star, clusters, reps: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """`stat(credit, a_star)` and its percentile bootstrap interval, resampling whole clusters (the
    episodes: the turns of one episode are not independent)."""
    c, a, g = np.asarray(credit, float), np.asarray(a_star, float), np.asarray(clusters)
    ids = np.unique(g)
    rows = [np.flatnonzero(g == i) for i in ids]
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(reps):
        take = np.concatenate([rows[i] for i in rng.integers(0, len(ids), len(ids))])
        v = stat(c[take], a[take])
        if math.isfinite(v):
            vals.append(v)
    lo, hi = (np.quantile(vals, [(1 - level) / 2, (1 + level) / 2]) if vals else (float("nan"),) * 2)
    return stat(c, a), float(lo), float(hi)


# ----------------------------------------------------------------------------------------------
# Policies and saved states from a script's rollout
# ----------------------------------------------------------------------------------------------
def model_policy(script, model, tok, temperature: float, max_new_tokens: int) -> Policy:
    """The script's own sampling (its `render_prompt`, `encode`, `generate`) as a batched Policy; a
    seated two-player game is prompted from the seat whose turn it is."""
    def act(envs: list) -> list:
        msgs = [e.observe(e.current_player) if hasattr(e, "observe") else e.messages() for e in envs]
        ids = [script.encode(tok, script.render_prompt(tok, m)) for m in msgs]
        out = []
        for k in range(0, len(ids), 256):
            comps = script.generate(model, tok, ids[k:k + 256], temperature, max_new_tokens)
            out += [tok.decode(c, skip_special_tokens=True) for c in comps]
        return out
    return act


def replayed_states(new_env, task_id: str, actions: Sequence[str]) -> list:
    """s_0 .. s_{T-1} of an episode, rebuilt by replaying its actions on a fresh env (the envs are
    deterministic given the texts played): states[t] is the env before actions[t]."""
    env = new_env()
    env.reset(task_id)
    states = []
    for a in actions:
        states.append(env.clone())
        env.step(a)
    return states


# ----------------------------------------------------------------------------------------------
# Methods: one batch of the script's own rollout, its credit per turn, and A* per turn
# ----------------------------------------------------------------------------------------------
def _import_script(name: str):
    import importlib
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    return importlib.import_module(name)


def graphgpo_batch(env_id: str, tasks: int, group: int, n: int, seed: int, argv: Sequence[str] = ()) -> dict:
    """GraphGPO, GiGPO and GRPO credit (graphgpo.py's `compute_advantages` with each --step-advantage) on
    one batch of `tasks` train tasks x `group` episodes of the shipped tiny policy, and A* of every turn."""
    import torch
    import tyro

    gg = _import_script("graphgpo")
    from common.models import load_policy

    args = tyro.cli(gg.Args, args=["--env-id", env_id, "--seed", str(seed), *argv])
    omega = gg.check_args(args)
    rng = gg.seed_everything(seed)
    new_env, probe, defaults, _ = gg.make_env(args)
    max_new = args.max_new_tokens or defaults.max_new_tokens
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False)
    train = list(probe.task_ids("train"))
    chosen = rng.choice(len(train), size=tasks, replace=False)
    task_ids = [train[i] for i in chosen for _ in range(group)]
    episodes = gg.rollout(model, tok, new_env, task_ids, [g for g in range(tasks) for _ in range(group)],
                          args.temperature, max_new)
    credit = {}
    for mode, label in (("graph", "GraphGPO"), ("gigpo", "GiGPO"), ("none", "GRPO")):
        args.step_advantage = mode
        samples, _ = gg.compute_advantages(episodes, args, omega)
        credit[label] = {(s["traj"], s["turn"]): s["adv"] for s in samples}
    states, actions, keys = [], [], []
    for ep in episodes:
        states += replayed_states(new_env, ep.task_id, ep.actions)
        actions += ep.actions
        keys += [(ep.traj_id, t) for t in range(ep.length)]
    with torch.no_grad():
        true = mc_advantages(states, actions, model_policy(gg, model, tok, args.temperature, max_new), n,
                             seed=seed)
    return dict(method="graphgpo", env=env_id, episodes=len(episodes), success=float(np.mean([e.success for e in episodes])),
                keys=keys, group_of={ep.traj_id: ep.group_id for ep in episodes},
                group_success={g: float(np.mean([e.success for e in episodes if e.group_id == g])) for g in range(tasks)},
                a_star=true.a_star, se=true.se, credit={k: np.array([v[key] for key in keys]) for k, v in credit.items()},
                method_label="GraphGPO", baseline_labels=("GRPO", "GiGPO"))
