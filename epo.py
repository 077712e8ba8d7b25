"""EPO: a trained strategist guiding a frozen agent, with process rewards and iterative self-play.

Paper: "EPO: Explicit Policy Optimization for Strategic Reasoning in LLMs via Reinforcement
Learning", Xiaoqian Liu, Ke Wang, Yongbin Li, Yuchuan Wu, Wentao Ma, Aobo Kong, Fei Huang, Jianbin
Jiao, Junge Zhang, ACL 2025; https://arxiv.org/abs/2502.12486 ; official code:
https://github.com/lxqpku/EPO (the method is reconstructed from it: docs/epo.md).

Method. Only a strategist (one LoRA adapter) is trained: each turn it writes a short strategy that
a frozen agent reads before writing the actual message or action. Each iteration: collect episodes,
ask a process reward model (PRM) which strategy turns were critical (reward 1; the last turn the
outcome in [0, 1]), normalise the discounted returns per trajectory by their max |G|, and train on
the weighted log-likelihood of the strategies for a few epochs: REINFORCE without baseline, KL or
clipping. Repeat with the new strategist (iterative self-play).

Equations -> functions (section 2; the official code's, unnumbered)
- r_t = 1[t critical]; r_T = S / S_max unless T is critical; G_t = Σ_k γ^(k-t) r_k
                                                                       -> `epo_turn_returns`
- A_t = G_t / max_t |G_t| per trajectory (or over the batch: --return-norm batch)
                                                                       -> `batch_turn_weights`
- PRM stand-in: the top-k turns by the env's progress gain             -> `rule_critical_turns`
- A_t of every turn of a batch (1 with --weights ones: uniform)        -> `epo_advantages`
- L(θ) = -(1/T) Σ_t A_t (1/k_t) Σ_i log π_θ(a_{t,i} | context_t, a_{t,<i})   -> `epo_loss`
- PRM (LLM judge, a paraphrase of the paper's prompt; answer {"indexes": [...]}), section 4
                                                  -> `prm_prompt`, `parse_prm_answer`, `llm_prm`
- ablations: --prm none (outcome only), --weights ones (uniform turn weights: outcome-free)

`python epo.py` runs the tiny Negotiation strategist on a CPU, 40 iterations of 64 games. How it
differs from the paper's setup (docs/epo.md, "Deviations"), one line each:
- a rule agent and a rule PRM, not GPT-4o and an LLM judge (--agent base --prm llm: the base model);
- trained against scripted styles, not self-chat (--train-opponent self restores it);
- returns scaled by the batch's max |G| and no critical turn below a goal score of 5;

Example
    python epo.py                       # tiny Negotiation, rule agent, rule PRM, CPU
    python epo.py --model-name smollm2-135m   # SmolLM2 + its strategist adapter (DEFAULTS)
    python epo.py --model-name Qwen/Qwen2.5-1.5B-Instruct --agent base --prm llm
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import sys
import time
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
    checkpoint_every: Optional[int] = None  # checkpoint each N iterations (0: end); None: DEFAULTS
    resume: Optional[str] = None  # a run dir to continue from its checkpoint.pt and config.json
    torch_threads: int = 0  # CPU threads for torch (0: leave torch's default)

    # model
    model_name: str = "tiny"  # 'tiny' (tiny strategist), 'smollm2-135m', a hub id or a dir
    tiny_preset: str = "default"  # tiny policy size: 'default' or 'micro' (for tests)
    load_in_4bit: Optional[bool] = None  # None: nf4 on CUDA only; True: always; False: never
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout
    activation_checkpointing: Optional[bool] = None  # None: on for real models on CUDA
    static_cache: bool = False  # static KV cache in generate (batches padded to 2^k; docs/gpu.md)
    max_new_tokens: Optional[int] = None  # most tokens per strategy; None: policy's or DEFAULTS
    temperature: float = 0.7  # strategist's sampling temperature in training (official: 0.7)
    score_temperature: float = 1.0  # the trained log-probs' temperature (official: 1; docs/epo.md)
    eval_temperature: float = 0.7  # sampled evaluation's temperature (greedy is evaluated too)

    # environment
    env_id: Optional[str] = None  # negotiation, or single-agent with --agent base; None: DEFAULTS
    history: Optional[int] = None  # past moves in the prompt; None: the env's or tiny recipe's
    agent: Literal["rule", "base"] = "rule"  # frozen agent: the env's rules or the base model
    agent_temperature: float = 0.0  # base agent's temperature (0: greedy; official action agent: 0)
    agent_max_new_tokens: Optional[int] = None  # most tokens per agent message; None: DEFAULTS
    train_opponent: Optional[str] = None  # 'self' (paper), 'rule:STYLE', 'rule:any'; None: DEFAULTS
    eval_num_tasks: Optional[int] = None  # both roles x every style (0: all); None: DEFAULTS
    eval_opponents: tuple[str, ...] = ()  # scripted styles of the evaluation (empty: all)
    eval_every: Optional[int] = None  # evaluate every N iterations, first and last; None: DEFAULTS
    eval_selfplay: bool = True  # also evaluate self-chat (both roles the strategist)
    num_logged_episodes: int = 4  # decoded episodes per evaluation written to samples.jsonl

    # algorithm
    num_iterations: Optional[int] = None  # (the paper plateaus after about 5); None: DEFAULTS
    episodes_per_iteration: Optional[int] = None  # games (self-chat: 2 trajectories); DEFAULTS
    num_epochs: int = 3  # training epochs over each iteration's trajectories (official: 3)
    trajectories_per_step: int = 8  # trajectories per optimizer step (official: 1 x accumulation 8)
    micro_batch_size: Optional[int] = None  # turns (and PRM prompts) per forward; None: DEFAULTS
    learning_rate: Optional[float] = None  # AdamW lr; None: DEFAULTS (official, full FT: 1e-6)
    warmup_ratio: float = 0.03  # warm-up share of an iteration's steps, then cosine to 0 (official)
    weight_decay: float = 0.0  # AdamW weight decay (official: 0)
    max_grad_norm: float = 1.0  # gradient clipping norm (official: 1.0)
    gamma: float = 0.99  # γ of the turn returns (official: 0.99)
    prm: Literal["rule", "llm", "none"] = "rule"  # rule: top-k progress gains; llm: paper's prompt
    prm_top_k: int = 2  # rule PRM: at most this many critical turns per trajectory
    prm_min_gain: float = 1e-6  # rule PRM: a turn is critical only if its progress gain > this
    prm_min_final: Optional[float] = None  # rule PRM: none critical below this end; None: DEFAULTS
    prm_temperature: float = 0.7  # LLM PRM sampling temperature (official: 0.7)
    prm_max_new_tokens: Optional[int] = None  # LLM PRM answer length; None: DEFAULTS
    weights: Literal["epo", "ones"] = "epo"  # PRM + outcome returns, or 1 on every turn (uniform)
    return_norm: Optional[Literal["trajectory", "batch"]] = None  # G/max|G| (official: trajectory)


# Every option left at None, by model (`with_defaults`, then `make_env`): "tiny" (docs/epo.md; its
# game aids TINY_GAME_AIDS only in a two-player game), "smollm2-135m" (docs/smollm2.md), "*" any
# other model: the paper's self-chat with a LoRA learning rate. A tiny or shipped strategist brings
# its own strategy budget (common/models.py).
DEFAULTS = {
    "tiny": dict(env_id="negotiation", num_iterations=40, episodes_per_iteration=64,
                 eval_num_tasks=0, eval_every=10, checkpoint_every=5, learning_rate=5e-4,
                 agent_max_new_tokens=16, prm_max_new_tokens=32, micro_batch_size=32,
                 train_opponent="rule:any", return_norm="batch", prm_min_final=0.5),
    "smollm2-135m": dict(env_id="negotiation", num_iterations=6, episodes_per_iteration=8,
                         eval_num_tasks=4, eval_every=3, checkpoint_every=1, learning_rate=1e-4,
                         agent_max_new_tokens=128, prm_max_new_tokens=256, micro_batch_size=8,
                         train_opponent="self", return_norm="trajectory", prm_min_final=0.0),
    "*": dict(env_id="negotiation", num_iterations=40, episodes_per_iteration=64, eval_num_tasks=0,
              eval_every=10, checkpoint_every=5, learning_rate=2e-5, max_new_tokens=48,
              agent_max_new_tokens=128, prm_max_new_tokens=256, micro_batch_size=8,
              train_opponent="self", return_norm="trajectory", prm_min_final=0.0),
}
TINY_GAME_AIDS = ("train_opponent", "return_norm", "prm_min_final")  # single agent: the "*" values


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
# The method, model-free: plain per-turn arrays in, one weight per turn out. The kernel is
# `epo_advantages` (at the end); the functions above it are its equations. The section runs alone
# with this file's imports (tests/test_method_first.py copies it out, runs its doctest).
def epo_turn_returns(critical, outcome, gamma=0.99):
    """The returns G_t of one strategist trajectory of T turns (official EPO rewards).

        r_t = 1 if turn t is critical;  r_T = outcome if the last turn is not critical;  else 0
        G_t = Σ_{k>=t} γ^(k-t) r_k

    critical: length-T bools (the PRM's critical turns); outcome: the goal score in [0, 1].
    """
    c = np.asarray(critical, dtype=bool).reshape(-1)
    T = len(c)
    r = c.astype(np.float64)
    if T and not c[-1]:
        r[-1] = float(outcome)
    G = np.zeros(T)
    acc = 0.0
    for t in range(T - 1, -1, -1):
        acc = r[t] + gamma * acc
        G[t] = acc
    return G


def batch_turn_weights(returns):
    """A_t = G_t / max |G| over every turn of the given trajectories (`--return-norm batch`: the
    batch; a list of one trajectory: EPO's G_t / max_t |G_t|). One scale for all, so a trajectory
    with a better outcome keeps a larger weight than a worse one. `returns`: per-trajectory arrays
    G; returns a list of arrays (zeros if all G are 0)."""
    m = max((float(np.abs(g).max()) for g in returns if len(g)), default=0.0)
    return [np.asarray(g, dtype=np.float64) / m if m > 0 else np.zeros(len(g)) for g in returns]


def rule_critical_turns(progress, k=2, min_gain=1e-6, min_final=0.0):
    """PRM stand-in: the (at most) k turns with the largest progress gain above `min_gain`.

        gain_t = progress[t + 1] - progress[t]  (progress[t]: before turn t, progress[T]: the end)

    Ties go to the earlier turn. With `min_final` > 0, a game that ends below it (progress[T] <
    min_final) has no critical turn: the paper's PRM is shown the outcome and picks the turns that
    were important for achieving the goal. Returns length-T bools.
    """
    p = np.asarray(progress, dtype=np.float64).reshape(-1)
    T = max(len(p) - 1, 0)
    crit = np.zeros(T, dtype=bool)
    if T == 0 or k <= 0 or p[-1] < min_final:
        return crit
    gain = np.diff(p)
    for t in sorted(range(T), key=lambda i: (-gain[i], i))[:k]:
        if gain[t] > min_gain:
            crit[t] = True
    return crit


def epo_advantages(traj, turn, outcome, critical, gamma=0.99, return_norm="trajectory",
                   weights="epo"):
    """The EPO weight A_t of every strategist turn of a batch, from plain per-turn arrays.

    traj[i], turn[i]: the turn's trajectory and its position in it. outcome[i]: the outcome of the
    turn's trajectory (goal score scaled to [0, 1]). critical[i]: the PRM marked the turn critical.
    return_norm: "trajectory" (EPO: each trajectory divided by its own max |G|) or "batch" (one max
    over the batch); weights: "epo" (the returns) or "ones" (uniform: every turn 1). Returns
    float64 [N], the REINFORCE weight of each turn (`epo_loss`).

    Three trajectories, γ = 0.5. τ0: turns 0 and 2 critical, outcome 0.6; the last turn is
    critical, so the outcome is dropped: r = (1, 0, 1), G = (1 + 0.25, 0.5, 1) = (1.25, 0.5, 1),
    A = G / 1.25 = (1, 0.4, 0.8). τ1: nothing critical, outcome 0.4: r = (0, 0.4), G = (0.2, 0.4),
    A = G / 0.4 = (0.5, 1). τ2: a failed one-turn game, r = G = 0: A = 0 (it is not trained on).
    Divided by the batch's max |G| (1.25) instead, τ1 keeps its smaller size: (0.16, 0.32).

    >>> kw = dict(traj=[0, 0, 0, 1, 1, 2], turn=[0, 1, 2, 0, 1, 0],
    ...           outcome=[0.6, 0.6, 0.6, 0.4, 0.4, 0.0], critical=[1, 0, 1, 0, 0, 0], gamma=0.5)
    >>> epo_advantages(**kw).round(3)
    array([1. , 0.4, 0.8, 0.5, 1. , 0. ])
    >>> epo_advantages(**kw, return_norm="batch").round(3)
    array([1.  , 0.4 , 0.8 , 0.16, 0.32, 0.  ])
    """
    if return_norm not in ("trajectory", "batch") or weights not in ("epo", "ones"):
        raise ValueError(f"return_norm 'trajectory' or 'batch', weights 'epo' or 'ones'; got "
                         f"{return_norm!r}, {weights!r}")
    turn, outcome = np.asarray(turn), np.asarray(outcome, dtype=np.float64)
    critical = np.asarray(critical, dtype=bool)
    rows_of = {}  # trajectory -> its rows, in order of first appearance
    for i, m in enumerate(traj):
        rows_of.setdefault(m, []).append(i)
    rows = [sorted(r, key=lambda i: turn[i]) for r in rows_of.values()]  # each in turn order
    returns = [epo_turn_returns(critical[r], outcome[r[0]], gamma) for r in rows]  # G_t
    # the trajectories that share one scale max |G|: each alone (EPO), or the whole batch
    shared = [[g] for g in returns] if return_norm == "trajectory" else [returns]
    scaled = [a for group in shared for a in batch_turn_weights(group)]  # A_t = G_t / max|G|, final
    adv = np.zeros(len(turn))
    for r, a in zip(rows, scaled):
        adv[r] = a
    return np.ones(len(turn)) if weights == "ones" else adv  # ones: uniform, no signal


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
AGENT_HINT = ("A social expert proposes this strategy for your turn: \"{strategy}\". You may use "
              "it, or rely on your own reflection.")
THOUGHT_HINT = "A guide suggests: \"{strategy}\". You may use it, or rely on your own reflection."
STRATEGIST_SYSTEM = (
    "You are a social expert advising {player} in a negotiation. {player} writes the actual "
    "messages; you give {player} one strategy for the next message, at most 10 words, as "
    "`Strategy: <strategy>` inside <action>...</action>. What {player} was told:\n{context}")
THOUGHT_SYSTEM = (
    "You are a guide for an agent acting in a text environment. Each turn, analyse the situation "
    "and give one or two sentences that help the agent choose its next action, as "
    "`Thought: <your thoughts>` inside <action>...</action>. The agent's instructions:\n{context}")
THOUGHT_FOOTER = "Give your guidance for the agent's next action: Thought: <one or two sentences>."
OUTCOME_FROM_REWARD = ("webshop",)  # single-agent envs whose outcome is the final reward in [0, 1]


@dataclass
class Episode:
    """One strategist's turns in one game, and what the credit functions need."""

    traj_id: int
    game_id: int
    task_id: str
    player: str
    opponent: str  # "self" or a scripted style ("" for single-agent envs)
    prompts: list = field(default_factory=list)  # per turn: strategist prompt ids, as sampled
    completions: list = field(default_factory=list)  # per turn: generated ids (EOS if emitted)
    strategies: list = field(default_factory=list)  # per turn: the strategy text
    views: list = field(default_factory=list)  # per turn: the strategist's user message (PRM)
    moves: list = field(default_factory=list)  # per turn: what the agent sent
    invalid: list = field(default_factory=list)
    progress: list = field(default_factory=list)  # before each turn, then the final value (T + 1)
    outcome: float = 0.0  # goal score scaled to [0, 1]
    score: float = 0.0  # goal score on the env's scale (Negotiation 0-10)
    env_return: float = 0.0  # sum of the env's rewards (single-agent envs)
    won: bool = False
    deal: bool = False
    context: str = ""  # the goal / background shown to the PRM
    critical: list = field(default_factory=list)  # the credit, set by compute_advantages
    weights: list = field(default_factory=list)
    prm_answer: str = ""  # set by llm_prm

    @property
    def length(self) -> int:
        return len(self.strategies)


def with_user_suffix(messages, suffix):
    """A copy of chat messages with `suffix` appended (on a new line) to the last user message."""
    out = [dict(m) for m in messages]
    users = [m for m in out if m["role"] == "user"]
    if users:
        users[-1]["content"] = f"{users[-1]['content']}\n{suffix}"
    return out


def context(game, player):
    """What `player` was told: the game's system prompt without the move list, or the env's."""
    if game.two_player:
        return game.env.system_prompt_for(player).split("\nMoves:")[0]
    return game.env.system_prompt


def strategist_messages(game, player, own, real):
    """The strategist's prompt: the player's view (single agent: with the `Thought:` footer); an
    instruct strategist (`real`) gets its own system prompt and its earlier strategies `own`."""
    if game.two_player:
        msgs = game.observe(player)
        if not real:  # the tiny strategist: the format it was trained on
            return msgs
        system = STRATEGIST_SYSTEM.format(player=player, context=context(game, player))
    else:
        msgs = with_user_suffix(game.observe(player), THOUGHT_FOOTER)
        system = THOUGHT_SYSTEM.format(context=game.env.system_prompt)
    msgs = [{"role": "system", "content": system}, *msgs[1:]]
    if not real or not own:
        return msgs
    listed = "; ".join(f"{i}. {s}" for i, s in enumerate(own, 1))
    return with_user_suffix(msgs, f"Your earlier strategies in this game: {listed}")


def agent_messages(game, player, strategy):
    """The base agent's prompt: its own view (moves read as utterances), the strategist's hint."""
    if not game.two_player:
        return with_user_suffix(game.observe(player), THOUGHT_HINT.format(strategy=strategy))
    with game.env.utterance_moves():
        return with_user_suffix(game.observe(player), AGENT_HINT.format(strategy=strategy))


def strategy_of(text: str) -> str:
    """The strategy inside a strategist's output (`<action>` tags stripped, at most 200 chars)."""
    from envs import extract_action

    return extract_action(text)[:200]


def training_games(new_env, tasks, players, styles, args, rng):
    """One game per task: the policy in every seat (`--train-opponent self`, or a single-agent env),
    or in one role, alternating, against a scripted style (`rule:<style>`; `rule:any`: drawn)."""
    games = []
    for n, task in enumerate(tasks):
        seats = {p: "policy" for p in players}
        if args.train_opponent != "self":
            style = args.train_opponent.split(":", 1)[1]
            style = styles[int(rng.integers(len(styles)))] if style == "any" else style
            seats.update({p: style for p in players if p != players[n % len(players)]})
        games.append(new_env(task, seats))
    return games


def rollout(model, tok, games, args, temperature, greedy=False, first_traj_id=0, real=False,
            noise_keys=None, desc=None):
    """Play the reset games to the end: batched strategies, then the agents' moves (rule, or the
    base model); with `noise_keys` seat p's t-th strategy (move) uses noise (*key, p, t, 0) (1)."""
    episodes = {}
    for g, game in enumerate(games):
        for p in [p for p in game.players if game.seats[p] == "policy"]:
            others = [game.seats[q] for q in game.players if q != p]
            opponent = "" if not others else ("self" if others[0] == "policy" else others[0])
            episodes[(g, p)] = Episode(first_traj_id + len(episodes), g, str(game.task_id), p,
                                       opponent, context=context(game, p))
    model.eval()
    stops = stop_ids(model, tok)
    bar = tqdm(desc=desc, unit="turn", leave=False, disable=desc is None)
    while live := [g for g, game in enumerate(games) if not game.done]:
        bar.update(len(live))
        who = [games[g].current_player for g in live]
        msgs = [strategist_messages(games[g], p, episodes[(g, p)].strategies, real)
                for g, p in zip(live, who)]
        prompts = [encode(tok, render_prompt(tok, m)) for m in msgs]
        keys = None if noise_keys is None else [
            (*noise_keys[g], games[g].players.index(p), episodes[(g, p)].length)
            for g, p in zip(live, who)]
        completions = generate(model, tok, prompts, temperature, args.max_new_tokens, greedy,
                               noise_keys=None if keys is None else [(*k, 0) for k in keys])
        strategies = [strategy_of(completion_text(tok, c, stops)) for c in completions]
        if args.agent == "rule":
            moves = [games[g].env.rule_agent_action(p, s) for g, p, s in zip(live, who, strategies)]
        else:
            agent_prompts = [encode(tok, render_prompt(tok, agent_messages(games[g], p, s)))
                             for g, p, s in zip(live, who, strategies)]
            with model.disable_adapter():
                replies = generate(model, tok, agent_prompts, args.agent_temperature,
                                   args.agent_max_new_tokens,
                                   noise_keys=None if keys is None else [(*k, 1) for k in keys])
            moves = [completion_text(tok, c, stops) for c in replies]
        for k, (g, p) in enumerate(zip(live, who)):
            game, ep = games[g], episodes[(g, p)]
            ep.prompts.append(prompts[k])
            ep.completions.append(completions[k])
            ep.strategies.append(strategies[k])
            ep.views.append(msgs[k][-1]["content"])
            ep.progress.append(game.progress(p))
            said = game.two_player and args.agent == "base"  # the base agent's text is a move
            with game.env.utterance_moves() if said else contextlib.nullcontext():
                step = game.step(moves[k])
            ep.moves.append(moves[k][:200])
            ep.invalid.append(bool(step.info.get("invalid", False)))
            ep.env_return += float(step.reward)
            ep.won = bool(step.info.get("success", False))
    bar.close()
    for (g, p), ep in episodes.items():
        game, env = games[g], games[g].env
        ep.progress.append(game.progress(p))
        if game.two_player:
            ep.score, ep.won = float(env.scores()[p]), env.winner() == p
            ep.outcome, ep.deal = ep.score / 10.0, env.deal_round is not None
        else:
            reward = env.env_id in OUTCOME_FROM_REWARD
            ep.outcome = ep.score = min(1.0, max(0.0, ep.env_return)) if reward else float(ep.won)
            ep.deal = ep.won
    return list(episodes.values())


def compute_advantages(episodes, args, signal=None):
    """Episodes in, one Sample per strategist turn out (its EPO weight in `adv`), credit stats.
    `signal`: the LLM PRM's critical marks, one per turn; None: --prm rule or none."""
    turns = [(ep, t) for ep in episodes for t in range(ep.length)]
    if args.return_norm is None or args.prm_min_final is None:
        raise ValueError("--return-norm, --prm-min-final unresolved: call make_env first")
    if (signal is None and args.prm == "llm") or (signal is not None and len(signal) != len(turns)):
        raise ValueError("--prm llm: pass the LLM PRM's critical marks, one per turn, as `signal`")
    if signal is not None:
        critical = [bool(c) for c in signal]
    elif args.prm == "rule":
        critical = [bool(c) for ep in episodes for c in rule_critical_turns(
            ep.progress, args.prm_top_k, args.prm_min_gain, args.prm_min_final)]
    else:
        critical = [False] * len(turns)
    adv = epo_advantages(traj=[ep.traj_id for ep, _ in turns], turn=[t for _, t in turns],
                         outcome=[ep.outcome for ep, _ in turns], critical=critical,
                         gamma=args.gamma, return_norm=args.return_norm, weights=args.weights)
    ends = np.cumsum([ep.length for ep in episodes])
    for ep, end in zip(episodes, ends):  # recorded for samples.jsonl
        ep.critical, ep.weights = critical[end - ep.length:end], adv[end - ep.length:end].tolist()
    samples = [Sample(ep.prompts[t], ep.completions[t], ep.game_id, ep.traj_id, t, float(a))
               for (ep, t), a in zip(turns, adv)]
    trained = sum(1 for ep in episodes if any(w != 0 for w in ep.weights))
    return samples, {"credit/critical_frac": float(sum(critical) / max(len(turns), 1)),
                     "credit/weight_mean": float(adv.mean()) if len(adv) else 0.0,
                     "credit/zero_weight_traj_frac": 1.0 - trained / max(len(episodes), 1)}


# ----------------------------------------------------------------------------------------------
# 4. Model-side signal, loss and update
# ----------------------------------------------------------------------------------------------
# The LLM PRM (--prm llm), the model-side signal: the paper's appendix prompts, the answer's parser
# and `llm_prm`, which asks the frozen base model for each trajectory's critical turns.
PRM_SOCIAL = (
    "Here's a conversation in JSON format between {a1} and {a2}:\n"
    "In the first response from \"human\", you can find the context of the conversation and "
    "{a1}'s goal.\n"
    "In the other responses from \"human\", you can find the conversation history between {a1} "
    "and {a2}.\n"
    "In the responses from \"gpt\", you can find communication and social strategies that {a1} "
    "used for achieving {a1}'s goal.\n"
    "In the \"score\" field, you can find a score for evaluating {a1}'s goal achievement. The "
    "score ranges from 0 and 10. 0 represents minimal goals achievement, 10 represents complete "
    "goal achievement, and a higher score indicates that {a1} is making progress towards the "
    "goal.\n\n{history}\n\n"
    "Your task is to select top strategies {a1} used that were critically important for "
    "achieving {a1}'s goal.\n\n")
PRM_TASK = (
    "Here's a conversation in JSON format between human and gpt.\n"
    "In the first response from \"human\", you can find the {what} for gpt and Agent to {verb}.\n"
    "In the responses from \"gpt\", you can find thoughts that gpt provides for helping Agent to "
    "{verb} the {goal}.\n"
    "In the other responses from \"human\", you can find the trajectories of Agent's actions and "
    "the resulting observations from the environment.\n\n"
    "In the \"score\" field, you can find a score evaluating the goal achievement. The score "
    "ranges from 0 and 1. 0 represents minimal goals achievement, 1 represents complete goal "
    "achievement.\n\n{history}\n\n"
    "Your task is to select top thoughts gpt produced that were critically important for "
    "{verb_ing} the {goal}.\n\n")
PRM_OUTPUT = (  # how both prompts ask for the answer: {items} strategies or thoughts, for {aim}
    "Please output the selected round indexes and the reasoning process that led you to the "
    "selection in JSON format like this: {{\"indexes\": , \"reasoning\": \"\"}}.\n"
    "Here is the output schema: {{\"properties\": {{\"indexes\": {{\"description\": \"the "
    "selected top {items} that are critically important for {aim}\", \"title\": \"indexes\", "
    "\"type\": \"list(integer)\"}}, \"reasoning\": {{\"description\": \"the reasoning process why "
    "you select these {items}\", \"title\": \"reasoning\", \"type\": \"string\"}}}}, "
    "\"required\": [\"indexes\", \"reasoning\"]}}.")
PRM_TASK_WORDS = {  # env -> the words of PRM_TASK (None: any other single-agent env)
    "webshop": dict(what="shopping goal", verb="achieve", verb_ing="achieving",
                    goal="shopping goal"),
    "alfworld": dict(what="initial environment observation and a household task",
                     verb="accomplish", verb_ing="accomplishing", goal="household task"),
    None: dict(what="task", verb="accomplish", verb_ing="accomplishing", goal="task"),
}
_JSON_OBJ = re.compile(r"\{.*?\}", re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def prm_prompt(ep: Episode, env_id: str, two_player: bool, other: str = ""):
    """The paper's PRM prompt for one trajectory and the conversation position of each strategy:
    human = what the strategist saw (the first with the context), gpt = its strategy (official)."""
    conv = []
    for t, (view, strategy) in enumerate(zip(ep.views, ep.strategies)):
        human = f"{ep.context}\n{view}" if t == 0 else view
        conv.append({"from": "human", "value": human, "index": 2 * t})
        conv.append({"from": "gpt", "value": strategy, "index": 2 * t + 1})
    history = json.dumps({"conversations": conv, "score": round(ep.score, 2)}, ensure_ascii=False)
    if two_player:
        text = PRM_SOCIAL.format(a1=ep.player, a2=other or "the other party", history=history)
        items, aim = "strategies", f"achieving {ep.player}'s goal"
    else:
        words = PRM_TASK_WORDS.get(env_id, PRM_TASK_WORDS[None])
        text = PRM_TASK.format(history=history, **words)
        items, aim = "thoughts", f"{words['verb_ing']} the {words['goal']}"
    return text + PRM_OUTPUT.format(items=items, aim=aim), [2 * t + 1 for t in range(ep.length)]


def prm_indexes(text):
    """The list "indexes" of the first `{...}` in a PRM answer (official: re `\\{.*?\\}`, control
    characters removed) parsed as JSON; None when there is no such list."""
    m = _JSON_OBJ.search(text) if isinstance(text, str) else None
    try:
        obj = json.loads(_CONTROL.sub("", m.group(0))) if m else None
    except (ValueError, RecursionError):
        return None
    idx = obj.get("indexes") if isinstance(obj, dict) else None
    return idx if isinstance(idx, list) else None


def parse_prm_answer(text, turn_positions):
    """Length-T bools: turn t is critical if its position turn_positions[t] is in the answer's
    `prm_indexes`. Anything malformed (no list, non-integers, other positions) marks nothing."""
    where = {int(p): t for t, p in enumerate(turn_positions)}
    crit = [False] * len(turn_positions)
    for v in prm_indexes(text) or []:
        if isinstance(v, float) and math.isfinite(v) and v == int(v):
            v = int(v)
        if type(v) is int and v in where:  # not a bool, a string or a fraction
            crit[where[v]] = True
    return crit


def llm_prm(model, tok, episodes, args, players):
    """The critical marks of the frozen base model (adapters off), one per turn of every episode
    (compute_advantages' `signal`), and the share of answers without an index list."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    prompts, positions = [], []
    for ep in episodes:
        other = [p for p in players if p != ep.player]
        text, pos = prm_prompt(ep, args.env_id, len(players) > 1, other[0] if other else "")
        ids = encode(tok, render_prompt(tok, [{"role": "user", "content": text}]))
        room = limit - args.prm_max_new_tokens if limit else len(ids)
        prompts.append(ids[max(0, len(ids) - room):])  # cut the start: the task and schema stay
        positions.append(pos)
    answers = []
    model.eval()
    for s in range(0, len(prompts), args.micro_batch_size):
        with model.disable_adapter():
            completions = generate(model, tok, prompts[s:s + args.micro_batch_size],
                                   args.prm_temperature, args.prm_max_new_tokens)
        answers += [tok.decode(c, skip_special_tokens=True) for c in completions]
    for ep, answer in zip(episodes, answers):
        ep.prm_answer = answer
    marks = [c for a, pos in zip(answers, positions) for c in parse_prm_answer(a, pos)]
    fails = sum(prm_indexes(a) is None for a in answers)
    return marks, {"credit/prm_parse_fail_frac": fails / max(len(episodes), 1)}


def epo_loss(token_logps, mask, turn_weights):
    """L = -(1/T) Σ_t A_t (Σ_i m_{t,i} log π(a_{t,i}) / Σ_i m_{t,i}) over one trajectory's T turns;
    token_logps, mask: [T, L]; turn_weights: [T]; a turn without tokens counts as mean 0."""
    lp = torch.as_tensor(token_logps)
    m = torch.as_tensor(mask, dtype=lp.dtype, device=lp.device)
    w = torch.as_tensor(turn_weights, dtype=lp.dtype, device=lp.device)
    if lp.shape[0] == 0:
        return lp.sum() * 0.0
    turn_mean = (lp * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # token mean within each turn
    return -(w * turn_mean).sum() / lp.shape[0]


def lr_factor(step, total, warmup_ratio):
    """Linear warm-up over warmup_ratio * total steps, then cosine decay to 0 (LLaMA-Factory's)."""
    warm = max(1, math.ceil(warmup_ratio * total)) if warmup_ratio > 0 else 0
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def update(model, tok, optimizer, samples, args, rng):
    """`num_epochs` passes over the trajectories with a non-zero weight, `trajectories_per_step` per
    optimizer step (the mean of their `epo_loss`), turns in length-sorted micro-batches."""
    by_traj = {}  # the samples of each trajectory, in turn order
    for x in samples:
        by_traj.setdefault(x.traj, []).append(x)
    data = [turns for turns in by_traj.values() if any(x.adv != 0 for x in turns)]
    if not data:
        return {"policy_loss": 0.0, "grad_norm": 0.0, "optimizer_steps": 0}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_step = max(1, args.trajectories_per_step)
    total = math.ceil(len(data) / per_step) * args.num_epochs  # optimizer steps (the lr schedule)
    losses, grad_norms = [], []
    model.train()
    for _ in range(args.num_epochs):
        order = rng.permutation(len(data))
        for s in range(0, len(order), per_step):
            batch = [data[i] for i in order[s:s + per_step]]
            turns = sorted(((j, x) for j, trajectory in enumerate(batch) for x in trajectory),
                           key=lambda jx: len(jx[1].prompt) + len(jx[1].completion))  # less padding
            for group in optimizer.param_groups:
                group["lr"] = args.learning_rate * lr_factor(len(losses), total, args.warmup_ratio)
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for c in range(0, len(turns), args.micro_batch_size):
                chunk = turns[c:c + args.micro_batch_size]
                lp, mask = completion_logprobs(model, tok, [x.prompt for _, x in chunk],
                                               [x.completion for _, x in chunk],
                                               temperature=args.score_temperature)
                loss = lp.sum() * 0.0
                for j in sorted({j for j, _ in chunk}):
                    rows = [r for r, (jj, _) in enumerate(chunk) if jj == j]
                    w = torch.tensor([chunk[r][1].adv for r in rows], dtype=lp.dtype,
                                     device=lp.device)
                    part = epo_loss(lp[rows], mask[rows], w)  # trajectory j's turns S in the chunk
                    # (|S| / T) epo_loss(S) over the micro-batches sums to trajectory j's epo_loss
                    loss = loss + (len(rows) / len(batch[j])) * part / len(batch)
                loss.backward()
                loss_sum += float(loss.detach())
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)))
            optimizer.step()
            losses.append(loss_sum)
    model.eval()
    return {"policy_loss": float(np.mean(losses)), "grad_norm": float(np.mean(grad_norms)),
            "optimizer_steps": len(losses)}


# ----------------------------------------------------------------------------------------------
# 5. Evaluation
# ----------------------------------------------------------------------------------------------
def evaluate(model, tok, new_env, tasks, players, styles, args, real):
    """Each test task in each role against every scripted style (single agent: each task), sampled
    (common random numbers of (seed, 0, game)) and greedily; self-chat too with --eval-selfplay."""
    specs = ([(task, role, style) for style in styles for role in players for task in tasks]
             if styles else [(task, "agent", "") for task in tasks])

    def games():
        return [new_env(task, {p: "policy" if p == role else style for p in players})
                for task, role, style in specs]
    sampled = rollout(model, tok, games(), args, args.eval_temperature, real=real,
                      noise_keys=[(args.seed, 0, i) for i in range(len(specs))],
                      desc="eval (sampled)")
    greedy = rollout(model, tok, games(), args, 0.0, greedy=True, real=real, desc="eval (greedy)")
    scores = [float(ep.score) for ep in sampled]
    row = {"eval/goal_score_episodes": scores,
           "eval/deal_rate": float(np.mean([ep.deal for ep in sampled])),
           "eval/goal_score_greedy": float(np.mean([ep.score for ep in greedy])),
           "eval/success_greedy": float(np.mean([ep.won for ep in greedy]))}
    for key, xs in (("goal_score", scores), ("success", [ep.won for ep in sampled])):
        row[f"eval/{key}"], row[f"eval/{key}_se"] = mean_se(xs)
    if styles and args.eval_selfplay:  # both roles the strategist; keys (seed, 1, game)
        selfplay = rollout(model, tok, [new_env(task, {p: "policy" for p in players})
                                        for task in tasks], args, args.eval_temperature, real=real,
                           noise_keys=[(args.seed, 1, i) for i in range(len(tasks))],
                           desc="eval (self-chat)")
        row["eval/selfplay_goal_score"] = float(np.mean([ep.score for ep in selfplay]))
        row["eval/selfplay_deal_rate"] = float(np.mean([ep.deal for ep in selfplay]))
    return row, sampled[: args.num_logged_episodes]


def episode_record(ep: Episode, tag: str) -> dict:
    """One decoded trajectory for samples.jsonl: its strategies, moves and credit."""
    crit, weights = ep.critical or [None] * ep.length, ep.weights or [None] * ep.length
    turns = [{"strategy": s, "move": m, "invalid": i, "progress_before": p, "critical": c,
              "weight": w} for s, m, i, p, c, w in zip(ep.strategies, ep.moves, ep.invalid,
                                                        ep.progress, crit, weights)]
    return {"tag": tag, "task": ep.task_id, "player": ep.player, "opponent": ep.opponent,
            "score": ep.score, "deal": ep.deal, "won": ep.won, "final_progress": ep.progress[-1],
            "turns": turns, **({"prm_answer": ep.prm_answer[:500]} if ep.prm_answer else {})}


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def strategist_policy(args):
    """What the strategist policy fixes (`common.models.policy_prompt_options`, with the tiny
    strategist's recipe overrides): its env options, its strategy budget, is_tiny, sft."""
    from common.models import policy_prompt_options
    from common.tiny import strategist_overrides

    return policy_prompt_options(args.model_name, args.env_id, args.tiny_preset,
                                 strategist_overrides(args.env_id))


def make_env(args):
    """`args` with every default set (DEFAULTS) and checked, the env factory `new_env(task, seats)`
    (an `envs.Seated` game reset to `task`), a probe and the env options; errors -> UserError."""
    import envs
    from common.models import UserError

    unset = [k for k in TINY_GAME_AIDS if getattr(args, k) is None]
    args = with_defaults(args)
    if args.env_id not in envs.available():
        raise UserError(f"env {args.env_id!r} is not available in this checkout; available env "
                        f"ids: {', '.join(envs.available()) or 'none'}")
    two_player, strategy_moves = args.env_id in envs.TWO_PLAYER, args.env_id in envs.STRATEGY_MOVES
    if not two_player:  # the tiny row's game aids need scripted styles
        args = dataclasses.replace(args, **{k: DEFAULTS["*"][k] for k in unset})
    policy = strategist_policy(args)
    if args.max_new_tokens is None:  # the strategist's recipe (tiny_overrides), else the "*" row
        args = dataclasses.replace(args, max_new_tokens=policy.max_new_tokens
                                   or DEFAULTS["*"]["max_new_tokens"])
    check_args(args)
    kw = dict(policy.env_kwargs)  # a tiny policy's recipe options: the prompts it was trained on
    if strategy_moves:
        kw["moves"] = "strategy"
        if not policy.is_tiny:  # the paper's strategist reads the whole game (the view: 4 moves)
            kw.setdefault("history", None)
    if args.history is not None:
        kw["history"] = args.history
    try:
        probe = envs.make(args.env_id, **kw)
        probe.reset(probe.task_ids("test")[0])
    except ValueError as e:
        raise UserError(f"env {args.env_id!r}: {e}") from None
    styles = probe.opponent_styles() if two_player else []
    opponent = args.train_opponent
    style = opponent.split(":", 1)[1] if opponent.startswith("rule:") else None
    bad = [s for s in args.eval_opponents if s not in styles]
    for wrong, message in [
        (args.agent == "rule" and not strategy_moves, f"--agent rule needs an env with a strategy-"
         f"following rule agent (negotiation); {args.env_id!r} has none: use --agent base"),
        (opponent != "self" and not two_player,
         "--train-opponent applies to two-player games only"),
        (opponent != "self" and (style is None or (style != "any" and style not in styles)),
         f"--train-opponent must be 'self', 'rule:any' or 'rule:<style>' with a style in "
         f"{', '.join(styles)}; got {opponent!r}"),
        (bad, f"--eval-opponents: unknown style(s) {bad}; known: "
              f"{', '.join(styles) or 'none (single agent)'}")]:
        if wrong:
            raise UserError(message)

    def new_env(task, seats):
        return envs.Seated(envs.make(args.env_id, **kw), seats).reset(task)

    return args, new_env, probe, kw


def check_args(args):
    """User errors in the resolved arguments -> UserError, one line that says what to do."""
    from common.models import UserError

    for bad, message in [
        (args.num_iterations < 0 or args.episodes_per_iteration < 1 or args.num_epochs < 1,
         "--num-iterations: >= 0; --episodes-per-iteration, --num-epochs: >= 1"),
        (not 0.0 < args.gamma <= 1.0, "--gamma must be in (0, 1]"),
        (min(args.micro_batch_size, args.trajectories_per_step) < 1 or args.eval_num_tasks < 0,
         "--micro-batch-size, --trajectories-per-step: >= 1; --eval-num-tasks: >= 0"),
        (not 0.0 <= args.prm_min_final <= 1.0,
         "--prm-min-final must be in [0, 1] (the env's progress scale)"),
        (not args.score_temperature > 0, "--score-temperature must be > 0 (official: 1)")]:
        if bad:
            raise UserError(message)


def iteration_row(episodes, samples, ustats, cstats, seconds):
    """One training iteration's metrics: charts, losses, credit statistics and timings."""
    turns = max(sum(ep.length for ep in episodes), 1)
    row = {**{f"charts/{k}": float(np.mean([getattr(ep, a) for ep in episodes])) for k, a in
              (("goal_score", "score"), ("success", "won"), ("deal_rate", "deal"),
               ("episode_length", "length"))},
           "charts/invalid_rate": float(sum(sum(ep.invalid) for ep in episodes) / turns),
           **{f"losses/{k}": v for k, v in ustats.items()}, **cstats,
           **{f"perf/{k}_seconds": v for k, v in seconds.items()},
           "perf/tokens_per_second": (sum(len(x.completion) for x in samples)
                                      / max(seconds["rollout"], 1e-9)),
           "perf/samples": len(samples)}
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main(args: Args):
    import envs
    from common.models import load_policy
    from common.tiny import strategist_overrides

    t_start = time.time()
    if args.resume:
        args = resumed_args(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rng = seed_everything(args.seed)
    args, new_env, probe, env_kwargs = make_env(args)
    policy = strategist_policy(args)
    two_player = args.env_id in envs.TWO_PLAYER
    players = list(probe.players) if two_player else ["agent"]
    styles = list(probe.opponent_styles()) if two_player else []
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them
    real = not (policy.is_tiny or policy.sft)  # instruct: own prompts; tiny, SFT: the demos
    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r,
                             lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             activation_checkpointing=args.activation_checkpointing,
                             static_cache=args.static_cache,
                             tiny_overrides=strategist_overrides(args.env_id))
    params = [p for p in model.parameters() if p.requires_grad]
    run_dir, logger = start_run(args, {"env_kwargs": env_kwargs})

    def run_eval(it):
        t0 = time.time()
        row, logged = evaluate(model, tok, new_env, test_tasks, players,
                               list(args.eval_opponents) or styles, args, real)
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, [episode_record(ep, "eval_sampled") for ep in logged])
        tqdm.write(eval_line(it, row))
        return row

    start = 0
    if args.resume:  # no optimizer to restore: each iteration makes a fresh one
        start, (first_eval, last_eval), state = load_checkpoint(run_dir, model, {}, rng)
        next_traj_id = state["next_traj_id"]
    else:
        first_eval = last_eval = run_eval(0)
        logger.log(0, first_eval)
        next_traj_id = 0

    bar = tqdm(range(start + 1, args.num_iterations + 1), desc="epo", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.episodes_per_iteration,
                            replace=len(train_tasks) < args.episodes_per_iteration)
        games = training_games(new_env, [train_tasks[int(i)] for i in chosen], players, styles,
                               args, rng)
        episodes = rollout(model, tok, games, args, args.temperature, first_traj_id=next_traj_id,
                           real=real)
        next_traj_id += len(episodes)
        t1 = time.time()  # process rewards (critical turns) -> per-turn weights
        marks, prm_stats = (llm_prm(model, tok, episodes, args, players) if args.prm == "llm"
                            else (None, {}))
        samples, cstats = compute_advantages(episodes, args, signal=marks)
        t2 = time.time()  # a fresh optimizer each iteration: each round is a new fine-tuning
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=(0.9, 0.999),
                                      weight_decay=args.weight_decay)
        ustats = update(model, tok, optimizer, samples, args, rng)
        t3 = time.time()
        seconds = {"rollout": t1 - t0, "credit": t2 - t1, "update": t3 - t2, "iteration": t3 - t0}
        row = iteration_row(episodes, samples, ustats, {**cstats, **prm_stats}, seconds)
        logger.log_samples(it, [episode_record(ep, "train")
                                for ep in episodes[: args.num_logged_episodes]])
        if (args.eval_every and it % args.eval_every == 0) or it == args.num_iterations:
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.checkpoint_every and it % args.checkpoint_every == 0:
            save_checkpoint(run_dir, it, model, {}, rng, (first_eval, last_eval),
                            {"next_traj_id": next_traj_id})
            if args.save_model:
                save_adapter(model, run_dir)
        bar.set_postfix(score=f"{row['charts/goal_score']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}")
    if args.save_model:
        save_adapter(model, run_dir)
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval,
                         "eval/goal_score")


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
