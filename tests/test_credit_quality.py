"""benchmarks/credit_quality.py: the Monte Carlo true advantage on a two-turn game whose values are worked
out by hand, the agreement statistics on small cases computed by hand, the pooling of seeds, and the iStar
adapter's PRM warm-up."""

from __future__ import annotations

import math
import random
import sys

import numpy as np
import pytest

from envs.base import Step, TextEnv
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import credit_quality as cq  # noqa: E402


class TwoTurns(TextEnv):
    """Two turns, each "A" or "B" (anything else counts as "B"); success iff both turns are "A"."""

    env_id = "two_turns"
    max_turns = 2

    def task_ids(self, split):
        return ["t"]

    def _reset(self, task_id):
        self.moves = []
        return "start"

    def _step(self, action):
        self.moves.append(action == "A")
        done = len(self.moves) == 2
        return Step(f"moves {self.moves}", 0.0, done, {"success": done and all(self.moves)})

    def _render_state(self):
        return "x"

    def state_key(self):
        return tuple(self.moves)

    def expert_action(self):
        return "A"


def coin_policy(p_a, rng):
    return lambda envs: ["A" if rng.random() < p_a else "B" for _ in envs]


def test_true_advantage_of_a_two_turn_game_by_hand():
    # Policy: "A" with probability 0.5. Success needs A then A.
    # V(start) = 0.25; Q(start, A) = P(A at turn 2) = 0.5; Q(start, B) = 0  -> A* = +0.25, -0.25.
    # After A: V = 0.5, Q(., A) = 1, Q(., B) = 0                            -> A* = +0.5, -0.5.
    # After B: V = 0 and Q = 0 whatever the action                          -> A* = 0 (SE 0).
    start = TwoTurns()
    start.reset("t")
    after_a, after_b = start.clone(), start.clone()
    after_a.step("A")
    after_b.step("B")
    states = [start, start, after_a, after_a, after_b]
    actions = ["A", "B", "A", "B", "A"]
    n = 4000
    est = cq.mc_advantages(states, actions, coin_policy(0.5, random.Random(0)), n)
    truth = np.array([0.25, -0.25, 0.5, -0.5, 0.0])
    # SE by hand: Q and V are means of Bernoulli draws, var = p (1 - p) / n each
    se_true = np.sqrt(np.array([0.5 * 0.5 + 0.25 * 0.75, 0 + 0.25 * 0.75, 0 + 0.25, 0 + 0.25, 0]) / n)
    assert np.allclose(est.se, se_true, rtol=0.1, atol=1e-12)
    assert np.all(np.abs(est.a_star - truth) <= 4 * se_true + 1e-12)
    assert est.a_star[4] == 0.0 and est.se[4] == 0.0
    assert start.moves == [] and after_a.moves == [True]  # the saved states were cloned, not stepped


def test_true_advantage_under_a_biased_policy():
    # "A" with probability 0.8: V(start) = 0.64, Q(start, A) = 0.8 -> A* = +0.16; Q(start, B) = 0 -> -0.64
    start = TwoTurns()
    start.reset("t")
    est = cq.mc_advantages([start, start], ["A", "B"], coin_policy(0.8, random.Random(1)), 3000)
    assert est.a_star == pytest.approx([0.16, -0.64], abs=0.04)


def test_auc_and_spearman_by_hand():
    # A* > 0 turns have credit 3 and 1, A* < 0 turns have 2 and 0; the A* = 0 turn is left out.
    # Pairs (pos, neg): (3,2) (3,0) (1,2) (1,0) -> 3 of 4 ordered right: AUC 0.75.
    assert cq.auc([3, 1, 2, 0, 9], [0.5, 0.1, -0.2, -0.4, 0.0]) == pytest.approx(0.75)
    assert cq.auc([1, 1], [0.3, -0.3]) == pytest.approx(0.5)  # a tie counts half
    # ranks of credit 1,2,3,4 against A* ranks 1,3,2,4: d^2 = 0+1+1+0 = 2, rho = 1 - 6*2/(4*15) = 0.8
    assert cq.spearman([1, 2, 3, 4], [0.1, 0.3, 0.2, 0.4]) == pytest.approx(0.8)


def test_within_and_between_episode_spearman_by_hand():
    # episode 0: credit 1, 2, 3 and A* 0.1, 0.3, 0.2; episode 1: credit 5, 5 and A* 0.0, 0.6; episode 2 has one
    # scored turn and is left out of "within". Centred: credit -1, 0, 1, 0, 0 and A* -0.1, 0.1, 0, -0.3, 0.3.
    # Ranks: credit 1, 3, 5, 3, 3 (three ties at 0 share rank 3); A* 2, 4, 3, 1, 5. Deviations from 3:
    # credit -2, 0, 2, 0, 0; A* -1, 1, 0, -2, 2; covariance sum 2, squares 8 and 10: rho = 2 / sqrt(80).
    credit, a_star, ep = [1, 2, 3, 5, 5, 9], [0.1, 0.3, 0.2, 0.0, 0.6, -1.0], [0, 0, 0, 1, 1, 2]
    assert cq.within_episode_spearman(credit, a_star, ep) == pytest.approx(2 / np.sqrt(80))
    # episode means: credit 2, 5, 9 (ranks 1, 2, 3); A* 0.2, 0.3, -1.0 (ranks 2, 3, 1);
    # d = -1, -1, 2, sum d^2 = 6: rho = 1 - 6 * 6 / (3 * 8) = -0.5
    assert cq.between_episode_spearman(credit, a_star, ep) == pytest.approx(-0.5)
    # a credit that is constant within each episode (outcome only) cannot order an episode's turns, also when
    # float32 storage leaves it a few 1e-8 apart (residuals below 1e-6 of the largest count as 0)
    assert np.isnan(cq.within_episode_spearman([0.1, 0.1, 0.1, 0.7, 0.7, 9], a_star, ep))
    assert np.isnan(cq.within_episode_spearman([0.3, 0.3 + 3e-8, 0.3 - 2e-8, 0.7, 0.7, 9], a_star, ep))
    # credit = A* plus an offset per episode: every resample orders the turns within episodes perfectly
    rng = np.random.default_rng(1)
    clusters = np.arange(60) // 3
    a = rng.normal(size=60)
    value, lo, hi = cq.bootstrap_ci(cq.within_episode_spearman, a + 10 * clusters, a, clusters, reps=100,
                                    by_cluster=True)
    assert value == pytest.approx(1.0) and lo == pytest.approx(1.0) and hi == pytest.approx(1.0)


def test_reliability_and_bootstrap_interval():
    # var(A*) with ddof 1 of [0, 1, 2, 3] = 5/3; mean se^2 = 0.25 -> 1 - 0.25 / (5/3) = 0.85
    assert cq.reliability([0, 1, 2, 3], [0.5] * 4) == pytest.approx(0.85)
    rng = np.random.default_rng(0)
    a = rng.normal(size=400)
    credit = a + rng.normal(scale=0.5, size=400)
    value, lo, hi = cq.bootstrap_ci(cq.spearman, credit, a, clusters=np.arange(400) // 4, reps=300)
    assert lo < value < hi and 0.8 < value < 0.95 and hi - lo < 0.1


def test_a_continuation_returns_the_sum_of_its_step_rewards():
    # reward 1 per step played, plus 10 at a success. From the start two steps are left; after one move one.
    # Policy always "A": every continuation succeeds. Q(start, B) plays B then A: 2 steps, no success.
    def reward(step, env):
        return 1.0 + 10.0 * float(step.done and step.info["success"])

    start = TwoTurns()
    start.reset("t")
    after_a = start.clone()
    after_a.step("A")
    est = cq.mc_advantages([start, start, after_a], ["A", "B", "A"], coin_policy(1.0, random.Random(0)), 3, reward)
    assert est.q.tolist() == [12.0, 2.0, 11.0] and est.v.tolist() == [12.0, 12.0, 11.0]
    assert est.a_star.tolist() == [0.0, -10.0, 0.0] and est.se.tolist() == [0.0, 0.0, 0.0]


def test_a_reward_per_state_scores_each_pair_for_its_own_seat():
    # The second pair is scored by the loser's reward (1 - success): its A* is the first one's, negated.
    start = TwoTurns()
    start.reset("t")
    win = cq.final_return

    def lose(step, env):
        return float(step.done and not step.info["success"])

    est = cq.mc_advantages([start, start], ["A", "A"], coin_policy(1.0, random.Random(0)), 4, [win, lose])
    assert est.q.tolist() == [1.0, 0.0] and est.v.tolist() == [1.0, 0.0]
    est = cq.mc_advantages([start, start], ["B", "B"], coin_policy(1.0, random.Random(0)), 4, [win, lose])
    assert est.a_star.tolist() == [-1.0, 1.0]


def test_pairs_with_the_same_key_share_their_continuations():
    # Two identical (state, action) pairs with one key are estimated once: the same numbers, and the policy
    # is asked for as many moves as for one pair alone (with the same seed, the same draws).
    start = TwoTurns()
    start.reset("t")
    calls = []

    def policy(envs):
        calls.append(len(envs))
        return coin_policy(0.5, rng)(envs)

    rng = random.Random(3)
    both = cq.mc_advantages([start, start, start], ["A", "A", "B"], policy, 50, keys=["s", "s", "s"])
    asked_both = sum(calls)
    calls.clear()
    rng = random.Random(3)
    one = cq.mc_advantages([start, start], ["A", "B"], policy, 50, keys=["s", "s"])
    assert sum(calls) == asked_both
    assert both.a_star[0] == both.a_star[1] == one.a_star[0] and both.a_star[2] == one.a_star[1]
    assert both.v[0] == both.v[2]  # one V for the state, whatever the action


def test_regroup_splits_each_group_into_consecutive_subgroups():
    assert cq._regroup([0, 0, 0, 0, 1, 1, 1, 1], 2) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cq._regroup([5, 5, 5, 2, 2, 2], 3) == [0, 0, 0, 1, 1, 1]
    assert cq._group_sizes(8) == [2, 4, 8] and cq._group_sizes(6) == [2, 6]


def _result(rows):
    return {"method": "graphgpo", "env": "sokoban", "labels": ["M", "B"], "config": vars(cq.Config(tasks=2, group=2)),
            "rows": rows, "episodes": 4, "success": 0.5, "turns_in_batch": len(rows), "turns_scored": len(rows),
            "seconds": 1.0, "mc_seconds": 0.5, "return_measured": "success"}


def test_summary_and_report_between_the_markers(tmp_path):
    # Credit M orders the turns as A* does (rho 1, AUC 1); B reverses them (rho -1, AUC 0).
    a = [0.4, 0.2, -0.1, -0.3, 0.1, -0.2]
    rows = [{"traj": i // 2, "group": i // 4, "turn": i % 2, "group_success": 0.5 if i < 4 else 0.0,
             "credit": {"M": x, "B": -x}, "credit_by_group_size": {}, "a_star": x, "se": 0.0} for i, x in enumerate(a)]
    res = _result(rows)
    res["summary"] = s = cq.summarize(res, reps=50)
    assert s["credit"]["M"]["spearman"] == pytest.approx(1.0) and s["credit"]["M"]["auc"] == 1.0
    assert s["credit"]["B"]["spearman"] == pytest.approx(-1.0) and s["credit"]["B"]["auc"] == 0.0
    assert s["reliability"] == 1.0 and s["by_success"]["group success 0"]["M"]["turns"] == 2
    # the paired difference, method minus baseline, in every resample: 1 - (-1) and 1 - 0
    assert s["vs_method"]["B"]["spearman"] == pytest.approx(2.0) and s["vs_method"]["B"]["spearman_ci"] == pytest.approx([2, 2])
    assert s["vs_method"]["B"]["auc"] == 1.0
    # within episodes (episodes 0, 1, 2 with two turns each): M's centred credit is A*'s, B's its negative
    assert s["credit"]["M"]["within"] == pytest.approx(1.0) and s["credit"]["B"]["within"] == pytest.approx(-1.0)
    # episode means of A*: 0.3, -0.2, -0.05 -> M orders them as A* does, B reverses them
    assert s["credit"]["M"]["between"] == pytest.approx(1.0) and s["credit"]["B"]["between"] == pytest.approx(-1.0)
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n")
    data = {"seed": 4, "seconds": 60.0, "machine": "test", "results": {"graphgpo": res}}
    cq.write_report(data, doc)
    cq.write_report(data, doc)  # a second report replaces the first
    text = doc.read_text()
    assert text.startswith("intro\n") and text.count(cq.REPORT_BEGIN) == 1 and text.count(cq.REPORT_END) == 1
    assert "| **M** (graphgpo) | 1.00 / 1.00 |" in text and "| B (graphgpo) | -1.00 / 0.00 |" in text
    assert "| B | -1.00 [-1.00, -1.00] | 0.00 [0.00, 0.00] | -1.00 [-1.00, -1.00] | -1.00 [-1.00, -1.00] |" in text


def test_pool_seeds_by_hand():
    # estimates 0.1, 0.3, 0.5, each variance 0.01: fixed mean 0.3, Q = 100 x (0.04 + 0 + 0.04) = 8,
    # C = 300 - 30000 / 300 = 200, tau^2 = (8 - 2) / 200 = 0.03; weights 1 / 0.04 = 25 each, mean 0.3;
    # Hartung-Knapp factor 25 x 0.08 / 2 = 1 -> SE^2 = 1 / 75; t(2, 0.975) = 4.302653 -> half-width 0.496828
    r = cq.pool_seeds([0.1, 0.3, 0.5], [0.01] * 3)
    assert r["value"] == pytest.approx(0.3) and r["tau"] == pytest.approx(math.sqrt(0.03))
    assert r["ci"] == pytest.approx([0.3 - 0.496828, 0.3 + 0.496828], abs=1e-6) and r["seeds"] == 3
    # equal estimates: tau 0, the factor is held at 1: SE^2 = 1 / (100 + 100 / 3) = 0.0075; t(1) = 12.7062
    r = cq.pool_seeds([0.2, 0.2, float("nan")], [0.01, 0.03, 0.01])
    assert r["tau"] == 0 and r["seeds"] == 2 and r["ci"][1] == pytest.approx(0.2 + 12.7062 * math.sqrt(0.0075), abs=1e-3)
    # the interval is cut to what the statistic can take; one seed: its own normal interval
    assert cq.pool_seeds([0.9, 0.95, 0.99], [0.01] * 3, bounds=(-1, 1))["ci"][1] == 1
    assert cq.pool_seeds([0.5], [0.04])["ci"] == pytest.approx([0.5 - 1.959964 * 0.2, 0.5 + 1.959964 * 0.2])


def test_pooled_table_of_two_seeds(tmp_path):
    # seed 4: M orders the turns as A* does, B reverses them (as in the test above); seed 5: the same turns
    # with B equal to M. Per seed rho of M: 1, 1; of B: -1, 1; M minus B: 2, 0.
    a = [0.4, 0.2, -0.1, -0.3, 0.1, -0.2]

    def data(seed, b_sign):
        rows = [{"traj": i // 2, "group": i // 4, "turn": i % 2, "group_success": 0.5, "a_star": x, "se": 0.0,
                 "credit": {"M": x, "B": b_sign * x}, "credit_by_group_size": {}} for i, x in enumerate(a)]
        return {"seed": seed, "results": {"graphgpo": _result(rows)}}

    pooled = cq.pooled_summary([data(4, -1), data(5, 1), {"seed": 6, "results": {}}], reps=40)
    r = pooled["results"]["graphgpo"]
    assert r["seeds"] == [4, 5] and pooled["seeds"] == [4, 5, 6]
    assert r["credit"]["M"]["spearman"]["per_seed"] == pytest.approx([1, 1])
    assert r["credit"]["B"]["spearman"]["per_seed"] == pytest.approx([-1, 1])
    assert r["vs_method"]["B"]["spearman"]["per_seed"] == pytest.approx([2, 0])
    assert r["credit"]["M"]["spearman"]["ci"][1] <= 1 and r["vs_method"]["B"]["spearman"]["ci"][1] <= 2
    assert "| A* of graphgpo's turns: reliability (seeds 4 / 5) | " in cq.pooled_report(pooled)
    doc = tmp_path / "doc.md"
    cq.main(["--pool", str(_dump(tmp_path, data(4, -1))), str(_dump(tmp_path, data(5, 1))), "--doc", str(doc),
             "--reps", "40"])
    text = doc.read_text()
    assert text.count(cq.POOLED_BEGIN) == 1 and "| **M** (graphgpo) | 1.00 / 1.00 |" in text
    assert "| A* of graphgpo's turns: reliability | " in text  # seed 6 measured nothing: not named
    assert "| M minus B (paired) | 2.00 / 0.00 |" in text
    with pytest.raises(SystemExit, match="no such results file"):
        cq.main(["--pool", str(tmp_path / "missing.json")])


def test_a_seed_whose_credit_is_flat_is_left_out_of_that_credits_pool(tmp_path):
    # seeds 4 and 5 as above (B reversed, then B = M); on seed 6 B is 0 on every turn (a batch whose groups
    # all ended alike). B's rho there is undefined and its AUC a 0.5 tie with no bootstrap variance, a
    # weight of 1e12 in the pool: B and M minus B pool seeds 4 and 5 only; M keeps all three seeds.
    a = [0.4, 0.2, -0.1, -0.3, 0.1, -0.2]

    def data(seed, b):
        rows = [{"traj": i // 2, "group": i // 4, "turn": i % 2, "group_success": 0.5, "a_star": x, "se": 0.0,
                 "credit": {"M": x, "B": b(x)}, "credit_by_group_size": {}} for i, x in enumerate(a)]
        return {"seed": seed, "results": {"graphgpo": _result(rows)}}

    datas = [data(4, lambda x: -x), data(5, lambda x: x), data(6, lambda x: 0.0)]
    r = cq.pooled_summary(datas, reps=40)["results"]["graphgpo"]
    assert r["credit"]["M"]["auc"]["seeds"] == 3 and r["credit"]["M"]["auc"]["value"] == pytest.approx(1.0)
    b_auc = r["credit"]["B"]["auc"]
    assert b_auc["seeds"] == 2 and math.isnan(b_auc["per_seed"][2])
    assert b_auc["per_seed"][:2] == pytest.approx([0, 1]) and b_auc["value"] == pytest.approx(0.5)
    assert r["vs_method"]["B"]["spearman"]["seeds"] == 2 and r["vs_method"]["B"]["auc"]["seeds"] == 2
    doc = tmp_path / "doc.md"
    cq.main(["--pool", *(str(_dump(tmp_path, d)) for d in datas), "--doc", str(doc), "--reps", "40"])
    text = doc.read_text()
    assert "| B (graphgpo) | -1.00 / 1.00 / n/a |" in text and "(2 of 3 seeds)" in text
    assert "(0 of" not in text and "of 0 seeds" not in text


def _dump(tmp_path, data):
    import json

    path = tmp_path / f"seed{data['seed']}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def one_thread():
    """One torch thread, as the benchmark runs (on a busy 2-core machine more threads make it many times slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_graphgpo_adapter_on_a_micro_policy(tiny_cache, one_thread):
    # GRPO's credit is the episode term alone: one value for every turn of an episode.
    # two turns and eight tokens at most: an untrained micro policy would otherwise play 15 long turns
    fast = ["--tiny-preset", "micro", "--max-turns", "2", "--max-new-tokens", "8"]
    res = cq.graphgpo_batch(cq.Config(tasks=2, group=2, n=1, turns=4, seed=1), argv=fast)
    assert res["labels"] == ["GraphGPO", "GRPO", "GiGPO"] and res["turns_scored"] == 4 and res["episodes"] == 4
    for r in res["rows"]:
        assert set(r["credit"]) == set(res["labels"]) and set(r["credit_by_group_size"]) == set()
        assert all(np.isfinite([r["a_star"], r["se"], *r["credit"].values()]))
    by_traj = {}
    for r in res["rows"]:
        by_traj.setdefault(r["traj"], set()).add(r["credit"]["GRPO"])
    assert all(len(v) == 1 for v in by_traj.values())


def test_aria_adapter_scores_each_seat_on_a_micro_policy(tiny_cache, one_thread):
    res = cq.aria_batch(cq.Config(tasks=1, group=2, n=1, turns=4, seed=1),
                        argv=["--tiny-preset", "micro", "--max-new-tokens", "8"])
    assert res["labels"] == ["ARIA", "REINFORCE"] and res["turns_scored"] == 4
    for r in res["rows"]:
        assert 0.0 <= r["q"] <= 1.0 and 0.0 <= r["v"] <= 1.0  # a seat's normalised payoff
        assert r["credit"]["REINFORCE"] >= 0.0  # raw discounted returns of outcomes in [0, 1]


def test_istar_adapter_trains_its_prm_as_the_script_does(tiny_cache, monkeypatch):
    """The warm-up PRM steps use istar.py's own PRM settings (the tiny preset's learning rate) and its
    replay of earlier batches' pairs, as the script's main loop does: replay 0, 1, 2 batches before the
    three PRM steps of 2 warm-up batches + the scored batch."""
    import istar

    seen = []
    original = istar.prm_update

    def recording(model, tok, optimizer, samples, succ, grp, args, replay=()):
        seen.append((len(replay), optimizer.param_groups[0]["lr"]))
        return original(model, tok, optimizer, samples, succ, grp, args, replay)

    monkeypatch.setattr(istar, "prm_update", recording)
    res = cq.istar_batch(cq.Config(tasks=2, group=4, n=1, turns=2, seed=0), argv=["--tiny-preset", "micro"],
                         warm_batches=2)
    lr = istar.DEFAULTS["tiny"]["prm_learning_rate"]
    assert seen == [(0, lr), (1, lr), (2, lr)]
    assert res["prm_learning_rate"] == lr and res["prm_replay"] == istar.DEFAULTS["tiny"]["prm_replay"]


def test_delta_belief_adapter_scores_three_credits_on_a_micro_policy(tiny_cache, one_thread, monkeypatch):
    """ΔBelief at the script's λ, StarPO, and ΔBelief at λ 0 (the same turn-wise normalisation without the
    belief gain), each at the batch's group size (4) and at its subgroups of 2."""
    import delta_belief

    seen = []
    original = delta_belief.compute_advantages

    def recording(episodes, args, signal=None):
        seen.append((args.reward_mode, args.lam))
        return original(episodes, args, signal)

    monkeypatch.setattr(delta_belief, "compute_advantages", recording)
    res = cq.delta_belief_batch(cq.Config(tasks=1, group=4, n=1, turns=4, seed=1),
                                argv=["--tiny-preset", "micro", "--max-turns", "2", "--max-new-tokens", "8"])
    assert res["labels"] == ["ΔBelief", "StarPO", "λ 0"] and res["turns_scored"] == 4
    lam = delta_belief.Args.lam
    assert lam > 0 and seen == [("delta", lam), ("starpo", lam), ("delta", 0.0)] * 2  # G = 2, then G = 4
    by_traj = {}
    for r in res["rows"]:
        assert set(r["credit"]) == set(res["labels"]) and set(r["credit_by_group_size"]) == {"2"}
        by_traj.setdefault(r["traj"], set()).add(r["credit"]["StarPO"])
    assert all(len(v) == 1 for v in by_traj.values())  # StarPO: one advantage for all of an episode's turns


def test_model_name_and_tiny_preset_reach_the_adapters_as_script_flags(monkeypatch, tmp_path, one_thread):
    """`--model-name` (a pretrained model on a GPU) and `--tiny-preset` are handed to the method adapter as the
    script's own flags (built once for every method), so its `tyro.cli(<script>.Args, ...)` loads that model."""
    seen = {}

    class Stop(Exception):
        pass

    def recording(cfg, argv=(), **kw):
        seen["argv"] = list(argv)
        raise Stop

    monkeypatch.setitem(cq.ADAPTERS, "graphgpo", recording)
    with pytest.raises(Stop):
        cq.main(["--methods", "graphgpo", "--model-name", "Qwen/Qwen2.5-1.5B-Instruct", "--out", str(tmp_path / "o.json")])
    assert seen["argv"] == ["--model-name", "Qwen/Qwen2.5-1.5B-Instruct"]
    with pytest.raises(Stop):
        cq.main(["--methods", "graphgpo", "--tiny-preset", "micro", "--out", str(tmp_path / "o.json")])
    assert seen["argv"] == ["--tiny-preset", "micro"]


def test_epo_adapter_plays_scripted_styles_even_when_the_preset_trains_in_self_chat(tiny_cache, one_thread):
    # A* continues each game against its scripted opponent, so a self-chat preset (a real model's) is
    # measured against the styles; the rows then name a style, never "self".
    res = cq.epo_batch(cq.Config(tasks=1, group=2, n=1, turns=3, seed=1),
                       argv=["--tiny-preset", "micro", "--max-new-tokens", "8", "--train-opponent", "self"])
    assert res["labels"] == ["EPO", "outcome-only"] and res["turns_scored"] == 3
    assert {r["opponent"] for r in res["rows"]} <= {"fair", "tough", "conceding", "tit_for_tat"}
    for r in res["rows"]:
        assert 0.0 <= r["q"] <= 1.0 and 0.0 <= r["v"] <= 1.0  # goal score / 10
