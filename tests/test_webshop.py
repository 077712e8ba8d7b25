"""WebShop-lite: catalogue and instructions, the reward worked out by hand, pages and clicks, state keys,
progress, the expert and a random baseline (the generic protocol checks are in test_env_protocol.py)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import envs
from conftest import random_policy_wins
from envs.webshop import (CATALOGUE_FILE, POPULARITY_WEIGHT, TASKS_FILE, WebShopEnv, can_satisfy, load_catalogue,
                          load_tasks, parse_action, reward)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def env() -> WebShopEnv:
    return envs.make("webshop")


def run_expert(env, task_id: str):
    env.reset(task_id)
    step = None
    while not env.done:
        step = env.step(env.expert_action())
        assert step.info["invalid"] is False
    return step


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def test_catalogue_shape():
    cat = load_catalogue()
    products = cat["products"]
    assert len(products) >= 300
    assert len({p["id"] for p in products}) == len(products)
    assert len({p["category"] for p in products}) >= 6
    assert len({p["type"] for p in products}) >= 24
    for p in products:
        spec = cat["categories"][p["category"]]
        assert p["type"] in spec["types"]
        assert len(p["attributes"]) == 3
        # one attribute of each group; the title is the attributes then the type
        assert all(a in g for a, g in zip(reversed(p["attributes"]), spec["attribute_groups"]))
        assert p["title"] == " ".join(p["attributes"] + [p["type"]])
        assert isinstance(p["price"], int) and p["price"] > 0
        assert 0.0 <= p["popularity"] <= 1.0
        colors, sizes = p["options"]["color"], p["options"]["size"]
        assert len(colors) >= 2 and len(sizes) >= 2
        assert set(colors) <= set(spec["colors"]) and set(sizes) <= set(spec["sizes"])
        assert not set(colors) & set(sizes)   # a click on an option value names one group


def test_instructions_are_built_from_their_target():
    tasks, by_id = load_tasks(), load_catalogue()["by_id"]
    assert len(tasks["test"]) == 200 and len(tasks["train"]) >= 1000
    texts = [t["instruction"] for t in tasks["train"] + tasks["test"]]
    assert len(set(texts)) == len(texts)   # no instruction twice, so none in both splits
    for t in tasks["train"] + tasks["test"]:
        p = by_id[t["target"]]
        assert can_satisfy(p, t)
        assert t["type"] == p["type"] and t["category"] == p["category"]
        assert 1 <= len(t["attributes"]) <= 3 and 1 <= len(t["options"]) <= 2
        assert p["price"] < t["price_upper"] <= p["price"] + 10 and t["price_upper"] % 10 == 0
        assert t["query"] in t["instruction"] and t["instruction"].endswith(f"under ${t['price_upper']}")
        if "size" in t["options"]:
            assert f"size {t['options']['size']}," in t["instruction"]


def test_generator_rewrites_the_same_files(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "envs/data/webshop_generate.py"), str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "webshop_catalogue.json").read_bytes() == CATALOGUE_FILE.read_bytes()
    assert (tmp_path / "webshop_tasks.json").read_bytes() == TASKS_FILE.read_bytes()


# ----------------------------------------------------------------------------------------------
# Reward by hand
# ----------------------------------------------------------------------------------------------
GOAL = dict(category="tops", type="t-shirt", attributes=["cotton", "slim fit"],
            options={"color": "red", "size": "m"}, price_upper=30)


def product(**kw):
    base = dict(category="tops", type="t-shirt", attributes=["organic", "slim fit", "cotton"], price=24,
                options={"color": ["red", "blue"], "size": ["s", "m"]})
    return {**base, **kw}


@pytest.mark.parametrize("prod,chosen,expected", [
    # type 1 * (2 attributes + 2 options + price) / (2 + 2 + 1) = 5/5
    (product(), {"color": "red", "size": "m"}, 1.0),
    # no size chosen: 1 * (2 + 1 + 1) / 5 = 0.8
    (product(), {"color": "red"}, 0.8),
    # one attribute missing, price over the bound: 1 * (1 + 2 + 0) / 5 = 0.6
    (product(attributes=["organic", "relaxed fit", "cotton"], price=31), {"color": "red", "size": "m"}, 0.6),
    # price equal to the bound counts (price <= bound): 1 * (2 + 0 + 1) / 5 = 0.6
    (product(price=30), {"color": "blue", "size": "s"}, 0.6),
    # another type of the same category: 0.5 * (2 + 1 + 0) / 5 = 0.3
    (product(type="hoodie", price=35), {"color": "red", "size": "s"}, 0.3),
    # another category: r_type 0, whatever matches
    (product(category="bedding", type="pillow"), {"color": "red", "size": "m"}, 0.0),
])
def test_reward_by_hand(prod, chosen, expected):
    assert reward(prod, chosen, GOAL) == pytest.approx(expected)


def test_reward_with_one_option_goal():
    goal = {**GOAL, "attributes": ["cotton"], "options": {"size": "m"}}
    # (1 attribute + 0 options + 1 price) / (1 + 1 + 1) = 2/3
    assert reward(product(), {"color": "red", "size": "s"}, goal) == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------
# Pages, clicks, state keys and progress
# ----------------------------------------------------------------------------------------------
def test_expert_walkthrough_of_a_test_task(env):
    # test-1: "i want to buy a blue organic wool sweater, size l, under $70"; target p184 ($66).
    obs = env.reset("test-1")
    assert obs == "Search page. Type search[words]."
    assert env.state_key() == ("search",) and env.admissible_actions() == ["search[blue organic wool sweater]"]
    s = env.step("search[blue organic wool sweater]")
    assert s.observation.split("\n") == [
        'Results page 1/5 for "blue organic wool sweater":',
        "[1] organic slim fit wool sweater $66",
        "[2] organic striped linen duvet cover $87",
        "[3] organic plain microfiber sheet set $43",
        "[next >] [back to search]"]
    assert env.state_key() == ("results", "blue organic wool sweater", 1)
    assert s.info["progress"] == 0.0 and s.reward == 0.0
    assert env.expert_action() == "click[1]"
    s = env.step("click[1]")
    assert env.item == "p184"
    assert s.observation.split("\n") == [
        "Item: organic slim fit wool sweater $66",
        "color: [white] [red] [blue] [pink]",
        "size: [m] [l] [xl]",
        "[< prev] [back to search] [buy now]"]
    # progress = the reward of buying now: (2 attributes + 0 options + price) / 5
    assert s.info["progress"] == pytest.approx(3 / 5)
    s = env.step("click[blue]")
    assert "chosen: blue" in s.observation and s.info["progress"] == pytest.approx(4 / 5)
    assert env.state_key() == ("item", "blue organic wool sweater", 1, "p184", (("color", "blue"),))
    s = env.step("click[l]")
    assert env.expert_action() == "click[buy now]"
    s = env.step("click[buy now]")
    assert s.done and s.reward == 1.0 and s.info["success"] is True and s.info["progress"] == 1.0
    assert s.observation == "You bought organic slim fit wool sweater $66 (blue, l). Reward 1.00."
    assert env.state_key() == ("bought", "p184", (("color", "blue"), ("size", "l")))
    assert env.turn == 5


def test_partial_and_wrong_purchases(env):
    env.reset("test-1")
    for a in ["search[blue organic wool sweater]", "click[1]", "click[blue]", "click[buy now]"]:
        s = env.step(a)
    assert s.done and s.reward == pytest.approx(0.8) and s.info["success"] is False  # (2 + 1 + 1) / 5
    assert s.info["reward_parts"] == dict(r_type=1.0, attributes=2, options=1, price=True, product="p184",
                                          target="p184")
    env.reset("test-1")
    for a in ["search[blue organic wool sweater]", "click[2]", "click[blue]", "click[buy now]"]:
        s = env.step(a)
    assert s.done and s.reward == 0.0  # a duvet cover: another category


def test_choosing_again_replaces_the_option(env):
    env.reset("test-1")
    for a in ["search[blue organic wool sweater]", "click[1]", "click[red]", "click[m]", "click[blue]"]:
        env.step(a)
    assert env.chosen == {"color": "blue", "size": "m"}
    assert "chosen: blue, m" in env.render()


def test_paging_and_going_back(env):
    env.reset("test-15")  # target p253 is the 7th result: page 3, first line
    env.step("search[black zip up puffer jacket]")
    assert env.expert_action() == "click[next >]"
    s = env.step("click[next >]")
    assert s.observation.startswith('Results page 2/5 for "black zip up puffer jacket":')
    assert "[< prev] [next >] [back to search]" in s.observation
    assert env.state_key() == ("results", "black zip up puffer jacket", 2)
    env.step("click[next >]")
    assert env.expert_action() == "click[1]"
    env.step("click[1]")
    assert env.item == "p253"
    env.step("click[black]")
    s = env.step("click[< prev]")  # back to the results page it came from; choices are dropped
    assert env.state_key() == ("results", "black zip up puffer jacket", 3) and env.chosen == {}
    env.step("click[prev]")
    assert env.state_key() == ("results", "black zip up puffer jacket", 2)
    for _ in range(3):
        env.step("click[next >]")
    assert env.state_key() == ("results", "black zip up puffer jacket", 5)
    s = env.step("click[next >]")  # no next page on the last page
    assert s.info["invalid"] is True and env.state_key() == ("results", "black zip up puffer jacket", 5)
    env.step("click[back to search]")
    assert env.state_key() == ("search",)


def test_same_page_by_two_routes_has_the_same_key(env):
    env.reset("test-15")
    env.step("search[black zip up puffer jacket]")
    env.step("click[next >]")
    direct = env.state_key()
    env.reset("test-15")
    for a in ["search[puffer]", "click[back to search]", "search[Black  ZIP up puffer jacket]", "click[next >]",
              "click[next >]", "click[< prev]"]:
        env.step(a)
    assert env.state_key() == direct


def test_search_ranking_matches_an_independent_count(env):
    products = load_catalogue()["products"]

    def ranking(query: str) -> list[str]:
        words = set(query.split())
        scored = []
        for i, p in enumerate(products):
            text = set(" ".join([p["title"], p["type"], p["category"]] + p["options"]["color"]).split())
            n = len(words & text)
            if n:
                scored.append((-(n + POPULARITY_WEIGHT * p["popularity"]), i, p["id"]))
        return [pid for _, _, pid in sorted(scored)][:15]

    env.reset("test-0")
    for query in ["red cotton t-shirt", "waterproof leather boots", "queen", "insulated stainless steel tumbler"]:
        env.step(f"search[{query}]")
        assert env.results == ranking(query), query
    env.step("search[zzz qqq]")
    assert env.results == [] and env.render() == 'No results for "zzz qqq".\n[back to search]'


def test_invalid_actions_keep_the_page(env):
    env.reset("test-1")
    s = env.step("click[1]")  # nothing to click on the search page
    assert s.info["invalid"] and not s.done and env.state_key() == ("search",)
    assert s.observation.endswith("Search page. Type search[words].")
    env.step("search[blue organic wool sweater]")
    key = env.state_key()
    for text in ["buy the sweater", "click[4]", "click[0]", "click[p184]", "click[blue]", "search[]", "search[  ,, ]",
                 "click p184", "search[a] click[b]", "click[[p184]]", "", "😀"]:
        s = env.step(text)
        assert s.info["invalid"] is True and s.done is False and s.reward == 0.0, text
        assert env.state_key() == key, text
        assert s.observation.startswith("Invalid action:")
    assert env.turn == 14  # 1 invalid click, 1 search, 12 invalid texts


def test_action_forms():
    assert parse_action("search[Red T-Shirt]") == ("search", "Red T-Shirt")
    assert parse_action("  CLICK [ Buy  Now ] ") == ("click", "Buy Now")
    assert parse_action("click[next >].") == ("click", "next >")
    for bad in ["click", "click[]x", "press[p001]", "search(red)", "click[a]]", None, "x" * 500]:
        assert parse_action(bad) is None, bad
    assert parse_action("click[]") == ("click", "")  # parsed, then invalid: nothing is named ""
    env = envs.make("webshop")
    env.reset("test-1")
    assert env.step("<think>search first</think><action>search[blue organic wool sweater]</action>").info[
        "invalid"] is False
    assert env.step("click[ 1 ]").info["invalid"] is False and env.item == "p184"
    assert env.step("click[BLUE]").info["invalid"] is False
    assert env.step("click[Buy]").done is True  # alias of [buy now]


def test_products_clicked_by_id():
    env = envs.make("webshop", click_items="id")
    env.reset("test-1")
    s = env.step("search[blue organic wool sweater]")
    assert s.observation.split("\n")[1:4] == ["[p184] organic slim fit wool sweater $66",
                                              "[p274] organic striped linen duvet cover $87",
                                              "[p343] organic plain microfiber sheet set $43"]
    assert env.expert_action() == "click[p184]"
    assert env.step("click[1]").info["invalid"] is True
    s = env.step("click[P184]")
    assert s.info["invalid"] is False and s.observation.startswith("Item: [p184] organic slim fit wool sweater $66")
    assert "[p042]" in env.system_prompt and env.version != envs.make("webshop").version
    wins = sum(run_expert(env, t).info["success"] for t in env.task_ids("test")[:50])
    assert wins == 50


def test_search_from_an_item_page(env):
    env.reset("test-1")
    env.step("search[sweater]")
    env.step("click[1]")
    s = env.step("search[blue organic wool sweater]")
    assert s.info["invalid"] is False and env.state_key() == ("results", "blue organic wool sweater", 1)


def test_truncation_after_15_steps(env):
    env.reset("test-1")
    steps = [env.step("search[sweater]") for _ in range(15)]
    assert [s.done for s in steps] == [False] * 14 + [True]
    assert steps[-1].info.get("truncated") is True and steps[-1].reward == 0.0
    assert not steps[-1].info["success"]


def test_prompt_is_compact_and_complete(env):
    env.reset("test-15")
    for a in ["search[black zip up puffer jacket]", "click[zzz]", "click[next >]", "click[next >]",
              "click[1]"]:
        env.step(a)
    user = env.messages()[1]["content"]
    lines = user.split("\n")
    assert lines[1] == "Instruction: i am looking for a black zip up puffer jacket, size xl, under $130"
    # the last 4 actions, the invalid one marked
    assert lines[2] == "Past actions: ... click[zzz] (invalid) | click[next >] | click[next >] | click[1]"
    assert "\n".join(lines[3:-1]) == env.render()
    assert lines[-1] == "Step 6 of 15."
    assert env.system_prompt.endswith(envs.INSTRUCT_FORMAT)
    longest = 0
    for tid in env.task_ids("test")[:50]:
        env.reset(tid)
        while not env.done:
            longest = max(longest, len(env.messages()[1]["content"]))
            env.step(env.expert_action())
    assert longest < 700  # about 200 tokens of the default tiny tokenizer


def test_without_the_task_line_the_instruction_stays():
    env = envs.make("webshop", instructions=False)
    env.reset("test-1")
    user = env.messages()[1]["content"]
    assert user.split("\n") == ["Instruction: i want to buy a blue organic wool sweater, size l, under $70",
                                "Search page. Type search[words].", "Step 1 of 15."]
    assert env.version != envs.make("webshop").version


def test_bad_options_and_task_ids():
    for kw in [dict(results_per_page=0), dict(max_results=2, results_per_page=3), dict(max_steps=3),
               dict(history=-1), dict(click_items="title")]:
        with pytest.raises(ValueError):
            envs.make("webshop", **kw)
    env = envs.make("webshop")
    for bad in ["test-200", "train-99999", "test--1", "bogus", "test-x"]:
        with pytest.raises(ValueError):
            env.reset(bad)
    assert envs.make("webshop", results_per_page=5).version != env.version


# ----------------------------------------------------------------------------------------------
# Expert and random baseline
# ----------------------------------------------------------------------------------------------
def test_expert_solves_the_test_split(env):
    wins, lengths = 0, []
    for tid in env.task_ids("test"):
        s = run_expert(env, tid)
        wins += s.info["success"]
        lengths.append(env.turn)
    assert wins / len(lengths) >= 0.9  # measured 1.0 (200 of 200)
    assert max(lengths) <= env.max_turns and 4 <= np.mean(lengths) <= 7  # measured mean 4.9


def test_expert_recovers_after_noise(env):
    rng = random.Random(3)
    wins = 0
    tasks = env.task_ids("train")[:100]
    for tid in tasks:
        env.reset(tid)
        for _ in range(3):
            env.step(env.corrupt_action(rng))
        s = None
        while not env.done:
            s = env.step(env.expert_action())
        wins += bool(s and s.info["success"])
    assert wins >= 85  # a noisy "buy now" ends some episodes early; measured 96 of 100


def test_random_policy_rarely_succeeds(env):
    wins, _ = random_policy_wins(env, 300)
    assert wins / 300 < 0.05  # measured 0.007 over 1000 episodes


def test_corrupt_action_is_valid(env):
    env.reset("test-1")
    got = {env.corrupt_action(np.random.default_rng(i)) for i in range(30)}
    assert got == {"search[blue organic wool sweater]", "search[sweater]"}
    env.step("search[blue organic wool sweater]")
    for i in range(30):
        a = env.corrupt_action(random.Random(i))
        probe = envs.make("webshop")
        probe.reset("test-1")
        probe.step("search[blue organic wool sweater]")
        assert probe.step(a).info["invalid"] is False, a
