"""ΔBelief-RL: credit functions against hand-computed numbers, belief elicitation against a hand-made
forward pass on the micro tiny model, and the script end to end."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from tests.conftest import REPO, assert_adapter_trained, assert_run_outputs, read_metrics

import delta_belief as db

S2 = 1 / math.sqrt(2)


# ---------------------------------------------------------------------------------------------
# turn_rewards
# ---------------------------------------------------------------------------------------------
def test_turn_rewards_won_game_with_repeat_and_negative_change():
    # T = 3, won on turn 3. beliefs b0..b3 = -5, -4, -4.5, (nan: not measured after the winning turn)
    # delta_1 = -4 - (-5) = 1.0  -> 0.1 * 1.0 = 0.1
    # delta_2 = -4.5 - (-4) = -0.5 -> clipped to 0
    # delta_3 = winning turn -> 0
    # eog = 2.0 * 1 - 0.05 * 3 = 1.85 on every turn; turn 2 repeated: -1.0
    # r = [1.85 + 0.1, 1.85 - 1.0, 1.85] = [1.95, 0.85, 1.85]
    r = db.turn_rewards([-5.0, -4.0, -4.5, float("nan")], True, [False, False, False], [False, True, False])
    np.testing.assert_allclose(r, [1.95, 0.85, 1.85], atol=1e-12)


def test_turn_rewards_lost_game_invalid_repeated_and_lam():
    # T = 4, lost, lam = 0.5. beliefs -6, -3, -3.5, -1.5, -2
    # deltas = 3.0, -0.5, 2.0, -0.5 -> 0.5 * relu = 1.5, 0, 1.0, 0
    # eog = 0 - 0.05 * 4 = -0.2; turn 2 invalid (-5.0); turn 4 invalid AND repeated (-5.0 - 1.0)
    # r = [-0.2 + 1.5, -0.2 - 5.0, -0.2 + 1.0, -0.2 - 6.0] = [1.3, -5.2, 0.8, -6.2]
    r = db.turn_rewards([-6.0, -3.0, -3.5, -1.5, -2.0], False, [False, True, False, True],
                        [False, False, False, True], lam=0.5)
    np.testing.assert_allclose(r, [1.3, -5.2, 0.8, -6.2], atol=1e-12)


def test_turn_rewards_winning_turn_gets_no_belief_gain():
    # beliefs -3, -1, 0 (the last change +1 would count if the game were not won)
    # won:  eog = 2 - 0.05 * 2 = 1.9; delta_1 = 2 -> 0.2, delta_2 ignored -> [2.1, 1.9]
    # lost: eog = -0.1; delta_1 -> 0.2, delta_2 = 1 -> 0.1 -> [0.1, 0.0]
    np.testing.assert_allclose(db.turn_rewards([-3.0, -1.0, 0.0], True, [0, 0], [0, 0]), [2.1, 1.9], atol=1e-12)
    np.testing.assert_allclose(db.turn_rewards([-3.0, -1.0, 0.0], False, [0, 0], [0, 0]), [0.1, 0.0], atol=1e-12)
    # lam = 0 removes only the belief term: lost -> [-0.1, -0.1]
    np.testing.assert_allclose(db.turn_rewards([-3.0, -1.0, 0.0], False, [0, 0], [0, 0], lam=0.0), [-0.1, -0.1])


def test_turn_rewards_custom_scales_and_shape_check():
    # win_reward 1, turn_penalty 0.1, invalid 2, repeat 0.5, lam 1; T = 2 won; beliefs -2, -2.25, nan
    # eog = 1 - 0.2 = 0.8; delta_1 = -0.25 -> 0; turn 1 invalid -> 0.8 - 2 = -1.2; turn 2 -> 0.8
    r = db.turn_rewards([-2.0, -2.25, float("nan")], True, [True, False], [False, False], lam=1.0, win_reward=1.0,
                        turn_penalty=0.1, invalid_penalty=2.0, repeat_penalty=0.5)
    np.testing.assert_allclose(r, [-1.2, 0.8], atol=1e-12)
    with pytest.raises(ValueError):
        db.turn_rewards([0.0, 1.0], False, [False, False], [False, False])  # needs T + 1 = 3 beliefs


# ---------------------------------------------------------------------------------------------
# turnwise_advantages
# ---------------------------------------------------------------------------------------------
def test_turnwise_advantages_ragged_lengths():
    # G = 3, lengths 3, 1, 2 (the 99s are past the end and must be ignored)
    # t = 0: all active, r = 1, 3, 2 -> mean 2, unbiased std sqrt((1 + 1 + 0) / 2) = 1 -> -1, 1, 0
    # t = 1: games 0 and 2 active, r = 2, 0 -> mean 1, std sqrt((1 + 1) / 1) = sqrt(2) -> 1/sqrt2, -1/sqrt2
    #        (the official code would also count game 1 as a 0 here: mean 2/3, a different answer)
    # t = 2: only game 0 active -> 0
    rewards = [[1.0, 2.0, 5.0], [3.0, 99.0, 99.0], [2.0, 0.0, 99.0]]
    adv = db.turnwise_advantages(rewards, [3, 1, 2], eps=0.0)
    np.testing.assert_allclose(adv, [[-1.0, S2, 0.0], [1.0, 0.0, 0.0], [0.0, -S2, 0.0]], atol=1e-12)
    # default eps = 1e-6: t = 0 gives -1 / (1 + 1e-6)
    adv = db.turnwise_advantages(rewards, [3, 1, 2])
    assert adv[0, 0] == pytest.approx(-1.0 / (1.0 + 1e-6), abs=1e-12)


def test_turnwise_advantages_constant_column_and_single_game():
    # constant column -> (r - mean) = 0 -> 0; one game in the group -> 0 everywhere
    adv = db.turnwise_advantages([[1.5, 2.0], [1.5, 4.0]], [2, 2])
    # t = 1: 2, 4 -> mean 3, std sqrt(2) -> -1/sqrt2, 1/sqrt2 (eps 1e-6 -> within 1e-6)
    np.testing.assert_allclose(adv, [[0.0, -S2], [0.0, S2]], atol=1e-6)
    np.testing.assert_array_equal(db.turnwise_advantages([[3.0, -1.0]], [2]), [[0.0, 0.0]])


def test_turnwise_advantages_permutation_equivariant():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(5, 4))
    lengths = np.array([4, 2, 3, 1, 4])
    perm = rng.permutation(5)
    np.testing.assert_allclose(db.turnwise_advantages(r[perm], lengths[perm]), db.turnwise_advantages(r, lengths)[perm])


# ---------------------------------------------------------------------------------------------
# StarPO baseline
# ---------------------------------------------------------------------------------------------
def test_starpo_rewards_and_trajectory_advantages():
    # T = 3, won, turn 1 repeated, turn 2 invalid -> [-1, -5, eog] with eog = 2 - 0.15 = 1.85
    np.testing.assert_allclose(db.starpo_turn_rewards(True, [0, 1, 0], [1, 0, 0]), [-1.0, -5.0, 1.85], atol=1e-12)
    # returns 1, 2, 3, 6: mean 3, deviations -2, -1, 0, 3, SS = 14, unbiased var 14/3, std 2.1602469
    std = math.sqrt(14 / 3)
    np.testing.assert_allclose(db.trajectory_advantages([1, 2, 3, 6], eps=0.0), [-2 / std, -1 / std, 0, 3 / std])
    np.testing.assert_array_equal(db.trajectory_advantages([4.0]), [0.0])


# ---------------------------------------------------------------------------------------------
# the kernel and compute_advantages
# ---------------------------------------------------------------------------------------------
def test_compute_advantages_gives_the_kernels_numbers_per_turn():
    import torch

    # the kernel's worked example as episodes: τ0 wins on turn 1; τ1, τ2 lose after two questions
    # turn 0: r = 1.95, 0.1, -0.1 -> 1.150, -0.487, -0.664; turn 1: r = -0.1, 0 -> -/+ 1/sqrt 2
    beliefs = [[-3.0, float("nan")], [-3.0, -1.0, -1.0], [-3.0, -3.0, -2.0]]
    episodes = []
    for m, b in enumerate(beliefs):
        ep = db.Episode(traj_id=m, group_id=0, task_id="t", target="cat", beliefs=b, success=m == 0)
        T = len(b) - 1
        ep.prompts, ep.completions, ep.actions = [[1]] * T, [[2]] * T, ["q"] * T
        ep.logprobs = [torch.tensor([-0.5])] * T  # as sampled: kept as π_θold's
        ep.invalid, ep.repeated = [False] * T, [False] * T
        episodes.append(ep)
    args = db.Args(adv_eps=0.0)
    samples, stats = db.compute_advantages(episodes, args)
    assert [(x.traj, x.turn) for x in samples] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    np.testing.assert_allclose([x.adv for x in samples], [1.150, -0.487, -S2, -0.664, S2], atol=1e-3)
    assert all(torch.equal(x.old, torch.tensor([-0.5])) for x in samples)  # the sampler's, kept
    assert stats["charts/turn_reward_mean"] == pytest.approx((1.95 + 0.1 - 0.1 - 0.1 + 0.0) / 5)
    # ΔBelief of the turns that have a b after them: 2, 0, 0, 1 -> mean 0.75
    assert stats["credit/delta_belief_mean"] == pytest.approx(0.75)
    # an explicit signal replaces the episodes' beliefs: τ1's first question now gains nothing
    signal = [[-3.0, float("nan")], [-3.0, -3.0], [-3.0, -3.0], [-3.0, -3.0], [-3.0, -2.0]]
    other, _ = db.compute_advantages(episodes, args, signal=signal)
    assert other[1].adv == pytest.approx(other[3].adv)  # τ1 and τ2 tie on turn 0
    # StarPO: the trajectory advantage (returns 1.95, -0.1, -0.1) on every turn
    samples, stats = db.compute_advantages(episodes, db.Args(adv_eps=0.0, reward_mode="starpo"))
    np.testing.assert_allclose([x.adv for x in samples], [2 / math.sqrt(3)] + [-1 / math.sqrt(3)] * 4)
    assert "credit/delta_belief_mean" not in stats


# ---------------------------------------------------------------------------------------------
# target location inside the elicitation message
# ---------------------------------------------------------------------------------------------
class PieceTok:
    """A tokenizer that cuts text into fixed pieces, so BPE-like merges across the quote can be tested."""

    def __init__(self, pieces):
        self.pieces = pieces

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        assert "".join(self.pieces) == text
        ids, offs, pos = [], [], 0
        for p in self.pieces:
            ids.append(len(ids) + 10)
            offs.append((pos, pos + len(p)))
            pos += len(p)
        return {"input_ids": ids, "offset_mapping": offs}


def test_locate_target_clean_and_merged_boundaries():
    msg = "Is it 'catfish'?"
    # clean split: target = tokens 3, 4 ("cat", "fish"); ids cut after the last target token
    ids, mask = db.locate_target(PieceTok(["Is", " it", " '", "cat", "fish", "'?"]), msg, "catfish")
    assert mask == [0, 0, 0, 1, 1] and ids == [10, 11, 12, 13, 14]
    # BPE merged the quote into the first piece and the last piece with the closing quote
    ids, mask = db.locate_target(PieceTok(["Is", " it", " 'cat", "fish'", "?"]), msg, "catfish")
    assert mask == [0, 0, 1, 1] and ids == [10, 11, 12, 13]
    with pytest.raises(ValueError):
        db.locate_target(PieceTok(["Is it 'dog'?"]), "Is it 'dog'?", "cat")


# ---------------------------------------------------------------------------------------------
# belief on the micro tiny model vs a hand-made forward pass
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def micro_policy(tiny_cache):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from common.models import load_policy

    model, tok = load_policy("tiny", env_id="twenty_questions", tiny_preset="micro", lora_r=8, lora_alpha=8)
    model.eval()
    return model, tok


def test_belief_equals_hand_computed_target_logprob(micro_policy):
    import torch

    import envs

    model, tok = micro_policy
    env = envs.make("twenty_questions")
    tasks = env.task_ids("test")[:3]
    msgs, targets = [], []
    for i, task in enumerate(tasks):  # three chats of different lengths (exercises the left padding)
        env.reset(task)
        for _ in range(i):
            env.step(env.expert_action())
        msgs.append(env.messages())
        targets.append(env.target)
    got = db.elicit_beliefs(model, tok, msgs, targets, "Is it '{target}'?", micro_batch_size=2)

    for m, target, b in zip(msgs, targets, got):
        prompt = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        # by hand: prompt tokens, then "Is it '", then the target's own tokens, then "'?"
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        pre = tok("Is it '", add_special_tokens=False)["input_ids"]
        tgt = tok(target, add_special_tokens=False)["input_ids"]
        post = tok("'?", add_special_tokens=False)["input_ids"]
        # the tiny tokenizer isolates the quote, so the message splits exactly at the quotes
        assert tok("Is it '" + target + "'?", add_special_tokens=False)["input_ids"] == pre + tgt + post
        full = torch.tensor([p_ids + pre + tgt + post])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=full).logits[0].double(), dim=-1)
        first = len(p_ids) + len(pre)  # position of the target's first token
        want = sum(float(logp[pos - 1, full[0, pos]]) for pos in range(first, first + len(tgt)))
        assert b == pytest.approx(want, abs=1e-4), (target, b, want)
        assert b < 0


def test_token_logprobs_sorted_micro_batches_keep_each_samples_own_logprobs(micro_policy):
    """token_logprobs scores in length-sorted micro-batches; each sample's vector must come back in
    its own place and equal the sample scored alone, unpadded (a full forward, by hand)."""
    import torch

    model, tok = micro_policy
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 2), (3, 1), (14, 3), (5, 2), (11, 1), (4, 3), (8, 2)]  # unsorted on purpose
    samples = [db.Sample(torch.randint(5, 60, (p,), generator=g).tolist(),
                         torch.randint(5, 60, (c,), generator=g).tolist(), 0, i, 0)
               for i, (p, c) in enumerate(lengths)]
    got = db.token_logprobs(model, tok, samples, micro_batch_size=3)
    for x, lp in zip(samples, got):
        full = torch.tensor([x.prompt + x.completion])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=full).logits[0].double(), dim=-1)
        want = [float(logp[len(x.prompt) + k - 1, c]) for k, c in enumerate(x.completion)]
        assert lp.tolist() == pytest.approx(want, abs=1e-4), (len(x.prompt), len(x.completion))


def test_reading_beliefs_plays_the_same_games(micro_policy):
    """Reading a belief samples nothing: the games played with beliefs and without (as the evaluation plays
    them) are the same, and so is every success."""
    import torch

    import envs

    model, tok = micro_policy
    args = db.Args(max_new_tokens=10, micro_batch_size=4)
    tasks = [t for t in envs.make("twenty_questions").task_ids("test")[:3] for _ in range(2)]
    new_env = lambda: envs.make("twenty_questions")  # noqa: E731
    played = {}
    for with_beliefs in (True, False):
        torch.manual_seed(0)
        played[with_beliefs] = db.rollout(model, tok, new_env, tasks, [0, 0, 1, 1, 2, 2], args, 1.5,
                                          "Is it '{target}'?", max_turns=3, with_beliefs=with_beliefs)
    read, unread = played[True], played[False]
    assert [ep.completions for ep in read] == [ep.completions for ep in unread]
    assert [ep.success for ep in read] == [ep.success for ep in unread]
    for a, b in zip(read, unread):
        assert len(a.beliefs) == a.length + 1 and b.beliefs == []  # b_0 .. b_T, or none
        assert all(math.isfinite(x) for x in a.beliefs[:-1]) and (a.success != math.isfinite(a.beliefs[-1]))


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
SMALL = ["--num-iterations", "2", "--tasks-per-iteration", "2", "--group-size", "4", "--max-turns", "3",
         "--eval-num-tasks", "2", "--eval-k", "2", "--eval-every", "2", "--max-new-tokens", "10",
         "--torch-threads", "1", "--lora-r", "8", "--lora-alpha", "8", "--learning-rate", "1e-3"]


# every end-to-end run of this module, by name: conftest's `runs` starts them together when the first test
# needs one (E2E_SCRIPT with each flag list):
# ΔBelief for two iterations, StarPO for one, and an evaluation only (0 iterations) with an OOD env
E2E_SCRIPT = "delta_belief.py"
E2E = {"delta": [*SMALL, "--eval-best-of-n", "2"],
       # the shipped tiny policy at its own 16 tokens (the micro one's questions seldom end within
       # 10): finished questions, returns that differ, so StarPO has a signal and trains
       "starpo": [SMALL[0], "1", *SMALL[2:SMALL.index("--max-new-tokens")],
                  *SMALL[SMALL.index("--max-new-tokens") + 2:], "--reward-mode", "starpo",
                  "--tiny-preset", "default"],
       "ood": [SMALL[0], "0", *SMALL[2:], "--eval-env-id", "guess_my_city"]}


def test_end_to_end_delta(runs):
    run_dir = runs["delta"].result()
    summary = assert_run_outputs(run_dir)
    assert_adapter_trained(run_dir)
    rows = read_metrics(run_dir)
    train = [r for r in rows if "charts/success" in r]
    assert len(train) == 2
    for r in train:
        assert math.isfinite(r["credit/delta_belief_mean"]) and math.isfinite(r["losses/policy_loss"])
    ev = summary["last_eval"]
    for key in ("eval/success", "eval/success_greedy", "eval/bon2_success"):
        assert 0.0 <= ev[key] <= 1 and 0.0 <= ev[key + "_se"] <= 1, key
    assert len(ev["eval/success_episodes"]) == 2 * 2  # 2 test secrets x --eval-k 2
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    first = [r for r in records if r["iteration"] == 0]
    assert [r["tag"] for r in first] == ["eval/sampled"] * 4 + ["eval/best_of_2"] * 2
    assert first[0]["task_id"] != first[1]["task_id"]  # one game of every secret first
    best = first[-1]  # best-of-n reads a belief before the first question and after every other one
    assert len(best["beliefs"]) == len(best["actions"]) + 1 and best["beliefs"][0] < 0


def test_end_to_end_starpo(runs):
    run_dir = runs["starpo"].result()
    assert_run_outputs(run_dir)
    row = [r for r in read_metrics(run_dir) if "credit/adv_nonzero_frac" in r][0]
    assert math.isfinite(row["losses/policy_loss"]) and row["charts/invalid_rate"] < 1.0
    assert row["credit/adv_nonzero_frac"] > 0 and row["losses/grad_norm"] > 0  # a signal, a step
    assert_adapter_trained(run_dir)


def test_end_to_end_out_of_distribution_eval(runs):
    run_dir = runs["ood"].result()
    ev = json.loads((run_dir / "summary.json").read_text())["last_eval"]
    assert 0.0 <= ev["eval/ood_success"] <= 1.0 and 0.0 <= ev["eval/success"] <= 1.0


def test_unknown_eval_env_is_one_clear_line(tiny_cache):
    proc = subprocess.run([sys.executable, str(REPO / "delta_belief.py"), "--eval-env-id", "no_such_env"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "no_such_env" in proc.stderr and "Traceback" not in proc.stderr


def test_minibatches_keep_whole_games_for_starpo():
    # games 7 (3 turns), 8 (1 turn), 9 (2 turns), 10 (2 turns) -> 8 samples, 2 minibatches
    trajs = [7, 7, 8, 9, 7, 9, 10, 10]
    rng = np.random.default_rng(0)
    for _ in range(20):
        parts = db.minibatches(trajs, 2, rng, whole_games=True)
        assert len(parts) == 2 and sorted(i for p in parts for i in p) == list(range(8))
        for p in parts:
            for i in p:  # every turn of a game is in the same minibatch
                assert all(j in p for j in range(8) if trajs[j] == trajs[i])
            assert len({trajs[i] for i in p}) == 2  # 4 games split 2 / 2
    split = [db.minibatches(trajs, 2, np.random.default_rng(s), whole_games=False) for s in range(20)]
    assert all(sorted(i for p in parts for i in p) == list(range(8)) for parts in split)
    assert any({trajs[i] for i in parts[0]} & {trajs[i] for i in parts[1]} for parts in split)  # turns shuffled


def test_make_env_returns_the_args_the_factory_a_probe_and_the_env_options():
    from common.models import UserError, policy_kind

    args = db.Args(history=2, max_turns=3, eval_env_id="guess_my_city", eval_num_tasks=2)
    args, new_env, probe, kw = db.make_env(args)
    env = new_env()
    assert env is not probe and env.max_turns == 3 and probe.target and kw["history"] == 2
    assert policy_kind(args.model_name) == "tiny" and args.learning_rate == 5e-4  # the tiny row
    assert args.eval_temperature == args.temperature and args.num_minibatches == 2
    new_ood_env, ood_tasks, _ = db.make_ood_env(args, kw)
    assert new_ood_env().max_turns == 3 and len(ood_tasks) == 2  # --eval-max-turns 0: --max-turns
    assert new_ood_env().show_candidates == kw["show_candidates"] == 5  # the tiny recipe's list
    with pytest.raises(UserError, match="--eval-env-id 'sokoban' has no hidden target"):
        db.make_ood_env(dataclasses.replace(args, eval_env_id="sokoban", eval_max_turns=3), {})
    with pytest.raises(UserError, match="--eval-env-id 'sokoban': .*'numbered'"):  # not a crash
        db.make_ood_env(dataclasses.replace(args, eval_env_id="sokoban"), kw)


# ---------------------------------------------------------------------------------------------
# policy_loss and update, by hand
# ---------------------------------------------------------------------------------------------
def test_policy_loss_by_hand():
    import torch

    # ratios 1.5, 0.5, 1.1 (old log-probs 0), A = 1, -1, -1, weights 0.5, 0.25, 0.25, clip 0.2 / 0.28
    # token 1: -min(1.5, 1.28) = -1.28 (clipped); token 2: A < 0, -A * max(0.5, 0.8) = 0.8 (clipped);
    # token 3: 1.1 inside the range -> 1.1. loss = 0.5 * -1.28 + 0.25 * 0.8 + 0.25 * 1.1 = -0.165
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old, adv, w = torch.zeros(1, 3), torch.tensor([[1.0, -1.0, -1.0]]), torch.tensor([[0.5, 0.25, 0.25]])
    loss, clipped = db.policy_loss(logp, old, adv, w, 0.2, 0.28, 3.0)
    assert float(loss) == pytest.approx(-0.165, abs=1e-6) and clipped.tolist() == [[1.0, 1.0, 0.0]]
    # ε_high 0.5: token 1 gives -1.5 -> 0.5 * -1.5 + 0.475 = -0.275
    assert float(db.policy_loss(logp, old, adv, w, 0.2, 0.5, 3.0)[0]) == pytest.approx(-0.275, abs=1e-6)
    # ratio 5 with A = -1: -A * 5 = 5, the dual clip caps it at -c A = 3; dual_clip 0: 5
    big = torch.log(torch.tensor([[5.0]]))
    one = torch.ones(1, 1)
    assert float(db.policy_loss(big, one * 0, -one, one, 0.2, 0.28, 3.0)[0]) == pytest.approx(3.0)
    assert float(db.policy_loss(big, one * 0, -one, one, 0.2, 0.28, 0.0)[0]) == pytest.approx(5.0)


def _update_batch(random_llama_dir):
    import torch

    from tests.test_shared_blocks import _policy_with_a_trained_looking_adapter

    model, tok = _policy_with_a_trained_looking_adapter(random_llama_dir)
    g = torch.Generator().manual_seed(3)
    lengths = [(9, 2), (3, 1), (14, 3), (5, 2), (11, 4), (4, 3), (8, 2)]  # unsorted on purpose
    trajs, advs = [0, 0, 1, 2, 2, 2, 3], [1.0, -0.5, 2.0, 0.0, -1.0, 0.7, -2.0]
    samples = [db.Sample(torch.randint(5, 250, (p,), generator=g).tolist(),
                         torch.randint(5, 250, (c,), generator=g).tolist(), group=0, traj=t,
                         turn=i - trajs.index(t), adv=a)
               for i, ((p, c), t, a) in enumerate(zip(lengths, trajs, advs))]
    return model, tok, samples


def _grad_of_update(model, tok, samples, **kw):
    import torch

    args = db.Args(num_minibatches=1, temperature=1.0, max_grad_norm=1e9, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    for x in samples:
        x.old = None  # update takes π_θold's log-probs itself: every ratio starts at 1
    stats = db.update(model, tok, torch.optim.SGD(params, lr=0.0), samples, args, np.random.default_rng(0))
    return torch.cat([p.grad.flatten() for p in params]), stats


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batched_update_gradient_equals_the_hand_made_one(random_llama_dir, agg):
    """At ratio 1 the loss's gradient is -Σ_tokens w A ∇log p: w = 1 / (all tokens) for token-mean,
    1 / (games x the game's tokens) for seq-mean-token-mean. By hand: each sample alone, unpadded, its
    completion's log-probs summed; the update's length-sorted micro-batches of 3 must give the same."""
    import torch

    model, tok, samples = _update_batch(random_llama_dir)
    got, stats = _grad_of_update(model, tok, samples, micro_batch_size=3, loss_agg=agg)
    params = [p for p in model.parameters() if p.requires_grad]
    ntok = sum(len(x.completion) for x in samples)
    game_tokens = Counter()
    for x in samples:
        game_tokens[x.traj] += len(x.completion)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = 0.0
    for x in samples:
        full = torch.tensor([x.prompt + x.completion])
        logp = torch.log_softmax(model(input_ids=full).logits[0].float(), dim=-1)
        lp = sum(logp[len(x.prompt) + k - 1, c] for k, c in enumerate(x.completion))
        w = 1 / ntok if agg == "token-mean" else 1 / (len(game_tokens) * game_tokens[x.traj])
        loss = loss - w * x.adv * lp
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in params])
    assert want.abs().max() > 0 and torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # at ratio 1 the loss is -Σ w A: token-mean (2 - 0.5 + 6 + 0 - 4 + 2.1 - 4) / 17;
    # seq-mean-token-mean -(1/4)((2 - 0.5) / 3 + 6 / 3 + (0 - 4 + 2.1) / 9 + -4 / 2)
    want_loss = (-(2 - 0.5 + 6 + 0 - 4 + 2.1 - 4) / 17 if agg == "token-mean"
                 else -((2 - 0.5) / 3 + 6 / 3 + (0 - 4 + 2.1) / 9 - 4 / 2) / 4)
    assert stats["policy_loss"] == pytest.approx(want_loss, abs=1e-5)


def test_loss_agg_and_clip_high_reach_the_update(random_llama_dir):
    """--loss-agg: auto is token-mean for delta and seq-mean-token-mean for starpo, and an explicit
    value wins; --clip-high: with every ratio e^0.5 = 1.65 above the range and A = 1, the token-mean
    loss is -(1 + ε_high) exactly."""
    model, tok, samples = _update_batch(random_llama_dir)
    token = _grad_of_update(model, tok, samples, micro_batch_size=64, loss_agg="token-mean")[1]
    seq = _grad_of_update(model, tok, samples, micro_batch_size=64, loss_agg="seq-mean-token-mean")[1]
    assert token["policy_loss"] != pytest.approx(seq["policy_loss"], abs=1e-3)
    auto_delta = _grad_of_update(model, tok, samples, micro_batch_size=64)[1]
    auto_starpo = _grad_of_update(model, tok, samples, micro_batch_size=64, reward_mode="starpo")[1]
    assert auto_delta["policy_loss"] == pytest.approx(token["policy_loss"], abs=1e-6)
    assert auto_starpo["policy_loss"] == pytest.approx(seq["policy_loss"], abs=1e-6)
    old = db.token_logprobs(model, tok, samples, 64)
    for clip_high in (0.28, 0.5):
        for x, o in zip(samples, old):
            x.old, x.adv = o - 0.5, 1.0
        args = db.Args(num_minibatches=1, temperature=1.0, micro_batch_size=64, clip_high=clip_high,
                       loss_agg="token-mean")
        stats = db.update(model, tok, _sgd0(model), samples, args, np.random.default_rng(0))
        assert stats["policy_loss"] == pytest.approx(-(1 + clip_high), abs=1e-5)
        assert stats["clip_frac"] == pytest.approx(1.0)


def _sgd0(model):
    import torch

    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)


def test_real_model_budget_fits_a_think_then_ask_answer(smollm2_cache):
    """The "*" row's max_new_tokens holds a think-then-ask answer to the env's own instruction
    (envs.INSTRUCT_FORMAT) in SmolLM2 tokens, <|im_end|> included; the official 50 cuts the longer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_cache / "smollm2-135m"))
    answers = [
        "<think>No questions yet. Start broad.</think><action>Is it an animal?</action>",
        "<think>It is an animal but not a mammal. Birds are a big group, so check flying next."
        "</think><action>Can it fly?</action>",
        "<think>So far: it is an animal, it is a mammal, it is not a pet and it lives on a farm. Farm "
        "mammals include cows, pigs, horses, sheep and goats. Horns would split these roughly in half."
        "</think><action>Does it have horns?</action>",
        "<think>Known facts: man-made, used in the kitchen, not electronic, made of metal, small enough "
        "to hold in one hand. Candidates are a knife, a fork, a spoon or a pan. A knife is the only sharp "
        "one, so asking about sharpness halves the set, and if the answer is yes I can guess next turn."
        "</think><action>Is it sharp?</action>",
    ]
    counts = [len(tok(a, add_special_tokens=False)["input_ids"]) + 1 for a in answers]
    assert counts == [24, 36, 64, 87]
    assert max(counts) <= db.DEFAULTS["*"]["max_new_tokens"] and max(counts) > 50
    args, *_ = db.make_env(db.Args(model_name="smollm2-135m-instruct"))
    assert args.max_new_tokens == db.DEFAULTS["*"]["max_new_tokens"]


def test_real_model_row_is_faithful_to_the_paper_per_mode():
    """A "*" model: 3 minibatches (official), lr 3e-5 for ΔBelief and 1e-5 for StarPO (paper Table 5,
    official script); the tiny and SmolLM2 rows keep one rate for both modes; a given lr wins."""
    for model, delta, starpo in (("Qwen/Qwen3-1.7B", 3e-5, 1e-5), ("tiny", 5e-4, 5e-4),
                                 ("smollm2-135m", 1e-4, 1e-4)):
        assert db.make_env(db.Args(model_name=model))[0].learning_rate == delta
        assert db.make_env(db.Args(model_name=model, reward_mode="starpo"))[0].learning_rate == starpo
    args, *_ = db.make_env(db.Args(model_name="Qwen/Qwen3-1.7B", reward_mode="starpo"))
    assert args.num_minibatches == 3 and args.max_new_tokens == 128
    args, *_ = db.make_env(db.Args(model_name="Qwen/Qwen3-1.7B", reward_mode="starpo",
                                   learning_rate=2e-5))
    assert args.learning_rate == 2e-5
