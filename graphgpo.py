"""GraphGPO: graph-based step credit from the aggregated state-transition graph of a rollout group.

Paper: "Graph-based Group Policy Optimization for LLM agents" (GraphGPO), §4, App. A, C, D;
official code: https://github.com/langfengQ/verl-agent, `recipe/GraphGPO/` (commit 234a9136), which
extends GiGPO (`gigpo/core_gigpo.py` in the same tree).

Method (docs/graphgpo.md, "Overview"). The states (`env.state_key()`) of a task's M trajectories are
merged into one graph (identical states one node, the last state of every successful trajectory
one shared goal node); a BFS from the goal gives every node its distance d(s) (unreachable:
d_max + 1). A step is rewarded R = r_succ * omega^(d(s')+1) (minus 0.1 if invalid), normalised
among the steps that leave the same state, plus the episode-level GRPO advantage; clipped policy
gradient, token-mean, k3 KL (0.01) to the base model. `--step-advantage gigpo` / `none` give the
GiGPO / multi-turn GRPO baselines.

Equations -> functions (section 2; the kernel `graphgpo_advantages` takes plain per-turn arrays)
- Eq. 3  d(s) = 0 at the goal, min over out-edges (1 + d(s')), d_max + 1 if unreachable
                                                                   -> `graph_distances`
- Eq. 4  R^G(s, a, s') = r_succ * omega^(d(s') + 1)  (unit cost c = 1) -> `graph_step_advantages`
- Eq. 5  G^G(s) = steps leaving state s;  Eq. 6  A^G = (R^G - mean) / std
                                                                   -> `graph_step_advantages`
- Eq. 2  A^E(tau) = (R(tau) - mean) / std over the group's trajectories -> `grpo_advantages`
- GiGPO  A^S = discounted return normalised within same-state step groups -> `gigpo_step_advantages`
- App. D.3 fuzzy matching (similarity >= 0.95: one node, one step group) -> `fuzzy_node_map`
- Eq. 8  A = beta_G A^G + beta_E A^E                               -> `graphgpo_advantages`
- Eq. 9  clipped PG - beta KL(pi || pi_ref)                          -> `policy_loss`

`python graphgpo.py` trains a LoRA adapter of the tiny Sokoban policy on a CPU: 40 iterations of
4 tasks x 8 trajectories (the paper: a whole Qwen2.5 for 150 epochs of 16 tasks x 8). Deviations
from the paper and the official code: docs/graphgpo.md; using the kernel in verl or TRL:
docs/porting.md.

    python graphgpo.py                                   # tiny Sokoban policy, CPU, GraphGPO
    python graphgpo.py --step-advantage gigpo --seed 2   # GiGPO baseline, same budget
    python graphgpo.py --model-name smollm2-135m         # SmolLM2 + its WebShop adapter
    python graphgpo.py --model-name Qwen/Qwen2.5-1.5B-Instruct --env-id webshop
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import random
import sys
import time
from collections import defaultdict, deque
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
    checkpoint_every: Optional[int] = None  # adapter + checkpoint.pt every N (0: end); DEFAULTS
    resume: Optional[str] = None  # a run dir to continue from its checkpoint.pt and config.json
    torch_threads: int = 0  # CPU threads for torch (0: leave torch's default)

    # model
    model_name: str = "tiny"  # 'tiny' (the env's tiny policy), 'smollm2-135m', a hub id or a dir
    tiny_preset: str = "default"  # tiny policy size: 'default' or 'micro' (for tests)
    load_in_4bit: Optional[bool] = None  # None: nf4 on CUDA only; True: always; False: never
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout
    activation_checkpointing: Optional[bool] = None  # None: on for real models on CUDA
    static_cache: bool = False
    """static KV cache in generate (batches padded to a power of two); transformers compiles it
    on CUDA, but not for 4-bit weights (docs/gpu.md)"""
    max_new_tokens: Optional[int] = None  # most tokens generated per turn; None: DEFAULTS
    temperature: float = 1.0  # sampling temperature of the rollouts (paper: 1.0)
    eval_temperature: float = 0.4  # the paper's validation runs: eval/success_val_temp

    # environment
    env_id: Optional[str] = None  # needs env.state_key(): sokoban, webshop, ...; None: DEFAULTS
    history: Optional[int] = None  # past steps shown; None: DEFAULTS, else the policy's or env's
    max_turns: int = 0  # steps per episode (0: the env's; paper: 15, ALFWorld 50)
    eval_num_tasks: Optional[int] = None  # test tasks per evaluation (0: all); None: DEFAULTS
    eval_k: int = 1  # sampled episodes per test task at each temperature
    eval_every: Optional[int] = None  # evaluate every N iterations, first and last; None: DEFAULTS
    num_logged_episodes: int = 4  # decoded episodes per evaluation written to samples.jsonl

    # algorithm
    num_iterations: Optional[int] = None  # (paper: 150 epochs); None: DEFAULTS
    tasks_per_iteration: Optional[int] = None  # B (paper: 16 x 8 = 128 envs); None: DEFAULTS
    group_size: Optional[int] = None  # M: trajectories per task (paper: 8); None: DEFAULTS
    learning_rate: Optional[float] = None  # AdamW lr; None: DEFAULTS (paper, full FT: 1e-6)
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping norm
    num_minibatches: int = 2  # optimizer steps per iteration (minibatches of the turns)
    micro_batch_size: Optional[int] = None  # turns per forward; None: DEFAULTS
    step_advantage: Literal["graph", "gigpo", "none"] = "graph"
    """step-level term: 'graph' (GraphGPO), 'gigpo' (GiGPO discounted return), 'none' (GRPO)"""
    state_match: Literal["exact", "fuzzy"] = "exact"  # 'fuzzy': similar states are one (App. D.3)
    similarity_threshold: float = 0.95  # text similarity at which --state-match fuzzy merges
    omega: Optional[float] = None  # distance discount ω; None: the paper's per env (OMEGA_BY_ENV)
    r_succ: float = 10.0  # reward of a successful episode (paper: 10)
    gamma: float = 0.95  # GiGPO discount of the step returns (paper: 0.95)
    invalid_penalty: float = 0.1  # off an invalid action's step reward (paper: 0.1)
    step_cost: float = 1.0  # c in Eq. 4, R = r_succ ω^(d(s') + c) (paper: 1; official code: 0)
    beta_graph: float = 1.0  # β_G, weight of the step-level advantage (paper: 1)
    beta_episode: float = 1.0  # β_E, weight of the episode-level GRPO advantage (paper: 1)
    clip_eps: float = 0.2  # ε of the clipped ratio (verl's 0.2; the paper gives no value)
    dual_clip: float = 3.0  # dual-clip c for negative advantages (verl default; 0 disables)
    kl_coef: float = 0.01  # β of the k3 KL penalty to the reference policy (paper: 0.01)
    adv_eps: float = 1e-6  # ε in (x - mean) / (std + ε)


# Every option left at None, by model (`with_defaults`): "tiny", the tiny policy on a CPU
# (Sokoban's 200 test tasks: SE <= 0.035); "smollm2-135m", SmolLM2 with its WebShop adapter,
# under an hour on 2 CPU cores (docs/smollm2.md); "*", any other model: the paper's 512 tokens and
# 2 past steps, a LoRA learning rate. A tiny or shipped policy brings its own token budget and
# prompt options (common/models.py).
DEFAULTS = {
    "tiny": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
                 learning_rate=5e-4, micro_batch_size=64, eval_num_tasks=200, eval_every=10,
                 checkpoint_every=10),
    "smollm2-135m": dict(env_id="webshop", num_iterations=16, tasks_per_iteration=2, group_size=4,
                         learning_rate=1e-4, max_new_tokens=512, micro_batch_size=8,
                         eval_num_tasks=30, eval_every=0, checkpoint_every=2),
    "*": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
              learning_rate=1e-5, max_new_tokens=512, micro_batch_size=8, history=2,
              eval_num_tasks=200, eval_every=10, checkpoint_every=10),
}
OMEGA_BY_ENV = {"sokoban": 0.8, "alfworld": 0.1, "webshop": 0.2}  # paper, App. C; other envs 0.5


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
# The method, model-free: plain per-turn arrays in, one advantage per turn out. The kernel is
# `graphgpo_advantages` (Eq. 8, at the end); the functions above it are its equations. The section
# runs alone with this file's imports (tests/test_method_first.py copies it out, runs its doctest).
class _Goal:
    """The one goal node of a group's graph (the last state of every successful trajectory)."""

    def __repr__(self) -> str:
        return "GOAL"


GOAL = _Goal()


def graph_distances(transitions, goal):
    """Shortest unit-cost distance of every node to `goal` (Eq. 3, with the d_max + 1 rule).

        d(goal) = 0;  d(s) = min_{(s, s') in E} 1 + d(s');  d(s) = d_max + 1 if s cannot reach goal,
        d_max = max finite d over the graph (0 if only the goal reaches itself).

    transitions: (s, s_next) pairs of hashable keys. Returns {node: distance} (all 1 without goal).
    BFS from the goal over the reversed edges (= Dijkstra with unit costs).
    """
    transitions = list(transitions)
    nodes = dict.fromkeys(x for pair in transitions for x in pair)
    predecessors = defaultdict(list)
    for s, s_next in transitions:
        predecessors[s_next].append(s)
    if goal not in nodes:
        return {n: 1 for n in nodes}
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        u = queue.popleft()
        for v in predecessors[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                queue.append(v)
    d_max = max(dist.values())
    return {n: dist.get(n, d_max + 1) for n in nodes}


def normalise_in_groups(values, keys, eps):
    """(x - mean) / (std + eps) within the values of equal key; unbiased std; a group of one, or of
    equal values, gets 0."""
    values = np.asarray(values, dtype=np.float64)
    out = np.zeros_like(values)
    members = defaultdict(list)
    for i, k in enumerate(keys):
        members[k].append(i)
    for idx in members.values():
        if len(idx) < 2:
            continue
        x = values[idx]
        sd = x.std(ddof=1)
        if sd > 0:  # equal values give 0 (also when eps = 0)
            out[idx] = (x - x.mean()) / (sd + eps)
    return out


def _split(flat, lengths):
    """A flat per-step array as one array per trajectory of the given lengths."""
    return np.split(np.asarray(flat, dtype=np.float64), np.cumsum(lengths)[:-1]) if lengths else []


def _graph_rewards(episodes, success, omega, r_succ, invalid, invalid_penalty, node_of, step_cost):
    """A group's graph and step rewards: transitions on graph nodes, the distances (Eq. 3), the
    source node of every step, and every step's R (Eq. 4)."""
    node = (lambda k: k) if node_of is None else (lambda k: node_of.get(k, k))
    transitions, steps = [], []
    for m, states in enumerate(episodes):
        states = list(states)
        if not states:
            raise ValueError(f"episode {m} has no state")
        nodes = [node(s) for s in states]
        if success[m]:
            nodes[-1] = GOAL  # every successful trajectory ends in the one shared goal node
        for t in range(len(states) - 1):
            transitions.append((nodes[t], nodes[t + 1]))
            flagged = bool(invalid[m][t]) if invalid is not None else False
            steps.append((nodes[t], nodes[t + 1], flagged))  # grouped by node (App. D.3)
    dist = graph_distances(transitions, GOAL)
    R = [r_succ * omega ** (dist[target] + step_cost) - invalid_penalty * flagged  # Eq. 4
         for _, target, flagged in steps]
    return transitions, dist, [source for source, _, _ in steps], R


def graph_step_advantages(episodes, success, omega, r_succ=10.0, eps=1e-6, invalid=None,
                          invalid_penalty=0.1, node_of=None, step_cost=1.0):
    """GraphGPO step advantages of one group (Eq. 4-6).

        R_t = r_succ * omega^(d(s_{t+1}) + c) - invalid_penalty * invalid_t   (c = step_cost, 1)
        A_t = (R_t - mean_{G(s_t)} R) / (std_{G(s_t)} R + eps),  G(s): the steps leaving key s

    episodes[m] = [s_1, ..., s_{T+1}]; a successful trajectory's last state becomes the goal node.
    `node_of` ({key: node}, fuzzy matching): matched states are one node, in the graph and in the
    step groups (App. D.3). Returns one float64 array of length T per trajectory.
    """
    if len(episodes) != len(success):
        raise ValueError(f"{len(episodes)} episodes but {len(success)} success flags")
    episodes = [list(e) for e in episodes]
    _, _, sources, R = _graph_rewards(episodes, success, omega, r_succ, invalid, invalid_penalty,
                                      node_of, step_cost)
    lengths = [max(len(e) - 1, 0) for e in episodes]
    return _split(normalise_in_groups(R, sources, eps), lengths)  # Eq. 5-6


def grpo_advantages(returns, eps=1e-6):
    """Episode-level GRPO advantage (Eq. 2): A^E = (R - mean R) / (std R + eps), unbiased std;
    a group of one trajectory gets 0."""
    R = np.asarray(returns, dtype=np.float64)
    if R.size < 2 or R.std(ddof=1) == 0:
        return np.zeros_like(R)
    return (R - R.mean()) / (R.std(ddof=1) + eps)


def discounted_returns(rewards, gamma):
    """G_t = sum_{k >= t} gamma^(k - t) r_k for one trajectory."""
    out = np.zeros(len(rewards), dtype=np.float64)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def gigpo_step_advantages(episodes, step_rewards, gamma=0.95, eps=1e-6, invalid=None,
                          invalid_penalty=0.1):
    """GiGPO anchor-state step advantages of one group.

        R_t = sum_{k >= t} gamma^(k - t) r_k - invalid_penalty * invalid_t
        A_t = (R_t - mean_{G(s_t)} R) / (std_{G(s_t)} R + eps),  G(s): the steps leaving key s

    episodes[m] = [s_1, ...] (s_1..s_T are the steps' source states); step_rewards[m] = [r_1..r_T].
    Unbiased std; a group of one step gets 0. Returns one float64 array of length T per trajectory.
    """
    if len(episodes) != len(step_rewards):
        raise ValueError(f"{len(episodes)} episodes but {len(step_rewards)} reward lists")
    R, keys, lengths = [], [], []
    for m, (states, rewards) in enumerate(zip(episodes, step_rewards)):
        T = len(rewards)
        if len(states) < T:
            raise ValueError(f"episode {m}: {len(states)} states for {T} rewards")
        penalty = [invalid_penalty * float(bool(invalid[m][t])) if invalid is not None else 0.0
                   for t in range(T)]
        R += list(discounted_returns(rewards, gamma) - penalty)
        keys += states[:T]
        lengths.append(T)
    return _split(normalise_in_groups(R, keys, eps), lengths)


def fuzzy_node_map(keys, threshold=0.95):
    """Greedy clustering of state keys by text similarity (App. D.3; official `enable_similarity`).

    Keys are visited in order; each joins the first earlier cluster whose representative's
    difflib.SequenceMatcher ratio on str(key) is >= threshold, else it starts a new cluster.
    Returns {key: representative key}.
    """
    reps, out = [], {}
    for k in keys:
        if k in out:
            continue
        text = str(k)
        for r, rtext in reps:
            sm = difflib.SequenceMatcher(None, text, rtext, autojunk=False)
            if (sm.real_quick_ratio() >= threshold and sm.quick_ratio() >= threshold
                    and sm.ratio() >= threshold):
                out[k] = r
                break
        else:
            reps.append((k, text))
            out[k] = k
    return out


def trajectories_of(group, traj, *per_turn):
    """Per-turn arrays regrouped: {group: {trajectory: [turn rows]}} in order of first appearance,
    and each array in `per_turn` as a numpy array with one element per turn (a state key that is a
    tuple, as WebShop's, stays one hashable element)."""
    rows = {}
    for i, (g, m) in enumerate(zip(group, traj)):
        rows.setdefault(g, {}).setdefault(m, []).append(i)
    return rows, [_one_per_turn(x) for x in per_turn]


def _one_per_turn(x):
    if not any(isinstance(v, (tuple, list)) for v in x):
        return np.asarray(x)
    column = np.empty(len(x), dtype=object)  # np.asarray would unpack the tuples into a 2-D array
    for i, v in enumerate(x):
        column[i] = tuple(v)
    return column


def graphgpo_advantages(group, traj, state, next_state, success, invalid, omega,
                        step_advantage="graph", r_succ=10.0, gamma=0.95, invalid_penalty=0.1,
                        step_cost=1.0, beta_graph=1.0, beta_episode=1.0, fuzzy_threshold=None,
                        eps=1e-6):
    """The GraphGPO advantage of every turn of a batch (Eq. 8), from plain per-turn arrays.

    group[i], traj[i]: the turn's group (the M trajectories of one task) and trajectory; a
    trajectory's turns come in order. state[i], next_state[i]: hashable keys of s_t and s_{t+1}.
    success[i]: the turn's trajectory succeeded. invalid[i]: its action was invalid.
    step_advantage: "graph" (Eq. 4-6), "gigpo" (GiGPO's discounted returns in state groups) or
    "none" (multi-turn GRPO). fuzzy_threshold: merge graph nodes whose key texts are this similar
    (App. D.3). Returns float64 [N]:  A = beta_graph * A^step + beta_episode * A^episode.

    One task, three trajectories from state a (ω = 0.5, r_succ = 10): τ0 a -> b -> goal succeeds,
    τ1 a -> c -> c and τ2 a -> b -> d fail. d(b) = 1, d(a) = 2, c and d never reach the goal:
    d_max + 1 = 3. R = 10 · 0.5^(d(s') + 1): from a 2.5, 0.625, 2.5 -> A^G = 1, -2, 1 (/ sqrt 3);
    from b 5 (τ0), 0.625 (τ2) -> ±1/sqrt 2; from c alone -> 0. Returns 10, 0, 0 -> A^E = 2, -1,
    -1 (/ sqrt 3). τ2's first step moved toward the goal: GRPO blames it (-0.577), GraphGPO not (0).

    >>> adv = graphgpo_advantages(group=[0, 0, 0, 0, 0, 0], traj=[0, 0, 1, 1, 2, 2],
    ...                           state=["a", "b", "a", "c", "a", "b"],
    ...                           next_state=["b", "win", "c", "c", "b", "d"],
    ...                           success=[1, 1, 0, 0, 0, 0], invalid=[0] * 6, omega=0.5, eps=0.0)
    >>> adv.round(3) + 0.0
    array([ 1.732,  1.862, -1.732, -0.577,  0.   , -1.284])
    """
    rows_of, (state, next_state, success, invalid) = trajectories_of(
        group, traj, state, next_state, success, invalid)
    a_step, a_episode = np.zeros(len(state)), np.zeros(len(state))
    for trajectories in rows_of.values():
        rows = list(trajectories.values())
        flat = [i for r in rows for i in r]
        episodes = [[state[i] for i in r] + [next_state[r[-1]]] for r in rows]  # s_1 .. s_{T+1}
        won = [bool(success[r[0]]) for r in rows]
        flags = [[bool(invalid[i]) for i in r] for r in rows]
        if step_advantage == "graph":
            node_of = None
            if fuzzy_threshold is not None:  # App. D.3: near-identical states are one graph node
                keys = dict.fromkeys(s for e in episodes for s in e)
                node_of = fuzzy_node_map(keys, fuzzy_threshold)
            per_traj = graph_step_advantages(episodes, won, omega, r_succ, eps, flags,
                                             invalid_penalty, node_of=node_of, step_cost=step_cost)
        elif step_advantage == "gigpo":  # the reward r_succ * success arrives on the last turn
            rewards = [[0.0] * (len(r) - 1) + [r_succ * float(w)] for r, w in zip(rows, won)]
            per_traj = gigpo_step_advantages(episodes, rewards, gamma, eps, flags, invalid_penalty)
        elif step_advantage == "none":
            per_traj = [np.zeros(len(r)) for r in rows]
        else:
            raise ValueError(f"step_advantage: 'graph', 'gigpo' or 'none', not {step_advantage!r}")
        a_step[flat] = np.concatenate(per_traj)
        returns = [r_succ * float(w) - invalid_penalty * sum(f) for w, f in zip(won, flags)]
        a_episode[flat] = np.repeat(grpo_advantages(returns, eps), [len(r) for r in rows])  # Eq. 2
    return beta_graph * a_step + beta_episode * a_episode  # Eq. 8


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One trajectory: the tokens of its turns and what the credit needs."""

    traj_id: int
    group_id: int
    task_id: str
    prompts: list = field(default_factory=list)  # per turn: prompt token ids, as sampled
    completions: list = field(default_factory=list)  # per turn: generated ids (EOS if emitted)
    logprobs: list = field(default_factory=list)  # per turn: their log-probs under the sampler
    actions: list = field(default_factory=list)  # per turn: decoded text
    observations: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    states: list = field(default_factory=list)  # s_1 .. s_{T+1} (env.state_key())
    success: bool = False
    env_return: float = 0.0

    @property
    def length(self) -> int:
        return len(self.actions)


def rollout(model, tok, new_env, task_ids, group_ids, temperature, max_new_tokens, greedy=False,
            noise_keys=None, progress=None):
    """One episode per task id, all envs stepped together: one batched generate per turn. With
    `noise_keys` (a key per episode) turn t samples with CommonNoise of (*key, t)."""
    envs_, episodes = [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        env = new_env()
        env.reset(task)
        envs_.append(env)
        episodes.append(Episode(traj_id=i, group_id=int(g), task_id=str(task),
                                states=[env.state_key()]))
    model.eval()
    stops = stop_ids(model, tok)
    while active := [i for i, e in enumerate(envs_) if not e.done]:
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        keys = (None if noise_keys is None
                else [(*noise_keys[i], episodes[i].length) for i in active])
        completions, logprobs = generate(model, tok, prompts, temperature, max_new_tokens,
                                         greedy=greedy, noise_keys=keys, logprobs=True)
        for k, i in enumerate(active):
            ep = episodes[i]
            step = envs_[i].step(completion_text(tok, completions[k], stops))
            ep.prompts.append(prompts[k])
            ep.completions.append(completions[k])
            ep.logprobs.append(logprobs[k])
            ep.actions.append(tok.decode(completions[k], skip_special_tokens=True))
            ep.observations.append(step.observation)
            ep.invalid.append(bool(step.info.get("invalid", False)))
            ep.states.append(envs_[i].state_key())
            ep.env_return += float(step.reward)
            if step.done:
                ep.success = bool(step.info.get("success", False))
        if progress is not None:  # episodes finished this turn
            progress.update(sum(envs_[i].done for i in active))
    return episodes


def compute_advantages(episodes, args, signal=None):
    """Episodes in, one Sample per turn out with its advantage (Eq. 8), and the logged credit
    statistics. `signal`: a method's model-derived credit signal (GraphGPO has none)."""
    turns = [(ep, t) for ep in episodes for t in range(ep.length)]
    adv = graphgpo_advantages(
        group=[ep.group_id for ep, _ in turns], traj=[ep.traj_id for ep, _ in turns],
        state=[ep.states[t] for ep, t in turns], next_state=[ep.states[t + 1] for ep, t in turns],
        success=[ep.success for ep, _ in turns], invalid=[ep.invalid[t] for ep, t in turns],
        omega=args.omega, step_advantage=args.step_advantage, r_succ=args.r_succ, gamma=args.gamma,
        invalid_penalty=args.invalid_penalty, step_cost=args.step_cost, beta_graph=args.beta_graph,
        beta_episode=args.beta_episode, eps=args.adv_eps,
        fuzzy_threshold=args.similarity_threshold if args.state_match == "fuzzy" else None)
    samples = [Sample(ep.prompts[t], ep.completions[t], ep.group_id, ep.traj_id, t, float(a),
                      old=ep.logprobs[t]) for (ep, t), a in zip(turns, adv)]
    a = np.abs(adv) if len(adv) else np.zeros(1)
    return samples, {"credit/adv_abs_mean": float(a.mean()),
                     "credit/adv_nonzero_frac": float((a > 1e-8).mean())}


# ----------------------------------------------------------------------------------------------
# 4. Model-side signal, loss and update
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def token_logprobs(model, tok, samples, adapter, micro_batch_size, temperature=1.0):
    """Per-sample token log-prob vectors under the policy (adapter "default") or, with adapter None,
    the reference policy (adapter disabled); eval mode, no gradient, length-sorted micro-batches."""
    model.eval()
    out = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: seq_len(samples[i]))  # little padding
    for s in range(0, len(order), micro_batch_size):
        chunk = [samples[i] for i in order[s:s + micro_batch_size]]
        with model.disable_adapter() if adapter is None else contextlib.nullcontext():
            lp, _ = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                        [x.completion for x in chunk], temperature=temperature)
        for j, (i, x) in enumerate(zip(order[s:s + micro_batch_size], chunk)):
            out[i] = lp[j, lp.shape[1] - len(x.completion):].float().cpu()
    return out


def policy_loss(logp, old_logp, ref_logp, adv, mask, clip_eps, dual_clip, kl_coef):
    """Eq. 9 per token, token-mean over `mask`:

        ratio = exp(logp - old);  pg = -min(ratio A, clip(ratio, 1 - ε, 1 + ε) A)
        for A < 0: pg = min(pg, -c A)  (dual clip)
        k3 = exp(ref - logp) - (ref - logp) - 1   (verl low_var_kl, clamped to [-10, 10])
        loss = Σ mask (pg + β k3) / Σ mask
    Returns (loss, pg_loss, kl, clip_frac) (the last three detached, as floats).
    """
    n = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    pg = torch.maximum(l1, l2)
    if dual_clip and dual_clip > 1.0:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    k3 = (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)
    pg_loss = (pg * mask).sum() / n
    kl = (k3 * mask).sum() / n
    loss = pg_loss + kl_coef * kl if kl_coef else pg_loss
    clip_frac = (((l2 > l1).float()) * mask).sum() / n
    return loss, pg_loss.item(), kl.item(), clip_frac.item()


def update(model, tok, optimizer, samples, args, rng):
    """One pass over the turns in `num_minibatches` optimizer steps of the policy, token-mean within
    each. The reference policy's token log-probs are taken here, before any step, and π_θold's where
    sampling did not keep them or kept them in less than fp32 (they would differ from these)."""
    device = next(model.parameters()).device
    fp32 = next(model.parameters()).dtype == torch.float32
    todo = [x for x in samples if x.old is None or not fp32]
    for x, o in zip(todo, token_logprobs(model, tok, todo, "default", args.micro_batch_size,
                                         args.temperature)):
        x.old = o
    ref = (token_logprobs(model, tok, samples, None, args.micro_batch_size, args.temperature)
           if args.kl_coef else [None] * len(samples))
    for x, r in zip(samples, ref):
        x.ref = r
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "loss", "kl_ref", "approx_kl", "clip_frac",
                             "grad_norm")}
    order = rng.permutation(len(samples))
    for minibatch_idx in np.array_split(order, max(1, args.num_minibatches)):
        # sorted by length: the minibatch's loss is a sum over its micro-batches, so the order
        # changes no gradient, only how much padding each micro-batch's forward pays for
        minibatch = sorted((samples[i] for i in minibatch_idx), key=seq_len)
        if not minibatch:
            continue
        ntok = sum(len(x.completion) for x in minibatch)
        optimizer.zero_grad(set_to_none=True)
        acc = dict.fromkeys(stats, 0.0)
        for s in range(0, len(minibatch), args.micro_batch_size):
            chunk = minibatch[s:s + args.micro_batch_size]
            lp, m = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                        [x.completion for x in chunk], temperature=args.temperature)
            old = _padded(chunk, "old", lp.shape[1], device)
            ref = _padded(chunk, "ref", lp.shape[1], device) if args.kl_coef else old
            adv = m * torch.tensor([float(x.adv) for x in chunk], device=device)[:, None]
            loss, pg, kl, cf = policy_loss(lp, old, ref, adv, m, args.clip_eps, args.dual_clip,
                                           args.kl_coef)
            # a micro-batch's token mean weighted by its share of the minibatch's tokens: the
            # gradient is the token mean over the whole minibatch, whatever the micro-batching
            w = float(m.sum()) / max(ntok, 1)
            (loss * w).backward()
            for name, v in (("loss", loss.item()), ("policy_loss", pg), ("kl_ref", kl),
                            ("clip_frac", cf)):
                acc[name] += v * w
            with torch.no_grad():
                log_r = (lp - old) * m
                acc["approx_kl"] += float(((torch.exp(log_r) - 1 - log_r) * m).sum()) / max(ntok, 1)
        acc["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm))
        optimizer.step()
        for k, v in acc.items():
            stats[k].append(v)
    model.eval()
    return {k: float(np.mean(v)) if v else 0.0 for k, v in stats.items()}


# ----------------------------------------------------------------------------------------------
# 5. Evaluation
# ----------------------------------------------------------------------------------------------
def evaluate(model, tok, new_env, tasks, args):
    """Test success sampled at the training and the paper's validation temperature, and greedy;
    the sampled episodes draw common random numbers keyed by (seed, stream, episode)."""
    tasks_k = [t for t in tasks for _ in range(args.eval_k)]
    keys = [[(args.seed, stream, i) for i in range(len(tasks_k))] for stream in (0, 1)]
    with tqdm(total=2 * len(tasks_k) + len(tasks), desc="evaluation", unit="episode",
              leave=False, dynamic_ncols=True) as bar:
        episodes = rollout(model, tok, new_env, tasks_k, [0] * len(tasks_k), args.temperature,
                           args.max_new_tokens, noise_keys=keys[0], progress=bar)
        val = rollout(model, tok, new_env, tasks_k, [0] * len(tasks_k), args.eval_temperature,
                      args.max_new_tokens, noise_keys=keys[1], progress=bar)
        greedy = rollout(model, tok, new_env, tasks, [0] * len(tasks), 1.0, args.max_new_tokens,
                         greedy=True, progress=bar)
    out = {"eval/success_episodes": [float(ep.success) for ep in episodes]}
    for key, eps in (("", episodes), ("_greedy", greedy), ("_val_temp", val)):
        out[f"eval/success{key}"], out[f"eval/success{key}_se"] = mean_se([e.success for e in eps])
    n_turns = sum(ep.length for ep in episodes)
    out["eval/return"] = float(np.mean([ep.env_return for ep in episodes]))
    out["eval/return_greedy"] = float(np.mean([ep.env_return for ep in greedy]))
    out["eval/episode_length"] = float(np.mean([ep.length for ep in episodes]))
    out["eval/invalid_rate"] = float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1))
    logged = ([("sampled", ep) for ep in episodes[: args.num_logged_episodes]]
              + [("greedy", ep) for ep in greedy[: max(1, args.num_logged_episodes // 2)]])
    return out, [{"tag": tag, "task_id": ep.task_id, "success": ep.success, "return": ep.env_return,
                  "turns": [{"action": a, "observation": o, "invalid": v}
                            for a, o, v in zip(ep.actions, ep.observations, ep.invalid)]}
                 for tag, ep in logged]


def iteration_row(episodes, samples, ustats, cstats, seconds):
    """One iteration's metrics: training rollouts, losses, credit statistics, seconds per phase."""
    n_turns = sum(ep.length for ep in episodes)
    n_tokens = sum(len(x.completion) for x in samples)
    row = {"charts/success": float(np.mean([ep.success for ep in episodes])),
           "charts/return": float(np.mean([ep.env_return for ep in episodes])),
           "charts/episode_length": float(np.mean([ep.length for ep in episodes])),
           "charts/invalid_rate": float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1)),
           **{f"losses/{k}": v for k, v in ustats.items()}, **cstats,
           **{f"perf/{k}_seconds": v for k, v in seconds.items()},
           "perf/tokens_per_second": n_tokens / max(seconds["rollout"], 1e-9),
           "perf/samples": len(samples)}
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def make_env(args):
    """`args` with every default set (DEFAULTS, OMEGA_BY_ENV) and checked, the env factory
    `new_env`, one probe instance and the env options (user errors -> UserError)."""
    import envs
    from common.models import UserError, policy_prompt_options

    args = with_defaults(args)
    if args.omega is None:
        args = dataclasses.replace(args, omega=OMEGA_BY_ENV.get(args.env_id, 0.5))
    check_args(args)
    if args.env_id not in envs.available():
        raise UserError(f"env {args.env_id!r} is not available in this checkout; available env "
                        f"ids: {', '.join(envs.available()) or 'none'}")
    if args.env_id in envs.TWO_PLAYER:
        raise UserError(f"env {args.env_id!r} is a two-player game; GraphGPO needs a single-agent "
                        "env such as sokoban")
    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    kw = dict(policy_prompt_options(args.model_name, args.env_id, args.tiny_preset).env_kwargs)
    if args.history is not None:
        kw["history"] = args.history

    def new_env():
        env = envs.make(args.env_id, **kw)
        if args.max_turns:
            env.max_turns = args.max_turns
        return env

    try:
        probe = new_env()
        probe.reset(probe.task_ids("train")[0])
        probe.state_key()
    except ValueError as e:
        raise UserError(f"env {args.env_id!r}: {e}") from None
    except NotImplementedError:
        raise UserError(f"env {args.env_id!r} has no state_key(); GraphGPO needs one "
                        "(sokoban, alfworld, webshop)") from None
    return args, new_env, probe, kw


def check_args(args):
    """User errors in the resolved arguments -> UserError, one line that says what to do."""
    from common.models import UserError

    if args.group_size < 2:
        raise UserError("--group-size must be >= 2 (advantages compare the trajectories of a task)")
    if min(args.tasks_per_iteration, args.micro_batch_size, args.eval_k, args.max_new_tokens) < 1:
        raise UserError("--tasks-per-iteration, --micro-batch-size, --eval-k and --max-new-tokens "
                        "must be >= 1")
    if args.num_iterations < 0:
        raise UserError("--num-iterations must be >= 0")
    if args.history is not None and args.history < 0:
        raise UserError(f"--history must be >= 0 (or None), got {args.history}")
    if not 0.0 < args.omega < 1.0:
        raise UserError(f"--omega must lie in (0, 1), got {args.omega}")
    if not 0.0 < args.similarity_threshold <= 1.0:
        raise UserError("--similarity-threshold must lie in (0, 1], got "
                        f"{args.similarity_threshold}")


def main(args: Args):
    from common.models import load_policy

    t_start = time.time()
    if args.resume:
        args = resumed_args(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rng = seed_everything(args.seed)
    args, new_env, probe, env_kwargs = make_env(args)
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them

    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r,
                             lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             activation_checkpointing=args.activation_checkpointing,
                             static_cache=args.static_cache)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=args.weight_decay)
    run_dir, logger = start_run(args, {"env_kwargs": env_kwargs,
                                       "max_turns_resolved": probe.max_turns,
                                       "num_train_tasks": len(train_tasks),
                                       "num_test_tasks": len(test_tasks)})

    def run_eval(it):
        t0 = time.time()
        row, records = evaluate(model, tok, new_env, test_tasks, args)
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, records)
        tqdm.write(eval_line(it, row))
        return row

    start = 0
    if args.resume:
        start, evals, _ = load_checkpoint(run_dir, model, {"policy": optimizer}, rng)
        first_eval, last_eval = evals
    else:
        first_eval = last_eval = run_eval(0)
        logger.log(0, first_eval)

    bar = tqdm(range(start + 1, args.num_iterations + 1), desc=f"graphgpo[{args.step_advantage}]",
               dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(args.group_size)]
        groups = [g for g in range(len(chosen)) for _ in range(args.group_size)]
        episodes = rollout(model, tok, new_env, tasks, groups, args.temperature,
                           args.max_new_tokens)
        t1 = time.time()
        samples, cstats = compute_advantages(episodes, args)
        t2 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)
        t3 = time.time()
        seconds = {"rollout": t1 - t0, "credit": t2 - t1, "update": t3 - t2, "iteration": t3 - t0}
        row = iteration_row(episodes, samples, ustats, cstats, seconds)
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.checkpoint_every and it % args.checkpoint_every == 0:
            save_checkpoint(run_dir, it, model, {"policy": optimizer}, rng, (first_eval, last_eval))
            if args.save_model:
                save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}",
                        reward=f"{row['charts/return']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}")
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval,
                         "eval/success", step_advantage=args.step_advantage)


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
