"""EPO: credit functions against hand-computed numbers, the PRM answer parser on malformed answers,
the rule PRM, and the script end to end (rule agent + rule PRM; base agent + LLM PRM)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import REPO, assert_adapter_trained, assert_run_outputs, read_metrics

import epo


# ---------------------------------------------------------------------------------------------
# one trajectory's weights A_t = G_t / max_t |G_t| (what epo_advantages gives each trajectory)
# ---------------------------------------------------------------------------------------------
def turn_weights(critical, outcome, gamma=0.99):
    return epo.batch_turn_weights([epo.epo_turn_returns(critical, outcome, gamma)])[0]


def test_weights_no_critical_turn_and_zero_outcome_are_all_zero():
    np.testing.assert_array_equal(turn_weights([False] * 4, 0.0), np.zeros(4))
    assert turn_weights([], 0.7).shape == (0,)


def test_weights_outcome_only():
    # T = 3, outcome 0.5: r = [0, 0, 0.5]; G = [0.5 * 0.99^2, 0.5 * 0.99, 0.5] = [0.49005, 0.495, 0.5]
    # max |G| = 0.5 -> A = [0.9801, 0.99, 1.0]
    np.testing.assert_allclose(turn_weights([0, 0, 0], 0.5), [0.9801, 0.99, 1.0], atol=1e-12)


def test_weights_critical_last_turn_drops_the_outcome():
    # critical = [T, F, T], outcome 0.8. The last turn is critical: r = [1, 0, 1] (0.8 is dropped)
    # G2 = 1, G1 = 0.99, G0 = 1 + 0.99 * 0.99 = 1.9801; max 1.9801
    # A = [1, 0.99 / 1.9801, 1 / 1.9801] = [1, 0.499974..., 0.505025...]
    # (with the outcome added, r2 = 1.8 would give G = [2.76418, 1.782, 1.8] instead)
    want = [1.0, 0.99 / 1.9801, 1.0 / 1.9801]
    np.testing.assert_allclose(turn_weights([True, False, True], 0.8), want, atol=1e-12)
    # only the last turn critical: r = [0, 0, 1] -> [0.9801, 0.99, 1], whatever the outcome
    np.testing.assert_allclose(turn_weights([False, False, True], 0.0), [0.9801, 0.99, 1.0], atol=1e-12)


def test_weights_worked_example_critical_turn_two_of_ten():
    # docs/epo.md, worked example: T = 10, turn 2 (index 1) critical, outcome 0.8, γ = 0.99
    # r = [0, 1, 0, 0, 0, 0, 0, 0, 0, 0.8]
    # G9 = 0.8; G_t = 0.8 * 0.99^(9-t) for t = 2..8; G1 = 1 + 0.99 * G2 = 1 + 0.8 * 0.99^8 = 1.738195755
    # G0 = 0.99 * G1 = 1.720813798; max = G1
    # A0 = 0.99, A1 = 1, A2 = 0.8 * 0.99^7 / G1 = 0.745652278 / 1.738195755 = 0.428981..., A9 = 0.8 / G1 = 0.460247...
    A = turn_weights([t == 1 for t in range(10)], 0.8)
    g1 = 1 + 0.8 * 0.99 ** 8
    assert A[0] == pytest.approx(0.99, abs=1e-12)
    assert A[1] == pytest.approx(1.0, abs=1e-12)
    assert A[2] == pytest.approx(0.428981, abs=1e-6)
    assert A[9] == pytest.approx(0.460247, abs=1e-6)
    np.testing.assert_allclose(A[2:], [0.8 * 0.99 ** (9 - t) / g1 for t in range(2, 10)], atol=1e-12)


def test_weights_zero_outcome_critical_turn_and_gamma_one():
    # outcome 0, turn 3 of 5 critical: r = [0, 0, 1, 0, 0] -> G = [0.9801, 0.99, 1, 0, 0] -> same / 1
    np.testing.assert_allclose(turn_weights([0, 0, 1, 0, 0], 0.0), [0.9801, 0.99, 1.0, 0.0, 0.0], atol=1e-12)
    # γ = 1, critical = [F, T, F, F], outcome 0.5: r = [0, 1, 0, 0.5] -> G = [1.5, 1.5, 0.5, 0.5] -> / 1.5
    np.testing.assert_allclose(turn_weights([0, 1, 0, 0], 0.5, gamma=1.0), [1, 1, 1 / 3, 1 / 3], atol=1e-12)


def test_batch_turn_weights_keep_the_outcome_size_across_trajectories():
    # gamma 0.5. A: no critical turn, outcome 0.5 -> r = (0, 0.5), G = (0.25, 0.5).
    # B: turn 1 critical, outcome 0.8 -> r = (1, 0, 0.8), G = (1 + 0.5 * 0.4, 0.5 * 0.8, 0.8) = (1.2, 0.4, 0.8).
    GA = epo.epo_turn_returns([False, False], 0.5, gamma=0.5)
    GB = epo.epo_turn_returns([True, False, False], 0.8, gamma=0.5)
    np.testing.assert_allclose(GA, [0.25, 0.5], atol=1e-12)
    np.testing.assert_allclose(GB, [1.2, 0.4, 0.8], atol=1e-12)
    wa, wb = epo.batch_turn_weights([GA, GB])  # one scale, the batch max 1.2
    np.testing.assert_allclose(wa, [0.25 / 1.2, 0.5 / 1.2], atol=1e-12)
    np.testing.assert_allclose(wb, [1.0, 0.4 / 1.2, 0.8 / 1.2], atol=1e-12)
    # per trajectory (official) A would weigh (0.5, 1.0): the outcome's size is lost
    np.testing.assert_allclose(turn_weights([False, False], 0.5, gamma=0.5), [0.5, 1.0], atol=1e-12)
    assert [list(w) for w in epo.batch_turn_weights([np.zeros(2), np.zeros(0)])] == [[0.0, 0.0], []]


def test_kernel_regroups_turns_into_trajectories():
    # the worked example of epo_advantages, its turns given out of order: each trajectory gets
    # its own max |G| (per trajectory) or batch_turn_weights (one max over the batch); ones: uniform
    kw = dict(traj=[1, 0, 0, 2, 1, 0], turn=[1, 0, 2, 0, 0, 1], outcome=[0.4, 0.6, 0.6, 0.0, 0.4, 0.6],
              critical=[0, 1, 1, 0, 0, 0], gamma=0.5)
    np.testing.assert_allclose(epo.epo_advantages(**kw), [1.0, 1.0, 0.8, 0.0, 0.5, 0.4], atol=1e-12)
    np.testing.assert_allclose(epo.epo_advantages(**kw, return_norm="batch"), [0.32, 1.0, 0.8, 0.0, 0.16, 0.4],
                               atol=1e-12)
    assert epo.epo_advantages(**kw, weights="ones").tolist() == [1.0] * 6
    assert epo.epo_advantages([], [], [], []).shape == (0,)


def Ep(progress, outcome, traj_id):
    """A played trajectory as compute_advantages reads it (T = len(progress) - 1 turns)."""
    T = len(progress) - 1
    return epo.Episode(traj_id, traj_id, "t", "Alice", "self", prompts=[[1]] * T, completions=[[2]] * T,
                       strategies=["s"] * T, progress=list(progress), outcome=outcome)


def test_compute_advantages_return_norm():
    eps = [Ep([0.0] * 3, 0.5, 0), Ep([0.0] * 2, 0.25, 1)]
    samples, stats = epo.compute_advantages(eps, epo.Args(prm="none", gamma=1.0, return_norm="batch",
                                                          prm_min_final=0.0))
    assert eps[0].weights == [1.0, 1.0] and eps[1].weights == [0.5]
    assert [(x.traj, x.turn, x.adv) for x in samples] == [(0, 0, 1.0), (0, 1, 1.0), (1, 0, 0.5)]
    assert stats["credit/weight_mean"] == pytest.approx(2.5 / 3) and stats["credit/critical_frac"] == 0.0
    epo.compute_advantages(eps, epo.Args(prm="none", gamma=1.0, return_norm="trajectory", prm_min_final=0.0))
    assert eps[0].weights == [1.0, 1.0] and eps[1].weights == [1.0]
    with pytest.raises(ValueError, match="make_env"):  # options left at None are resolved by make_env
        epo.compute_advantages(eps, epo.Args(prm="none"))


def test_compute_advantages_outcome_gated_rule_prm_with_batch_scaling():
    # The tiny strategist's default: rule PRM (top 2 gains), no critical turn below a final progress of 0.5,
    # returns divided by the batch's max |G|. gamma 0.5.
    # A: progress (0, 0.2, 0.2, 0.6), outcome 0.6: gains (0.2, 0, 0.4) -> turns 0 and 2 critical; the last turn
    #    is critical, so the outcome is dropped: r = (1, 0, 1), G = (1 + 0.25, 0.5, 1) = (1.25, 0.5, 1).
    # B: progress (0, 0.3, 0.4), outcome 0.4 < 0.5: no critical turn: r = (0, 0.4), G = (0.2, 0.4).
    # batch max |G| = 1.25: A = (1, 0.4, 0.8), B = (0.16, 0.32).
    a, b = Ep([0.0, 0.2, 0.2, 0.6], 0.6, 0), Ep([0.0, 0.3, 0.4], 0.4, 1)
    epo.compute_advantages([a, b], epo.Args(prm="rule", gamma=0.5, return_norm="batch", prm_min_final=0.5))
    assert a.critical == [True, False, True] and b.critical == [False, False]
    np.testing.assert_allclose(a.weights, [1.0, 0.4, 0.8], atol=1e-12)
    np.testing.assert_allclose(b.weights, [0.16, 0.32], atol=1e-12)
    # without the gate, B's best gain (turn 0, 0.3) would be critical and earn 1, more than A's outcome
    epo.compute_advantages([a, b], epo.Args(prm="rule", gamma=0.5, return_norm="batch", prm_min_final=0.0))
    assert b.critical == [True, True]


# ---------------------------------------------------------------------------------------------
# epo_loss
# ---------------------------------------------------------------------------------------------
def test_loss_token_mean_then_turn_mean():
    # turn 0: tokens -1, -2 (third column is padding) -> mean -1.5; turn 1: -0.5, -1.5, -2.5 -> mean -1.5
    # A = [1.0, 0.5]: L = -(1/2) * (1.0 * -1.5 + 0.5 * -1.5) = 1.125
    lp = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -1.5, -2.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss = epo.epo_loss(lp, mask, torch.tensor([1.0, 0.5]))
    assert float(loss.detach()) == pytest.approx(1.125, abs=1e-7)
    loss.backward()
    # dL/dlp[t, i] = -(1/T) * A_t / k_t on real tokens: turn 0: -(1/2)(1)(1/2) = -0.25; turn 1: -(1/2)(0.5)(1/3) = -1/12
    np.testing.assert_allclose(lp.grad.numpy(), [[-0.25, -0.25, 0.0], [-1 / 12, -1 / 12, -1 / 12]], atol=1e-7)


def test_loss_zero_weights_give_zero_loss_and_gradient():
    lp = torch.tensor([[-1.0, -3.0], [-2.0, -4.0]], requires_grad=True)
    loss = epo.epo_loss(lp, torch.ones(2, 2), torch.zeros(2))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert float(lp.grad.abs().sum()) == 0.0


def test_loss_split_over_micro_batches_sums_to_the_whole():
    # update adds (|S| / T) * epo_loss(S) per micro-batch S of one trajectory's turns:
    # (1/2) * epo_loss(turn 0) + (1/2) * epo_loss(turn 1) = (1/2)(1.5) + (1/2)(0.75) = 1.125
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -2.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = torch.tensor([1.0, 0.5])
    parts = 0.5 * epo.epo_loss(lp[:1], mask[:1], w[:1]) + 0.5 * epo.epo_loss(lp[1:], mask[1:], w[1:])
    assert float(parts) == pytest.approx(1.125, abs=1e-7)


# ---------------------------------------------------------------------------------------------
# PRMs
# ---------------------------------------------------------------------------------------------
def test_rule_prm_top_k_progress_gains():
    # progress before turns 0..4 and at the end: gains = [0.1, 0, 0.4, -0.1, 0.2]
    p = [0.0, 0.1, 0.1, 0.5, 0.4, 0.6]
    assert epo.rule_critical_turns(p, k=2).tolist() == [False, False, True, False, True]
    assert epo.rule_critical_turns(p, k=3).tolist() == [True, False, True, False, True]
    # k = 4: the fourth largest gain is 0 -> not critical (gain must exceed min_gain)
    assert epo.rule_critical_turns(p, k=4).tolist() == [True, False, True, False, True]
    # tie between turns 0 and 1 (gain 0.2 each): the earlier wins
    assert epo.rule_critical_turns([0.0, 0.2, 0.4, 0.4], k=1).tolist() == [True, False, False]
    # no positive gain, or no turn
    assert not epo.rule_critical_turns([0.5, 0.5, 0.0], k=2).any()
    assert epo.rule_critical_turns([0.3], k=2).shape == (0,)
    # min_final: the same game (final progress 0.6) keeps its critical turns at 0.6 and loses all at 0.61
    assert epo.rule_critical_turns(p, k=2, min_final=0.6).tolist() == [False, False, True, False, True]
    assert not epo.rule_critical_turns(p, k=2, min_final=0.61).any()
    # a game without a deal ends at progress 0: nothing is critical once min_final > 0
    assert epo.rule_critical_turns([0.0, 0.4, 0.7, 0.0], k=2).tolist() == [True, True, False]
    assert not epo.rule_critical_turns([0.0, 0.4, 0.7, 0.0], k=2, min_final=0.1).any()


def test_prm_answer_valid_forms():
    pos = [1, 3, 5]  # the strategies are conversation entries 1, 3, 5
    assert epo.parse_prm_answer('{"indexes": [1, 5], "reasoning": "anchor and close"}', pos) == [True, False, True]
    text = 'Sure.\n```json\n{"indexes": [3], "reasoning": "the concession"}\n```'
    assert epo.parse_prm_answer(text, pos) == [False, True, False]
    # positions of human messages (2), out of range (9, -1) and non-integers are ignored; 5.0 counts
    assert epo.parse_prm_answer('{"indexes": [2, 9, -1, "3", 1.5, true, 5.0]}', pos) == [False, False, True]


@pytest.mark.parametrize("answer", [
    "", None, "no json here", "indexes: [1, 3]", '{"indexes": [1, 3', '{"indexes": "1, 3"}', "{indexes: [1]}",
    '{"reasoning": "nothing"}', '[1, 3]', '{"indexes": null}', "\x00{\x01}", "{" * 2000,
    '{"indexes": [1], "reasoning": "a {nested} brace"}',  # the official non-greedy match cuts it: bad JSON
    '{"indexes": [1' + "0" * 400 + ', 1e400]}',  # an integer too large for a float, an infinite float
])
def test_malformed_prm_answer_marks_no_critical_turn(answer):
    assert epo.parse_prm_answer(answer, [1, 3, 5]) == [False, False, False]


def test_prm_prompt_numbers_the_conversation():
    tr = epo.Episode(0, 0, "p00_s0.8_b1.2_T8", "Alice", "self", strategies=["Strategy: anchor high",
                        "Strategy: hold firm"], views=["Round 1 of 8.", "Round 2 of 8. Bob proposes $90."],
                        context="You are Alice.", score=6.5)
    text, positions = epo.prm_prompt(tr, "negotiation", True, "Bob")
    assert positions == [1, 3]
    start = text.index('{"conversations"')
    hist = json.loads(text[start:text.index("\n\nYour task")])
    assert [c["index"] for c in hist["conversations"]] == [0, 1, 2, 3]
    assert hist["conversations"][1] == {"from": "gpt", "value": "Strategy: anchor high", "index": 1}
    assert hist["conversations"][0]["value"].startswith("You are Alice.") and hist["score"] == 6.5
    assert "select top strategies Alice used" in text and "between Alice and Bob" in text


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
SMALL = ["--num-iterations", "2", "--episodes-per-iteration", "6", "--eval-num-tasks", "2", "--eval-every", "2",
         "--torch-threads", "1", "--lora-r", "8", "--lora-alpha", "8", "--learning-rate", "1e-3",
         "--num-epochs", "2", "--trajectories-per-step", "4"]


# every end-to-end run of this module, by name: conftest's `runs` starts them together when the first test
# needs one (E2E_SCRIPT with each flag list)
E2E_SCRIPT = "epo.py"
E2E = {
    "rule_agent_rule_prm": [*SMALL, "--agent", "rule", "--prm", "rule"],
    # one iteration; the micro model writes gibberish as agent and as PRM
    "base_agent_llm_prm": [SMALL[0], "1", *SMALL[2:], "--agent", "base", "--prm", "llm", "--eval-num-tasks", "1",
                           "--learning-rate", "3e-3"],
    "webshop_thought": ["--env-id", "webshop", "--agent", "base", "--prm", "rule", "--num-iterations", "1",
                        "--episodes-per-iteration", "2", "--eval-num-tasks", "1", "--torch-threads", "1",
                        "--lora-r", "8", "--lora-alpha", "8", "--max-new-tokens", "8", "--agent-max-new-tokens", "8"],
    "self_chat": ["--train-opponent", "self", "--return-norm", "trajectory", "--prm-min-final", "0",
                  "--num-iterations", "1", "--episodes-per-iteration", "4", "--eval-num-tasks", "1",
                  "--torch-threads", "1", "--lora-r", "8", "--lora-alpha", "8", "--no-eval-selfplay"],
}


def test_end_to_end_rule_agent_rule_prm(runs):
    run_dir = runs["rule_agent_rule_prm"].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "charts/goal_score" in r]
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["losses/policy_loss"]) and 0 <= r["credit/critical_frac"] <= 1
        assert r["perf/samples"] > 0 and 0 <= r["charts/goal_score"] <= 10
    ev = summary["last_eval"]
    for key in ("eval/success", "eval/success_greedy", "eval/goal_score_greedy", "eval/deal_rate",
                "eval/selfplay_goal_score"):
        assert key in ev
    assert [r["iteration"] for r in rows if "eval/goal_score" in r] == [0, 2]  # before training, at the end
    # the per-game scores: each test task once per scripted style and role (2 tasks x 4 styles x 2 roles), and
    # their mean is the evaluation's
    scores = ev["eval/goal_score_episodes"]
    assert len(scores) == 2 * 4 * 2 and all(0 <= s <= 10 for s in scores)
    assert np.mean(scores) == pytest.approx(ev["eval/goal_score"])
    recs = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if r["tag"] == "train"]
    assert train_recs and all(t["weight"] is not None for r in train_recs for t in r["turns"])


def test_end_to_end_base_agent_llm_prm(runs):
    # the micro model writes gibberish as agent and as PRM: the pipeline must still run and log
    run_dir = runs["base_agent_llm_prm"].result()
    assert_run_outputs(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "charts/goal_score" in r]
    assert len(train) == 1 and 0 <= train[0]["credit/prm_parse_fail_frac"] <= 1
    assert 0 <= train[0]["charts/invalid_rate"] <= 1
    recs = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any("prm_answer" in r for r in recs if r["tag"] == "train")


def test_end_to_end_single_agent_thought_strategist(runs):
    # WebShop-lite through the "Thought:" strategist and the base agent (micro model: gibberish, must run)
    run_dir = runs["webshop_thought"].result()
    summary = assert_run_outputs(run_dir)
    ev = summary["last_eval"]
    assert 0 <= ev["eval/success"] <= 1 and 0 <= ev["eval/goal_score"] <= 1  # single agent: the outcome in [0, 1]
    assert not any(k.startswith(("eval/vs_", "eval/selfplay")) for k in ev)  # no scripted styles, no self-chat
    recs = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any(r["tag"] == "train" and r["player"] == "agent" for r in recs)
    assert all(len(r["turns"]) >= 1 for r in recs)


@pytest.mark.parametrize("flags, words", [
    (["--env-id", "sokoban", "--agent", "rule"], ["--agent rule", "--agent base"]),
    (["--train-opponent", "rule:nobody"], ["--train-opponent", "tough"]),
    (["--env-id", "no_such_env"], ["no_such_env", "negotiation"]),
    (["--prm-min-final", "1.5"], ["--prm-min-final", "[0, 1]"]),
])
def test_user_errors_are_one_clear_line(tiny_cache, flags, words):
    proc = subprocess.run([sys.executable, str(REPO / "epo.py"), "--tiny-preset", "micro", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error:") and all(w in proc.stderr for w in words), proc.stderr


def test_instruct_strategist_sees_its_own_earlier_strategies():
    import envs

    game = envs.Seated(envs.make("negotiation")).reset(envs.make("negotiation").task_ids("test")[0])
    p = game.current_player
    assert "earlier strategies" not in epo.strategist_messages(game, p, [], real=True)[-1]["content"]
    last = epo.strategist_messages(game, p, ["Open low", "Concede a little"], real=True)[-1]["content"]
    assert last.endswith("Your earlier strategies in this game: 1. Open low; 2. Concede a little")
    tiny = epo.strategist_messages(game, p, ["Open low"], real=False)
    assert "earlier strategies" not in tiny[-1]["content"] and tiny == game.observe(p)  # its trained format


def test_make_env_gives_reset_seated_games():
    import envs

    args, new_env, probe, kw = epo.make_env(epo.Args(tiny_preset="micro"))
    assert kw["moves"] == "strategy" and kw["history"] is None and epo.strategist_policy(args).is_tiny
    # the tiny strategist's recipe overrides (common/tiny.py); none in an env whose moves are not strategies
    from common.tiny import strategist_overrides

    assert strategist_overrides("negotiation") == {"env_kwargs": {"moves": "strategy", "history": None},
                                                   "demo_mix": {"share": 0.3, "env_kwargs": {"expert": "style"}}}
    assert strategist_overrides("sokoban") is None
    # the tiny strategist's measured defaults were filled in (docs/epo.md)
    assert (args.train_opponent, args.return_norm, args.prm_min_final) == ("rule:any", "batch", 0.5)
    task = probe.task_ids("test")[0]
    p0, p1 = probe.players
    game = new_env(task, {p0: "policy", p1: probe.opponent_styles()[0]})
    assert isinstance(game, envs.Seated) and game.task_id == task and game.current_player == p0


def test_eval_opponents_are_checked_against_the_games_styles():
    import epo
    from common.models import UserError

    with pytest.raises(UserError, match=r"--eval-opponents: unknown style\(s\) \['nope'\]; known: tough, fair"):
        epo.make_env(epo.Args(eval_opponents=("nope",)))
    epo.make_env(epo.Args(eval_opponents=("fair",)))  # a style of the game: accepted


REAL = "Qwen/Qwen2.5-1.5B-Instruct"  # any model without its own DEFAULTS row (nothing is loaded)


def test_defaults_resolve_by_model_and_keep_explicit_flags():
    def resolved(model, two_player, **flags):
        env = dict(env_id="negotiation") if two_player else dict(env_id="webshop", agent="base")
        args = epo.make_env(epo.Args(model_name=model, tiny_preset="micro", **env, **flags))[0]
        return args.train_opponent, args.return_norm, args.prm_min_final

    assert resolved("tiny", True) == ("rule:any", "batch", 0.5)  # the tiny strategist: scripted styles
    assert resolved(REAL, True) == ("self", "trajectory", 0.0)  # a real model: the paper's self-chat
    assert resolved("tiny", False) == ("self", "trajectory", 0.0)  # a single-agent env has no styles
    assert resolved("tiny", True, train_opponent="self", prm_min_final=0.0) == ("self", "batch", 0.0)
    assert resolved(REAL, True, return_norm="batch") == ("self", "batch", 0.0)


def test_token_budgets_and_learning_rate_resolve_by_model():
    def budgets(**flags):
        a = epo.make_env(epo.Args(**flags))[0]
        return a.learning_rate, a.max_new_tokens, a.agent_max_new_tokens, a.prm_max_new_tokens

    assert budgets() == (5e-4, 24, 16, 32)  # the tiny strategist's recipe gives the 24
    assert budgets(model_name=REAL) == (2e-5, 48, 128, 256)
    assert budgets(model_name=REAL, learning_rate=1e-3, prm_max_new_tokens=8) == (1e-3, 48, 128, 8)


@pytest.mark.parametrize("score_temperature", [None, 0.7])
def test_update_trains_the_log_probs_at_the_official_temperature(tiny_cache, score_temperature):
    # the official loss scores `logits.log_softmax(-1)` (T = 1), whatever the sampling temperature
    # (0.7): update's loss before its one optimizer step is epo_loss of those log-probs
    from common.models import load_policy
    from common.tiny import strategist_overrides

    model, tok = load_policy("tiny", env_id="negotiation", tiny_preset="micro", load_in_4bit=False,
                             tiny_overrides=strategist_overrides("negotiation"))
    prompts = [epo.encode(tok, t) for t in ("Round 1 of 8.", "Round 2 of 8. Bob proposes $90.")]
    comps = [epo.encode(tok, t) + [tok.eos_token_id] for t in ("Strategy: anchor high", "hold")]
    w = [1.0, 0.5]
    samples = [epo.Sample(p, c, 0, 0, t, a) for t, (p, c, a) in enumerate(zip(prompts, comps, w))]
    flags = {} if score_temperature is None else {"score_temperature": score_temperature}
    args = epo.Args(num_epochs=1, micro_batch_size=8, learning_rate=1e-3, **flags)
    T = args.score_temperature
    assert args.temperature == 0.7 and T == (score_temperature or 1.0)
    with torch.no_grad():
        lp, mask = epo.completion_logprobs(model, tok, prompts, comps, temperature=T)
        want = float(epo.epo_loss(lp, mask, torch.tensor(w)))
        other = epo.completion_logprobs(model, tok, prompts, comps, temperature=1.7 - T)
        assert abs(float(epo.epo_loss(*other, torch.tensor(w))) - want) > 1e-3  # T tells them apart
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    stats = epo.update(model, tok, optimizer, samples, args, np.random.default_rng(0))
    assert stats["optimizer_steps"] == 1 and stats["policy_loss"] == pytest.approx(want, rel=1e-5)


def test_end_to_end_self_chat_by_flag(runs):
    # self-play stays available: both roles are the strategist, each game gives two trajectories
    run_dir = runs["self_chat"].result()
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["train_opponent"], config["return_norm"], config["prm_min_final"]) == ("self", "trajectory", 0.0)
    recs = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["tag"] == "train"]
    assert train and all(r["opponent"] == "self" for r in train)
    assert {r["player"] for r in train} == {"Alice", "Bob"}
