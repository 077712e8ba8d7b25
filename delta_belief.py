"""ΔBelief-RL: the agent's own belief change as a dense turn-level reward, with turn-wise GRPO.

Paper: "Intrinsic Credit Assignment for Long Horizon Interaction" (ΔBelief-RL), Auzina et al.;
https://bethgelab.github.io/delta-belief-rl ; code: https://github.com/bethgelab/delta-belief-rl

Method (docs/delta_belief.md, "Overview"). The questioner of Twenty Questions, rewarded only when it
names the secret, gets its *own* belief as a dense signal: after every turn t,
b_t = log p_θ(target | history_t, "Is it '<target>'?"), and the turn earns λ·max(b_t - b_{t-1}, 0)
on top of outcome and penalties. Advantages are normalised per turn across the G games of a target
(turn-wise GRPO); clipped policy gradient with DAPO's asymmetric clip (0.2 / 0.28), no KL,
token-mean. The baseline StarPO (``--reward-mode starpo``) is trajectory-level GRPO on the summed
reward, no belief term.

Equations -> functions (section 2; the kernel `delta_belief_advantages` takes plain per-turn arrays)
- Eq. 1  ΔBelief_t = log b_t - log b_{t-1}                             -> `turn_rewards` (delta)
- Eq. 3  r_t = r_eog + λ max(ΔBelief_t, 0) + r_p                      -> `turn_rewards`
- Eq. 4  Â_t^i = (r_t^i - mean_i r_t) / std_i r_t   (per turn column) -> `turnwise_advantages`,
                                                                        `delta_belief_advantages`
- StarPO R^i = Σ_t r_t^i, Â^i = (R^i - mean R) / std R                 -> `starpo_turn_rewards`,
                                                                        `trajectory_advantages`
- belief elicitation b_t (section 4: a scoring forward pass)           -> `elicit_beliefs`
- Eq. 2  best-of-n ΔBelief sampling (Fig. 3, evaluation only)          -> `best_of_n_rollout`
- clipped PG with ε_low / ε_high, dual clip, token-mean                 -> `policy_loss`

Deviations from the paper and the official code: docs/delta_belief.md, "Deviations".

`python delta_belief.py` trains a LoRA adapter of the tiny Twenty Questions policy on a CPU, 64
iterations of 8 secrets x 4 games (paper: Qwen3, 240 x 16); the answerer is rule-based.

Example
    python delta_belief.py                                  # tiny policy, CPU, ΔBelief
    python delta_belief.py --reward-mode starpo --seed 2    # StarPO baseline, same budget
    python delta_belief.py --model-name smollm2-135m        # SmolLM2 + its adapter (DEFAULTS)
    python delta_belief.py --model-name Qwen/Qwen3-1.7B --tasks-per-iteration 15
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
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
    checkpoint_every: Optional[int] = None  # checkpoint every N iterations (0: at the end)
    resume: Optional[str] = None  # a run dir to continue from its checkpoint.pt and config.json
    torch_threads: int = 0  # CPU threads for torch (0: leave torch's default)

    # model
    model_name: str = "tiny"  # 'tiny' (the env's tiny policy), 'smollm2-135m', a hub id or a dir
    tiny_preset: str = "default"  # tiny policy size: 'default' or 'micro' (for tests)
    load_in_4bit: Optional[bool] = None  # None: nf4 on CUDA only; True: always; False: never
    lora_r: int = 64  # LoRA rank (paper: 64)
    lora_alpha: int = 64  # LoRA alpha (paper: 64)
    lora_dropout: float = 0.0  # LoRA dropout
    activation_checkpointing: Optional[bool] = None  # None: on for real models on CUDA
    static_cache: bool = False  # static KV cache in generate (docs/gpu.md)
    max_new_tokens: Optional[int] = None  # most tokens per turn; None: the policy's, else DEFAULTS
    temperature: Optional[float] = None  # rollout temperature; None: the policy's (paper: 1.0)
    eval_temperature: Optional[float] = None  # sampled evaluation's; None: --temperature's

    # environment
    env_id: Optional[str] = None  # needs env.target, the hidden answer; None: DEFAULTS
    history: Optional[int] = None  # past (question, answer) pairs shown; None: the env's
    max_turns: Optional[int] = None  # most questions per game (paper: 20); None: DEFAULTS
    eval_env_id: str = ""  # extra out-of-distribution evaluation env, e.g. guess_my_city
    eval_max_turns: int = 0  # question budget at evaluation (0: max_turns; paper's scaling: 50)
    eval_num_tasks: Optional[int] = None  # test targets per evaluation (0: all); None: DEFAULTS
    eval_k: Optional[int] = None  # sampled games per test target; None: DEFAULTS
    eval_every: Optional[int] = None  # evaluate every N iterations, first and last; None: DEFAULTS
    eval_best_of_n: int = 0  # > 0: also evaluate ΔBelief best-of-n (Fig. 3), first and last
    num_logged_episodes: int = 4  # decoded episodes per evaluation written to samples.jsonl

    # algorithm
    reward_mode: Literal["delta", "starpo"] = "delta"  # starpo: trajectory GRPO (baseline)
    num_iterations: Optional[int] = None  # training iterations; None: DEFAULTS
    tasks_per_iteration: Optional[int] = None  # secrets (official: 240); None: DEFAULTS
    group_size: Optional[int] = None  # G: games per secret (paper: 16); None: DEFAULTS
    learning_rate: Optional[float] = None  # None: DEFAULTS (StarPO, "*": STARPO_LEARNING_RATE)
    adam_betas: tuple[float, float] = (0.9, 0.95)  # AdamW betas (official)
    weight_decay: float = 0.01  # AdamW weight decay (official)
    max_grad_norm: float = 1.0  # gradient clipping norm
    num_minibatches: Optional[int] = None  # optimizer steps per iteration; None: DEFAULTS
    micro_batch_size: Optional[int] = None  # turns (and belief prompts) per forward; None: DEFAULTS
    lam: float = 0.1  # λ, weight of the clipped belief gain (paper: 0.1)
    win_reward: float = 2.0  # end-of-game reward for naming the secret
    turn_penalty: float = 0.05  # end-of-game penalty per question asked
    invalid_penalty: float = 5.0  # penalty of a turn that is not a valid yes/no question
    repeat_penalty: float = 1.0  # penalty of a turn that repeats an earlier question
    belief_template: str = "auto"  # elicitation message with {target}; auto: "Is it '{target}'?"
    clip_low: float = 0.2  # ε_low of the clipped ratio
    clip_high: float = 0.28  # ε_high of the clipped ratio (DAPO asymmetric clipping)
    dual_clip: float = 3.0  # dual-clip c for negative advantages (verl default; 0 disables)
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-mean"] = "auto"  # auto: official
    adv_eps: float = 1e-6  # ε in (r - mean) / (std + ε)


# Every option left at None, by model (`with_defaults`; docs/delta_belief.md): "tiny" on a CPU;
# "smollm2-135m" under an hour on 2 CPU cores (docs/smollm2.md); "*", any other model.
DEFAULTS = {
    "tiny": dict(env_id="twenty_questions", max_turns=20, num_iterations=64, tasks_per_iteration=8,
                 group_size=4, learning_rate=5e-4, num_minibatches=2, micro_batch_size=64,
                 eval_num_tasks=0, eval_k=5, eval_every=32, checkpoint_every=50),
    "smollm2-135m": dict(env_id="twenty_questions", max_turns=12, num_iterations=10,
                         tasks_per_iteration=4, group_size=4, learning_rate=1e-4, num_minibatches=2,
                         micro_batch_size=8, eval_num_tasks=20, eval_k=2, eval_every=5,
                         checkpoint_every=2),
    "*": dict(env_id="twenty_questions", max_turns=20, num_iterations=64, tasks_per_iteration=8,
              group_size=4, learning_rate=3e-5, num_minibatches=3, micro_batch_size=8,
              max_new_tokens=128, eval_num_tasks=0, eval_k=5, eval_every=32, checkpoint_every=50),
}
# StarPO on a "*" model: the paper's (Table 5) rate for Qwen3-1.7B.
STARPO_LEARNING_RATE = 1e-5


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
# The method, model-free: plain per-turn arrays and log-beliefs in, one advantage per turn out. The
# kernel is `delta_belief_advantages` (Eq. 4, at the end); the functions above it are its equations.
# The section runs alone with this file's imports (tests/test_method_first.py runs its doctests).
def turn_rewards(log_beliefs, won, invalid, repeated, lam=0.1, win_reward=2.0, turn_penalty=0.05,
                 invalid_penalty=5.0, repeat_penalty=1.0):
    """Per-turn ΔBelief-RL rewards of one game of T turns (Eq. 1 and 3, official scales).

        delta_t = b_t - b_{t-1}                      (t = 1..T; the winning turn: delta_T = 0)
        eog     = win_reward * won - turn_penalty * T               (added to every turn)
        r_t     = eog + lam * max(delta_t, 0) - invalid_penalty * invalid_t
                  - repeat_penalty * repeated_t

    log_beliefs: [b_0, ..., b_T] (length T+1; when `won`, b_T is ignored and may be NaN).
    invalid, repeated: length-T bools. Returns a float64 array of length T.
    """
    b = np.asarray(log_beliefs, dtype=np.float64)
    inv = np.asarray(invalid, dtype=bool)
    rep = np.asarray(repeated, dtype=bool)
    T = len(inv)
    if b.shape != (T + 1,) or rep.shape != (T,):
        raise ValueError(f"need T+1 beliefs and T flags, got {b.shape}, {inv.shape}, {rep.shape}")
    delta = np.diff(b) if T else np.zeros(0)  # Eq. 1
    if won and T:
        delta[-1] = 0.0  # the finishing turn gets no belief reward
    delta = np.nan_to_num(delta, nan=0.0)
    eog = win_reward * float(bool(won)) - turn_penalty * T
    return eog + lam * np.maximum(delta, 0.0) - invalid_penalty * inv - repeat_penalty * rep


def turnwise_advantages(rewards, lengths, eps=1e-6):
    """Turn-wise GRPO (Eq. 4) over the G games of one target.

        A[i, t] = (r[i, t] - mean_{j: len_j > t} r[j, t]) / (std_{j: len_j > t} r[j, t] + eps)

    rewards: [G, T_max] (entries past a game's end are ignored); lengths: [G]. The statistics of
    turn t use only the games still playing at turn t; std is unbiased (ddof=1); a turn with a
    single active game gives 0; entries past a game's end are 0.
    """
    r = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(lengths)
    adv = np.zeros_like(r)
    for t in range(r.shape[1]):
        active = lengths > t
        if int(active.sum()) < 2:
            continue
        column = r[active, t]
        adv[active, t] = (column - column.mean()) / (column.std(ddof=1) + eps)
    return adv


def starpo_turn_rewards(won, invalid, repeated, win_reward=2.0, turn_penalty=0.05,
                        invalid_penalty=5.0, repeat_penalty=1.0):
    """StarPO (baseline) per-turn rewards: penalties on their turns, eog on the last turn only.

        r_t = -invalid_penalty * invalid_t - repeat_penalty * repeated_t + 1[t = T] * eog,
        eog = win_reward * won - turn_penalty * T
    """
    inv = np.asarray(invalid, dtype=bool)
    rep = np.asarray(repeated, dtype=bool)
    r = -invalid_penalty * inv - repeat_penalty * rep.astype(np.float64)
    if len(r):
        r[-1] += win_reward * float(bool(won)) - turn_penalty * len(r)
    return r


def trajectory_advantages(returns, eps=1e-6):
    """Trajectory-level GRPO (StarPO): A^i = (R^i - mean R) / (std R + eps), unbiased std; one
    game -> 0."""
    R = np.asarray(returns, dtype=np.float64)
    if R.size < 2:
        return np.zeros_like(R)
    return (R - R.mean()) / (R.std(ddof=1) + eps)


def games_of(group, traj, turn):
    """The rows of every game of every group, both in order of first appearance:
    [[rows of one game, ...] per group]. A game's rows must be its turns 0, 1, ... in order."""
    index = {}
    for i, (g, m) in enumerate(zip(group, traj)):
        index.setdefault(g, {}).setdefault(m, []).append(i)
    groups = [list(games.values()) for games in index.values()]
    for rows in (rows for games in groups for rows in games):
        turns = [int(turn[i]) for i in rows]
        if turns != list(range(len(rows))):
            raise ValueError(f"a game's turns must be 0, 1, ... in order, got {turns}")
    return groups


def batch_turn_rewards(group, traj, turn, success, invalid, repeated, log_beliefs,
                       reward_mode="delta", lam=0.1, win_reward=2.0, turn_penalty=0.05,
                       invalid_penalty=5.0, repeat_penalty=1.0):
    """r_t of every turn, float64 [N]: `turn_rewards` of each game (Eq. 3) for "delta",
    `starpo_turn_rewards` for "starpo" (log_beliefs unused, may be None). The arrays are those of
    `delta_belief_advantages`."""
    success, invalid, repeated = (np.asarray(x) for x in (success, invalid, repeated))
    if reward_mode == "delta":
        log_beliefs = np.asarray(log_beliefs, dtype=np.float64)
    rewards = np.zeros(len(success))
    for games in games_of(group, traj, turn):
        for rows in games:
            won = bool(success[rows[0]])
            if reward_mode == "delta":  # b_0 (before the first turn), then b after every turn
                beliefs = [log_beliefs[rows[0], 0], *log_beliefs[rows, 1]]
                rewards[rows] = turn_rewards(beliefs, won, invalid[rows], repeated[rows], lam,
                                             win_reward, turn_penalty, invalid_penalty,
                                             repeat_penalty)
            elif reward_mode == "starpo":
                rewards[rows] = starpo_turn_rewards(won, invalid[rows], repeated[rows], win_reward,
                                                    turn_penalty, invalid_penalty, repeat_penalty)
            else:
                raise ValueError(f"reward_mode: 'delta' or 'starpo', not {reward_mode!r}")
    return rewards


def delta_belief_advantages(group, traj, turn, success, invalid, repeated, log_beliefs,
                            reward_mode="delta", lam=0.1, win_reward=2.0, turn_penalty=0.05,
                            invalid_penalty=5.0, repeat_penalty=1.0, eps=1e-6):
    """The ΔBelief-RL advantage of every turn of a batch (Eq. 3, then Eq. 4), from per-turn arrays.

    group[i], traj[i], turn[i]: the turn's group (the G games of one secret), game and 0-based
    position in it; a game's turns come in order. success[i]: the turn's game was won. invalid[i],
    repeated[i]: its question was not a valid yes/no question / repeated an earlier one.
    log_beliefs: float [N, 2], per turn the log-belief in the secret before the turn (b_t) and after
    it (b_{t+1}; NaN after the winning turn, where none is elicited); the kernel reads b_0 from a
    game's first turn and b_{t+1} from every turn. reward_mode "starpo": the baseline, trajectory
    GRPO of the summed StarPO rewards on every turn (log_beliefs unused, may be None).
    Returns float64 [N].

    One secret, three games (default scales: eog = 2 * won - 0.05 * turns, λ = 0.1). τ0 wins on its
    first question: r = 1.95. τ1 and τ2 lose after two questions (eog = -0.1); τ1's first question
    lifts its belief from -3 to -1 (r = -0.1 + 0.1 * 2 = 0.1), its second changes nothing (-0.1);
    τ2's first changes nothing (-0.1), its second lifts -3 to -2 (-0.1 + 0.1 = 0). Turn 0: r = 1.95,
    0.1, -0.1, mean 0.65, std sqrt(2.555 / 2) = 1.130 -> 1.150, -0.487, -0.664. Turn 1 (τ0 has
    ended): -0.1, 0 -> ∓1/sqrt 2. StarPO gives both lost games -1/sqrt 3 on every turn (returns
    1.95, -0.1, -0.1); ΔBelief ranks each lost game's informative question above the other's.

    >>> arrays = dict(group=[0, 0, 0, 0, 0], traj=[0, 1, 1, 2, 2], turn=[0, 0, 1, 0, 1],
    ...               success=[1, 0, 0, 0, 0], invalid=[0] * 5, repeated=[0] * 5,
    ...               log_beliefs=[[-3, float("nan")], [-3, -1], [-1, -1], [-3, -3], [-3, -2]])
    >>> delta_belief_advantages(**arrays, eps=0.0).round(3) + 0.0
    array([ 1.15 , -0.487, -0.707, -0.664,  0.707])
    >>> delta_belief_advantages(**arrays, reward_mode="starpo", eps=0.0).round(3) + 0.0
    array([ 1.155, -0.577, -0.577, -0.577, -0.577])
    """
    rewards = batch_turn_rewards(group, traj, turn, success, invalid, repeated, log_beliefs,
                                 reward_mode, lam, win_reward, turn_penalty, invalid_penalty,
                                 repeat_penalty)  # Eq. 3 (or StarPO's)
    adv = np.zeros(len(rewards))
    for games in games_of(group, traj, turn):
        lengths = np.array([len(rows) for rows in games])
        r = np.zeros((len(games), int(lengths.max())))  # [G, T_max], zeros past a game's end
        for i, rows in enumerate(games):
            r[i, :len(rows)] = rewards[rows]
        if reward_mode == "delta":
            a = turnwise_advantages(r, lengths, eps)  # Eq. 4: Â_t^i = (r_t^i - mean r_t) / std r_t
        else:  # StarPO: the game's advantage on every one of its turns
            a = np.repeat(trajectory_advantages(r.sum(1), eps)[:, None], r.shape[1], axis=1)
        for i, rows in enumerate(games):
            adv[rows] = a[i, :len(rows)]
    return adv


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One game: the tokens of its turns and what the credit needs."""

    traj_id: int
    group_id: int
    task_id: str
    target: str
    prompts: list = field(default_factory=list)  # per turn: prompt token ids, as sampled
    completions: list = field(default_factory=list)  # per turn: generated ids (EOS if emitted)
    logprobs: list = field(default_factory=list)  # per turn: their log-probs under the sampler
    actions: list = field(default_factory=list)  # per turn: decoded text
    observations: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    repeated: list = field(default_factory=list)
    beliefs: list = field(default_factory=list)  # b_0..b_T (b_T = nan after a winning turn)
    success: bool = False

    @property
    def length(self) -> int:
        return len(self.actions)

    def add_turn(self, tok, prompt, completion, step, logprobs=None):
        self.prompts.append(prompt)
        self.completions.append(completion)
        self.logprobs.append(logprobs)
        self.actions.append(tok.decode(completion, skip_special_tokens=True))
        self.observations.append(step.observation)
        self.invalid.append(bool(step.info.get("invalid", False)))
        self.repeated.append(bool(step.info.get("repeated", False)))
        self.success = bool(step.done and step.info.get("success", False))


def start_games(new_env, task_ids, group_ids, max_turns=None):
    """A fresh env per task id, reset, and its Episode (`max_turns`: another question budget)."""
    envs_, episodes = [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        envs_.append(new_env())
        if max_turns:
            envs_[i].max_turns = max_turns
        envs_[i].reset(task)
        episodes.append(Episode(i, g, task_id=str(task), target=str(envs_[i].target)))
    return envs_, episodes


def rollout(model, tok, new_env, task_ids, group_ids, args, temperature, belief_message,
            greedy=False, max_turns=None, with_beliefs=True, noise_keys=None, progress=None):
    """One game per task id, stepped together: a batched generate per turn, then b_0, b_{t+1}
    (NaN after a win) by `elicit_beliefs`. `noise_keys`: turn t of game i samples (*key_i, t, 0)."""
    envs_, episodes = start_games(new_env, task_ids, group_ids, max_turns)
    model.eval()
    stops = stop_ids(model, tok)

    def beliefs(games):  # b of each game's current chat, in micro-batches
        return elicit_beliefs(model, tok, [envs_[i].messages() for i in games],
                              [episodes[i].target for i in games], belief_message,
                              args.micro_batch_size)

    if with_beliefs:
        for ep, b in zip(episodes, beliefs(range(len(episodes)))):
            ep.beliefs.append(float(b))
    while active := [i for i, env in enumerate(envs_) if not env.done]:
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        keys = None if noise_keys is None else [(*noise_keys[i], episodes[i].length, 0)
                                                for i in active]
        completions, logprobs = generate(model, tok, prompts, temperature, args.max_new_tokens,
                                         greedy, keys, logprobs=True)
        for i, prompt, completion, lp in zip(active, prompts, completions, logprobs):
            step = envs_[i].step(completion_text(tok, completion, stops))
            episodes[i].add_turn(tok, prompt, completion, step, lp)
        if with_beliefs:  # none is elicited after the winning turn
            unsolved = [i for i in active if not episodes[i].success]
            after = dict(zip(unsolved, beliefs(unsolved)))
            for i in active:
                episodes[i].beliefs.append(float(after.get(i, float("nan"))))
        if progress is not None:  # games finished this turn
            progress.update(sum(envs_[i].done for i in active))
    return episodes


def compute_advantages(episodes, args, signal=None):
    """One Sample per turn with its advantage, and the logged credit statistics. `signal`: the
    log-beliefs [N, 2] of the N turns (b before and after each); None: the episodes' own."""
    turns = [(ep, t) for ep in episodes for t in range(ep.length)]
    delta = args.reward_mode == "delta"
    if delta:  # [N, 2]: b before and after every turn
        beliefs = [ep.beliefs[t:t + 2] for ep, t in turns] if signal is None else signal
        signal = np.asarray(beliefs, dtype=np.float64).reshape(-1, 2)
    inputs = dict(group=[ep.group_id for ep, _ in turns], traj=[ep.traj_id for ep, _ in turns],
                  turn=[t for _, t in turns], success=[ep.success for ep, _ in turns],
                  invalid=[ep.invalid[t] for ep, t in turns],
                  repeated=[ep.repeated[t] for ep, t in turns], log_beliefs=signal,
                  **{k: getattr(args, k) for k in ("reward_mode", "lam", "win_reward",
                                                   "turn_penalty", "invalid_penalty",
                                                   "repeat_penalty")})
    adv = delta_belief_advantages(**inputs, eps=args.adv_eps)
    samples = [Sample(ep.prompts[t], ep.completions[t], ep.group_id, ep.traj_id, t, float(a),
                      old=ep.logprobs[t]) for (ep, t), a in zip(turns, adv)]
    stats = {"charts/turn_reward_mean": float(np.mean(batch_turn_rewards(**inputs))),
             "credit/adv_abs_mean": float(np.abs(adv).mean()),
             "credit/adv_nonzero_frac": float((np.abs(adv) > 1e-8).mean())}
    if delta:  # the mean ΔBelief (Eq. 1) of the turns with a b after them (not a winning one)
        change = signal[:, 1] - signal[:, 0]
        won_turn = np.array([ep.success and t == ep.length - 1 for ep, t in turns], dtype=bool)
        deltas = change[~won_turn & np.isfinite(change)]
        stats["credit/delta_belief_mean"] = float(np.mean(deltas)) if len(deltas) else 0.0
    return samples, stats


# ----------------------------------------------------------------------------------------------
# 4. Model-side signal, loss and update
# ----------------------------------------------------------------------------------------------
# The belief b_t (the kernel's log_beliefs): the log-prob of the secret in an elicitation message.
def belief_message_for(args, env):
    """--belief-template, or for "auto" the official "Is it '{target}'?"; a tiny policy on an env
    with guesses gets the env's `guess_text` ("Is it a cat?"), the only guess form it has seen."""
    from common.models import policy_kind

    if args.belief_template != "auto":
        return args.belief_template
    if (policy_kind(args.model_name) == "tiny"
            and env.guess_text(env.task_ids("test")[0]) is not None):
        return env.guess_text
    return "Is it '{target}'?"


def locate_target(tok, message: str, target: str):
    """Token ids of `message` (alone, cut after the target) and a 0/1 mask of the tokens whose span
    overlaps the target, so `'cat` counts (docs/delta_belief.md, "Implementation details" 2)."""
    start = message.rfind(target)  # the last occurrence: the target ends the message
    if not target or start < 0:
        raise ValueError(f"target {target!r} not in elicitation message {message!r}")
    end = start + len(target)
    try:
        enc = tok(message, add_special_tokens=False, return_offsets_mapping=True)
        ids, spans = list(enc["input_ids"]), [tuple(s) for s in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer: decode
        ids = encode(tok, message)
        ends = [len(tok.decode(ids[: i + 1])) for i in range(len(ids))]
        spans = list(zip([0] + ends[:-1], ends))
    mask = [1 if (s < end and e > start and e > s) else 0 for s, e in spans]
    if not any(mask):
        raise ValueError(f"no token of {message!r} covers the target {target!r}")
    last = max(i for i, m in enumerate(mask) if m)
    return ids[: last + 1], mask[: last + 1]


@torch.no_grad()
def elicit_beliefs(model, tok, messages_list, targets, template="Is it '{target}'?",
                   micro_batch_size=64):
    """b = Σ log p(target tokens | chat, "Is it '") per (chat, target), raw logits, no gradient;
    the message is the next assistant turn (docs/delta_belief.md, "Implementation details" 1)."""
    if not messages_list:
        return np.zeros(0)
    prompts, messages, masks = [], [], []
    for chat, target in zip(messages_list, targets):
        message = template(target) if callable(template) else template.format(target=target)
        ids, mask = locate_target(tok, message, target)
        prompts.append(encode(tok, render_prompt(tok, chat)))
        messages.append(ids)
        masks.append(mask)
    was_training = model.training
    model.eval()
    out = []
    with merged_lora(model):  # as when sampling: one matmul per layer
        for s in range(0, len(prompts), micro_batch_size):
            logp, _ = completion_logprobs(model, tok, prompts[s:s + micro_batch_size],
                                          messages[s:s + micro_batch_size])
            for j, mask in enumerate(masks[s:s + micro_batch_size]):
                row = logp[j, logp.shape[1] - len(mask):]  # the message's tokens: right-aligned
                out.append(float((row * torch.tensor(mask, dtype=row.dtype).to(row.device)).sum()))
    model.train(was_training)
    return np.asarray(out, dtype=np.float64)


@torch.no_grad()
def token_logprobs(model, tok, samples, micro_batch_size, temperature=1.0):
    """Per-sample token log-prob vectors under the policy, in length-sorted micro-batches."""
    model.eval()
    out = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: seq_len(samples[i]))  # little padding
    for s in range(0, len(order), micro_batch_size):
        idx = order[s:s + micro_batch_size]
        lp, _ = completion_logprobs(model, tok, [samples[i].prompt for i in idx],
                                    [samples[i].completion for i in idx], temperature=temperature)
        for j, i in enumerate(idx):
            out[i] = lp[j, lp.shape[1] - len(samples[i].completion):].float().cpu()
    return out


def policy_loss(logp, old_logp, adv, weights, clip_low, clip_high, dual_clip):
    """Σ weights * -min(ratio A, clip(ratio, 1 - ε_low, 1 + ε_high) A), for A < 0 at most -c A
    (dual clip); and the 0/1 mask of the clipped tokens."""
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(l1, l2)
    if dual_clip > 1.0:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * dual_clip), loss_tok)
    return (loss_tok * weights).sum(), (l2 > l1).float()


def minibatches(trajs, n, rng, whole_games):
    """Sample indices in n shuffled minibatches (trajs[i]: sample i's game). `whole_games` keeps a
    game's turns in one (official: under seq-mean-token-mean a split game would weigh twice)."""
    n = max(1, n)
    if not whole_games:
        return [list(b) for b in np.array_split(rng.permutation(len(trajs)), n)]
    members = {}  # game -> its samples, games in order of first appearance
    for i, g in enumerate(trajs):
        members.setdefault(g, []).append(i)
    games = list(members)
    order = [games[k] for k in rng.permutation(len(games))]
    return [[i for g in part for i in members[g]]
            for part in np.array_split(np.array(order, dtype=object), n)]


def update(model, tok, optimizer, samples, args, rng):
    """One pass over the turns in `num_minibatches` optimizer steps, aggregated by --loss-agg.
    π_θold's log-probs are taken here where sampling did not keep them in fp32."""
    device = next(model.parameters()).device
    agg = args.loss_agg if args.loss_agg != "auto" else (
        "token-mean" if args.reward_mode == "delta" else "seq-mean-token-mean")
    fp32 = next(model.parameters()).dtype == torch.float32
    todo = [x for x in samples if x.old is None or not fp32]
    for x, o in zip(todo, token_logprobs(model, tok, todo, args.micro_batch_size,
                                         args.temperature)):
        x.old = o
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "approx_kl", "clip_frac", "grad_norm")}
    for minibatch_idx in minibatches([x.traj for x in samples], args.num_minibatches, rng,
                                     whole_games=agg == "seq-mean-token-mean"):
        # sorted by length: the loss is a sum over micro-batches, so only the padding changes
        minibatch = sorted((samples[i] for i in minibatch_idx), key=seq_len)
        if not minibatch:
            continue
        ntok = sum(len(x.completion) for x in minibatch)
        game_tokens = Counter()  # tokens per game in this minibatch
        for x in minibatch:
            game_tokens[x.traj] += len(x.completion)
        optimizer.zero_grad(set_to_none=True)
        acc = dict.fromkeys(stats, 0.0)
        for s in range(0, len(minibatch), args.micro_batch_size):
            chunk = minibatch[s:s + args.micro_batch_size]
            lp, m = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                        [x.completion for x in chunk], temperature=args.temperature)
            old = _padded(chunk, "old", lp.shape[1], device)
            adv = m * torch.tensor([float(x.adv) for x in chunk], device=device)[:, None]
            # token weights: token-mean 1 / tokens; seq-mean-token-mean 1 / (games * game's tokens)
            w = m * torch.tensor([1.0 / ntok if agg == "token-mean"
                                  else 1.0 / (len(game_tokens) * game_tokens[x.traj])
                                  for x in chunk], device=device)[:, None]
            loss, clipped = policy_loss(lp, old, adv, w, args.clip_low, args.clip_high,
                                        args.dual_clip)
            loss.backward()
            acc["policy_loss"] += float(loss.detach())
            with torch.no_grad():
                log_r = (lp - old) * m
                acc["approx_kl"] += float(((torch.exp(log_r) - 1 - log_r) * m).sum())
                acc["clip_frac"] += float((clipped * m).sum())
        acc["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        optimizer.step()
        for k, v in acc.items():  # the token sums become token means
            stats[k].append(v / max(ntok, 1) if k in ("approx_kl", "clip_frac") else v)
    model.eval()
    return {k: float(np.mean(v)) if v else 0.0 for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------
# 5. Evaluation
# ----------------------------------------------------------------------------------------------
def best_of_n_rollout(model, tok, new_env, tasks, args, belief_message, n, max_turns, noise_keys,
                      progress=None):
    """ΔBelief best-of-n (Eq. 2, Fig. 3): every turn samples n questions (keys (*key, t, j)), plays
    each on a copy of the env and keeps the largest belief gain; a question that wins, outright."""
    envs_, episodes = start_games(new_env, tasks, range(len(tasks)), max_turns)
    b0 = elicit_beliefs(model, tok, [env.messages() for env in envs_],
                        [ep.target for ep in episodes], belief_message, args.micro_batch_size)
    for ep, b in zip(episodes, b0):
        ep.beliefs.append(float(b))
    stops = stop_ids(model, tok)
    while active := [i for i, env in enumerate(envs_) if not env.done]:
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        keys = [(*noise_keys[i], episodes[i].length, j) for i in active for j in range(n)]
        completions = generate(model, tok, [p for p in prompts for _ in range(n)],
                               args.eval_temperature, args.max_new_tokens, noise_keys=keys)
        copies = [copy.deepcopy(envs_[i]) for i in active for _ in range(n)]
        steps = [env.step(completion_text(tok, c, stops)) for env, c in zip(copies, completions)]
        unsolved = [q for q, step in enumerate(steps) if not step.info["success"]]
        after = np.full(len(copies), np.inf)
        after[unsolved] = elicit_beliefs(model, tok, [copies[q].messages() for q in unsolved],
                                         [episodes[active[q // n]].target for q in unsolved],
                                         belief_message, args.micro_batch_size)
        for k, i in enumerate(active):
            j = k * n + int(np.argmax(after[k * n:(k + 1) * n] - episodes[i].beliefs[-1]))
            envs_[i] = copies[j]
            episodes[i].add_turn(tok, prompts[k], completions[j], steps[j])
            episodes[i].beliefs.append(float(after[j]) if np.isfinite(after[j]) else math.nan)
        if progress is not None:
            progress.update(sum(envs_[i].done for i in active))
    return episodes


def evaluate(model, tok, new_env, tasks, args, prefix, belief_message, best_of_n=0):
    """Sampled (k per task), greedy and best-of-n success. The sampled games draw common random
    numbers keyed by (seed, stream, game): `write_summary` pairs the first and last evaluation."""
    k, max_turns = args.eval_k, args.eval_max_turns or args.max_turns
    stream = 0 if prefix == "eval/" else 1  # the test secrets; the out-of-distribution ones
    keys = [(args.seed, stream, i) for i in range(len(tasks) * k)]
    with tqdm(total=len(tasks) * (k + 1 + bool(best_of_n)), desc=prefix.rstrip("/_"),
              unit="game", leave=False, dynamic_ncols=True) as bar:
        sampled = rollout(model, tok, new_env, [t for t in tasks for _ in range(k)],
                          [i // k for i in range(len(keys))], args, args.eval_temperature,
                          belief_message, max_turns=max_turns, with_beliefs=False,
                          noise_keys=keys, progress=bar)
        greedy = rollout(model, tok, new_env, tasks, range(len(tasks)), args, 1.0,
                         belief_message, greedy=True, max_turns=max_turns, with_beliefs=False,
                         progress=bar)
        best = best_of_n and best_of_n_rollout(
            model, tok, new_env, tasks, args, belief_message, best_of_n, max_turns,
            [(args.seed, stream + 2, i) for i in range(len(tasks))], progress=bar)
    row = {prefix + "success_episodes": [float(ep.success) for ep in sampled]}
    for name, episodes in ((prefix + "success", sampled), (prefix + "success_greedy", greedy)):
        row[name], row[name + "_se"] = mean_se([ep.success for ep in episodes])
    shown = [("sampled", ep) for j in range(k) for ep in sampled[j::k]][: args.num_logged_episodes]
    if best_of_n:
        name = f"{prefix}bon{best_of_n}_success"
        row[name], row[name + "_se"] = mean_se([ep.success for ep in best])
        shown += [(f"best_of_{best_of_n}", ep) for ep in best[:2]]
    records = [{"tag": prefix + tag, **{key: v for key, v in vars(ep).items() if key not in
                ("prompts", "completions", "logprobs")}} for tag, ep in shown]  # no token ids
    return row, records


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def env_factory(env_id, kw, max_turns, what):
    """`new_env` of `env_id` with options `kw` and a probe; an unknown env, bad options or no
    hidden target -> UserError naming `what` ("env" or "--eval-env-id")."""
    import envs
    from common.models import UserError

    def new_env():
        env = envs.make(env_id, **kw)
        env.max_turns = max_turns or env.max_turns
        return env

    try:
        probe = new_env()
        probe.reset(probe.task_ids("test")[0])
    except (ValueError, TypeError) as e:  # TypeError: an option the env does not take
        raise UserError(f"{what} {env_id!r}: {e}") from None
    if not getattr(probe, "target", None):
        raise UserError(f"{what} {env_id!r} has no hidden target (env.target); ΔBelief needs one "
                        "(twenty_questions, guess_my_city)")
    return new_env, probe


def make_env(args):
    """`args` with every default set (DEFAULTS, STARPO_LEARNING_RATE) and checked, the env factory
    `new_env`, a probe and the env options (a tiny or SFT recipe's; --history over them)."""
    from common.models import policy_kind, policy_prompt_options

    if (args.learning_rate is None and args.reward_mode == "starpo"
            and policy_kind(args.model_name) not in DEFAULTS):
        args = dataclasses.replace(args, learning_rate=STARPO_LEARNING_RATE)
    args = with_defaults(args)
    if args.eval_temperature is None:
        args = dataclasses.replace(args, eval_temperature=args.temperature)
    check_args(args)
    kw = dict(policy_prompt_options(args.model_name, args.env_id, args.tiny_preset).env_kwargs)
    if args.history is not None:
        kw["history"] = args.history
    return (args, *env_factory(args.env_id, kw, args.max_turns, "env"), kw)


def make_ood_env(args, env_kwargs):
    """--eval-env-id's (env factory, test tasks, belief message): the policy's prompt format
    carries over (instructions, numbered, --history, the candidate list: none for a real model)."""
    kw = {k: env_kwargs[k] for k in ("instructions", "numbered") if k in env_kwargs}
    if args.history is not None:
        kw["history"] = args.history
    new_env, probe = env_factory(args.eval_env_id, kw, args.eval_max_turns or args.max_turns,
                                 "--eval-env-id")

    def ood_env():
        env = new_env()
        env.show_candidates = env_kwargs.get("show_candidates", 0)
        return env

    return (ood_env, probe.task_ids("test")[: args.eval_num_tasks or None],
            belief_message_for(args, probe))


def check_args(args):
    """User errors in the resolved arguments -> UserError, one line that says what to do."""
    from common.models import UserError

    rules = [(args.group_size < 2, "--group-size must be >= 2 (advantages compare the games of a "
              "secret)"),
             (min(args.tasks_per_iteration, args.micro_batch_size, args.eval_k,
                  args.num_minibatches, args.max_new_tokens) < 1,
              "--tasks-per-iteration, --micro-batch-size, --eval-k, --num-minibatches and "
              "--max-new-tokens must be >= 1"),
             (args.num_iterations < 0, "--num-iterations must be >= 0"),
             (args.history is not None and args.history < 0,
              f"--history must be >= 0 (or None), got {args.history}"),
             (args.belief_template != "auto" and "{target}" not in args.belief_template,
              "--belief-template must contain '{target}', e.g. \"Is it '{target}'?\"")]
    for bad, message in rules:
        if bad:
            raise UserError(message)


def main(args: Args):
    from common.models import load_policy

    t_start = time.time()
    if args.resume:
        args = resumed_args(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rng = seed_everything(args.seed)
    args, new_env, probe, env_kwargs = make_env(args)
    belief_message = belief_message_for(args, probe)
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them
    evals = {"eval/": (new_env, test_tasks, belief_message)}
    if args.eval_env_id and args.eval_env_id != args.env_id:  # out-of-distribution evaluation
        evals["eval/ood_"] = make_ood_env(args, env_kwargs)

    model, tok = load_policy(args.model_name, env_id=args.env_id, **{k: getattr(args, k) for k in (
        "tiny_preset", "load_in_4bit", "lora_r", "lora_alpha", "lora_dropout",
        "activation_checkpointing", "static_cache")})
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, betas=tuple(args.adam_betas),
                                  weight_decay=args.weight_decay)
    shown = belief_message if isinstance(belief_message, str) else belief_message("{target}")
    run_dir, logger = start_run(args, {"belief_message": shown, "env_kwargs": env_kwargs})

    def run_eval(it):  # best-of-n before and after training only
        t0, row, records = time.time(), {}, []
        for prefix, (env_fn, tasks, message) in evals.items():
            ev, recs = evaluate(model, tok, env_fn, tasks, args, prefix, message,
                                args.eval_best_of_n if it in (0, args.num_iterations) else 0)
            row.update(ev)
            records += recs
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

    bar = tqdm(range(start + 1, args.num_iterations + 1), desc=f"delta_belief[{args.reward_mode}]",
               dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(args.group_size)]
        groups = [g for g in range(len(chosen)) for _ in range(args.group_size)]
        episodes = rollout(model, tok, new_env, tasks, groups, args, args.temperature,
                           belief_message, with_beliefs=args.reward_mode == "delta")
        t1 = time.time()
        samples, cstats = compute_advantages(episodes, args)  # the beliefs: in the episodes
        t2 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)
        t3 = time.time()
        seconds = {"rollout": t1 - t0, "credit": t2 - t1, "update": t3 - t2, "iteration": t3 - t0}
        row = {"charts/success": float(np.mean([ep.success for ep in episodes])),
               "charts/episode_length": float(np.mean([ep.length for ep in episodes])),
               "charts/invalid_rate": sum(sum(ep.invalid) for ep in episodes) / len(samples),
               "charts/repeated_rate": sum(sum(ep.repeated) for ep in episodes) / len(samples),
               **{f"losses/{k}": v for k, v in ustats.items()}, **cstats,
               **{f"perf/{k}_seconds": v for k, v in seconds.items()}, "perf/samples": len(samples),
               "perf/tokens_per_second": sum(len(x.completion) for x in samples)
               / max(seconds["rollout"], 1e-9)}
        if torch.cuda.is_available():
            row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.checkpoint_every and it % args.checkpoint_every == 0:
            save_checkpoint(run_dir, it, model, {"policy": optimizer}, rng, (first_eval, last_eval))
            if args.save_model:
                save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}",
                        reward=f"{row['charts/turn_reward_mean']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}")
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval,
                         "eval/success")


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


def _padded(samples, key, C, device):
    """Right-aligned [B, C] tensor of the samples' per-token vectors `key`, zeros on the left."""
    rows = [getattr(x, key).to(device) for x in samples]
    return torch.stack([F.pad(r, (C - len(r), 0)) for r in rows])


def seq_len(sample) -> int:
    """Prompt plus completion tokens: micro-batches of similar lengths pad little."""
    return len(sample.prompt) + len(sample.completion)


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
