"""Bargaining: payoffs by hand, move parsing, invalid moves, scripted styles, expert and random win
rates, the vs_opponent wrapper and self-play. The shared engine (envs/two_player_common.py) is tested
here; tests/test_negotiation.py covers what Negotiation adds."""

import random

import pytest

import envs
from envs.bargaining import BargainingEnv
from envs.two_player_common import expert, parse_move, play, win_rate


@pytest.fixture
def game():
    return envs.make("bargaining")


def test_task_split_fixed_and_disjoint(game):
    train, test = game.task_ids("train"), game.task_ids("test")
    # 7 discounts for Alice x 7 for Bob x 4 horizons = 196 ids, a quarter of them in the test split
    assert len(train) == 147 and len(test) == 49
    assert not set(train) & set(test)
    assert test == BargainingEnv().task_ids("test")
    with pytest.raises(ValueError):
        game.reset("dA0.81_dB0.90_T6")


def test_payoffs_deal_at_round_3(game):
    game.reset("dA0.80_dB0.90_T6")
    assert game.current_player == "Alice"
    game.step("propose 70")                     # round 1: Alice 70 / Bob 30
    game.step("Reject. I propose 55 for me")    # round 2: Bob 55 -> Alice 45
    assert game.offer == 45 and game.round == 2
    game.step("I propose $60 for me")           # round 3: Alice 60 / Bob 40
    step = game.step("<action>ACCEPT</action>")
    assert step.done and game.deal_round == 3
    pay = game.payoffs()
    # p_A = 0.8^(3-1) * 60 = 0.64 * 60 = 38.4 ; p_B = 0.9^2 * 40 = 0.81 * 40 = 32.4
    assert pay["Alice"] == pytest.approx(38.4)
    assert pay["Bob"] == pytest.approx(32.4)
    assert game.winner() == "Alice" and step.info["winner"] == "Alice"
    # reward and success of a step are the acting player's (Bob accepted and lost)
    assert step.info["player"] == "Bob" and not step.info["success"] and step.reward == pytest.approx(32.4)


def test_discounting_can_turn_a_nominal_loss_into_a_win(game):
    game.reset("dA0.70_dB1.00_T6")
    for move in ["propose 80", "propose 50", "propose 55", "accept"]:
        game.step(move)
    # deal at round 3, Alice 55: p_A = 0.7^2 * 55 = 0.49 * 55 = 26.95 ; p_B = 1.0^2 * 45 = 45
    assert game.payoffs()["Alice"] == pytest.approx(26.95)
    assert game.payoffs()["Bob"] == pytest.approx(45.0)
    assert game.winner() == "Bob"


def test_no_deal_pays_zero_and_last_round_reject(game):
    game.reset("dA0.90_dB0.90_T4")
    for move in ["propose 90", "propose 90", "propose 90", "propose 90"]:
        game.step(move)
    assert game.round == 4 and game.final_response and not game.done
    step = game.step("reject")
    assert step.done and game.payoffs() == {"Alice": 0.0, "Bob": 0.0} and game.winner() is None


@pytest.mark.parametrize("text,kind,value", [
    ("propose 60", "propose", 60), ("I propose $60 for me", "propose", 60), ("60 for me and 40 for you", "propose", 60),
    ("you get 40", "propose", 60), ("I'll give you 35", "propose", 65), ("Bob gets 40", "propose", 60),
    ("What about a 70-30 split?", "propose", 70), ("Reject. I offer 55", "propose", 55),
    ("I reject, how about 55-45 split?", "propose", 55), ("I want 70%", "propose", 70),
    ("I cannot accept that. I propose 58.", "propose", 58),
    ("Im not willing to accept a 60-40 split. What about 65-35 Split?", "propose", 65),
    ("<think>maybe 70</think><action>propose 65</action>", "propose", 65),
    ("accept", "accept", None), ("<action>ACCEPT</action>", "accept", None), ("Deal!", "accept", None),
    ("I accept your offer of $60", "accept", None), ("reject", "reject", None), ("No deal.", "reject", None),
])
def test_parse_phrasings_as_alice(text, kind, value):
    move = parse_move(text, split_total=100, names=("alice", "bob"))
    assert move is not None and move.kind == kind
    if value is not None:
        assert move.value == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "hello there", "Let me think about it.", None, 42, "\u00e9\u00e8\u2603"])
def test_unparseable_is_none(text):
    assert parse_move(text, split_total=100) is None


def test_invalid_moves_repeat_the_turn_then_end_the_game(game):
    game.reset("dA0.90_dB0.80_T6")
    step = game.step("let me think")
    assert step.info["invalid"] and not step.done and game.current_player == "Alice"
    assert "Invalid" in step.observation
    step = game.step("propose 60")  # a valid move resets the streak
    assert not step.info["invalid"] and game.current_player == "Bob"
    step = game.step("propose 160")  # out of range
    assert step.info["invalid"] and game.current_player == "Bob" and not step.done
    step = game.step("reject")  # a rejection needs a counter-proposal before the last round
    assert step.info["invalid"] and step.done  # max_invalid=2 in a row: no deal
    assert game.payoffs() == {"Alice": 0.0, "Bob": 0.0}
    step = game.step("accept")  # after the end: still a valid Step
    assert step.done and step.info["invalid"]


def test_max_invalid_option_and_accept_without_offer():
    g = BargainingEnv(max_invalid=3)
    g.reset("dA0.90_dB0.80_T6")
    assert g.step("accept").info["invalid"]  # nothing to accept yet
    assert not g.step("x" * 100000).done
    assert g.step("\x00\ud800 ignore previous instructions").done
    with pytest.raises(ValueError):
        BargainingEnv(max_invalid=0)


def test_any_string_gives_a_step(game):
    rng = random.Random(0)
    junk = ["", " ", "\n", "<action></action>", "<action>propose -5</action>", "propose 1e9", "accept accept",
            "<think>", "$$$", "\u202e\u0000", "propose 50.5", "a" * 5000]
    for task in game.task_ids("test")[:5]:
        game.reset(task)
        for _ in range(40):
            if game.done:
                break
            step = game.step(rng.choice(junk + game.admissible_actions()))
            assert isinstance(step, envs.Step) and isinstance(step.info["invalid"], bool)


def test_determinism_state_key_and_views(game):
    task = game.task_ids("test")[3]
    a = game.reset(task)
    key0 = game.state_key()
    moves = ["propose 70", "propose 60", "propose 65"]
    for m in moves:
        game.step(m)
    key1, msgs = game.state_key(), game.observe("Bob")
    assert game.reset(task) == a and game.state_key() == key0
    for m in moves:
        game.step(m)
    assert game.state_key() == key1 and game.observe("Bob") == msgs and hash(key1) is not None
    assert key1 != key0
    # the private view: own discount first, history of offers, the move forms
    sys_msg, user = msgs
    assert sys_msg["role"] == "system" and "playing as Bob" in sys_msg["content"] and "<action>" in sys_msg["content"]
    assert user["content"].startswith("You are Bob") and "History:\nR1 Alice: propose 70\nR2 Bob: propose 60\n" in user["content"]
    # the proposal on the table is spelled out once, in the view
    assert "R3" not in user["content"] and "Round 3 of 8. Alice proposes Alice 65, Bob 35." in user["content"]
    assert user["content"].endswith("Your move: accept | propose N.")
    short = BargainingEnv(history=1)
    short.reset(task)
    for m in moves:
        short.step(m)
    assert "History:\nR2 Bob: propose 60\nRound 3" in short.observe("Bob")[1]["content"]
    assert game.max_turns_per_player() == 12  # ceil((10 + 1) / 2) = 6 moves x max_invalid 2


def test_styles_behave_as_named(game):
    def alice_proposals(style, bob_move):
        game.reset("dA0.95_dB0.95_T10")
        out = []
        while not game.done:
            if game.current_player == "Alice":
                move = game.scripted_action("Alice", style)
                if move.startswith("propose"):
                    out.append(float(move.split()[1]))
                game.step(move)
            else:
                game.step(bob_move(out))
        return out

    hold = lambda out: "propose 90"  # Bob never concedes: Alice keeps 10
    tough, conceding = alice_proposals("tough", hold), alice_proposals("conceding", hold)
    assert tough[0] - tough[-1] < conceding[0] - conceding[-1]
    assert tough == [85, 82, 79, 76, 73]          # opens 85, concedes 3 a round
    assert conceding == [55, 43, 31, 20, 20]      # opens 55, concedes 12 a round down to 20
    assert alice_proposals("fair", hold) == [50] * 5
    # tit for tat: holds while Bob holds; once Bob concedes 5 a round (85, 80, 75), Alice concedes 5 too
    assert alice_proposals("tit_for_tat", hold) == [55] * 5
    assert alice_proposals("tit_for_tat", lambda out: f"propose {90 - 5 * len(out)}")[:4] == [55, 55, 50, 45]
    # fair accepts a split leaving it 40, not 39
    game.reset("dA0.95_dB0.95_T10")
    game.step("propose 50")
    game.step("propose 60")
    assert game.scripted_action("Alice", "fair") == "accept"
    game.reset("dA0.95_dB0.95_T10")
    game.step("propose 50")
    game.step("propose 61")
    assert game.scripted_action("Alice", "fair") == "propose 50"
    with pytest.raises(ValueError):
        game.scripted_action("Alice", "gpt4o")


@pytest.mark.parametrize("style", ["conceding", "fair"])
@pytest.mark.parametrize("role", ["Alice", "Bob"])
def test_expert_wins_test_tasks(game, role, style):
    assert win_rate(game, game.task_ids("test"), role, expert, style) >= 0.9


def test_random_policy_wins_rarely(game):
    rng = random.Random(0)
    rand = lambda g, p: rng.choice(g.admissible_actions(p))
    tasks = game.task_ids("test")
    rates = [win_rate(game, tasks, role, rand, "fair") for role in game.players]
    assert max(rates) <= 0.3, rates


@pytest.mark.parametrize("role", ["Alice", "Bob"])
def test_vs_opponent_both_roles(role):
    env = envs.vs_opponent(envs.make("bargaining"), "rule:fair", learner=role)
    assert env.max_turns == 12 and "playing as " + role in env.system_prompt
    wins = 0
    for task in env.task_ids("test")[:10]:
        obs = env.reset(task)
        assert isinstance(obs, str) and env.messages()[1]["content"].startswith(f"You are {role}")
        for _ in range(env.max_turns):
            step = env.step(env.expert_action())
            if step.done:
                break
        assert step.done and step.info["payoffs"][role] == pytest.approx(step.reward)
        assert step.info["success"] == (env.game.winner() == role)
        assert 0.0 <= step.info["progress"] <= 1.0
        wins += step.info["success"]
    assert wins == 10
    env.reset(env.task_ids("test")[0])
    step = env.step("no idea")
    assert step.info["invalid"] and not step.done and step.reward == 0.0
    with pytest.raises(ValueError):
        envs.vs_opponent(envs.make("bargaining"), "rule:nobody")


def test_self_play_experts_reach_a_deal(game):
    for task in game.task_ids("test"):
        play(game, task, {p: expert for p in game.players})
        assert game.deal_round is not None, task


def test_progress_is_the_deal_position(game):
    game.reset("dA0.80_dB0.90_T6")
    assert game.progress("Bob") == 0.0
    game.step("propose 70")
    assert game.progress("Bob") == pytest.approx(0.30)   # Bob gets 30 of 100 at round 1
    game.step("propose 60")
    # Alice could take 40 at round 2: 0.8 * 40 / 100 = 0.32
    assert game.progress("Alice") == pytest.approx(0.32)
    game.step("accept")
    assert game.progress("Alice") == pytest.approx(0.32) and game.progress("Bob") == pytest.approx(0.9 * 60 / 100)
