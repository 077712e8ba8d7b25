"""ALFWorld-lite: hand-written rooms walked through step by step (feedback, admissible actions, rewards
and progress worked out by hand), the generated splits, the expert, a random baseline, and the micro
tiny build. The protocol checks shared by every env (hostile strings, determinism, ...) are in
tests/test_env_protocol.py."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import envs
from conftest import random_policy_wins
from envs.alfworld import INVALID_FEEDBACK, TASK_TYPES, ALFWorldEnv, rtype, task_signature, world

REPO = Path(__file__).resolve().parent.parent


def task_id(**task) -> str:
    return "json:" + json.dumps(task)


# A kitchen: the apple is in the closed fridge; the knife on the countertop; the mug in the cabinet.
HEAT = task_id(task_type="heat", scene="kitchen", obj="apple", goal="countertop",
               receptacles=["cabinet 1", "countertop 1", "fridge 1", "microwave 1", "sinkbasin 1"],
               placements={"apple 1": "fridge 1", "knife 1": "countertop 1", "mug 1": "cabinet 1"})
# A bedroom: the book on the bed, the desk lamp on the side table.
LOOK = task_id(task_type="look", scene="bedroom", obj="book", receptacles=["bed 1", "drawer 1", "sidetable 1"],
               placements={"book 1": "bed 1"}, lamp="desklamp 1", lamp_at="sidetable 1")
# A living room: two remote controls, to be put in the (closed) drawer.
TWO = task_id(task_type="two", scene="livingroom", obj="remotecontrol", goal="drawer",
              receptacles=["coffeetable 1", "drawer 1", "sofa 1"],
              placements={"remotecontrol 1": "sofa 1", "remotecontrol 2": "coffeetable 1"})


def run_expert(env) -> list:
    steps = []
    while not env.done:
        action = env.expert_action()
        step = env.step(action)
        assert step.info["invalid"] is False, action
        steps.append((action, step))
    return steps


# ----------------------------------------------------------------------------------------------
# Hand-written rooms
# ----------------------------------------------------------------------------------------------
def test_heat_task_walkthrough_by_hand():
    env = ALFWorldEnv()
    obs = env.reset(HEAT)
    assert env.task["text"] == "put a hot apple on countertop."  # countertops take "on"
    assert obs == ("You are in the middle of the kitchen, holding nothing.\n"
                   "Not looked in: cabinet 1, countertop 1, fridge 1, microwave 1, sinkbasin 1.\n"
                   "Actions: go to cabinet 1, go to countertop 1, go to fridge 1, go to microwave 1, "
                   "go to sinkbasin 1, inventory")
    # The apple may start on a countertop, dining table, fridge, garbage can or sink basin, in that order
    # of likelihood: the expert looks on countertop 1 (a knife), then in the fridge (closed: open it).
    steps = run_expert(env)
    actions = [a for a, _ in steps]
    assert actions == ["go to countertop 1", "go to fridge 1", "open fridge 1", "take apple 1 from fridge 1",
                       "go to microwave 1", "heat apple 1 with microwave 1", "go to countertop 1",
                       "put apple 1 in/on countertop 1"]
    feedback = [s.observation.split("\n")[0] for _, s in steps]
    assert feedback == [
        "You arrive at countertop 1. On the countertop 1, you see a knife 1.",
        "You arrive at fridge 1. The fridge 1 is closed.",
        "You open the fridge 1. The fridge 1 is open. In it, you see a apple 1.",
        "You pick up the apple 1 from the fridge 1.",
        "You arrive at microwave 1. The microwave 1 is closed.",
        "You heat the apple 1 using the microwave 1.",
        "You arrive at countertop 1. On the countertop 1, you see a knife 1.",
        "You put the apple 1 on the countertop 1.",
    ]
    # Subgoals of the heat recipe: hold an apple (1/3), it is hot (2/3), it is on a countertop (3/3).
    assert [s.info["progress"] for _, s in steps] == pytest.approx([0, 0, 0, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1])
    assert [s.reward for _, s in steps] == [0.0] * 7 + [10.0]
    assert steps[-1][1].done and steps[-1][1].info["success"] is True
    assert env.state_key() == ("at=countertop 1|hold=-|apple 1@countertop 1,knife 1@countertop 1,mug 1@cabinet 1"
                               "|open=fridge 1|state=apple 1:hot|on=")


def test_status_block_and_admissible_actions_at_the_microwave():
    env = ALFWorldEnv()
    env.reset(HEAT)
    for a in ["go to countertop 1", "go to fridge 1", "open fridge 1", "take apple 1 from fridge 1",
              "go to microwave 1", "heat apple 1 with microwave 1"]:
        env.step(a)
    # Closed microwave: no put (contents hidden), but heating works on a held object; the cabinet, the
    # microwave and the sink basin were never looked into; the apple is in hand, so not under "Seen".
    assert env.admissible_actions() == [
        "open microwave 1", "heat apple 1 with microwave 1", "go to cabinet 1", "go to countertop 1",
        "go to fridge 1", "go to sinkbasin 1", "examine microwave 1", "examine apple 1", "inventory"]
    assert env.status().split("\n")[:2] == ["You are at microwave 1, holding apple 1 (hot).",
                                            "Not looked in: cabinet 1, microwave 1, sinkbasin 1."]
    assert env.step("inventory").observation.startswith("You are carrying: a apple 1 (hot).")
    assert env.step("examine apple 1").observation.startswith("This is a hot apple 1.")
    user = env.messages()[1]["content"]
    # history=2: the two pairs before the last one, then the last one, the status block, the turn counter.
    assert user.split("\n")[:7] == [
        "Task: put a hot apple on countertop.",
        "> heat apple 1 with microwave 1", "You heat the apple 1 using the microwave 1.",
        "> inventory", "You are carrying: a apple 1 (hot).",
        "> examine apple 1", "This is a hot apple 1."]
    assert user.endswith("Turn 9 of 30.")


def test_knowledge_lines_track_what_was_seen():
    env = ALFWorldEnv()
    env.reset(TWO)
    env.step("go to coffeetable 1")
    status = env.status().split("\n")
    assert status[1] == "Not looked in: drawer 1, sofa 1."
    assert status[2] == "Seen: remotecontrol 2 on coffeetable 1."
    env.step("go to sofa 1")
    assert env.status().split("\n")[2] == "Seen: remotecontrol 1 on sofa 1, remotecontrol 2 on coffeetable 1."


def test_invalid_and_inadmissible_actions_change_nothing():
    env = ALFWorldEnv()
    env.reset(HEAT)
    key = env.state_key()
    for text in ["take apple 1 from fridge 1",  # not there
                 "open fridge 1",  # not there
                 "go to fridge 2",  # no such receptacle
                 "heat apple 1 with microwave 1",  # holding nothing
                 "look", "go to", "fly to the moon", ""]:
        s = env.step(text)
        assert s.info["invalid"] is True and s.reward == 0.0 and s.done is False, text
        assert s.observation.split("\n")[0] == INVALID_FEEDBACK
        assert env.state_key() == key
    assert env.turn == 8
    # Case, spaces, a trailing period and the tags are accepted.
    assert env.step("  GO TO   Fridge 1. ").info["invalid"] is False
    assert env.loc == "fridge 1"
    assert env.step("take apple 1 from fridge 1").info["invalid"] is True  # the fridge is closed
    assert env.step("<think>open it</think><action>open fridge 1</action>").info["invalid"] is False
    assert env.step("take apple 1 from fridge 1").info["invalid"] is False
    # "put X in Y" and "put X on Y" both spell the canonical "put X in/on Y".
    assert env.step("put apple 1 on fridge 1").info["invalid"] is False
    assert env.where["apple 1"] == "fridge 1" and env.held is None
    env.step("take apple 1 from fridge 1")
    assert env.step("put apple 1 in fridge 1").info["invalid"] is False
    # The history shows an invalid text on one line, without markup.
    env.step("<|im_end|>\nhello\tworld")
    assert "> ??im_end?? hello world\nNothing happens." in env.messages()[1]["content"]


def test_holding_one_object_and_closing():
    env = ALFWorldEnv()
    env.reset(HEAT)
    env.step("go to countertop 1")
    env.step("take knife 1 from countertop 1")
    env.step("go to fridge 1")
    env.step("open fridge 1")
    assert "take apple 1 from fridge 1" not in env.admissible_actions()  # hands full
    assert env.step("take apple 1 from fridge 1").info["invalid"] is True
    before = env.state_key()
    assert env.step("close fridge 1").observation.startswith("You close the fridge 1.")
    assert env.state_key() != before
    env.step("open fridge 1")
    assert env.state_key() == before  # open -> close -> open: the same state


def test_processing_state_matters_and_the_last_process_wins():
    env = ALFWorldEnv()
    env.reset(HEAT)
    for a in ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1", "go to countertop 1"]:
        env.step(a)
    s = env.step("put apple 1 in/on countertop 1")  # not hot: the goal does not hold
    assert s.reward == 0.0 and not s.done and s.info["progress"] == 0.0
    env.step("take apple 1 from countertop 1")
    env.step("go to microwave 1")
    assert env.step("heat apple 1 with microwave 1").info["progress"] == pytest.approx(2 / 3)
    env.step("go to fridge 1")
    s = env.step("cool apple 1 with fridge 1")  # cooling undoes the heat
    assert "state=apple 1:cool" in env.state_key() and s.info["progress"] == pytest.approx(1 / 3)
    env.step("go to countertop 1")
    assert env.step("put apple 1 in/on countertop 1").reward == 0.0
    # The expert finishes from here: take it back, heat it, put it.
    steps = run_expert(env)
    assert [a for a, _ in steps] == ["take apple 1 from countertop 1", "go to microwave 1",
                                     "heat apple 1 with microwave 1", "go to countertop 1",
                                     "put apple 1 in/on countertop 1"]
    assert steps[-1][1].info["success"] is True


def test_look_task_lamp_then_object():
    env = ALFWorldEnv()
    env.reset(LOOK)
    assert env.task["text"] == "look at book under the desklamp."
    s = env.step("go to sidetable 1")
    assert s.observation.split("\n")[0] == "You arrive at sidetable 1. On the sidetable 1, you see a desklamp 1."
    assert "take desklamp 1 from sidetable 1" not in env.admissible_actions()  # lamps stay put
    assert env.step("take desklamp 1 from sidetable 1").info["invalid"] is True
    s = env.step("use desklamp 1")
    assert s.observation.split("\n")[0] == "You turn on the desklamp 1."
    assert s.reward == 0.0 and s.info["progress"] == 0.0  # lamp on, no book in hand
    env.step("go to bed 1")
    s = env.step("take book 1 from bed 1")
    assert s.info["progress"] == 0.5 and not s.done
    s = env.step("go to sidetable 1")  # the lamp is still on: holding the book there is the goal
    assert s.reward == 10.0 and s.done and s.info["success"] and s.info["progress"] == 1.0


def test_look_task_expert_by_hand():
    env = ALFWorldEnv()
    env.reset(LOOK)
    # book: bed first in the table's order, then the lamp's side table.
    assert [a for a, _ in run_expert(env)] == ["go to bed 1", "take book 1 from bed 1", "go to sidetable 1",
                                               "use desklamp 1"]
    assert env.state_key().endswith("|on=desklamp 1")


def test_pick_two_progress_by_hand():
    env = ALFWorldEnv()
    env.reset(TWO)
    assert env.task["text"] == "put two remotecontrol in drawer."
    steps = run_expert(env)
    assert [a for a, _ in steps] == [
        "go to sofa 1", "take remotecontrol 1 from sofa 1", "go to drawer 1", "open drawer 1",
        "put remotecontrol 1 in/on drawer 1", "go to coffeetable 1", "take remotecontrol 2 from coffeetable 1",
        "go to drawer 1", "put remotecontrol 2 in/on drawer 1"]
    # Subgoals: hold one (1/4), put it (2/4), hold the second (3/4), both in the drawer (4/4).
    assert [s.info["progress"] for _, s in steps] == [0, .25, .25, .25, .5, .5, .75, .75, 1.0]
    assert steps[3][1].observation.split("\n")[0] == "You open the drawer 1. The drawer 1 is open. In it, you see nothing."
    assert [s.reward for _, s in steps] == [0.0] * 8 + [10.0]


def test_pick_two_needs_the_same_receptacle():
    two = json.loads(TWO[5:])
    two["receptacles"] = ["coffeetable 1", "drawer 1", "drawer 2", "sofa 1"]
    env = ALFWorldEnv()
    env.reset("json:" + json.dumps(two))
    for a in ["go to sofa 1", "take remotecontrol 1 from sofa 1", "go to drawer 2", "open drawer 2",
              "put remotecontrol 1 in/on drawer 2", "go to coffeetable 1", "take remotecontrol 2 from coffeetable 1",
              "go to drawer 1", "open drawer 1"]:
        env.step(a)
    s = env.step("put remotecontrol 2 in/on drawer 1")
    assert not s.done and s.reward == 0.0 and s.info["progress"] == 0.5  # one per drawer: best count 1
    # The expert keeps drawer 1 (a tie goes to the first listed) and fetches the other one.
    steps = run_expert(env)
    assert [a for a, _ in steps] == ["go to drawer 2", "take remotecontrol 1 from drawer 2", "go to drawer 1",
                                     "put remotecontrol 1 in/on drawer 1"]
    assert steps[-1][1].info["success"]


def test_truncation_at_max_steps():
    env = ALFWorldEnv(max_steps=3)
    env.reset(HEAT)
    s = [env.step("inventory") for _ in range(3)][-1]
    assert s.done and s.info.get("truncated") and not s.info["success"] and s.reward == 0.0


def test_state_key_ignores_what_was_looked_at():
    a, b = ALFWorldEnv(), ALFWorldEnv()
    a.reset(HEAT)
    b.reset(HEAT)
    for x in ["go to cabinet 1", "go to sinkbasin 1", "go to countertop 1"]:
        a.step(x)
    b.step("go to countertop 1")
    assert a.state_key() == b.state_key()
    assert a.status() != b.status()  # a has looked into more places


def test_bad_json_tasks_and_options_are_value_errors():
    env = ALFWorldEnv()
    bad = json.loads(HEAT[5:])
    for change in [dict(task_type="bake"), dict(goal="stoveburner"), dict(receptacles=["fridge 1"]),
                   dict(placements={"apple 1": "oven 1"}), dict(obj="dragon")]:
        with pytest.raises(ValueError):
            env.reset("json:" + json.dumps({**bad, **change}))
    for tid in ["json:{", "json:[]", "test-9999", "train--1", "dev-0", "7"]:
        with pytest.raises(ValueError):
            env.reset(tid)
    with pytest.raises(ValueError):
        ALFWorldEnv(task_types=("pick", "dance"))
    with pytest.raises(ValueError):
        envs.make("alfworld", max_steps=0)


# ----------------------------------------------------------------------------------------------
# Generated tasks
# ----------------------------------------------------------------------------------------------
GOAL_TEXT = re.compile(r"^(put (a|a clean|a hot|a cool|two) [a-z]+ (in|on) [a-z]+\.|look at [a-z]+ under the "
                       r"(desklamp|floorlamp)\.)$")


def test_test_split_is_balanced_and_tasks_are_well_formed():
    env = envs.make("alfworld")
    tasks = [env.get_task(t) for t in env.task_ids("test")] + [env.get_task(t) for t in env.task_ids("train")[:600]]
    assert Counter(t["task_type"] for t in tasks[:120]) == {k: 20 for k in TASK_TYPES}
    data = world()
    for t in tasks:
        assert GOAL_TEXT.match(t["text"]), t["text"]
        targets = [o for o in t["placements"] if rtype(o) == t["obj"]]
        assert (2 <= len(targets) <= 3) if t["task_type"] == "two" else (1 <= len(targets) <= 2)
        assert all(r in t["receptacles"] for r in t["placements"].values())
        load = Counter(t["placements"].values()) + Counter([t["lamp_at"]] if t["lamp_at"] else [])
        assert max(load.values()) <= 3
        for o in targets:  # never already done, never on the lamp's receptacle
            assert rtype(t["placements"][o]) != t["goal"] and t["placements"][o] != t["lamp_at"]
        if t["task_type"] in ("clean", "heat", "cool"):
            assert any(rtype(r) == data["appliances"][t["task_type"]] for r in t["receptacles"])
            assert t["goal"] != data["appliances"][t["task_type"]]
        if t["task_type"] == "look":
            assert t["lamp"] and t["scene"] in ("bedroom", "livingroom")


def test_splits_are_disjoint_as_tasks():
    env = envs.make("alfworld")
    test = {task_signature(env.get_task(t)) for t in env.task_ids("test")}
    train = [task_signature(env.get_task(t)) for t in env.task_ids("train")]
    assert len(test) == 120 and len(train) == 3000
    assert not test & set(train)
    assert len(set(train)) > 2990  # independent draws: (almost) no repeats


def test_expert_solves_the_test_split():
    env = envs.make("alfworld")
    wins, lengths = Counter(), []
    for tid in env.task_ids("test"):
        env.reset(tid)
        steps = run_expert(env)
        wins[env.task["task_type"]] += steps[-1][1].info["success"]
        lengths.append(len(steps))
    assert all(wins[k] >= 0.9 * 20 for k in TASK_TYPES), wins  # measured: 20/20 of every type
    assert max(lengths) <= 20  # measured: mean 8.0, max 13 of 30 steps


def test_noisy_expert_recovers():
    env = envs.make("alfworld")
    rng = random.Random(3)
    wins = 0
    for tid in env.task_ids("train")[:120]:
        env.reset(tid)
        while not env.done:
            acts = env.admissible_actions()
            s = env.step(env.expert_action() if rng.random() > 0.3 else rng.choice(acts))
        wins += s.info["success"]
    assert wins >= 0.9 * 120  # measured 118/120 with 30% random actions


def test_random_admissible_policy_rarely_succeeds():
    wins, invalid = random_policy_wins(envs.make("alfworld"), 360)
    assert invalid == 0
    assert wins / 360 < 0.05  # measured 2/360 here, 6/1200 (0.005) over 1200 episodes


def test_prompts_stay_compact():
    env = envs.make("alfworld")
    rng = random.Random(1)
    longest = 0
    for tid in env.task_ids("test")[:60]:
        env.reset(tid)
        while not env.done:
            longest = max(longest, len(env.messages()[1]["content"]))
            acts = env.admissible_actions()
            env.step(env.expert_action() if rng.random() < 0.7 else rng.choice(acts))
    assert longest < 1200  # measured: mean 711 characters, max 999 (about 235 tiny tokens on average)


def test_tasks_are_the_same_in_a_fresh_process():
    code = ("import envs, json; from envs.alfworld import task_signature; e = envs.make('alfworld'); print(e.version); "
            "print(json.dumps([task_signature(e.get_task(t)) for t in e.task_ids('test')[:5] + e.task_ids('train')[:5]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONHASHSEED="4321"))
    assert out.returncode == 0, out.stderr
    env = envs.make("alfworld")
    version, sigs = out.stdout.strip().split("\n", 1)
    assert version == env.version
    assert json.loads(sigs) == [task_signature(env.get_task(t)) for t in env.task_ids("test")[:5] + env.task_ids("train")[:5]]


def test_task_type_subset_option():
    env = envs.make("alfworld", task_types=("look",), num_train=10, num_test=4)
    assert {env.get_task(t)["task_type"] for t in env.task_ids("test") + env.task_ids("train")} == {"look"}
    assert env.version != envs.make("alfworld").version


# ----------------------------------------------------------------------------------------------
# Tiny policy
# ----------------------------------------------------------------------------------------------
def test_micro_tiny_build_from_the_command_line(tiny_cache):
    out = subprocess.run([sys.executable, "-m", "common.tiny", "--env-id", "alfworld", "--preset", "micro",
                          "--cache-dir", str(tiny_cache), "--num-threads", "1", "--no-progress"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    path = Path(out.stdout.strip().split("\n")[0])
    meta = json.loads((path / "tiny_meta.json").read_text())
    assert meta["env_id"] == "alfworld" and meta["demos"]["pairs"] > 0
    assert meta["success"]["test_tasks"] == 8
