"""GraphGPO in verl: an advantage estimator registered with `register_adv_est`.

Rows are turns (verl-agent's layout: one row per env step, the response = that turn's action).
verl gives the estimator the token tensors and the group ids (`index` = non_tensor_batch["uid"]);
GraphGPO also needs, per row, the trajectory id, the turn's position, the state keys before and
after the turn, the trajectory's success and the invalid flag. The rollout puts them in
non_tensor_batch; the trainer passes non_tensor_batch to the estimator (verl 0.9.1 forwards it
only to "gdpo", so this is a one-line change in the trainer: `compute_advantage_with_turns`).
Hyperparameters come from the algorithm config: `+algorithm.graphgpo.omega=0.8`.

Run by benchmarks/porting_check.py (the check below the snippet): docs/porting_check.md.
"""

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, register_adv_est

from graphgpo import graphgpo_advantages

TURN_FIELDS = ("traj_uid", "turn", "state", "next_state", "success", "invalid")


@register_adv_est("graphgpo")
def compute_graphgpo_advantage(token_level_rewards, response_mask, index=None, config=None,
                               non_tensor_batch=None, **kwargs):
    """GraphGPO advantage of every row (one row = one turn), broadcast over its response tokens.

    index: the group of each row (verl's `uid`: the rollouts of one task). non_tensor_batch: the
    per-row fields TURN_FIELDS. config: verl's algorithm config; its `graphgpo` entry holds the
    kernel's keyword arguments (omega is required). Returns (advantages, returns), [bs, L] each.
    """
    nt = non_tensor_batch
    if nt is None or index is None:
        raise ValueError("graphgpo needs the per-turn fields: call it with index=uid and "
                         "non_tensor_batch=data.non_tensor_batch (compute_advantage_with_turns)")
    missing = [k for k in TURN_FIELDS if k not in nt]
    if missing:
        raise ValueError(f"graphgpo: non_tensor_batch lacks {missing}; the rollout must add them")
    opts = dict((config.get("graphgpo", None) if config is not None else None) or {})
    if "omega" not in opts:
        raise ValueError("graphgpo: set the distance discount, e.g. +algorithm.graphgpo.omega=0.8")
    # The kernel reads each trajectory's turns in order; verl's balance_batch reorders the rows.
    order = np.argsort(np.asarray(nt["turn"], dtype=np.int64), kind="stable")
    adv = np.empty(len(order))
    adv[order] = graphgpo_advantages(
        group=np.asarray(index)[order], traj=nt["traj_uid"][order], state=nt["state"][order],
        next_state=nt["next_state"][order], success=nt["success"][order].astype(bool),
        invalid=nt["invalid"][order].astype(bool), **opts)
    scores = torch.as_tensor(adv, dtype=torch.float32, device=response_mask.device)
    scores = scores.unsqueeze(-1) * response_mask  # the turn's advantage on each of its tokens
    return scores, scores


def compute_advantage_with_turns(data, config):
    """What verl's `compute_advantage` does for a registered estimator, plus the per-row fields:
    the trainer calls this where it calls `compute_advantage` (verl-agent has such a branch for
    GiGPO)."""
    estimator = get_adv_estimator_fn(config.adv_estimator)
    advantages, returns = estimator(
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"], index=data.non_tensor_batch["uid"],
        config=config, non_tensor_batch=data.non_tensor_batch)
    data.batch["advantages"], data.batch["returns"] = advantages, returns
    return data


# Use: import this module in the process that runs the trainer, the Ray actor TaskRunner (not
# the script you start): Ray's worker_process_setup_hook, e.g. verl_v1.py's setup; run with
#   algorithm.adv_estimator=graphgpo +algorithm.graphgpo.omega=0.8
# and in the trainer, where it calls compute_advantage(batch, ...):
#   batch = compute_advantage_with_turns(batch, self.config.algorithm)


# ---- check (not part of the snippet) ----------------------------------------------------------
def check():
    """verl's registry and DataProto on a hand-made batch: the result equals the kernel."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    torch.manual_seed(0)
    # Two tasks. Task A: graphgpo.py's worked example (three trajectories from state a);
    # task B: one win and one loss that revisits its start.
    turns = [  # (uid, traj_uid, turn, state, next_state, success, invalid)
        ("A", "A0", 0, "a", "b", True, False), ("A", "A0", 1, "b", "win", True, False),
        ("A", "A1", 0, "a", "c", False, False), ("A", "A1", 1, "c", "c", False, False),
        ("A", "A2", 0, "a", "b", False, False), ("A", "A2", 1, "b", "d", False, False),
        ("B", "B0", 0, "x", "y", True, False), ("B", "B0", 1, "y", "z", True, False),
        ("B", "B1", 0, "x", "y", False, False), ("B", "B1", 1, "y", "x", False, False),
        ("B", "B1", 2, "x", "q", False, True)]
    cols = list(zip(*turns))
    omega = 0.5
    kernel = graphgpo_advantages(group=cols[0], traj=cols[1], state=cols[3], next_state=cols[4],
                                 success=cols[5], invalid=cols[6], omega=omega)
    worked = [1.732, 1.862, -1.732, -0.577, 0.0, -1.284]  # graphgpo_advantages' doctest
    assert np.allclose(kernel[:6], worked, atol=1e-3), kernel
    n, L = len(turns), 6
    lengths = torch.randint(1, L + 1, (n,))
    response_mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(n, L)  # verl's own reward: success on a trajectory's last token
    for i, t in enumerate(turns):
        last = i + 1 == n or turns[i + 1][1] != t[1]
        rewards[i, int(lengths[i]) - 1] = float(t[5] and last)
    perm = torch.randperm(n)  # rows in any order, as after balance_batch
    data = DataProto.from_dict(
        tensors={"responses": torch.randint(0, 100, (n, L))[perm], "response_mask":
                 response_mask[perm], "token_level_rewards": rewards[perm]},
        non_tensors={k: np.array(v, dtype=object)[perm.numpy()] for k, v in zip(
            ("uid",) + TURN_FIELDS, cols)})
    config = OmegaConf.create({"adv_estimator": "graphgpo", "graphgpo": {"omega": omega}})

    assert get_adv_estimator_fn("graphgpo") is compute_graphgpo_advantage
    print("registry: get_adv_estimator_fn('graphgpo') returns the registered estimator")
    out = compute_advantage_with_turns(data, config)
    adv, mask = out.batch["advantages"], out.batch["response_mask"]
    expected = torch.tensor(kernel, dtype=torch.float32)[perm].unsqueeze(-1) * mask
    assert torch.allclose(adv, expected, atol=1e-6), (adv, expected)
    assert torch.equal(out.batch["returns"], adv)
    print(f"advantages [{n}, {L}] (rows shuffled) == kernel per turn x response_mask: max |diff| "
          f"{float((adv - expected).abs().max()):.1e}")
    print("  uid traj turn  state->next   success invalid  kernel   its row: tokens x value")
    inv = torch.argsort(perm)
    for i, t in enumerate(turns):
        row = adv[inv[i]][mask[inv[i]] > 0]
        assert torch.all(row == row[0])
        k, a = (round(float(x), 3) + 0.0 for x in (kernel[i], row[0]))  # + 0.0: no "-0.000"
        print(f"  {t[0]:>3} {t[1]:>4} {t[2]:>4}  {t[3]:>5}->{t[4]:<5} {t[5]!s:>7} {t[6]!s:>7} "
              f"{k:7.3f}   {len(row)} x {a:.3f}")
    try:  # verl's own compute_advantage, unchanged: it does not pass the per-row fields
        compute_advantage(data, adv_estimator="graphgpo", config=config)
    except ValueError as e:
        print(f"verl's own compute_advantage does not pass them: ValueError '{str(e)[:30]}...'")
    else:
        raise AssertionError("verl's compute_advantage now forwards non_tensor_batch: simplify")
    print("PASS graphgpo_verl")


if __name__ == "__main__":
    torch.set_num_threads(1)
    check()
