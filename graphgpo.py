"""GraphGPO: graph-based step credit from the aggregated state-transition graph of a rollout group.

Paper: "Graph-based Group Policy Optimization for LLM agents" (GraphGPO), §4, App. A, C, D;
official code: https://github.com/langfengQ/verl-agent, `recipe/GraphGPO/` (commit 234a9136), which
extends GiGPO (`gigpo/core_gigpo.py` in the same tree).

Method (docs/graphgpo.md, "Overview"). The states (`env.state_key()`) of a task's M trajectories are
merged into one graph (identical states one node, the last state of every successful trajectory one
shared goal node); a BFS from the goal gives every node its distance d(s) (unreachable: d_max + 1). A
step is rewarded R = r_succ * omega^(d(s')+1) (minus 0.1 if invalid), normalised among the steps that
leave the same state, plus the episode-level GRPO advantage; clipped policy gradient, token-mean, k3 KL
(0.01) to the base model. `--step-advantage gigpo` / `none` give the GiGPO / multi-turn GRPO baselines.

Equations -> functions
- Eq. 3  d(s) = 0 at the goal, min over out-edges (1 + d(s')), d_max + 1 if unreachable -> `graph_distances`
- Eq. 4  R^G(s, a, s') = r_succ * omega^(d(s') + 1)   (unit cost c = 1)                -> `graph_step_advantages`
- Eq. 5  G^G(s) = steps leaving state s;  Eq. 6  A^G = (R^G - mean) / std              -> `graph_step_advantages`
- Eq. 2  A^E(tau) = (R(tau) - mean) / std over the group's trajectories                -> `grpo_advantages`
- GiGPO  A^S = discounted return normalised within the same-state step groups          -> `gigpo_step_advantages`
- App. D.3 fuzzy state matching (similarity >= 0.95, graph nodes only)                  -> `fuzzy_node_map`
- Eq. 8  A = beta_G A^G + beta_E A^E;  Eq. 9 clipped PG - beta KL(pi || pi_ref)         -> main loop, `policy_loss`

Deviations from the paper and from the official code: docs/graphgpo.md, "Deviations".

Example
    python graphgpo.py                                   # tiny Sokoban policy, CPU, GraphGPO
    python graphgpo.py --step-advantage gigpo --seed 2   # GiGPO baseline, same budget
    python graphgpo.py --model-name Qwen/Qwen2.5-1.5B-Instruct --max-new-tokens 512 --tasks-per-iteration 16
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

import numpy as np
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
    exp_name: str = Path(__file__).stem
    """name of the run (the run directory is {env}__{exp_name}__{seed}__{time})"""
    seed: int = 1
    """random seed (python, numpy, torch, task sampling)"""
    output_dir: str = "runs"
    """directory under which the run directory is created"""
    track: bool = False
    """also log to TensorBoard (only if tensorboard is installed)"""
    save_model: bool = True
    """save the LoRA adapter to <run>/adapter at checkpoints and at the end"""
    checkpoint_every: int = 10
    """save the adapter every this many iterations (0: only at the end)"""
    torch_threads: int = 0
    """CPU threads for torch (0: leave torch's default)"""

    # model
    model_name: str = "tiny"
    """'tiny' (the env's tiny local policy), 'smollm2-135m' (SmolLM2-135M-Instruct), a hub id or a local directory"""
    tiny_preset: str = "default"
    """tiny policy size preset: 'default' or 'micro' (builds in seconds, for tests)"""
    load_in_4bit: Optional[bool] = None
    """None: nf4 on CUDA, plain weights on CPU; True forces 4-bit; False never"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA alpha"""
    lora_dropout: float = 0.0
    """LoRA dropout"""
    activation_checkpointing: bool = False
    """activation checkpointing in the training forward (saves GPU memory on real models)"""
    max_new_tokens: Optional[int] = None
    """most tokens generated per turn; None: the tiny recipe's (Sokoban 4) on the tiny policy, else 512 (paper: 512)"""
    temperature: float = 1.0
    """sampling temperature of the rollouts (paper: 1.0)"""
    eval_temperature: float = 0.4
    """temperature of the paper's validation runs (0.4), logged as eval/success_val_temp"""

    # environment
    env_id: str = "sokoban"
    """training env (needs env.state_key(): sokoban, alfworld, webshop, ...)"""
    history: Optional[int] = None
    """past (action, observation) pairs in the prompt; None: the tiny recipe's (Sokoban 0) or the env's (paper 2)"""
    max_turns: int = 0
    """most steps per episode (0: the env's default; paper: 15 Sokoban/WebShop, 50 ALFWorld)"""
    eval_num_tasks: int = 200
    """test tasks per evaluation (0: all test tasks of the env; Sokoban has 200: standard error <= 0.035)"""
    eval_k: int = 1
    """sampled episodes per test task at each temperature"""
    eval_every: int = 10
    """evaluate every this many iterations (and before training and at the end)"""
    num_logged_episodes: int = 4
    """decoded evaluation episodes written to samples.jsonl per evaluation"""

    # algorithm
    num_iterations: int = 40
    """training iterations (rollout + update; paper: 150 epochs; sized for the CPU default run)"""
    tasks_per_iteration: int = 4
    """B: distinct tasks per iteration (paper: 16, Sokoban 32; sized for the CPU default run)"""
    group_size: int = 8
    """M: trajectories per task, the group (paper: 8)"""
    learning_rate: Optional[float] = None
    """AdamW learning rate; None: 5e-4 for the tiny policy, 1e-5 for a real model (paper, full FT: 1e-6)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_minibatches: int = 2
    """optimizer steps per iteration (the turns are split into this many minibatches)"""
    micro_batch_size: int = 64
    """turns per forward pass (gradient accumulation inside a minibatch)"""
    step_advantage: Literal["graph", "gigpo", "none"] = "graph"
    """step-level term: 'graph' (GraphGPO), 'gigpo' (GiGPO discounted return), 'none' (multi-turn GRPO)"""
    state_match: Literal["exact", "fuzzy"] = "exact"
    """graph nodes: exact state keys, or 'fuzzy' (difflib similarity >= similarity_threshold, App. D.3)"""
    similarity_threshold: float = 0.95
    """text similarity at which --state-match fuzzy merges two graph nodes"""
    omega: Optional[float] = None
    """distance discount ω; None: the paper's per env (sokoban 0.8, alfworld 0.1, webshop 0.2, else 0.5)"""
    r_succ: float = 10.0
    """reward of a successful episode (paper: 10)"""
    gamma: float = 0.95
    """GiGPO discount of the step returns (paper: 0.95)"""
    invalid_penalty: float = 0.1
    """subtracted from the step reward of an invalid action before normalisation (paper: 0.1)"""
    step_cost: float = 1.0
    """unit cost c in Eq. 4, R = r_succ ω^(d(s') + c) (paper: 1; official code: 0, docs/graphgpo.md "Deviations")"""
    beta_graph: float = 1.0
    """β_G, weight of the step-level advantage (paper: 1)"""
    beta_episode: float = 1.0
    """β_E, weight of the episode-level GRPO advantage (paper: 1)"""
    clip_eps: float = 0.2
    """ε of the clipped importance ratio (paper: 0.2)"""
    dual_clip: float = 3.0
    """dual-clip constant c for negative advantages (verl default; 0 disables)"""
    kl_coef: float = 0.01
    """β, coefficient of the k3 KL penalty to the reference policy (paper: 0.01; 0 skips it)"""
    adv_eps: float = 1e-6
    """ε in (x - mean) / (std + ε)"""


OMEGA_BY_ENV = {"sokoban": 0.8, "alfworld": 0.1, "webshop": 0.2}


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
class _Goal:
    """The one goal node of a group's graph (the last state of every successful trajectory)."""

    def __repr__(self) -> str:
        return "GOAL"


GOAL = _Goal()


def graph_distances(transitions, goal):
    """Shortest unit-cost distance of every node to `goal` (Eq. 3, with the d_max + 1 rule).

        d(goal) = 0;  d(s) = min_{(s, s') in E} 1 + d(s');  d(s) = d_max + 1 if s cannot reach goal,
        d_max = max finite d over the graph (0 if only the goal reaches itself).

    transitions: (s, s_next) pairs of hashable keys; returns {node: distance} (all 1 without `goal`).
    BFS from the goal on the reversed edges (= Dijkstra with unit costs); docs/graphgpo.md, "Equations".
    """
    transitions = list(transitions)
    nodes = dict.fromkeys(x for pair in transitions for x in pair)
    rev = defaultdict(list)
    for s, s_next in transitions:
        rev[s_next].append(s)
    if goal not in nodes:
        return {n: 1 for n in nodes}
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        u = queue.popleft()
        for v in rev[u]:
            if v not in dist:
                dist[v] = dist[u] + 1
                queue.append(v)
    d_max = max(dist.values())
    return {n: dist.get(n, d_max + 1) for n in nodes}


def _normalise_in_groups(values, keys, eps):
    """(x - mean) / (std + eps) within groups of equal key; unbiased std; a group of one, or of equal
    values, gets 0."""
    values = np.asarray(values, dtype=np.float64)
    out = np.zeros_like(values)
    groups = defaultdict(list)
    for i, k in enumerate(keys):
        groups[k].append(i)
    for idx in groups.values():
        if len(idx) < 2:
            continue
        x = values[idx]
        sd = x.std(ddof=1)
        if sd > 0:  # equal values give 0 (also when eps = 0)
            out[idx] = (x - x.mean()) / (sd + eps)
    return out


def _split(flat, lengths):
    return np.split(np.asarray(flat, dtype=np.float64), np.cumsum(lengths)[:-1]) if lengths else []


def graph_step_advantages(episodes, success, omega, r_succ=10.0, eps=1e-6, invalid=None, invalid_penalty=0.1,
                          node_of=None, return_stats=False, step_cost=1.0):
    """GraphGPO step advantages of one group (Eq. 4-6).

        R_t = r_succ * omega^(d(s_{t+1}) + c) - invalid_penalty * invalid_t,   c = step_cost (paper: 1)
        A_t = (R_t - mean_{G(s_t)} R) / (std_{G(s_t)} R + eps),  G(s) = all steps whose source key is s

    episodes[m] = [s_1, ..., s_{T+1}]; a successful trajectory's last state becomes the goal node; step
    groups use the exact keys, node_of ({key: node}, fuzzy matching) the graph nodes only (docs/graphgpo.md,
    "Equations"). Returns one float64 array of length T per trajectory (and graph statistics with
    `return_stats`).
    """
    if len(episodes) != len(success):
        raise ValueError(f"{len(episodes)} episodes but {len(success)} success flags")
    node = (lambda k: k) if node_of is None else (lambda k: node_of.get(k, k))
    transitions, steps, lengths = [], [], []
    for m, states in enumerate(episodes):
        states = list(states)
        T = len(states) - 1
        if T < 0:
            raise ValueError(f"episode {m} has no state")
        nodes = [node(s) for s in states]
        if success[m]:
            nodes[-1] = GOAL
        lengths.append(T)
        for t in range(T):
            transitions.append((nodes[t], nodes[t + 1]))
            steps.append((states[t], nodes[t + 1], bool(invalid[m][t]) if invalid is not None else False))
    dist = graph_distances(transitions, GOAL)
    R = [r_succ * omega ** (dist[nxt] + step_cost) - invalid_penalty * inv for _, nxt, inv in steps]
    keys = [s for s, _, _ in steps]
    adv = _split(_normalise_in_groups(R, keys, eps), lengths)
    if not return_stats:
        return adv
    counts = Counter(keys)
    stats = {
        "nodes": len(dist),
        "edges": len(set(transitions)),
        "has_goal": GOAL in dist,
        "mean_distance": float(np.mean([d for n, d in dist.items() if n is not GOAL])) if len(dist) > 1 else 0.0,
        "steps": len(keys),
        "singleton_steps": sum(1 for k in keys if counts[k] == 1),
        "step_reward_mean": float(np.mean(R)) if R else 0.0,
    }
    return adv, stats


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


def gigpo_step_advantages(episodes, step_rewards, gamma=0.95, eps=1e-6, invalid=None, invalid_penalty=0.1):
    """GiGPO anchor-state step advantages of one group.

        R_t = sum_{k >= t} gamma^(k - t) r_k - invalid_penalty * invalid_t
        A_t = (R_t - mean_{G(s_t)} R) / (std_{G(s_t)} R + eps),  G(s) = all steps whose source key is s

    episodes[m] = [s_1, ...] (s_1..s_T are the steps' source states); step_rewards[m] = [r_1, ..., r_T].
    Unbiased std; a group of one step gets 0. Returns one float64 array of length T per trajectory.
    """
    if len(episodes) != len(step_rewards):
        raise ValueError(f"{len(episodes)} episodes but {len(step_rewards)} reward lists")
    R, keys, lengths = [], [], []
    for m, (states, rewards) in enumerate(zip(episodes, step_rewards)):
        T = len(rewards)
        if len(states) < T:
            raise ValueError(f"episode {m}: {len(states)} states for {T} rewards")
        pen = [invalid_penalty * float(bool(invalid[m][t])) if invalid is not None else 0.0 for t in range(T)]
        R += list(discounted_returns(rewards, gamma) - pen)
        keys += states[:T]
        lengths.append(T)
    return _split(_normalise_in_groups(R, keys, eps), lengths)


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
            if sm.real_quick_ratio() >= threshold and sm.quick_ratio() >= threshold and sm.ratio() >= threshold:
                out[k] = r
                break
        else:
            reps.append((k, text))
            out[k] = k
    return out


def compute_advantages(episodes, args, omega):
    """Episodes in, training samples out: the advantage of every turn of one iteration, per group
    (A = beta_graph * A_step + beta_episode * A_episode; A_step by --step-advantage), and the credit
    statistics that are logged."""
    groups = defaultdict(list)
    for ep in episodes:
        groups[ep.group_id].append(ep)
    samples, st = [], defaultdict(list)
    graph_seconds = 0.0
    for g, grp in groups.items():
        states = [ep.states for ep in grp]
        success = [ep.success for ep in grp]
        invalid = [ep.invalid for ep in grp]
        # the graph is built in every mode (its statistics are logged); it drives A only for 'graph'
        t0 = time.perf_counter()
        node_of = None
        if args.state_match == "fuzzy":
            keys = list(dict.fromkeys(s for ep in grp for s in ep.states))
            node_of = fuzzy_node_map(keys, args.similarity_threshold)
        a_graph, gs = graph_step_advantages(states, success, omega, args.r_succ, args.adv_eps, invalid,
                                            args.invalid_penalty, node_of=node_of, return_stats=True,
                                            step_cost=args.step_cost)
        graph_seconds += time.perf_counter() - t0
        if args.step_advantage == "graph":
            a_step = a_graph
        elif args.step_advantage == "gigpo":
            rewards = [[0.0] * (ep.length - 1) + [args.r_succ * float(ep.success)] if ep.length else [] for ep in grp]
            a_step = gigpo_step_advantages(states, rewards, args.gamma, args.adv_eps, invalid, args.invalid_penalty)
        else:
            a_step = [np.zeros(ep.length) for ep in grp]
        returns = [args.r_succ * float(ep.success) - args.invalid_penalty * sum(ep.invalid) for ep in grp]
        a_ep = grpo_advantages(returns, args.adv_eps)
        for i, ep in enumerate(grp):
            for t in range(ep.length):
                adv = args.beta_graph * float(a_step[i][t]) + args.beta_episode * float(a_ep[i])
                samples.append({"prompt": ep.prompts[t], "completion": ep.completions[t], "adv": adv,
                                "traj": ep.traj_id, "group": g, "turn": t,
                                "a_step": float(a_step[i][t]), "a_episode": float(a_ep[i])})
        for k in ("nodes", "edges", "mean_distance", "step_reward_mean", "steps", "singleton_steps"):
            st[k].append(gs[k])
        st["group_success"].append(float(any(success)))
    a, a_s, a_e = (np.array([s[k] for s in samples]) if samples else np.zeros(1)
                   for k in ("adv", "a_step", "a_episode"))
    stats = {
        "credit/graph_nodes": float(np.mean(st["nodes"])),
        "credit/graph_edges": float(np.mean(st["edges"])),
        "credit/mean_distance": float(np.mean(st["mean_distance"])),
        "credit/graph_step_reward_mean": float(np.mean(st["step_reward_mean"])),
        "credit/singleton_frac": float(sum(st["singleton_steps"]) / max(sum(st["steps"]), 1)),
        "credit/group_success_frac": float(np.mean(st["group_success"])),
        "credit/adv_abs_mean": float(np.abs(a).mean()),
        "credit/adv_step_abs_mean": float(np.abs(a_s).mean()),
        "credit/adv_episode_abs_mean": float(np.abs(a_e).mean()),
        "credit/adv_nonzero_frac": float((np.abs(a) > 1e-8).mean()),
        "credit/graph_seconds": graph_seconds,
    }
    return samples, stats


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One trajectory: the samples of its turns and what the credit functions need."""

    traj_id: int
    group_id: int
    task_id: str
    prompts: list = field(default_factory=list)  # per turn: prompt token ids (as rendered at sampling)
    completions: list = field(default_factory=list)  # per turn: generated ids (EOS included if emitted)
    actions: list = field(default_factory=list)  # per turn: decoded text
    observations: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    states: list = field(default_factory=list)  # s_1 .. s_{T+1} (env.state_key())
    success: bool = False
    env_return: float = 0.0

    @property
    def length(self) -> int:
        return len(self.actions)


def render_prompt(tok, messages) -> str:
    """The sampling-time prompt: the chat template with the generation prompt, as text. Thinking off:
    a template that reads `enable_thinking` (Qwen3) opens the answer with an empty think block instead of
    spending the token budget on thoughts; templates without the variable ignore it."""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def encode(tok, text: str) -> list:
    return tok(text, add_special_tokens=False)["input_ids"]


def completion_text(tok, completion) -> str:
    """The text the env reads from a completion: "" (an invalid action in every env) when it has no EOS, i.e.
    it was cut at max_new_tokens (over-long or unfinished), else the decoded text without special tokens."""
    if not completion or completion[-1] != tok.eos_token_id:
        return ""
    return tok.decode(completion, skip_special_tokens=True)


@torch.no_grad()
def generate(model, tok, prompt_ids, temperature, max_new_tokens, greedy=False):
    """One batched generate (left padding, top_k=0, top_p=1, stop at EOS); temperature <= 0 is greedy.
    Returns completion id lists: each row up to and including its first EOS, or all `max_new_tokens`
    tokens when it has none (every one of them was sampled, even one that happens to be the pad id)."""
    if not prompt_ids:
        return []
    device = next(model.parameters()).device
    pad = tok.pad_token_id
    L, eos = max(len(p) for p in prompt_ids), tok.eos_token_id
    input_ids = torch.tensor([[pad] * (L - len(p)) + list(p) for p in prompt_ids], dtype=torch.long, device=device)
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompt_ids], dtype=torch.long, device=device)
    sample = not greedy and temperature > 0
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(input_ids=input_ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, eos_token_id=eos, **kw)
    return [row[: row.index(eos) + 1] if eos in row else row for row in out[:, L:].tolist()]


def rollout(model, tok, new_env, task_ids, group_ids, temperature, max_new_tokens, greedy=False):
    """Play one episode per task id, all envs stepped together: one batched generate per turn. Records every
    turn's prompt and completion token ids, s_1 = state_key() after reset and s_{t+1} after every step."""
    envs_, episodes = [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        env = new_env()
        env.reset(task)
        envs_.append(env)
        episodes.append(Episode(traj_id=i, group_id=int(g), task_id=str(task), states=[env.state_key()]))
    model.eval()
    while True:
        active = [i for i, e in enumerate(envs_) if not e.done]
        if not active:
            break
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        comps = generate(model, tok, prompts, temperature, max_new_tokens, greedy=greedy)
        for k, i in enumerate(active):
            ep = episodes[i]
            text = tok.decode(comps[k], skip_special_tokens=True)
            st = envs_[i].step(completion_text(tok, comps[k]))
            ep.prompts.append(prompts[k])
            ep.completions.append(comps[k])
            ep.actions.append(text)
            ep.observations.append(st.observation)
            ep.invalid.append(bool(st.info.get("invalid", False)))
            ep.states.append(envs_[i].state_key())
            ep.env_return += float(st.reward)
            if st.done:
                ep.success = bool(st.info.get("success", False))
    return episodes


# ----------------------------------------------------------------------------------------------
# 4. Log-probs and loss
# ----------------------------------------------------------------------------------------------
def completion_logprobs(model, tok, prompt_ids, completion_ids, temperature=1.0):
    """Per-token log-probs of the completions given the prompts (one left-padded forward, active adapter)
    under softmax(logits / temperature), the sampling distribution (docs/design.md, "Shared blocks").
    Returns (logp [B, C_max], mask [B, C_max]), completions right-aligned (an empty one is an all-zero row);
    only the last C_max + 1 positions' logits are computed, log p = z[token] - logsumexp(z)."""
    device = next(model.parameters()).device
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    seqs = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    L = max(len(s) for s in seqs)
    C = max(1, max(len(c) for c in completion_ids))
    input_ids = torch.tensor([[pad] * (L - len(s)) + s for s in seqs], dtype=torch.long, device=device)
    attn = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long, device=device)
    cmask = torch.tensor([[0.0] * (C - len(c)) + [1.0] * len(c) for c in completion_ids], device=device)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                   logits_to_keep=C + 1).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:  # temperature <= 0 (greedy sampling) scores the raw logits
        logits = logits / temperature
    targets = input_ids[:, L - C:]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return logp * cmask, cmask


def _padded(samples, key, C, device):
    """Right-aligned [B, C] tensor of the per-token vectors samples[j][key], zeros on the left."""
    return torch.stack([F.pad(x[key].to(device), (C - len(x[key]), 0)) for x in samples])


@torch.no_grad()
def token_logprobs(model, tok, samples, adapter, micro_batch_size, temperature=1.0):
    """Per-sample token log-prob vectors under the policy (adapter "default") or, with adapter None, under
    the reference policy (the adapter disabled: the base model), at the sampling temperature, eval mode, no
    gradient."""
    model.eval()
    out = []
    for s in range(0, len(samples), micro_batch_size):
        chunk = samples[s:s + micro_batch_size]
        with model.disable_adapter() if adapter is None else contextlib.nullcontext():
            lp, _ = completion_logprobs(model, tok, [x["prompt"] for x in chunk], [x["completion"] for x in chunk],
                                        temperature=temperature)
        out += [lp[j, lp.shape[1] - len(x["completion"]):].float().cpu() for j, x in enumerate(chunk)]
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
    """One pass over the turns in `num_minibatches` optimizer steps of the policy, token-mean within each.
    samples: dicts with prompt, completion and adv (one per turn); π_θold's and the reference policy's
    token log-probs are taken here."""
    device = next(model.parameters()).device
    for x, o in zip(samples, token_logprobs(model, tok, samples, "default", args.micro_batch_size, args.temperature)):
        x["old"] = o
    if args.kl_coef:
        for x, r in zip(samples, token_logprobs(model, tok, samples, None, args.micro_batch_size, args.temperature)):
            x["ref"] = r
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "loss", "kl_ref", "approx_kl", "clip_frac", "grad_norm")}
    for mb_idx in np.array_split(rng.permutation(len(samples)), max(1, args.num_minibatches)):
        mb = [samples[i] for i in mb_idx]
        if not mb:
            continue
        ntok = sum(len(x["completion"]) for x in mb)
        optimizer.zero_grad(set_to_none=True)
        acc = dict.fromkeys(stats, 0.0)
        for s in range(0, len(mb), args.micro_batch_size):
            chunk = mb[s:s + args.micro_batch_size]
            lp, m = completion_logprobs(model, tok, [x["prompt"] for x in chunk], [x["completion"] for x in chunk],
                                        temperature=args.temperature)
            old = _padded(chunk, "old", lp.shape[1], device)
            ref = _padded(chunk, "ref", lp.shape[1], device) if args.kl_coef else old
            adv = m * torch.tensor([float(x["adv"]) for x in chunk], device=device)[:, None]
            loss, pg, kl, cf = policy_loss(lp, old, ref, adv, m, args.clip_eps, args.dual_clip, args.kl_coef)
            w = float(m.sum()) / max(ntok, 1)  # token-mean over the whole minibatch
            (loss * w).backward()
            for name, v in (("loss", loss.item()), ("policy_loss", pg), ("kl_ref", kl), ("clip_frac", cf)):
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
# 5. Evaluation, logging and checkpoints
# ----------------------------------------------------------------------------------------------
def episode_record(ep, tag):
    return {"tag": tag, "task_id": ep.task_id, "success": ep.success, "return": ep.env_return,
            "turns": [{"action": a, "observation": o, "invalid": inv}
                      for a, o, inv in zip(ep.actions, ep.observations, ep.invalid)]}


def evaluate(model, tok, new_env, tasks, args, max_new_tokens):
    """Sampled (eval_k per test task, at the training temperature and at the paper's validation temperature
    0.4: eval/success_val_temp) and greedy episodes on the test tasks."""
    tasks_k = [t for t in tasks for _ in range(args.eval_k)]
    episodes = rollout(model, tok, new_env, tasks_k, [0] * len(tasks_k), args.temperature, max_new_tokens)
    val = rollout(model, tok, new_env, tasks_k, [0] * len(tasks_k), args.eval_temperature, max_new_tokens)
    greedy = rollout(model, tok, new_env, tasks, [0] * len(tasks), 1.0, max_new_tokens, greedy=True)
    out, n_turns = {}, sum(ep.length for ep in episodes)
    out["eval/success"], out["eval/success_se"] = mean_se([ep.success for ep in episodes])
    out["eval/success_greedy"], out["eval/success_greedy_se"] = mean_se([ep.success for ep in greedy])
    out["eval/success_val_temp"], out["eval/success_val_temp_se"] = mean_se([ep.success for ep in val])
    out["eval/return"] = float(np.mean([ep.env_return for ep in episodes]))
    out["eval/return_greedy"] = float(np.mean([ep.env_return for ep in greedy]))
    out["eval/episode_length"] = float(np.mean([ep.length for ep in episodes]))
    out["eval/invalid_rate"] = float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1))
    records = [episode_record(ep, "sampled") for ep in episodes[: args.num_logged_episodes]]
    records += [episode_record(ep, "greedy") for ep in greedy[: max(1, args.num_logged_episodes // 2)]]
    return out, records


def iteration_row(episodes, samples, ustats, cstats, seconds):
    """The metrics of one iteration: training rollouts, losses, credit statistics and seconds per phase."""
    n_turns = sum(ep.length for ep in episodes)
    row = {
        "charts/success": float(np.mean([ep.success for ep in episodes])),
        "charts/return": float(np.mean([ep.env_return for ep in episodes])),
        "charts/episode_length": float(np.mean([ep.length for ep in episodes])),
        "charts/invalid_rate": float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1)),
        **{f"losses/{k}": v for k, v in ustats.items()},
        **cstats,
        **{f"perf/{k}_seconds": v for k, v in seconds.items()},
        "perf/tokens_per_second": sum(len(x["completion"]) for x in samples) / max(seconds["rollout"], 1e-9),
        "perf/samples": len(samples),
    }
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def start_run(args, resolved):
    """The run directory, its config.json (every Args field, the values resolved at run time), its Logger."""
    run_dir = Path(args.output_dir) / f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"run dir: {run_dir}")
    (run_dir / "config.json").write_text(json.dumps({**asdict(args), **resolved}, indent=2))
    return run_dir, Logger(run_dir, args.track)


def eval_line(ev):
    """An evaluation row as one printed line (its numbers, without the per-opponent breakdown)."""
    return ", ".join(f"{k}={v:.3f}" for k, v in ev.items() if isinstance(v, float) and "/vs_" not in k)


def write_summary(run_dir, args, wall_seconds, first_eval, last_eval, eval_metric, **extra):
    """summary.json (the first and last evaluation, `extra`, the learning block), printed as well."""
    summary = {"run_dir": str(run_dir), "iterations": args.num_iterations, "wall_seconds": wall_seconds,
               "first_eval": first_eval, "last_eval": last_eval, **extra,
               "learning": learning_summary(first_eval, last_eval, eval_metric)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print("summary: " + json.dumps({k: v for k, v in summary.items() if not isinstance(v, (dict, list))}))
    for name, ev in (("first", first_eval), ("last", last_eval)):
        print(f"{name} eval: " + eval_line(ev))
    print_learning(summary["learning"])
    return summary


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for fewer than two values) of per-episode values.
    For success flags this is the success rate p and about sqrt(p (1 - p) / n)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return 0.0, 0.0
    return float(x.mean()), (float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0)


def learning_summary(first, last, metric):
    """The run's main evaluation metric before and after training, the change and its standard error
    (the two evaluations' SEs in quadrature); `rose` / `fell`: the change is above +2 SE / below -2 SE."""
    before, after = float(first[metric]), float(last[metric])
    se0, se1 = float(first.get(metric + "_se", 0.0)), float(last.get(metric + "_se", 0.0))
    change, se = after - before, math.sqrt(se0 ** 2 + se1 ** 2)
    return {"metric": metric, "before": before, "before_se": se0, "after": after, "after_se": se1,
            "change": change, "change_se": se, "rose": bool(change > 2.0 * se), "fell": bool(change < -2.0 * se)}


def print_learning(s):
    print(f"{s['metric']}: {s['before']:.3f} ± {s['before_se']:.3f} before training, {s['after']:.3f} ± "
          f"{s['after_se']:.3f} after ({s['change']:+.3f} ± {s['change_se']:.3f})")
    if s["fell"]:
        print(f"WARNING: {s['metric']} fell by more than two standard errors ({s['change']:+.3f} ± "
              f"{s['change_se']:.3f}): this run made the policy worse")


class Logger:
    """metrics.jsonl (one row per iteration; NaN and inf are written as null, so every line is valid JSON),
    samples.jsonl (decoded episodes) and, with --track, TensorBoard scalars."""

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
        row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
        self.f.write(json.dumps({"iteration": it, **row}) + "\n")
        self.f.flush()
        if self.tb:
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, it)

    def log_samples(self, it: int, records: list):
        for r in records:
            self.samples.write(json.dumps({"iteration": it, **r}, default=str) + "\n")
        self.samples.flush()


def save_adapter(model, run_dir: Path):
    model.save_pretrained(str(run_dir / "adapter"))


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def make_env(args):
    """The env factory `new_env` (user errors -> UserError), one probe instance, the policy's model-dependent
    defaults (`policy_defaults`) and the env options."""
    import envs
    from common.models import UserError, policy_defaults

    if args.env_id not in envs.available():
        raise UserError(f"env {args.env_id!r} is not available in this checkout; available env ids: "
                        f"{', '.join(envs.available()) or 'none'}")
    if args.env_id in envs.TWO_PLAYER:
        raise UserError(f"env {args.env_id!r} is a two-player game; GraphGPO needs a single-agent env such as sokoban")
    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    defaults = policy_defaults(args.model_name, args.env_id, args.tiny_preset, learning_rate=1e-5, max_new_tokens=512)
    kw = dict(defaults.env_kwargs)
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
    return new_env, probe, defaults, kw


def check_args(args):
    """User errors in the arguments -> UserError; returns omega (--omega, or the env's default)."""
    from common.models import UserError

    if args.group_size < 2:
        raise UserError("--group-size must be >= 2 (advantages compare the trajectories of a task)")
    if args.tasks_per_iteration < 1 or args.num_iterations < 0 or args.micro_batch_size < 1 or args.eval_k < 1:
        raise UserError("--tasks-per-iteration, --micro-batch-size and --eval-k must be >= 1, --num-iterations >= 0")
    if args.history is not None and args.history < 0:
        raise UserError(f"--history must be >= 0 (or None), got {args.history}")
    omega = args.omega if args.omega is not None else OMEGA_BY_ENV.get(args.env_id, 0.5)
    if not 0.0 < omega < 1.0:
        raise UserError(f"--omega must lie in (0, 1), got {omega}")
    if not 0.0 < args.similarity_threshold <= 1.0:
        raise UserError(f"--similarity-threshold must lie in (0, 1], got {args.similarity_threshold}")
    return omega


def seed_everything(seed):
    """Seeds python, numpy and torch; returns the numpy generator that draws the run's tasks and batches."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def main(args: Args):
    from common.models import load_policy

    t_start = time.time()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    omega = check_args(args)
    rng = seed_everything(args.seed)

    new_env, probe, defaults, env_kwargs = make_env(args)
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them
    lr = args.learning_rate if args.learning_rate is not None else defaults.learning_rate
    max_new = args.max_new_tokens or defaults.max_new_tokens

    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout, activation_checkpointing=args.activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)

    run_dir, logger = start_run(args, {"resolved_learning_rate": lr, "resolved_omega": omega,
                                       "resolved_max_new_tokens": max_new, "max_turns_resolved": probe.max_turns,
                                       "env_kwargs": env_kwargs, "num_train_tasks": len(train_tasks),
                                       "num_test_tasks": len(test_tasks)})

    def run_eval(it):
        t0 = time.time()
        row, records = evaluate(model, tok, new_env, test_tasks, args, max_new)
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, records)
        return row

    first_eval = run_eval(0)
    logger.log(0, first_eval)
    last_eval = first_eval
    print("eval before training: " + eval_line(first_eval))

    G = args.group_size
    bar = tqdm(range(1, args.num_iterations + 1), desc=f"graphgpo[{args.step_advantage}]", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(G)]
        groups = [g for g in range(len(chosen)) for _ in range(G)]
        episodes = rollout(model, tok, new_env, tasks, groups, args.temperature, max_new)
        seconds = {"rollout": time.time() - t0}

        t1 = time.time()
        samples, cstats = compute_advantages(episodes, args, omega)
        seconds["credit"] = time.time() - t1

        t2 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)
        seconds["update"] = time.time() - t2
        seconds["iteration"] = time.time() - t0
        cstats["credit/graph_time_frac"] = cstats["credit/graph_seconds"] / max(seconds["iteration"], 1e-9)

        row = iteration_row(episodes, samples, ustats, cstats, seconds)
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.save_model and args.checkpoint_every and it % args.checkpoint_every == 0:
            save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}", reward=f"{row['charts/return']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}")
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval, "eval/success",
                         step_advantage=args.step_advantage)


if __name__ == "__main__":
    args = tyro.cli(Args)
    from common.models import UserError

    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
