"""Twenty Questions with compound secrets (`envs.make("twenty_questions", secrets="compound")`): the table,
the split, the answerer, the expert, state keys, progress and the prompt, against values worked out by hand
from envs/data/twenty_questions_compound.json (the generic protocol checks are in test_env_protocol.py)."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

import envs
from conftest import random_policy_wins
from envs.twenty_questions import COMPOUND_FILE, VERSION, load_compound_table, parse_compound_question

N = 256  # 16 things x 16 colours


@pytest.fixture
def env():
    return envs.make("twenty_questions", secrets="compound")


def play(env, secret: str, questions: list[str]) -> list:
    env.reset(secret)
    return [env.step(q) for q in questions]


# ----------------------------------------------------------------------------------------------
# Table and split
# ----------------------------------------------------------------------------------------------
def test_table_shape_and_features_tell_every_item_apart():
    meta = json.loads(COMPOUND_FILE.read_text())
    table = load_compound_table()
    assert [p["name"] for p in meta["parts"]] == ["thing", "colour"]
    for part in meta["parts"]:
        items = [it["name"] for it in part["items"]]
        assert len(items) == 16 == len(set(items))
        for f in part["features"]:
            assert f["question"].endswith("?") and f["definition"]
            assert 0 < len(f["true"]) < 16, f["name"]  # every feature splits its part
        vectors = {tuple(it in f["true"] for f in part["features"]) for it in items}
        assert len(vectors) == 16, part["name"]  # the features alone identify every item
    assert len(table.words) == N == len(set(table.words))
    assert table.words[:3] == ["red cat", "orange cat", "yellow cat"] and table.words[-1] == "maroon hat"


def test_split_holds_out_combinations_of_parts_seen_in_training(env):
    train, test = env.task_ids("train"), env.task_ids("test")
    assert len(test) == 52 and len(train) == 204 and not set(train) & set(test)
    # thing 0 (cat) with colours 0, 5, 10, 15; thing 1 (dog) with colours 1, 6, 11: (i - j) % 5 == 0
    assert [w for w in test if w.endswith(" cat")] == ["red cat", "purple cat", "gray cat", "maroon cat"]
    assert [w for w in test if w.endswith(" dog")] == ["orange dog", "pink dog", "gold dog"]
    table = load_compound_table()
    for part, index in (("thing", 1), ("colour", 0)):
        for item in table.parts[part]:
            n_train = sum(w.split(" ")[index] == item for w in train)
            n_test = sum(w.split(" ")[index] == item for w in test)
            assert (n_train, n_test) in ((12, 4), (13, 3)), (item, n_train, n_test)


@pytest.mark.parametrize("secret, attr, value", [
    ("red cat", "animal", True), ("red cat", "mammal", True), ("red cat", "pet", True), ("red cat", "bark", False),
    ("red cat", "warm", True), ("red cat", "rainbow", True), ("red cat", "light", False), ("red cat", "primary", True),
    ("silver plane", "fly", True), ("silver plane", "engine", True), ("silver plane", "wheels", True),
    ("silver plane", "metallic", True), ("silver plane", "neutral", True), ("silver plane", "warm", False),
    ("navy sailboat", "ride", True), ("navy sailboat", "engine", False), ("navy sailboat", "dark", True),
    ("navy sailboat", "rainbow", False), ("beige bed", "legs", True), ("beige bed", "sleep", True),
    ("beige bed", "neutral", True), ("beige bed", "dark", False), ("green shark", "legs", False),
    ("green shark", "water", True), ("orange frog", "handheld", True), ("white owl", "hoot", True),
    ("white owl", "feathers", True), ("black hat", "wear", True), ("red cat", "thing=cat", True),
    ("red cat", "thing=dog", False), ("red cat", "colour=red", True), ("red cat", "colour=orange", False),
])
def test_table_facts(secret, attr, value):
    assert load_compound_table().values[secret][attr] is value


def test_options_and_version(env):
    assert env.version != VERSION and env.version.startswith("c1.")
    assert envs.make("twenty_questions").version == VERSION
    with pytest.raises(ValueError, match="secrets"):
        envs.make("twenty_questions", secrets="colours")
    with pytest.raises(ValueError, match="compound secrets"):
        env.reset("cat")


# ----------------------------------------------------------------------------------------------
# Answerer
# ----------------------------------------------------------------------------------------------
def test_answers_for_an_orange_frog(env):
    steps = play(env, "orange frog", ["Is it an animal?", "Is it a mammal?", "Can it fly?", "Does it have legs?",
                                      "Is it a warm colour?", "Is it a colour of the rainbow?",
                                      "Is it a light colour?", "Is it a primary colour?", "Is it a cool colour?",
                                      "Is it a frog?", "Is it red?"])
    assert [s.observation for s in steps] == ["Yes", "No", "No", "Yes", "Yes", "Yes", "No", "No", "No", "Yes", "No"]
    assert [s.info["attribute"] for s in steps] == ["animal", "mammal", "fly", "legs", "warm", "rainbow", "light",
                                                    "primary", "warm", "thing=frog", "colour=red"]
    assert all(s.reward == 0.0 and not s.done and not s.info["invalid"] for s in steps)


@pytest.mark.parametrize("question, attr, positive", [
    ("Is it an animal?", "animal", True), ("Is it alive?", "animal", True), ("Is it a creature?", "animal", True),
    ("Can it fly?", "fly", True), ("Does it live in the sea?", "water", True), ("Can people ride it?", "ride", True),
    ("Is it handheld?", "handheld", True), ("Is its colour warm?", "warm", True),
    ("Is it warm-coloured?", "warm", True), ("Is it a cool color?", "warm", False),
    ("Is it in the rainbow?", "rainbow", True), ("Is its color dark?", "dark", True),
    ("Is it a pale colour?", "light", True), ("Is it metallic?", "metallic", True),
    ("Question: Is it a primary colour?", "primary", True), ("Is it a cat?", "thing=cat", True),
    ("Is it a kitten?", "thing=cat", True), ("Is it an airplane?", "thing=plane", True),
    ("Is it a bike?", "thing=bicycle", True), ("Is it red?", "colour=red", True), ("Is it grey?", "colour=gray", True),
])
def test_synonyms_map_to_attributes(question, attr, positive):
    p = parse_compound_question(question)
    assert (p.kind, p.attr, p.positive) == ("attribute", attr, positive), p


def test_canonical_questions_and_guesses_parse_to_themselves(env):
    table = load_compound_table()
    for part in ("thing", "colour"):
        for a in table.features[part]:
            p = parse_compound_question(table.questions[a])
            assert (p.kind, p.attr, p.positive) == ("attribute", a, True), (a, p)
    for w in table.words:
        p = parse_compound_question(env.guess_text(w))
        assert (p.kind, p.word) == ("guess", w), (w, p)
    assert env.guess_text("orange frog") == "Is it an orange frog?" and env.guess_text("red cat") == "Is it a red cat?"
    acts = env.admissible_actions()
    assert len(acts) == 17 + 7 + N == len(set(acts))  # 17 thing features, 7 colour features, every guess


@pytest.mark.parametrize("guess", [
    "Is it an orange frog?", "Is it a orange frog?", "is it the orange frogs", "Is it Orange Frog?",
    "<think>warm and small</think><action>Is it an orange frog?</action>", "Guess: is it an orange frog?",
])
def test_naming_the_secret_finishes(env, guess):
    env.reset("orange frog")
    step = env.step(guess)
    assert step.observation == "Finished" and step.done and step.reward == 1.0
    assert step.info["success"] and step.info["progress"] == 1.0 and step.info["guess"] == "orange frog"
    assert env.state_key() == frozenset({("guess", "orange frog")})


def test_wrong_guess_is_no_and_leaves_the_game_open(env):
    env.reset("orange frog")
    step = env.step("Is it a red frog?")
    assert step.observation == "No" and not step.done and step.reward == 0.0 and not step.info["invalid"]
    assert step.info["guess"] == "red frog" and env.state_key() == frozenset({("guess", "red frog")})
    assert "red frog" not in env.candidates() and len(env.candidates()) == N - 1


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("red cat", "not a question"), ("What colour is it?", "not a yes/no question"),
    ("Is it red? Is it a cat?", "more than one question"), ("Is it an animal and can it fly?", "more than one question"),
    ("Is it not red?", "negated question"), ("Is it a cat or a dog?", "several guesses"),
    ("Is it red or blue?", "several guesses"), ("Is it a red animal?", "several properties"),
    ("Is it a mammal that can fly?", "several properties"), ("Is it big?", "unsupported property"),
    ("Is it a big animal?", "unsupported property"), ("Is its colour bright?", "unsupported property"),
    ("Is it warm-blooded?", "unsupported property"), ("Does it have four legs?", "unsupported property"),
    ("Is it happy?", "nothing understood"), ("Is it dark?", "nothing understood"),
])
def test_invalid_forms(env, text, reason):
    assert parse_compound_question(text).reason == reason
    env.reset("orange frog")
    step = env.step(text)
    assert step.observation == "Invalid" and step.info["invalid"] and not step.done
    assert step.reward == 0.0 and env.turn == 1 and env.state_key() == frozenset()


def test_repeated_questions(env):
    env.reset("orange frog")
    assert env.step("Is it an animal?").observation == "Yes"
    step = env.step("is it an ANIMAL")
    assert step.observation == "Repeated" and step.info["repeated"] and not step.info["invalid"]
    assert env.step("Is it a creature?").observation == "Yes"  # other words: answered again, no new fact
    env.step("Is it a red frog?")
    assert env.step("is it a red frog").observation == "Repeated"
    assert env.state_key() == frozenset({("animal", True), ("guess", "red frog")}) and env.turn == 5


def test_game_ends_after_twenty_questions(env):
    env.reset("orange frog")
    for i in range(20):
        step = env.step("Is it happy?" if i % 2 else "Is it an animal?")
    assert step.done and step.info.get("truncated") and step.reward == 0.0 and not step.info["success"]
    assert not env.step("Is it an orange frog?").info["success"]


# ----------------------------------------------------------------------------------------------
# State key and progress
# ----------------------------------------------------------------------------------------------
def test_state_key_is_order_and_wording_invariant():
    a = envs.make("twenty_questions", secrets="compound")
    b = envs.make("twenty_questions", secrets="compound")
    play(a, "orange frog", ["Is it an animal?", "Is it a warm colour?", "Is it a cat?", "Is it a red frog?"])
    play(b, "orange frog", ["Is it a red frog?", "Is it a kitten?", "Is it a cool colour?", "Is it a creature?",
                            "Is it happy?"])
    assert a.state_key() == b.state_key() == frozenset(
        {("animal", True), ("warm", True), ("thing=cat", False), ("guess", "red frog")})
    play(b, "orange frog", [])
    assert b.state_key() == frozenset()


def test_progress_by_hand(env):
    env.reset("orange frog")
    assert env.step("Is it happy?").info["progress"] == 0.0
    # 8 animals x 16 colours = 128 left: 1 - log 128 / log 256 = 1 - 7/8
    assert env.step("Is it an animal?").info["progress"] == pytest.approx(0.125)
    # the animals that cannot fly: cat dog horse cow shark frog (eagle and owl fly): 6 x 16 = 96
    assert env.step("Can it fly?").info["progress"] == pytest.approx(1 - math.log(96) / math.log(256))
    # not red: 6 x 15 = 90; then a wrong guess removes one secret: 89
    assert env.step("Is it red?").info["progress"] == pytest.approx(1 - math.log(90) / math.log(256))
    assert env.step("Is it an orange cat?").info["progress"] == pytest.approx(1 - math.log(89) / math.log(256))
    assert env.step("Is it a frog?").info["progress"] == pytest.approx(1 - math.log(15) / math.log(256))
    assert env.step("Is it an orange frog?").info["progress"] == 1.0


# ----------------------------------------------------------------------------------------------
# Expert
# ----------------------------------------------------------------------------------------------
def expert_game(env, secret):
    env.reset(secret)
    questions, step = [], None
    while not env.done:
        questions.append(env.expert_action())
        step = env.step(questions[-1])
    return questions, step.info["success"]


def test_expert_games_traced_by_hand(env):
    # thing: animal? yes, mammal? yes, pet? yes, bark? no -> cat; colour: warm? yes, rainbow? yes (red orange
    # yellow), light? no (red orange), primary? yes -> red
    assert expert_game(env, "red cat") == ([
        "Is it an animal?", "Is it a mammal?", "Is it a pet?", "Does it bark?", "Is it a warm colour?",
        "Is it a colour of the rainbow?", "Is it a light colour?", "Is it a primary colour?", "Is it a red cat?"], True)
    # thing: animal? no, vehicle? yes, engine? yes (car plane), fly? yes -> plane; colour: warm? no, neutral? no
    # (green blue purple navy), dark? yes (purple navy), rainbow? no -> navy
    assert expert_game(env, "navy plane") == ([
        "Is it an animal?", "Is it a vehicle?", "Does it have an engine?", "Can it fly?", "Is it a warm colour?",
        "Is it a neutral colour?", "Is it a dark colour?", "Is it a colour of the rainbow?",
        "Is it a navy plane?"], True)
    # yellow: warm? yes, rainbow? yes, light? yes -> the only light rainbow warm colour (7 questions + guess)
    assert expert_game(env, "yellow hat")[0][4:] == ["Is it a warm colour?", "Is it a colour of the rainbow?",
                                                      "Is it a light colour?", "Is it a yellow hat?"]


def test_expert_solves_every_secret_thing_first(env):
    table = load_compound_table()
    colour_questions = {table.questions[a] for a in table.features["colour"]}
    lengths = Counter()
    for secret in table.words:
        questions, won = expert_game(env, secret)
        assert won and questions[-1] == env.guess_text(secret)
        assert not colour_questions & set(questions[:4]) and colour_questions >= set(questions[4:-1])
        lengths[len(questions)] += 1
    assert lengths == {8: 16, 9: 208, 10: 32}  # colours need 3 (yellow), 4 or 5 (pink, beige) questions
    # the next question depends on the answers: the second question differs between animals and the rest
    assert expert_game(env, "red cat")[0][1] != expert_game(env, "red car")[0][1]


def test_expert_continues_from_any_state(env):
    env.reset("gold owl")
    for q in ["Is it a red cat?", "Is it happy?", "Is it a metallic colour?", "Is it a dog?", "Can it fly?"]:
        env.step(q)
    while not env.done:
        step = env.step(env.expert_action())
    assert step.info["success"] and env.turn <= 15


def test_uniform_random_policy_rarely_wins(env):
    total = 2 * len(env.task_ids("test"))
    wins, _ = random_policy_wins(env, total, actions=env.admissible_actions())
    # 20 draws from 280 actions, of which 1 wins: 1 - (279/280)^20 = 6.9% per game
    assert wins / total < 0.15  # measured: 7 of 104


def test_corrupt_action_is_admissible(env):
    import random

    env.reset("orange frog")
    acts = set(env.admissible_actions())
    rng = random.Random(0)
    draws = [env.corrupt_action(rng) for _ in range(200)]
    assert set(draws) <= acts
    assert 0.3 < sum(parse_compound_question(d).kind == "guess" for d in draws) / 200 < 0.7


# ----------------------------------------------------------------------------------------------
# Prompt
# ----------------------------------------------------------------------------------------------
def test_prompt_of_the_tiny_recipe_and_the_candidate_list():
    env = envs.make("twenty_questions", secrets="compound", instructions=False, numbered=False,
                    show_candidates=5)  # the tiny recipe's options
    play(env, "orange frog", ["Is it an animal?", "Is it a frog?", "Is it a warm colour?"])
    assert env.messages()[1]["content"] == (
        "Is it an animal? Yes\nIs it a frog? Yes\nIs it a warm colour? Yes\nQuestion 4 of 20:")
    env.step("Is it a colour of the rainbow?")  # red, orange, yellow frog left (at most show_candidates=5)
    assert env.messages()[1]["content"].splitlines()[-2:] == [
        "Possible secrets: red frog, orange frog, yellow frog.", "Question 5 of 20:"]
    sys_prompt = env.messages()[0]["content"]
    # the kinds of thing, never the 16 things or the 16 colours (the paper, §4: the set of secrets is
    # unknown to the questioner)
    assert "an animal, a vehicle, a piece of furniture" in sys_prompt
    assert not any(f" {w}," in sys_prompt or f" {w}." in sys_prompt
                   for w in ("dog", "horse", "shark", "bicycle", "orange", "purple", "maroon", "navy"))
    hidden = envs.make("twenty_questions", secrets="compound")  # the default: no candidate list
    play(hidden, "orange frog", ["Is it a frog?", "Is it a warm colour?", "Is it a colour of the rainbow?"])
    assert len(hidden.candidates()) <= 5 and "Possible" not in hidden.messages()[1]["content"]
    quiet = envs.make("twenty_questions", secrets="compound", instructions=False, numbered=False, show_candidates=0)
    play(quiet, "orange frog", ["Is it a frog?", "Is it a warm colour?", "Is it a colour of the rainbow?"])
    assert "Possible" not in quiet.messages()[1]["content"]
    full = envs.make("twenty_questions", secrets="compound")
    full.reset("orange frog")
    assert full.messages()[1]["content"].startswith("Twenty Questions: find the secret thing and its colour")
