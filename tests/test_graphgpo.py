"""GraphGPO: credit functions against hand-computed numbers, and the script end to end (GraphGPO, GiGPO
and GRPO modes, fuzzy matching) on the micro tiny Sokoban policy."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO, assert_adapter_trained, assert_run_outputs, load_benchmark, read_metrics

import graphgpo as gg

S2 = 1 / math.sqrt(2)
S3 = 1 / math.sqrt(3)
S129 = 1 / math.sqrt(129)


# ---------------------------------------------------------------------------------------------
# graph_distances
# ---------------------------------------------------------------------------------------------
# One group, two trajectories (the paper's Fig. 2/3 situation):
#   tau_0 (success): A -> B -> C -> B -> D -> goal     (loop B -> C -> B)
#   tau_1 (failure): A -> E -> B -> F                  (F is a dead end: no way to the goal)
# B is visited by both trajectories.
TAU0 = ["A", "B", "C", "B", "D", "solved-grid"]  # the last state is replaced by the goal node
TAU1 = ["A", "E", "B", "F"]


def test_graph_distances_loop_dead_end_shared_state():
    # reversed BFS from G: D -> G (1); B -> D (2); A -> B, C -> B, E -> B (3)
    # F reaches nothing -> d_max + 1 = 3 + 1 = 4
    tr = [("A", "B"), ("B", "C"), ("C", "B"), ("B", "D"), ("D", "G"), ("A", "E"), ("E", "B"), ("B", "F")]
    d = gg.graph_distances(tr, "G")
    assert d == {"A": 3, "B": 2, "C": 3, "D": 1, "G": 0, "E": 3, "F": 4}


def test_graph_distances_goal_absent_and_only_goal_reachable():
    # goal never occurs -> every node 1
    assert gg.graph_distances([("a", "b"), ("b", "c")], "g") == {"a": 1, "b": 1, "c": 1}
    # the goal occurs but nothing reaches it (it only has an outgoing edge): d_max = 0 -> others get 1
    assert gg.graph_distances([("a", "b"), ("g", "h")], "g") == {"a": 1, "b": 1, "g": 0, "h": 1}
    # c -> g gives d(c) = 1 = d_max; a, b unreachable -> 2
    assert gg.graph_distances([("a", "b"), ("c", "g")], "g") == {"a": 2, "b": 2, "c": 1, "g": 0}
    # parallel edges and self-loops change nothing: x -> x, x -> g twice -> d(x) = 1
    assert gg.graph_distances([("x", "x"), ("x", "g"), ("x", "g")], "g") == {"x": 1, "g": 0}
    assert gg.graph_distances([], "g") == {}


def test_graph_distances_takes_the_shortest_path():
    # a -> b -> c -> g and a shortcut a -> g: d(a) = 1 not 3; d_max = 2 (b)
    d = gg.graph_distances([("a", "b"), ("b", "c"), ("c", "g"), ("a", "g"), ("z", "a")], "g")
    assert d == {"a": 1, "b": 2, "c": 1, "g": 0, "z": 2}


# ---------------------------------------------------------------------------------------------
# graph_step_advantages
# ---------------------------------------------------------------------------------------------
def test_kernel_takes_tuple_states_of_different_lengths():
    """WebShop's state keys are tuples of different lengths ("search",), ("results", query, page), ...:
    each stays one state. The kernel's worked example (docstring of graphgpo_advantages) with its states
    written as such tuples gives its hand-computed advantages: 1.732, 1.862, -1.732, -0.577, 0, -1.284."""
    a, b, c, d = ("search",), ("results", "red shoes", 1), ("item", "red shoes", 1, "x", ()), ("bought", "y", ())
    win = ("bought", "x", (("size", "9"),))
    adv = gg.graphgpo_advantages(group=[0] * 6, traj=[0, 0, 1, 1, 2, 2], state=[a, b, a, c, a, b],
                                 next_state=[b, win, c, c, b, d], success=[1, 1, 0, 0, 0, 0],
                                 invalid=[0] * 6, omega=0.5, eps=0.0)
    assert np.allclose(adv, [1.732, 1.862, -1.732, -0.577, 0.0, -1.284], atol=1e-3)


def test_graph_step_advantages_hand_computed():
    # omega = 0.5, r_succ = 10; distances as above (G = the goal node): R = 10 * 0.5 ** (d(s') + 1)
    #   tau_0: A->B d=2: 10/8 = 1.25 | B->C d=3: 10/16 = 0.625 | C->B 1.25 | B->D d=1: 2.5 | D->G d=0: 5
    #   tau_1: A->E d=3: 0.625 | E->B d=2: 1.25 | B->F d=4: 10/32 = 0.3125
    # groups by source state:
    #   A: {1.25 (tau_0), 0.625 (tau_1)}: mean 0.9375, unbiased std = 0.3125 * sqrt(2) -> +-1/sqrt(2)
    #   B: {0.625, 2.5 (tau_0), 0.3125 (tau_1)} = {30, 120, 15} / 48: mean 55/48,
    #      deviations -25/48, 65/48, -40/48; sum of squares 6450/48^2; unbiased var 3225/48^2;
    #      std sqrt(3225)/48 = 5 sqrt(129)/48 -> A = -5/sqrt(129), 13/sqrt(129), -8/sqrt(129)
    #   C, D, E: one step each -> 0
    # The loop step B->C of the *successful* trajectory gets a negative advantage; the step B->D
    # toward the goal the highest; the failed trajectory's B->F into a dead end the lowest.
    adv = gg.graph_step_advantages([TAU0, TAU1], [True, False], omega=0.5, r_succ=10.0, eps=0.0)
    np.testing.assert_allclose(adv[0], [S2, -5 * S129, 0.0, 13 * S129, 0.0], atol=1e-12)
    np.testing.assert_allclose(adv[1], [-S2, 0.0, -8 * S129], atol=1e-12)
    # default eps = 1e-6 divides by std + 1e-6: A-group std = 0.3125 * sqrt(2)
    adv = gg.graph_step_advantages([TAU0, TAU1], [True, False], omega=0.5)
    assert adv[0][0] == pytest.approx(0.3125 / (0.3125 * math.sqrt(2) + 1e-6), abs=1e-12)


def test_fuzzy_matching_groups_the_steps_by_the_matched_node():
    # App. D.3: matched states "are treated as identical", in the graph and in Eq. 5's step groups.
    # Four WebShop trajectories whose start pages differ only in an ad suffix (A1..A4 merge into A):
    #   tau0 A1 -> b -> goal (success), tau1 A2 -> c, tau2 A3 -> b -> d, tau3 A4 -> c
    # d(goal) 0, d(b) 1, d(A) 2, c and d never reach the goal: d_max + 1 = 3. R = 10 * 0.5^(d(s') + 1):
    #   from A: 2.5, 0.625, 2.5, 0.625: mean 1.5625, deviations +-0.9375, unbiased std 0.9375 * 2 / sqrt(3)
    #   -> A^G = +-sqrt(3) / 2 = +-0.866;  from b: 5 (tau0), 0.625 (tau2) -> +-1 / sqrt(2)
    # With the start steps grouped by their exact keys every start step is alone in its group: A^G = 0
    # there, and the graph's signal at the start (the step that chose b over c) is lost.
    page = "results for red running shoes: B01 trail runner $39, B02 road runner $45, B03 spikes $52 [ad {}]"
    starts = [page.format(i) for i in (1, 2, 3, 4)]
    b, c, d = "item B01 trail runner, $39; click buy now", "no results; back to search", "item B03 spikes, $52"
    node_of = gg.fuzzy_node_map(starts + [b, c, d], threshold=0.95)
    assert len({node_of[s] for s in starts}) == 1 and len({node_of[x] for x in (b, c, d)}) == 3
    episodes = [[starts[0], b, "won"], [starts[1], c], [starts[2], b, d], [starts[3], c]]
    won = [True, False, False, False]
    adv = gg.graph_step_advantages(episodes, won, omega=0.5, eps=0.0, node_of=node_of)
    h, r = math.sqrt(3) / 2, 1 / math.sqrt(2)
    for got, want in zip(adv, [[h, r], [-h], [h, -r], [-h]]):
        np.testing.assert_allclose(got, want, atol=1e-12)
    exact = gg.graph_step_advantages(episodes, won, omega=0.5, eps=0.0)  # no matching: singletons at the start
    assert [e[0] for e in exact] == [0.0, 0.0, 0.0, 0.0]
    # the kernel from per-turn arrays, --state-match fuzzy: the same start advantages plus A^E
    turns = [(m, t) for m, e in enumerate(episodes) for t in range(len(e) - 1)]
    full = gg.graphgpo_advantages(group=[0] * len(turns), traj=[m for m, _ in turns],
                                  state=[episodes[m][t] for m, t in turns],
                                  next_state=[episodes[m][t + 1] for m, t in turns],
                                  success=[won[m] for m, _ in turns], invalid=[False] * len(turns),
                                  omega=0.5, eps=0.0, beta_episode=0.0, fuzzy_threshold=0.95)
    np.testing.assert_allclose(full, [h, r, -h, h, -r, -h], atol=1e-12)


def test_graph_step_advantages_no_success_and_invalid_penalty():
    # no success: every node d = 1 -> every R = 10 * 0.5^2 = 2.5, then -0.1 for an invalid action
    #   tau_0: S -> P -> Q ; tau_1: S -> S (invalid, nothing moved) -> R
    #   group S: {2.5 (tau_0 t0), 2.4 (tau_1 t0, invalid), 2.5 (tau_1 t1)}: mean 2.4667,
    #   deviations 1/30, -2/30, 1/30; unbiased var (6/900)/2 = 1/300; std = 1/sqrt(300)
    #   -> A = (1/30) sqrt(300) = 1/sqrt(3), -2/sqrt(3), 1/sqrt(3);  group P: one step -> 0
    eps = [["S", "P", "Q"], ["S", "S", "R"]]
    inv = [[False, False], [True, False]]
    adv = gg.graph_step_advantages(eps, [False, False], omega=0.5, eps=0.0, invalid=inv, invalid_penalty=0.1)
    np.testing.assert_allclose(adv[0], [S3, 0.0], atol=1e-9)
    np.testing.assert_allclose(adv[1], [-2 * S3, S3], atol=1e-9)
    # without the invalid flags every reward is equal -> all zero
    for a in gg.graph_step_advantages(eps, [False, False], omega=0.5):
        np.testing.assert_array_equal(a, 0.0)


def test_graph_step_advantages_step_cost_changes_ranking_with_invalid_actions():
    # omega 0.2. A: s0 -> s0 -> s2 -> goal, all three actions invalid (success); B: s0 -> s1 (valid, failure).
    # d(goal) 0, d(s2) 1, d(s0) 2, d(s1) = inf -> d_max + 1 = 3. The s0 group holds A's first two steps and B's.
    # c = 1 (paper): R = 10*0.2^3 - 0.1 = -0.02, 10*0.2^2 - 0.1 = 0.3, 10*0.2^4 = 0.016; mean 0.098667,
    #   deviations -0.118667, 0.201333, -0.082667; unbiased var 0.0307253; std 0.175286
    #   -> A = -0.67700, 1.14859, -0.47161
    # c = 0 (official): R = 0.3, 1.9, 0.08; mean 0.76; deviations -0.46, 1.14, -0.68; var 0.9868; std 0.993378
    #   -> A = -0.46307, 1.14760, -0.68453
    eps = [["s0", "s0", "s2", "end"], ["s0", "s1"]]
    inv = [[True, True, True], [False]]
    paper = gg.graph_step_advantages(eps, [True, False], omega=0.2, eps=0.0, invalid=inv)
    np.testing.assert_allclose([paper[0][0], paper[0][1], paper[1][0]], [-0.67700, 1.14859, -0.47161], atol=1e-4)
    official = gg.graph_step_advantages(eps, [True, False], omega=0.2, eps=0.0, invalid=inv, step_cost=0.0)
    np.testing.assert_allclose([official[0][0], official[0][1], official[1][0]], [-0.46307, 1.14760, -0.68453],
                               atol=1e-4)
    assert gg.Args().step_cost == 1.0


def test_graph_step_advantages_singletons_and_empty_episode():
    # no state repeats anywhere -> all steps are singleton groups -> 0, even with a success
    adv = gg.graph_step_advantages([["a", "b", "c"], ["x", "y"], ["q"]], [True, False, False], omega=0.8)
    assert [list(a) for a in adv] == [[0.0, 0.0], [0.0], []]


def test_graph_step_advantages_success_goal_is_shared_sentinel():
    # two successful trajectories whose last *keys* differ ("w1", "w2") still end in the same goal node:
    #   tau_0: s -> m -> w1 (success), tau_1: s -> w2 (success), tau_2: s -> m -> x (fail)
    #   d(goal) = 0, d(m) = 1, d(s) = 1 (s -> goal directly), d(x) = d_max + 1 = 2
    #   omega 0.5: group s: tau_0 s->m 10*0.5^2 = 2.5, tau_1 s->goal 10*0.5 = 5, tau_2 s->m 2.5
    #      mean 10/3, deviations -5/6, 5/3, -5/6; var (25/36 + 100/36 + 25/36)/2 = 150/72; std = 5/sqrt(12)
    #      -> -1/sqrt(3), 2/sqrt(3), -1/sqrt(3)
    #   group m: tau_0 m->goal 5, tau_2 m->x 10*0.5^3 = 1.25 -> +-1/sqrt(2)
    eps = [["s", "m", "w1"], ["s", "w2"], ["s", "m", "x"]]
    adv = gg.graph_step_advantages(eps, [True, True, False], omega=0.5, eps=0.0)
    np.testing.assert_allclose(adv[0], [-S3, S2], atol=1e-12)
    np.testing.assert_allclose(adv[1], [2 * S3], atol=1e-12)
    np.testing.assert_allclose(adv[2], [-S3, -S2], atol=1e-12)


def test_graph_step_advantages_permutation_equivariant():
    rng = np.random.default_rng(0)
    eps = [list(rng.integers(0, 4, size=int(rng.integers(2, 7)))) for _ in range(6)]
    succ = [bool(rng.integers(0, 2)) for _ in eps]
    inv = [[bool(rng.integers(0, 2)) for _ in range(len(e) - 1)] for e in eps]
    base = gg.graph_step_advantages(eps, succ, 0.8, invalid=inv)
    perm = [3, 0, 5, 1, 4, 2]
    out = gg.graph_step_advantages([eps[i] for i in perm], [succ[i] for i in perm], 0.8,
                                   invalid=[inv[i] for i in perm])
    for j, i in enumerate(perm):
        np.testing.assert_allclose(out[j], base[i], atol=1e-12)


def test_graph_step_advantages_fuzzy_nodes_and_groups():
    # n1 and n1' differ in one character of 41 -> similarity 2*40/82 = 0.9756 >= 0.95: one graph node.
    #   tau_0 (success): s -> n1 -> goal;  tau_1 (fail): s -> n1' -> dead
    # exact nodes: d(n1) = 1, d(s) = 2 = d_max, d(n1') = d(dead) = 3
    #   group s: tau_0 10*0.5^2 = 2.5, tau_1 10*0.5^4 = 0.625 -> +-1/sqrt(2); n1, n1' alone -> 0
    # fuzzy nodes: n1' is n1 -> d(n1') = 1 -> both s-steps 2.5 -> 0, 0; and the steps from n1 and
    #   n1' are one group (App. D.3): n1 -> goal 10*0.5^1 = 5, n1' -> dead 10*0.5^4 = 0.625 -> +-1/sqrt(2)
    n1, n1p = "x" * 40 + "A", "x" * 40 + "B"
    eps = [["s", n1, "win"], ["s", n1p, "dead"]]
    exact = gg.graph_step_advantages(eps, [True, False], omega=0.5, eps=0.0)
    np.testing.assert_allclose(exact[0], [S2, 0.0], atol=1e-12)
    np.testing.assert_allclose(exact[1], [-S2, 0.0], atol=1e-12)
    node_of = gg.fuzzy_node_map(["s", n1, "win", n1p, "dead"], 0.95)
    assert node_of[n1p] == n1 and node_of["s"] == "s" and node_of["dead"] == "dead"
    fuzzy = gg.graph_step_advantages(eps, [True, False], omega=0.5, eps=0.0, node_of=node_of)
    np.testing.assert_allclose(fuzzy[0], [0.0, S2], atol=1e-12)
    np.testing.assert_allclose(fuzzy[1], [0.0, -S2], atol=1e-12)


def test_fuzzy_node_map_threshold_and_first_match():
    a, b, c = "x" * 40 + "A", "x" * 40 + "B", "x" * 38 + "CDE"
    # ratio(a, b) = 80/82 = 0.9756; ratio(a, c) = 2*38/82 = 0.927 -> c stays alone at 0.95
    m = gg.fuzzy_node_map([a, b, c], 0.95)
    assert m == {a: a, b: a, c: c}
    # at 0.9 c joins the first cluster (a), not a later one
    assert gg.fuzzy_node_map([a, c, b], 0.9) == {a: a, c: a, b: a}
    # threshold 1.0 keeps every distinct key
    assert gg.fuzzy_node_map([a, b, a], 1.0) == {a: a, b: b}


# ---------------------------------------------------------------------------------------------
# grpo_advantages
# ---------------------------------------------------------------------------------------------
def test_grpo_advantages():
    # [10, 0, 0, 10]: mean 5, unbiased std sqrt(4 * 25 / 3) = 10/sqrt(3) -> +-5 sqrt(3)/10 = +-sqrt(3)/2
    np.testing.assert_allclose(gg.grpo_advantages([10.0, 0.0, 0.0, 10.0], eps=0.0),
                               [math.sqrt(3) / 2, -math.sqrt(3) / 2, -math.sqrt(3) / 2, math.sqrt(3) / 2])
    # [9.9, 10, 0]: mean 6.6333, deviations 3.2667, 3.3667, -6.6333; sum sq 10.671 + 11.334 + 44.001
    #   = 66.007; var 33.0033; std 5.74485 -> 0.56863, 0.58604, -1.15466
    np.testing.assert_allclose(gg.grpo_advantages([9.9, 10.0, 0.0], eps=0.0), [0.56863, 0.58604, -1.15466],
                               atol=1e-5)
    assert list(gg.grpo_advantages([10.0])) == [0.0]  # a group of one
    np.testing.assert_array_equal(gg.grpo_advantages([0.0, 0.0, 0.0]), 0.0)  # all failed
    np.testing.assert_array_equal(gg.grpo_advantages([10.0, 10.0]), 0.0)  # all succeeded


# ---------------------------------------------------------------------------------------------
# gigpo_step_advantages
# ---------------------------------------------------------------------------------------------
def test_gigpo_step_advantages_hand_computed():
    # gamma = 0.5. tau_0 (success) A -> B -> C -> win, rewards 0, 0, 10 -> returns 2.5, 5, 10
    #              tau_1 (fail)    A -> B -> A -> E,   rewards 0, 0, 0  -> returns 0, 0, 0
    # group A: {2.5 (tau_0 t0), 0 (tau_1 t0), 0 (tau_1 t2)}: mean 5/6, deviations 5/3, -5/6, -5/6;
    #   sum sq 25/9 + 2 * 25/36 = 150/36; var 75/36; std 5 sqrt(3)/6 -> 2/sqrt(3), -1/sqrt(3), -1/sqrt(3)
    # group B: {5, 0} -> +-1/sqrt(2); group C: one step -> 0
    eps = [["A", "B", "C", "win"], ["A", "B", "A", "E"]]
    adv = gg.gigpo_step_advantages(eps, [[0, 0, 10], [0, 0, 0]], gamma=0.5, eps=0.0)
    np.testing.assert_allclose(adv[0], [2 * S3, S2, 0.0], atol=1e-12)
    np.testing.assert_allclose(adv[1], [-S3, -S2, -S3], atol=1e-12)


def test_gigpo_step_advantages_invalid_penalty_and_short_states():
    # same group, tau_1's last step (from A) invalid: group A = {2.5, 0, -0.1}: mean 0.8,
    #   deviations 1.7, -0.8, -0.9; sum sq 2.89 + 0.64 + 0.81 = 4.34; var 2.17; std sqrt(2.17) = 1.4730920
    #   -> 1.7 / 1.4730920 = 1.1540352, -0.8 / 1.4730920 = -0.5430754, -0.9 / 1.4730920 = -0.6109598
    # states may be given without s_{T+1} (only s_1..s_T are used)
    eps = [["A", "B", "C"], ["A", "B", "A"]]
    inv = [[False, False, False], [False, False, True]]
    adv = gg.gigpo_step_advantages(eps, [[0, 0, 10], [0, 0, 0]], gamma=0.5, eps=0.0, invalid=inv)
    np.testing.assert_allclose(adv[0], [1.1540352, S2, 0.0], atol=1e-6)
    np.testing.assert_allclose(adv[1], [-0.5430754, -S2, -0.6109598], atol=1e-6)
    # constant rewards and no repeated states give zero
    for a in gg.gigpo_step_advantages([["a", "b"], ["c", "d"]], [[1, 1], [1, 1]]):
        np.testing.assert_array_equal(a, 0.0)


def test_discounted_returns():
    # [1, 0, 2] gamma 0.5: G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
    np.testing.assert_allclose(gg.discounted_returns([1, 0, 2], 0.5), [1.5, 1.0, 2.0])
    assert len(gg.discounted_returns([], 0.9)) == 0


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
def test_policy_loss_hand_computed():
    import torch

    # two tokens, adv +1 and -1, old = ref = 0 log-prob; logp = log 1.5 (ratio 1.5, clipped at 1.2)
    # token 1: A = +1: -min(1.5, 1.2) = -1.2 ; token 2: A = -1: -min(-1.5, -1.2) = 1.5 (dual clip 3 not hit)
    # pg = (-1.2 + 1.5) / 2 = 0.15; k3 with ref - logp = -log 1.5: exp(.) = 2/3 -> 2/3 + log 1.5 - 1 = 0.072132
    # loss = 0.15 + 0.01 * 0.072132; only token 1 is clipped (for A < 0 the unclipped 1.5 > 1.2 is kept)
    # -> clip frac 1/2
    lp = torch.full((1, 2), math.log(1.5))
    zero = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss, pg, kl, cf = gg.policy_loss(lp, zero, zero, adv, torch.ones(1, 2), 0.2, 3.0, 0.01)
    k3 = 2 / 3 + math.log(1.5) - 1
    assert pg == pytest.approx(0.15) and kl == pytest.approx(k3) and cf == pytest.approx(0.5)
    assert float(loss) == pytest.approx(0.15 + 0.01 * k3)
    # a masked-out token does not count
    loss, pg, _, _ = gg.policy_loss(lp, zero, zero, adv, torch.tensor([[1.0, 0.0]]), 0.2, 3.0, 0.0)
    assert pg == pytest.approx(-1.2) and float(loss) == pytest.approx(-1.2)


# ---------------------------------------------------------------------------------------------
# the update's micro-batches
# ---------------------------------------------------------------------------------------------
def test_length_sorted_micro_batches_score_and_train_as_one_batch(random_llama_dir):
    """token_logprobs and update take their micro-batches in length order (less padding): each sample's
    log-probs come back in its own place, equal to the sample scored alone, under the policy and with the
    adapter off; the update's gradient over micro-batches of 3 equals the gradient of one pass over all."""
    import torch

    from tests.test_shared_blocks import _policy_with_a_trained_looking_adapter

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 2), (3, 1), (14, 3), (5, 2), (11, 1), (4, 3), (8, 2)]  # unsorted on purpose
    samples = [gg.Sample(torch.randint(5, 250, (p,), generator=g).tolist(),
                         torch.randint(5, 250, (c,), generator=g).tolist(), 0, i, 0, adv=(-1.0) ** i)
               for i, (p, c) in enumerate(lengths)]
    for adapter in ("default", None):
        got = gg.token_logprobs(model, tok, samples, adapter, micro_batch_size=3)
        for x, lp in zip(samples, got):
            with torch.no_grad(), model.disable_adapter() if adapter is None else contextlib.nullcontext():
                alone, _ = gg.completion_logprobs(model, tok, [x.prompt], [x.completion])
            assert lp.shape == (len(x.completion),) and torch.allclose(lp, alone[0], atol=1e-5)
    grads = []
    for micro in (3, 64):
        for x in samples:
            x.old = x.ref = None
        args = gg.Args(num_minibatches=1, micro_batch_size=micro, max_grad_norm=1e9, kl_coef=0.01)
        params = [p for p in model.parameters() if p.requires_grad]
        gg.update(model, tok, torch.optim.SGD(params, lr=0.0), samples, args, np.random.default_rng(0))
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-6)


# ---------------------------------------------------------------------------------------------
# end to end (micro tiny Sokoban policy)
# ---------------------------------------------------------------------------------------------
SMALL = ["--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "4", "--eval-num-tasks", "4",
         "--eval-every", "1", "--torch-threads", "1", "--lora-r", "8", "--lora-alpha", "8",
         "--learning-rate", "1e-2", "--max-turns", "6"]


def _needs_sokoban():
    import envs

    if "sokoban" not in envs.available():
        pytest.skip("envs/sokoban.py not in this checkout")


# every end-to-end run of this module, by name: conftest's `runs` starts them together when the first test
# needs one (E2E_SCRIPT with each flag list)
E2E_SCRIPT = "graphgpo.py"
E2E = {"graph": SMALL,
       **{mode: [SMALL[0], "1", *SMALL[2:], "--step-advantage", mode, "--state-match", "fuzzy", "--eval-every", "0"]
          for mode in ("gigpo", "none")}}


def test_end_to_end_graph(runs):
    _needs_sokoban()
    run_dir = runs["graph"].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "charts/success" in r]
    assert len(train) == 2
    for r in train:
        assert r["credit/adv_abs_mean"] >= 0.0 and 0.0 <= r["credit/adv_nonzero_frac"] <= 1.0
        assert 0.0 <= r["perf/credit_seconds"] < r["perf/iteration_seconds"]
        assert math.isfinite(r["losses/policy_loss"]) and r["losses/kl_ref"] >= 0.0
    for key in ("eval/success", "eval/success_greedy", "eval/success_val_temp"):
        assert 0.0 <= summary["last_eval"][key] <= 1.0
    assert summary["step_advantage"] == "graph"
    assert (run_dir / "samples.jsonl").read_text().strip()


@pytest.mark.parametrize("mode", ["gigpo", "none"])
def test_end_to_end_baselines(runs, mode):
    _needs_sokoban()
    run_dir = runs[mode].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    assert summary["step_advantage"] == mode


def test_bad_flag_is_one_clear_line(tiny_cache):
    proc = subprocess.run([sys.executable, str(REPO / "graphgpo.py"), "--omega", "1.5"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "omega" in proc.stderr and "Traceback" not in proc.stderr


def test_beta_graph_from_the_command_line_weighs_the_step_term_by_hand():
    # the kernel's doctest group (omega 0.5), its step term A^G per turn:
    #   tau0: 1/sqrt3, 1/sqrt2;  tau1: -2/sqrt3, 0;  tau2: 1/sqrt3, -1/sqrt2;  A^E = (2, -1, -1) / sqrt3
    # --beta-graph 0.5: A = 0.5 A^G + A^E
    import tyro

    args = tyro.cli(gg.Args, args=["--beta-graph", "0.5", "--omega", "0.5", "--adv-eps", "0"])
    rows = [(["a", "b", "win"], True), (["a", "c", "c"], False), (["a", "b", "d"], False)]
    episodes = [gg.Episode(traj_id=m, group_id=0, task_id="0", prompts=[[1]] * 2, completions=[[2]] * 2,
                           logprobs=[None] * 2, actions=["x"] * 2, invalid=[False] * 2, states=states,
                           success=won) for m, (states, won) in enumerate(rows)]
    samples, _ = gg.compute_advantages(episodes, args)
    s3, s2 = math.sqrt(3), math.sqrt(2)
    want = [0.5 / s3 + 2 / s3, 0.5 / s2 + 2 / s3, -1 / s3 - 1 / s3, -1 / s3, 0.5 / s3 - 1 / s3, -0.5 / s2 - 1 / s3]
    np.testing.assert_allclose([x.adv for x in samples], want, atol=1e-12)
