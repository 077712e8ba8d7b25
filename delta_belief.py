"""ΔBelief-RL: the agent's own belief change as a dense turn-level reward, trained with turn-wise GRPO.

Paper: "Intrinsic Credit Assignment for Long Horizon Interaction" (ΔBelief-RL; the trained agent is CIA),
Auzina, Strüber, Hernández-Gutiérrez, Goel, Prabhu, Bethge; https://bethgelab.github.io/delta-belief-rl ;
official code: https://github.com/bethgelab/delta-belief-rl

Method (docs/delta_belief.md, "Overview"). The questioner of Twenty Questions, rewarded only when it names
the secret, gets its *own* belief as a dense signal: after every turn t, b_t = log p_θ(target | history_t,
"Is it '<target>'?"), and the turn earns λ·max(b_t - b_{t-1}, 0) on top of outcome and penalties.
Advantages are normalised per turn across the G games of a target (turn-wise GRPO); clipped policy
gradient with DAPO's asymmetric clip (0.2 / 0.28), no KL, token-mean. The baseline StarPO
(``--reward-mode starpo``) is trajectory-level GRPO on the summed reward, no belief term.

Equations -> functions
- Eq. 1  ΔBelief_t = log b_t - log b_{t-1}                               -> `turn_rewards` (delta)
- Eq. 3  r_t = r_eog + λ max(ΔBelief_t, 0) + r_p                        -> `turn_rewards`
- Eq. 4  Â_t^i = (r_t^i - mean_i r_t) / std_i r_t   (per turn column)     -> `turnwise_advantages`
- StarPO R^i = Σ_t r_t^i, Â^i = (R^i - mean R) / std R                    -> `starpo_turn_rewards`,
                                                                            `trajectory_advantages`
- belief elicitation b_t                                                  -> `elicit_beliefs`
- Eq. 2  best-of-n ΔBelief sampling (Fig. 3, evaluation only)            -> `rollout(best_of_n=n)`
- clipped PG with ε_low / ε_high, dual clip, token-mean                   -> `policy_loss`

Deviations from the paper and from the official code: docs/delta_belief.md, "Deviations".

Example
    python delta_belief.py --env-id twenty_questions --reward-mode delta --lam 0.1 --seed 1
    python delta_belief.py --model-name Qwen/Qwen3-1.7B --learning-rate 3e-5 --tasks-per-iteration 15
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import sys
import time
from collections import Counter, defaultdict
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
    checkpoint_every: int = 50
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
    lora_r: int = 64
    """LoRA rank (paper: 64)"""
    lora_alpha: int = 64
    """LoRA alpha (paper: 64)"""
    lora_dropout: float = 0.0
    """LoRA dropout"""
    activation_checkpointing: bool = False
    """activation checkpointing in the training forward (saves GPU memory on real models)"""
    max_new_tokens: Optional[int] = None
    """most tokens generated per turn; None: 50 (official) for a real model, 24 for the tiny policy"""
    temperature: Optional[float] = None
    """sampling temperature of the rollouts; None: 1.0 (paper), the tiny policy's RL temperature (20Q: 1.5)"""
    eval_temperature: Optional[float] = None
    """sampling temperature of the sampled evaluation (greedy is evaluated as well); None: --temperature's"""

    # environment
    env_id: str = "twenty_questions"
    """training env (needs `env.target`, the hidden answer)"""
    history: Optional[int] = None
    """past (question, answer) pairs shown in the prompt; None: the env's default"""
    max_turns: int = 20
    """most questions per game in training (paper: 20)"""
    eval_env_id: str = ""
    """extra out-of-distribution evaluation env, e.g. guess_my_city ('' : none)"""
    eval_max_turns: int = 0
    """question budget at evaluation (0: max_turns; the paper's interaction scaling uses 50)"""
    eval_num_tasks: int = 0
    """test targets per evaluation (0: all test targets of the env)"""
    eval_k: int = 5
    """sampled games per test target (success = mean over them, pass@k = any of them)"""
    eval_every: int = 16
    """evaluate every this many iterations (and before training and at the end)"""
    eval_best_of_n: int = 0
    """if > 0: also evaluate ΔBelief best-of-n sampling (Fig. 3) before and after training"""
    num_logged_episodes: int = 4
    """decoded evaluation games written to samples.jsonl per evaluation"""

    # algorithm
    reward_mode: Literal["delta", "starpo"] = "delta"
    """'delta': ΔBelief turn rewards + turn-wise GRPO; 'starpo': trajectory-level GRPO (baseline)"""
    num_iterations: int = 32
    """training iterations (rollout + update)"""
    tasks_per_iteration: int = 4
    """distinct secrets per iteration (official: 240 on GPUs)"""
    group_size: int = 8
    """G: games per secret, the GRPO group (paper: 16; 8 here so that an iteration covers 4 secrets)"""
    learning_rate: Optional[float] = None
    """AdamW learning rate; None: 3e-5 (paper) for a real model, 5e-4 for the tiny policy (docs/delta_belief.md)"""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (official)"""
    weight_decay: float = 0.01
    """AdamW weight decay (official)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    num_minibatches: int = 2
    """optimizer steps per iteration (the turns are split into this many minibatches; official: 3)"""
    micro_batch_size: int = 64
    """turns per forward pass (gradient accumulation inside a minibatch)"""
    lam: float = 0.1
    """λ, weight of the clipped belief gain (paper: 0.1; 0 removes the belief term only)"""
    win_reward: float = 2.0
    """end-of-game reward for naming the secret"""
    turn_penalty: float = 0.05
    """end-of-game penalty per question asked"""
    invalid_penalty: float = 5.0
    """penalty of a turn that is not a valid yes/no question"""
    repeat_penalty: float = 1.0
    """penalty of a turn that repeats an earlier question"""
    belief_template: str = "auto"
    """elicitation message with {target}; auto: "Is it '{target}'?" (official), the env's own guess on a tiny policy"""
    clip_low: float = 0.2
    """ε_low of the clipped ratio"""
    clip_high: float = 0.28
    """ε_high of the clipped ratio (DAPO asymmetric clipping)"""
    dual_clip: float = 3.0
    """dual-clip constant c for negative advantages (verl default; 0 disables)"""
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-mean"] = "auto"
    """loss aggregation; auto: token-mean for delta, seq-mean-token-mean (per game) for starpo (official)"""
    adv_eps: float = 1e-6
    """ε in (r - mean) / (std + ε)"""


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
def turn_rewards(log_beliefs, won, invalid, repeated, lam=0.1, win_reward=2.0, turn_penalty=0.05,
                 invalid_penalty=5.0, repeat_penalty=1.0):
    """Per-turn ΔBelief-RL rewards of one game of T turns (Eq. 1 and 3, official scales).

        delta_t = b_t - b_{t-1}                       (t = 1..T; the turn that wins the game: delta_T = 0)
        eog     = win_reward * won - turn_penalty * T (added to every turn)
        r_t     = eog + lam * max(delta_t, 0) - invalid_penalty * invalid_t - repeat_penalty * repeated_t

    log_beliefs: [b_0, ..., b_T] (length T+1; when `won`, b_T is ignored and may be NaN).
    invalid, repeated: length-T bools. Returns a float64 array of length T.
    """
    b = np.asarray(log_beliefs, dtype=np.float64)
    inv = np.asarray(invalid, dtype=bool)
    rep = np.asarray(repeated, dtype=bool)
    T = len(inv)
    if b.shape != (T + 1,) or rep.shape != (T,):
        raise ValueError(f"need T+1 beliefs and T flags, got {b.shape}, {inv.shape}, {rep.shape}")
    delta = np.diff(b) if T else np.zeros(0)
    if won and T:
        delta[-1] = 0.0  # the finishing turn gets no belief reward
    delta = np.nan_to_num(delta, nan=0.0)
    eog = win_reward * float(bool(won)) - turn_penalty * T
    return eog + lam * np.maximum(delta, 0.0) - invalid_penalty * inv - repeat_penalty * rep


def turnwise_advantages(rewards, lengths, eps=1e-6):
    """Turn-wise GRPO (Eq. 4) over the G games of one target.

        A[i, t] = (r[i, t] - mean_{j: len_j > t} r[j, t]) / (std_{j: len_j > t} r[j, t] + eps)

    rewards: [G, T_max] (entries past a game's end are ignored); lengths: [G]. The statistics of turn t
    use only the games still playing at turn t; std is unbiased (ddof=1); a turn with a single active
    game gives 0; entries past a game's end are 0.
    """
    r = np.asarray(rewards, dtype=np.float64)
    lengths = np.asarray(lengths)
    G, T_max = r.shape
    adv = np.zeros_like(r)
    for t in range(T_max):
        active = lengths > t
        n = int(active.sum())
        if n < 2:
            continue
        col = r[active, t]
        adv[active, t] = (col - col.mean()) / (col.std(ddof=1) + eps)
    return adv


def starpo_turn_rewards(won, invalid, repeated, win_reward=2.0, turn_penalty=0.05, invalid_penalty=5.0,
                        repeat_penalty=1.0):
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
    """Trajectory-level GRPO (StarPO): A^i = (R^i - mean R) / (std R + eps), unbiased std; G = 1 -> 0."""
    R = np.asarray(returns, dtype=np.float64)
    if R.size < 2:
        return np.zeros_like(R)
    return (R - R.mean()) / (R.std(ddof=1) + eps)


def compute_advantages(episodes, args):
    """Episodes in (group_id = the secret's index), training samples out: the turn rewards of every game
    (ΔBelief: `turn_rewards`; StarPO: `starpo_turn_rewards`) and their advantages within each group
    (`turnwise_advantages`; StarPO: `trajectory_advantages` of the summed rewards on every turn), and the
    credit statistics that are logged."""
    groups = defaultdict(list)
    for ep in episodes:
        groups[ep.group_id].append(ep)
    samples, all_r, deltas = [], [], []
    for g, grp in groups.items():
        lengths = np.array([ep.length for ep in grp])
        T_max = int(lengths.max())
        R = np.zeros((len(grp), T_max))
        for i, ep in enumerate(grp):
            if args.reward_mode == "delta":
                R[i, : ep.length] = turn_rewards(ep.beliefs, ep.success, ep.invalid, ep.repeated, args.lam,
                                                 args.win_reward, args.turn_penalty, args.invalid_penalty,
                                                 args.repeat_penalty)
                d = np.diff(np.asarray(ep.beliefs, dtype=np.float64))
                deltas += [float(x) for x in (d[:-1] if ep.success else d) if np.isfinite(x)]
            else:
                R[i, : ep.length] = starpo_turn_rewards(ep.success, ep.invalid, ep.repeated, args.win_reward,
                                                        args.turn_penalty, args.invalid_penalty, args.repeat_penalty)
            all_r += list(R[i, : ep.length])
        if args.reward_mode == "delta":
            A = turnwise_advantages(R, lengths, args.adv_eps)
        else:
            A = np.repeat(trajectory_advantages(R.sum(1), args.adv_eps)[:, None], T_max, axis=1)
        for i, ep in enumerate(grp):
            for t in range(ep.length):
                samples.append({"prompt": ep.prompts[t], "completion": ep.completions[t], "adv": float(A[i, t]),
                                "traj": ep.traj_id, "group": g, "turn": t})
    a = np.array([s["adv"] for s in samples])
    stats = {
        "charts/turn_reward_mean": float(np.mean(all_r)) if all_r else 0.0,
        "credit/adv_abs_mean": float(np.abs(a).mean()) if len(a) else 0.0,
        "credit/adv_nonzero_frac": float((np.abs(a) > 1e-8).mean()) if len(a) else 0.0,
    }
    if args.reward_mode == "delta":
        stats["credit/delta_belief_mean"] = float(np.mean(deltas)) if deltas else 0.0
        stats["credit/delta_belief_pos_frac"] = float(np.mean([d > 0 for d in deltas])) if deltas else 0.0
        stats["credit/belief_b0_mean"] = float(np.mean([ep.beliefs[0] for ep in episodes]))
        stats["credit/belief_gain_reward_mean"] = float(args.lam * np.mean(np.maximum(deltas, 0))) if deltas else 0.0
    return samples, stats


# ----------------------------------------------------------------------------------------------
# 3. Rollout
# ----------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One game: the samples of its turns and what the credit functions need."""

    traj_id: int
    group_id: int
    task_id: str
    target: str
    prompts: list = field(default_factory=list)  # per turn: prompt token ids (as rendered at sampling)
    completions: list = field(default_factory=list)  # per turn: generated ids (EOS included if emitted)
    actions: list = field(default_factory=list)  # per turn: decoded text
    observations: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    repeated: list = field(default_factory=list)
    beliefs: list = field(default_factory=list)  # b_0..b_T (b_T = nan after a winning turn)
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


def locate_target(tok, message: str, target: str):
    """Token ids of the elicitation `message` (tokenised on its own, cut after the target) and a 0/1 mask
    marking the target's tokens: those whose character span overlaps the target, so a BPE merge such as
    `'cat` still counts (docs/delta_belief.md, "Implementation details" 2).
    """
    start = message.rfind(target)  # the last occurrence: the target ends the message
    if not target or start < 0:
        raise ValueError(f"target {target!r} not in elicitation message {message!r}")
    end = start + len(target)
    try:
        enc = tok(message, add_special_tokens=False, return_offsets_mapping=True)
        ids, spans = list(enc["input_ids"]), [tuple(s) for s in enc["offset_mapping"]]
    except (NotImplementedError, TypeError, ValueError, KeyError):
        ids = encode(tok, message)
        spans, prev = [], 0
        for i in range(len(ids)):
            n = len(tok.decode(ids[: i + 1]))
            spans.append((prev, n))
            prev = n
    mask = [1 if (s < end and e > start and e > s) else 0 for s, e in spans]
    if not any(mask):
        raise ValueError(f"no token of {message!r} covers the target {target!r}")
    last = max(i for i, m in enumerate(mask) if m)
    return ids[: last + 1], mask[: last + 1]


@torch.no_grad()
def elicit_beliefs(model, tok, messages_list, targets, template="Is it '{target}'?", micro_batch_size=64):
    """b = Σ log p(target tokens | chat, "Is it '") for each (messages, target); no gradient. The chat is
    rendered as at sampling time, the message is the next assistant turn (docs/delta_belief.md,
    "Implementation details" 1)."""
    if not messages_list:
        return np.zeros(0)
    prompts, comps, masks = [], [], []
    for msgs, target in zip(messages_list, targets):
        message = template(target) if callable(template) else template.format(target=target)
        ids, mask = locate_target(tok, message, target)
        prompts.append(encode(tok, render_prompt(tok, msgs)))
        comps.append(ids)
        masks.append(mask)
    was_training = model.training
    model.eval()
    out = []
    for s in range(0, len(prompts), micro_batch_size):
        lp, cmask = completion_logprobs(model, tok, prompts[s:s + micro_batch_size], comps[s:s + micro_batch_size])
        for j, m in enumerate(masks[s:s + micro_batch_size]):
            c = len(m)
            row = lp[j, lp.shape[1] - c:]  # completions are right-aligned
            out.append(float((row * torch.tensor(m, dtype=row.dtype, device=row.device)).sum()))
    model.train(was_training)
    return np.asarray(out, dtype=np.float64)


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


def belief_message_for(template, env, is_tiny):
    """The elicitation message: a template with {target}, or (template "auto") the official
    "Is it '{target}'?", except for a tiny policy on an env with guesses (`env.guess_text`): then the
    env's canonical guess ("Is it a cat?"), the only guess form a tiny policy has ever seen."""
    if template != "auto":
        return template
    if is_tiny and env.guess_text(env.task_ids("test")[0]) is not None:
        return env.guess_text
    return "Is it '{target}'?"


def rollout(model, tok, new_env, task_ids, group_ids, args, temperature, belief_message, greedy=False,
            best_of_n=0, max_turns=None, with_beliefs=True, belief_games=None):
    """Play one game per task id, all envs stepped together: one batched generate per turn. With `best_of_n`
    > 0 (evaluation, Fig. 3) the question with the largest belief gain of n is kept (docs/delta_belief.md,
    "Implementation details" 11). `belief_games` (indices into task_ids; None: all) limits the belief
    elicitation of `with_beliefs` to those games; it is a forward pass without sampling, so the games
    played are the same either way.
    """
    envs_, episodes = [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        env = new_env()
        if max_turns:
            env.max_turns = max_turns
        env.reset(task)
        envs_.append(env)
        episodes.append(Episode(traj_id=i, group_id=g, task_id=str(task), target=str(getattr(env, "target", ""))))
    model.eval()
    tmpl, mb = belief_message, args.micro_batch_size
    scored = set(range(len(envs_)) if belief_games is None or best_of_n else belief_games)
    if with_beliefs or best_of_n:
        first = sorted(scored)
        b0 = elicit_beliefs(model, tok, [envs_[i].messages() for i in first], [episodes[i].target for i in first],
                            tmpl, mb)
        for i, b in zip(first, b0):
            episodes[i].beliefs.append(float(b))
    while True:
        active = [i for i, e in enumerate(envs_) if not e.done]
        if not active:
            break
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        n = max(1, best_of_n)
        comps = generate(model, tok, [p for p in prompts for _ in range(n)], temperature, args.max_new_tokens,
                         greedy=greedy and n == 1)
        if n > 1:  # ΔBelief best-of-n: simulate every candidate on a copy of the env
            copies, steps = [], []
            for k, i in enumerate(active):
                for j in range(n):
                    c = copy.deepcopy(envs_[i])
                    steps.append(c.step(completion_text(tok, comps[k * n + j])))
                    copies.append(c)
            need = [q for q, st in enumerate(steps) if not st.info["success"]]
            bs = np.full(len(copies), np.inf)
            bs[need] = elicit_beliefs(model, tok, [copies[q].messages() for q in need],
                                      [episodes[active[q // n]].target for q in need], tmpl, mb)
            chosen = []
            for k, i in enumerate(active):
                gains = bs[k * n:(k + 1) * n] - episodes[i].beliefs[-1]
                j = int(np.argmax(gains))
                envs_[i] = copies[k * n + j]
                chosen.append((comps[k * n + j], steps[k * n + j], bs[k * n + j]))
        else:
            chosen = [(comps[k], envs_[i].step(completion_text(tok, comps[k])), None)
                      for k, i in enumerate(active)]
        for k, i in enumerate(active):
            ep = episodes[i]
            comp, st, b = chosen[k]
            ep.prompts.append(prompts[k])
            ep.completions.append(comp)
            ep.actions.append(tok.decode(comp, skip_special_tokens=True))
            ep.observations.append(st.observation)
            ep.invalid.append(bool(st.info.get("invalid", False)))
            ep.repeated.append(bool(st.info.get("repeated", False)))
            ep.env_return += float(st.reward)
            if st.done:
                ep.success = bool(st.info.get("success", False))
            if b is not None:
                ep.beliefs.append(float(b) if np.isfinite(b) else float("nan"))
        if with_beliefs and best_of_n <= 1:
            need = [i for i in active if not episodes[i].success and i in scored]
            bs = elicit_beliefs(model, tok, [envs_[i].messages() for i in need], [episodes[i].target for i in need],
                               tmpl, mb)
            got = dict(zip(need, bs))
            for i in active:
                if i in scored:
                    episodes[i].beliefs.append(float(got[i]) if i in got else float("nan"))
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


def policy_loss(logp, old_logp, adv, weights, clip_low, clip_high, dual_clip):
    """Clipped policy gradient with asymmetric clip and dual clip; `weights` carry the aggregation.

        ratio = exp(logp - old); l = -min(ratio A, clip(ratio, 1 - ε_low, 1 + ε_high) A)
        for A < 0: l = min(l, -c A)   (dual clip);   loss = Σ weights * l
    """
    ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(l1, l2)
    if dual_clip and dual_clip > 1.0:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * dual_clip), loss_tok)
    clipped = (l2 > l1).float()
    return (loss_tok * weights).sum(), clipped, ratio


def minibatches(trajs, n, rng, whole_games):
    """Split sample indices into n shuffled minibatches; trajs[i] is sample i's game id. With `whole_games`
    the games are shuffled and split, so every turn of a game lands in one minibatch (the official code's
    grouping: under seq-mean-token-mean a game split over two minibatches would weigh about twice)."""
    n = max(1, n)
    if not whole_games:
        return [list(b) for b in np.array_split(rng.permutation(len(trajs)), n)]
    games = list(dict.fromkeys(trajs))
    members = {g: [] for g in games}
    for i, g in enumerate(trajs):
        members[g].append(i)
    order = [games[k] for k in rng.permutation(len(games))]
    return [[i for g in part for i in members[g]] for part in np.array_split(np.array(order, dtype=object), n)]


def update(model, tok, optimizer, samples, args, rng):
    """One pass over the turns in `num_minibatches` optimizer steps of the policy. samples: dicts with
    prompt, completion, adv and traj (global game id); π_θold's token log-probs are taken here."""
    device = next(model.parameters()).device
    agg = args.loss_agg if args.loss_agg != "auto" else (
        "token-mean" if args.reward_mode == "delta" else "seq-mean-token-mean")
    for x, o in zip(samples, token_logprobs(model, tok, samples, "default", args.micro_batch_size, args.temperature)):
        x["old"] = o
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "approx_kl", "clip_frac", "grad_norm")}
    for mb_idx in minibatches([x["traj"] for x in samples], args.num_minibatches, rng,
                              whole_games=agg == "seq-mean-token-mean"):
        mb = [samples[i] for i in mb_idx]
        if not mb:
            continue
        ntok = sum(len(x["completion"]) for x in mb)
        traj_tok = Counter()  # tokens per game in this minibatch (seq-mean-token-mean)
        for x in mb:
            traj_tok[x["traj"]] += len(x["completion"])
        optimizer.zero_grad(set_to_none=True)
        acc = dict.fromkeys(stats, 0.0)
        for s in range(0, len(mb), args.micro_batch_size):
            chunk = mb[s:s + args.micro_batch_size]
            lp, m = completion_logprobs(model, tok, [x["prompt"] for x in chunk], [x["completion"] for x in chunk],
                                        temperature=args.temperature)
            old = _padded(chunk, "old", lp.shape[1], device)
            adv = m * torch.tensor([float(x["adv"]) for x in chunk], device=device)[:, None]
            w = m * torch.tensor([1.0 / ntok if agg == "token-mean" else 1.0 / (len(traj_tok) * traj_tok[x["traj"]])
                                  for x in chunk], device=device)[:, None]
            loss, clipped, _ = policy_loss(lp, old, adv, w, args.clip_low, args.clip_high, args.dual_clip)
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
# 5. Evaluation, logging and checkpoints
# ----------------------------------------------------------------------------------------------
def belief_curve(episodes, max_len):
    """Mean b_t per turn t = 0..max_len over the games that have b_t (finished games drop out)."""
    curve = []
    for t in range(max_len + 1):
        vals = [ep.beliefs[t] for ep in episodes if len(ep.beliefs) > t and np.isfinite(ep.beliefs[t])]
        curve.append(float(np.mean(vals)) if vals else None)
    while curve and curve[-1] is None:
        curve.pop()
    return curve


def episode_stats(episodes, k):
    """success (mean), pass@k (per task, any of its k games), questions, repeated and invalid fractions."""
    n_q = sum(ep.length for ep in episodes)
    by_task = {}
    for ep in episodes:
        by_task.setdefault(ep.group_id, []).append(ep.success)
    success, success_se = mean_se([ep.success for ep in episodes])
    return {
        "success": success,
        "success_se": success_se,
        f"pass_at_{k}": float(np.mean([any(v) for v in by_task.values()])),
        "return": float(np.mean([ep.env_return for ep in episodes])),
        "episode_length": float(np.mean([ep.length for ep in episodes])),
        "num_questions": float(np.mean([ep.length for ep in episodes])),
        "repeated_frac": float(sum(sum(ep.repeated) for ep in episodes) / max(n_q, 1)),
        "invalid_frac": float(sum(sum(ep.invalid) for ep in episodes) / max(n_q, 1)),
    }


def episode_record(ep, tag):
    return {"tag": tag, "target": ep.target, "won": ep.success, "turns": [
        {"question": a, "answer": o, "belief_after": (ep.beliefs[t + 1] if len(ep.beliefs) > t + 1 else None)}
        for t, (a, o) in enumerate(zip(ep.actions, ep.observations))], "b0": ep.beliefs[0] if ep.beliefs else None}


def evaluate(model, tok, new_env, tasks, args, max_turns, prefix, belief_message, best_of_n=0):
    """Sampled (k per task, training temperature), greedy (1 per task) and optionally best-of-n games."""
    out, records = {}, []
    tasks_k = [t for t in tasks for _ in range(args.eval_k)]
    groups_k = [g for g in range(len(tasks)) for _ in range(args.eval_k)]
    # the belief curve is read off the first of the k games per target: 1/k of the elicitation cost
    episodes = rollout(model, tok, new_env, tasks_k, groups_k, args, args.eval_temperature, belief_message,
                       max_turns=max_turns, belief_games=range(0, len(tasks_k), args.eval_k))
    for key, v in episode_stats(episodes, args.eval_k).items():
        out[f"{prefix}{key}"] = v
    out[f"{prefix}belief_curve"] = belief_curve(episodes, max_turns)
    logged = episodes[:: args.eval_k][: args.num_logged_episodes]  # one game per target, with its beliefs
    records += [episode_record(ep, f"{prefix}sampled") for ep in logged]
    greedy = rollout(model, tok, new_env, tasks, list(range(len(tasks))), args, 1.0, belief_message, greedy=True,
                     max_turns=max_turns, with_beliefs=False)
    out[f"{prefix}success_greedy"], out[f"{prefix}success_greedy_se"] = mean_se([ep.success for ep in greedy])
    if best_of_n > 0:
        bon = rollout(model, tok, new_env, tasks, list(range(len(tasks))), args, args.eval_temperature,
                      belief_message, best_of_n=best_of_n, max_turns=max_turns)
        out[f"{prefix}bon{best_of_n}_success"] = float(np.mean([ep.success for ep in bon]))
        out[f"{prefix}bon{best_of_n}_num_questions"] = float(np.mean([ep.length for ep in bon]))
        records += [episode_record(ep, f"{prefix}best_of_{best_of_n}") for ep in bon[:2]]
    return out, records


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


def iteration_row(episodes, samples, ustats, cstats, seconds):
    """The metrics of one iteration: training rollouts, losses, credit statistics and seconds per phase."""
    n_turns = sum(ep.length for ep in episodes)
    row = {
        "charts/success": float(np.mean([ep.success for ep in episodes])),
        "charts/return": float(np.mean([ep.env_return for ep in episodes])),
        "charts/episode_length": float(np.mean([ep.length for ep in episodes])),
        "charts/invalid_rate": float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1)),
        "charts/repeated_rate": float(sum(sum(ep.repeated) for ep in episodes) / max(n_turns, 1)),
        **{f"losses/{k}": v for k, v in ustats.items()},
        **cstats,
        **{f"perf/{k}_seconds": v for k, v in seconds.items()},
        "perf/tokens_per_second": sum(len(x["completion"]) for x in samples) / max(seconds["rollout"], 1e-9),
        "perf/samples": len(samples),
    }
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


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
def env_factory(env_id, kw, max_turns, what):
    """The env factory `new_env` of `env_id` with options `kw` (user errors -> UserError, naming the env
    `what`: "env", or "--eval-env-id" for the out-of-distribution one) and one probe instance."""
    import envs
    from common.models import UserError

    if env_id not in envs.available():
        raise UserError(f"{what} {env_id!r} is not available in this checkout; available env ids: "
                        f"{', '.join(envs.available()) or 'none'}")

    def new_env():
        env = envs.make(env_id, **kw)
        if max_turns:
            env.max_turns = max_turns
        return env

    try:
        probe = new_env()
        probe.reset(probe.task_ids("test")[0])
    except ValueError as e:
        raise UserError(f"{what} {env_id!r}: {e}") from None
    if not getattr(probe, "target", None):
        raise UserError(f"{what} {env_id!r} has no hidden target (env.target); ΔBelief needs one "
                        "(twenty_questions, guess_my_city)")
    return new_env, probe


def make_env(args):
    """The env factory `new_env` (user errors -> UserError), one probe instance, the policy's model-dependent
    defaults (`policy_defaults`) and the env options."""
    from common.models import policy_defaults

    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    defaults = policy_defaults(args.model_name, args.env_id, args.tiny_preset, learning_rate=3e-5, max_new_tokens=50)
    kw = dict(defaults.env_kwargs)
    if args.history is not None:
        kw["history"] = args.history
    new_env, probe = env_factory(args.env_id, kw, args.max_turns, "env")
    return new_env, probe, defaults, kw


def check_args(args):
    """User errors in the arguments -> UserError."""
    from common.models import UserError

    if args.group_size < 2:
        raise UserError("--group-size must be >= 2 (advantages compare the trajectories of a task)")
    if args.tasks_per_iteration < 1 or args.num_iterations < 0 or args.micro_batch_size < 1 or args.eval_k < 1:
        raise UserError("--tasks-per-iteration, --micro-batch-size and --eval-k must be >= 1, --num-iterations >= 0")
    if args.history is not None and args.history < 0:
        raise UserError(f"--history must be >= 0 (or None), got {args.history}")
    if args.belief_template != "auto" and "{target}" not in args.belief_template:
        raise UserError("--belief-template must contain '{target}', e.g. \"Is it '{target}'?\"")


def make_ood_env(args, env_kwargs, max_turns, is_tiny):
    """The out-of-distribution evaluation of `--eval-env-id`: (env factory, test tasks, belief message), or
    None without one. The policy's prompt format carries over (a tiny 20Q policy reads no instruction text
    and an unnumbered history); the env's content options (e.g. show_candidates) stay the OOD env's own."""
    if not args.eval_env_id or args.eval_env_id == args.env_id:
        return None
    ood_kwargs = {k: env_kwargs[k] for k in ("instructions", "numbered") if k in env_kwargs}
    if args.history is not None:
        ood_kwargs["history"] = args.history
    new_ood_env, ood_probe = env_factory(args.eval_env_id, ood_kwargs, max_turns, "--eval-env-id")
    ood_tasks = ood_probe.task_ids("test")
    return (new_ood_env, ood_tasks[: args.eval_num_tasks] if args.eval_num_tasks else ood_tasks,
            belief_message_for(args.belief_template, ood_probe, is_tiny))


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
    check_args(args)
    rng = seed_everything(args.seed)

    new_env, probe, defaults, env_kwargs = make_env(args)
    is_tiny = defaults.is_tiny
    eval_max_turns = args.eval_max_turns or args.max_turns
    ood = make_ood_env(args, env_kwargs, eval_max_turns, is_tiny)
    belief_message = belief_message_for(args.belief_template, probe, is_tiny)
    if args.max_new_tokens is None:
        args.max_new_tokens = defaults.max_new_tokens
    if args.temperature is None:  # the tiny 20Q policy samples at 1.5 (common.tiny.RL_TEMPERATURE)
        args.temperature = defaults.temperature
    if args.eval_temperature is None:
        args.eval_temperature = args.temperature
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them

    lr = args.learning_rate if args.learning_rate is not None else defaults.learning_rate
    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout, activation_checkpointing=args.activation_checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(args.adam_betas), weight_decay=args.weight_decay)

    shown = belief_message if isinstance(belief_message, str) else f"env guess_question: {belief_message('<target>')}"
    run_dir, logger = start_run(args, {"resolved_learning_rate": lr, "resolved_belief_message": shown,
                                       "env_kwargs": env_kwargs})

    def run_eval(it, final=False):
        t0 = time.time()
        bon = args.eval_best_of_n if (it == 0 or final) else 0
        row, records = evaluate(model, tok, new_env, test_tasks, args, eval_max_turns, "eval/", belief_message, bon)
        if ood is not None:
            r2, rec2 = evaluate(model, tok, ood[0], ood[1], args, eval_max_turns, "eval/ood_", ood[2], bon)
            row.update(r2)
            records += rec2[:2]
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, records)
        return row

    first_eval = run_eval(0)
    logger.log(0, first_eval)
    last_eval = first_eval
    print("eval before training: " + eval_line(first_eval))

    G = args.group_size
    bar = tqdm(range(1, args.num_iterations + 1), desc="delta_belief", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(G)]
        groups = [g for g in range(len(chosen)) for _ in range(G)]
        episodes = rollout(model, tok, new_env, tasks, groups, args, args.temperature, belief_message,
                           with_beliefs=args.reward_mode == "delta")
        seconds = {"rollout": time.time() - t0}

        t1 = time.time()
        samples, cstats = compute_advantages(episodes, args)
        seconds["credit"] = time.time() - t1

        t2 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)
        seconds["update"] = time.time() - t2
        seconds["iteration"] = time.time() - t0

        row = iteration_row(episodes, samples, ustats, cstats, seconds)
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it, final=it == args.num_iterations)
            row.update(last_eval)
        logger.log(it, row)
        if args.save_model and args.checkpoint_every and it % args.checkpoint_every == 0:
            save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}", reward=f"{row['charts/turn_reward_mean']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}")
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations, final=True)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval, "eval/success")


if __name__ == "__main__":
    args = tyro.cli(Args)
    from common.models import UserError

    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
