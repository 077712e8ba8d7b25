"""iStar: implicit step rewards from a trajectory-DPO process reward model, on top of RLOO or GRPO.

Paper: "Agentic Reinforcement Learning with Implicit Step Rewards" (Liu et al., Tongyi Lab, 2025),
https://arxiv.org/abs/2509.19199 ; official code: https://github.com/Tongyi-ConvAI/Tongyi-Character
(directory CharacterRL-iStar/).

Method (docs/istar.md, "Overview"). An implicit process reward model (PRM) π_φ, a second LoRA adapter
("prm") on the policy's base model, is trained alongside the policy π_θ. Each iteration: roll out N
trajectories per task and record π_θold's log-probs; score every step r_φ = β Σ_tokens (log π_φ - log π_θold)
(Eq. 1); update the PRM with trajectory-level DPO on success/failure pairs of a task (Eq. 2); A = A_E + α A_S,
episode-level plus step-level advantage (Eq. 3-5); clipped surrogate, no KL (Eq. 6). `--alpha 0` is the
vanilla RLOO or GRPO baseline (the PRM is then neither scored nor trained).

Equations -> functions
- Eq. 1  r_φ(o_1:t, a_t) = β Σ_tok log π_φ(a_t|.) / π_θold(a_t|.)       -> `implicit_step_rewards`
- Eq. 2  J_PRM = -E log σ(S(τ+) - S(τ-)), S = mean (or sum) of r_φ        -> `trajectory_dpo_loss`
         (pairs, scores and pair accuracy for logging)                   -> `trajectory_scores`, `preference_pairs`
- Eq. 3  A_E(τ_i) = (r_o(τ_i) - mean R_o) / std R_o   (GRPO) or RLOO     -> `istar_advantages`
- Eq. 4  A_S(a_t^i) = (r_φ(a_t^i) - mean R_s) / std R_s, R_s = ∪_{i,t}    -> `istar_advantages`
- Eq. 5  A = A_E + α A_S                                                  -> `istar_advantages`
- Eq. 6  clipped surrogate on the step-level ratio, step-mean, no KL     -> `policy_loss`
- official `istar_norm: batch_norm` (step rewards / max |r| of the batch) -> `normalize_step_rewards`

Deviations from the paper and from the official code: docs/istar.md, "Deviations".

Example
    python istar.py --env-id sokoban --seed 1                 # iStar on RLOO, tiny policy, CPU
    python istar.py --alpha 0                                 # vanilla RLOO baseline
    python istar.py --estimator grpo --step-reward-granularity token
    python istar.py --model-name Qwen/Qwen2.5-1.5B-Instruct --max-new-tokens 512 --env-id webshop
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import deque
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
    """save the LoRA adapters (policy at <run>/adapter, PRM at <run>/adapter/prm) at checkpoints and at the end"""
    checkpoint_every: int = 10
    """save the adapters every this many iterations (0: only at the end)"""
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
    """LoRA rank of the policy and of the PRM adapter"""
    lora_alpha: int = 32
    """LoRA alpha of the policy and of the PRM adapter"""
    lora_dropout: float = 0.0
    """LoRA dropout"""
    activation_checkpointing: bool = False
    """activation checkpointing in the training forward (saves GPU memory on real models)"""
    max_new_tokens: Optional[int] = None
    """most tokens generated per turn; None: the tiny recipe's (Sokoban 4) on the tiny policy, else 512 (paper: 512)"""
    temperature: float = 1.0
    """sampling temperature of the rollouts (paper: 1.0)"""
    eval_temperature: float = 1.0
    """sampling temperature of the sampled evaluation (paper validates at 0.4; greedy is logged too)"""

    # environment
    env_id: str = "sokoban"
    """training and evaluation env"""
    history: Optional[int] = None
    """past (action, observation) pairs in the prompt; None: the tiny recipe's (Sokoban 0) or the env's default"""
    max_turns: int = 0
    """most steps per episode (0: the env's default; paper: 15 on Sokoban, 10 on WebShop)"""
    sokoban_reward: Literal["shaped", "sparse"] = "shaped"
    """Sokoban's r_o: 'shaped' (paper: -0.1/step, +-1/box on/off target, +10 solved) or 'sparse' (10 solved)"""
    opponent: str = "rule:fair"
    """scripted opponent of two-player envs (bargaining, negotiation)"""
    eval_num_tasks: int = 200
    """test tasks per evaluation (0: all test tasks of the env; Sokoban has 200: standard error <= 0.035)"""
    eval_every: int = 10
    """evaluate every this many iterations (and before training and at the end)"""
    num_logged_episodes: int = 4
    """decoded evaluation episodes written to samples.jsonl per evaluation"""

    # algorithm
    num_iterations: int = 40
    """training iterations (rollout + PRM update + policy update; paper: 200; sized for the CPU default run)"""
    tasks_per_iteration: int = 4
    """distinct tasks per iteration (paper: 32 groups on Sokoban, 16 on WebShop; sized for the CPU default run)"""
    group_size: int = 8
    """N: trajectories per task (paper: 8)"""
    learning_rate: Optional[float] = None
    """policy AdamW lr; None: 5e-4 on the tiny policy, 1e-5 on a real model (paper 5e-7 is full fine-tuning)"""
    prm_learning_rate: Optional[float] = None
    """PRM AdamW lr; None: 4e-3 on the tiny policy (docs/istar.md, "PRM settings on the tiny policy"), 2x the policy
    lr on a real model (paper: 1e-6 vs 5e-7; official: 2x)"""
    weight_decay: float = 0.0
    """AdamW weight decay of both optimizers (official: 0)"""
    max_grad_norm: float = 1.0
    """gradient clipping of the policy (verl default)"""
    prm_max_grad_norm: float = 10.0
    """gradient clipping of the PRM (official)"""
    num_minibatches: int = 2
    """optimizer steps per iteration (the turns are split into this many minibatches)"""
    micro_batch_size: int = 64
    """turns per forward pass (gradient accumulation inside a minibatch)"""
    beta: float = 0.05
    """β of the implicit reward (paper: 0.05)"""
    alpha: float = 1.0
    """α, weight of the step-level advantage (paper: 1; 0 = vanilla RLOO/GRPO baseline)"""
    estimator: Literal["rloo", "grpo"] = "rloo"
    """advantage estimator of both levels (paper's Sokoban/WebShop runs: RLOO)"""
    step_reward_granularity: Literal["step", "token"] = "step"
    """'step': one reward per action (iStar); 'token': one per token (Table 3 ablation)"""
    step_reward_norm: Literal["batch_max_abs", "none"] = "batch_max_abs"
    """divide the step rewards by their largest |value| in the batch (official istar_norm: batch_norm)"""
    dpo_reduce: Literal["mean", "sum"] = "mean"
    """trajectory score of the DPO loss: mean (official) or sum (Eq. 2 literally) of its step rewards"""
    prm_updates_per_iteration: int = 1
    """PRM optimizer steps per iteration on the iteration's pairs (official: 1; the paper does not say; more steps
    did not help the tiny policy's PRM, docs/istar.md, "PRM settings on the tiny policy")"""
    prm_replay: Optional[int] = None
    """the PRM also trains on the pairs of this many earlier iterations, each against its own π_θold; None: 4 on
    the tiny policy (docs/istar.md, "PRM settings on the tiny policy"), 0 on a real model (official: none)"""
    positive_threshold: Optional[float] = None
    """None: positive = info['success']; a number: positive = outcome r_o > it (negotiation default: 6, as SOTOPIA)"""
    invalid_penalty: float = 0.1
    """subtracted from the outcome per invalid action (paper: 0.1)"""
    clip_eps: float = 0.2
    """ε of the clipped importance ratio (paper: 0.2)"""
    dual_clip: float = 3.0
    """dual-clip constant c for negative advantages (verl default; 0 disables)"""
    ratio_level: Literal["step", "token"] = "step"
    """'step': one ratio per action, step-mean (paper Eq. 6, GSPO-style); 'token': token-mean (official verl)"""
    adv_eps: float = 1e-6
    """ε in (x - mean) / (std + ε)"""


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
def implicit_step_rewards(prm_logps, old_logps, mask, beta):
    """Implicit step rewards (Eq. 1): r_b = β Σ_l mask[b, l] (log π_φ[b, l] - log π_θold[b, l]).

    prm_logps, old_logps, mask: [B, L] token log-probs of B step completions under the PRM and the old
    policy, mask = 1 on completion tokens. Returns [B] (differentiable through prm_logps).
    """
    return beta * (mask * (prm_logps - old_logps)).sum(-1)


def trajectory_scores(step_rewards, traj_index, num_traj, reduce="mean"):
    """S(τ_i) = mean (or sum) of the step rewards of trajectory i; [S] -> [N]. A trajectory without
    steps scores 0."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    idx = torch.as_tensor(traj_index, dtype=torch.long, device=step_rewards.device)
    total = torch.zeros(num_traj, dtype=step_rewards.dtype, device=step_rewards.device).index_add(0, idx, step_rewards)
    if reduce == "sum":
        return total
    count = torch.zeros(num_traj, dtype=step_rewards.dtype, device=step_rewards.device).index_add(
        0, idx, torch.ones_like(step_rewards))
    return total / count.clamp(min=1)


def preference_pairs(traj_success, traj_group):
    """All (positive, negative) index pairs inside each group: [P, 2] long tensor (P may be 0)."""
    succ = torch.as_tensor(traj_success, dtype=torch.bool)
    grp = torch.as_tensor(traj_group)
    ok = (grp[:, None] == grp[None, :]) & succ[:, None] & ~succ[None, :]
    return ok.nonzero()


def traj_in_pair(traj_success, traj_group):
    """[N] bool: trajectory i is in at least one (positive, negative) pair, i.e. its group holds both kinds."""
    pairs = preference_pairs(traj_success, traj_group)
    out = torch.zeros(len(traj_success), dtype=torch.bool)
    out[pairs.flatten()] = True
    return out


def trajectory_dpo_loss(step_rewards, traj_index, traj_success, traj_group, reduce="mean"):
    """Trajectory-level DPO loss of the implicit PRM (Eq. 2), π_θold as the reference.

        S(τ) = mean_t r_φ(a_t)  (reduce="mean", official)  or  Σ_t r_φ(a_t)  (reduce="sum", Eq. 2)
        L = mean over pairs (τ+, τ-) of the same group of -log σ(S(τ+) - S(τ-))

    step_rewards [S] (with grad), traj_index [S] in 0..N-1, traj_success [N] bool, traj_group [N]. Without
    any pair the result is a zero that still belongs to the autograd graph of step_rewards.
    """
    n = len(traj_success)
    pairs = preference_pairs(traj_success, traj_group).to(step_rewards.device)
    if pairs.shape[0] == 0:
        return step_rewards.sum() * 0.0
    s = trajectory_scores(step_rewards, traj_index, n, reduce)
    return -F.logsigmoid(s[pairs[:, 0]] - s[pairs[:, 1]]).mean()


def _baseline(x, estimator, eps):
    """RLOO (x - mean of the others) or GRPO ((x - mean) / (unbiased std + eps)) of one group's values."""
    m = x.numel()
    if estimator == "rloo":
        return x - (x.sum() - x) / (m - 1)
    if estimator == "grpo":
        return (x - x.mean()) / (x.std(unbiased=True) + eps)
    raise ValueError(f"estimator must be 'rloo' or 'grpo', got {estimator!r}")


def istar_advantages(outcomes, traj_group, step_rewards, traj_index, alpha=1.0, estimator="rloo", eps=1e-6):
    """Combined iStar advantages of every step (Eq. 3-5), no gradient.

        A_E(τ_i)   = rloo: r_o(τ_i) - mean_{j≠i} r_o(τ_j)         grpo: (r_o(τ_i) - mean R_o) / (std R_o + eps)
        A_S(a_t^i) = the same estimator over R_s = all step rewards of the group (Eq. 4, the union over i, t;
                     rloo: r - mean of the group's other steps)
        A(a_t^i)   = A_E(τ_i) + α A_S(a_t^i)

    outcomes [N], traj_group [N], step_rewards [S], traj_index [S] in 0..N-1. std is unbiased. A group
    with one trajectory gives 0 for both terms. Returns [S] float64.
    """
    if estimator not in ("rloo", "grpo"):
        raise ValueError(f"estimator must be 'rloo' or 'grpo', got {estimator!r}")
    outcomes = torch.as_tensor(outcomes, dtype=torch.float64).detach()
    step_rewards = torch.as_tensor(step_rewards, dtype=torch.float64).detach()
    grp = torch.as_tensor(traj_group, dtype=torch.long)
    idx = torch.as_tensor(traj_index, dtype=torch.long)
    a_e = torch.zeros_like(outcomes)
    a_s = torch.zeros_like(step_rewards)
    step_grp = grp[idx]
    for g in torch.unique(grp):
        in_g = grp == g
        if int(in_g.sum()) < 2:
            continue  # a group of one: no counterfactual, advantage 0
        a_e[in_g] = _baseline(outcomes[in_g], estimator, eps)
        steps = step_grp == g
        if int(steps.sum()) >= 2:
            a_s[steps] = _baseline(step_rewards[steps], estimator, eps)
    return a_e[idx] + alpha * a_s


def normalize_step_rewards(step_rewards, eps=1e-6):
    """Official `istar_norm: batch_norm`: r / (max |r| + eps) over the whole batch, so r lies in [-1, 1]."""
    r = torch.as_tensor(step_rewards)
    if r.numel() == 0:
        return r
    return r / (r.abs().max() + eps)


def trajectory_outcomes(episodes, invalid_penalty, threshold=None):
    """The outcome of every trajectory, r_o = env return - invalid_penalty * (its invalid actions), whether it
    is a positive of the PRM's DPO pairs (threshold None: the episode succeeded; else r_o > threshold) and
    its group. Returns (outcomes [N] float64, positive [N] bool, group [N] long)."""
    outcomes = torch.tensor([ep.env_return - invalid_penalty * sum(ep.invalid) for ep in episodes],
                            dtype=torch.float64)
    positive = outcomes > threshold if threshold is not None else torch.tensor([ep.success for ep in episodes])
    return outcomes, positive, torch.tensor([ep.group_id for ep in episodes])


def compute_advantages(samples, outcomes, traj_group, step_r, tok_r, args):
    """Samples in (one per step), each gets `adv`, one advantage per completion token: A = A^E + α·A^S of
    its step reward on every token (Eq. 3-5), or with --step-reward-granularity token every token is its
    own step (Table 3 ablation). Returns the credit statistics that are logged."""
    traj_index = torch.tensor([x["traj"] for x in samples], dtype=torch.long)
    if args.step_reward_granularity == "step" or tok_r is None:
        r_in = step_r.double()
        r_in = normalize_step_rewards(r_in) if args.step_reward_norm == "batch_max_abs" else r_in
        adv = istar_advantages(outcomes, traj_group, r_in, traj_index, args.alpha, args.estimator, args.adv_eps)
        for x, a in zip(samples, adv.tolist()):
            x["adv"] = torch.full((len(x["completion"]),), a)
    else:
        flat = torch.cat(tok_r).double()
        flat = normalize_step_rewards(flat) if args.step_reward_norm == "batch_max_abs" else flat
        tok_traj = torch.cat([torch.full((len(x["completion"]),), x["traj"]) for x in samples])
        adv = istar_advantages(outcomes, traj_group, flat, tok_traj, args.alpha, args.estimator, args.adv_eps)
        pos = 0
        for x in samples:
            c = len(x["completion"])
            x["adv"] = adv[pos:pos + c].float()
            pos += c
    advs = torch.cat([x["adv"] for x in samples]) if samples else torch.zeros(0)
    return {"credit/adv_abs_mean": float(advs.abs().mean()) if len(advs) else 0.0}


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
    progress_delta: list = field(default_factory=list)  # per turn: change of info["progress"] (nan if unknown)
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


def _progress(env, info=None):
    p = (info or {}).get("progress")
    if p is None and info is None:
        p = env.progress()
    try:
        return float(p) if p is not None else float("nan")
    except (TypeError, ValueError):
        return float("nan")


def rollout(model, tok, new_env, task_ids, group_ids, temperature, max_new_tokens, greedy=False):
    """Play one episode per task id with the policy adapter, all envs stepped together: one batched generate
    per turn. Records every turn's prompt and completion token ids and its change of env progress."""
    envs_, episodes, prog = [], [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        env = new_env()
        env.reset(task)
        envs_.append(env)
        episodes.append(Episode(traj_id=i, group_id=int(g), task_id=str(task)))
        prog.append(_progress(env))
    model.set_adapter("default")
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
            p = _progress(envs_[i], st.info)
            ep.progress_delta.append(p - prog[i])
            prog[i] = p
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
    """Per-sample token log-prob vectors under one adapter at the sampling temperature, eval mode, no
    gradient."""
    model.set_adapter(adapter)
    model.eval()
    out = []
    for s in range(0, len(samples), micro_batch_size):
        chunk = samples[s:s + micro_batch_size]
        lp, _ = completion_logprobs(model, tok, [x["prompt"] for x in chunk], [x["completion"] for x in chunk],
                                    temperature=temperature)
        out += [lp[j, lp.shape[1] - len(x["completion"]):].float().cpu() for j, x in enumerate(chunk)]
    return out


def training_samples(model, tok, episodes, args):
    """One sample per step (prompt, completion, trajectory, group, turn) with π_θold's token log-probs."""
    samples = [{"prompt": ep.prompts[t], "completion": ep.completions[t], "traj": ep.traj_id,
                "group": ep.group_id, "turn": t}
               for ep in episodes for t in range(ep.length)]
    old = token_logprobs(model, tok, samples, "default", args.micro_batch_size, args.temperature)
    for x, o in zip(samples, old):
        x["old"] = o
    return samples


def prm_step_rewards(model, tok, samples, args):
    """Eq. 1 for every sample under the PRM as it is now: (token rewards list, step rewards [S]), no gradient."""
    prm_lp = token_logprobs(model, tok, samples, "prm", args.micro_batch_size, args.temperature)
    tok_r = [args.beta * (p - x["old"]) for p, x in zip(prm_lp, samples)]  # Eq. 1 per token
    return tok_r, (torch.stack([t.sum() for t in tok_r]) if tok_r else torch.zeros(0))  # Eq. 1 per step


def paired_batch(samples, traj_success, traj_group):
    """The PRM's training data of one iteration: the steps of the trajectories that are in a pair, their
    trajectories renumbered 0..n-1 in order, with those trajectories' success and group."""
    in_pair = traj_in_pair(traj_success, traj_group)
    keep = [i for i in range(len(traj_success)) if bool(in_pair[i])]
    new_id = {old: new for new, old in enumerate(keep)}
    return {"samples": [dict(x, traj=new_id[x["traj"]]) for x in samples if x["traj"] in new_id],
            "success": torch.as_tensor(traj_success)[keep], "group": torch.as_tensor(traj_group)[keep]}


def merge_batches(batches):
    """Paired batches of several iterations as one: trajectory and group ids of batch b are offset by the
    trajectories and the largest group id + 1 of the batches before it, so no pair crosses iterations."""
    samples, succ, grp, n_traj, n_grp = [], [], [], 0, 0
    for b in batches:
        samples += [dict(x, traj=x["traj"] + n_traj) for x in b["samples"]]
        succ.append(b["success"])
        grp.append(torch.as_tensor(b["group"], dtype=torch.long) + n_grp)
        n_traj += len(b["success"])
        n_grp = int(grp[-1].max()) + 1 if len(grp[-1]) else n_grp
    return {"samples": samples, "success": torch.cat(succ) if succ else torch.zeros(0, dtype=torch.bool),
            "group": torch.cat(grp) if grp else torch.zeros(0, dtype=torch.long)}


def prm_update(model, tok, optimizer, samples, traj_success, traj_group, args, replay=()):
    """`--prm-updates-per-iteration` optimizer steps of the PRM adapter on the trajectory-DPO loss (Eq. 2) of
    this batch's pairs and of the paired batches in `replay` (earlier iterations', `paired_batch`), each step in
    two passes (docs/istar.md, "Implementation details" 4): the step rewards without graph, g_s = dL/dr_s on
    them, then a re-forward of the paired steps that backpropagates Σ_s g_s r_s. The first scoring (every step,
    before any update on this batch) gives the rewards that feed the advantages and the held-out pair
    statistics; after the last step this batch's paired steps are scored again (fit statistics).
    Returns (token rewards list, step rewards [S], stats, this batch's `paired_batch` for later replay).
    """
    device = next(model.parameters()).device
    tok_r, r = prm_step_rewards(model, tok, samples, args)
    idx = torch.tensor([x["traj"] for x in samples], dtype=torch.long)
    held = pair_counts(r, idx, traj_success, traj_group, args.dpo_reduce)
    n_pairs = int(held["pairs"].sum())
    stats = {"pairs": n_pairs, "loss": held["loss"], "heldout_pair_acc": held["acc"],
             "heldout_margin": held["margin"], "grad_norm": 0.0, "heldout_counts": (held["correct"], held["pairs"])}
    in_pair = traj_in_pair(traj_success, traj_group)
    paired = [j for j, x in enumerate(samples) if bool(in_pair[x["traj"]])]  # only these steps have dL/dr != 0
    mine = paired_batch(samples, traj_success, traj_group)
    batch = merge_batches([mine, *replay])  # this iteration's pairs first
    train, t_idx = batch["samples"], torch.tensor([x["traj"] for x in batch["samples"]], dtype=torch.long)
    if not train:
        model.set_adapter("default")
        return tok_r, r, stats, mine
    r_train = r[paired]
    for k in range(args.prm_updates_per_iteration):
        if k > 0:  # dL/dr with the PRM as it is now
            r_train = prm_step_rewards(model, tok, train, args)[1]
        elif replay:  # this batch's steps were scored above; the earlier iterations' under the PRM as it is now
            r_train = torch.cat([r_train, prm_step_rewards(model, tok, train[len(paired):], args)[1]])
        leaf = r_train.detach().double().requires_grad_(True)
        (g,) = torch.autograd.grad(trajectory_dpo_loss(leaf, t_idx, batch["success"], batch["group"],
                                                       args.dpo_reduce), leaf)
        model.set_adapter("prm")
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for s0 in range(0, len(train), args.micro_batch_size):
            chunk = train[s0:s0 + args.micro_batch_size]
            lp, m = completion_logprobs(model, tok, [x["prompt"] for x in chunk], [x["completion"] for x in chunk],
                                        temperature=args.temperature)
            old = _padded(chunk, "old", lp.shape[1], device)
            rr = implicit_step_rewards(lp, old, m, args.beta)
            (rr * g[s0:s0 + len(chunk)].to(rr.dtype).to(device)).sum().backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.prm_max_grad_norm))
        optimizer.step()
    if n_pairs:
        after = pair_counts(prm_step_rewards(model, tok, mine["samples"], args)[1], idx[paired], traj_success,
                            traj_group, args.dpo_reduce)
        stats.update(train_loss_after=after["loss"], train_pair_acc_after=after["acc"],
                     train_margin_after=after["margin"])
    stats["train_pairs"] = int(preference_pairs(batch["success"], batch["group"]).shape[0])
    model.set_adapter("default")
    model.eval()
    return tok_r, r, stats, mine


def policy_loss(logp, old_logp, adv, weights, clip_eps, dual_clip, step_mask=None):
    """Clipped surrogate (Eq. 6) with optional dual clip; `weights` carry the aggregation.

        ratio = exp(logp - old); l = -min(ratio A, clip(ratio, 1 - ε, 1 + ε) A)
        for A < 0: l = min(l, -c A)   (dual clip);   loss = Σ weights * l

    With `step_mask` (the completion mask [B, C]) the ratio is the step's, s = exp(mean over the step's tokens
    of (logp - old)), as s * π_t / sg(π_t) on every token (Eq. 6, GSPO; docs/istar.md, "Implementation details" 12).
    """
    if step_mask is not None:
        n = step_mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_s = ((logp - old_logp) * step_mask).sum(-1, keepdim=True) / n
        ratio = torch.exp(log_s.detach() + logp - logp.detach())
    else:
        ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss_tok = torch.maximum(l1, l2)
    if dual_clip and dual_clip > 1.0:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * dual_clip), loss_tok)
    clipped = (l2 > l1).float()
    return (loss_tok * weights).sum(), clipped, ratio


def update(model, tok, optimizer, samples, args, rng):
    """One pass over the turns in `num_minibatches` optimizer steps of the policy adapter. samples: dicts
    with prompt, completion, old (π_θold's token log-probs) and adv (per-token advantages). Step-level ratio
    and step-mean (`--ratio-level step`, Eq. 6) or per-token ratios and token-mean (`token`)."""
    device = next(model.parameters()).device
    model.set_adapter("default")
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "approx_kl", "clip_frac", "grad_norm")}
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
            adv = _padded(chunk, "adv", lp.shape[1], device)
            if args.ratio_level == "step":
                w = m / (m.sum(-1, keepdim=True).clamp(min=1.0) * len(mb))
                loss, clipped, _ = policy_loss(lp, old, adv, w, args.clip_eps, args.dual_clip, step_mask=m)
            else:
                loss, clipped, _ = policy_loss(lp, old, adv, m / ntok, args.clip_eps, args.dual_clip)
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
def episode_record(ep, tag):
    return {"tag": tag, "task_id": ep.task_id, "success": ep.success, "return": ep.env_return,
            "turns": [{"action": a, "observation": o, "invalid": inv}
                      for a, o, inv in zip(ep.actions, ep.observations, ep.invalid)]}


def evaluate(model, tok, new_env, tasks, args, max_new_tokens):
    """Sampled (one per test task, at --eval-temperature) and greedy episodes on the test tasks with the
    policy adapter."""
    episodes = rollout(model, tok, new_env, tasks, [0] * len(tasks), args.eval_temperature, max_new_tokens)
    greedy = rollout(model, tok, new_env, tasks, [0] * len(tasks), 1.0, max_new_tokens, greedy=True)
    out, n_turns = {}, sum(ep.length for ep in episodes)
    out["eval/success"], out["eval/success_se"] = mean_se([ep.success for ep in episodes])
    out["eval/success_greedy"], out["eval/success_greedy_se"] = mean_se([ep.success for ep in greedy])
    out["eval/return"] = float(np.mean([ep.env_return for ep in episodes]))
    out["eval/return_greedy"] = float(np.mean([ep.env_return for ep in greedy]))
    out["eval/episode_length"] = float(np.mean([ep.length for ep in episodes]))
    out["eval/invalid_rate"] = float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1))
    records = [episode_record(ep, "sampled") for ep in episodes[: args.num_logged_episodes]]
    records += [episode_record(ep, "greedy") for ep in greedy[: max(1, args.num_logged_episodes // 2)]]
    return out, records


def pair_counts(step_rewards, traj_index, traj_success, traj_group, reduce="mean"):
    """The PRM's pairs as it scores them now: per group with pairs, its pairs and how many the PRM ranks right
    (S(τ+) > S(τ-); a tie is wrong), and over all pairs the accuracy, the mean margin S(τ+) - S(τ-) and the
    DPO loss (NaN without pairs). Returns a dict: groups, correct, pairs (per group), acc, margin, loss."""
    traj_index = torch.as_tensor(traj_index, dtype=torch.long)
    grp = torch.as_tensor(traj_group)
    pairs = preference_pairs(traj_success, traj_group)
    if pairs.shape[0] == 0:
        nan = float("nan")
        return {"groups": [], "correct": np.zeros(0), "pairs": np.zeros(0), "acc": nan, "margin": nan, "loss": nan}
    s = trajectory_scores(torch.as_tensor(step_rewards).double(), traj_index, len(grp), reduce)
    d = s[pairs[:, 0]] - s[pairs[:, 1]]
    pg = grp[pairs[:, 0]]
    groups = torch.unique(pg)
    return {"groups": groups.tolist(),
            "correct": np.array([float((d[pg == g] > 0).sum()) for g in groups]),
            "pairs": np.array([float((pg == g).sum()) for g in groups]),
            "acc": float((d > 0).double().mean()), "margin": float(d.mean()), "loss": float(-F.logsigmoid(d).mean())}


def pooled_pair_accuracy(correct, pairs):
    """Accuracy over the pairs of many groups, Σ correct / Σ pairs, and its standard error with the group as the
    unit (a group's pairs share trajectories, so they are not independent): with n_g pairs and c_g right in
    group g, acc = Σ c_g / Σ n_g and SE = sqrt(G / (G - 1) Σ_g (c_g - acc n_g)²) / Σ n_g (0 for one group).
    Returns (acc, se); (NaN, NaN) without pairs."""
    c, n = np.asarray(correct, dtype=np.float64), np.asarray(pairs, dtype=np.float64)
    if n.sum() == 0:
        return float("nan"), float("nan")
    acc, G = c.sum() / n.sum(), len(n)
    se = math.sqrt(G / (G - 1) * ((c - acc * n) ** 2).sum()) / n.sum() if G > 1 else 0.0
    return float(acc), float(se)


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


def prm_stats(samples, traj_success, step_r, pstats):
    """The fraction of positive trajectories and, when the PRM is in use (`pstats` given), its statistics
    and those of its step rewards (of all steps, of the steps of positive and of other trajectories)."""
    row = {"charts/positive_frac": float(traj_success.float().mean())}
    if pstats is None:
        return row
    succ = traj_success[torch.tensor([x["traj"] for x in samples], dtype=torch.long)].numpy()
    r = step_r.double().numpy()
    row.update({f"prm/{k}": v for k, v in pstats.items() if isinstance(v, (int, float))})
    row["credit/step_reward_mean"] = float(r.mean()) if len(r) else 0.0
    row["credit/step_reward_abs_mean"] = float(np.abs(r).mean()) if len(r) else 0.0
    row["credit/step_reward_success_mean"] = float(r[succ].mean()) if succ.any() else float("nan")
    row["credit/step_reward_failure_mean"] = float(r[~succ].mean()) if (~succ).any() else float("nan")
    return row


def heldout_summary(heldout, num_iterations):
    """The PRM's held-out pair accuracy (docs/istar.md, "Logged metrics") pooled over the pairs of the first and
    of the last quarter of the iterations, with standard errors (`pooled_pair_accuracy`), for summary.json."""
    q = max(1, num_iterations // 4)
    out = {}
    for name, lo, hi in (("first_quarter", 1, q), ("last_quarter", num_iterations - q + 1, num_iterations)):
        rows = [(c, n) for it, c, n in heldout if lo <= it <= hi]
        c = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0)
        n = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0)
        acc, se = pooled_pair_accuracy(c, n)
        out[name] = {"iterations": [lo, hi], "acc": acc if n.sum() else None, "se": se if n.sum() else None,
                     "pairs": int(n.sum()), "groups": len(n)}  # None (JSON null) without pairs
    return out


def adapter_params(model, adapter):
    """The LoRA parameters of one named adapter (by name, independent of which adapter is active)."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n]


def step_reward_record(episodes, step_r):
    """Every step's implicit reward and change of env progress (null where unknown), in step order, for
    samples.jsonl; benchmarks/istar_bench.py correlates them."""
    return {"tag": "train_step_rewards", "step_reward": step_r.double().tolist(),
            "progress_delta": [d if math.isfinite(d) else None for ep in episodes for d in ep.progress_delta]}


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
    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    defaults = policy_defaults(args.model_name, args.env_id, args.tiny_preset, learning_rate=1e-5, max_new_tokens=512)
    kw = dict(defaults.env_kwargs)
    if args.history is not None:
        kw["history"] = args.history
    if args.env_id == "sokoban":
        kw["reward"] = args.sokoban_reward

    def new_env():
        env = envs.make(args.env_id, **kw)
        if args.env_id in envs.TWO_PLAYER:
            env = envs.vs_opponent(env, opponent=args.opponent)
        if args.max_turns:
            env.max_turns = args.max_turns
        return env

    try:
        probe = new_env()
        probe.reset(probe.task_ids("test")[0])
    except ValueError as e:
        raise UserError(f"env {args.env_id!r}: {e}") from None
    return new_env, probe, defaults, kw


def check_args(args):
    """User errors in the arguments -> UserError."""
    from common.models import UserError

    if args.group_size < 2:
        raise UserError("--group-size must be >= 2 (advantages compare the trajectories of a task)")
    if args.tasks_per_iteration < 1 or args.num_iterations < 0 or args.micro_batch_size < 1:
        raise UserError("--tasks-per-iteration and --micro-batch-size must be >= 1, --num-iterations >= 0")
    if args.history is not None and args.history < 0:
        raise UserError(f"--history must be >= 0 (or None), got {args.history}")
    if args.beta <= 0:
        raise UserError("--beta must be > 0 (it scales the implicit reward, paper: 0.05)")
    if args.prm_updates_per_iteration < 1:
        raise UserError(f"--prm-updates-per-iteration must be >= 1, got {args.prm_updates_per_iteration} "
                        "(--alpha 0 turns the PRM off)")
    if args.prm_replay is not None and args.prm_replay < 0:
        raise UserError(f"--prm-replay must be >= 0 (earlier iterations whose pairs the PRM also trains on), "
                        f"got {args.prm_replay}")
    if args.prm_learning_rate is not None and args.prm_learning_rate <= 0:
        raise UserError(f"--prm-learning-rate must be > 0, got {args.prm_learning_rate}")


# What the PRM options left at None resolve to. A real model: the official code's settings (one DPO step per
# iteration on the iteration's pairs, PRM lr = 2x the policy lr as in the paper, no replay). The tiny policy: the
# cheapest setting under which the implicit PRM learns within the default run (held-out pair accuracy >= 0.65 at
# the end), chosen with benchmarks/istar_prm_diag.py on tuning seed 1; with the official settings its DPO loss
# stays at ln 2 (docs/istar.md, "PRM settings on the tiny policy").
TINY_PRM_DEFAULTS = dict(prm_learning_rate=4e-3, prm_replay=4)


def resolve_prm_defaults(args, is_tiny, lr):
    """Fill `prm_learning_rate` and `prm_replay` left at None: TINY_PRM_DEFAULTS on the tiny policy, the official
    settings on a real model (2x the policy lr `lr`, no replay)."""
    official = dict(prm_learning_rate=2 * lr, prm_replay=0)
    for key, value in (TINY_PRM_DEFAULTS if is_tiny else official).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def seed_everything(seed):
    """Seeds python, numpy and torch; returns the numpy generator that draws the run's tasks and batches."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def main(args: Args):
    from common.models import add_adapter, load_policy

    t_start = time.time()
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    check_args(args)
    rng = seed_everything(args.seed)

    new_env, probe, defaults, env_kwargs = make_env(args)
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them
    threshold = args.positive_threshold
    if threshold is None and args.env_id == "negotiation":
        threshold = 6.0  # 0-10 score, positives above 6 (paper's SOTOPIA rule)
    lr = args.learning_rate if args.learning_rate is not None else defaults.learning_rate
    resolve_prm_defaults(args, defaults.is_tiny, lr)  # PRM lr and replay
    prm_lr = args.prm_learning_rate
    max_new = args.max_new_tokens or defaults.max_new_tokens
    use_prm = args.alpha != 0

    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
                             lora_dropout=args.lora_dropout, activation_checkpointing=args.activation_checkpointing)
    add_adapter(model, "prm", lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    model.set_adapter("default")
    pol_params, prm_params = adapter_params(model, "default"), adapter_params(model, "prm")
    if not pol_params or not prm_params:
        raise RuntimeError("could not find the LoRA parameters of the policy and PRM adapters")
    optimizer = torch.optim.AdamW(pol_params, lr=lr, weight_decay=args.weight_decay)
    prm_optimizer = torch.optim.AdamW(prm_params, lr=prm_lr, weight_decay=args.weight_decay)

    run_dir, logger = start_run(args, {"resolved_learning_rate": lr, "resolved_prm_learning_rate": prm_lr,
                                       "resolved_prm_replay": args.prm_replay,
                                       "resolved_max_new_tokens": max_new, "max_turns_resolved": probe.max_turns,
                                       "resolved_positive_threshold": threshold, "env_kwargs": env_kwargs,
                                       "num_train_tasks": len(train_tasks), "num_test_tasks": len(test_tasks)})

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
    heldout = []  # per iteration with the PRM: (it, correct, pairs) per group, scored before the PRM trained on them
    replay = deque(maxlen=args.prm_replay)  # the paired batches of the last --prm-replay iterations
    bar = tqdm(range(1, args.num_iterations + 1), desc="istar", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(G)]
        groups = [g for g in range(len(chosen)) for _ in range(G)]
        episodes = rollout(model, tok, new_env, tasks, groups, args.temperature, max_new)
        seconds = {"rollout": time.time() - t0}

        t1 = time.time()
        samples = training_samples(model, tok, episodes, args)  # one per turn, with π_θold log-probs
        seconds["old_logprob"] = time.time() - t1

        # credit: pre-update implicit step rewards (Eq. 1), one trajectory-DPO step of the PRM (Eq. 2), A (Eq. 3-5)
        t2 = time.time()
        outcomes, traj_success, traj_group = trajectory_outcomes(episodes, args.invalid_penalty, threshold)
        if use_prm:
            tok_r, step_r, pstats, mine = prm_update(model, tok, prm_optimizer, samples, traj_success, traj_group,
                                                     args, replay)
            heldout.append((it, *pstats["heldout_counts"]))
            replay.appendleft(mine)  # newest first; the deque keeps the last --prm-replay iterations
        else:
            tok_r, step_r, pstats = None, torch.zeros(len(samples)), None
        seconds["prm"] = time.time() - t2
        cstats = {**compute_advantages(samples, outcomes, traj_group, step_r, tok_r, args),
                  **prm_stats(samples, traj_success, step_r, pstats)}

        t3 = time.time()
        ustats = update(model, tok, optimizer, samples, args, rng)  # Eq. 6
        seconds["update"] = time.time() - t3
        seconds["iteration"] = time.time() - t0

        row = iteration_row(episodes, samples, ustats, cstats, seconds)
        logger.log_samples(it, [step_reward_record(episodes, step_r)] if use_prm else [])
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.save_model and args.checkpoint_every and it % args.checkpoint_every == 0:
            save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}", reward=f"{row['charts/return']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}",
                        prm_acc=f"{row.get('prm/heldout_pair_acc', math.nan):.2f}")
    if args.num_iterations and not args.eval_every:
        last_eval = run_eval(args.num_iterations)
        logger.log(args.num_iterations, last_eval)
    if args.save_model:
        save_adapter(model, run_dir)
    extra = {"prm_heldout_pair_acc": heldout_summary(heldout, args.num_iterations)} if use_prm else {}
    return write_summary(run_dir, args, time.time() - t_start, first_eval, last_eval, "eval/success", **extra)


if __name__ == "__main__":
    args = tyro.cli(Args)
    from common.models import UserError

    try:
        main(args)
    except UserError as e:
        sys.exit(f"error: {e}")
