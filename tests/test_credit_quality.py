"""benchmarks/credit_quality.py: the Monte Carlo true advantage on a two-turn game whose values are worked
out by hand, and the agreement statistics on small cases computed by hand."""

from __future__ import annotations

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


def test_reliability_and_bootstrap_interval():
    # var(A*) with ddof 1 of [0, 1, 2, 3] = 5/3; mean se^2 = 0.25 -> 1 - 0.25 / (5/3) = 0.85
    assert cq.reliability([0, 1, 2, 3], [0.5] * 4) == pytest.approx(0.85)
    rng = np.random.default_rng(0)
    a = rng.normal(size=400)
    credit = a + rng.normal(scale=0.5, size=400)
    value, lo, hi = cq.bootstrap_ci(cq.spearman, credit, a, clusters=np.arange(400) // 4, reps=300)
    assert lo < value < hi and 0.8 < value < 0.95 and hi - lo < 0.1
