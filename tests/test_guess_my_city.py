"""The guess_my_city env: city table, rule-based answerer (open, yes/no, refused and guessed questions),
expert and random baselines, state keys, progress and prompt rendering (the generic protocol checks
are in test_env_protocol.py).

Measured when written: the expert wins 32 of 32 test cities (and 129 of 129 train cities) in 3.3
questions on average (at most 7); a uniform random admissible policy wins 6.25% of 160 test episodes
(expected 1 - (1 - 1/353)^20 = 5.5%: one of 353 actions names the secret each turn).
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections import Counter, defaultdict

import numpy as np
import pytest

import envs
from conftest import random_policy_wins
from envs.guess_my_city import (ATTRIBUTES, CITIES_FILE, GOAL, NAMES_FILE, OPEN_QUESTIONS, REFUSAL,
                                GuessMyCityEnv, _find, _match_form, canonical_yesno, guess_question,
                                load_table, normalize_question, open_answer, parse_question)


@pytest.fixture
def env() -> GuessMyCityEnv:
    return envs.make("guess_my_city")


def play(env, city: str, questions: list[str]) -> list:
    env.reset(city)
    return [env.step(q) for q in questions]


# ----------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------
def test_table_shape_and_values():
    with open(CITIES_FILE, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 100
    assert list(rows[0].keys()) == ["city", "country", "continent", "coast", "capital", "population", "climate",
                                    "language", "hemisphere", "landmark", "dishes", "split", "variants"]
    assert len({r["city"] for r in rows}) == len(rows)
    names = json.loads(NAMES_FILE.read_text())
    for r in rows:
        assert all(r[k] for k in ["city", "country", "landmark", "dishes", "language"]), r["city"]
        assert r["continent"] in ("Africa", "Asia", "Europe", "North America", "Oceania", "South America")
        assert r["capital"] in ("0", "1") and r["hemisphere"] in ("N", "S") and r["split"] in ("train", "test")
        assert r["population"] in ("under_1m", "1m_5m", "5m_10m", "over_10m")
        assert r["climate"] in ("tropical", "arid", "mediterranean", "subtropical", "oceanic", "continental",
                                "highland")
        assert r["country"] in names["countries"] and r["language"] in names["languages"]
        assert r["coast"] == "inland" or r["coast"] in names["waters"]
    capitals = Counter(r["country"] for r in rows if r["capital"] == "1")
    assert max(capitals.values()) == 1   # at most one capital per country in the table
    for a in ATTRIBUTES:   # every attribute splits the cities
        assert len({r[a] for r in rows}) > 1, a


def test_split_is_disjoint_fixed_and_stratified(env):
    train, test = env.task_ids("train"), env.task_ids("test")
    assert not set(train) & set(test) and set(train) | set(test) == set(env.cities)
    assert 0.15 <= len(test) / len(env.cities) <= 0.25
    assert test[:4] == ["Berlin", "Milan", "Amsterdam", "Warsaw"] and len(test) == 32
    per = defaultdict(Counter)
    for c in env.cities:
        per[load_table().rows[c]["continent"]][load_table().splits[c]] += 1
    assert all(c["test"] >= 1 and c["train"] >= 2 for c in per.values()), per
    with pytest.raises(ValueError):
        env.task_ids("validation")


def test_cities_differ_in_some_attribute():
    # Cities that share every attribute would leave the expert nothing to ask but guesses.
    table = load_table()
    groups = defaultdict(list)
    for c in table.cities:
        groups[tuple(table.rows[c][a] for a in ATTRIBUTES)].append(c)
    assert all(len(g) == 1 for g in groups.values()), [g for g in groups.values() if len(g) > 1]


@pytest.mark.parametrize("city, attr, value", [
    ("Paris", "capital", "1"), ("Paris", "coast", "inland"), ("Sydney", "capital", "0"), ("Canberra", "capital", "1"),
    ("Tokyo", "coast", "Pacific Ocean"), ("Cairo", "climate", "arid"), ("Rio de Janeiro", "hemisphere", "S"),
    ("Barcelona", "coast", "Mediterranean Sea"), ("Mumbai", "language", "Marathi"), ("Istanbul", "capital", "0"),
    ("Mexico City", "climate", "highland"), ("Lagos", "population", "over_10m"),
    ("Reykjavik", "population", "under_1m"),
    ("Montreal", "language", "French"), ("Zurich", "language", "German"), ("Nairobi", "hemisphere", "S"),
    ("Baku", "coast", "Caspian Sea"), ("Moscow", "continent", "Europe"), ("Cape Town", "climate", "mediterranean"),
])
def test_table_facts(city, attr, value):
    assert load_table().rows[city][attr] == value


# ----------------------------------------------------------------------------------------------
# Answerer
# ----------------------------------------------------------------------------------------------
def test_canonical_questions_parse_to_themselves(env):
    for topic, q in OPEN_QUESTIONS.items():
        p = parse_question(q)
        assert (p.kind, p.topic) == ("open", topic), (q, p)
    for q, attr, vals in canonical_yesno():
        p = parse_question(q)
        assert (p.kind, p.attr, p.values) == ("yesno", attr, vals), (q, p)
    for c in env.cities:
        p = parse_question(guess_question(c))
        assert (p.kind, p.city) == ("guess", c), (c, p)
    acts = env.admissible_actions()
    assert len(acts) == len(set(acts)) == len(OPEN_QUESTIONS) + len(canonical_yesno()) + len(env.cities) == 353


@pytest.mark.parametrize("question, topic", [
    ("What continent is your city on?", "continent"), ("Where is your city located?", "continent"),
    ("In which part of the world is your city?", "continent"),
    ("What is the primary language spoken in your city?", "language"),
    ("What's the weather like in your city?", "climate"), ("How big is your city?", "population"),
    ("What is the population of your city?", "population"), ("Is your city on the coast or inland?", "coast"),
    ("Which ocean is your home city near?", "coast"), ("Is your city north or south of the equator?", "hemisphere"),
    ("What landmarks is your city known for?", "landmark"), ("What is your city famous for?", "landmark"),
    ("What kind of food is your city famous for?", "food"), ("Tell me about the cuisine of your city.", "food"),
])
def test_open_questions(question, topic):
    p = parse_question(question)
    assert (p.kind, p.topic) == ("open", topic), p


@pytest.mark.parametrize("question, attr, yes_values", [
    ("Is your city the capital of a country?", "capital", {"1"}),           # ARIA's listing
    ("Is the country you're thinking of located in Europe?", "continent", {"Europe"}),
    ("Is your city located in the country of Japan?", "country", {"Japan"}),
    ("Is your home city located near the coastline?", "coast", "coastal"),
    ("Is your city inland?", "coast", {"inland"}),
    ("Is your city on the Mediterranean coast?", "coast", {"Mediterranean Sea"}),
    ("Is the climate Mediterranean?", "climate", {"mediterranean"}),
    ("Is your city in the tropics?", "climate", {"tropical"}),
    ("Does your city have more than 5 million inhabitants?", "population", {"5m_10m", "over_10m"}),
    ("Does your city have fewer than 1 million people?", "population", {"under_1m"}),
    ("Is your city a megacity?", "population", {"over_10m"}),
    ("Is your city south of the equator?", "hemisphere", {"S"}),
    ("Do people speak Chinese in your city?", "language", {"Mandarin", "Cantonese"}),
    ("Is Farsi spoken there?", "language", {"Persian"}),
    ("Is your city in Korea?", "country", {"South Korea", "North Korea"}),
    ("Is your city in the U.S.?", "country", {"United States"}),
    ("Is your city in America?", "country", {"United States"}),
    ("Is your city in North America?", "continent", {"North America"}),
    ("Is it in Holland?", "country", {"Netherlands"}),
    ("Is your city on the Gulf of Mexico?", "coast", {"Gulf of Mexico"}),
    ("Is your city in Mexico?", "country", {"Mexico"}),
    ("<think>narrow it</think><action>Is your city in Asia?</action>", "continent", {"Asia"}),
])
def test_yes_no_questions(question, attr, yes_values):
    if yes_values == "coastal":
        yes_values = set(load_table().waters)
    p = parse_question(envs.extract_action(question))
    assert (p.kind, p.attr, set(p.values)) == ("yesno", attr, set(yes_values)), p


@pytest.mark.parametrize("text, city", [
    ("Is your city Tokyo?", "Tokyo"), ("Is your city Tokyo?.", "Tokyo"), ("Is the city Jakarta, Indonesia?", "Jakarta"),
    ("Tokyo", "Tokyo"), ("guess: São Paulo", "Sao Paulo"), ("My guess is Bombay, India", "Mumbai"),
    ("Is it Xi'an?", "Xi'an"), ("Is your city Xian?", "Xi'an"),
    ("Question: Is your city St. Petersburg?", "Saint Petersburg"),
    ("Is your city Mexico City?", "Mexico City"), ("Is your city in Washington D.C.?", "Washington"),
    ("Is your city's name Kiev?", "Kyiv"), ("I think it is Paris", "Paris"), ("new york?", "New York"),
])
def test_guesses(text, city):
    p = parse_question(text)
    assert (p.kind, p.city) == ("guess", city), p


@pytest.mark.parametrize("text", [
    "What country is your city in?", "Which city is it?", "What is the name of your city?", "Where are you from?",
    "Can you tell me the name of your country?", "What is your home city called?",
])
def test_naming_city_or_country_is_refused(env, text):
    assert parse_question(text).kind == "refuse"
    env.reset("Paris")
    step = env.step(text)
    assert step.observation == REFUSAL and step.info["refused"] and step.info["invalid"] and not step.done
    assert env.state_key() == frozenset() and env.turn == 1


@pytest.mark.parametrize("text, reason", [
    ("", "empty"), ("   ", "empty"), ("up", "not a question"), ("It is a nice city", "not a question"),
    ("Is it in Asia? Is it big?", "more than one question"),
    ("Is it in Asia and is it a capital?", "more than one question"),
    ("Which sea is your city on and what is its climate?", "more than one question"),
    ("Is your city in Asia? I think so.", "not a single question"), ("Is your city not in Asia?", "negated question"),
    ("Isn't your city a capital?", "negated question"), ("Is your city Tokyo or Osaka?", "several cities"),
    ("Is your city in Asia or Europe?", "several properties"),
    ("Is your city a capital in Asia?", "several properties"),
    ("Is your city on the east coast of the country?", "unsupported property"),
    ("Is your city a big city?", "unsupported property"),
    ("Is your city on a river?", "unsupported property"), ("Is your city in Southeast Asia?", "unsupported property"),
    ("Does your city have 3 million people?", "unsupported property"),
    ("What river runs through your city?", "unsupported property"),
    ("What is Tokyo famous for?", "open question about a named city"),
    ("What language do they speak in Japan?", "open question about a named country"),
    ("What is the climate and population of your city?", "several questions"),
    ("Is your city happy?", "nothing understood"),
    ("Est-ce une capitale ?", "nothing understood"), ("Is it " + "very " * 80 + "big?", "too long"),
])
def test_invalid_forms(env, text, reason):
    assert parse_question(text).reason == reason
    env.reset("Paris")
    step = env.step(text)
    assert step.observation == f"Invalid: {reason}." and step.info["invalid"] and not step.done
    assert step.reward == 0.0 and env.turn == 1 and env.state_key() == frozenset()


def test_open_answers_are_informative_sentences(env):
    steps = play(env, "Barcelona", list(OPEN_QUESTIONS.values()))
    assert [s.observation for s in steps] == [
        "Most people in my city speak Spanish.", "My city is in Europe.",
        "My city has a Mediterranean climate, with hot dry summers and mild wet winters.",
        "Between 1 and 5 million people live in my city.", "My city lies on the coast of the Mediterranean Sea.",
        "My city is north of the equator.", "My city is known for the Sagrada Familia basilica.",
        "My city is famous for paella and crema catalana."]
    assert [s.info["topic"] for s in steps] == list(OPEN_QUESTIONS)
    assert all(not s.done and not s.info["invalid"] and s.reward == 0.0 for s in steps)
    assert play(env, "Madrid", ["Which sea or ocean is your city on?"])[0].observation == \
        "My city lies inland, away from the sea."


def test_answers_never_name_the_city_or_its_country():
    # Read every answer with the answerer's own name matcher (longest phrase wins, so "North America"
    # is a continent, not the United States, and "East China Sea" a sea, not China).
    table = load_table()
    for city in table.cities:
        country = table.rows[city]["country"]
        for topic in OPEN_QUESTIONS:
            answer = open_answer(city, topic)
            assert answer.endswith(".") and answer.count(".") == 1, answer
            for kind, payload, matched in _find(table.yesno_patterns, _match_form(answer)):
                assert not (kind == "city" and payload[matched.replace(" ", "")] == city), (city, answer)
                assert not (kind == "country" and country in payload), (city, answer)


def test_yes_no_answers_and_guesses(env):
    steps = play(env, "Tokyo", ["Is your city in Asia?", "Is your city on the coast?", "Is your city a capital?",
                                "Does your city have over 10 million people?", "Is your city in China?",
                                "Do people in your city speak Japanese?", "Is your city on the Atlantic Ocean?"])
    assert [s.observation for s in steps] == ["Yes", "Yes", "Yes", "Yes", "No", "Yes", "No"]
    assert [s.info["attribute"] for s in steps] == ["continent", "coast", "capital", "population", "country",
                                                    "language", "coast"]
    step = env.step("Is your city Osaka?")
    assert step.observation == "No" and not step.done and step.info["guess"] == "Osaka" and env.turn == 8
    step = env.step("Is your city Tokyo, Japan?")
    assert step.observation == GOAL == "Goal reached" and step.done and step.reward == 1.0
    assert step.info["success"] and step.info["progress"] == 1.0 and ("guess", "Tokyo") in env.state_key()


def test_repeated_uses_normalised_text(env):
    env.reset("Paris")
    assert env.step("Is your city a capital?").observation == "Yes"
    step = env.step("  is your city a CAPITAL ")
    assert step.observation == "Repeated" and step.info["repeated"] and not step.info["invalid"] and env.turn == 2
    assert env.step("Is your city the capital of its country?").observation == "Yes"   # other words: answered
    assert env.state_key() == frozenset({("capital", ("1",))})
    env.step("Is your city Lyon?")
    assert env.step("is your city lyon").observation == "Repeated"
    env.step("What is the name of your city?")
    assert env.step("What is the name of your city?").observation == REFUSAL   # refusals are not Repeated
    assert normalize_question("Q: Is your city LYON?!") == "is your city lyon"


def test_game_ends_after_twenty_questions(env):
    env.reset("Paris")
    for i in range(20):
        step = env.step("Is your city happy?" if i % 2 else "Is your city in Europe?")
    assert step.done and step.info.get("truncated") and step.reward == 0.0 and not step.info["success"]
    after = env.step("Is your city Paris?")
    assert after.done and after.reward == 0.0 and not after.info["success"]


def test_huge_and_odd_inputs_are_invalid_and_use_a_turn(env):
    env.reset("Paris")
    for i, text in enumerate(["x" * 100_000, "Is your city Paris?" * 500, "\x00\u202e", "\ud800", None, 42], 1):
        step = env.step(text)
        assert step.info["invalid"] and step.observation.startswith("Invalid: ") and env.turn == i


# ----------------------------------------------------------------------------------------------
# State key and progress
# ----------------------------------------------------------------------------------------------
def test_state_key_is_order_and_wording_invariant():
    a, b = envs.make("guess_my_city"), envs.make("guess_my_city")
    play(a, "Paris", ["Which continent is your city in?", "Is your city a capital?", "Is your city Rome?",
                      "What food is your city known for?"])
    play(b, "Paris", ["What food is your city known for?", "Is your city Rome?", "Is the country located in Europe?",
                      "Is your city the capital of its country?", "Is your city happy?"])
    assert a.state_key() == b.state_key() == frozenset(
        {("continent", ("Europe",)), ("capital", ("1",)), ("guess", "Rome"), ("clue", "food")})
    hash(a.state_key())
    # "No" to each other continent leaves the same knowledge as the open answer.
    c = envs.make("guess_my_city")
    others = ["Asia", "Africa", "North America", "South America", "Oceania"]
    play(c, "Paris", ["Is your city in " + x + "?" for x in others])
    assert c.state_key() == frozenset({("continent", ("Europe",))})
    play(b, "Paris", [])
    assert b.state_key() == frozenset()


def test_progress(env):
    n_all = len(env.cities)   # 161
    env.reset("Paris")
    assert env.step("Is your city happy?").info["progress"] == 0.0
    step = env.step("Which continent is your city in?")
    n = sum(load_table().rows[c]["continent"] == "Europe" for c in env.cities)
    assert n == 40 and step.info["progress"] == pytest.approx(1 - math.log(40) / math.log(n_all))
    step = env.step("What is your city famous for?")   # a clue: no narrowing
    assert step.info["progress"] == pytest.approx(1 - math.log(40) / math.log(n_all))
    # European capitals that speak French: Paris and Brussels (Geneva, Lyon, Marseille are not capitals).
    env.step("Is your city a capital?")
    step = env.step("Do people in your city speak French?")
    assert env.candidates() == ["Paris", "Brussels"]
    assert step.info["progress"] == pytest.approx(1 - math.log(2) / math.log(n_all))
    assert env.step("Is your city Paris?").info["progress"] == 1.0


# ----------------------------------------------------------------------------------------------
# Expert and random baselines
# ----------------------------------------------------------------------------------------------
def run_expert(env, city):
    env.reset(city)
    step = None
    while not env.done:
        action = env.expert_action()
        step = env.step(action)
        assert not step.info["invalid"], action
    return step.info["success"], env.turn


def test_expert_wins_test_cities(env):
    results = [run_expert(env, c) for c in env.task_ids("test")]
    assert sum(s for s, _ in results) >= 0.9 * len(results)   # measured: 32 of 32
    assert np.mean([t for _, t in results]) < 5               # measured: 3.3 questions
    assert max(t for _, t in results) <= 10


def test_expert_is_deterministic_and_canonical(env):
    canonical = set(env.admissible_actions())

    def expert_questions(city):
        env.reset(city)
        out = []
        while not env.done:
            a = env.expert_action()
            assert a in canonical
            out.append(a)
            env.step(a)
        return out

    first = expert_questions("Chicago")
    assert first == expert_questions("Chicago") and first[-1] == "Is your city Chicago?"
    assert first[0] == "What language do people speak in your city?" == expert_questions("Tokyo")[0]


def test_expert_continues_from_any_state(env):
    env.reset("Kyoto")
    for q in ["Is your city Tokyo?", "Is your city happy?", "What is your city famous for?", "Is your city in Europe?"]:
        env.step(q)
    while not env.done:
        step = env.step(env.expert_action())
    assert step.info["success"]


def test_uniform_random_policy_rarely_wins(env):
    total = 5 * len(env.task_ids("test"))
    wins, _ = random_policy_wins(env, total, actions=env.admissible_actions())
    # Expected about 1 - (1 - 1/353)^20 = 5.5%; measured 10 of 160 = 6.25%.
    assert wins / total < 0.10


def test_corrupt_action_is_admissible(env):
    env.reset("Paris")
    acts = set(env.admissible_actions())
    for rng in (random.Random(1), np.random.default_rng(1)):
        got = [env.corrupt_action(rng) for _ in range(50)]
        assert all(isinstance(a, str) and a in acts for a in got)
        assert any(parse_question(a).kind == "guess" for a in got)
        assert any(parse_question(a).kind in ("open", "yesno") for a in got)


# ----------------------------------------------------------------------------------------------
# Prompt
# ----------------------------------------------------------------------------------------------
def test_messages_list_questions_history_and_few_candidates():
    env = envs.make("guess_my_city")
    env.reset("Paris")
    user = env.messages()[1]["content"]
    assert user.startswith("Guess My City") and "continent, language, climate" in user
    assert "Is your city <city>?" in user and "No questions asked yet." in user and "Question 1 of 20:" in user
    play(env, "Paris", ["Which continent is your city in?", "Is your city a capital?", "Is your city happy?",
                        "Do people in your city speak French?"])
    user = env.messages()[1]["content"]
    assert "1. Q: Which continent is your city in? A: My city is in Europe." in user
    assert "3. Q: Is your city happy? A: Invalid: nothing understood." in user
    assert "Possible cities: Paris, Brussels." in user and "Question 5 of 20:" in user
    assert env.target == "Paris"
    short = envs.make("guess_my_city", history=2, show_candidates=0, instructions=False)
    play(short, "Paris", ["Which continent is your city in?", "Is your city a capital?", "Is your city happy?",
                          "Do people in your city speak French?"])
    user = short.messages()[1]["content"]
    assert "1. Q:" not in user and "3. Q: Is your city happy?" in user and "4. Q: Do people" in user
    assert "Possible cities" not in user and "2 earlier questions not shown" in user
    assert user.startswith("(2 earlier questions not shown)") and "Guess My City" in short.system_prompt
    plain = envs.make("guess_my_city", history=2, instructions=False, numbered=False)
    play(plain, "Paris", ["Which continent is your city in?", "Is your city a capital?", "Is your city happy?",
                            "Do people in your city speak French?"])
    assert plain.messages()[1]["content"].splitlines()[1:3] == [
        "Is your city happy? Invalid: nothing understood.", "Do people in your city speak French? Yes"]
    with pytest.raises(ValueError):
        envs.make("guess_my_city", show_candidates=-1)


def test_unknown_task_id_is_an_error(env):
    with pytest.raises(ValueError, match="unknown guess_my_city task id"):
        env.reset("Atlantis")
    assert re.fullmatch(r"2\.[0-9a-f]{8}", env.version)
