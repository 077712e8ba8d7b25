"""iStar in verl: an estimator that reads the PRM's log-ratios, and the PRM as a second actor whose
trajectory-DPO step is a verl actor update.

Rows are turns (verl-agent's layout). iStar needs per row the trajectory id, the turn, the
trajectory's outcome r_o and success, and the turn's token log-ratios log π_φ − log π_θold. verl
has π_θold's log-probs (`old_log_probs`, the actor's compute_log_prob); the PRM π_φ (in istar.py a
second LoRA adapter on the policy's base) it has not: here a second actor worker group built from
the same base model. Its compute_log_prob gives `prm_log_probs`, the estimator turns them into the
kernel's log-ratios, and its update_actor takes the PRM's DPO step (Eq. 2). That loss couples the
trajectories of a group, so it is no per-row loss, but its gradient is a per-row one: with
g_s = dL/dr_s at the current step rewards r_s = β Σ_tokens (log π_φ − log π_θold),
∇L = Σ_s β g_s Σ_tokens ∇log π_φ (istar.py's prm_update takes the same two passes). So the step
is a verl actor update with advantages −β g_s on the turn's tokens, policy loss "gpg" (−A log π:
no ratio, no clip) and loss_agg_mode "token-sum". `compute_advantage_with_turns` is
graphgpo_verl.py's, passing `batch` too.

Run by benchmarks/porting_check.py (the check below the snippet): docs/porting_check.md.
"""

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, register_adv_est

from istar import istar_turn_advantages, trajectory_dpo_loss

TURN_FIELDS = ("traj_uid", "turn", "outcome", "success")
LOG_PROBS = ("old_log_probs", "prm_log_probs")  # π_θold (the actor's), π_φ (the PRM worker's)
TOKENS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def _options(config):
    """The algorithm config's `istar` entry: the kernel's keyword arguments and dpo_reduce."""
    opts = dict((config.get("istar", None) if config is not None else None) or {})
    return opts, opts.pop("dpo_reduce", "mean")


@register_adv_est("istar")
def compute_istar_advantage(token_level_rewards, response_mask, index=None, config=None,
                            non_tensor_batch=None, batch=None, **kwargs):
    """iStar advantage of every row (one row = one turn), A = A_E + α A_S (Eq. 5), broadcast over
    its response tokens. index: verl's `uid` (the group); non_tensor_batch: TURN_FIELDS; batch:
    the token log-probs LOG_PROBS. config: verl's algorithm config; its `istar` entry holds the
    kernel's keyword arguments (beta, alpha, estimator, normalize, eps)."""
    nt = non_tensor_batch
    if nt is None or batch is None or index is None:
        raise ValueError("istar needs the per-turn fields and log-probs: call it with index=uid, "
                         "non_tensor_batch and batch (compute_advantage_with_turns)")
    missing = [k for k in TURN_FIELDS if k not in nt]
    missing += [k for k in LOG_PROBS if k not in batch.keys()]
    if missing:
        raise ValueError(f"istar: the batch lacks {missing}")
    opts, _ = _options(config)
    order = np.argsort(np.asarray(nt["turn"], dtype=np.int64), kind="stable")  # turns in order
    group = np.unique(np.asarray(index).astype(str), return_inverse=True)[1]  # integers: kernel's
    ratio = (batch["prm_log_probs"] - batch["old_log_probs"]).double()
    ratios = [r[m > 0] for r, m in zip(ratio, response_mask)]  # the turn's tokens only
    adv = np.empty(len(order))
    adv[order] = istar_turn_advantages(
        group=group[order], traj=nt["traj_uid"][order],
        outcome=nt["outcome"][order].astype(float), prm_log_ratios=[ratios[i] for i in order],
        **opts)
    scores = torch.as_tensor(adv, dtype=torch.float32, device=response_mask.device)
    scores = scores.unsqueeze(-1) * response_mask  # the turn's advantage on each of its tokens
    return scores, scores


def istar_prm_batch(data, config):
    """The PRM's DPO step (Eq. 2) as a batch for the PRM worker's update_actor: advantages
    −β dL/dr_s on each turn's tokens, L the trajectory-DPO loss of the batch's success/failure
    pairs within a group, at the log-ratios the advantages used. Returns (batch, L)."""
    opts, reduce = _options(config)
    beta, nt = float(opts.get("beta", 0.05)), data.non_tensor_batch
    mask = data.batch["response_mask"]
    traj = np.unique(nt["traj_uid"].astype(str), return_inverse=True)[1]  # 0..n-1
    first = np.unique(traj, return_index=True)[1]  # a row of each trajectory
    group = np.unique(nt["uid"].astype(str), return_inverse=True)[1]
    log_ratio = data.batch["prm_log_probs"] - data.batch["old_log_probs"]
    rewards = beta * (log_ratio * mask).sum(-1).double().requires_grad_(True)  # Eq. 1, r_s
    loss = trajectory_dpo_loss(rewards, torch.as_tensor(traj),
                               torch.as_tensor(nt["success"][first].astype(bool)),
                               torch.as_tensor(group[first]), reduce)
    (grad,) = torch.autograd.grad(loss, rewards)  # g_s = dL/dr_s
    prm = data.select(batch_keys=list(TOKENS), non_tensor_batch_keys=["uid", "traj_uid"])
    prm.batch["advantages"] = -beta * grad.to(mask.dtype)[:, None] * mask  # "gpg": −A log π_φ
    prm.batch["old_log_probs"] = data.batch["prm_log_probs"]  # π_φ's own: ratio 1
    return prm, float(loss.detach())


def compute_advantage_with_turns(data, config):
    """verl's `compute_advantage` for a registered estimator, plus non_tensor_batch and batch
    (verl 0.9.1 passes them only to "gdpo"): the trainer calls this instead."""
    estimator = get_adv_estimator_fn(config.adv_estimator)
    advantages, returns = estimator(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"], index=data.non_tensor_batch["uid"],
        config=config, non_tensor_batch=data.non_tensor_batch, batch=data.batch)
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data


# Use: the policy with algorithm.adv_estimator=istar +algorithm.istar.beta=0.05
#   +algorithm.istar.alpha=1.0 (+algorithm.istar.dpo_reduce=mean); the PRM: a second actor worker
#   group from the same base model (its own LoRA and optimizer) with actor.policy_loss.loss_mode=gpg
#   actor.loss_agg_mode=token-sum actor.ppo_epochs=1 actor.ppo_mini_batch_size=<the whole batch>
#   actor.use_kl_loss=False actor.entropy_coeff=0 actor.optim.lr=<PRM lr>. In the trainer's step,
#   once old_log_probs are in the batch, instead of compute_advantage(batch, ...):
#     batch.batch["prm_log_probs"] = <old_log_probs of _compute_old_log_prob(batch), PRM group>
#     batch = compute_advantage_with_turns(batch, self.config.algorithm)  # Eq. 1, 3-5
#     prm_batch, dpo_loss = istar_prm_batch(batch, self.config.algorithm)  # Eq. 2
#     <the PRM group's update_actor(prm_batch)>                             # the PRM's DPO step


# ---- check (not part of the snippet) ----------------------------------------------------------
def check():
    """The estimator through verl's registry on a hand-made DataProto; the PRM's DPO step through
    verl's actor loss (ppo_loss) on a tiny random Llama's log-probs, one SGD step."""
    from omegaconf import OmegaConf
    from tiny_lm import tiny_causal_lm, tiny_tokenizer, verl_log_probs, verl_rows
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    from istar import implicit_step_rewards

    torch.manual_seed(0)
    tok = tiny_tokenizer("task go push see left right up down box wall a b c d".split())
    words = list(range(3, len(tok)))
    # (uid, traj_uid, turn, outcome, success, the turn's token log-ratios). Task A: the kernel's
    # doctest (β 0.05: r = 0.1, 0.2, -0.2, 0.1); task B's |r| stay below A's max |r| = 0.2.
    turns = [("A", "A0", 0, 1.0, True, [1.0, 1.0]), ("A", "A0", 1, 1.0, True, [2.0, 2.0]),
             ("A", "A1", 0, 0.0, False, [-2.0, -2.0]), ("A", "A2", 0, 0.0, False, [0.0, 2.0]),
             ("B", "B0", 0, 0.9, True, [0.5]), ("B", "B0", 1, 0.9, True, [1.0, -0.5, 0.5]),
             ("B", "B1", 0, -0.1, False, [-1.0, 0.2])]
    uid, traj, turn, outcome, success, ratios = (list(c) for c in zip(*turns))
    n = len(turns)
    rows = verl_rows([[words[(3 * i + j) % len(words)] for j in range(2 + i % 3)]
                      for i in range(n)],
                     [[words[(5 * i + j) % len(words)] for j in range(len(r))]
                      for i, r in enumerate(ratios)])
    mask = rows["response_mask"]
    old = -torch.rand(n, mask.shape[1]) * 3 * mask
    prm = old + torch.tensor([r + [0.0] * (mask.shape[1] - len(r)) for r in ratios])
    config = OmegaConf.create({"adv_estimator": "istar",
                               "istar": {"beta": 0.05, "alpha": 1.0, "dpo_reduce": "mean"}})
    kernel = istar_turn_advantages(group=[0] * 4 + [1] * 3, traj=traj, outcome=outcome,
                                   prm_log_ratios=[torch.tensor(r) for r in ratios],
                                   beta=0.05, alpha=1.0)
    assert np.allclose(kernel[:4], [1.333, 2.0, -2.167, -0.167], atol=1e-3), kernel  # doctest

    def data_proto(old_lp, prm_lp, perm):
        nts = dict(uid=uid, traj_uid=traj, turn=turn, outcome=outcome, success=success)
        return DataProto.from_dict(
            tensors={**{k: v[perm] for k, v in rows.items()}, "old_log_probs": old_lp[perm],
                     "prm_log_probs": prm_lp[perm], "token_level_rewards": torch.zeros_like(mask)},
            non_tensors={k: np.array(v, dtype=object)[perm.numpy()] for k, v in nts.items()})

    assert get_adv_estimator_fn("istar") is compute_istar_advantage
    print("registry: get_adv_estimator_fn('istar') returns the registered estimator")
    perm = torch.randperm(n)  # rows in any order, as after balance_batch
    out = compute_advantage_with_turns(data_proto(old, prm, perm), config)
    expected = torch.tensor(kernel, dtype=torch.float32)[perm].unsqueeze(-1) * mask[perm]
    adv = out.batch["advantages"]
    assert torch.allclose(adv, expected, atol=1e-5), (adv, expected)
    print(f"advantages [{n}, {mask.shape[1]}] (rows shuffled; log-ratio = prm_log_probs - "
          f"old_log_probs)\n  == kernel per turn x response_mask: max |diff| "
          f"{float((adv - expected).abs().max()):.1e}")
    print("  uid traj turn outcome  log-ratios          kernel  (task A: the kernel's doctest)")
    for t, k in zip(turns, kernel):
        print(f"  {t[0]:>3} {t[1]:>4} {t[2]:>4} {t[3]:7.1f}  {str(t[5]):<18} "
              f"{round(float(k), 3) + 0.0:7.3f}")

    # The PRM's DPO step: π_θold and π_φ two tiny random Llamas (a PRM that has trained already)
    policy, prm_model = tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1)
    with torch.no_grad():
        old = verl_log_probs(policy, rows)[1]
    prm_flat, prm_lp = verl_log_probs(prm_model, rows)  # with the graph: the update's forward
    data = data_proto(old, prm_lp.detach(), torch.arange(n))
    model_kernel = istar_turn_advantages(
        group=[0] * 4 + [1] * 3, traj=traj, outcome=outcome,
        prm_log_ratios=[(p - o)[m > 0].double() for p, o, m in zip(prm_lp.detach(), old, mask)])
    adv = compute_advantage_with_turns(data, config).batch["advantages"]
    assert torch.allclose(adv, torch.tensor(model_kernel).float()[:, None] * mask, atol=1e-5)
    print("with the two models' log-probs: advantages == kernel on their log-ratios")
    prm_batch, dpo_loss = istar_prm_batch(data, config)
    td = left_right_2_no_padding(prm_batch.to_tensordict())  # as verl's _update_actor does
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=n)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=n,
                        loss_agg_mode="token-sum", policy_loss=PolicyLossConfig(loss_mode="gpg"),
                        use_torch_compile=False)
    verl_loss, _ = ppo_loss(actor, {"log_probs": prm_flat}, td)  # the actor worker's loss
    params = [p for p in prm_model.parameters()]
    grads = torch.autograd.grad(verl_loss, params, retain_graph=True)
    # the same DPO loss in one pass, with the graph through the step rewards (istar.py, Eq. 1-2)
    traj_index = torch.tensor([0, 0, 1, 2, 3, 3, 4])
    traj_success = torch.tensor([True, False, False, True, False])
    traj_group = torch.tensor([0, 0, 0, 1, 1])

    def direct_loss(prm_logps):
        rewards = implicit_step_rewards(prm_logps, old, mask, 0.05)
        return trajectory_dpo_loss(rewards, traj_index, traj_success, traj_group)

    reference = direct_loss(prm_lp)
    ref_grads = torch.autograd.grad(reference, params)
    assert abs(float(reference) - dpo_loss) < 1e-5, (float(reference), dpo_loss)
    err = max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in
              zip(grads, ref_grads))
    assert err < 1e-4, err
    print(f"PRM step: verl's ppo_loss (gpg, token-sum, A = -β dL/dr) has the gradient of the\n"
          f"  trajectory-DPO loss (Eq. 2; {len(traj_success)} trajectories, 3 pairs) taken in one "
          f"pass:\n  max relative diff {err:.1e} over {len(params)} tensors")
    opt = torch.optim.SGD(params, lr=0.5)
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    with torch.no_grad():
        after = float(direct_loss(verl_log_probs(prm_model, rows)[1]))
    assert after < dpo_loss, (dpo_loss, after)
    print(f"one SGD step (lr 0.5) of the PRM: DPO loss {dpo_loss:.4f} -> {after:.4f}")
    print("PASS istar_verl")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check()
