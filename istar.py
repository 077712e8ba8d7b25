"""iStar: implicit step rewards from a trajectory-DPO process reward model, on top of RLOO or GRPO.

Paper: "Agentic Reinforcement Learning with Implicit Step Rewards" (Liu et al., Tongyi Lab, 2025),
https://arxiv.org/abs/2509.19199 ; official code: https://github.com/Tongyi-ConvAI/Tongyi-Character
(directory CharacterRL-iStar/). Method: docs/istar.md; deviations: docs/istar.md, "Deviations".

A second LoRA adapter ("prm") on the policy's base model is the implicit PRM π_φ. Each iteration:
roll out N trajectories per task; the PRM scores every step and takes its DPO step (`prm_update`,
Alg. 1); A = A_E + α A_S; clipped surrogate, no KL. `--alpha 0`: the vanilla RLOO or GRPO baseline.
Equations -> functions (section 2; the kernel `istar_turn_advantages` takes plain per-turn arrays):
- Eq. 1  r_φ = β Σ_tok log π_φ / π_θold     -> `implicit_turn_rewards`, `implicit_step_rewards`
- Eq. 2  J_PRM = -E log σ(S(τ+) - S(τ-))    -> `trajectory_dpo_loss` (`trajectory_scores`, pairs)
- Eq. 3-5  A_E (RLOO or GRPO), A_S over R_s = ∪_{i,t}, A = A_E + α A_S -> `istar_advantages`
  (official `istar_norm: batch_norm`, r / max |r| of the batch: `normalize_step_rewards`)
- Eq. 6  clipped surrogate on the step-level ratio, step-mean, no KL   -> `policy_loss`

    python istar.py                                   # iStar on RLOO, tiny policy, Sokoban, CPU
    python istar.py --alpha 0                         # vanilla RLOO baseline
    python istar.py --model-name smollm2-135m         # SmolLM2 + its WebShop adapter
    python istar.py --model-name Qwen/Qwen2.5-1.5B-Instruct --env-id webshop
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections import deque
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
    save_model: bool = True  # save the adapters (policy: <run>/adapter, PRM: <run>/adapter/prm)
    checkpoint_every: Optional[int] = None  # checkpoint each N iterations (0: end); None: DEFAULTS
    resume: Optional[str] = None  # a run dir to continue from its checkpoint.pt and config.json
    torch_threads: int = 0  # CPU threads for torch (0: leave torch's default)
    # model
    model_name: str = "tiny"  # 'tiny' (the env's tiny policy), 'smollm2-135m', a hub id or a dir
    tiny_preset: str = "default"  # tiny policy size: 'default' or 'micro' (for tests)
    load_in_4bit: Optional[bool] = None  # None: nf4 on CUDA only; True: always; False: never
    lora_r: int = 16  # LoRA rank of the policy and of the PRM adapter
    lora_alpha: int = 32  # LoRA alpha of the policy and of the PRM adapter
    lora_dropout: float = 0.0  # LoRA dropout
    activation_checkpointing: Optional[bool] = None  # backward recomputes (None: real model, CUDA)
    static_cache: bool = False  # static KV cache in generate, compiled on CUDA (docs/gpu.md)
    max_new_tokens: Optional[int] = None  # most tokens per turn (paper: 512); None: DEFAULTS
    temperature: float = 1.0  # sampling temperature of the rollouts (paper: 1.0)
    eval_temperature: float = 1.0  # sampled evaluation's temperature (paper: 0.4; greedy too)
    # environment
    env_id: Optional[str] = None  # training and evaluation env; None: DEFAULTS
    history: Optional[int] = None  # (action, observation) pairs shown; None: the policy's or env's
    max_turns: int = 0  # steps per episode (0: the env's; paper: 15 on Sokoban, 10 on WebShop)
    sokoban_reward: Literal["shaped", "sparse"] = "shaped"  # Sokoban r_o: paper's shaped or sparse
    opponent: str = "rule:fair"  # scripted opponent of two-player envs (bargaining, negotiation)
    eval_num_tasks: Optional[int] = None  # test tasks per evaluation (0: all); None: DEFAULTS
    eval_every: Optional[int] = None  # evaluate every N iterations, first and last; None: DEFAULTS
    num_logged_episodes: int = 4  # decoded episodes per evaluation written to samples.jsonl
    # algorithm
    num_iterations: Optional[int] = None  # iterations (paper: 200); None: DEFAULTS
    tasks_per_iteration: Optional[int] = None  # (paper: 32 Sokoban, 16 WebShop); None: DEFAULTS
    group_size: Optional[int] = None  # N: trajectories per task (paper: 8); None: DEFAULTS
    learning_rate: Optional[float] = None  # policy lr (paper: 5e-7, full fine-tune); None: DEFAULTS
    prm_learning_rate: Optional[float] = None  # (paper: 1e-6); None: DEFAULTS, else 2x the policy's
    weight_decay: float = 0.01  # AdamW weight decay of the policy (official: 0.01, verl's)
    prm_weight_decay: float = 0.0  # AdamW weight decay of the PRM (official: 0)
    max_grad_norm: float = 1.0  # gradient clipping of the policy (verl default)
    prm_max_grad_norm: float = 10.0  # gradient clipping of the PRM (official)
    num_minibatches: int = 2  # optimizer steps per iteration (the turns in this many minibatches)
    micro_batch_size: Optional[int] = None  # turns per forward (grad accumulation); None: DEFAULTS
    beta: float = 0.05  # β of the implicit reward (paper: 0.05)
    alpha: float = 1.0  # α, weight of the step-level advantage (paper: 1; 0: RLOO/GRPO baseline)
    estimator: Literal["rloo", "grpo"] = "rloo"  # of both levels (paper, Sokoban/WebShop: RLOO)
    step_reward_granularity: Literal["step", "token"] = "step"  # iStar or Table 3's ablation
    step_reward_norm: Literal["batch_max_abs", "none"] = "batch_max_abs"  # r / max |r| (official)
    dpo_reduce: Literal["mean", "sum"] = "mean"  # trajectory score: mean (official) or sum (Eq. 2)
    prm_updates_per_iteration: int = 1  # PRM steps per iteration (official: 1; more did not help)
    prm_replay: Optional[int] = None  # iterations the PRM replays (official: 0); None: DEFAULTS
    positive_threshold: Optional[float] = None  # DPO positive: r_o > this; None: success or by env
    invalid_penalty: float = 0.1  # subtracted from the outcome per invalid action (paper: 0.1)
    clip_eps: float = 0.2  # ε of the clipped importance ratio (paper: 0.2)
    dual_clip: float = 3.0  # dual-clip c for negative advantages (verl default; 0 disables)
    ratio_level: Literal["step", "token"] = "step"  # step-mean (Eq. 6) or token-mean (verl)
    adv_eps: float = 1e-6  # ε in (x - mean) / (std + ε)


# Every option left at None, by model (`with_defaults`): "tiny", the tiny policy on a CPU, with the
# cheapest PRM setting that learns (docs/istar.md, "Deviations"); "smollm2-135m", SmolLM2 with its
# WebShop adapter (docs/smollm2.md); "*", any other model: the official PRM settings (no replay).
DEFAULTS = {
    "tiny": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
                 learning_rate=5e-4, prm_learning_rate=4e-3, prm_replay=4, micro_batch_size=64,
                 eval_num_tasks=200, eval_every=10, checkpoint_every=10),
    "smollm2-135m": dict(env_id="webshop", num_iterations=8, tasks_per_iteration=2, group_size=4,
                         learning_rate=1e-4, max_new_tokens=512, prm_replay=0, micro_batch_size=8,
                         eval_num_tasks=30, eval_every=0, checkpoint_every=2),
    "*": dict(env_id="sokoban", num_iterations=40, tasks_per_iteration=4, group_size=8,
              learning_rate=1e-5, max_new_tokens=512, prm_replay=0, micro_batch_size=8,
              eval_num_tasks=200, eval_every=10, checkpoint_every=10),
}
POSITIVE_THRESHOLD_BY_ENV = {"negotiation": 6.0}  # a 0-10 score: positives above 6 (SOTOPIA rule)


# ----------------------------------------------------------------------------------------------
# 2. Credit assignment (ALGO LOGIC)
# ----------------------------------------------------------------------------------------------
# The method, model-free: plain per-turn arrays and the PRM's log-ratios in, one advantage per turn
# out. The kernel is `istar_turn_advantages` (Eq. 1, 3-5, at the end); the functions above it are
# its equations and the PRM's loss (Eq. 2). The section runs alone with this file's imports.
def implicit_step_rewards(prm_logps, old_logps, mask, beta):
    """Implicit step rewards (Eq. 1), batched: r_b = β Σ_l mask[b, l] (log π_φ - log π_θold)[b, l].

    prm_logps, old_logps, mask: [B, L] token log-probs of B step completions under the PRM and the
    old policy, mask = 1 on completion tokens. Returns [B] (differentiable through prm_logps).
    """
    return beta * (mask * (prm_logps - old_logps)).sum(-1)


def implicit_turn_rewards(prm_log_ratios, beta):
    """Implicit step rewards (Eq. 1), one per turn: r = Σ_tokens β (log π_φ - log π_θold).

    prm_log_ratios: per turn, the 1-D tensor of its token log-ratios. Returns [N] (dtype of the
    log-ratios). Summed per turn, unpadded: a padded batch sum would differ in the last bits.
    """
    if not len(prm_log_ratios):
        return torch.zeros(0)
    return torch.stack([(beta * log_ratio).sum() for log_ratio in prm_log_ratios])


def trajectory_scores(step_rewards, traj_index, num_traj, reduce="mean"):
    """S(τ_i) = mean (or sum) of the step rewards of trajectory i; [S] -> [N]. A trajectory without
    steps scores 0."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    idx = torch.as_tensor(traj_index, dtype=torch.long, device=step_rewards.device)
    zeros = torch.zeros(num_traj, dtype=step_rewards.dtype, device=step_rewards.device)
    total = zeros.index_add(0, idx, step_rewards)
    if reduce == "sum":
        return total
    count = zeros.index_add(0, idx, torch.ones_like(step_rewards))
    return total / count.clamp(min=1)


def preference_pairs(traj_success, traj_group):
    """All (positive, negative) index pairs inside each group: [P, 2] long tensor (P may be 0)."""
    succ = torch.as_tensor(traj_success, dtype=torch.bool)
    grp = torch.as_tensor(traj_group)
    ok = (grp[:, None] == grp[None, :]) & succ[:, None] & ~succ[None, :]
    return ok.nonzero()


def traj_in_pair(traj_success, traj_group):
    """[N] bool: trajectory i is in at least one pair (its group holds both kinds)."""
    pairs = preference_pairs(traj_success, traj_group)
    out = torch.zeros(len(traj_success), dtype=torch.bool)
    out[pairs.flatten()] = True
    return out


def trajectory_dpo_loss(step_rewards, traj_index, traj_success, traj_group, reduce="mean"):
    """Trajectory-level DPO loss of the implicit PRM (Eq. 2), π_θold as the reference.

        S(τ) = mean_t r_φ(a_t)  (reduce="mean", official)  or  Σ_t r_φ(a_t)  (reduce="sum", Eq. 2)
        L = mean over pairs (τ+, τ-) of the same group of -log σ(S(τ+) - S(τ-))

    step_rewards [S] (with grad), traj_index [S] in 0..N-1, traj_success [N] bool, traj_group [N].
    Without any pair the result is a zero that still belongs to the autograd graph of step_rewards.
    """
    n = len(traj_success)
    pairs = preference_pairs(traj_success, traj_group).to(step_rewards.device)
    if pairs.shape[0] == 0:
        return step_rewards.sum() * 0.0
    s = trajectory_scores(step_rewards, traj_index, n, reduce)
    return -F.logsigmoid(s[pairs[:, 0]] - s[pairs[:, 1]]).mean()


def _baseline(x, estimator, eps):
    """RLOO (x - mean of the others) or GRPO ((x - mean) / (unbiased std + eps)) of one group."""
    m = x.numel()
    if estimator == "rloo":
        return x - (x.sum() - x) / (m - 1)
    if estimator == "grpo":
        return (x - x.mean()) / (x.std(unbiased=True) + eps)
    raise ValueError(f"estimator must be 'rloo' or 'grpo', got {estimator!r}")


def istar_advantages(outcomes, traj_group, step_rewards, traj_index, alpha=1.0, estimator="rloo",
                     eps=1e-6):
    """Combined iStar advantages of every step (Eq. 3-5), no gradient.

        A_E(τ_i)   = rloo: r_o(τ_i) - mean_{j≠i} r_o(τ_j)
                     grpo: (r_o(τ_i) - mean R_o) / (std R_o + eps)
        A_S(a_t^i) = the same estimator over R_s = all step rewards of the group (Eq. 4, the union
                     over i, t; rloo: r - mean of the group's other steps)
        A(a_t^i)   = A_E(τ_i) + α A_S(a_t^i)

    outcomes [N], traj_group [N], step_rewards [S], traj_index [S] in 0..N-1. std is unbiased. A
    group with one trajectory gives 0 for both terms. Returns [S] float64.
    """
    if estimator not in ("rloo", "grpo"):
        raise ValueError(f"estimator must be 'rloo' or 'grpo', got {estimator!r}")
    outcomes = torch.as_tensor(outcomes, dtype=torch.float64).detach()
    step_rewards = torch.as_tensor(step_rewards, dtype=torch.float64).detach()
    grp = torch.as_tensor(traj_group, dtype=torch.long)
    idx = torch.as_tensor(traj_index, dtype=torch.long)
    adv_episode = torch.zeros_like(outcomes)
    adv_step = torch.zeros_like(step_rewards)
    step_group = grp[idx]
    for g in torch.unique(grp):
        in_group = grp == g
        if int(in_group.sum()) < 2:
            continue  # a group of one: no counterfactual, advantage 0
        adv_episode[in_group] = _baseline(outcomes[in_group], estimator, eps)  # Eq. 3
        steps = step_group == g
        if int(steps.sum()) >= 2:
            adv_step[steps] = _baseline(step_rewards[steps], estimator, eps)  # Eq. 4
    return adv_episode[idx] + alpha * adv_step  # Eq. 5: A = A_E + α A_S


def normalize_step_rewards(step_rewards, eps=1e-6):
    """Official `istar_norm: batch_norm`: r / (max |r| + eps) over the whole batch, in [-1, 1]."""
    r = torch.as_tensor(step_rewards)
    if r.numel() == 0:
        return r
    return r / (r.abs().max() + eps)


def istar_turn_advantages(group, traj, outcome, prm_log_ratios, beta=0.05, alpha=1.0,
                          estimator="rloo", normalize="batch_max_abs", eps=1e-6):
    """The iStar advantage of every turn of a batch (Eq. 1, 3-5), from plain per-turn arrays.

    group[i], traj[i]: the turn's group (the trajectories of one task) and trajectory; a
    trajectory's turns come in order. outcome[i]: r_o of its trajectory (the return minus the
    invalid-action penalty). prm_log_ratios[i]: the turn's token log-ratios log π_φ - log π_θold (a
    1-D tensor, scored by the PRM). Step reward r = β Σ_tokens log-ratio (Eq. 1), over max |r| of
    the batch (normalize "batch_max_abs", official, with its own ε 1e-6; "none" keeps r); the
    `estimator` ("rloo" or "grpo", `eps` in its std) on both levels (Eq. 3-4). Returns float64 [N]:
    A = A_E + α A_S  (Eq. 5).

    One task, three trajectories (β = 0.05, α = 1, RLOO). τ0 succeeds (r_o = 1) in two turns, τ1
    and τ2 fail (0) in one. Log-ratios τ0 [1, 1], [2, 2]; τ1 [-2, -2]; τ2 [0, 2] -> r = 0.1, 0.2,
    -0.2, 0.1, over max |r| = 0.2: 0.5, 1, -1, 0.5. A_E = r_o - mean of the others: 1, -0.5, -0.5.
    A_S = r - mean of the group's other three steps (sum 1): 1/3, 1, -5/3, 1/3. A = A_E + A_S: τ2
    failed, but the PRM liked its step: -0.167 where RLOO (α = 0) gives -0.5.

    >>> ratios = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0]), torch.tensor([-2.0, -2.0]),
    ...           torch.tensor([0.0, 2.0])]
    >>> adv = istar_turn_advantages(group=[0, 0, 0, 0], traj=[0, 0, 1, 2],
    ...                             outcome=[1.0, 1.0, 0.0, 0.0], prm_log_ratios=ratios)
    >>> adv.round(3) + 0.0
    array([ 1.333,  2.   , -2.167, -0.167])
    """
    if normalize not in ("batch_max_abs", "none"):
        raise ValueError(f"normalize: 'batch_max_abs' or 'none', not {normalize!r}")
    number, first_turn = {}, []  # trajectories numbered 0, 1, ... in order of first appearance
    for i, key in enumerate(zip(group, traj)):
        if key not in number:
            number[key] = len(number)
            first_turn.append(i)
    traj_index = [number[key] for key in zip(group, traj)]
    group_number = {g: n for n, g in enumerate(dict.fromkeys(group))}  # any hashable group id
    traj_group = [group_number[group[i]] for i in first_turn]
    traj_outcome = [float(outcome[i]) for i in first_turn]
    step_rewards = implicit_turn_rewards(prm_log_ratios, beta).double()  # Eq. 1
    if normalize == "batch_max_abs":
        step_rewards = normalize_step_rewards(step_rewards)
    adv = istar_advantages(traj_outcome, traj_group, step_rewards, traj_index, alpha, estimator,
                           eps)  # Eq. 3-5
    return adv.numpy()


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
    actions: list = field(default_factory=list)  # per turn: decoded text
    observations: list = field(default_factory=list)
    invalid: list = field(default_factory=list)
    success: bool = False
    env_return: float = 0.0

    @property
    def length(self) -> int:
        return len(self.actions)


def rollout(model, tok, new_env, task_ids, group_ids, temperature, max_new_tokens, greedy=False,
            noise_keys=None, progress=None):
    """One episode per task id (policy adapter), one batched generate a turn; with `noise_keys`
    (evaluation) turn t samples with `CommonNoise` of (*key, t)."""
    envs_, episodes = [], []
    for i, (task, g) in enumerate(zip(task_ids, group_ids)):
        envs_.append(new_env())
        envs_[-1].reset(task)
        episodes.append(Episode(traj_id=i, group_id=int(g), task_id=str(task)))
    model.set_adapter("default")
    model.eval()
    stops = stop_ids(model, tok)
    while active := [i for i, e in enumerate(envs_) if not e.done]:
        prompts = [encode(tok, render_prompt(tok, envs_[i].messages())) for i in active]
        keys = None if noise_keys is None else [(*noise_keys[i], len(episodes[i].completions))
                                                for i in active]
        completions = generate(model, tok, prompts, temperature, max_new_tokens, greedy=greedy,
                               noise_keys=keys)
        for k, i in enumerate(active):
            ep = episodes[i]
            step = envs_[i].step(completion_text(tok, completions[k], stops))
            ep.prompts.append(prompts[k])
            ep.completions.append(completions[k])
            ep.actions.append(tok.decode(completions[k], skip_special_tokens=True))
            ep.observations.append(step.observation)
            ep.invalid.append(bool(step.info.get("invalid", False)))
            ep.env_return += float(step.reward)
            if step.done:
                ep.success = bool(step.info.get("success", False))
        if progress is not None:
            progress.update(sum(envs_[i].done for i in active))
    return episodes


def trajectory_outcomes(episodes, invalid_penalty, threshold=None):
    """Per trajectory: r_o = return - invalid_penalty * invalid actions, whether it is a DPO
    positive (threshold None: it succeeded; else r_o > threshold), its group."""
    outcomes = torch.tensor([ep.env_return - invalid_penalty * sum(ep.invalid) for ep in episodes],
                            dtype=torch.float64)
    positive = (outcomes > threshold if threshold is not None
                else torch.tensor([ep.success for ep in episodes]))
    return outcomes, positive, torch.tensor([ep.group_id for ep in episodes])


def compute_advantages(episodes, args, signal=None):
    """One Sample per turn with its advantage (the kernel), credit stats; `signal`: the PRM's
    per-turn log-ratios (None: A = A_E). Token granularity (Table 3): one row per token."""
    outcomes, positive, _ = trajectory_outcomes(episodes, args.invalid_penalty,
                                                args.positive_threshold)
    turns = [(i, ep, t) for i, ep in enumerate(episodes) for t in range(ep.length)]
    log_ratios = signal if signal is not None else [torch.zeros(0)] * len(turns)
    token_level = args.step_reward_granularity == "token" and signal is not None
    rows = [len(ep.completions[t]) if token_level else 1 for _, ep, t in turns]  # kernel rows
    def per_row(values):
        return [v for v, n in zip(values, rows) for _ in range(n)]
    adv = istar_turn_advantages(
        group=per_row([ep.group_id for _, ep, _ in turns]),
        traj=per_row([ep.traj_id for _, ep, _ in turns]),
        outcome=per_row([float(outcomes[i]) for i, _, _ in turns]),
        prm_log_ratios=([token for r in log_ratios for token in r.reshape(-1, 1)] if token_level
                        else log_ratios),
        beta=args.beta, alpha=args.alpha, estimator=args.estimator,
        normalize=args.step_reward_norm, eps=args.adv_eps)
    samples, start = [], 0
    for (_, ep, t), n in zip(turns, rows):
        a = torch.from_numpy(adv[start:start + n]).float() if token_level else float(adv[start])
        samples.append(Sample(ep.prompts[t], ep.completions[t], ep.group_id, ep.traj_id, t, a))
        start += n
    advs = torch.cat([x.adv if token_level else torch.full((len(x.completion),), x.adv)
                      for x in samples]) if samples else torch.zeros(0)
    return samples, {"credit/adv_abs_mean": float(advs.abs().mean()) if len(advs) else 0.0,
                     "charts/positive_frac": float(positive.float().mean())}


# ----------------------------------------------------------------------------------------------
# 4. Model-side signal, loss and update
# ----------------------------------------------------------------------------------------------
# The PRM's step first: it scores every step (the signal of Eq. 1) and trains on the batch's
# pairs (Eq. 2). Then the log-probs both adapters use, π_θold's, the policy's loss and update.
def prm_log_ratios(model, tok, samples, args):
    """Per sample, its token log-ratios log π_φ - log π_θold under the PRM as it is, no gradient."""
    prm_lp = token_logprobs(model, tok, samples, "prm", args.micro_batch_size, args.temperature)
    return [p - x.old for p, x in zip(prm_lp, samples)]


def paired_batch(samples, traj_success, traj_group):
    """The PRM's data of one iteration: the steps of the trajectories in a pair, renumbered 0..n-1
    in order, with those trajectories' success and group."""
    in_pair = traj_in_pair(traj_success, traj_group)
    keep = [i for i in range(len(traj_success)) if bool(in_pair[i])]
    new_id = {old: new for new, old in enumerate(keep)}
    return {"samples": [dataclasses.replace(x, traj=new_id[x.traj]) for x in samples
                        if x.traj in new_id],
            "success": torch.as_tensor(traj_success)[keep],
            "group": torch.as_tensor(traj_group)[keep]}


def merge_batches(batches):
    """Paired batches of several iterations as one, trajectory and group ids offset past the
    batches before, so no pair crosses iterations."""
    samples, succ, grp, n_traj, n_grp = [], [], [], 0, 0
    for b in batches:
        samples += [dataclasses.replace(x, traj=x.traj + n_traj) for x in b["samples"]]
        succ.append(b["success"])
        grp.append(torch.as_tensor(b["group"], dtype=torch.long) + n_grp)
        n_traj += len(b["success"])
        n_grp = int(grp[-1].max()) + 1 if len(grp[-1]) else n_grp
    return {"samples": samples,
            "success": torch.cat(succ) if succ else torch.zeros(0, dtype=torch.bool),
            "group": torch.cat(grp) if grp else torch.zeros(0, dtype=torch.long)}


def prm_update(model, tok, optimizer, samples, traj_success, traj_group, args, replay=()):
    """The PRM's step (Alg. 1): score every step (Eq. 1), then DPO steps (Eq. 2) on this batch's and
    `replay`'s pairs. Returns (log-ratios, step rewards, stats, `paired_batch`)."""
    device = next(model.parameters()).device
    log_ratios = prm_log_ratios(model, tok, samples, args)
    step_rewards = implicit_turn_rewards(log_ratios, args.beta)  # Eq. 1
    n_pairs = int(preference_pairs(traj_success, traj_group).shape[0])
    loss = trajectory_dpo_loss(step_rewards.double(), [x.traj for x in samples], traj_success,
                               traj_group, args.dpo_reduce)  # scored before the PRM trains on them
    stats = {"pairs": n_pairs, "loss": float(loss) if n_pairs else math.nan, "grad_norm": 0.0}
    in_pair = traj_in_pair(traj_success, traj_group)
    paired = [j for j, x in enumerate(samples) if bool(in_pair[x.traj])]  # only they have dL/dr
    mine = paired_batch(samples, traj_success, traj_group)
    batch = merge_batches([mine, *replay])  # this iteration's pairs first
    train = batch["samples"]
    if not train:
        model.set_adapter("default")
        return log_ratios, step_rewards, stats, mine
    train_index = torch.tensor([x.traj for x in train], dtype=torch.long)
    train_rewards = step_rewards[paired]
    order = sorted(range(len(train)), key=lambda i: seq_len(train[i]))
    for k in range(args.prm_updates_per_iteration):
        if k > 0:  # dL/dr with the PRM as it is now
            train_rewards = implicit_turn_rewards(prm_log_ratios(model, tok, train, args),
                                                  args.beta)
        elif replay:  # this batch's steps are scored; the earlier ones' under the PRM as it is now
            earlier = prm_log_ratios(model, tok, train[len(paired):], args)
            train_rewards = torch.cat([train_rewards, implicit_turn_rewards(earlier, args.beta)])
        # two passes: g_s = dL/dr_s without graph, then backpropagate Σ_s g_s r_s per micro-batch
        leaf = train_rewards.detach().double().requires_grad_(True)
        (grad,) = torch.autograd.grad(trajectory_dpo_loss(
            leaf, train_index, batch["success"], batch["group"], args.dpo_reduce), leaf)
        model.set_adapter("prm")
        model.train()
        optimizer.zero_grad(set_to_none=True)
        for s in range(0, len(order), args.micro_batch_size):
            chunk = [train[i] for i in order[s:s + args.micro_batch_size]]
            lp, m = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                        [x.completion for x in chunk], temperature=args.temperature)
            rewards = implicit_step_rewards(lp, _padded(chunk, "old", lp.shape[1], device), m,
                                            args.beta)  # Eq. 1 with graph
            (rewards * grad[order[s:s + len(chunk)]].to(rewards.dtype).to(device)).sum().backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, args.prm_max_grad_norm))
        optimizer.step()
    model.set_adapter("default")
    model.eval()
    return log_ratios, step_rewards, stats, mine


@torch.no_grad()
def token_logprobs(model, tok, samples, adapter, micro_batch_size, temperature=1.0):
    """Per-sample token log-probs under one adapter ("default" or "prm"), no gradient, in
    length-sorted micro-batches (both adapters' passes batch alike)."""
    model.set_adapter(adapter)
    model.eval()
    out = [None] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: seq_len(samples[i]))
    with merged_lora(model):  # as when sampling: one matmul per layer
        for s in range(0, len(order), micro_batch_size):
            chunk = [samples[i] for i in order[s:s + micro_batch_size]]
            lp, _ = completion_logprobs(model, tok, [x.prompt for x in chunk],
                                        [x.completion for x in chunk], temperature=temperature)
            for j, (i, x) in enumerate(zip(order[s:s + micro_batch_size], chunk)):
                out[i] = lp[j, lp.shape[1] - len(x.completion):].float().cpu()
    return out


def old_logprob_turns(model, tok, episodes, args):
    """One Sample per turn with π_θold's log-probs in `old`, recomputed in the PRM's batching: log
    π_φ - log π_θold is then exactly 0 while the PRM equals the policy (sampling's differ)."""
    turns = [Sample(ep.prompts[t], ep.completions[t], ep.group_id, ep.traj_id, t)
             for ep in episodes for t in range(ep.length)]
    old = token_logprobs(model, tok, turns, "default", args.micro_batch_size, args.temperature)
    for x, o in zip(turns, old):
        x.old = o
    return turns


def policy_loss(logp, old_logp, adv, weights, clip_eps, dual_clip, step_mask=None):
    """Clipped surrogate (Eq. 6), dual clip: Σ weights * max(-r A, -clip(r) A), at most -c A if A <
    0; with `step_mask` the ratio is the step's, exp(mean of logp - old), as s * π_t / sg(π_t)."""
    if step_mask is not None:
        n = step_mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_s = ((logp - old_logp) * step_mask).sum(-1, keepdim=True) / n
        ratio = torch.exp(log_s.detach() + logp - logp.detach())  # value s, gradient of π_t
    else:
        ratio = torch.exp(logp - old_logp)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss_tok = torch.maximum(l1, l2)
    if dual_clip and dual_clip > 1.0:
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, -adv * dual_clip), loss_tok)
    return (loss_tok * weights).sum(), (l2 > l1).float(), ratio


def update(model, tok, optimizer, samples, args, rng):
    """`--num-minibatches` policy steps: step-level ratio and step-mean (`--ratio-level step`,
    Eq. 6) or per-token ratios and token-mean (`token`)."""
    device = next(model.parameters()).device
    model.set_adapter("default")
    model.train()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stats = {k: [] for k in ("policy_loss", "approx_kl", "clip_frac", "grad_norm")}
    for minibatch_idx in np.array_split(rng.permutation(len(samples)),
                                        max(1, args.num_minibatches)):
        # length-sorted: a sum over micro-batches, so only the padding changes, not the gradient
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
            adv = (_padded(chunk, "adv", lp.shape[1], device) if torch.is_tensor(chunk[0].adv)
                   else m * torch.tensor([float(x.adv) for x in chunk], device=device)[:, None])
            step = args.ratio_level == "step"  # each step weighs 1 / steps, over its tokens
            w = m / (m.sum(-1, keepdim=True).clamp(min=1.0) * len(minibatch)) if step else m / ntok
            loss, clipped, _ = policy_loss(lp, old, adv, w, args.clip_eps, args.dual_clip,
                                           step_mask=m if step else None)
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
def evaluate(model, tok, new_env, tasks, args):
    """Sampled episodes (common random numbers keyed by (seed, episode): `write_summary` pairs the
    first and last evaluation) and greedy ones on the test tasks."""
    with tqdm(total=2 * len(tasks), desc="evaluation", unit="episode", leave=False,
              dynamic_ncols=True) as bar:
        episodes = rollout(model, tok, new_env, tasks, [0] * len(tasks), args.eval_temperature,
                           args.max_new_tokens, noise_keys=[(args.seed, i) for i in
                                                            range(len(tasks))], progress=bar)
        greedy = rollout(model, tok, new_env, tasks, [0] * len(tasks), 1.0, args.max_new_tokens,
                         greedy=True, progress=bar)
    out, n_turns = {}, sum(ep.length for ep in episodes)
    out["eval/success_episodes"] = [float(ep.success) for ep in episodes]
    for key, eps in (("", episodes), ("_greedy", greedy)):
        out[f"eval/success{key}"], out[f"eval/success{key}_se"] = mean_se([e.success for e in eps])
        out[f"eval/return{key}"] = float(np.mean([ep.env_return for ep in eps]))
    out["eval/episode_length"] = float(np.mean([ep.length for ep in episodes]))
    out["eval/invalid_rate"] = float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1))
    logged = ([("sampled", ep) for ep in episodes[: args.num_logged_episodes]]
              + [("greedy", ep) for ep in greedy[: max(1, args.num_logged_episodes // 2)]])
    return out, [{"tag": tag, "task_id": ep.task_id, "success": ep.success, "return": ep.env_return,
                  "turns": [{"action": a, "observation": o, "invalid": v}
                            for a, o, v in zip(ep.actions, ep.observations, ep.invalid)]}
                 for tag, ep in logged]


def iteration_row(episodes, samples, ustats, cstats, prm_stats, seconds):
    """One iteration's metrics: rollouts, losses, credit and PRM statistics, seconds per phase."""
    n_turns = sum(ep.length for ep in episodes)
    row = {
        "charts/success": float(np.mean([ep.success for ep in episodes])),
        "charts/return": float(np.mean([ep.env_return for ep in episodes])),
        "charts/episode_length": float(np.mean([ep.length for ep in episodes])),
        "charts/invalid_rate": float(sum(sum(ep.invalid) for ep in episodes) / max(n_turns, 1)),
        **{f"losses/{k}": v for k, v in ustats.items()}, **cstats,
        **{f"prm/{k}": v for k, v in prm_stats.items()},
        **{f"perf/{k}_seconds": v for k, v in seconds.items()},
        "perf/tokens_per_second": (sum(len(x.completion) for x in samples)
                                   / max(seconds["rollout"], 1e-9)),
        "perf/samples": len(samples),
    }
    if torch.cuda.is_available():
        row["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


# ----------------------------------------------------------------------------------------------
# 6. Main loop
# ----------------------------------------------------------------------------------------------
def adapter_params(model, adapter):
    """The LoRA parameters of one named adapter (by name, whichever adapter is active)."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n]


def make_env(args):
    """`args` with every default set (DEFAULTS, the PRM's lr 2x the policy's, the env's threshold)
    and checked, the env factory, one probe instance, the env options."""
    import envs
    from common.models import UserError, policy_prompt_options

    args = with_defaults(args)
    by_rule = {"prm_learning_rate": 2 * args.learning_rate,
               "positive_threshold": POSITIVE_THRESHOLD_BY_ENV.get(args.env_id)}
    args = dataclasses.replace(args, **{k: v for k, v in by_rule.items()
                                        if getattr(args, k) is None})
    check_args(args)
    # a tiny policy was trained on prompts rendered with its recipe's env options: use the same ones
    kw = dict(policy_prompt_options(args.model_name, args.env_id, args.tiny_preset).env_kwargs)
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
    return args, new_env, probe, kw


def check_args(args):
    """User errors in the resolved arguments -> UserError, one line that says what to do."""
    import envs
    from common.models import UserError

    for ok, message in [
        (args.group_size >= 2,
         "--group-size must be >= 2 (advantages compare the trajectories of a task)"),
        (min(args.tasks_per_iteration, args.micro_batch_size, args.max_new_tokens) >= 1,
         "--tasks-per-iteration, --micro-batch-size and --max-new-tokens must be >= 1"),
        (args.num_iterations >= 0, "--num-iterations must be >= 0"),
        (args.history is None or args.history >= 0, "--history must be >= 0 (or None)"),
        (args.beta > 0, "--beta must be > 0 (it scales the implicit reward, paper: 0.05)"),
        (args.prm_updates_per_iteration >= 1,
         "--prm-updates-per-iteration must be >= 1 (--alpha 0 turns the PRM off)"),
        (args.prm_replay >= 0, "--prm-replay must be >= 0"),
        (args.prm_learning_rate > 0, "--prm-learning-rate must be > 0"),
        (args.env_id in envs.available(), f"env {args.env_id!r} is not available in this "
         f"checkout; available env ids: {', '.join(envs.available()) or 'none'}")]:
        if not ok:
            raise UserError(message)


def main(args: Args):
    from common.models import add_adapter, load_policy

    t_start = time.time()
    if args.resume:
        args = resumed_args(args)
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    rng = seed_everything(args.seed)
    args, new_env, probe, env_kwargs = make_env(args)
    train_tasks = list(probe.task_ids("train"))
    test_tasks = list(probe.task_ids("test"))[: args.eval_num_tasks or None]  # 0: all of them
    lora = dict(lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout)
    model, tok = load_policy(args.model_name, env_id=args.env_id, tiny_preset=args.tiny_preset,
                             load_in_4bit=args.load_in_4bit, **lora, static_cache=args.static_cache,
                             activation_checkpointing=args.activation_checkpointing)
    add_adapter(model, "prm", **lora)  # the PRM π_φ: a second LoRA adapter on the same base model
    model.set_adapter("default")
    adam = torch.optim.AdamW
    optimizers = {"policy": adam(adapter_params(model, "default"), lr=args.learning_rate,
                                 weight_decay=args.weight_decay),
                  "prm": adam(adapter_params(model, "prm"), lr=args.prm_learning_rate,
                              weight_decay=args.prm_weight_decay)}
    run_dir, logger = start_run(args, {
        "env_kwargs": env_kwargs, "max_turns_resolved": probe.max_turns,
        "num_train_tasks": len(train_tasks), "num_test_tasks": len(test_tasks)})

    def run_eval(it):
        t0 = time.time()
        row, records = evaluate(model, tok, new_env, test_tasks, args)
        row["perf/eval_seconds"] = time.time() - t0
        logger.log_samples(it, records)
        tqdm.write(eval_line(it, row))
        return row

    replay = deque(maxlen=args.prm_replay)  # the paired batches of the last --prm-replay iterations
    start = 0
    if args.resume:
        start, (first_eval, last_eval), state = load_checkpoint(run_dir, model, optimizers, rng)
        replay.extend(dict(b, samples=[Sample(**x) for x in b["samples"]]) for b in state["replay"])
    else:
        first_eval = last_eval = run_eval(0)
        logger.log(0, first_eval)
    bar = tqdm(range(start + 1, args.num_iterations + 1), desc="istar", dynamic_ncols=True)
    for it in bar:
        t0 = time.time()
        chosen = rng.choice(len(train_tasks), size=args.tasks_per_iteration,
                            replace=len(train_tasks) < args.tasks_per_iteration)
        tasks = [train_tasks[i] for i in chosen for _ in range(args.group_size)]
        groups = [g for g in range(len(chosen)) for _ in range(args.group_size)]
        episodes = rollout(model, tok, new_env, tasks, groups, args.temperature,
                           args.max_new_tokens)
        t1 = time.time()
        turns = old_logprob_turns(model, tok, episodes, args)  # π_θold's log-probs, taken once
        t2 = time.time()
        prm_signal, prm_stats = None, {}
        if args.alpha != 0:  # the PRM scores every step (Eq. 1), then takes its DPO step (Eq. 2)
            _, positive, traj_group = trajectory_outcomes(episodes, args.invalid_penalty,
                                                          args.positive_threshold)
            prm_signal, _, prm_stats, mine = prm_update(model, tok, optimizers["prm"], turns,
                                                        positive, traj_group, args, replay)
            replay.appendleft(mine)  # newest first; the deque keeps the last --prm-replay
        t3 = time.time()
        samples, cstats = compute_advantages(episodes, args, signal=prm_signal)  # Eq. 3-5
        for x, turn in zip(samples, turns):
            x.old = turn.old
        t4 = time.time()
        ustats = update(model, tok, optimizers["policy"], samples, args, rng)  # Eq. 6
        t5 = time.time()
        seconds = {"rollout": t1 - t0, "old_logprob": t2 - t1, "prm": t3 - t2, "credit": t4 - t3,
                   "update": t5 - t4, "iteration": t5 - t0}
        row = iteration_row(episodes, samples, ustats, cstats, prm_stats, seconds)
        if args.eval_every and (it % args.eval_every == 0 or it == args.num_iterations):
            last_eval = run_eval(it)
            row.update(last_eval)
        logger.log(it, row)
        if args.checkpoint_every and it % args.checkpoint_every == 0:
            # the replayed samples as dicts: checkpoint.pt loads without this file's classes
            state = {"replay": [dict(b, samples=[asdict(x) for x in b["samples"]]) for b in replay]}
            save_checkpoint(run_dir, it, model, optimizers, rng, (first_eval, last_eval), state)
            if args.save_model:
                save_adapter(model, run_dir)
        bar.set_postfix(success=f"{row['charts/success']:.2f}",
                        loss=f"{row['losses/policy_loss']:.3f}",
                        prm_loss=f"{row.get('prm/loss', math.nan):.3f}")
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
