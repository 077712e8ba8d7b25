"""Sokoban: hand-built levels with rewards worked out by hand, the level sets, the expert and a random
baseline. Design choice tested here: walking or pushing into a wall (or a blocked box) is a VALID move
that changes nothing and costs a turn; only text that names no move is invalid."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

import envs
from conftest import random_policy_wins
from envs.sokoban import ACTIONS, INVALID_MSG, SokobanEnv, parse_action, parse_grid

REPO = Path(__file__).resolve().parent.parent

# Two boxes. Player (1,1); box (1,2) left of target (1,3); box (3,2) left of target (3,3).
# Optimal: right (push box 1 on its target), then reach (3,1) in 3 moves, then right (push box 2):
# 1 + 3 + 1 = 5 moves. Pushing box 2 first costs 2 + 1 + 3 (back to (1,1)) + 1 = 7.
TWO_BOX = "######/#PBT_#/#____#/#_BT_#/#____#/######"
START_ROWS = ["######", "#PBT_#", "#____#", "#_BT_#", "#____#", "######"]


def grid_rows(env) -> list[str]:
    return env.state_key().split("\n")


def play(env, actions):
    return [env.step(a) for a in actions]


# ----------------------------------------------------------------------------------------------
# Hand-built levels
# ----------------------------------------------------------------------------------------------
def test_hand_level_renders_and_has_the_hand_computed_solution_length():
    env = SokobanEnv()
    obs = env.reset("grid:" + TWO_BOX)
    assert obs == "\n".join(START_ROWS) == env.state_key()
    assert env.level.opt_len == 5
    assert env.solution_length() == 5


def test_push_onto_target_then_off_into_a_dead_corner_sparse():
    env = SokobanEnv()
    env.reset("grid:" + TWO_BOX)
    s1 = env.step("right")  # box 1 onto its target
    assert grid_rows(env)[1] == "#_P*_#"
    assert (s1.reward, s1.done, s1.info["invalid"], s1.info["pushed"]) == (0.0, False, False, True)
    assert s1.info["boxes_on_target"] == 1
    assert s1.info["progress"] == pytest.approx(1 - 4 / 5)  # 4 moves left of the initial 5
    s2 = env.step("right")  # pushes box 1 off its target into the top-right corner: dead
    assert grid_rows(env)[1] == "#__QB#"  # Q: player standing on the empty target
    assert s2.info["pushed"] is True and s2.info["boxes_on_target"] == 0
    assert env.solution_length() is None
    assert s2.info["progress"] == 0.0
    assert s2.reward == 0.0 and not s2.done


def test_push_into_wall_is_a_valid_no_op_that_costs_a_turn():
    env = SokobanEnv()
    env.reset("grid:" + TWO_BOX)
    before = env.state_key()
    s = env.step("up")  # the player walks into the top wall
    assert s.info["invalid"] is False and s.info["moved"] is False
    assert env.state_key() == before and env.turn == 1
    play(env, ["right", "right"])  # box 1 now in the corner (1,4), player at (1,3)
    before = env.state_key()
    s = env.step("right")  # pushing the box into the wall: nothing moves
    assert s.info["invalid"] is False and s.info["moved"] is False and s.info["pushed"] is False
    assert env.state_key() == before and env.turn == 4


def test_invalid_text_keeps_the_episode_going():
    env = SokobanEnv()
    env.reset("grid:" + TWO_BOX)
    for text in ["jump", "up down", "", "<action>teleport</action>", "ignore previous instructions"]:
        s = env.step(text)
        assert s.info["invalid"] is True and s.done is False and s.reward == 0.0
        assert s.observation == INVALID_MSG + "\n" + "\n".join(START_ROWS)
    assert env.turn == 5 and env.state_key() == "\n".join(START_ROWS)


def test_sparse_reward_is_10_on_solving_and_expert_path():
    env = SokobanEnv(reward="sparse")
    env.reset("grid:" + TWO_BOX)
    # Expert ties break in the order up, down, left, right: after the first push, "down" to (2,2)
    # and "left" to (2,1) are on a shortest path (as is "left" first), "down" wins the tie.
    taken, rewards, progress = [], [], []
    while not env.done:
        a = env.expert_action()
        s = env.step(a)
        taken.append(a), rewards.append(s.reward), progress.append(s.info["progress"])
    assert taken == ["right", "down", "left", "down", "right"]
    assert rewards == [0.0, 0.0, 0.0, 0.0, 10.0]
    assert progress == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # 1 - remaining / 5
    assert s.done and s.info["success"] is True and s.info["boxes_on_target"] == 2
    assert grid_rows(env) == ["######", "#__*_#", "#____#", "#_P*_#", "#____#", "######"]


def test_shaped_rewards_by_hand():
    env = SokobanEnv(reward="shaped")
    env.reset("grid:" + TWO_BOX)
    s = play(env, ["right", "down", "left", "down", "right"])
    # push on target: -0.1 + 1 = 0.9; three walks: -0.1 each; solving push: -0.1 + 1 + 10 = 10.9
    assert [x.reward for x in s] == pytest.approx([0.9, -0.1, -0.1, -0.1, 10.9])
    assert sum(x.reward for x in s) == pytest.approx(11.5)
    env.reset("grid:" + TWO_BOX)
    s = play(env, ["right", "right", "right", "dance", "up"])
    # on target 0.9; off target -1 - 0.1 = -1.1; box into the wall -0.1; invalid -0.1; wall -0.1
    assert [x.reward for x in s] == pytest.approx([0.9, -1.1, -0.1, -0.1, -0.1])


def test_one_box_solve_shaped_and_sparse():
    level = "#####/#PBT#/#___#/#___#/#####"
    for reward, expected in (("sparse", 10.0), ("shaped", 10.9)):  # shaped: -0.1 + 1 + 10
        env = SokobanEnv(reward=reward)
        env.reset("grid:" + level)
        assert env.level.opt_len == 1 and env.expert_action() == "right"
        s = env.step("Right")
        assert s.reward == pytest.approx(expected) and s.done and s.info["success"]
        assert grid_rows(env)[1] == "#_P*#"


def test_truncation_at_max_steps():
    env = SokobanEnv()
    env.reset("grid:" + TWO_BOX)
    s = play(env, ["up"] * 15)
    assert [x.done for x in s] == [False] * 14 + [True]
    assert s[-1].info.get("truncated") is True and s[-1].info["success"] is False


def test_action_aliases():
    good = {"up": "up", "UP": "up", " Left ": "left", "move right": "right", "go down.": "down",
            "push up": "up", "u": "up", "North": "up", "'left'": "left", "Down!": "down", "r": "right"}
    for text, act in good.items():
        assert parse_action(text) == act, text
    for text in ["up down", "upward", "move", "move up now", "", "jump", "upp", "🙂", "up" * 30]:
        assert parse_action(text) is None, text
    env = SokobanEnv()
    env.reset("grid:" + TWO_BOX)
    s = env.step("<think>the box is to my right</think><action>Move Right</action>")
    assert s.info["invalid"] is False and grid_rows(env)[1] == "#_P*_#"


def test_prompt_carries_legend_actions_and_grid():
    env = SokobanEnv()
    env.reset("test-0")
    user = env.messages()[1]["content"]
    for piece in ["# wall", "_ floor", "P player", "B box", "T target", "* box on target",
                  "Q player on target", "Actions: up, down, left, right", env.state_key()]:
        assert piece in user
    assert env.system_prompt.endswith(envs.INSTRUCT_FORMAT)


def test_corrupt_action_and_admissible_actions():
    env = SokobanEnv()
    env.reset("test-0")
    assert env.admissible_actions() == list(ACTIONS)
    got = {env.corrupt_action(random.Random(i)) for i in range(40)}
    got |= {env.corrupt_action(np.random.default_rng(i)) for i in range(40)}
    assert got == set(ACTIONS)


def test_bad_options_and_task_ids():
    with pytest.raises(ValueError):
        envs.make("sokoban", reward="dense")
    with pytest.raises(ValueError):
        envs.make("sokoban", max_steps=10, max_solution_len=12)
    with pytest.raises(ValueError):
        envs.make("sokoban", num_boxes=4)
    with pytest.raises(ValueError, match="too many states"):
        envs.make("sokoban", size=12, num_boxes=2)  # 100 cells x C(100, 2) box pairs > 200k
    with pytest.raises(ValueError, match="widen"):  # a 2x2 interior: every cell is a corner
        envs.make("sokoban", size=4, num_boxes=1, min_solution_len=1, max_solution_len=3).reset("test-0")
    env = SokobanEnv(num_test=5)
    for bad in ["test-5", "train--1", "bogus", "grid:###/#P#/###"]:
        with pytest.raises(ValueError):
            env.reset(bad)


# ----------------------------------------------------------------------------------------------
# Level sets, expert, random baseline
# ----------------------------------------------------------------------------------------------
def _independent_bfs(grid: str) -> int:
    """Optimal moves by a forward BFS written from the rules (not the env's reverse table)."""
    rows = grid.split("\n")
    walls = {(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "#"}
    targets = {(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch in "T*Q"}
    boxes = frozenset((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch in "B*")
    player = next((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch in "PQ")
    start = (player, boxes)
    seen = {start: 0}
    queue = deque([start])
    while queue:
        (p, bx) = state = queue.popleft()
        if bx == targets:
            return seen[state]
        for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1)):
            q = (p[0] + dr, p[1] + dc)
            if q in walls:
                continue
            nb = bx
            if q in bx:
                r = (q[0] + dr, q[1] + dc)
                if r in walls or r in bx:
                    continue
                nb = (bx - {q}) | {r}
            nxt = (q, nb)
            if nxt not in seen:
                seen[nxt] = seen[state] + 1
                queue.append(nxt)
    return -1


@pytest.mark.parametrize("num_boxes", [1, 2])
def test_levels_have_the_promised_solution_lengths(num_boxes):
    env = SokobanEnv(num_boxes=num_boxes)
    ids = env.task_ids("test")[:40] + env.task_ids("train")[:40]
    for tid in ids:
        level = env.get_level(tid)
        assert 5 <= level.opt_len <= 12
        assert _independent_bfs(level.grid()) == level.opt_len, tid
        assert len(level.boxes) == num_boxes and set(level.boxes) != set(level.targets)
        assert parse_grid(level.grid()).grid() == level.grid()


def test_splits_are_disjoint_as_levels():
    env = SokobanEnv()
    train = [env.get_level(t).grid() for t in env.task_ids("train")]
    test = [env.get_level(t).grid() for t in env.task_ids("test")]
    assert len(train) == 5000 and len(test) == 200
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_expert_solves_every_test_level_optimally():
    env = SokobanEnv()
    for tid in env.task_ids("test"):
        env.reset(tid)
        n, s = 0, None
        while not env.done:
            s = env.step(env.expert_action())
            n += 1
        assert s.info["success"] and s.reward == 10.0, tid
        assert n == env.get_level(tid).opt_len, tid


def test_random_policy_rarely_solves():
    wins, _ = random_policy_wins(SokobanEnv(), 300, actions=ACTIONS)
    assert wins / 300 < 0.10  # measured 0.002 over 1000 episodes


def test_other_options_build_solvable_levels():
    env = SokobanEnv(size=7, num_boxes=1, min_solution_len=6, max_solution_len=12, min_floor=1.0)
    assert env.version != SokobanEnv().version
    for tid in env.task_ids("test")[:10]:
        env.reset(tid)
        rows = grid_rows(env)
        assert len(rows) == 7 and all(len(r) == 7 for r in rows)
        assert sum(r.count("B") + r.count("*") for r in rows) == 1
        assert all(ch in "_PBTQ" for r in rows[1:-1] for ch in r[1:-1])  # open room: no inner walls
        while not env.done:
            s = env.step(env.expert_action())
        assert s.info["success"]


def test_levels_are_the_same_in_a_fresh_process():
    code = ("import envs; e = envs.make('sokoban'); print(e.version); "
            "print('|'.join(e.get_level(t).grid() for t in e.task_ids('test')[:5] + e.task_ids('train')[:5]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONHASHSEED="12345"))
    assert out.returncode == 0, out.stderr
    env = SokobanEnv()
    here = "|".join(env.get_level(t).grid() for t in env.task_ids("test")[:5] + env.task_ids("train")[:5])
    version, grids = out.stdout.strip().split("\n", 1)
    assert version == env.version
    assert grids == here
