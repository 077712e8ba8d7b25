"""Credit quality: each method's per-turn credit against the true advantage of each turn, by Monte Carlo.

A*(t) = Q(s_t, a_t) - V(s_t) under the policy that produced the rollout, from `n` continuations of a copy
of s_t (`env.clone()`) each for Q (play a_t) and V (sample a fresh action); SE sqrt(var_Q / n + var_V / n).
The return of a continuation is what the method's outcome measures (docs/credit_quality.md).

This file holds the Monte Carlo estimator, the statistics (Spearman correlation and AUC of a credit
against A*, with episode-bootstrap confidence intervals, and the reliability of A*), one adapter per
method (`<method>_batch`: one batch of the script's own rollout, the method's and its baseline's credit
per turn from the script's own functions, A* of a random subset of the turns) and the command:

    python benchmarks/credit_quality.py --report     # all five methods, seed 4, tables into docs/credit_quality.md
    python benchmarks/credit_quality.py --pool A.json B.json C.json   # seeds pooled (`pool_seeds`)
    python benchmarks/credit_quality.py --solver-check   # no model: GraphGPO's credit vs the Sokoban solver

docs/credit_quality.md explains the measurements, the sizing and the results; `tests/test_credit_quality.py`
checks the estimator on a two-turn game whose values are worked out by hand.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

# A batched policy: the envs whose turn it is -> one action text per env (it must not step them).
Policy = Callable[[list], list]
# A reward: (step, env after the step) -> the part of the return earned by that step; a continuation's
# return is the sum over its steps.
Reward = Callable[..., float]


def final_return(step, env=None) -> float:
    """The return of an episode from its steps: 1.0 at the last step of a success, else 0.0."""
    return float(bool(step.done and step.info.get("success")))


def play_out(envs: list, policy: Policy, ret=final_return, first_actions: Optional[list] = None,
             max_steps: int = 1000, bar=None) -> np.ndarray:
    """Play every env to its end with `policy` (batched: one policy call per turn for all live envs) and
    return each one's return: the sum of `ret(step, env)` over the steps it plays (`ret` is one Reward or
    one per env). `first_actions[i]`, when given, is env i's first move instead of the policy's (None: the
    policy's). An env that is already over returns 0. `bar`: a tqdm bar advanced as envs finish."""
    rets = list(ret) if isinstance(ret, (list, tuple)) else [ret] * len(envs)
    out = np.zeros(len(envs))
    live = [i for i, e in enumerate(envs) if not e.done]
    if bar is not None:
        bar.update(len(envs) - len(live))
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
            out[i] += rets[i](step, envs[i])
            if step.done:
                if bar is not None:
                    bar.update(1)
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
                  ret=final_return, seed: int = 0, keys: Optional[Sequence] = None,
                  desc: Optional[str] = None) -> TrueAdvantage:
    """A*(t) = Q(s_t, a_t) - V(s_t) for each (saved state, action) pair, from `n` continuations each.

    states[t]: an env (or seated game) in state s_t, before a_t; it is cloned, never stepped. `ret`: one
    Reward, or one per state (a two-player game scores the continuation for the seat that acts in s_t).
    `keys[t]`, when given, identifies s_t exactly (e.g. the task and the texts played so far): pairs with
    the same key share one V estimate, and those with the same key and action one Q estimate (the same
    numbers, computed once). All continuations are played together, so the policy sees large batches.
    `seed` seeds python's, numpy's and torch's global generators first (a sampling policy draws from them).
    `desc`: show a progress bar with this label."""
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # a policy that needs no torch
        pass
    T = len(states)
    rets = list(ret) if isinstance(ret, (list, tuple)) else [ret] * T
    keys = list(keys) if keys is not None else list(range(T))
    v_of, q_of = {}, {}  # key -> index of the state whose V (Q) continuations stand for it
    for t in range(T):
        v_of.setdefault(keys[t], t)
        q_of.setdefault((keys[t], actions[t]), t)
    v_idx, q_idx = list(v_of.values()), list(q_of.values())
    q_envs = [states[t].clone() for t in q_idx for _ in range(n)]
    v_envs = [states[t].clone() for t in v_idx for _ in range(n)]
    firsts = [actions[t] for t in q_idx for _ in range(n)]
    env_rets = [rets[t] for t in q_idx for _ in range(n)] + [rets[t] for t in v_idx for _ in range(n)]
    bar = None
    if desc is not None:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(q_envs) + len(v_envs), desc=desc, unit="game", dynamic_ncols=True, leave=False)
    returns = play_out(q_envs + v_envs, policy, env_rets, first_actions=firsts + [None] * len(v_envs), bar=bar)
    if bar is not None:
        bar.close()
    q_rows = returns[: len(q_envs)].reshape(len(q_idx), n)
    v_rows = returns[len(q_envs):].reshape(len(v_idx), n)
    qpos = {k: i for i, k in enumerate(q_of)}
    vpos = {k: i for i, k in enumerate(v_of)}
    q = np.stack([q_rows[qpos[(keys[t], actions[t])]] for t in range(T)]) if T else np.zeros((0, n))
    v = np.stack([v_rows[vpos[keys[t]]] for t in range(T)]) if T else np.zeros((0, n))
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


def within_episode_spearman(credit, a_star, clusters) -> float:
    """Does the credit order the turns of one episode as A* does? Spearman ρ of credit and A* after each is
    centred on its episode's mean, pooled over the episodes with at least two scored turns (a credit
    constant within every episode, as an outcome-only one, gives NaN)."""
    c, a, g = np.asarray(credit, float), np.asarray(a_star, float), np.asarray(clusters)
    scale_c, scale_a = (float(np.abs(x).max()) if len(x) else 0.0 for x in (c, a))
    keep = np.zeros(len(g), bool)
    c, a = c.copy(), a.copy()
    for i in np.unique(g):
        m = g == i
        if m.sum() > 1:
            keep |= m
            c[m] -= c[m].mean()
            a[m] -= a[m].mean()
    return spearman(_zero_noise(c[keep], scale_c), _zero_noise(a[keep], scale_a))


def _zero_noise(residuals, scale: float, rel: float = 1e-6):
    """Residuals below `rel` of the values' scale (their largest |value|) set to 0: a credit constant within
    an episode leaves float noise (~1e-17 from the mean, ~1e-8 where it was stored in float32, as a token
    mean of one advantage) that would otherwise be ranked."""
    x = np.asarray(residuals, float)
    return np.where(np.abs(x) <= rel * scale, 0.0, x)


def between_episode_spearman(credit, a_star, clusters) -> float:
    """Does the credit order whole episodes as A* does? Spearman ρ of the episodes' mean credit and mean A*
    (what an outcome-only credit can get right too)."""
    c, a, g = np.asarray(credit, float), np.asarray(a_star, float), np.asarray(clusters)
    ids = np.unique(g)
    return spearman([c[g == i].mean() for i in ids], [a[g == i].mean() for i in ids])


def reliability(a_star, se) -> float:
    """The share of the variance of the estimated A* that is not Monte Carlo noise, 1 - mean(se^2) /
    var(A*): a correlation with A* is attenuated by about its square root."""
    a = np.asarray(a_star, float)
    var = a.var(ddof=1) if len(a) > 1 else 0.0
    return float(1.0 - np.mean(np.square(se)) / var) if var > 0 else float("nan")


def bootstrap_ci(stat: Callable, credit, a_star, clusters, reps: int = 1000, seed: int = 0,
                 level: float = 0.95, by_cluster: bool = False) -> tuple[float, float, float]:
    """`stat(credit, a_star)` and its percentile bootstrap interval, resampling whole clusters (the
    episodes: the turns of one episode are not independent). With `by_cluster` the statistic is
    `stat(credit, a_star, clusters)`, and a cluster drawn twice counts as two clusters."""
    value, vals = bootstrap_draws(stat, credit, a_star, clusters, reps, seed, by_cluster)
    lo, hi = (np.quantile(vals, [(1 - level) / 2, (1 + level) / 2]) if len(vals) else (float("nan"),) * 2)
    return value, float(lo), float(hi)


def bootstrap_draws(stat: Callable, credit, a_star, clusters, reps: int = 1000, seed: int = 0,
                    by_cluster: bool = False) -> tuple[float, np.ndarray]:
    """`stat` on the data and its finite values on `reps` cluster-bootstrap resamples (see `bootstrap_ci`)."""
    c, a, g = np.asarray(credit, float), np.asarray(a_star, float), np.asarray(clusters)
    ids = np.unique(g)
    rows = [np.flatnonzero(g == i) for i in ids]
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(reps):
        drawn = [rows[i] for i in rng.integers(0, len(ids), len(ids))]
        take = np.concatenate(drawn)
        if by_cluster:
            v = stat(c[take], a[take], np.repeat(np.arange(len(drawn)), [len(d) for d in drawn]))
        else:
            v = stat(c[take], a[take])
        if math.isfinite(v):
            vals.append(v)
    return (stat(c, a, g) if by_cluster else stat(c, a)), np.asarray(vals, float)


def pool_seeds(estimates, variances, level: float = 0.95, bounds=(-math.inf, math.inf)) -> dict:
    """One statistic measured on several seeds (each with its episode-bootstrap variance) pooled with a
    random-effects model, so that the interval includes the seed-to-seed spread: DerSimonian-Laird's
    between-seed variance tau^2, weights 1 / (v_i + tau^2), and the Hartung-Knapp interval (t with k - 1
    degrees of freedom, its variance factor at least 1) that stays honest with 2-5 seeds. Non-finite
    estimates are left out; one seed gives its own normal interval. The interval is cut to `bounds`, the
    values the statistic can take (a correlation's [-1, 1])."""
    from scipy.stats import norm, t as student_t

    th, v = np.asarray(estimates, float), np.asarray(variances, float)
    keep = np.isfinite(th) & np.isfinite(v)
    th, v = th[keep], np.maximum(v[keep], 1e-12)
    k = len(th)
    if k == 0:
        return {"value": float("nan"), "ci": [float("nan")] * 2, "tau": float("nan"), "seeds": 0}
    if k == 1:
        half = norm.ppf((1 + level) / 2) * math.sqrt(v[0])
        return {"value": float(th[0]), "ci": [float(max(bounds[0], th[0] - half)),
                                              float(min(bounds[1], th[0] + half))], "tau": float("nan"), "seeds": 1}
    w = 1 / v
    fixed = np.sum(w * th) / w.sum()
    q = np.sum(w * (th - fixed) ** 2)
    tau2 = max(0.0, (q - (k - 1)) / (w.sum() - np.sum(w ** 2) / w.sum()))
    w = 1 / (v + tau2)
    value = float(np.sum(w * th) / w.sum())
    se = math.sqrt(max(1.0, np.sum(w * (th - value) ** 2) / (k - 1)) / w.sum())
    half = student_t.ppf((1 + level) / 2, k - 1) * se
    return {"value": value, "ci": [float(max(bounds[0], value - half)), float(min(bounds[1], value + half))],
            "tau": math.sqrt(tau2), "seeds": k}


# ----------------------------------------------------------------------------------------------
# Policies and saved states from a script's rollout
# ----------------------------------------------------------------------------------------------
def model_policy(script, model, tok, temperature: float, max_new_tokens: int, chunk: int = 256) -> Policy:
    """The script's own sampling (its `render_prompt`, `encode`, `generate` and `completion_text`: a
    completion cut at the token limit is played as "", as in its rollout) as a batched Policy; a seated
    two-player game is prompted from the seat whose turn it is."""
    def act(envs: list) -> list:
        msgs = [e.observe(e.current_player) if hasattr(e, "observe") else e.messages() for e in envs]
        ids = [script.encode(tok, script.render_prompt(tok, m)) for m in msgs]
        out = []
        for k in range(0, len(ids), chunk):
            comps = script.generate(model, tok, ids[k:k + chunk], temperature, max_new_tokens)
            out += [script.completion_text(tok, c, script.stop_ids(model, tok)) for c in comps]
        return out
    return act


def replayed_states(env, texts: Sequence[str]) -> list:
    """s_0 .. s_{T-1} of an episode, rebuilt by playing the texts the env read (`completion_text` of the
    completions) on `env`, freshly reset to the episode's task (the envs are deterministic given the texts
    played): states[t] is a copy of the env before texts[t]."""
    states = []
    for a in texts:
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


@dataclass
class Config:
    """The sizes of one method's measurement (defaults: `DEFAULTS`)."""

    tasks: int = 4  # groups (tasks) of the batch; ARIA/EPO: games = tasks * group
    group: int = 8  # episodes per task
    n: int = 16  # continuations for Q and for V of each scored turn
    turns: int = 120  # turns of the batch whose A* is estimated (a random subset; 0: all)
    seed: int = 1


def _regroup(group_ids: Sequence[int], size: int) -> list:
    """Group ids after splitting every group into consecutive subgroups of `size` episodes (the group
    size the credit would have seen)."""
    seen, out = {}, []
    for g in group_ids:
        k = seen.get(g, 0)
        seen[g] = k + 1
        out.append((int(g), k // size))
    ids = {x: i for i, x in enumerate(dict.fromkeys(out))}
    return [ids[x] for x in out]


def _finish(method: str, env_id: str, labels: tuple, rows: list, states: list, texts: list, keys: list,
            rets: list, policy: Policy, cfg: Config, extra: dict) -> dict:
    """Estimate A* on a random subset of `cfg.turns` of the batch's turns and collect the result: one row
    per scored turn (traj, group, turn, each credit, a_star, se, q, v, and the adapter's context keys)."""
    import time

    rng = np.random.default_rng(cfg.seed + 1000)
    pick = np.arange(len(rows))
    if cfg.turns and cfg.turns < len(rows):
        pick = np.sort(rng.choice(len(rows), size=cfg.turns, replace=False))
    t0 = time.time()
    true = mc_advantages([states[i] for i in pick], [texts[i] for i in pick], policy, cfg.n,
                         [rets[i] for i in pick], seed=cfg.seed, keys=[keys[i] for i in pick],
                         desc=f"{method} A* ({len(pick)} turns x 2 x {cfg.n})")
    out_rows = []
    for j, i in enumerate(pick):
        r = dict(rows[i])
        r.update(a_star=float(true.a_star[j]), se=float(true.se[j]), q=float(true.q[j]), v=float(true.v[j]))
        out_rows.append(r)
    return dict(method=method, env=env_id, labels=list(labels), config=vars(cfg).copy(),
                turns_in_batch=len(rows), turns_scored=len(pick), mc_seconds=time.time() - t0,
                rows=out_rows, **extra)


def _check_replay(env, observations: Sequence[str], traj_id) -> None:
    """The replayed single-agent episode must have ended with the observations the rollout saw."""
    if not env.done or [o for _, o in env.trajectory] != list(observations):
        raise RuntimeError(f"replaying episode {traj_id} did not reproduce its observations")


def _prefix_keys(task_id, texts: Sequence[str], tag=()) -> list:
    """keys[t] = (tag, task, texts[:t]): the state before turn t, exactly (the envs are deterministic)."""
    return [(tag, str(task_id), tuple(texts[:t])) for t in range(len(texts))]


def graphgpo_batch(cfg: Config, env_id: str = "sokoban", argv: Sequence[str] = ()) -> dict:
    """GraphGPO, GiGPO and GRPO credit (graphgpo.py's `compute_advantages` with each --step-advantage) on
    one batch of `tasks` train tasks x `group` episodes of the shipped tiny policy, and A* of its turns.
    The return is the one GRPO's outcome measures: r_succ on success minus invalid_penalty per invalid
    action."""
    import dataclasses

    import torch
    import tyro

    gg = _import_script("graphgpo")
    from common.models import load_policy

    args = tyro.cli(gg.Args, args=["--env-id", env_id, "--seed", str(cfg.seed), "--group-size", str(cfg.group),
                                   "--tasks-per-iteration", str(cfg.tasks), *argv])
    rng = gg.seed_everything(cfg.seed)
    args, new_env, probe, _ = gg.make_env(args)  # every option the flags leave at None, checked
    max_new = args.max_new_tokens
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False)
    train = list(probe.task_ids("train"))
    chosen = rng.choice(len(train), size=cfg.tasks, replace=False)
    G = cfg.group
    episodes = gg.rollout(model, tok, new_env, [train[i] for i in chosen for _ in range(G)],
                          [g for g in range(cfg.tasks) for _ in range(G)], args.temperature, max_new)

    def credit_of(eps):
        out = {}
        for mode, label in (("graph", "GraphGPO"), ("gigpo", "GiGPO"), ("none", "GRPO")):
            samples, _ = gg.compute_advantages(eps, dataclasses.replace(args, step_advantage=mode))
            out[label] = {(x.traj, x.turn): x.adv for x in samples}
        return out

    by_size = {}
    for size in _group_sizes(G):
        regroup = _regroup([ep.group_id for ep in episodes], size)
        by_size[size] = credit_of([dataclasses.replace(ep, group_id=g) for ep, g in zip(episodes, regroup)])
    gsucc = {g: float(np.mean([e.success for e in episodes if e.group_id == g])) for g in range(cfg.tasks)}
    rows, states, texts, keys, rets = [], [], [], [], []
    reward = _sokoban_reward(success=args.r_succ, invalid=args.invalid_penalty, shaped=False)
    for ep in episodes:
        played = [gg.completion_text(tok, c, gg.stop_ids(model, tok)) for c in ep.completions]
        env = new_env()
        env.reset(ep.task_id)
        states += replayed_states(env, played)
        _check_replay(env, ep.observations, ep.traj_id)
        texts += played
        keys += _prefix_keys(ep.task_id, played)
        rets += [reward] * ep.length
        for t in range(ep.length):
            rows.append(dict(traj=ep.traj_id, group=ep.group_id, turn=t, group_success=gsucc[ep.group_id],
                             credit={lab: float(c[(ep.traj_id, t)]) for lab, c in by_size[G].items()},
                             credit_by_group_size={str(s): {lab: float(c[(ep.traj_id, t)]) for lab, c in cs.items()}
                                                   for s, cs in by_size.items() if s != G}))
    with torch.no_grad():
        return _finish("graphgpo", env_id, ("GraphGPO", "GRPO", "GiGPO"), rows, states, texts, keys, rets,
                       model_policy(gg, model, tok, args.temperature, max_new), cfg,
                       dict(episodes=len(episodes), success=float(np.mean([e.success for e in episodes])),
                            return_measured=f"{args.r_succ:g} x success - {args.invalid_penalty:g} x invalid actions"))


def _group_sizes(G: int) -> list:
    return [s for s in (2, 4, 8, 16) if s < G and G % s == 0] + [G]


def _sokoban_reward(success: float, invalid: float, shaped: bool) -> Reward:
    def reward(step, env=None) -> float:
        r = float(step.reward) if shaped else success * float(bool(step.done and step.info.get("success")))
        return r - invalid * float(bool(step.info.get("invalid")))
    return reward


def pair_counts(step_rewards, traj_index, traj_success, traj_group, reduce="mean") -> dict:
    """iStar's PRM on the (positive, negative) pairs as it scores them now: the accuracy (S(τ+) > S(τ-); a
    tie is wrong), the mean margin S(τ+) - S(τ-) and the DPO loss; NaN without pairs."""
    import torch
    import torch.nn.functional as F

    ist = _import_script("istar")
    pairs = ist.preference_pairs(traj_success, traj_group)
    if pairs.shape[0] == 0:
        return {"acc": math.nan, "margin": math.nan, "loss": math.nan}
    s = ist.trajectory_scores(torch.as_tensor(step_rewards).double(), traj_index, len(traj_group), reduce)
    d = s[pairs[:, 0]] - s[pairs[:, 1]]
    return {"acc": float((d > 0).double().mean()), "margin": float(d.mean()), "loss": float(-F.logsigmoid(d).mean())}


def istar_batch(cfg: Config, env_id: str = "sokoban", argv: Sequence[str] = (), warm_batches: int = 4) -> dict:
    """iStar's advantage (istar.py: `old_logprob_turns`, `prm_update`, `compute_advantages`) and RLOO's
    (`--alpha 0`: the same outcome term, no step term) on one batch, and A* of its turns.

    iStar credits a batch with the PRM's step rewards scored before the PRM trains on that batch's pairs.
    A fresh PRM equals the policy (its LoRA starts at zero), so at iteration 1 every step reward is 0 and
    iStar's credit is RLOO's; the PRM here first takes the script's PRM step (`prm_update`) on
    `warm_batches` earlier batches of the same (frozen) policy, as in iterations 1..warm_batches of a run
    whose policy had not moved (the script's PRM settings: its learning rate and its replay of the last
    `prm_replay` batches' pairs), and then scores this batch ("iStar"). "iStar (in-sample PRM)" scores it
    again after the PRM step on this batch's own pairs. The return is the script's outcome: the env
    return (shaped Sokoban reward by default) minus invalid_penalty per invalid action."""
    import dataclasses

    import torch
    import tyro

    ist = _import_script("istar")
    from common.models import add_adapter, load_policy

    args = tyro.cli(ist.Args, args=["--env-id", env_id, "--seed", str(cfg.seed), "--group-size", str(cfg.group),
                                    "--tasks-per-iteration", str(cfg.tasks), *argv])
    rng = ist.seed_everything(cfg.seed)
    args, new_env, probe, _ = ist.make_env(args)  # every option the flags leave at None
    prm_lr = args.prm_learning_rate  # the script's (tiny: DEFAULTS; a real model: the official 2x)
    max_new, threshold = args.max_new_tokens, args.positive_threshold
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False,
                             lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    add_adapter(model, "prm", lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    model.set_adapter("default")
    prm_optimizer = torch.optim.AdamW(ist.adapter_params(model, "prm"), lr=prm_lr,
                                      weight_decay=args.prm_weight_decay)
    train = list(probe.task_ids("train"))
    G = cfg.group

    def batch():
        chosen = rng.choice(len(train), size=cfg.tasks, replace=len(train) < cfg.tasks)
        eps = ist.rollout(model, tok, new_env, [train[i] for i in chosen for _ in range(G)],
                          [g for g in range(cfg.tasks) for _ in range(G)], args.temperature, max_new)
        samples = ist.old_logprob_turns(model, tok, eps, args)  # one per turn, with π_θold's log-probs
        return eps, samples

    replay = deque(maxlen=args.prm_replay)  # as in istar.py's main: the last prm_replay paired batches
    for _ in range(warm_batches):
        eps, samples = batch()
        _, succ, grp = ist.trajectory_outcomes(eps, args.invalid_penalty, threshold)
        *_, mine = ist.prm_update(model, tok, prm_optimizer, samples, succ, grp, args, replay)
        replay.appendleft(mine)
    episodes, samples = batch()
    _, succ, grp = ist.trajectory_outcomes(episodes, args.invalid_penalty, threshold)
    log_ratios, step_rewards, pstats, _ = ist.prm_update(model, tok, prm_optimizer, samples, succ, grp, args, replay)
    held = pair_counts(step_rewards, [x.traj for x in samples], succ, grp, args.dpo_reduce)  # held-out accuracy
    log_ratios_in = ist.prm_log_ratios(model, tok, samples, args)
    model.set_adapter("default")

    def mean_adv(x):  # a turn's advantage, or the mean of its tokens' (--step-reward-granularity token)
        adv = x.adv if torch.is_tensor(x.adv) else torch.full((len(x.completion),), x.adv)
        return float(adv.float().mean()) if len(adv) else 0.0

    def credit_of(group_ids):
        regrouped = [dataclasses.replace(ep, group_id=int(g)) for ep, g in zip(episodes, group_ids)]
        out = {}
        for label, alpha, signal in (("iStar", args.alpha, log_ratios), ("RLOO", 0.0, None),
                                     ("iStar (in-sample PRM)", args.alpha, log_ratios_in)):
            xs, _ = ist.compute_advantages(regrouped, dataclasses.replace(args, alpha=alpha), signal)
            out[label] = {(x.traj, x.turn): mean_adv(x) for x in xs}
        return out

    by_size = {s: credit_of(_regroup(grp.tolist(), s)) for s in _group_sizes(G)}
    gsucc = {g: float(np.mean([e.success for e in episodes if e.group_id == g])) for g in range(cfg.tasks)}
    reward = _sokoban_reward(success=1.0, invalid=args.invalid_penalty, shaped=True)
    rows, states, texts, keys, rets = [], [], [], [], []
    for ep in episodes:
        played = [ist.completion_text(tok, c, ist.stop_ids(model, tok)) for c in ep.completions]
        env = new_env()
        env.reset(ep.task_id)
        states += replayed_states(env, played)
        _check_replay(env, ep.observations, ep.traj_id)
        texts += played
        keys += _prefix_keys(ep.task_id, played)
        rets += [reward] * ep.length
        for t in range(ep.length):
            rows.append(dict(traj=ep.traj_id, group=ep.group_id, turn=t, group_success=gsucc[ep.group_id],
                             credit={lab: c[(ep.traj_id, t)] for lab, c in by_size[G].items()},
                             credit_by_group_size={str(s): {lab: c[(ep.traj_id, t)] for lab, c in cs.items()}
                                                   for s, cs in by_size.items() if s != G}))
    with torch.no_grad():
        return _finish("istar", env_id, ("iStar", "RLOO", "iStar (in-sample PRM)"), rows, states, texts, keys, rets,
                       model_policy(ist, model, tok, args.temperature, max_new), cfg,
                       dict(episodes=len(episodes), success=float(np.mean([e.success for e in episodes])),
                            prm_warm_batches=warm_batches, prm_learning_rate=prm_lr, prm_replay=args.prm_replay,
                            prm_heldout_pair_acc=held["acc"],
                            prm_pairs=pstats["pairs"],
                            return_measured=(f"env return ({args.sokoban_reward} reward)" if env_id == "sokoban" else "env return")
                            + f" - {args.invalid_penalty:g} x invalid actions"))


def delta_belief_batch(cfg: Config, env_id: str = "twenty_questions", argv: Sequence[str] = ()) -> dict:
    """ΔBelief's turn advantages (delta_belief.py's `rollout` with the policy's own beliefs and
    `compute_advantages`, --reward-mode delta), StarPO's (--reward-mode starpo: the trajectory
    advantage on every turn) and ΔBelief's with λ 0 (--lam 0: the same turn-wise normalisation of the
    task's own per-turn rewards, without the belief gain) on one batch, and A* of its turns. The return
    is the task's (StarPO's): win_reward on a win, minus turn_penalty per turn, invalid_penalty per
    invalid and repeat_penalty per repeated question."""
    import dataclasses

    import torch
    import tyro

    db = _import_script("delta_belief")
    from common.models import load_policy

    args = tyro.cli(db.Args, args=["--env-id", env_id, "--seed", str(cfg.seed), "--group-size", str(cfg.group),
                                   "--tasks-per-iteration", str(cfg.tasks), *argv])
    rng = db.seed_everything(cfg.seed)
    args, new_env, probe, _ = db.make_env(args)  # every option the flags leave at None, checked
    belief_message = db.belief_message_for(args, probe)
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False,
                             lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    train = list(probe.task_ids("train"))
    G = cfg.group
    chosen = rng.choice(len(train), size=cfg.tasks, replace=len(train) < cfg.tasks)
    episodes = db.rollout(model, tok, new_env, [train[i] for i in chosen for _ in range(G)],
                          [g for g in range(cfg.tasks) for _ in range(G)], args, args.temperature, belief_message,
                          with_beliefs=True)

    def credit_of(eps):
        out = {}
        for mode, lam, label in (("delta", args.lam, "ΔBelief"), ("starpo", args.lam, "StarPO"),
                                 ("delta", 0.0, "λ 0")):
            samples, _ = db.compute_advantages(eps, dataclasses.replace(args, reward_mode=mode, lam=lam))
            out[label] = {(x.traj, x.turn): float(x.adv) for x in samples}
        return out

    by_size = {}
    for size in _group_sizes(G):
        regroup = _regroup([ep.group_id for ep in episodes], size)
        by_size[size] = credit_of([dataclasses.replace(ep, group_id=g) for ep, g in zip(episodes, regroup)])
    gsucc = {g: float(np.mean([e.success for e in episodes if e.group_id == g])) for g in range(cfg.tasks)}

    def reward(step, env=None) -> float:
        info = step.info
        return (args.win_reward * float(bool(step.done and info.get("success"))) - args.turn_penalty
                - args.invalid_penalty * float(bool(info.get("invalid")))
                - args.repeat_penalty * float(bool(info.get("repeated"))))

    rows, states, texts, keys, rets = [], [], [], [], []
    for ep in episodes:
        played = [db.completion_text(tok, c, db.stop_ids(model, tok)) for c in ep.completions]
        env = new_env()
        env.reset(ep.task_id)
        states += replayed_states(env, played)
        _check_replay(env, ep.observations, ep.traj_id)
        texts += played
        keys += _prefix_keys(ep.task_id, played)
        rets += [reward] * ep.length
        for t in range(ep.length):
            rows.append(dict(traj=ep.traj_id, group=ep.group_id, turn=t, group_success=gsucc[ep.group_id],
                             credit={lab: c[(ep.traj_id, t)] for lab, c in by_size[G].items()},
                             credit_by_group_size={str(s): {lab: c[(ep.traj_id, t)] for lab, c in cs.items()}
                                                   for s, cs in by_size.items() if s != G}))
    with torch.no_grad():
        return _finish("delta_belief", env_id, ("ΔBelief", "StarPO", "λ 0"), rows, states, texts, keys,
                       rets, model_policy(db, model, tok, args.temperature, args.max_new_tokens), cfg,
                       dict(episodes=len(episodes), success=float(np.mean([e.success for e in episodes])),
                            return_measured=(f"{args.win_reward:g} x win - {args.turn_penalty:g} x turns - "
                                             f"{args.invalid_penalty:g} x invalid - {args.repeat_penalty:g} x repeated")))


def aria_batch(cfg: Config, env_id: str = "bargaining", argv: Sequence[str] = ()) -> dict:
    """ARIA's aggregated rewards (aria.py's `rollout` in self-play and `compute_advantages`: embed,
    cluster, aggregate) and REINFORCE's raw discounted returns (--no-aggregate) on one batch of
    tasks x group self-play games, and A* of its steps. A step's return is its own seat's outcome (the
    normalised payoff, `--game-reward payoff`), with the policy in the other seat as in the rollout."""
    import torch
    import tyro

    ar = _import_script("aria")
    from common.models import load_policy

    games = cfg.tasks * cfg.group
    args = tyro.cli(ar.Args, args=["--env-id", env_id, "--seed", str(cfg.seed), "--games-per-iteration", str(games),
                                   *argv])
    rng = ar.seed_everything(cfg.seed)
    args, new_env, probe, _ = ar.make_env(args)  # the options the flags leave at None: DEFAULTS
    embedder = ar.Embedder(args.embedder, dim=args.embed_dim)
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False,
                             lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    embedder.model, embedder.tok = model, tok
    train = list(probe.task_ids("train"))
    tasks = [train[i] for i in rng.choice(len(train), size=games, replace=len(train) < games)]
    episodes = ar.rollout(model, tok, new_env, tasks, args, args.temperature)
    signal = ar.embed_utterances(embedder, episodes, args.observation_labels)
    samples, cstats = ar.compute_advantages(episodes, args, signal)
    if not args.aggregate:
        raise ValueError("aria_batch compares ARIA's aggregated rewards with the raw returns: leave --aggregate on")
    by_step = {(x.traj, x.turn): x for x in samples}

    import envs

    two_player = env_id in envs.TWO_PLAYER

    def outcome_of(player):
        if not two_player:
            return final_return  # a single-agent env: R = 1 if solved (aria.py's rollout)

        def reward(step, env) -> float:
            return float(min(1.0, max(0.0, env.progress(player)))) if step.done else 0.0
        return reward

    rows, states, texts, keys, rets = [], [], [], [], []
    for ep in episodes:
        played = [ar.completion_text(tok, s["completion"], ar.stop_ids(model, tok)) for s in ep.steps]
        game = new_env().reset(ep.task_id)
        states += replayed_states(game, played)
        if two_player and abs(float(np.mean(list(game.env.payoffs().values()))) - ep.env_return) > 1e-9:
            raise RuntimeError(f"replaying game {ep.traj_id} did not reproduce its payoffs")
        if not two_player:
            _check_replay(game.env, ep.utterances[1::2], ep.traj_id)
        texts += played
        keys += _prefix_keys(ep.task_id, played)
        players = [s["player"] for s in ep.steps]  # REINFORCE's weights: the raw discounted returns
        raw = ar.turn_returns([ep.traj_id] * len(players), players, [ep.outcome.get(p, 0.0) for p in players],
                              args.gamma)
        for t, s in enumerate(ep.steps):
            rets.append(outcome_of(s["player"]))
            x = by_step[(ep.traj_id, t)]
            rows.append(dict(traj=ep.traj_id, group=ep.traj_id, turn=t, player=s["player"],
                             outcome=float(ep.outcome.get(s["player"], 0.0)), deal=bool(ep.success),
                             bucket=("deal" if ep.success else "no deal") if two_player else
                             ("solved" if ep.success else "not solved"),
                             credit={"ARIA": x.adv, "REINFORCE": float(raw[t])}))
    with torch.no_grad():
        return _finish("aria", env_id, ("ARIA", "REINFORCE"), rows, states, texts, keys, rets,
                       model_policy(ar, model, tok, args.temperature, args.max_new_tokens), cfg,
                       dict(episodes=len(episodes), success=float(np.mean([e.success for e in episodes])),
                            selected_k=cstats["credit/selected_k"],
                            return_measured=("the acting seat's normalised payoff (deal position in [0, 1]), self-play"
                                             if two_player else "1 if solved, else 0")))


def epo_batch(cfg: Config, env_id: str = "negotiation", argv: Sequence[str] = ()) -> dict:
    """EPO's turn weights (epo.py's `training_games` with `--train-opponent rule:any`, the tiny default;
    `rollout` and `compute_advantages` with the rule PRM's critical turns) and the outcome-only weights
    (--prm none) on one batch of tasks x group games, and A* of the strategist's turns. A turn's action is
    the move the rule agent makes from the strategist's strategy; the continuation samples the strategist
    (its own prompt, as in the rollout), lets the rule agent move and the scripted style reply. The
    return is the strategist's seat's goal score / 10 (the outcome in EPO's weights)."""
    import dataclasses

    import torch
    import tyro

    ep_mod = _import_script("epo")
    from common.models import load_policy
    from common.tiny import strategist_overrides

    games_n = cfg.tasks * cfg.group
    args = tyro.cli(ep_mod.Args, args=["--env-id", env_id, "--seed", str(cfg.seed),
                                       "--episodes-per-iteration", str(games_n), *argv])
    rng = ep_mod.seed_everything(cfg.seed)
    args, new_env, probe, _ = ep_mod.make_env(args)  # every default set (DEFAULTS), checked
    policy = ep_mod.strategist_policy(args)
    import envs

    two_player = env_id in envs.TWO_PLAYER
    if not (two_player and (policy.is_tiny or policy.sft) and args.agent == "rule"):
        raise ValueError("epo_batch measures a tiny or SFT strategist with the rule agent in a two-player game")
    if args.train_opponent == "self":  # a real model's preset trains in self-chat; A* needs scripted styles
        args = dataclasses.replace(args, train_opponent="rule:any")
    players, styles = list(probe.players), list(probe.opponent_styles())
    model, tok = load_policy(args.model_name, env_id=env_id, tiny_preset=args.tiny_preset, load_in_4bit=False,
                             lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             tiny_overrides=strategist_overrides(env_id))
    train = list(probe.task_ids("train"))
    pick = rng.choice(len(train), size=games_n, replace=len(train) < games_n)
    games = ep_mod.training_games(new_env, [train[int(i)] for i in pick], players, styles, args, rng)
    episodes = ep_mod.rollout(model, tok, games, args, args.temperature)
    credit, critical = {}, {}
    for prm, label in (("rule", "EPO"), ("none", "outcome-only")):
        eps = [dataclasses.replace(e) for e in episodes]
        samples, _ = ep_mod.compute_advantages(eps, dataclasses.replace(args, prm=prm))
        credit[label] = {(x.traj, x.turn): x.adv for x in samples}
        if prm == "rule":  # the rule PRM's marks, recorded on the episodes' copies
            critical = {(e.traj_id, t): bool(c) for e in eps for t, c in enumerate(e.critical)}

    def strategist(games_: list) -> list:
        who = [g.current_player for g in games_]
        prompts = [ep_mod.encode(tok, ep_mod.render_prompt(tok, ep_mod.strategist_messages(g, p, [], False)))
                   for g, p in zip(games_, who)]
        out = []
        for k in range(0, len(prompts), 256):
            comps = ep_mod.generate(model, tok, prompts[k:k + 256], args.temperature, args.max_new_tokens)
            out += [ep_mod.strategy_of(ep_mod.completion_text(tok, c, ep_mod.stop_ids(model, tok))) for c in comps]
        return [g.env.rule_agent_action(p, s) for g, p, s in zip(games_, who, out)]

    def score_of(player):
        def reward(step, env) -> float:
            return float(env.env.scores()[player]) / 10.0 if step.done else 0.0
        return reward

    rows, states, texts, keys, rets = [], [], [], [], []
    for e in episodes:
        other = [p for p in players if p != e.player][0]
        seats = {e.player: "policy", other: e.opponent}
        game = new_env(e.task_id, seats)
        states += replayed_states(game, e.moves)
        if abs(game.env.scores()[e.player] / 10.0 - e.outcome) > 1e-9:
            raise RuntimeError(f"replaying game {e.traj_id} did not reproduce its outcome")
        texts += list(e.moves)
        keys += _prefix_keys(e.task_id, e.moves, tag=(e.player, e.opponent))
        rets += [score_of(e.player)] * e.length
        for t in range(e.length):
            rows.append(dict(traj=e.traj_id, group=e.traj_id, turn=t, opponent=e.opponent, outcome=e.outcome,
                             critical=critical.get((e.traj_id, t), False),
                             credit={lab: c[(e.traj_id, t)] for lab, c in credit.items()}))
    with torch.no_grad():
        return _finish("epo", env_id, ("EPO", "outcome-only"), rows, states, texts, keys, rets, strategist, cfg,
                       dict(episodes=len(episodes), goal_score=float(np.mean([e.score for e in episodes])),
                            return_measured="the strategist's goal score / 10, against the game's scripted style"))


# ----------------------------------------------------------------------------------------------
# Summary, report, command line
# ----------------------------------------------------------------------------------------------
ADAPTERS = {"graphgpo": graphgpo_batch, "istar": istar_batch, "delta_belief": delta_belief_batch,
            "aria": aria_batch, "epo": epo_batch}
# The default run (`python benchmarks/credit_quality.py`): per method, the batch (tasks x group, the
# scripts' own batch sizes where the CPU allows) and the Monte Carlo sizes, chosen so that the whole run
# takes at most 20 minutes on 2 CPU cores with one torch thread (docs/credit_quality.md, "Sizing").
DEFAULTS = {
    "graphgpo": Config(tasks=4, group=8, n=32, turns=80),
    "istar": Config(tasks=4, group=8, n=32, turns=80),
    "delta_belief": Config(tasks=4, group=8, n=16, turns=50),
    "aria": Config(tasks=8, group=8, n=32, turns=80),
    "epo": Config(tasks=8, group=8, n=32, turns=80),
}
REPORT_BEGIN, REPORT_END = "<!-- credit-quality:begin -->", "<!-- credit-quality:end -->"
POOLED_BEGIN, POOLED_END = "<!-- credit-quality-pooled:begin -->", "<!-- credit-quality-pooled:end -->"
SOLVER_BEGIN, SOLVER_END = "<!-- credit-quality-solver:begin -->", "<!-- credit-quality-solver:end -->"


def _bucket(method: str, row: dict) -> str:
    """The success context of a turn: its group's success rate (groups of one task), or for the
    two-player games its own game's result."""
    if "bucket" in row:
        return row["bucket"]
    if method == "aria":
        return "deal" if row["deal"] else "no deal"
    if method == "epo":
        return "score >= 5" if row["outcome"] >= 0.5 else "score < 5"
    s = row["group_success"]
    return "group success 0" if s == 0 else ("group success 1" if s == 1 else "0 < group success < 1")


def _stats(credit, a_star, clusters, reps: int, seed: int) -> dict:
    out = {"turns": int(len(a_star))}
    for name, fn in (("spearman", spearman), ("auc", auc)):
        v, lo, hi = bootstrap_ci(fn, credit, a_star, clusters, reps=reps, seed=seed)
        out[name], out[name + "_ci"] = v, [lo, hi]
    return out


def summarize(result: dict, reps: int = 1000) -> dict:
    """Agreement of every credit with A* (Spearman, AUC with episode-cluster bootstrap intervals), the
    reliability of A*, and the same by group size and by success context."""
    rows, seed = result["rows"], result["config"]["seed"]
    a = np.array([r["a_star"] for r in rows])
    se = np.array([r["se"] for r in rows])
    traj = np.array([r["traj"] for r in rows])
    out = {"reliability": reliability(a, se), "mean_se": float(se.mean()), "sd_a_star": float(a.std(ddof=1)),
           "a_star_zero_frac": float(np.mean(a == 0)), "a_star_pos_frac": float(np.mean(a > 0)),
           "a_star_neg_frac": float(np.mean(a < 0)), "credit": {}, "by_group_size": {}, "by_success": {}}
    for lab in result["labels"]:
        c = np.array([r["credit"][lab] for r in rows])
        out["credit"][lab] = _stats(c, a, traj, reps, seed)
        for name, fn in (("within", within_episode_spearman), ("between", between_episode_spearman)):
            v, lo, hi = bootstrap_ci(fn, c, a, traj, reps, seed, by_cluster=True)
            out["credit"][lab][name], out["credit"][lab][name + "_ci"] = v, [lo, hi]
    main = np.array([r["credit"][result["labels"][0]] for r in rows])
    out["vs_method"] = {}
    for lab in result["labels"][1:]:  # the method minus each baseline, on the same resampled episodes
        pair = np.stack([main, [r["credit"][lab] for r in rows]], axis=1)
        out["vs_method"][lab] = {}
        for name, fn in (("spearman", spearman), ("auc", auc)):
            v, lo, hi = bootstrap_ci(lambda c, a_, fn=fn: fn(c[:, 0], a_) - fn(c[:, 1], a_), pair, a, traj, reps, seed)
            out["vs_method"][lab][name], out["vs_method"][lab][name + "_ci"] = v, [lo, hi]
    sizes = sorted({s for r in rows for s in r.get("credit_by_group_size", {})}, key=int)
    for s in sizes:
        out["by_group_size"][s] = {lab: _stats(np.array([r["credit_by_group_size"][s][lab] for r in rows]), a, traj,
                                               reps // 5, seed) for lab in result["labels"]}
    if sizes:
        out["by_group_size"][str(result["config"]["group"])] = {
            lab: {k: v for k, v in out["credit"][lab].items()} for lab in result["labels"]}
    buckets = np.array([_bucket(result["method"], r) for r in rows])
    for b in sorted(set(buckets)):
        m = buckets == b
        out["by_success"][b] = {lab: _stats(np.array([r["credit"][lab] for r, k in zip(rows, m) if k]), a[m],
                                            traj[m], reps // 5, seed) for lab in result["labels"]}
        out["by_success"][b]["_reliability"] = reliability(a[m], se[m])
    return out


def pooled_summary(datas: Sequence[dict], reps: int = 1000) -> dict:
    """The results of several seeds (one `--out` file each) pooled per method and env that two or more
    of them measured: per seed each credit's Spearman ρ, AUC and within-episode ρ, and the method minus
    each baseline, with their episode-bootstrap variances, pooled by `pool_seeds`."""
    stats = (("spearman", spearman, False), ("auc", auc, False), ("within", within_episode_spearman, True))
    bounds = {"spearman": (-1, 1), "auc": (0, 1), "within": (-1, 1)}  # a difference of two: twice the width
    keys = [k for k in dict.fromkeys(k for d in datas for k in d["results"])
            if sum(k in d["results"] for d in datas) > 1]
    out = {"seeds": [d["seed"] for d in datas], "results": {}}
    for key in keys:
        runs = [(d["seed"], d["results"][key]) for d in datas if key in d["results"]]
        labels = runs[0][1]["labels"]
        per = {"method": runs[0][1]["method"], "env": runs[0][1]["env"], "labels": labels,
               "seeds": [s for s, _ in runs], "per_seed": {}, "credit": {}, "vs_method": {}}
        draws = {}  # ("credit" or "vs_method", label, stat) -> [(estimate, variance) per seed]
        for seed, res in runs:
            rows = res["rows"]
            a = np.array([r["a_star"] for r in rows])
            traj = np.array([r["traj"] for r in rows])
            cred = {lab: np.array([r["credit"][lab] for r in rows]) for lab in labels}
            per["per_seed"][str(seed)] = {"reliability": reliability(a, [r["se"] for r in rows])}
            # a credit that is the same on every turn (e.g. a batch whose groups all ended alike) orders
            # nothing: its ρ is undefined and its AUC a tie of 0.5 with no variance, which would outweigh
            # every other seed, so the seed is left out of each statistic that involves that credit
            flat = {lab: bool(np.ptp(cred[lab]) == 0) for lab in labels}
            def estimate(fn, c, by_cluster=False):  # (value, bootstrap variance)
                v, d_ = bootstrap_draws(fn, c, a, traj, reps, seed, by_cluster)
                return v, d_.var(ddof=1) if len(d_) > 1 else np.nan

            for lab in labels:
                for name, fn, by_cluster in stats:
                    ev = (np.nan, np.nan) if flat[lab] else estimate(fn, cred[lab], by_cluster)
                    draws.setdefault(("credit", lab, name), []).append(ev)
            for lab in labels[1:]:
                pair = np.stack([cred[labels[0]], cred[lab]], axis=1)
                for name, fn, _ in stats[:2]:
                    ev = ((np.nan, np.nan) if flat[labels[0]] or flat[lab]
                          else estimate(lambda c, a_, fn=fn: fn(c[:, 0], a_) - fn(c[:, 1], a_), pair))
                    draws.setdefault(("vs_method", lab, name), []).append(ev)
        for (kind, lab, name), ev in draws.items():
            est, var = zip(*ev)
            lo, hi = bounds[name]
            per[kind].setdefault(lab, {})[name] = pool_seeds(
                est, var, bounds=(lo - hi, hi - lo) if kind == "vs_method" else (lo, hi)) | {"per_seed": list(est)}
        out["results"][key] = per
    return out


def pooled_report(pooled: dict) -> str:
    """The markdown of `pooled_summary`: one table, a row per credit and per paired difference."""
    lines = [f"Seeds {', '.join(map(str, pooled['seeds']))}: one batch each at the sizes the runs used. Per seed: "
             "Spearman ρ of the credit with A* (n/a: the credit was the same on every scored turn, so it has no "
             "ρ, and the seed is left out of that row's pool). Pooled: the random-effects mean over the seeds with "
             "a 95% interval that includes the seed-to-seed spread (`pool_seeds`: DerSimonian-Laird, "
             "Hartung-Knapp t interval with seeds - 1 degrees of freedom; \"k of n seeds\" where fewer seeds than "
             "measured it had a ρ; one seed: its own bootstrap interval); τ: the seed-to-seed standard deviation "
             "of ρ beyond the episode bootstrap's (0: none detected). AUC and within-episode ρ pooled the same "
             "way.", "",
             "| credit (method, env) | ρ per seed | pooled ρ [95% CI] | τ | pooled AUC [95% CI] | "
             "within episodes: pooled ρ [95% CI] |", "|---|---|---|---|---|---|"]
    def of(stat: dict) -> str:  # the pooled cell, with how many seeds went into it where some had no value
        n = len(stat["per_seed"])
        return _num(stat["value"], stat["ci"]) + (f" ({stat['seeds']} of {n} seeds)" if 0 < stat["seeds"] < n else "")

    for key, r in pooled["results"].items():
        for k, lab in enumerate(r["labels"]):
            c = r["credit"][lab]
            lines.append(f"| {f'**{lab}**' if k == 0 else lab} ({key}) | "
                         + " / ".join(_num(x) for x in c["spearman"]["per_seed"])
                         + f" | {of(c['spearman'])} | {_num(c['spearman']['tau'])} | "
                         f"{of(c['auc'])} | {of(c['within'])} |")
        for lab, c in r["vs_method"].items():
            lines.append(f"| {r['labels'][0]} minus {lab} (paired) | "
                         + " / ".join(_num(x) for x in c["spearman"]["per_seed"])
                         + f" | {of(c['spearman'])} | {_num(c['spearman']['tau'])} | {of(c['auc'])} | |")
        which = f" (seeds {' / '.join(map(str, r['seeds']))})" if r["seeds"] != pooled["seeds"] else ""
        lines.append(f"| A* of {key}'s turns: reliability{which} | " + " / ".join(
            _num(r["per_seed"][str(s)]["reliability"]) for s in r["seeds"]) + " | | | | |")
    return "\n".join(lines)


def solver_check(env_id: str = "sokoban", num_tasks: int = 200, group: int = 8, noise: float = 0.3,
                 seed: int = 1) -> str:
    """Without a model: does each step advantage of graphgpo.py rank a noisy expert's moves as the env's
    exact solver does? The expert (a random move with probability `noise`) plays `group` episodes per
    train task; a step is *good* if it lowers the solver's distance to the goal. Per variant (A = step
    term + episode term, beta 1): the AUC of good vs other steps (ties half), over all steps and over
    the steps of non-singleton state groups (the only ones a step term can rank), and mean A of each."""
    gg, envs = _import_script("graphgpo"), _import_script("envs")
    rng, env = np.random.default_rng(seed), envs.make(env_id)
    omega, tasks = gg.OMEGA_BY_ENV.get(env_id, 0.5), env.task_ids("train")[:num_tasks]
    names = {"graph": "GraphGPO", "gigpo": "GiGPO", "none": "GRPO"}
    res = {m: {"adv": [], "good": [], "multi": []} for m in names}
    n_success = n_groups_success = 0
    for task in tasks:
        eps, succ, inv, rews, good = [], [], [], [], []
        for _ in range(group):
            env.reset(task)
            states, iv, gd, done, ok = [env.state_key()], [], [], False, False
            while not done:
                d0 = env.solution_length()
                a = env.expert_action() if rng.random() >= noise else ["up", "down", "left", "right"][rng.integers(4)]
                st = env.step(a)
                d1 = 0 if st.info["success"] else env.solution_length()
                gd.append(d0 is not None and d1 is not None and d1 < d0)
                states.append(env.state_key())
                iv.append(st.info["invalid"])
                done, ok = st.done, st.info["success"]
            eps.append(states), succ.append(ok), inv.append(iv), good.append(gd)
            rews.append([0.0] * (len(iv) - 1) + [10.0 if ok else 0.0])
        n_success, n_groups_success = n_success + sum(succ), n_groups_success + any(succ)
        counts = {}
        for e in eps:
            for s in e[:-1]:
                counts[s] = counts.get(s, 0) + 1
        a_ep = gg.grpo_advantages([10.0 * s - 0.1 * sum(i) for s, i in zip(succ, inv)])
        steps = {"graph": gg.graph_step_advantages(eps, succ, omega, invalid=inv),
                 "gigpo": gg.gigpo_step_advantages(eps, rews, 0.95, invalid=inv),
                 "none": [np.zeros(len(g)) for g in good]}
        for m, a_step in steps.items():
            for i in range(group):
                res[m]["adv"] += list(a_step[i] + a_ep[i])
                res[m]["good"] += good[i]
                res[m]["multi"] += [counts[s] > 1 for s in eps[i][:-1]]
    g0, mu0 = np.asarray(res["graph"]["good"]), np.asarray(res["graph"]["multi"])
    lines = [f"Noisy expert (random move with probability {noise}), {len(tasks)} train tasks x {group} episodes, "
             f"seed {seed}: {len(g0)} steps, episode success {n_success / (len(tasks) * group):.3f}, groups with a "
             f"success {n_groups_success / len(tasks):.3f}, good steps {g0.mean():.3f}, steps in non-singleton "
             f"state groups {mu0.mean():.3f}; ω = {omega}.", "",
             "| variant | AUC good vs other (all steps) | AUC (non-singleton groups) | mean A good | mean A other |",
             "|---|---|---|---|---|"]
    for m, name in names.items():
        a, g, mu = (np.asarray(res[m][k]) for k in ("adv", "good", "multi"))
        sign = np.where(g, 1.0, -1.0)
        lines.append(f"| {name} | {auc(a, sign):.3f} | {auc(a[mu], sign[mu]):.3f} | {a[g].mean():+.3f} | "
                     f"{a[~g].mean():+.3f} |")
    return "\n".join(lines)


def _num(v, ci=None) -> str:
    if v is None or not (isinstance(v, (int, float)) and math.isfinite(v)):
        return "n/a"
    if ci is None or not all(math.isfinite(x) for x in ci):
        return f"{v:.2f}"
    return f"{v:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"


def report(data: dict) -> str:
    """The markdown of the results: the main table (rows: credits, columns: envs), then per method its
    sizes, the reliability of A* and each credit's statistics with their intervals (the breakdowns by
    group size and success context stay in the results file's summaries)."""
    res = data["results"]
    envs_ = list(dict.fromkeys(r["env"] for r in res.values()))
    total = sum(r["seconds"] for k, r in res.items() if "@" not in k)
    extra = sum(r["seconds"] for k, r in res.items() if "@" in k)
    lines = [f"Seed {data['seed']}; the methods on their default envs took {total / 60:.1f} min, the sum of the "
             f"per-method times below" + (f" (the other envs, `method@env`, {extra / 60:.1f} min more)" if extra else "")
             + f"; {data.get('machine', '')}. "
             "Each cell: Spearman ρ of the credit with A* / AUC of the credit for A* > 0 vs A* < 0, over the "
             "scored turns; 95% intervals (bootstrap over episodes) in the tables below. There, \"within episodes\" is "
             "ρ after centring the credit and A* on their episode's mean (episodes with two or more scored turns): "
             "whether the credit orders the turns of one episode, which an outcome-only credit cannot (n/a); "
             "\"episode means\" is ρ of the episodes' mean credit and mean A*."
             + (" Measured later and added with --append: " + ", ".join(dict.fromkeys(
                 k for x in data["appended"] for k in x["results"])) + "." if data.get("appended") else ""), "",
             "| credit (method, then its baseline) | " + " | ".join(envs_) + " |",
             "|---|" + "---|" * len(envs_)]
    by_method = {}  # method -> {env: result}: one row per credit, one column per env
    for key, r in res.items():
        by_method.setdefault(r["method"], {})[r["env"]] = r
    for m, per_env in by_method.items():
        labels = next(iter(per_env.values()))["labels"]
        for k, lab in enumerate(labels):
            cells = []
            for e in envs_:
                st = per_env[e]["summary"]["credit"].get(lab) if e in per_env else None
                cells.append(f"{_num(st['spearman'])} / {_num(st['auc'])}" if st else "")
            lines.append(f"| {f'**{lab}**' if k == 0 else lab} ({m}) | " + " | ".join(cells) + " |")
        cells = [f"reliability {_num(per_env[e]['summary']['reliability'])}" if e in per_env else "" for e in envs_]
        lines.append(f"| A* of {m}'s turns | " + " | ".join(cells) + " |")
    for m, r in res.items():
        s, c = r["summary"], r["config"]
        lines += ["", f"### {m} ({r['env']})", "",
                  f"Batch: {r['episodes']} episodes ({c['tasks']} tasks x {c['group']}), {r['turns_in_batch']} turns; "
                  f"A* on {r['turns_scored']} random turns, n = {c['n']} continuations each for Q and V; "
                  f"{r['seconds']:.0f} s ({r['mc_seconds']:.0f} s of continuations). "
                  + (f"Episode success {r['success']:.2f}. " if r.get("success") is not None else "")
                  + (f"Mean goal score {r['goal_score']:.2f}. " if r.get("goal_score") is not None else "")
                  + f"Return: {r['return_measured']}. "
                  f"A*: {s['a_star_pos_frac']:.0%} of turns > 0, {s['a_star_neg_frac']:.0%} < 0, "
                  f"{s['a_star_zero_frac']:.0%} exactly 0; sd {s['sd_a_star']:.3f}, mean SE {s['mean_se']:.3f}, "
                  f"reliability {_num(s['reliability'])}.", "",
                  "| credit | Spearman ρ [95% CI] | AUC [95% CI] | within episodes: ρ [95% CI] | episode means: "
                  "ρ [95% CI] |", "|---|---|---|---|---|"]
        for lab in r["labels"]:
            st = s["credit"][lab]
            split = (f" {_num(st['within'], st['within_ci'])} | {_num(st['between'], st['between_ci'])} |"
                     if "within" in st else " | |")  # results summarised before the split was measured
            lines.append(f"| {lab} | {_num(st['spearman'], st['spearman_ci'])} | {_num(st['auc'], st['auc_ci'])} |"
                         + split)
        for lab, st in s.get("vs_method", {}).items():
            lines.append(f"| {r['labels'][0]} minus {lab} (paired) | {_num(st['spearman'], st['spearman_ci'])} | "
                         f"{_num(st['auc'], st['auc_ci'])} | | |")
    return "\n".join(lines)


def write_report(data: dict, doc, markers=(REPORT_BEGIN, REPORT_END), body: Optional[str] = None) -> None:
    """Put `report(data)` (or `body`) between the markers of `doc` (appended, with the markers, if they
    are missing)."""
    from pathlib import Path

    begin, end = markers
    doc = Path(doc)
    text = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{report(data) if body is None else body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    doc.write_text(text)


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def main(argv=None) -> dict:
    import argparse
    import json
    import platform
    import time
    from pathlib import Path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="*", default=list(ADAPTERS), choices=list(ADAPTERS),
                   help="methods on their default env (none: only the --extra ones)")
    p.add_argument("--seed", type=int, default=4, help="the reported run uses 4; sizes were tried with seed 1")
    p.add_argument("--out", default="docs/results/credit_quality.json", help="raw per-turn results and summary")
    p.add_argument("--n", type=int, default=None, help="continuations per Q and per V (default: per method)")
    p.add_argument("--turns", type=int, default=None, help="scored turns per method (0: all; default: per method)")
    p.add_argument("--tasks", type=int, default=None, help="tasks (groups) per batch (default: per method)")
    p.add_argument("--group", type=int, default=None, help="episodes per task (default: per method)")
    p.add_argument("--extra", nargs="*", default=[], metavar="METHOD:ENV",
                   help="also measure a method on another env with a shipped tiny policy, e.g. aria:twenty_questions "
                        "graphgpo:webshop istar:webshop (not part of the default run)")
    p.add_argument("--append", action="store_true", help="add the results to those already in --out (e.g. a "
                   "later --methods ... --extra ... run) instead of replacing them")
    p.add_argument("--tiny-preset", default=None, help="e.g. micro: a fast smoke run with untrained micro policies")
    p.add_argument("--model-name", default=None,
                   help="the scripts' --model-name (default: their tiny policy), e.g. a pretrained model on a GPU; "
                        "plain weights, not 4-bit")
    p.add_argument("--istar-warm-batches", type=int, default=4,
                   help="iStar: PRM steps on earlier batches of the frozen policy before the scored batch")
    p.add_argument("--reps", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--doc", default="docs/credit_quality.md", help="where --report writes the tables")
    p.add_argument("--report", action="store_true", help="write the tables of --out into --doc (after a run, "
                   "or alone: from an existing --out)")
    p.add_argument("--report-only", action="store_true", help="do not run: only write the tables of --out")
    p.add_argument("--pool", nargs="+", default=None, metavar="OUT",
                   help="do not run: pool the results files of several seeds (each one --out) into --doc's "
                        "pooled table")
    p.add_argument("--solver-check", action="store_true", help="do not run a model: GraphGPO's, GiGPO's and "
                   "GRPO's credit of a noisy expert's Sokoban moves against the solver (`solver_check`), into --doc")
    a = p.parse_args(argv)
    if a.solver_check:
        body = "\n\n".join(solver_check(noise=x) for x in (0.3, 0.5, 0.7))
        write_report({}, a.doc, (SOLVER_BEGIN, SOLVER_END), body + "\n\nCommand: `python benchmarks/credit_quality.py "
                     "--solver-check`")
        return {}
    if a.pool:
        missing = [f for f in a.pool if not Path(f).exists()]
        if missing:
            raise SystemExit(f"--pool: no such results file: {', '.join(missing)} (run the seed first with --out)")
        pooled = pooled_summary([json.loads(Path(f).read_text()) for f in a.pool], a.reps)
        if not pooled["results"]:
            raise SystemExit("--pool: no method was measured in two or more of these files")
        write_report({}, a.doc, (POOLED_BEGIN, POOLED_END), pooled_report(pooled))
        return pooled
    import torch

    torch.set_num_threads(a.threads)
    if a.report_only:  # the summaries are recomputed from the stored turns (and stored again)
        data = json.loads(Path(a.out).read_text())
        for res in data["results"].values():
            res["summary"] = summarize(res, a.reps)
        data = _jsonable(data)
        Path(a.out).write_text(json.dumps(data, indent=1, ensure_ascii=False))
        write_report(data, a.doc)
        return data
    t0 = time.time()
    data = {"seed": a.seed, "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)",
            "argv": list(argv) if argv is not None else None, "results": {}}
    jobs = [(m, m, None) for m in a.methods] + [(x, *x.split(":", 1)) for x in a.extra]
    for key, m, env_id in jobs:
        key = key.replace(":", "@")
        d = DEFAULTS[m]
        cfg = Config(tasks=a.tasks or d.tasks, group=a.group or d.group, n=a.n or d.n,
                     turns=d.turns if a.turns is None else a.turns, seed=a.seed)
        t1 = time.time()
        extra = ["--tiny-preset", a.tiny_preset] if a.tiny_preset else []
        extra += ["--model-name", a.model_name] if a.model_name else []
        kw = {"env_id": env_id} if env_id else {}
        if m == "istar":
            kw["warm_batches"] = a.istar_warm_batches
        res = ADAPTERS[m](cfg, argv=extra, **kw)
        res["seconds"] = time.time() - t1
        res["summary"] = summarize(res, a.reps)
        data["results"][key] = res
        s = res["summary"]
        print(f"{key}: {res['seconds']:.0f} s, reliability {s['reliability']:.2f}; " + "; ".join(
            f"{lab} rho {s['credit'][lab]['spearman']:.2f} auc {s['credit'][lab]['auc']:.2f}" for lab in res["labels"]),
            flush=True)
    data["seconds"] = time.time() - t0
    data = _jsonable(data)
    if a.append and a.out and Path(a.out).exists():
        old = json.loads(Path(a.out).read_text())
        old.setdefault("appended", []).append({k: data[k] for k in ("seed", "machine", "argv", "seconds")}
                                              | {"results": list(data["results"])})
        old["results"].update(data["results"])
        data = old
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(data, indent=1, ensure_ascii=False))
    if a.report:
        write_report(data, a.doc)
    return data


if __name__ == "__main__":
    main()
