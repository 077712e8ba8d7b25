"""ARIA: reward aggregation in an intention space, trained with offline REINFORCE iterations.

Paper: "ARIA: Training Language Agents with Intention-Driven Reward Aggregation", Yang et al.,
2025; https://arxiv.org/abs/2506.00539 ; official code: https://github.com/rhyang2021/ARIA

Method (docs/aria.md). Utterances (actions and free-text observations) are embedded and clustered
by one HAC cut into k clusters, the "intention space"; a step's key is the label sequence of its
history and action. Each step's return γ^(T-t)·R is replaced by the mean return of all steps
sharing its key, with k chosen by SplitScore and a stopping rule. That aggregated reward is the
REINFORCE weight, loss = -mean over steps of (Σ_tokens log π(a_t|h_t))·Ã_t, a few epochs per batch
of games. Two-player games are played in self-play (both roles train), single-agent games against
the env's oracle. `--no-aggregate` is the paper's ablation: REINFORCE on the raw returns.

Equations -> functions (section 2; the kernel `aria_advantages` takes plain per-turn arrays)
- §3.3  R(h_t, a_t) = γ^(T-t) R                                 -> `discounted_returns`
        T and t counted per trajectory and player                 -> `turn_returns`
- §3.2 / App. D  HAC (average linkage), cut into k clusters        -> `hac_labels`
- §3.3  (h̃_t, ã_t) = (c_k(a_1), c_k(o_1), ..., c_k(a_t))          -> `intention_keys`
- §3.3  R̃^(k)(h̃, ã) = mean of R(h, a) over S_{h̃, ã}              -> `aggregate_rewards`
- §3.4  SplitScore(k) = δ_k / |D|, δ_k = Σ |R̃^(k+1) - R̃^(k)|       -> `split_score`
- §3.4  stopping rule: smallest k with SplitScore(j) < ε, j ∈ [k, k+τ] -> `select_k`
- §3.3-3.4 the aggregation for one batch of games                  -> `aria_credit`
- §3.3  the weight of a turn Ã(h_t, a_t) = R̃^(k*)(h̃_t, ã_t)       -> `aria_advantages`
- §3.5  J(θ) = E[Σ_t log π_θ(a_t|h_t) Ã(h_t, a_t)]                 -> `reinforce_loss`, `update`
The utterance embeddings (the model-derived signal) come from `embed_utterances` (section 4).

`python aria.py` trains a LoRA adapter of the tiny Bargaining policy in self-play on a CPU and
scores it against scripted styles. How that differs from the paper (docs/aria.md, "Deviations"):
- policy: a tiny policy at lr 2.5e-4 (paper: an 8B model, LoRA r8/α16 at 2e-5)
- games: 8 iterations of 64 (paper: 3 iterations of 1,000)
- horizons: Bargaining 4-10 rounds per task, Negotiation 6-10 (the paper's prompts: 20)
- encoder: hashed words and character 3-grams (paper: text-embedding-3-small)
- two-player R: the normalised payoff (paper: the win; `--game-reward win`)
- evaluation opponents: scripted styles (paper: GPT-4 oracles and LLM opponents)

Example
    python aria.py                                         # tiny Bargaining in self-play, CPU
    python aria.py --env-id twenty_questions --no-aggregate  # Twenty Questions, REINFORCE ablation
    python aria.py --model-name meta-llama/Meta-Llama-3-8B-Instruct --env-id negotiation \\
        --embedder sentence-transformers/all-MiniLM-L6-v2 --games-per-iteration 1000
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import scipy.stats
import torch
import tyro
from tqdm.auto import tqdm


# ----------------------------------------------------------------------------------------------
# 1. Arguments
# ----------------------------------------------------------------------------------------------
@dataclass
class Args:
    # experiment
    exp_name: str = Path(__file__).stem  # run name (run dir: {env}__{exp_name}__{seed}__{time})
    seed: int = 1  # random seed (python, numpy, torch, task sampling)
    output_dir: str = "runs"  # directory under which the run directory is created
    track: bool = False  # also log to TensorBoard (only if tensorboard is installed)
    save_model: bool = True  # save the LoRA adapter to <run>/adapter at checkpoints and at the end
    checkpoint_every: Optional[int] = None  # save every N its (0: at the end); None: DEFAULTS
    resume: Optional[str] = None  # a run dir to continue from its checkpoint.pt and config.json
    torch_threads: int = 0  # CPU threads for torch (0: leave torch's default)

    # model
    model_name: str = "tiny"  # 'tiny' (the env's tiny policy), 'smollm2-135m', a hub id or a dir
    tiny_preset: str = "default"  # tiny policy size: 'default' or 'micro' (for tests)
    load_in_4bit: Optional[bool] = None  # None: nf4 on CUDA only; True: always; False: never
    lora_r: int = 8  # LoRA rank (paper: 8)
    lora_alpha: int = 16  # LoRA alpha (paper: 16)
    lora_dropout: float = 0.0  # LoRA dropout
    activation_checkpointing: Optional[bool] = None  # None: on for real models on CUDA
    static_cache: bool = False  # static KV cache in generate (batches padded to 2^k; docs/gpu.md)
    max_new_tokens: Optional[int] = None  # most tokens generated per turn; None: DEFAULTS
    temperature: float = 1.0  # sampling temperature of the rollouts
    eval_temperature: float = 1.0  # temperature of the sampled evaluation (greedy is evaluated too)

    # environment
    env_id: Optional[str] = None  # bargaining, negotiation, twenty_questions, ...; None: DEFAULTS
    history: Optional[int] = None  # past turns in the prompt; None: the env's or tiny recipe's
    max_turns: int = 0  # single-agent steps per episode (0: the env's)
    game_reward: Literal["win", "payoff"] = "payoff"  # two-player R (paper: 'win')
    eval_num_tasks: Optional[int] = None  # test tasks per evaluation (0: all); None: DEFAULTS
    eval_k: Optional[int] = None  # sampled games per test task, role and style; None: DEFAULTS
    eval_opponents: tuple[str, ...] = ()  # scripted styles of the evaluation (empty: all)
    eval_every: Optional[int] = None  # evaluate every N iterations, first and last; None: DEFAULTS
    num_logged_episodes: int = 4  # decoded episodes per evaluation written to samples.jsonl

    # algorithm
    aggregate: bool = True  # aggregate in the intention space; --no-aggregate: raw returns
    num_iterations: Optional[int] = None  # iterations (paper: 3); None: DEFAULTS, else BY_GAME
    games_per_iteration: Optional[int] = None  # games per iteration; None: DEFAULTS, else BY_GAME
    num_epochs: int = 3  # epochs of offline REINFORCE over each iteration's steps (paper: 3)
    batch_size: Optional[int] = None  # steps per optimizer step; None: DEFAULTS, else BY_GAME
    micro_batch_size: Optional[int] = None  # turns per forward; None: DEFAULTS
    learning_rate: Optional[float] = None  # Adam lr; None: DEFAULTS (paper: 2e-5)
    max_grad_norm: float = 1.0  # gradient clipping norm (official: 1.0)
    gamma: float = 0.95  # discount of the outcome over a player's turns (official: 0.95)
    embedder: str = "hash"  # 'hash' (words, char 3-grams), 'policy' (frozen base) or an AutoModel
    embed_dim: int = 256  # dimension of the hash embedding
    linkage: Literal["average", "ward", "complete", "single"] = "average"  # official: ward
    max_k: int = 100  # K: most clusters tried (paper: 100; capped by the distinct utterances)
    split_eps: float = 0.01  # ε of the stopping rule (paper: 0.01)
    split_tau: int = 10  # τ, window of the stopping rule (paper: 10)
    fixed_k: int = 0  # use this k instead of the SplitScore choice (0: automatic)
    observation_labels: Literal["auto", "cluster", "exact"] = "auto"  # OBSERVATION_LABELS


# Every option left at None, by model (`with_defaults`): "tiny" (lr 2.5e-4 clears 2 SEs on more
# tuning seeds than 5e-4, docs/aria.md), "smollm2-135m" (under an hour on 2 CPU cores,
# docs/smollm2.md), "*" any other model: the paper's lr. A policy may bring its token budget.
DEFAULTS = {
    "tiny": dict(env_id="bargaining", learning_rate=2.5e-4, micro_batch_size=32, eval_num_tasks=0,
                 eval_k=2, eval_every=2, checkpoint_every=1),
    "smollm2-135m": dict(env_id="bargaining", num_iterations=4, games_per_iteration=8, batch_size=8,
                         learning_rate=1e-4, max_new_tokens=128, micro_batch_size=8,
                         eval_num_tasks=6, eval_k=2, eval_every=2, checkpoint_every=1),
    "*": dict(env_id="bargaining", learning_rate=2e-5, max_new_tokens=128, micro_batch_size=8,
              eval_num_tasks=0, eval_k=2, eval_every=2, checkpoint_every=1),
}
# What the model's row leaves at None, by game (`make_env`): 8 iterations of 64 self-play games
# raise the tiny Bargaining payoff share (docs/aria.md, "Defaults"); single agent: the paper's 3.
BY_GAME = {"two_player": dict(num_iterations=8, games_per_iteration=64, batch_size=32),
           "single_agent": dict(num_iterations=3, games_per_iteration=32, batch_size=16)}
OBSERVATION_LABELS = {"twenty_questions": "exact"}  # closed-set answers; other envs: "cluster"


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
# The method, model-free: plain per-turn arrays and the utterance embeddings in, one REINFORCE
# weight per turn out. The kernel is `aria_advantages` (at the end); the functions above it are its
# equations. The section runs alone with this file's imports (tests/test_method_first.py checks).
def discounted_returns(R, T, gamma):
    """Per-step returns of a player's T turns (§3.3): R(h_t, a_t) = γ^(T-t) R for t = 1..T,
    i.e. [γ^(T-1) R, ..., γ R, R]."""
    T = int(T)
    if T <= 0:
        return np.zeros(0)
    return float(R) * float(gamma) ** np.arange(T - 1, -1, -1, dtype=np.float64)


def hac_labels(embeddings, ks, method="average"):
    """One hierarchical agglomerative clustering of the rows (App. D), cut into each k of `ks`.

    scipy `linkage(X, method, metric="euclidean")` then `fcluster(Z, k, criterion="maxclust")`: at
    most k clusters (fewer when the rows have fewer distinct values), labels 1..k.
    Returns {k: int array}.
    """
    from scipy.cluster.hierarchy import fcluster, linkage

    X = np.asarray(embeddings, dtype=np.float64)
    n = len(X)
    if n < 2:
        return {int(k): np.ones(n, dtype=int) for k in ks}
    Z = linkage(X.reshape(n, -1), method=method, metric="euclidean")
    return {int(k): fcluster(Z, t=int(k), criterion="maxclust").astype(int) for k in ks}


def intention_keys(labels, episodes, steps):
    """The intention key of each step (§3.3): (tag, c(u_1), c(u_2), ..., c(u_p)).

    labels: the label of every utterance (a flat array); episodes: per episode, the indices into
    `labels` of its utterances in order (single agent: a_1, o_1, a_2, o_2, ...; two-player: every
    message of the game); steps: (episode, position of the step's action in that episode, tag) with
    tag = the acting player (a constant for single-agent games). Returns a list of tuples.
    """
    lab = np.asarray(labels)
    return [(tag,) + tuple(lab[np.asarray(episodes[e][: p + 1], dtype=int)].tolist())
            for e, p, tag in steps]


def aggregate_rewards(keys, returns):
    """R̃(h̃, ã) = mean of R(h, a) over the steps whose key is (h̃, ã) (§3.3); one per step."""
    returns = np.asarray(returns, dtype=np.float64)
    sums, counts = {}, {}
    for key, r in zip(keys, returns):
        sums[key] = sums.get(key, 0.0) + float(r)
        counts[key] = counts.get(key, 0) + 1
    return np.array([sums[k] / counts[k] for k in keys], dtype=np.float64)


def split_score(values_k, values_k1):
    """SplitScore(k) = δ_k / |D| = mean over all steps of |R̃^(k+1) - R̃^(k)| (§3.4)."""
    a = np.asarray(values_k, dtype=np.float64)
    b = np.asarray(values_k1, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"values at k and k+1 must have one entry per step, got {a.shape} and "
                         f"{b.shape}")
    return float(np.abs(b - a).mean()) if a.size else 0.0


def select_k(scores, eps=0.01, tau=10):
    """Automatic stopping (§3.4): the smallest k such that SplitScore(j) < eps for every j in
    [k, k + tau] that has a score; the largest k of `scores` if none qualifies.
    scores: {k: SplitScore(k)}."""
    if not scores:
        raise ValueError("select_k needs at least one SplitScore")
    ks = sorted(scores)
    for k in ks:
        if all(scores[j] < eps for j in ks if k <= j <= k + tau):
            return k
    return ks[-1]


def aria_credit(labels_by_k, episodes, steps, returns, eps=0.01, tau=10, fixed_k=0):
    """The whole aggregation for one batch of games.

    labels_by_k: {k: label of every utterance}; the rest as in `intention_keys`; returns:
    R(h_t, a_t) per step. For each k: R̃^(k) = aggregate_rewards(intention_keys(labels_k));
    SplitScore(k) compares k with the next k; k* = select_k (or `fixed_k`). Returns dict(k=k*,
    values=R̃^(k*), scores={k: score}, num_keys={k: distinct keys}).
    """
    ks = sorted(labels_by_k)
    values, num_keys = {}, {}
    for k in ks:
        keys = intention_keys(labels_by_k[k], episodes, steps)
        values[k] = aggregate_rewards(keys, returns)
        num_keys[k] = len(set(keys))
    scores = {k: split_score(values[k], values[k1]) for k, k1 in zip(ks[:-1], ks[1:])}
    if fixed_k:
        k_star = min(ks, key=lambda k: abs(k - fixed_k))
    else:
        k_star = select_k(scores, eps, tau) if scores else ks[-1]
    return {"k": k_star, "values": values[k_star], "scores": scores, "num_keys": num_keys}


def turn_returns(traj, player, outcome, gamma):
    """R(h_t, a_t) = γ^(T-t) R of every turn (§3.3), t and T counted over the turns of the same
    trajectory and player (in order), R = outcome of the turn's player in that trajectory."""
    turns_of = {}
    for i, key in enumerate(zip(traj, player)):
        turns_of.setdefault(key, []).append(i)
    returns = np.zeros(len(traj), dtype=np.float64)
    for rows in turns_of.values():
        returns[rows] = discounted_returns(outcome[rows[0]], len(rows), gamma)
    return returns


def aria_advantages(traj, player, outcome, history, utterances, exact, embeddings, *, gamma=0.95,
                    max_k=100, linkage="average", split_eps=0.01, split_tau=10, fixed_k=0,
                    aggregate=True, info=None):
    """ARIA's REINFORCE weight of every turn of a batch of games (§3.3-3.4), from plain arrays.

    Per turn i (a trajectory's turns in order): traj[i], its game; player[i], the acting player
    (the tag that starts its intention key; a constant in single-agent games); outcome[i], that
    player's R in that game; history[i], the indices of the game's utterances up to and including
    the turn's action. Per utterance u: utterances[u], its text; exact[u], labelled by its exact
    text instead of clustered (closed-set observations); embeddings[u], its vector (rows of exact
    utterances are not read). One HAC over the clustered utterances (duplicates included) is cut
    into k = 2..K clusters, K = min(max_k, distinct clustered texts); k* by SplitScore (or the k
    nearest `fixed_k`). Returns float64 [N]: R̃^(k*) of the turn's key, or with aggregate=False
    (the paper's REINFORCE ablation) the raw return. A dict `info` receives the intermediates:
    returns (raw), k, values (R̃^(k*)), scores, num_keys, max_k (K), num_distinct.

    Two Twenty Questions games, γ = 0.5: both ask "Is it an animal?" ("Yes"); game 0 then asks
    "Is it a cat?" and wins (R = 1), game 1 "Is it a dog?" and loses (R = 0). Raw returns
    γ^(T-t) R: [0.5, 1] and [0, 0]. The answers are labelled by their text, the three questions
    clustered (K = 3). At k = 2 "cat" and "dog" are one intention: the first turns share a key,
    (0.5 + 0) / 2 = 0.25, and so do the second turns, (1 + 0) / 2 = 0.5. At k = 3 the second
    turns split into 1 and 0. SplitScore(2) = (0 + 0.5 + 0 + 0.5) / 4 = 0.25 >= ε, the only score:
    k* = 2. The lost game's opening question earns 0.25, not 0.

    >>> texts = ["Is it an animal?", "Yes", "Is it a cat?", "Finished",
    ...          "Is it an animal?", "Yes", "Is it a dog?", "No"]
    >>> vectors = {"Is it an animal?": [0.0, 0.0], "Is it a cat?": [1.0, 0.0],
    ...            "Is it a dog?": [1.0, 0.1]}
    >>> games = dict(traj=[0, 0, 1, 1], player=["agent"] * 4, outcome=[1.0, 1.0, 0.0, 0.0],
    ...              history=[[0], [0, 1, 2], [4], [4, 5, 6]], utterances=texts,
    ...              exact=[False, True] * 4,  # the answers: labelled by their text
    ...              embeddings=[vectors.get(t, [0.0, 0.0]) for t in texts])
    >>> aria_advantages(**games, gamma=0.5).tolist()
    [0.25, 0.5, 0.25, 0.5]
    >>> aria_advantages(**games, gamma=0.5, fixed_k=3).tolist()
    [0.25, 1.0, 0.25, 0.0]
    >>> aria_advantages(**games, gamma=0.5, aggregate=False).tolist()
    [0.5, 1.0, 0.0, 0.0]
    """
    returns = turn_returns(traj, player, outcome, gamma)  # §3.3
    if not aggregate and info is None:
        return returns
    # exact utterances get fixed negative labels, one per distinct text; the others are clustered
    labels = np.zeros(len(utterances), dtype=np.int64)
    exact_labels, distinct, clustered = {}, {}, []
    for u, (text, fixed) in enumerate(zip(utterances, exact)):
        if fixed:
            labels[u] = -1 - exact_labels.setdefault(text, len(exact_labels))
        else:
            clustered.append(u)
            distinct.setdefault(text, len(distinct))
    clustered = np.array(clustered, dtype=np.int64)
    K = max(1, min(max_k, len(distinct)))  # beyond the distinct texts every cut is the same
    ks = list(range(2, K + 1)) if K >= 2 else [1]
    vectors = np.asarray(embeddings, dtype=np.float64)
    points = vectors[clustered] if len(clustered) else np.zeros((0, 1))
    labels_by_k = {}
    for k, cluster_of in hac_labels(points, ks, linkage).items():  # one HAC, cut at every k
        labels_by_k[k] = labels.copy()
        labels_by_k[k][clustered] = cluster_of
    # a turn's key is the label prefix of its history: each history is its own "episode" here
    steps = [(i, len(h) - 1, p) for i, (h, p) in enumerate(zip(history, player))]
    res = aria_credit(labels_by_k, history, steps, returns, split_eps, split_tau, fixed_k)
    if info is not None:
        info.update(res, returns=returns, max_k=ks[-1], num_distinct=len(distinct))
    return res["values"] if aggregate else returns  # §3.3: Ã(h_t, a_t) = R̃^(k*)(h̃_t, ã_t)


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One game: its utterances in order and its training steps (one per policy action)."""

    traj_id: int
    task_id: str
    utterances: list = field(default_factory=list)  # texts in game order (one agent: a_1, o_1, ...)
    kinds: list = field(default_factory=list)  # "action" / "observation" per utterance
    steps: list = field(default_factory=list)  # dicts: player, pos, prompt, completion, invalid
    outcome: dict = field(default_factory=dict)  # player -> R in [0, 1]
    success: bool = False  # single agent: solved; two-player: a deal was made
    env_return: float = 0.0  # single agent: env reward; two-player: mean payoff
    share: float = 0.0  # vs a scripted style: the learner's final deal position in [0, 1] (0: none)


def rollout(model, tok, new_env, task_ids, args, temperature, greedy=False, noise_keys=None):
    """Games of `new_env()` (`envs.Seated`) stepped together, one generate per turn; R: solved, or
    in self-play the win (`--game-reward win`) or normalised payoff; `noise_keys`: one per game."""
    from envs import extract_action

    games = [new_env().reset(task) for task in task_ids]
    episodes = [Episode(traj_id=i, task_id=str(task)) for i, task in enumerate(task_ids)]
    selfplay = bool(games) and list(games[0].seats.values()).count("policy") > 1
    rounds = range(2 * games[0].env.max_turns_per_player() + 2) if selfplay else itertools.count()
    model.eval()
    stops = stop_ids(model, tok)
    for _ in rounds:
        active = [i for i, g in enumerate(games) if not g.done]
        if not active:
            break
        prompts = [encode(tok, render_prompt(tok, games[i].observe(games[i].current_player)))
                   for i in active]
        keys = None if noise_keys is None else [(*noise_keys[i], len(episodes[i].steps))
                                                for i in active]
        completions = generate(model, tok, prompts, temperature, args.max_new_tokens,
                               greedy=greedy, noise_keys=keys)
        for i, prompt, completion in zip(active, prompts, completions):
            ep, player = episodes[i], games[i].current_player if selfplay else "agent"
            step = games[i].step(completion_text(tok, completion, stops))
            ep.steps.append({"player": player, "pos": len(ep.utterances), "prompt": prompt,
                             "completion": completion, "invalid": bool(step.info.get("invalid"))})
            ep.utterances.append(extract_action(tok.decode(completion, skip_special_tokens=True)))
            ep.kinds.append("action")
            if not selfplay:
                ep.utterances.append(str(step.observation))
                ep.kinds.append("observation")
                ep.env_return += float(step.reward)
                if step.done:
                    ep.success = bool(step.info.get("success", False))
                    ep.share = float(step.info.get("progress", ep.success))
    for game, ep in zip(games, episodes):
        if not selfplay:
            ep.outcome = {"agent": float(ep.success)}
            continue
        env, pay = game.env, game.env.payoffs()
        ep.success, ep.env_return = env.deal_round is not None, float(np.mean(list(pay.values())))
        for p, q in zip(env.players, env.players[::-1]):
            ep.outcome[p] = (float(pay[p] > pay[q] + 1e-9) if args.game_reward == "win"
                             else float(min(1.0, max(0.0, env.progress(p)))))
    return episodes


def compute_advantages(episodes, args, signal=None):
    """One Sample per turn with its REINFORCE weight as `adv`, and the credit statistics (computed
    with --no-aggregate too); `signal`: `embed_utterances`, one row per utterance, in order."""
    if signal is None:
        raise ValueError("ARIA's credit needs the utterance embeddings (embed_utterances)")
    turns, texts, exact, history = [], [], [], []
    for ep in episodes:
        first = len(texts)  # the episode's utterances are texts[first:]
        texts += ep.utterances
        exact += [kind == "observation" and args.observation_labels == "exact"
                  for kind in ep.kinds]
        for t, step in enumerate(ep.steps):
            turns.append((ep, t, step["player"]))
            history.append(list(range(first, first + step["pos"] + 1)))  # up to its action
    info = {}
    weights = aria_advantages(
        traj=[ep.traj_id for ep, _, _ in turns], player=[player for _, _, player in turns],
        outcome=[ep.outcome.get(player, 0.0) for ep, _, player in turns], history=history,
        utterances=texts, exact=exact, embeddings=signal, gamma=args.gamma, max_k=args.max_k,
        linkage=args.linkage, split_eps=args.split_eps, split_tau=args.split_tau,
        fixed_k=args.fixed_k, aggregate=args.aggregate, info=info)
    samples = [Sample(ep.steps[t]["prompt"], ep.steps[t]["completion"], 0, ep.traj_id, t, float(w))
               for (ep, t, _), w in zip(turns, weights)]  # group 0: the batch is aggregated as one
    raw, agg, k = info["returns"], info["values"], info["k"]
    mean = lambda x, f=np.mean: float(f(x)) if len(x) else 0.0  # noqa: E731
    # the paper's Fig. 4: the variance of the step rewards before and after the aggregation
    return samples, {
        "credit/selected_k": k, "credit/max_k": info["max_k"], "credit/num_steps": len(turns),
        "credit/num_distinct_utterances": info["num_distinct"],
        "credit/num_intentions": info["num_keys"][k],
        "credit/reward_var_raw": mean(raw, np.var),
        "credit/reward_var_aggregated": mean(agg, np.var),
        "credit/reward_mean_raw": mean(raw), "credit/reward_mean_aggregated": mean(agg),
        "credit/split_scores": [round(info["scores"][j], 6) for j in sorted(info["scores"])],
        "credit/weight_mean": mean(weights), "credit/weight_nonzero_frac": mean(weights != 0)}


# ----------------------------------------------------------------------------------------------
# 4. Model-side signal, loss and update
# ----------------------------------------------------------------------------------------------
# The credit's signal (§3.2): utterance embeddings from the hash, the frozen policy or an encoder.
_WORD = re.compile(r"[a-z]+|\d+(?:\.\d+)?|[^\sa-z\d]")


def hash_embed(texts, dim=256):
    """Text vectors without a model: signed hashing of the words (first half) and the character
    3-grams (second half) of the lower-cased text, each half L2-normalised, then the row."""
    half = max(1, dim // 2)
    out = np.zeros((len(texts), 2 * half), dtype=np.float64)

    def add(i, offset, feature):  # crc32 picks the column and the sign
        h = zlib.crc32(feature.encode("utf-8"))
        out[i, offset + h % half] += 1.0 if (h >> 31) & 1 else -1.0

    for i, text in enumerate(texts):
        s = " ".join(str(text).lower().split())
        if not s:
            continue  # an empty text: a zero row
        for w in _WORD.findall(s):
            add(i, 0, "w:" + w)
        padded = f"  {s} "
        for j in range(len(padded) - 2):
            add(i, half, "c:" + padded[j:j + 3])
        for block in (out[i, :half], out[i, half:]):
            n = np.linalg.norm(block)
            if n > 0:
                block /= n
    return _l2_rows(out)


def _l2_rows(x):
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


class Embedder:
    """Text -> L2-normalised vector: 'hash' (`hash_embed`), 'policy' (the frozen base with its
    adapter off; `main` sets .model and .tok) or an AutoModel (hub id or local directory)."""

    def __init__(self, name, dim=256):
        from common.models import HINT, UserError, _check_hub_reachable

        self.name, self.dim, self.model, self.tok = name, dim, None, None
        if name in ("hash", "policy"):
            return
        from transformers import AutoModel, AutoTokenizer

        path, hint = Path(name).expanduser(), "use --embedder hash or a local encoder directory"
        local = path.is_dir()
        if not local and name.startswith(("/", "./", "../", "~")):
            raise UserError(f"--embedder {name!r}: no such local directory; use --embedder hash, "
                            f"policy, or an encoder checkpoint directory")
        try:
            if not local:
                _check_hub_reachable(name)
            source = str(path) if local else name
            self.tok, self.model = (c.from_pretrained(source) for c in (AutoTokenizer, AutoModel))
        except UserError as e:
            raise UserError(f"--embedder: {e}".replace(HINT, hint)) from None
        except (OSError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"cannot load the encoder {name!r}: {first}; {hint}") from None
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        self.model.to("cuda" if torch.cuda.is_available() else "cpu").eval()

    @torch.no_grad()
    def __call__(self, texts):
        texts = [str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.dim))
        if self.name == "hash":
            return hash_embed(texts, self.dim)
        model, tok, side, out = self.model, self.tok, self.tok.padding_side, []
        policy, device = self.name == "policy", next(self.model.parameters()).device
        tok.padding_side = "right"
        try:  # the policy's frozen base (adapter off): training does not move the vectors
            with model.disable_adapter() if policy else contextlib.nullcontext():
                for s in range(0, len(texts), 64):  # the mean of the last hidden states
                    chunk = [t if t.strip() else "(empty)" for t in texts[s:s + 64]]
                    enc = tok(chunk, padding=True, truncation=True, max_length=256,
                              return_tensors="pt").to(device)
                    hidden = (model(**enc, output_hidden_states=True, logits_to_keep=1)
                              .hidden_states[-1] if policy else model(**enc).last_hidden_state)
                    m = enc["attention_mask"].unsqueeze(-1).to(torch.float32)
                    out.append(((hidden.float() * m).sum(1) / m.sum(1).clamp(min=1.0)).cpu())
        finally:
            tok.padding_side = side
        return _l2_rows(torch.cat(out).numpy().astype(np.float64))


def embed_utterances(embedder, episodes, observation_labels):
    """The signal of `compute_advantages`: one row per utterance, each distinct clustered text
    embedded once; exactly labelled observations ("exact") keep zero rows, never read."""
    texts = [u for ep in episodes for u in ep.utterances]
    kinds = [kind for ep in episodes for kind in ep.kinds]
    clustered = [i for i, kind in enumerate(kinds)
                 if not (kind == "observation" and observation_labels == "exact")]
    distinct = {}
    which = [distinct.setdefault(texts[i], len(distinct)) for i in clustered]
    vectors = embedder(list(distinct))
    rows = np.zeros((len(texts), vectors.shape[1]), dtype=np.float64)
    rows[clustered] = vectors[np.array(which, dtype=np.int64)]
    return rows


def reinforce_loss(seq_logp, weights, batch_size):
    """Offline REINFORCE (§3.5): -(1/B) Σ_i Ã_i Σ_tokens log π(a_i|h_i), B = the steps of the batch
    (steps with weight 0, whose forward is skipped, count in B)."""
    return -(seq_logp * weights).sum() / float(batch_size)


def update(model, tok, optimizer, samples, args, rng):
    """`num_epochs` passes of offline REINFORCE over the turns, shuffled, `batch_size` turns per
    optimizer step. A zero-weight turn adds nothing to the loss, so its forward is skipped."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses, grad_norms = [], []
    model.train()
    for epoch in range(args.num_epochs):
        order = rng.permutation(len(samples))
        for start in range(0, len(order), args.batch_size):
            batch = [samples[i] for i in order[start:start + args.batch_size]]
            # length-sorted: the loss is a sum over micro-batches, so only the padding changes
            live = sorted((x for x in batch if x.adv != 0.0),
                          key=lambda x: len(x.prompt) + len(x.completion))
            if not live:
                continue
            optimizer.zero_grad(set_to_none=True)
            batch_loss = 0.0
            for s in range(0, len(live), args.micro_batch_size):
                chunk = live[s:s + args.micro_batch_size]
                lp, _ = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                            [x.completion for x in chunk], args.temperature)
                seq_logp = lp.sum(-1)  # log π(a|h): the sum over the completion's tokens
                # over the whole batch's size: the micro-batches add up to the batch's loss
                loss = reinforce_loss(seq_logp, seq_logp.new_tensor([x.adv for x in chunk]),
                                      len(batch))
                loss.backward()
                batch_loss += float(loss.detach())
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)))
            optimizer.step()
            if epoch == args.num_epochs - 1:
                losses.append(batch_loss)
    model.eval()
    return {"policy_loss": float(np.mean(losses)) if losses else 0.0,
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "optimizer_steps": len(grad_norms)}


# ----------------------------------------------------------------------------------------------
# 5. Evaluation
# ----------------------------------------------------------------------------------------------
def eval_games(model, tok, new_env, probe, tasks, args, two_player):
    """Per seating (single agent: one; two-player: each role vs each scripted style) `eval_k`
    sampled games per task on common random numbers and one greedy: [(name, sampled, greedy)]."""
    tasks_k = [t for t in tasks for _ in range(args.eval_k)]
    seatings = [("sampled", None)]
    if two_player:
        styles = list(args.eval_opponents) or list(probe.opponent_styles())
        seatings = [(f"{role}_vs_{s}", {p: "policy" if p == role else s for p in probe.players})
                    for role in probe.players for s in styles]
    games = []
    bar = tqdm(total=len(seatings) * (len(tasks_k) + len(tasks)), desc="evaluation games",
               leave=False, dynamic_ncols=True)
    for c, (name, seats) in enumerate(seatings):
        make = lambda: new_env(seats)  # noqa: E731
        keys = [(args.seed, c, i) for i in range(len(tasks_k))]  # the same in every evaluation
        sampled = rollout(model, tok, make, tasks_k, args, args.eval_temperature, noise_keys=keys)
        bar.update(len(tasks_k))
        games.append((name, sampled, rollout(model, tok, make, tasks, args, 1.0, greedy=True)))
        bar.update(len(tasks))
    bar.close()
    return games


def evaluate(model, tok, new_env, probe, tasks, args, two_player):
    """Success (two-player: the win rate) and two-player the main metric, the payoff share, sampled
    and greedy with SEs, the main metric also per game (`write_summary` pairs); a few games."""
    games = eval_games(model, tok, new_env, probe, tasks, args, two_player)
    sampled, greedy = ([ep for g in games for ep in g[i]] for i in (1, 2))
    # the mean over the seatings of each one's rate (every seating plays the same number of games)
    success, success_greedy = (float(np.mean([np.mean([ep.success for ep in g[i]]) for g in games]))
                               for i in (1, 2))
    invalid = [s["invalid"] for ep in sampled for s in ep.steps]
    out = {"eval/success": success, "eval/success_se": mean_se([ep.success for ep in sampled])[1],
           "eval/success_greedy": success_greedy,
           "eval/return": float(np.mean([ep.env_return for ep in sampled])),
           "eval/episode_length": float(np.mean([len(ep.steps) for ep in sampled])),
           "eval/invalid_frac": float(np.mean(invalid)) if invalid else 0.0}
    if two_player:  # the win rate saturates against some styles; the deal position does not
        out.update({"eval/win_rate": success, "eval/win_rate_se": out["eval/success_se"],
                    "eval/win_rate_greedy": success_greedy})
        for key, eps in (("eval/payoff_share", sampled), ("eval/payoff_share_greedy", greedy)):
            out[key], out[key + "_se"] = mean_se([ep.share for ep in eps])
        out["eval/payoff_share_episodes"] = [ep.share for ep in sampled]
    else:
        out["eval/success_greedy_se"] = mean_se([ep.success for ep in greedy])[1]
        out["eval/success_episodes"] = [float(ep.success) for ep in sampled]
    n = max(1, args.num_logged_episodes // len(games))
    return out, [episode_record(ep, f"eval/{name}") for name, eps, _ in games for ep in eps[:n]]


def iteration_row(episodes, samples, ustats, cstats, seconds):
    """One iteration's metrics: the training games, losses, credit statistics, seconds per phase."""
    invalid = [s["invalid"] for ep in episodes for s in ep.steps]
    row = {"charts/success": float(np.mean([ep.success for ep in episodes])),
           "charts/return": float(np.mean([ep.env_return for ep in episodes])),
           "charts/outcome": float(np.mean([r for ep in episodes for r in ep.outcome.values()])),
           "charts/episode_length": float(np.mean([len(ep.steps) for ep in episodes])),
           "charts/invalid_rate": float(np.mean(invalid)) if invalid else 0.0,
           **{f"losses/{k}": v for k, v in ustats.items()}, **cstats,
           **{f"perf/{k}_seconds": v for k, v in seconds.items()},
           "perf/tokens_per_second": sum(len(x.completion) for x in samples)
           / max(seconds["rollout"], 1e-9), "perf/samples": len(samples)}
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def episode_record(ep, tag, weights=None):
    """A game as a samples.jsonl record; `weights`: {(traj, turn): the turn's training weight}."""
    turns = [{"player": s["player"], "action": ep.utterances[s["pos"]], "invalid": s["invalid"],
              **({"observation": ep.utterances[s["pos"] + 1]}
                 if ep.kinds[s["pos"] + 1:s["pos"] + 2] == ["observation"] else {}),
              **({} if weights is None else {"weight": round(weights[ep.traj_id, t], 4)})}
             for t, s in enumerate(ep.steps)]
    return {"tag": tag, "task": ep.task_id, "outcome": ep.outcome, "success": ep.success,
            "turns": turns}


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def make_env(args):
    """`args` with every default set (DEFAULTS, BY_GAME, OBSERVATION_LABELS) and checked, the env
    factory `new_env(seats=None)` (`envs.Seated`; default: self-play), a bare probe, the options."""
    import envs
    from common.models import UserError, policy_prompt_options

    args = with_defaults(args)
    two_player = args.env_id in envs.TWO_PLAYER
    game = BY_GAME["two_player" if two_player else "single_agent"]
    args = dataclasses.replace(args, **{k: v for k, v in game.items() if getattr(args, k) is None})
    if args.observation_labels == "auto":
        labels = OBSERVATION_LABELS.get(args.env_id, "cluster")
        args = dataclasses.replace(args, observation_labels=labels)
    for wrong, message in [
        (args.env_id not in envs.available(), f"env {args.env_id!r} is not available in this "
         f"checkout; available env ids: {', '.join(envs.available()) or 'none'}"),
        (args.num_iterations < 0, "--num-iterations must be >= 0"),
        (min(args.games_per_iteration, args.num_epochs, args.eval_k) < 1,
         "--games-per-iteration, --num-epochs and --eval-k must be >= 1"),
        (not 0.0 < args.gamma <= 1.0, f"--gamma must be in (0, 1], got {args.gamma}"),
        (args.max_k < 2 or args.split_tau < 0 or args.split_eps <= 0,
         "--max-k must be >= 2, --split-tau >= 0 and --split-eps > 0"),
        (min(args.batch_size, args.micro_batch_size) < 1,
         "--batch-size and --micro-batch-size must be >= 1")]:
        if wrong:
            raise UserError(message)
    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    kw = dict(policy_prompt_options(args.model_name, args.env_id, args.tiny_preset).env_kwargs)
    if args.history is not None:
        kw["history"] = args.history

    def make():
        env = envs.make(args.env_id, **kw)
        if args.max_turns and not two_player:
            env.max_turns = args.max_turns
        return env

    def new_env(seats=None):
        return envs.Seated(make(), seats)

    try:
        probe = make()
        probe.reset(probe.task_ids("train")[0])
    except (ValueError, TypeError) as e:
        raise UserError(f"env {args.env_id!r}: {e}") from None
    unknown = [s for s in args.eval_opponents if two_player and s not in probe.opponent_styles()]
    if unknown:
        raise UserError(f"--eval-opponents: unknown style(s) {unknown}; known: "
                        f"{', '.join(probe.opponent_styles())}")
    return args, new_env, probe, kw


def main(args: Args):
    import envs
    from common.models import load_policy

    t_start = time.time()
    if args.resume:
        args = resumed_args(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rng = seed_everything(args.seed)
    args, new_env, probe, env_kwargs = make_env(args)
    two_player = args.env_id in envs.TWO_PLAYER
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them

    embedder = Embedder(args.embedder, dim=args.embed_dim)  # a bad encoder fails before the policy
    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r,
                             lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             activation_checkpointing=args.activation_checkpointing,
                             static_cache=args.static_cache)
    if embedder.name == "policy":  # the policy's frozen base
        embedder.model, embedder.tok = model, tok
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                 lr=args.learning_rate)
    run_dir, logger = start_run(args, {"env_kwargs": env_kwargs, "two_player": two_player})

    def run_eval(it):
        t0 = time.time()
        row, records = evaluate(model, tok, new_env, probe, test_tasks, args, two_player)
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, records)
        tqdm.write(eval_line(it, row))
        return row

    start = 0
    if args.resume:
        start, (first_eval, last_eval), _ = load_checkpoint(run_dir, model, {"policy": optimizer},
                                                            rng)
    else:
        first_eval = last_eval = run_eval(0)
        logger.log(0, first_eval)

    bar = tqdm(range(start + 1, args.num_iterations + 1),
               desc="aria" if args.aggregate else "reinforce", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.games_per_iteration,
                            replace=len(train_tasks) < args.games_per_iteration)
        episodes = rollout(model, tok, new_env, [train_tasks[i] for i in chosen], args,
                           args.temperature)
        seconds = {"rollout": time.time() - t0}
        t1 = time.time()
        embeddings = embed_utterances(embedder, episodes, args.observation_labels)
        seconds["embed"] = time.time() - t1
        samples, cstats = compute_advantages(episodes, args, embeddings)
        seconds["credit"] = time.time() - t1  # the embedding and the clustering
        t2 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)
        seconds["update"] = time.time() - t2
        seconds["iteration"] = time.time() - t0

        row = iteration_row(episodes, samples, ustats, cstats, seconds)
        weights = {(x.traj, x.turn): x.adv for x in samples}
        logger.log_samples(it, [episode_record(ep, "train", weights)
                                for ep in episodes[: args.num_logged_episodes]])
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.checkpoint_every and it % args.checkpoint_every == 0:
            save_checkpoint(run_dir, it, model, {"policy": optimizer}, rng, (first_eval, last_eval))
            if args.save_model:
                save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}",
                        reward=f"{row['charts/outcome']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}", k=cstats["credit/selected_k"])
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    metric = "eval/payoff_share" if two_player else "eval/success"
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval, metric)


# ----------------------------------------------------------------------------------------------
# Utilities: the same text in all five files (tests/test_shared_blocks.py); a first read
# skips them: defaults, prompts and sampling, log-probs, statistics, logging, checkpoints
# ----------------------------------------------------------------------------------------------
def with_defaults(args):
    """`args` with each option left at None set: from the policy where it fixes one (a shipped
    policy's token budget, temperature), else from the model's DEFAULTS row ("*": no own row)."""
    from common.models import policy_kind, policy_prompt_options

    kind = policy_kind(args.model_name)
    row = DEFAULTS.get(kind, DEFAULTS["*"])
    unset = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) is None}
    fill = lambda a, values: dataclasses.replace(  # noqa: E731 - only the options left at None
        a, **{k: v for k, v in values.items() if v is not None and getattr(a, k) is None})
    args = fill(args, {"env_id": row["env_id"]})
    policy = policy_prompt_options(args.model_name, args.env_id, args.tiny_preset)
    args = fill(fill(args, {"max_new_tokens": policy.max_new_tokens,
                            "temperature": policy.temperature}), row)
    taken = [f"{k}={v}" for k, v in row.items() if k in unset and getattr(args, k) == v]
    if taken and kind != "tiny":  # a real model: say what its row sets
        tqdm.write(f"{args.model_name}: {', '.join(taken)} (DEFAULTS, row "
                   f"{kind if kind in DEFAULTS else '*'!r})")
    return args


@dataclass
class Sample:
    """One training turn, what `update` consumes (`compute_advantages` makes one per turn)."""

    prompt: list  # prompt token ids, as rendered at sampling time
    completion: list  # generated token ids (EOS included when emitted): exactly the trained tokens
    group: int  # the group the turn's episode is compared within (the episodes of one task)
    traj: int  # the episode
    turn: int  # position of the turn in its episode: 0, 1, ...
    adv: Any = 0.0  # the credit: advantage (or REINFORCE weight), a float or one per token
    old: Optional[torch.Tensor] = None  # token log-probs under the sampling policy π_θold
    ref: Optional[torch.Tensor] = None  # token log-probs under the reference policy (KL term)


def render_prompt(tok, messages) -> str:
    """The chat template with the generation prompt, thinking off (Qwen3); a template that rejects
    a system turn (Gemma) gets the system text at the head of the first user turn."""
    kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
    try:
        return tok.apply_chat_template(messages, **kw)
    except Exception:  # noqa: BLE001 - jinja's TemplateError; retried once without a system turn
        if not messages or messages[0]["role"] != "system" or len(messages) < 2:
            raise
        first = dict(messages[1], content=messages[0]["content"] + "\n\n" + messages[1]["content"])
        return tok.apply_chat_template([first, *messages[2:]], **kw)


def encode(tok, text: str) -> list:
    return tok(text, add_special_tokens=False)["input_ids"]


def stop_ids(model, tok) -> set:
    """The ids that end a turn: the tokenizer's EOS and every id the checkpoint's generation config
    lists (Llama 3's <|eot_id|>, Gemma's <end_of_turn>)."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return {tok.eos_token_id, *listed} - {None}


def completion_text(tok, completion, stops) -> str:
    """The text the env reads: "" (an invalid action in every env) for a completion cut at
    max_new_tokens (no stop id at its end), else the decoded text without special tokens."""
    if not completion or completion[-1] not in stops:
        return ""
    return tok.decode(completion, skip_special_tokens=True)


class CommonNoise:
    """Sampling by the Gumbel-max trick, argmax(logits / T + noise), row b's noise at new token i
    seeded by (*keys[b], i): policies evaluated with the same keys share random numbers."""

    def __init__(self, keys, temperature, width):
        self.keys, self.temperature, self.width = keys, temperature, width

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.width
        seeds = [int(np.random.SeedSequence([*key, step]).generate_state(1, np.uint64)[0])
                 for key in self.keys]
        u = torch.stack([torch.rand(scores.shape[-1], dtype=torch.float64, device=scores.device,
                                    generator=torch.Generator(scores.device).manual_seed(seed))
                         for seed in seeds])  # drawn where the logits are
        return scores / self.temperature - torch.log(-torch.log(u)).to(scores.dtype)


class SampledLogprobs:
    """Sampling from softmax(logits / T) as generate's sampler draws it, keeping each drawn token's
    log-prob: π_θold's log-probs, which `update` then need not recompute."""

    def __init__(self, temperature):
        self.temperature, self.steps = temperature, []

    def __call__(self, input_ids, scores):
        scaled = scores / self.temperature
        token = torch.multinomial(torch.softmax(scaled, dim=-1), num_samples=1)
        self.steps.append(scaled.gather(-1, token)[:, 0] - torch.logsumexp(scaled, dim=-1))
        return torch.full_like(scores, -math.inf).scatter_(-1, token, 0.0)  # argmax picks `token`


@contextlib.contextmanager
def merged_lora(model):
    """The active LoRA adapter merged into fp32 base weights while sampling (~40% less time per turn
    on a CPU), the weights copied back exactly afterwards; bf16 and 4-bit weights are not merged."""
    layers = [m for m in model.modules() if hasattr(m, "lora_A") and m.active_adapters
              and not m.disable_adapters and not m.merged
              and m.get_base_layer().weight.dtype == torch.float32]
    saved = [m.get_base_layer().weight.detach().clone() for m in layers]
    for m in layers:
        m.merge()
    try:
        yield
    finally:
        with torch.no_grad():
            for m, w in zip(layers, saved):
                m.unmerge()
                m.get_base_layer().weight.copy_(w)


@torch.no_grad()
def generate(model, tok, prompt_ids, temperature, max_new_tokens, greedy=False, noise_keys=None,
             logprobs=False):
    """One batched, left-padded generate; each row up to its first stop id (or max_new_tokens
    tokens). `noise_keys`: sample with CommonNoise; `logprobs`: also the sampled log-probs."""
    if not prompt_ids:
        return ([], []) if logprobs else []
    n = len(prompt_ids)
    if getattr(getattr(model, "generation_config", None), "cache_implementation", None) == "static":
        # --static-cache: one cache shape per power of two, padded with copies of row 0
        extra = (1 << (n - 1).bit_length()) - n
        prompt_ids = list(prompt_ids) + [prompt_ids[0]] * extra
        noise_keys = None if noise_keys is None else list(noise_keys) + [noise_keys[0]] * extra
    device = next(model.parameters()).device
    pad, stops = tok.pad_token_id, stop_ids(model, tok)
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompt_ids],
                             dtype=torch.long, device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids],
                             dtype=torch.long, device=device)
    recorder, processors = None, []
    if not greedy and temperature > 0 and noise_keys is not None:
        processors = [CommonNoise(noise_keys, temperature, width)]
    elif not greedy and temperature > 0:  # temperature sampling (no top-k or top-p)
        processors = [recorder := SampledLogprobs(temperature)]
    # the checkpoint's own generation config (a repetition penalty, top-k) would reshape the
    # samples even with do_sample=False: a clean one while generating
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = inner.generation_config
    inner.generation_config = GenerationConfig(cache_implementation=own.cache_implementation)
    try:
        with merged_lora(model):
            out = model.generate(input_ids=input_ids, attention_mask=attention, pad_token_id=pad,
                                 eos_token_id=sorted(stops), max_new_tokens=max_new_tokens,
                                 do_sample=False, logits_processor=processors)
    finally:
        inner.generation_config = own
    rows = [next((r[:i + 1] for i, t in enumerate(r) if t in stops), r)
            for r in out[:n, width:].tolist()]
    if not logprobs:
        return rows
    if recorder is None or not recorder.steps:  # not drawn by the recorder: `update` recomputes
        return rows, [None] * len(rows)
    steps = torch.stack(recorder.steps, dim=1).float().cpu()  # one copy, not one per token
    return rows, [steps[b, :len(r)] for b, r in enumerate(rows)]


def completion_logprobs(model, tok, prompt_ids, completion_ids, temperature=1.0):
    """Token log-probs of the completions under softmax(logits / T), one left-padded forward.
    Returns (logp [B, C], mask [B, C]), completions right-aligned (C: the longest)."""
    device = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    width = max(len(s) for s in seqs)
    C = max(1, max(len(c) for c in completion_ids))
    input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], dtype=torch.long,
                             device=device)
    attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs],
                             dtype=torch.long, device=device)
    mask = torch.tensor([[0.0] * (C - len(c)) + [1.0] * len(c) for c in completion_ids],
                        device=device)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding changes no log-prob
    # the logits at positions width-C-1 .. width-2 predict the last C tokens (the completions)
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                   logits_to_keep=C + 1).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:  # temperature <= 0 (greedy) scores the raw logits
        logits = logits / temperature
    targets = input_ids[:, width - C:]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp * mask, mask


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for fewer than two values)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return (float(x.mean()) if x.size else 0.0), 0.0
    return float(x.mean()), float(scipy.stats.sem(x))


def eval_line(it, ev):
    """An evaluation as one short line: each metric that has a standard error, as value ± SE."""
    return f"eval @ iteration {it}: " + ", ".join(
        f"{k.removeprefix('eval/')} {v:.3f} ± {ev[k + '_se']:.3f}" for k, v in ev.items()
        if k + "_se" in ev and "_vs_" not in k)


def write_summary(run_dir, args, wall_seconds, first_eval, last_eval, metric, **extra):
    """summary.json and the main metric before -> after; the change's SE pairs the episodes when
    both evaluations played the same ones (CommonNoise)."""
    summary = {"run_dir": str(run_dir), "iterations": args.num_iterations, "metric": metric,
               "wall_seconds": wall_seconds, "first_eval": first_eval, "last_eval": last_eval,
               **extra}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    a, b = first_eval.get(metric + "_episodes"), last_eval.get(metric + "_episodes")
    se = (first_eval.get(metric + "_se", 0.0), last_eval.get(metric + "_se", 0.0))
    paired = a is not None and b is not None and len(a) == len(b) > 1
    change_se = mean_se(np.subtract(b, a))[1] if paired else math.hypot(*se)
    print(f"{metric}: {first_eval[metric]:.3f} ± {se[0]:.3f} before -> {last_eval[metric]:.3f} ± "
          f"{se[1]:.3f} after ({last_eval[metric] - first_eval[metric]:+.3f} ± {change_se:.3f}"
          f"{', paired' if paired else ''}), {wall_seconds / 60:.1f} min; run dir {run_dir}")
    return summary


def seed_everything(seed):
    """Seeds python, numpy and torch; returns the numpy generator of the run's tasks and batches."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def resumed_args(args):
    """--resume RUN_DIR: the arguments that run started with (its config.json), to go on with it."""
    from common.models import UserError

    run_dir = Path(args.resume)
    if not (run_dir / "checkpoint.pt").is_file():
        raise UserError(f"--resume {run_dir}: no checkpoint.pt there (a run writes one every "
                        "--checkpoint-every iterations); pass a run that reached its first one")
    saved = json.loads((run_dir / "config.json").read_text())
    names = {f.name for f in dataclasses.fields(args)} - {"resume"}
    return dataclasses.replace(args, **{k: v for k, v in saved.items() if k in names})


def start_run(args, extra):
    """The run directory (with --resume, the run's own), its config.json and a Logger."""
    run_dir = Path(args.resume or Path(args.output_dir) / (
        f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"))
    print(f"run dir: {run_dir}{' (resumed)' if args.resume else ''}")
    if not args.resume:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps({**asdict(args), **extra}, indent=2))
    return run_dir, Logger(run_dir, args.track)


class Logger:
    """metrics.jsonl (NaN and inf as null), samples.jsonl and, with --track, TensorBoard."""

    def __init__(self, run_dir: Path, track: bool):
        self.f = open(run_dir / "metrics.jsonl", "a")
        self.samples = open(run_dir / "samples.jsonl", "a")
        self.tb = None
        if track:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(run_dir / "tb"))
            except Exception:  # noqa: BLE001 - optional extra
                print("--track: tensorboard is not installed; logging to metrics.jsonl only")

    def log(self, it: int, row: dict):
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v
               for k, v in row.items()}
        self.f.write(json.dumps({"iteration": it, **row}) + "\n")
        self.f.flush()
        for k, v in row.items() if self.tb else ():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(k, v, it)

    def log_samples(self, it: int, records: list):
        self.samples.writelines(json.dumps({"iteration": it, **r}, default=str) + "\n"
                                for r in records)
        self.samples.flush()


def save_adapter(model, run_dir: Path):
    model.save_pretrained(str(run_dir / "adapter"))


def save_checkpoint(run_dir: Path, it, model, optimizers, rng, evals, extra=None):
    """checkpoint.pt: what --resume needs to go on after iteration `it` as if the run had not
    stopped (every LoRA tensor, the optimizers, RNG states, evaluations, the method's state)."""
    state = {"iteration": it, "evals": evals, "extra": extra,
             "lora": {n: p.detach().cpu().clone() for n, p in model.named_parameters()
                      if "lora_" in n},
             "optimizers": {k: opt.state_dict() for k, opt in optimizers.items()},
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                     "torch": torch.get_rng_state(), "run": rng.bit_generator.state,
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    torch.save(state, run_dir / "checkpoint.pt.tmp")
    Path(run_dir / "checkpoint.pt.tmp").replace(run_dir / "checkpoint.pt")  # never half a file


def load_checkpoint(run_dir: Path, model, optimizers, rng):
    """Restore what save_checkpoint wrote and drop the log lines of later iterations (a killed run
    may have logged some). Returns (iteration, evals, extra)."""
    ck = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in ck["lora"].items():
            params[name].copy_(tensor)
    for k, opt in optimizers.items():
        opt.load_state_dict(ck["optimizers"][k])
    r = ck["rng"]
    random.setstate(r["python"])
    np.random.set_state(r["numpy"])
    torch.set_rng_state(r["torch"])
    if r["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(r["cuda"])
    rng.bit_generator.state = r["run"]
    for log in ("metrics.jsonl", "samples.jsonl"):
        lines = (run_dir / log).read_text().splitlines() if (run_dir / log).is_file() else []
        kept = [line for line in lines
                if line.strip() and json.loads(line)["iteration"] <= ck["iteration"]]
        (run_dir / log).write_text("".join(line + "\n" for line in kept))
    return ck["iteration"], ck["evals"], ck["extra"]


if __name__ == "__main__":
    args = tyro.cli(Args)
    from common.models import UserError

    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
