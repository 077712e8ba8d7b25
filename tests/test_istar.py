"""iStar: credit functions against hand-computed numbers, the PRM/policy adapter separation, the PRM's
pair accuracy (benchmarks/credit_quality.py's `pair_counts`), and the script end to end on the micro tiny policy."""

import dataclasses
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO, adapter_tensors, assert_adapter_trained, assert_run_outputs, load_benchmark, read_metrics
from istar import (Args, Episode, Sample, implicit_step_rewards, implicit_turn_rewards, istar_advantages,
                   merge_batches, normalize_step_rewards, paired_batch, preference_pairs, prm_log_ratios, prm_update,
                   traj_in_pair, trajectory_dpo_loss, trajectory_outcomes, trajectory_scores, update)

torch.set_num_threads(1)
pair_counts = load_benchmark("credit_quality").pair_counts  # the PRM's pair accuracy, margin and DPO loss


def softplus(x):  # -log sigmoid(d) = log(1 + exp(-d)) = softplus(-d)
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------------------------------------
# Eq. 1: implicit step rewards
# ---------------------------------------------------------------------------------------------
def test_implicit_step_rewards_hand_computed():
    prm = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    old = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # row 0: (-1 + 1.5) + (-2 + 1) = -0.5 (third token masked out although its diff is 9); x beta 0.5 = -0.25
    # row 1: 3 x 0.5 = 1.5; x 0.5 = 0.75
    r = implicit_step_rewards(prm, old, mask, 0.5)
    assert r.tolist() == pytest.approx([-0.25, 0.75])


# ---------------------------------------------------------------------------------------------
# Eq. 2: trajectory DPO
# ---------------------------------------------------------------------------------------------
# Six trajectories, step rewards listed per trajectory:
#   group 0: traj 0 success [0.3, 0.1]            mean 0.2,  sum 0.4
#            traj 1 failure [0.3]                 mean 0.3,  sum 0.3
#            traj 2 failure [-0.1, -0.1, -0.1, -0.1] mean -0.1, sum -0.4
#   group 1: traj 3 success [0.5], traj 4 success [0.0]   (all success: no pair)
#   group 2: traj 5 failure [1.0]                          (all failure: no pair)
# Pairs: (0, 1) and (0, 2) only.
STEP_R = [0.3, 0.1, 0.3, -0.1, -0.1, -0.1, -0.1, 0.5, 0.0, 1.0]
TRAJ_IX = [0, 0, 1, 2, 2, 2, 2, 3, 4, 5]
SUCC = [True, False, False, True, True, False]
GROUP = [0, 0, 0, 1, 1, 2]


def test_preference_pairs_all_cross_pairs_within_groups():
    pairs = {tuple(p) for p in preference_pairs(torch.tensor(SUCC), torch.tensor(GROUP)).tolist()}
    assert pairs == {(0, 1), (0, 2)}
    # two successes x two failures in one group -> 4 pairs; different groups never pair
    pairs = {tuple(p) for p in preference_pairs([True, True, False, False, True, False], [7, 7, 7, 7, 8, 9]).tolist()}
    assert pairs == {(0, 2), (0, 3), (1, 2), (1, 3)}


def test_traj_in_pair():
    # pairs (0, 1) and (0, 2); groups 1 (all success) and 2 (all failure) have none
    assert traj_in_pair(torch.tensor(SUCC), torch.tensor(GROUP)).tolist() == [True, True, True, False, False, False]


def test_paired_batch_and_merge_batches_renumber_by_hand():
    # traj 0 is alone in group 0 (no pair); group 1: traj 1 success, 2 failure; group 2: traj 3 failure, 4 success
    succ, group = torch.tensor([False, True, False, False, True]), torch.tensor([0, 1, 1, 2, 2])
    samples = [Sample([i], [], 0, t, 0) for i, t in enumerate([0, 1, 2, 2, 4, 3])]  # prompt [i]: sample i
    b1 = paired_batch(samples, succ, group)
    # kept trajectories 1, 2, 3, 4 -> 0, 1, 2, 3; sample 0 (traj 0) is dropped, the order is kept
    assert [x.prompt[0] for x in b1["samples"]] == [1, 2, 3, 4, 5] and [x.traj for x in b1["samples"]] == [0, 1, 1, 3, 2]
    assert b1["success"].tolist() == [True, False, False, True] and b1["group"].tolist() == [1, 1, 2, 2]
    assert samples[1].traj == 1  # the caller's samples are not renumbered
    b2 = {"samples": [Sample([], [], 0, 0, 0), Sample([], [], 0, 1, 0)], "success": torch.tensor([True, False]),
          "group": torch.tensor([0, 0])}
    m = merge_batches([b1, b2])
    # b2's trajectories follow b1's 4, its group follows b1's largest group id 2
    assert [x.traj for x in m["samples"]] == [0, 1, 1, 3, 2, 4, 5]
    assert m["group"].tolist() == [1, 1, 2, 2, 3, 3]
    assert m["success"].tolist() == [True, False, False, True, True, False]
    assert {tuple(p) for p in preference_pairs(m["success"], m["group"]).tolist()} == {(0, 1), (3, 2), (4, 5)}


def test_trajectory_scores_mean_and_sum():
    r = torch.tensor(STEP_R, dtype=torch.float64)
    assert trajectory_scores(r, TRAJ_IX, 6, "mean").tolist() == pytest.approx([0.2, 0.3, -0.1, 0.5, 0.0, 1.0])
    assert trajectory_scores(r, TRAJ_IX, 6, "sum").tolist() == pytest.approx([0.4, 0.3, -0.4, 0.5, 0.0, 1.0])
    # a trajectory without steps scores 0
    assert trajectory_scores(r[:2], [0, 0], 2, "mean").tolist() == pytest.approx([0.2, 0.0])


def test_trajectory_dpo_loss_mean_vs_sum_hand_computed():
    r = torch.tensor(STEP_R, dtype=torch.float64, requires_grad=True)
    # mean: diffs 0.2 - 0.3 = -0.1 and 0.2 - (-0.1) = 0.3
    #       loss = (softplus(0.1) + softplus(-0.3)) / 2 = (0.744397 + 0.554355) / 2 = 0.649376
    loss = trajectory_dpo_loss(r, TRAJ_IX, SUCC, GROUP, reduce="mean")
    assert float(loss.detach()) == pytest.approx((softplus(0.1) + softplus(-0.3)) / 2, abs=1e-12)
    assert float(loss.detach()) == pytest.approx(0.649376, abs=1e-6)
    loss.backward()
    # dL/dd_p = -sigmoid(-d_p) / 2 per pair; traj 0's score gets both pairs, each of its 2 steps 1/2 of it:
    #   dL/dr(step of traj 0) = (-sigmoid(0.1) - sigmoid(-0.3)) / 2 / 2
    #   dL/dr(step of traj 1) = +sigmoid(0.1) / 2          (1 step)
    #   dL/dr(step of traj 2) = +sigmoid(-0.3) / 2 / 4     (4 steps)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    g0 = (-sig(0.1) - sig(-0.3)) / 4
    want = [g0, g0, sig(0.1) / 2] + [sig(-0.3) / 8] * 4 + [0.0, 0.0, 0.0]
    assert r.grad.tolist() == pytest.approx(want, abs=1e-12)

    # sum (Eq. 2 literally): diffs 0.4 - 0.3 = 0.1 and 0.4 - (-0.4) = 0.8
    #       loss = (softplus(-0.1) + softplus(-0.8)) / 2 = (0.644397 + 0.371101) / 2 = 0.507749
    loss_sum = trajectory_dpo_loss(torch.tensor(STEP_R), TRAJ_IX, SUCC, GROUP, reduce="sum")
    assert float(loss_sum) == pytest.approx(0.507749, abs=1e-6)


def test_pair_counts_hand_computed():
    # mean scores: traj 0 0.2, traj 1 0.3, traj 2 -0.1 -> pair (0, 1) d = -0.1 (wrong), (0, 2) d = 0.3 (right)
    st = pair_counts(torch.tensor(STEP_R), TRAJ_IX, SUCC, GROUP, "mean")
    assert st["acc"] == pytest.approx(0.5) and st["margin"] == pytest.approx(0.1)
    assert st["loss"] == pytest.approx((softplus(0.1) + softplus(-0.3)) / 2)  # as the DPO loss above
    # sum scores: 0.4, 0.3, -0.4 -> d = 0.1 and 0.8, both right
    st = pair_counts(torch.tensor(STEP_R), TRAJ_IX, SUCC, GROUP, "sum")
    assert st["acc"] == 1.0 and st["margin"] == pytest.approx(0.45)
    # two groups with pairs, a tie counts as wrong: group 4: S = 0.5 vs 0.5 (tie); group 9: 1.0 vs 0.0 and 1.0 vs 2.0
    st = pair_counts(torch.tensor([0.5, 0.5, 1.0, 0.0, 2.0]), [0, 1, 2, 3, 4], [True, False, True, False, False],
                     [4, 4, 9, 9, 9])
    assert st["acc"] == pytest.approx(1 / 3) and st["margin"] == pytest.approx((0.0 + 1.0 - 1.0) / 3)
    # no pairs: NaN statistics
    st = pair_counts(torch.tensor([0.1, 0.2]), [0, 1], [True, True], [0, 0])
    assert math.isnan(st["acc"]) and math.isnan(st["loss"])


@pytest.mark.parametrize("succ", [[True] * 4, [False] * 4])
def test_trajectory_dpo_loss_without_pairs_is_attached_zero(succ):
    r = torch.tensor([0.1, -0.2, 0.3, 0.4], requires_grad=True)
    loss = trajectory_dpo_loss(r, [0, 1, 2, 3], succ, [0, 0, 1, 1])
    assert float(loss.detach()) == 0.0
    assert loss.requires_grad
    loss.backward()
    assert r.grad is not None and r.grad.abs().sum() == 0


def test_trajectory_dpo_loss_single_pair_equal_scores_is_log2():
    # one pair with equal scores: -log sigmoid(0) = log 2
    loss = trajectory_dpo_loss(torch.tensor([0.7, 0.7]), [0, 1], [True, False], [3, 3])
    assert float(loss) == pytest.approx(math.log(2))


# ---------------------------------------------------------------------------------------------
# Eq. 3-5: combined advantages
# ---------------------------------------------------------------------------------------------
# group 0: outcomes [10, 0, 0], steps: traj 0 [0.4, 0.2], traj 1 [-0.2], traj 2 [0.0]
# group 5: a single trajectory, outcome 10, steps [0.5, 0.7] -> everything 0
OUT = [10.0, 0.0, 0.0, 10.0]
TG = [0, 0, 0, 5]
SR = [0.4, 0.2, -0.2, 0.0, 0.5, 0.7]
TI = [0, 0, 1, 2, 3, 3]


def test_istar_advantages_rloo_hand_computed():
    # episode (RLOO): traj 0: 10 - mean(0, 0) = 10; traj 1, 2: 0 - mean(10, 0) = -5
    # step (RLOO over the group's 4 steps, sum 0.4): r - (0.4 - r) / 3
    #   0.4 -> 0.4 - 0/3 = 0.4;  0.2 -> 0.2 - 0.2/3 = 0.133333;  -0.2 -> -0.2 - 0.6/3 = -0.4;  0 -> -0.4/3
    a = istar_advantages(OUT, TG, SR, TI, alpha=0.5, estimator="rloo")
    want = [10 + 0.5 * 0.4, 10 + 0.5 * 0.2 / 1.5, -5 + 0.5 * -0.4, -5 + 0.5 * (-0.4 / 3), 0.0, 0.0]
    assert a.tolist() == pytest.approx(want, abs=1e-9)
    # alpha 0: the vanilla RLOO baseline, every step of a trajectory gets the episode advantage
    assert istar_advantages(OUT, TG, SR, TI, alpha=0.0).tolist() == pytest.approx([10, 10, -5, -5, 0, 0])


def test_istar_advantages_grpo_hand_computed():
    # episode: mean 10/3, deviations (20/3, -10/3, -10/3), unbiased var (400 + 100 + 100) / 9 / 2 = 100/3,
    #   std 5.773503 -> A_E = (2/sqrt(3), -1/sqrt(3), -1/sqrt(3)) = (1.154701, -0.577350, -0.577350)
    # step: mean 0.1, deviations (0.3, 0.1, -0.3, -0.1), unbiased var 0.2 / 3, std 0.258199
    #   -> A_S = (1.161895, 0.387298, -1.161895, -0.387298)
    a = istar_advantages(OUT, TG, SR, TI, alpha=1.0, estimator="grpo", eps=0.0)
    s = math.sqrt(0.2 / 3)
    want = [2 / math.sqrt(3) + 0.3 / s, 2 / math.sqrt(3) + 0.1 / s,
            -1 / math.sqrt(3) - 0.3 / s, -1 / math.sqrt(3) - 0.1 / s, 0.0, 0.0]
    assert a.tolist() == pytest.approx(want, abs=1e-9)
    assert a[0] == pytest.approx(1.154701 + 1.161895, abs=1e-5)


def test_istar_advantages_group_of_one_and_constant_rewards():
    # one trajectory: no counterfactual -> 0 whatever its steps
    assert istar_advantages([3.0], [0], [1.0, -2.0, 5.0], [0, 0, 0], estimator="rloo").tolist() == [0, 0, 0]
    assert istar_advantages([3.0], [0], [1.0, -2.0, 5.0], [0, 0, 0], estimator="grpo").tolist() == [0, 0, 0]
    # all-success group with equal step rewards -> 0 for both estimators
    for est in ("rloo", "grpo"):
        a = istar_advantages([10.0, 10.0, 10.0], [1, 1, 1], [0.2, 0.2, 0.2, 0.2], [0, 1, 1, 2], estimator=est)
        assert a.abs().max() == pytest.approx(0.0, abs=1e-9)


def test_istar_advantages_all_failure_group_gets_step_credit_only():
    # outcomes all 0 -> A_E = 0; steps [1.0, 0.0 | -1.0]: RLOO r - (sum - r)/2 with sum 0 -> 1.5 r
    a = istar_advantages([0.0, 0.0], [4, 4], [1.0, 0.0, -1.0], [0, 0, 1], alpha=1.0, estimator="rloo")
    assert a.tolist() == pytest.approx([1.5, 0.0, -1.5])


def test_istar_advantages_permutation_equivariant():
    perm = [3, 1, 0, 2]  # new trajectory k = old trajectory perm[k]
    inv = {old: new for new, old in enumerate(perm)}
    out = [OUT[p] for p in perm]
    tg = [TG[p] for p in perm]
    ti = [inv[t] for t in TI]
    for est in ("rloo", "grpo"):
        assert istar_advantages(out, tg, SR, ti, estimator=est).tolist() == pytest.approx(
            istar_advantages(OUT, TG, SR, TI, estimator=est).tolist())


def test_istar_turn_advantages_regroups_the_turns_by_hand():
    """The kernel over per-turn arrays is Eq. 1 then `istar_advantages` on the trajectories it finds:
    with β = 1 and one token per turn the step rewards are the log-ratios themselves (SR above)."""
    from istar import istar_turn_advantages

    group = [TG[t] for t in TI]  # per turn: its trajectory's group, outcome and, one token, its reward
    outcome = [OUT[t] for t in TI]
    ratios = [torch.tensor([r], dtype=torch.float64) for r in SR]
    for est in ("rloo", "grpo"):
        a = istar_turn_advantages(group, TI, outcome, ratios, beta=1.0, alpha=0.5, estimator=est,
                                  normalize="none")
        assert a.tolist() == pytest.approx(istar_advantages(OUT, TG, SR, TI, 0.5, est).tolist(), abs=1e-12)
    # batch max-abs normalisation (max |r| = 0.7): the RLOO step term of group 0 scales by 1 / 0.7
    a = istar_turn_advantages(group, TI, outcome, ratios, beta=1.0, alpha=0.5, eps=0.0)
    assert a[0] == pytest.approx(10 + 0.5 * 0.4 / 0.7, abs=1e-5)
    # trajectory ids are per group: traj 0 of group 0 and traj 0 of group 1 are two trajectories
    # (RLOO: 1 - 0 and 0 - 1 in group 0; group 1 has one trajectory: 0)
    a = istar_turn_advantages([0, 0, 1], [0, 1, 0], [1.0, 0.0, 5.0], [torch.zeros(1)] * 3, alpha=0.0)
    assert a.tolist() == [1.0, -1.0, 0.0]


def test_policy_loss_step_level_ratio_hand_computed():
    # step 0: two tokens, log-ratios 0.05 and 0.15 -> s = exp(0.10) = 1.105171, A = +1 (inside the clip range)
    # step 1: one token, log-ratio -0.10 -> s = exp(-0.10) = 0.904837, A = +2
    # per-step loss -s A, averaged over the 2 steps: (-1.105171 - 1.809675) / 2 = -1.457423
    # gradient w.r.t. each token log-prob: -A s / (len * steps): step 0: -1.105171 / 4 = -0.276293 (both
    # tokens), step 1: -2 * 0.904837 / 2 = -0.904837
    from istar import policy_loss

    logp = torch.tensor([[-1.0, -2.0], [0.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = logp.detach() - torch.tensor([[0.05, 0.15], [0.0, -0.10]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    w = m / (m.sum(-1, keepdim=True) * 2)
    loss, clipped, ratio = policy_loss(logp, old, adv, w, 0.2, 0.0, step_mask=m)
    assert abs(float(loss) - (-1.457423)) < 1e-5
    np.testing.assert_allclose(ratio.detach()[0], [1.105171, 1.105171], atol=1e-6)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [[-0.276293, -0.276293], [0.0, -0.904837]], atol=1e-6)
    # per-token ratios (the official verl loss), token-mean over 3 tokens: exp(0.05), exp(0.15), 2 exp(-0.1)
    # -> -(1.051271 + 1.161834 + 1.809675) / 3 = -1.340927
    tok_loss, _, _ = policy_loss(logp.detach(), old, adv, m / 3, 0.2, 0.0)
    assert abs(float(tok_loss) - (-1.340927)) < 1e-5
    # a step whose mean log-ratio leaves the clip range is clipped as a whole: log-ratios 0.1, 0.3 -> s = exp(0.2)
    logp2 = logp.detach().clone().requires_grad_(True)
    old2 = logp2.detach() - torch.tensor([[0.1, 0.3], [0.0, -0.10]], dtype=torch.float64)
    loss2, clipped2, _ = policy_loss(logp2, old2, adv, w, 0.2, 0.0, step_mask=m)
    assert abs(float(loss2) - (-(1.2 + 1.809675) / 2)) < 1e-5
    loss2.backward()
    assert logp2.grad[0].abs().max() == 0 and clipped2[0].eq(1).all()


def test_trajectory_outcomes_hand_computed():
    # returns 10 (solved, 2 invalid), -1.5 (1 invalid), 0 (no invalid): r_o = 10 - 0.2, -1.5 - 0.1, 0
    eps = [Episode(0, 0, "a"), Episode(1, 0, "a"), Episode(2, 1, "b")]
    for ep, ret, inv, ok in zip(eps, (10.0, -1.5, 0.0), ([1, 0, 1], [1], [0, 0]), (True, False, False)):
        ep.env_return, ep.invalid, ep.success = ret, [bool(i) for i in inv], ok
    out, pos, grp = trajectory_outcomes(eps, 0.1)
    assert torch.allclose(out, torch.tensor([9.8, -1.6, 0.0], dtype=torch.float64))
    assert pos.tolist() == [True, False, False] and grp.tolist() == [0, 0, 1]
    _, pos, _ = trajectory_outcomes(eps, 0.1, threshold=-0.05)  # positive = r_o > -0.05
    assert pos.tolist() == [True, False, True]


def test_normalize_step_rewards():
    # max |r| = 2 -> [0.25, -1, 0.5]
    assert normalize_step_rewards(torch.tensor([0.5, -2.0, 1.0]), eps=0.0).tolist() == [0.25, -1.0, 0.5]
    assert normalize_step_rewards(torch.zeros(0)).numel() == 0


# ---------------------------------------------------------------------------------------------
# The PRM and the policy are two adapters of one model: each update moves only its own adapter
# ---------------------------------------------------------------------------------------------
def _two_adapter_model():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(**lora))
    try:
        from common.models import add_adapter
        add_adapter(model, "prm", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    except ImportError:
        model.add_adapter("prm", LoraConfig(**lora))
    model.set_adapter("default")
    return model


def _samples(model, tok):
    """Four trajectories (two groups), 1-3 steps each, with π_old = the policy's log-probs."""
    from istar import token_logprobs

    g = torch.Generator().manual_seed(1)
    samples = []
    for traj, n_steps in enumerate([2, 1, 3, 1]):
        for turn in range(n_steps):
            p = torch.randint(1, 40, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
            c = torch.randint(1, 40, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            samples.append(Sample(p, c, traj // 2, traj, turn))
    for x, o in zip(samples, token_logprobs(model, tok, samples, "default", 64)):
        x.old = o
    return samples


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dpo_backward_moves_only_the_prm_adapter():
    from istar import adapter_params

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    samples = _samples(model, tok)
    succ, group = torch.tensor([True, False, True, False]), torch.tensor([0, 0, 1, 1])
    args = Args(micro_batch_size=2, beta=0.05)
    opt = torch.optim.AdamW(adapter_params(model, "prm"), lr=1e-2)
    before = _snapshot(model)
    _, r, stats, _ = prm_update(model, tok, opt, samples, succ, group, args)
    assert stats["pairs"] == 2
    # both adapters start with B = 0, so the PRM equals π_old at first: every step reward is 0 and the
    # loss is log 2 (two pairs with equal scores)
    assert r.abs().max() == pytest.approx(0.0, abs=1e-6)
    assert stats["loss"] == pytest.approx(math.log(2), abs=1e-6)
    after = _snapshot(model)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved, "the PRM update changed nothing"
    assert all(".prm." in n and "lora_" in n for n in moved), sorted(moved)[:5]
    assert any("lora_B" in n for n in moved)
    # the policy adapter is active again and its rewards now differ from the moved PRM's
    assert model.active_adapter == "default"


def test_prm_steps_lower_the_dpo_loss_on_a_fixed_batch():
    """Repeated PRM steps on one batch must separate positives from negatives (sign of the gradient)."""
    from istar import adapter_params

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    samples = _samples(model, tok)
    succ, group = torch.tensor([True, False, False, True]), torch.tensor([0, 0, 1, 1])
    args = Args(micro_batch_size=4, beta=0.5)
    opt = torch.optim.AdamW(adapter_params(model, "prm"), lr=3e-2)
    losses, accs = [], []
    for _ in range(8):
        _, r, stats, _ = prm_update(model, tok, opt, samples, succ, group, args)
        losses.append(stats["loss"])  # the DPO loss of the batch before the step, as pair_counts scores it
        held = pair_counts(r, [x.traj for x in samples], succ, group)
        assert held["loss"] == pytest.approx(stats["loss"], abs=1e-12)
        accs.append(held["acc"])
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)  # PRM == π_old at the start
    assert losses[-1] < 0.6 and accs[-1] == 1.0, (losses, accs)


def test_k_prm_steps_equal_k_single_step_updates():
    """--prm-updates-per-iteration K: K optimizer steps on the batch, each with dL/dr of the moved PRM, i.e. the
    same as K calls with K = 1 (the pre-update statistics of the first call are those of the K-step call)."""
    from istar import adapter_params

    succ, group = torch.tensor([True, False, False, True]), torch.tensor([0, 0, 1, 1])
    finals, first_stats = [], []
    for k, calls in ((3, 1), (1, 3)):
        model = _two_adapter_model()
        tok = SimpleNamespace(pad_token_id=0)
        samples = _samples(model, tok)
        opt = torch.optim.AdamW(adapter_params(model, "prm"), lr=3e-2)
        args = Args(micro_batch_size=3, beta=0.5, prm_updates_per_iteration=k)
        for c in range(calls):
            _, _, stats, _ = prm_update(model, tok, opt, samples, succ, group, args)
            if c == 0:
                first_stats.append(stats["loss"])
        fit = implicit_turn_rewards(prm_log_ratios(model, tok, samples, args), args.beta)  # after the steps
        finals.append(([p.detach().clone() for p in adapter_params(model, "prm")],
                       pair_counts(fit, [x.traj for x in samples], succ, group)["loss"]))
    (p3, loss3), (p1, loss1) = finals
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p3, p1))
    assert loss3 == pytest.approx(loss1, abs=1e-6) and loss3 < math.log(2) - 0.05  # three steps fit the batch
    assert first_stats[0] == first_stats[1] == pytest.approx(math.log(2), abs=1e-6)


def test_replay_gradient_is_the_pooled_dpo_gradient_over_both_iterations():
    """--prm-replay: one step on this iteration's pairs and an earlier iteration's, each scored against its own
    π_θold: the gradient equals one backward of the DPO loss averaged over the pairs of both."""
    from istar import adapter_params, completion_logprobs

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    with torch.no_grad():
        for p in adapter_params(model, "prm"):
            p.add_(0.3 * torch.randn_like(p))
    samples = _samples(model, tok)
    succ, group = torch.tensor([True, False, False, True]), torch.tensor([0, 0, 1, 1])
    # the earlier iteration: the same steps, other labels and another reference (its π_θold)
    earlier = [dataclasses.replace(x, old=x.old - 0.4 * (i % 3)) for i, x in enumerate(samples)]
    succ_e, group_e = torch.tensor([False, True, True, False]), torch.tensor([5, 5, 6, 6])
    old_batch = paired_batch(earlier, succ_e, group_e)
    args = Args(micro_batch_size=3, beta=0.5)
    params = adapter_params(model, "prm")
    opt = torch.optim.AdamW(params, lr=0.0)
    _, _, stats, _ = prm_update(model, tok, opt, samples, succ, group, args, replay=[old_batch])
    trained = merge_batches([paired_batch(samples, succ, group), old_batch])  # the pairs of both iterations
    assert stats["pairs"] == 2 and preference_pairs(trained["success"], trained["group"]).shape[0] == 4
    got = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    model.set_adapter("prm")
    model.train()
    both = samples + earlier
    lp, m = completion_logprobs(model, tok, [x.prompt for x in both], [x.completion for x in both])
    old = torch.zeros_like(lp)
    for j, x in enumerate(both):
        old[j, lp.shape[1] - len(x.old):] = x.old
    r = implicit_step_rewards(lp, old, m, args.beta)
    traj = [x.traj for x in samples] + [x.traj + 4 for x in earlier]
    loss = trajectory_dpo_loss(r, traj, torch.cat([succ, succ_e]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), "mean")
    loss.backward()
    for a, b in zip(got, [p.grad for p in params]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert max(float(g.abs().max()) for g in got) > 0


@pytest.mark.parametrize("flag", [{"prm_updates_per_iteration": 0}, {"prm_learning_rate": 0.0}, {"beta": 0.0},
                                  {"prm_replay": -1}, {"micro_batch_size": 0}])
def test_bad_prm_options_are_user_errors(flag):
    from common.models import UserError
    from istar import make_env

    with pytest.raises(UserError, match="--" + next(iter(flag)).replace("_", "-")):
        make_env(Args(tiny_preset="micro", **flag))


@pytest.mark.parametrize("model", ["tiny", "Qwen/Qwen2.5-1.5B-Instruct"])
def test_prm_defaults_resolve_by_model(model):
    """PRM lr and replay left at None: the tiny policy's tuned setting (DEFAULTS["tiny"]), else the official one
    (2x the policy lr, no replay); one PRM step per iteration for both; a value given on the command line is
    kept, and a real model's PRM lr follows a given policy lr; negotiation's positives are scores above 6."""
    from istar import make_env

    def resolved(**kw):  # make_env builds the env only, no model
        return make_env(Args(model_name=model, **kw))[0]

    tiny = model == "tiny"
    args = resolved()
    got = (args.learning_rate, args.prm_learning_rate, args.prm_replay, args.prm_updates_per_iteration,
           args.micro_batch_size, args.positive_threshold)
    assert got == ((5e-4, 4e-3, 4, 1, 64, None) if tiny else (1e-5, 2e-5, 0, 1, 8, None))
    assert (args.weight_decay, args.prm_weight_decay) == (0.01, 0.0)  # official: verl's actor 0.01, the PRM's 0
    given = resolved(prm_learning_rate=3e-4, prm_replay=0)
    assert (given.prm_learning_rate, given.prm_replay) == (3e-4, 0)
    assert resolved(learning_rate=1e-4).prm_learning_rate == (4e-3 if tiny else 2e-4)
    if tiny:
        assert resolved(env_id="negotiation").positive_threshold == 6.0


def test_two_pass_dpo_gradient_equals_pooled_backward():
    """prm_update re-injects dL/dr per micro-batch; its gradient must equal one pooled backward."""
    from istar import adapter_params, completion_logprobs

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    # move the PRM away from π_old first so the scores differ and the pairs have different weights
    with torch.no_grad():
        for p in adapter_params(model, "prm"):
            p.add_(0.3 * torch.randn_like(p))
    samples = _samples(model, tok)
    succ, group = torch.tensor([True, False, False, True]), torch.tensor([0, 0, 1, 1])
    args = Args(micro_batch_size=2, beta=0.5, dpo_reduce="mean")
    params = adapter_params(model, "prm")
    opt = torch.optim.AdamW(params, lr=0.0)  # lr 0: the step keeps the parameters, .grad stays readable
    prm_update(model, tok, opt, samples, succ, group, args)
    two_pass = [p.grad.clone() for p in params]
    # direct: one forward with the graph over all steps, the loss, one backward
    for p in params:
        p.grad = None
    model.set_adapter("prm")
    model.train()
    lp, m = completion_logprobs(model, tok, [x.prompt for x in samples], [x.completion for x in samples])
    old = torch.zeros_like(lp)
    for j, x in enumerate(samples):
        old[j, lp.shape[1] - len(x.old):] = x.old
    r = implicit_step_rewards(lp, old, m, args.beta)
    trajectory_dpo_loss(r, [x.traj for x in samples], succ, group, "mean").backward()
    for a, b in zip(two_pass, [p.grad for p in params]):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert max(float(g.abs().max()) for g in two_pass) > 0


def test_update_moves_only_the_policy_adapter():
    from istar import adapter_params

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    samples = _samples(model, tok)
    for i, x in enumerate(samples):
        x.adv = torch.full((len(x.completion),), 1.0 if i % 2 else -1.0)
    opt = torch.optim.AdamW(adapter_params(model, "default"), lr=1e-2)
    before = _snapshot(model)
    update(model, tok, opt, samples, Args(micro_batch_size=3, num_minibatches=2), np.random.default_rng(0))
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and all(".default." in n and "lora_" in n for n in moved), sorted(moved)[:5]


@pytest.mark.parametrize("level", ["token", "step"])
def test_ratio_level_sets_the_loss_aggregation_by_hand(level):
    """Two turns in one minibatch, at ratio 1 (π_old = the policy): turn a has 1 token and A = +1, turn b has
    3 tokens and A = -1. --ratio-level token: token-mean, loss = -(1 - 3) / 4 = 0.5; step (Eq. 6): each step
    weighs 1/2, loss = -(1 - 1) / 2 = 0. A flag that did not reach `update` would give the same loss twice."""
    from istar import token_logprobs

    model = _two_adapter_model()
    tok = SimpleNamespace(pad_token_id=0)
    samples = [Sample([3, 4, 5], [7], 0, 0, 0, adv=1.0), Sample([6, 2], [8, 9, 10], 0, 1, 0, adv=-1.0)]
    for x, o in zip(samples, token_logprobs(model, tok, samples, "default", 64)):
        x.old = o
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_" in n and ".default." in n], lr=0.0)
    stats = update(model, tok, opt, samples, Args(micro_batch_size=1, num_minibatches=1, ratio_level=level),
                   np.random.default_rng(0))
    assert stats["policy_loss"] == pytest.approx(0.5 if level == "token" else 0.0, abs=1e-5)
    assert stats["clip_frac"] == 0.0


def _credit_episodes():
    """One task, three trajectories, as `compute_advantages` gets them (hand cases below)."""
    eps = [Episode(0, 0, "t", completions=[[1, 2], [3]], actions=["a", "b"], invalid=[False, True],
                   success=True, env_return=1.0),
           Episode(1, 0, "t", completions=[[4, 5]], actions=["c"], invalid=[False], env_return=0.0),
           Episode(2, 0, "t", completions=[[6, 7]], actions=["d"], invalid=[False], env_return=0.5)]
    for ep in eps:
        ep.prompts = [[9]] * ep.length
    signal = [torch.tensor([1.0, 1.0]), torch.tensor([2.0]), torch.tensor([-2.0, -2.0]), torch.tensor([0.0, 4.0])]
    return eps, signal


def test_compute_advantages_hand_computed():
    """Outcomes r_o = return - 0.1 x invalid: τ0 1 - 0.1 = 0.9, τ1 0, τ2 0.5. RLOO A_E = r_o - mean of the other
    two: τ0 0.9 - 0.25 = 0.65, τ1 0 - 0.7 = -0.7, τ2 0.5 - 0.45 = 0.05. Step rewards β Σ log-ratio (β 0.05):
    0.1, 0.1, -0.2, 0.2; over max |r| = 0.2: 0.5, 0.5, -1, 1 (sum 1). RLOO A_S = r - (1 - r) / 3: 1/3, 1/3,
    -5/3, 1. A = A_E + A_S: 0.98333, 0.98333, -2.36667, 1.05. --alpha 0 (no signal): A = A_E. Logged: the
    token mean of |A| over the 7 tokens, (3 x 0.98333 + 2 x 2.36667 + 2 x 1.05) / 7 = 1.397619, and the
    positive fraction 1/3 (τ0 succeeded)."""
    from istar import compute_advantages

    eps, signal = _credit_episodes()
    samples, stats = compute_advantages(eps, Args(), signal)
    assert [(x.traj, x.turn, x.completion) for x in samples] == [(0, 0, [1, 2]), (0, 1, [3]), (1, 0, [4, 5]),
                                                                  (2, 0, [6, 7])]
    assert [x.adv for x in samples] == pytest.approx([0.983333, 0.983333, -2.366667, 1.05], abs=1e-5)
    assert stats["credit/adv_abs_mean"] == pytest.approx(1.397619, abs=1e-5)
    assert stats["charts/positive_frac"] == pytest.approx(1 / 3)
    rloo, _ = compute_advantages(eps, Args(alpha=0.0), None)
    assert [x.adv for x in rloo] == pytest.approx([0.65, 0.65, -0.7, 0.05], abs=1e-12)
    # DPO positives by threshold, after the invalid penalty: r_o > 0.4 holds for τ0 (0.9) and τ2 (0.5)
    _, stats = compute_advantages(eps, Args(positive_threshold=0.4), signal)
    assert stats["charts/positive_frac"] == pytest.approx(2 / 3)


def test_token_granularity_gives_every_token_its_own_step_reward_by_hand():
    """--step-reward-granularity token (Table 3): every token is a row. Token rewards β x log-ratio: τ0 0.05,
    0.05, 0.1; τ1 -0.1, -0.1; τ2 0, 0.2; over max |r| = 0.2: 0.25, 0.25, 0.5, -0.5, -0.5, 0, 1 (sum 1). RLOO over
    the group's 7 rows: A_S = x - (1 - x) / 6 = (7x - 1) / 6: 0.125, 0.125, 0.416667, -0.75, -0.75, -0.166667,
    1. A_E as at step level (0.65, -0.7, 0.05). A per token: 0.775, 0.775 | 1.066667 | -1.45, -1.45 |
    -0.116667, 1.05. At step level the turns would carry one float each (0.98333, ...)."""
    from istar import compute_advantages

    eps, signal = _credit_episodes()
    samples, _ = compute_advantages(eps, Args(step_reward_granularity="token"), signal)
    got = [x.adv.tolist() for x in samples]
    want = [[0.775, 0.775], [1.066667], [-1.45, -1.45], [-0.116667, 1.05]]
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
# The micro policy rarely solves a level, so the end-to-end run defines positives by the outcome
# r_o = return - 0.1 x invalid actions > -0.05, i.e. "no invalid action": groups then hold both kinds
# and the PRM gets DPO pairs in every iteration.
SMALL = ["--num-iterations", "2", "--tasks-per-iteration", "3", "--group-size", "6", "--max-turns", "8",
         "--eval-num-tasks", "3", "--eval-every", "2", "--torch-threads", "1", "--lora-r", "8", "--lora-alpha", "16",
         "--learning-rate", "1e-3", "--max-new-tokens", "4", "--positive-threshold", "-0.05",
         "--sokoban-reward", "sparse"]  # positive = no invalid action (outcome 0 - 0.1 per invalid step)


# every end-to-end run of this module, by name: conftest's `runs` starts them together when the first test
# needs one (E2E_SCRIPT with each flag list)
E2E_SCRIPT = "istar.py"
E2E = {"istar": SMALL, "alpha0": [*SMALL[:1], "1", *SMALL[2:], "--alpha", "0", "--estimator", "grpo"]}


def test_end_to_end_istar(runs):
    run_dir = runs["istar"].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)  # policy
    assert_adapter_trained(run_dir, "prm")  # PRM, saved under adapter/prm
    rows = [r for r in read_metrics(run_dir) if "charts/success" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["losses/policy_loss"])
    # which groups hold both a success and a failure depends on the sampled episodes; at least one
    # iteration must have had pairs (the PRM adapter is checked as trained above)
    paired = [r for r in rows if r["prm/pairs"] >= 1]
    assert paired
    for r in paired:  # a DPO loss of pairs is finite and positive (log 2 where the PRM equals the policy)
        assert 0.0 < r["prm/loss"] < 10.0
    for key in ("eval/success", "eval/success_greedy"):
        assert 0.0 <= summary["last_eval"][key] <= 1.0
    assert set(adapter_tensors(run_dir)) != set() and set(adapter_tensors(run_dir, "prm")) != set()


def test_end_to_end_alpha0_baseline(runs):
    run_dir = runs["alpha0"].result()
    assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    assert not any("prm/loss" in r for r in read_metrics(run_dir))


def test_bad_flag_is_one_clear_line(tiny_cache):
    proc = subprocess.run([sys.executable, str(REPO / "istar.py"), "--env-id", "no_such_env"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "no_such_env" in proc.stderr and "Traceback" not in proc.stderr


def test_sokoban_outcome_is_the_papers_shaped_reward():
    # the shaped return of a solved 1-box level: -0.1 per step, +1 for the box on its target, +10 on solving
    import istar

    _, make, probe, _ = istar.make_env(istar.Args())  # the default tiny recipe's 1-box levels (not built here)
    env = make()
    env.reset(env.task_ids("train")[0])
    total, n = 0.0, 0
    while not env.done:
        total += env.step(env.expert_action()).reward
        n += 1
    assert env.reward_type == "shaped" and abs(total - (11.0 - 0.1 * n)) < 1e-9
    _, make, _, kw = istar.make_env(istar.Args(tiny_preset="micro", sokoban_reward="sparse"))
    assert make().reward_type == "sparse" and kw["reward"] == "sparse"


def test_prm_equal_to_the_policy_gives_log_ratios_of_exactly_zero(random_llama_dir):
    """Where the PRM equals the policy (its first iteration), log π_φ - log π_θold is exactly 0 for
    every token: π_θold's log-probs are recomputed by the same scoring pass as the PRM's (with the
    adapter merged in both), not kept from sampling, whose last bits differ (the step rewards are
    divided by the batch's largest |r|, which would turn 1e-7 into ±1)."""
    import istar
    from common.models import add_adapter, load_policy

    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    add_adapter(model, "prm", lora_r=4, lora_alpha=8)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking policy, and the PRM a copy of it
        for name, p in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                p.add_(0.3 * torch.randn_like(p))
        params = dict(model.named_parameters())
        for name, p in params.items():
            if ".prm." in name:
                p.copy_(params[name.replace(".prm.", ".default.")])
    model.set_adapter("default")
    prompts = [istar.encode(tok, t) for t in ["push the box up", "is it an animal?", "left right"]]
    completions, kept = istar.generate(model, tok, prompts, 1.0, 6, logprobs=True)
    episodes = [Episode(traj_id=i, group_id=0, task_id="t", prompts=[p], completions=[c], actions=["a"],
                        observations=["o"], invalid=[False]) for i, (p, c) in enumerate(zip(prompts, completions))]
    args = Args(micro_batch_size=2)
    turns = istar.old_logprob_turns(model, tok, episodes, args)
    ratios = istar.prm_log_ratios(model, tok, turns, args)
    assert all(len(r) == len(c) and torch.equal(r, torch.zeros(len(c))) for r, c in zip(ratios, completions))
    # the sampler's own log-probs are the same numbers to ~1e-6, but not the same bits
    assert all(torch.allclose(k, x.old, atol=1e-5) for k, x in zip(kept, turns))


def test_length_sorted_micro_batches_score_and_train_as_one_batch(random_llama_dir):
    """token_logprobs and update take their micro-batches in length order (less padding): each sample's
    log-probs come back in its own place, equal to the sample scored alone, under the policy and the PRM;
    the update's gradient over micro-batches of 3 equals the gradient of one pass over all."""
    import istar
    from common.models import add_adapter
    from tests.test_shared_blocks import _policy_with_a_trained_looking_adapter

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    add_adapter(model, "prm", lora_r=4, lora_alpha=8)
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 2), (3, 1), (14, 3), (5, 2), (11, 1), (4, 3), (8, 2)]  # unsorted on purpose
    samples = [Sample(torch.randint(5, 250, (p,), generator=g).tolist(),
                      torch.randint(5, 250, (c,), generator=g).tolist(), 0, i, 0, adv=(-1.0) ** i)
               for i, (p, c) in enumerate(lengths)]
    for adapter in ("default", "prm"):
        got = istar.token_logprobs(model, tok, samples, adapter, micro_batch_size=3)
        model.set_adapter(adapter)
        for x, lp in zip(samples, got):
            with torch.no_grad():
                alone, _ = istar.completion_logprobs(model, tok, [x.prompt], [x.completion])
            assert lp.shape == (len(x.completion),) and torch.allclose(lp, alone[0], atol=1e-5)
    model.set_adapter("default")
    for x, lp in zip(samples, istar.token_logprobs(model, tok, samples, "default", 64)):
        x.old = lp - 0.05 * x.traj  # ratios away from 1 on some samples
    grads = []
    for micro in (3, 64):
        args = Args(num_minibatches=1, micro_batch_size=micro, max_grad_norm=1e9)
        params = istar.adapter_params(model, "default")
        for p in params:
            p.grad = None
        istar.update(model, tok, torch.optim.SGD(params, lr=0.0), samples, args, np.random.default_rng(0))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)
