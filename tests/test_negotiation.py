"""Negotiation: utilities and 0-10 scores by hand, price parsing, the buyer's outside option, scripted
styles, expert and random win rates, vs_opponent, self-play, and EPO's strategy-following agent. The
engine shared with Bargaining is tested in tests/test_bargaining.py."""

import random

import pytest

import envs
from envs.negotiation import STRATEGIES, strategy_intent
from envs.two_player_common import expert, parse_move, play, win_rate

TASK = "p00_s0.8_b1.2_T8"  # used road bike: M = 400, V_S = 0.8 * 400 = 320, V_B = 1.2 * 400 = 480, 8 rounds


@pytest.fixture
def game():
    g = envs.make("negotiation")
    g.reset(TASK)
    return g


def test_tasks_and_values(game):
    train, test = game.task_ids("train"), game.task_ids("test")
    # 12 products x 3 seller factors x 3 buyer factors x 3 horizons = 324 ids, a quarter for test
    assert len(train) == 243 and len(test) == 81 and not set(train) & set(test)
    assert (game.M, game.value["Alice"], game.value["Bob"], game.T) == (400, 320, 480, 8)
    with pytest.raises(ValueError):
        game.reset("p99_s0.8_b1.2_T8")


def test_utilities_scores_and_win_by_hand(game):
    for move in ["propose 500", "I can pay $400", "How about $440?", "Reject. I offer 420", "accept"]:
        step = game.step(move)
    assert step.done and game.deal_offer == 420 and game.deal_round == 4
    # u_S = 420 - 320 = 100 ; u_B = 480 - 420 = 60
    assert game.payoffs() == {"Alice": pytest.approx(100.0), "Bob": pytest.approx(60.0)}
    # score_S = 10 * (420 - 320) / (480 - 320) = 6.25 ; score_B = 10 * (480 - 420) / 160 = 3.75
    assert game.scores() == {"Alice": pytest.approx(6.25), "Bob": pytest.approx(3.75)}
    assert step.info["scores"] == game.scores() and game.winner() == "Alice" and step.info["success"]
    assert step.info["progress"] == pytest.approx(0.625)


def test_scores_clip_and_no_deal(game):
    assert game.score_at("Alice", 600) == 10.0 and game.score_at("Bob", 600) == 0.0
    assert game.score_at("Bob", 360) == pytest.approx(7.5)  # 10 * (480 - 360) / 160
    game.step("propose 450")
    step = game.step("I'll walk away and buy from John")  # the buyer's outside option
    assert step.done and not step.info["invalid"] and not step.info["deal"]
    assert game.payoffs() == {"Alice": 0.0, "Bob": 0.0} and game.scores() == {"Alice": 0.0, "Bob": 0.0}


def test_seller_has_no_outside_option(game):
    step = game.step("walk away")
    assert step.info["invalid"] and not step.done and game.current_player == "Alice"


@pytest.mark.parametrize("text,kind,value", [
    ("propose 450", "propose", 450), ("How about $121.25?", "propose", 121.25), ("$1,200", "propose", 1200),
    ("I'd like to make a counteroffer of $105. Can you consider that?", "propose", 105),
    ("$125 is too steep. I offer $105", "propose", 105), ("Reject. I offer 55", "propose", 55),
    ("I accept the offer.", "accept", None), ("<action>accept</action>", "accept", None),
    ("I do not accept $500, counter-offer 450", "propose", 450), ("walk away", "walk", None),
    ("No deal", "reject", None),
])
def test_parse_prices(text, kind, value):
    move = parse_move(text)
    assert move is not None and move.kind == kind
    if value is not None:
        assert move.value == pytest.approx(value)


def test_invalid_price_and_any_string(game):
    assert game.step("propose 0").info["invalid"]
    assert game.step("propose -20").done  # second invalid in a row: no deal
    rng = random.Random(1)
    junk = ["", "\u2603", "<action>", "propose 1e400", "a" * 3000, "accept", "walk away", "propose 99999999"]
    for task in game.task_ids("test")[:5]:
        game.reset(task)
        for _ in range(40):
            if game.done:
                break
            step = game.step(rng.choice(junk + game.admissible_actions()))
            assert isinstance(step, envs.Step) and isinstance(step.info["invalid"], bool)


def test_view_is_private(game):
    game.step("propose 500")
    sys_b, user_b = game.observe("Bob")
    assert "$480" in user_b["content"] and "$320" not in user_b["content"]
    assert "John" in sys_b["content"] and "$480" in sys_b["content"] and "$320" not in sys_b["content"]
    sys_a, user_a = game.observe("Alice")
    assert "$320" in user_a["content"] and "$480" not in user_a["content"] + sys_a["content"]
    assert "Alice proposes price $500" in user_b["content"] and "walk away" in user_b["content"]
    game.step("propose 380")
    game.step("propose 470")
    assert "History:\nR1 Alice: propose 500\nR2 Bob: propose 380\nRound 3" in game.observe("Bob")[1]["content"]


def _proposals(game, player, style, other_move):
    game.reset(TASK)
    out = []
    while not game.done:
        if game.current_player == player:
            move = game.scripted_action(player, style)
            if move.startswith("propose"):
                out.append(float(move.split()[1]))
            game.step(move)
        else:
            game.step(other_move)
    return out


def test_styles_behave_as_named(game):
    # Seller styles against a buyer who keeps offering $100 (M = 400, V_S = 320).
    tough = _proposals(game, "Alice", "tough", "propose 100")
    conceding = _proposals(game, "Alice", "conceding", "propose 100")
    assert tough == [560, 548, 536, 524]         # 1.40 M, then 3% of M a round
    assert conceding == [440, 400, 360, 320]     # 1.10 M, then 10% of M a round, down to V_S
    assert tough[0] - tough[-1] < conceding[0] - conceding[-1]
    # fair splits the difference with a buyer at $400 (480, 440, 420) and takes 400, within 6% of M of 420
    assert _proposals(game, "Alice", "fair", "propose 400") == [480, 440, 420]
    assert game.deal_offer == 400
    # tit for tat holds against a buyer who holds
    assert _proposals(game, "Alice", "tit_for_tat", "propose 100") == [500] * 4
    # buyer side (V_B = 480): conceding opens at 0.9 M and rises 10% of M a round, capped at V_B
    assert _proposals(game, "Bob", "conceding", "propose 700") == [360, 400, 440, 480]


@pytest.mark.parametrize("style", ["conceding", "fair"])
@pytest.mark.parametrize("role", ["Alice", "Bob"])
def test_expert_wins_test_tasks(game, role, style):
    assert win_rate(game, game.task_ids("test"), role, expert, style) >= 0.9


def test_random_policy_wins_rarely(game):
    rng = random.Random(0)
    rand = lambda g, p: rng.choice(g.admissible_actions(p))
    rates = [win_rate(game, game.task_ids("test"), role, rand, "fair") for role in game.players]
    assert max(rates) <= 0.3, rates


@pytest.mark.parametrize("role", ["Alice", "Bob"])
def test_vs_opponent_both_roles(role):
    env = envs.vs_opponent(envs.make("negotiation"), "rule:conceding", learner=role)
    for task in env.task_ids("test")[:8]:
        env.reset(task)
        for _ in range(env.max_turns):
            step = env.step(env.expert_action())
            if step.done:
                break
        assert step.done and step.info["success"] and step.reward == pytest.approx(step.info["payoffs"][role])
        assert step.info["scores"][role] > 5.0 and step.info["progress"] == pytest.approx(step.info["scores"][role] / 10)


def test_self_play_experts_reach_a_deal(game):
    for task in game.task_ids("test"):
        play(game, task, {p: expert for p in game.players})
        assert game.deal_offer is not None, task
        assert sum(game.scores().values()) == pytest.approx(10.0)


# ---- EPO: strategy-following agent ----------------------------------------------------------------
def test_strategy_intents():
    assert strategy_intent("Strategy: hold firm at a high price") == "hold"
    assert strategy_intent("Strategy: concede slightly") == "small"
    assert strategy_intent("Strategy: make a big concession") == "large"
    assert strategy_intent("Strategy: accept the offer") == "accept"
    assert strategy_intent("Strategy: anchor low") == "anchor"
    assert strategy_intent("Strategy: meet them halfway") == "split"
    assert strategy_intent("Strategy: walk away to John") == "walk"
    assert strategy_intent("zzz") is None and strategy_intent(None) is None


def test_rule_agent_follows_strategies(game):
    assert game.rule_agent_action("Alice", "Strategy: anchor high") == "propose 540"  # 1.35 * 400
    game.step("propose 540")
    assert game.rule_agent_action("Bob", "Strategy: anchor low") == "propose 260"  # (2 - 1.35) * 400
    # accepting 540 would lose Bob money (V_B = 480): he holds, i.e. opens at his anchor
    assert game.rule_agent_action("Bob", "Strategy: accept the offer") == "propose 260"
    assert game.rule_agent_action("Bob", "Strategy: walk away") == "walk away"
    game.step("propose 300")
    agent = lambda s: game.rule_agent_action("Alice", s)
    assert agent("Strategy: hold firm") == "propose 540"
    assert agent("Strategy: concede slightly") == "propose 528"         # 540 - 0.03 * 400
    assert agent("Strategy: concede a lot") == "propose 500"            # 540 - 0.10 * 400
    assert agent("Strategy: split the difference") == "propose 420"     # (540 + 300) / 2
    assert agent("Strategy: accept the offer") == "propose 540"         # 300 < V_S = 320: holds
    assert agent("Strategy: walk away") == "propose 540"                # no outside option: holds
    assert agent("gibberish ###") == "propose 528"                      # not understood: slight concession


def test_rule_agent_never_loses_money_and_accepts_better_offers(game):
    for move in ["propose 340", "propose 335"]:
        game.step(move)
    # conceding a lot would ask 300 < V_S; clipped at 320, which is below Bob's 335: accept instead
    assert game.rule_agent_action("Alice", "Strategy: concede a lot") == "accept"
    game.reset(TASK)
    for move in ["propose 330", "propose 200"]:
        game.step(move)
    assert game.rule_agent_action("Alice", "Strategy: concede a lot") == "propose 320"


def test_expert_strategy_and_canonical_list(game):
    assert set(STRATEGIES) == set(game.players) and "Strategy: walk away" in game.strategies("Bob")
    assert "Strategy: walk away" not in game.strategies("Alice")
    rng = random.Random(0)
    for task in game.task_ids("test")[:20]:
        game.reset(task)
        while not game.done:
            p = game.current_player
            s = game.expert_strategy(p)
            assert s.startswith("Strategy: ") and len(s.split()) <= 10 and s in game.strategies(p)
            assert game.expert_action(p) == game.rule_agent_action(p, s)
            # noisy strategies still give a legal move
            noisy = rng.choice(game.strategies(p)) if rng.random() < 0.3 else s
            assert not game.step(game.rule_agent_action(p, noisy)).info["invalid"]


def test_strategy_level_moves():
    g = envs.make("negotiation", moves="strategy")
    g.reset(TASK)
    assert g.expert_action("Alice") == "Strategy: anchor high" and g.admissible_actions() == g.strategies("Alice")
    step = g.step("<action>Strategy: anchor high</action>")
    assert g.offer == 540 and step.info["strategy_understood"] and not step.info["invalid"]
    g.step("propose 300")  # text that is not a strategy is a direct move (scripted opponents)
    step = g.step("Strategy: purple elephants")  # not understood: the agent concedes slightly
    assert g.offer == 528 and not step.info["strategy_understood"]
    assert g.step("blah").info["invalid"]
    assert win_rate(g, g.task_ids("test")[:30], "Bob", expert, "fair") >= 0.9
    with pytest.raises(ValueError):
        envs.make("negotiation", moves="telepathy")


# ---- EPO: the style-aware expert ------------------------------------------------------------------
def _play_strategies(style, role, expert_kind="style"):
    """Play TASK with the `expert_kind` expert in `role` against `style`; its strategies, the moves, its score."""
    game = envs.Seated(envs.make("negotiation", moves="strategy", expert=expert_kind),
                       {role: "policy", "Bob" if role == "Alice" else "Alice": style}).reset(TASK)
    used = []
    while not game.done:
        used.append(game.env.expert_action(role))
        game.step(used[-1])
    return [s.removeprefix("Strategy: ") for s in used], game.env.moves, game.env.scores()[role]


@pytest.mark.parametrize("style", ["tough", "fair", "conceding", "tit_for_tat"])
def test_opening_style_reads_the_other_sides_opening(game, style):
    assert game.opening_style("Bob") is None  # no proposal yet
    game.step(game.scripted_action("Alice", style))
    assert game.opening_style("Bob") == style and game.opening_style("Alice") is None
    game.reset(TASK)
    game.step("propose 540")  # 1.35 M, the strategy agent's anchor: no scripted style opens there
    assert game.opening_style("Bob") is None


def test_style_expert_against_tit_for_tat_by_hand():
    # M = 400, V_S = 320, V_B = 480, 8 rounds. tit_for_tat opens 500 (1.25 M) and mirrors Bob's last concession:
    # Bob anchors 260 (Alice holds 500), concedes a lot to 300 (Alice mirrors 40: 460), returns to 260 (a retreat
    # is not mirrored: 460), and splits on the last proposal: z = (1.35 + (2 - 460/400)) / 2 = 1.10 -> $360,
    # which tit_for_tat takes on the last round (>= V_S). Bob's score 10 (480 - 360) / 160 = 7.5.
    used, moves, score = _play_strategies("tit_for_tat", "Bob")
    assert used == ["anchor low", "concede a lot", "anchor low", "split the difference"]
    assert [m[3] for m in moves if m[2] == "propose"] == [500, 260, 500, 300, 460, 260, 460, 360]
    assert moves[-1][2] == "accept" and score == pytest.approx(7.5)
    assert _play_strategies("tit_for_tat", "Bob", "plain")[2] == pytest.approx(2.0)  # the plain expert: $448


def test_style_expert_against_tough_by_hand():
    # tough opens 560 and concedes 12 a round; Bob anchors 260, concedes a lot twice (300, 340) and splits on the
    # last proposal: z = (1.15 + (2 - 524/400)) / 2 = 0.92 -> $432, above tough's floor V_S + 0.25 M = $420, so it
    # is taken. Bob's score 10 (480 - 432) / 160 = 3.0; the plain expert's last offer ($404) is refused.
    used, moves, score = _play_strategies("tough", "Bob")
    assert used == ["anchor low", "concede a lot", "concede a lot", "split the difference"]
    assert moves[-2][3] == 432 and score == pytest.approx(3.0)
    assert _play_strategies("tough", "Bob", "plain")[2] == 0.0


def test_style_expert_is_the_plain_expert_without_a_scripted_opening(game):
    for task in game.task_ids("test")[:10]:
        game.reset(task)
        while not game.done:  # self-play: the other side's opening is the expert's anchor, no style
            p = game.current_player
            assert game.style_expert_strategy(p) == game.expert_strategy(p)
            game.step(game.rule_agent_action(p, game.expert_strategy(p)))
    assert _play_strategies("conceding", "Alice")[0] == _play_strategies("conceding", "Alice", "plain")[0]
    with pytest.raises(ValueError):
        envs.make("negotiation", expert="oracle")


def test_style_expert_scores_at_least_the_plain_expert_on_every_pairing():
    # test tasks, goal score per (style, role); measured: the plain expert 6.02 on average, the style-aware 6.82
    means = {}
    for kind in ("plain", "style"):
        base = envs.make("negotiation", moves="strategy")
        for style in base.opponent_styles():
            for role in base.players:
                scores = []
                for task in base.task_ids("test"):
                    g = envs.Seated(envs.make("negotiation", moves="strategy", expert=kind),
                                    {role: "policy", base.other(role): style}).reset(task)
                    while not g.done:
                        g.step(g.env.expert_action(role))
                    scores.append(g.env.scores()[role])
                means[kind, style, role] = sum(scores) / len(scores)
    for style, role in {(s, r) for _, s, r in means}:
        assert means["style", style, role] >= means["plain", style, role] - 1e-9, (style, role)
    assert means["style", "tit_for_tat", "Bob"] - means["plain", "tit_for_tat", "Bob"] > 3.0
    overall = {k: sum(v for (kk, _, _), v in means.items() if kk == k) / 8 for k in ("plain", "style")}
    assert overall["style"] - overall["plain"] > 0.6
