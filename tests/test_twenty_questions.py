"""The twenty_questions env: attribute table, rule-based answerer, expert and random baselines,
state keys, progress and prompt rendering (the generic protocol checks are in test_env_protocol.py)."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter, defaultdict

import numpy as np
import pytest

import envs
from conftest import random_policy_wins
from envs.twenty_questions import (ATTRIBUTES_FILE, WORDS_FILE, TwentyQuestionsEnv, guess_question,
                                   Parsed, load_table, normalize_question, parse_question)


@pytest.fixture
def env() -> TwentyQuestionsEnv:
    return envs.make("twenty_questions")


def play(env, secret: str, questions: list[str]) -> list:
    env.reset(secret)
    return [env.step(q) for q in questions]


# ----------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------
def test_table_shape_and_no_missing_values():
    meta = json.loads(ATTRIBUTES_FILE.read_text())
    names = [a["name"] for a in meta["attributes"]]
    assert len(names) >= 25 and len(set(names)) == len(names)
    assert all(a["question"].endswith("?") and a["definition"] for a in meta["attributes"])
    with open(WORDS_FILE, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 150
    assert len({r["word"] for r in rows}) == len(rows)
    header = list(rows[0].keys())
    assert header[:5] == ["word", "category", "split", "article", "variants"] and header[5:] == names
    for r in rows:
        assert r["split"] in ("train", "test"), r["word"]
        assert r["article"] in ("a", "an", "the", "-"), r["word"]
        assert all(r[a] in ("0", "1") for a in names), r["word"]   # no missing or odd values
    for a in names:   # every attribute splits the words (no dead column)
        assert 0 < sum(r[a] == "1" for r in rows) < len(rows), a


def test_split_is_disjoint_fixed_and_stratified(env):
    train, test = env.task_ids("train"), env.task_ids("test")
    assert not set(train) & set(test) and set(train) | set(test) == set(env.words)
    assert 0.15 <= len(test) / len(env.words) <= 0.25
    table = load_table()
    per_cat = defaultdict(Counter)
    for w in env.words:
        per_cat[table.categories[w]][table.splits[w]] += 1
    for cat, c in per_cat.items():   # every category of 3 or more words has test words and train words
        if c["train"] + c["test"] >= 3:
            assert c["test"] >= 1 and c["train"] >= 2, cat
    with pytest.raises(ValueError):
        env.task_ids("validation")


def test_attribute_vectors_almost_all_distinct():
    table = load_table()
    groups = defaultdict(list)
    for w in table.words:
        groups[tuple(table.values[w][a] for a in table.attributes)].append(w)
    shared = [ws for ws in groups.values() if len(ws) > 1]
    # At the time of writing no two words share a vector; allow a few after edits of the table.
    assert sum(len(ws) for ws in shared) <= 0.02 * len(table.words), shared


@pytest.mark.parametrize("word, attr, value", [
    ("cat", "mammal", True), ("cat", "pet", True), ("whale", "fish", False), ("whale", "mammal", True),
    ("whale", "legs", False), ("bat", "fly", True), ("penguin", "fly", False), ("penguin", "bird", True),
    ("spider", "insect", False), ("spider", "legs", True), ("frog", "reptile", False), ("shark", "fish", True),
    ("apple", "fruit", True), ("apple", "edible", True), ("apple", "living", False), ("potato", "underground", True),
    ("lemon", "sweet", False), ("hammer", "tool", True), ("hammer", "metal", True), ("car", "vehicle", True),
    ("bicycle", "engine", False), ("chair", "furniture", True), ("chair", "legs", True), ("sock", "clothing", True),
    ("television", "electronic", True), ("refrigerator", "kitchen", True), ("elephant", "person", True),
    ("elephant", "breadbox", True), ("mouse", "breadbox", False), ("coin", "tiny", True), ("rock", "man_made", False),
    ("sun", "hot", True), ("moon", "light", False), ("house", "building", True), ("bridge", "building", False),
    ("chicken", "eggs", True), ("dog", "eggs", False), ("octopus", "legs", False), ("cow", "farm", True),
    ("violin", "instrument", True), ("ice cream", "sweet", True), ("milk", "drink", True), ("rose", "flower", True),
])
def test_table_facts(word, attr, value):
    assert load_table().values[word][attr] is value


# ----------------------------------------------------------------------------------------------
# Answerer
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("question, attr, positive", [
    ("Is it alive?", "living", True), ("Is it a living thing?", "living", True),
    ("is it living", "living", True), ("Is it non-living?", "living", False),
    ("Is it inanimate?", "living", False), ("Can you eat it?", "edible", True),
    ("Is it edible?", "edible", True), ("Is it something people eat?", "edible", True),
    ("Is it an animal?", "animal", True), ("Is it a creature?", "animal", True),
    ("Does it have legs?", "legs", True), ("Is it larger than a microwave?", "breadbox", True),
    ("Is it bigger than a breadbox?", "breadbox", True), ("Is it smaller than a bread box?", "breadbox", False),
    ("Is it heavier than a person?", "person", True), ("Is it lighter than a human?", "person", False),
    ("Is it bigger than a car?", "car", True), ("Is it natural?", "man_made", False),
    ("Is it man-made?", "man_made", True), ("Is it found in a kitchen?", "kitchen", True),
    ("Is it found in the house?", "indoors", True), ("Does it live in the sea?", "water", True),
    ("Is it a boat?", "watercraft", True), ("Does it grow on trees?", "tree", True),
    ("Is it a citrus fruit?", "citrus", True), ("Is it a farm animal?", "farm", True),
    ("Is it made of metal?", "metal", True), ("Is it made of stone?", "stone", True),
    ("Does it use electricity?", "electronic", True), ("Is it an electronic device?", "electronic", True),
    ("Can it fly?", "fly", True), ("Is it a bug?", "insect", True), ("Question: Is it a fruit?", "fruit", True),
    ("IS IT A MAMMAL?", "mammal", True), ("Is it used at school?", "office", True),
    ("Is it commonly found in households?", "indoors", True), ("Is it 'edible'?", "edible", True),
])
def test_synonyms_map_to_attributes(question, attr, positive):
    p = parse_question(question)
    assert (p.kind, p.attr, p.positive) == ("attribute", attr, positive), p


def test_canonical_questions_and_guesses_parse_to_themselves(env):
    table = load_table()
    for a in table.attributes:
        p = parse_question(table.questions[a])
        assert (p.kind, p.attr, p.positive) == ("attribute", a, True), (a, p)
    for w in table.words:
        p = parse_question(guess_question(w))
        assert (p.kind, p.word) == ("guess", w), (w, p)
    assert guess_question("apple") == "Is it an apple?" and guess_question("rice") == "Is it rice?"
    assert guess_question("sun") == "Is it the sun?" and guess_question("cat") == "Is it a cat?"
    acts = env.admissible_actions()
    assert len(acts) == len(table.attributes) + len(table.words) == len(set(acts))


def test_answers_yes_no_for_the_secret(env):
    steps = play(env, "cat", ["Is it an animal?", "Can it fly?", "Is it smaller than a breadbox?",
                              "Is it a living thing?"])
    assert [s.observation for s in steps] == ["Yes", "No", "No", "Yes"]
    assert [s.info["attribute"] for s in steps] == ["animal", "fly", "breadbox", "living"]
    assert all(s.reward == 0.0 and not s.done and not s.info["invalid"] for s in steps)


@pytest.mark.parametrize("secret, guess", [
    ("cat", "Is it a cat?"), ("cat", "is it cats"), ("cat", "Is it a kitten?"), ("cat", "Is it kittens?"),
    ("cat", "<think>small pet</think><action>Is it a cat?</action>"), ("mouse", "Is it mice?"),
    ("knife", "Is it knives?"), ("shirt", "Is it a T-shirt?"), ("ice cream", "Is it ice-cream?"),
    ("rock", "Is it a stone?"), ("bus", "Is it a school bus?"), ("cat", "Is the secret word cat?"),
    ("cat", "cat?"), ("cat", "Is it 'cat'?"), ("cat", 'Is it "cats"?'),
])
def test_naming_the_secret_finishes(env, secret, guess):
    env.reset(secret)
    step = env.step(guess)
    assert step.observation == "Finished" and step.done and step.reward == 1.0
    assert step.info["success"] and step.info["progress"] == 1.0
    assert ("guess", secret) in env.state_key()


def test_wrong_guess_is_no_and_counts(env):
    env.reset("cat")
    step = env.step("Is it a dog?")
    assert step.observation == "No" and not step.done and step.reward == 0.0
    assert step.info["guess"] == "dog" and not step.info["invalid"] and env.turn == 1
    assert env.state_key() == frozenset({("guess", "dog")})
    assert env.step("Is it dogs?").observation == "No"   # another text: answered, no new fact
    assert env.state_key() == frozenset({("guess", "dog")}) and env.turn == 2


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("   ", "empty"), ("cat", "not a question"), ("It is an animal", "not a question"),
    ("What is it?", "not a yes/no question"), ("How big is it?", "not a yes/no question"),
    ("Is it red? Is it big?", "more than one question"), ("Is it an animal and does it fly?", "more than one question"),
    ("Is it an animal? I think so.", "not a single question"), ("Is it not alive?", "negated question"),
    ("Isn't it an animal?", "negated question"),
    ("Is it an animal or a plant?", "several properties"), ("Is it a mammal that can fly?", "several properties"),
    ("Is it a wild animal?", "unsupported property"), ("Is it bigger than a cat?", "unsupported property"),
    ("Is it happy?", "nothing understood"), ("Est-ce un chat ?", "nothing understood"),
    ("这是动物吗？", "nothing understood"), ("Is it " + "very " * 100 + "big?", "too long"),
])
def test_invalid_forms(env, text, reason):
    assert parse_question(text).reason == reason
    env.reset("cat")
    step = env.step(text)
    assert step.observation == "Invalid" and step.info["invalid"] and not step.done
    assert step.reward == 0.0 and env.turn == 1 and env.state_key() == frozenset()


def test_huge_and_odd_inputs_are_invalid_and_use_a_turn(env):
    env.reset("cat")
    for i, text in enumerate(["x" * 100_000, "Is it a cat?" * 1000, "\x00\u202e", None, 42], 1):
        step = env.step(text)
        assert step.observation == "Invalid" and step.info["invalid"] and env.turn == i


def test_repeated_uses_normalised_text(env):
    env.reset("cat")
    assert env.step("Is it an animal?").observation == "Yes"
    step = env.step("  is it an ANIMAL ")
    assert step.observation == "Repeated" and step.info["repeated"] and not step.info["invalid"]
    assert env.turn == 2
    # Same attribute in other words is answered again, and adds no fact.
    assert env.step("Is it a creature?").observation == "Yes"
    assert env.state_key() == frozenset({("animal", True)})
    # A repeated wrong guess is Repeated; a repeated invalid text stays Invalid.
    env.step("Is it a dog?")
    assert env.step("is it a dog").observation == "Repeated"
    env.step("What is it?")
    assert env.step("What is it?").observation == "Invalid"
    assert normalize_question("Q: Is it a DOG?!") == "is it a dog"


def test_game_ends_after_twenty_questions(env):
    env.reset("cat")
    for i in range(20):
        step = env.step("Is it happy?" if i % 2 else "Is it an animal?")
    assert step.done and step.info.get("truncated") and step.reward == 0.0 and not step.info["success"]
    after = env.step("Is it a cat?")
    assert after.done and after.reward == 0.0 and not after.info["success"]


# ----------------------------------------------------------------------------------------------
# State key and progress
# ----------------------------------------------------------------------------------------------
def test_state_key_is_order_and_wording_invariant():
    a, b = envs.make("twenty_questions"), envs.make("twenty_questions")
    play(a, "cat", ["Is it an animal?", "Is it bigger than a breadbox?", "Is it a dog?", "Can it fly?"])
    play(b, "cat", ["Can it fly?", "Is it a dog?", "Is it smaller than a breadbox?", "Is it a creature?",
                    "Is it happy?"])
    assert a.state_key() == b.state_key() == frozenset(
        {("animal", True), ("breadbox", True), ("fly", False), ("guess", "dog")})
    hash(a.state_key())
    play(b, "cat", ["Can it fly?"])
    assert b.state_key() != a.state_key()
    play(b, "dog", [])
    assert b.state_key() == frozenset()


def test_progress(env):
    n_words = len(env.words)
    env.reset("cat")
    step = env.step("Is it happy?")
    assert step.info["progress"] == 0.0
    step = env.step("Is it a mammal?")
    n = sum(load_table().values[w]["mammal"] for w in env.words)   # 27 mammals
    assert step.info["progress"] == pytest.approx(1 - math.log(n) / math.log(n_words))
    prev = step.info["progress"]
    step = env.step("Is it kept as a pet?")
    assert step.info["progress"] > prev
    assert env.step("Is it a cat?").info["progress"] == 1.0


# ----------------------------------------------------------------------------------------------
# Expert and random baselines
# ----------------------------------------------------------------------------------------------
def run_expert(env, word):
    env.reset(word)
    step = None
    while not env.done:
        step = env.step(env.expert_action())
    return step.info["success"], env.turn


def test_expert_wins_test_words(env):
    results = [run_expert(env, w) for w in env.task_ids("test")]
    wins = sum(s for s, _ in results)
    assert wins >= 0.9 * len(results)
    assert np.mean([t for _, t in results]) < 12   # about log2(237) questions and a guess


def test_expert_is_deterministic_and_canonical(env):
    canonical = set(env.admissible_actions())

    def expert_questions(word):
        env.reset(word)
        out = []
        while not env.done:
            a = env.expert_action()
            assert a in canonical
            out.append(a)
            env.step(a)
        return out

    first = expert_questions("violin")
    assert first == expert_questions("violin") and first[-1] == "Is it a violin?"
    assert expert_questions("cat")[0] == first[0]   # the first question does not depend on the secret


def test_expert_continues_from_any_state(env):
    env.reset("guitar")
    for q in ["Is it a dog?", "Is it happy?", "Is it made of wood?", "Is it a tree?"]:
        env.step(q)
    while not env.done:
        step = env.step(env.expert_action())
    assert step.info["success"]


def test_uniform_random_policy_rarely_wins(env):
    total = 2 * len(env.task_ids("test"))
    wins, _ = random_policy_wins(env, total, actions=env.admissible_actions())
    # Expected about 1 - (1 - 1/332)^20 = 5.9% (one of 332 actions names the secret each turn).
    assert wins / total < 0.10


def test_corrupt_action_is_admissible(env):
    env.reset("cat")
    acts = set(env.admissible_actions())
    for rng in (random.Random(1), np.random.default_rng(1)):
        got = [env.corrupt_action(rng) for _ in range(50)]
        assert all(isinstance(a, str) and a in acts for a in got)
        assert any(a.startswith("Is it a") and parse_question(a).kind == "guess" for a in got)
        assert any(parse_question(a).kind == "attribute" for a in got)


# ----------------------------------------------------------------------------------------------
# Prompt
# ----------------------------------------------------------------------------------------------
def test_several_words_named_are_a_guess_of_each():
    """App. B.1 of the ΔBelief-RL paper counts a question that includes the secret as finished: naming
    the secret among other words wins; naming several wrong words is No, each recorded as guessed."""
    env = envs.make("twenty_questions")
    assert parse_question("Is it a cat or a dog?") == Parsed("guess", word="dog", words=("dog", "cat"))
    env.reset("cat")
    step = env.step("Is it a cat or a dog?")
    assert step.observation == "Finished" and step.done and step.info["success"] and not step.info["invalid"]
    assert step.info["guess"] == "cat" and env.turn == 1
    env.reset("horse")
    step = env.step("Is it a dog, a cat or a rabbit?")
    assert step.observation == "No" and not step.done and not step.info["invalid"]
    assert env.state_key() == frozenset({("guess", "dog"), ("guess", "cat"), ("guess", "rabbit")})
    assert not {"dog", "cat", "rabbit"} & set(env.candidates()) and "horse" in env.candidates()
    assert env.step("Is it a cat or a dog?").observation == "No"  # another text: answered again


def test_system_prompt_and_default_prompt_never_list_the_secrets():
    """The paper (§4) keeps the set of possible secrets unknown to the questioner: the default env
    shows no candidate list, however few are left (the tiny recipe passes show_candidates=5)."""
    env = envs.make("twenty_questions")
    play(env, "cat", ["Is it an animal?", "Is it a mammal?", "Is it kept as a pet?", "Does it bark?"])
    assert len(env.candidates()) <= 5 and "Possible" not in env.messages()[1]["content"]
    system = env.messages()[0]["content"]
    assert not any(f" {w} " in system or f" {w}," in system or f" {w}?" in system
                   for w in ("cat", "dog", "rabbit", "hamster", "apple", "hammer"))


def test_messages_list_all_questions_and_few_candidates():
    env = envs.make("twenty_questions", show_candidates=5)
    env.reset("cat")
    user = env.messages()[1]["content"]
    assert "Twenty Questions" in user and "No questions asked yet." in user and "Question 1 of 20:" in user
    for q in ["Is it an animal?", "Is it a mammal?", "Is it kept as a pet?", "Does it bark?", "Is it happy?"]:
        env.step(q)
    user = env.messages()[1]["content"]
    assert "1. Q: Is it an animal? A: Yes" in user and "4. Q: Does it bark? A: No" in user
    assert "5. Q: Is it happy? A: Invalid" in user and "Question 6 of 20:" in user
    # pets that do not bark: cat, rabbit, hamster (parrot and goldfish are not mammals)
    assert "Possible words: cat, rabbit, hamster." in user
    assert env.target == "cat"
    short = envs.make("twenty_questions", history=2, show_candidates=0)
    play(short, "cat", ["Is it an animal?", "Is it a mammal?", "Is it kept as a pet?", "Does it bark?"])
    user = short.messages()[1]["content"]
    assert "1. Q:" not in user and "3. Q: Is it kept as a pet? A: Yes" in user and "4. Q: Does it bark?" in user
    assert "Possible words" not in user and "2 earlier questions not shown" in user
    plain = envs.make("twenty_questions", instructions=False, numbered=False, show_candidates=5)
    play(plain, "cat", ["Is it an animal?", "Is it a mammal?", "Is it kept as a pet?", "Does it bark?", "Is it happy?"])
    assert plain.messages()[1]["content"] == (
        "Is it an animal? Yes\nIs it a mammal? Yes\nIs it kept as a pet? Yes\nDoes it bark? No\nIs it happy? Invalid\n"
        "Possible words: cat, rabbit, hamster.\nQuestion 6 of 20:")
    with pytest.raises(ValueError):
        envs.make("twenty_questions", show_candidates=-1)


def test_prompt_after_a_game_lost_at_the_limit_keeps_the_format():
    """The last belief of a lost game is elicited on this prompt: the counter stays at 20 of 20 and the
    candidate list is still shown, as in the turns that were played."""
    env = envs.make("twenty_questions", show_candidates=5)
    env.max_turns = 6
    play(env, "cat", ["Is it an animal?", "Is it a mammal?", "Is it kept as a pet?", "Does it bark?", "Is it happy?",
                      "Is it a rabbit?"])
    assert env.done
    user = env.messages()[1]["content"]
    assert user.endswith("Possible words: cat, hamster.\nQuestion 6 of 6:")
    assert "Question 7" not in user


def test_unknown_task_id_is_an_error(env):
    with pytest.raises(ValueError, match="unknown twenty_questions task id"):
        env.reset("unicorn")
    assert env.version
