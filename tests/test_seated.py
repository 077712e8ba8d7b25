"""envs.Seated: who sits where, whose turn it is, what a player's step returns (docs/envs.md, "Seated games").
Payoffs are computed by hand from the Bargaining rules: a deal at round t giving Alice p dollars pays
Alice d_A^(t-1) p and Bob d_B^(t-1) (100 - p)."""

import pytest

import envs

TASK = "dA0.80_dB0.95_T6"  # d_A 0.80, d_B 0.95, 6 rounds


def bargaining(seats=None):
    return envs.Seated(envs.make("bargaining"), seats).reset(TASK)


def test_self_play_seats_the_policy_twice_and_alternates():
    game = bargaining()
    assert game.seats == {"Alice": "policy", "Bob": "policy"} and game.current_player == "Alice"
    step = game.step("propose 70")
    assert game.current_player == "Bob" and not step.done and step.reward == 0.0 and step.info["payoffs"] == {}
    assert "Round 1 of 6. You proposed Alice 70, Bob 30" in step.observation  # Alice's side
    assert "Alice proposes Alice 70, Bob 30" in game.observe("Bob")[-1]["content"]
    step = game.step("propose 55")  # Bob counters: round 2, Alice to answer
    assert game.current_player == "Alice" and game.env.round == 2
    step = game.step("accept")  # round 2, Alice 45: Alice 0.8 * 45 = 36, Bob 0.95 * 55 = 52.25
    assert step.done and game.done and step.reward == pytest.approx(36.0)
    assert step.info["payoffs"] == pytest.approx({"Alice": 36.0, "Bob": 52.25}) and not step.info["success"]


def test_a_scripted_opener_moves_in_reset_and_replies_in_step():
    game = bargaining({"Alice": "fair", "Bob": "policy"})
    assert game.current_player == "Bob"  # fair Alice has opened with 50
    assert "Alice proposes Alice 50, Bob 50" in game.observe("Bob")[-1]["content"]
    step = game.step("propose 55")  # Alice keeps 45 >= 40: fair accepts at round 2
    assert step.done and step.reward == pytest.approx(0.95 * 55) and step.info["success"]
    assert step.info["payoffs"] == pytest.approx({"Alice": 0.80 * 45, "Bob": 0.95 * 55})
    assert step.info["progress"] == pytest.approx(0.5225) and "scores" in step.info


def test_a_scripted_responder_answers_after_the_policy():
    game = bargaining({"Alice": "policy", "Bob": "tough"})
    assert game.current_player == "Alice" and game.env.round == 1  # Alice opens: nothing scripted yet
    step = game.step("propose 60")  # tough Bob (keeps at least 65) rejects and counters 85 for himself
    assert not step.done and game.current_player == "Alice" and game.env.round == 2
    assert game.progress("Alice") == pytest.approx(0.80 * 15 / 100)  # accepting Bob's 85 would pay 0.8 * 15
    assert step.info["progress"] == pytest.approx(game.progress("Alice"))


def test_bad_text_is_an_invalid_move_of_the_same_player():
    game = bargaining()
    step = game.step("no idea at all")
    assert step.info["invalid"] and not step.done and game.current_player == "Alice"
    step = game.step(None)  # the second invalid message in a row ends the game with no deal
    assert step.info["invalid"] and step.done and step.reward == 0.0
    assert step.info["payoffs"] == {"Alice": 0.0, "Bob": 0.0} and not step.info["success"]


def test_a_single_agent_env_has_one_seat_and_passes_steps_through():
    game = envs.Seated(envs.make("sokoban"))
    twin = envs.make("sokoban")
    task = twin.task_ids("test")[0]
    game.reset(task)
    twin.reset(task)
    assert game.players == ("agent",) and game.seats == {"agent": "policy"} and game.current_player == "agent"
    assert game.observe("agent") == twin.messages() and game.progress("agent") == 0.0
    for text in ("up", "not a move", twin.expert_action()):
        a, b = game.step(text), twin.step(text)
        assert (a.observation, a.reward, a.done, a.info) == (b.observation, b.reward, b.done, b.info)
        assert game.progress("agent") == b.info.get("progress", 0.0)


def test_bad_seats_are_refused():
    game = envs.make("bargaining")
    with pytest.raises(ValueError, match="unknown opponent style"):
        envs.Seated(game, {"Alice": "policy", "Bob": "nobody"})
    with pytest.raises(ValueError, match="seats must name each player"):
        envs.Seated(game, {"Alice": "policy"})
    with pytest.raises(ValueError, match="seat the policy"):
        envs.Seated(game, {"Alice": "fair", "Bob": "tough"})


def test_utterance_moves_reads_messages_as_moves_only_inside_the_block():
    game = envs.Seated(envs.make("negotiation", moves="strategy")).reset(envs.make("negotiation").task_ids("test")[0])
    assert "Strategy: <at most 10 words>" in game.observe("Alice")[-1]["content"]
    with game.env.utterance_moves():
        assert game.env.moves_mode == "utterance" and "propose N" in game.observe("Alice")[-1]["content"]
        step = game.step("Strategy: anchor high")  # not a move when read as an utterance
    assert step.info["invalid"] and game.env.moves_mode == "strategy"
    step = game.step("Strategy: anchor high")  # the rule agent plays it
    assert not step.info["invalid"] and step.info["strategy"] == "Strategy: anchor high"
    bargaining_game = envs.make("bargaining")
    with bargaining_game.utterance_moves():
        assert bargaining_game.moves_mode is None
