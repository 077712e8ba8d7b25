"""Sokoban as a text env: push every box onto a target in a small walled room.

Levels. A level is a room (border walls plus interior walls carved by a random walk, as in
gym-sokoban), `num_boxes` targets, and a start state (player and box cells). Start states come from
exhaustive reverse play: a breadth-first search from every solved state (all boxes on targets, the
player on any free floor cell) over reverse moves (walk, or pull the box behind the player). Every
state it reaches is solvable and its BFS depth is its optimal solution length in moves, so the same
table is the expert (`expert_action`: a move to a state one step closer), the progress measure
(`info["progress"]`) and the solvability check. A start state is drawn with an optimal solution
length uniform in [min_solution_len, max_solution_len].

Level sets are deterministic: candidate j of a split uses `random.Random("sokoban|<options>|<split>|j")`.
The test levels are generated first; train levels skip every start configuration of the test set and
every duplicate, so train and test are disjoint as levels (the grid strings differ). Train levels are
generated lazily in index order and kept in memory (a module-level cache shared by env instances).

Observation: the grid, one symbol per cell, rows on separate lines: `#` wall, `_` floor, `P` player,
`B` box, `T` target, `*` box on target, `Q` player on target. The legend and the admissible actions
are in `task_prompt`, which heads every user message (`messages()`), so history entries stay compact
(`instructions=False` drops it there, for the tiny policies, which read no instructions).

Actions: up, down, left, right (case-insensitive; aliases such as "move up", "go left", "push down",
"u", "north" are accepted). Walking or pushing into a wall or a blocked box is a valid move that
changes nothing (it costs a turn, as in gym-sokoban). Any other text is invalid: the observation says
"Invalid action. Admissible actions: up, down, left, right" followed by the grid, and the episode goes on.

Rewards: "sparse" (default, GraphGPO/GiGPO): 10 when the last box reaches its target, else 0.
"shaped" (VisualSokoban/gym-sokoban): -0.1 every turn (invalid turns included), +1 per box pushed onto
a target, -1 per box pushed off a target, +10 on solving (the solving push earns -0.1 + 1 + 10 = 10.9).
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from envs.base import INSTRUCT_FORMAT, Step, TextEnv

GENERATOR_VERSION = "1"  # bump when level generation changes (tiny-policy caches key on env.version)

ACTIONS = ("up", "down", "left", "right")
_DIRS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
_ALIASES = {
    "u": "up", "north": "up", "n": "up",
    "d": "down", "south": "down", "s": "down",
    "l": "left", "west": "left", "w": "left",
    "r": "right", "east": "right", "e": "right",
}
_VERBS = ("move", "go", "push", "walk", "step")
_STRIP = " \t\r\n.!,;:'\"`()[]{}*"
INVALID_MSG = "Invalid action. Admissible actions: up, down, left, right"
LEGEND = ("Legend: # wall, _ floor, P player, B box, T target, * box on target, "
          "Q player on target.")
WALL, FLOOR, PLAYER, BOX, TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET = "#", "_", "P", "B", "T", "*", "Q"


def parse_action(action: str) -> Optional[str]:
    """Canonical move for an action string ("Up", "move left", "go down.", "r"), or None."""
    if not isinstance(action, str) or len(action) > 40:
        return None
    words = action.lower().strip(_STRIP).split()
    if len(words) == 2 and words[0] in _VERBS:
        words = words[1:]
    if len(words) != 1:
        return None
    word = words[0].strip(_STRIP)
    if word in _DIRS:
        return word
    return _ALIASES.get(word)


# ----------------------------------------------------------------------------------------------
# Levels and the solver
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Level:
    """A start configuration. Cells are indices r * size + c."""

    size: int
    walls: frozenset
    targets: tuple
    player: int
    boxes: tuple
    opt_len: int  # optimal solution length in moves (-1: unsolvable)

    def grid(self) -> str:
        return render(self.size, self.walls, self.targets, self.player, self.boxes)


def render(size: int, walls, targets, player: int, boxes) -> str:
    tset, bset = set(targets), set(boxes)
    rows = []
    for r in range(size):
        row = []
        for c in range(size):
            i = r * size + c
            if i in walls:
                row.append(WALL)
            elif i in bset:
                row.append(BOX_ON_TARGET if i in tset else BOX)
            elif i == player:
                row.append(PLAYER_ON_TARGET if i in tset else PLAYER)
            else:
                row.append(TARGET if i in tset else FLOOR)
        rows.append("".join(row))
    return "\n".join(rows)


def parse_grid(text: str) -> Level:
    """A Level from a grid string (rows separated by newlines or "/"). Raises ValueError."""
    rows = [r for r in re.split(r"[\n/]", text.strip()) if r]
    size = len(rows)
    if size < 3 or any(len(r) != size for r in rows):
        raise ValueError("a Sokoban grid must be square with at least 3 rows")
    walls, targets, boxes, players = set(), [], [], []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            i = r * size + c
            if ch == WALL:
                walls.add(i)
            elif ch in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET):
                targets.append(i)
            elif ch not in (FLOOR, PLAYER, BOX):
                raise ValueError(f"unknown grid symbol {ch!r}")
            if ch in (BOX, BOX_ON_TARGET):
                boxes.append(i)
            if ch in (PLAYER, PLAYER_ON_TARGET):
                players.append(i)
    for i in range(size * size):  # the border is always wall
        r, c = divmod(i, size)
        if (r in (0, size - 1) or c in (0, size - 1)) and i not in walls:
            raise ValueError("the border of a Sokoban grid must be walls")
    if len(players) != 1 or not boxes or len(boxes) != len(targets):
        raise ValueError("a Sokoban grid needs one player and as many boxes as targets (at least one)")
    walls, targets, boxes = frozenset(walls), tuple(sorted(targets)), tuple(sorted(boxes))
    dist = solve_table(size, walls, targets)
    return Level(size, walls, targets, players[0], boxes, dist.get((players[0], boxes), -1))


def move(size: int, walls, player: int, boxes: tuple, action: str) -> tuple[int, tuple, bool]:
    """Apply a move: (new player, new sorted boxes, pushed?). Blocked moves return the same state."""
    dr, dc = _DIRS[action]
    d = dr * size + dc
    q = player + d
    if q in walls:
        return player, boxes, False
    if q in boxes:
        r = q + d
        if r in walls or r in boxes:
            return player, boxes, False
        return q, tuple(sorted(r if b == q else b for b in boxes)), True
    return q, boxes, False


@lru_cache(maxsize=256)
def solve_table(size: int, walls: frozenset, targets: tuple) -> dict:
    """Optimal solution length (moves) of every solvable state {(player, boxes): dist} of a room.

    Breadth-first search from all solved states over reverse moves: the player steps back from p to
    q = p + d (q free), optionally pulling the box at p - d onto p. States missing from the table
    cannot be solved (dead ends).
    """
    floor = [i for i in range(size * size) if i not in walls]
    deltas = [dr * size + dc for dr, dc in _DIRS.values()]
    dist = {}
    queue = deque()
    tset = frozenset(targets)
    for p in floor:
        if p not in tset:
            dist[(p, targets)] = 0
            queue.append((p, targets))
    while queue:
        state = queue.popleft()
        p, boxes = state
        nd = dist[state] + 1
        for d in deltas:
            q = p + d
            if q in walls or q in boxes:
                continue
            prev = (q, boxes)
            if prev not in dist:
                dist[prev] = nd
                queue.append(prev)
            b = p - d
            if b in boxes:
                prev = (q, tuple(sorted(p if x == b else x for x in boxes)))
                if prev not in dist:
                    dist[prev] = nd
                    queue.append(prev)
    return dist


def _carve_room(rng: random.Random, size: int, min_floor: float = 0.6) -> frozenset:
    """Walls of a room: border plus interior cells left uncarved by a random walk that carves a
    uniformly drawn fraction in [min_floor, 1] of the interior (min_floor=1: an open room)."""
    inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    n_inner = len(inner)
    goal = rng.randint(min(n_inner, max(3, math.ceil(min_floor * n_inner - 1e-9))), n_inner)
    r, c = rng.choice(inner)
    floor = {(r, c)}
    for _ in range(50 * n_inner):
        if len(floor) >= goal:
            break
        dr, dc = rng.choice(list(_DIRS.values()))
        if 1 <= r + dr <= size - 2 and 1 <= c + dc <= size - 2:
            r, c = r + dr, c + dc
            floor.add((r, c))
    return frozenset(r * size + c for r in range(size) for c in range(size) if (r, c) not in floor)


def generate_level(rng: random.Random, size: int, num_boxes: int, min_len: int, max_len: int,
                   min_floor: float = 0.6, tries: int = 200) -> Level:
    """One level: carve a room, place the targets, pick a start state by reverse-play depth."""
    for _ in range(tries):
        walls = _carve_room(rng, size, min_floor)
        floor = [i for i in range(size * size) if i not in walls]
        if len(floor) < num_boxes + 2:
            continue
        targets = tuple(sorted(rng.sample(floor, num_boxes)))
        dist = solve_table(size, walls, targets)
        by_len: dict[int, list] = {}
        for state, k in dist.items():
            if min_len <= k <= max_len:
                by_len.setdefault(k, []).append(state)
        if not by_len:
            continue
        k = rng.choice(sorted(by_len))
        player, boxes = rng.choice(by_len[k])
        return Level(size, walls, targets, player, boxes, k)
    raise ValueError(f"no Sokoban level with a {min_len}-{max_len} move solution in a {size}x{size} "
                     f"room with {num_boxes} boxes after {tries} rooms; widen the solution length range")


class _LevelSet:
    """The deterministic test and train levels of one set of level options."""

    def __init__(self, key: str, size: int, num_boxes: int, min_len: int, max_len: int, min_floor: float,
                 num_test: int):
        self.key, self.args = key, (size, num_boxes, min_len, max_len, min_floor)
        self.levels = {"test": [], "train": []}
        self.seen = {"test": set(), "train": set()}
        self.next_candidate = {"test": 0, "train": 0}
        self.num_test = num_test

    def _extend(self, split: str, n: int) -> None:
        if split == "train" and len(self.levels["test"]) < self.num_test:
            self._extend("test", self.num_test)
        levels, seen = self.levels[split], self.seen[split]
        rejected = 0
        while len(levels) < n:
            j = self.next_candidate[split]
            self.next_candidate[split] += 1
            level = generate_level(random.Random(f"sokoban|{self.key}|{split}|{j}"), *self.args)
            g = level.grid()
            if g in seen or (split == "train" and g in self.seen["test"]):
                rejected += 1
                if rejected > 5000:  # the level space is (nearly) exhausted
                    raise ValueError(f"only about {len(levels)} distinct {split} Sokoban levels exist for "
                                     f"{self.key}; ask for fewer levels or a larger/harder room")
                continue
            rejected = 0
            seen.add(g)
            levels.append(level)

    def get(self, split: str, index: int) -> Level:
        self._extend(split, index + 1)
        return self.levels[split][index]


_LEVEL_SETS: dict[str, _LevelSet] = {}


# ----------------------------------------------------------------------------------------------
# The env
# ----------------------------------------------------------------------------------------------
class SokobanEnv(TextEnv):
    """Sokoban in a small room. Options:

    size: room side including the border walls (6 -> a 4x4 interior, as in the papers).
    num_boxes: boxes (and targets), 1-3 (the tiny policy's recipe uses 1: its 0.6M-parameter model learned
        almost nothing of 2-box rooms within its build budget).
    min_solution_len, max_solution_len: optimal solution length range of the levels, in moves.
    min_floor: each room's interior is floor in a uniform fraction in [min_floor, 1] of its cells,
        the rest interior walls (1.0: open rooms only).
    max_steps: turns per episode (invalid turns count).
    reward: "sparse" (10 on solving) or "shaped" (-0.1/turn, +-1 per box on/off target, +10 on solving).
    num_train, num_test: how many levels per split.
    seed: level-generation seed.
    history: (action, observation) pairs shown in the prompt (None = all).
    instructions: False leaves the task line, legend and action list out of the user message
        (the system prompt keeps them); the tiny policy's recipe uses it to halve its prompt.
    """

    env_id = "sokoban"

    shared_data = ("_levels",)  # the generated levels, read-only

    def __init__(self, size: int = 6, num_boxes: int = 2, min_solution_len: int = 5,
                 max_solution_len: int = 12, min_floor: float = 0.8, max_steps: int = 15,
                 reward: str = "sparse", num_train: int = 5000, num_test: int = 200, seed: int = 0,
                 history: Optional[int] = 2, instructions: bool = True):
        super().__init__(history=history, instructions=instructions)
        if not 4 <= size <= 12:
            raise ValueError(f"size must be in 4..12 (room side including walls), got {size}")
        if not 1 <= num_boxes <= 3:
            raise ValueError(f"num_boxes must be 1, 2 or 3, got {num_boxes}")
        if not 1 <= min_solution_len <= max_solution_len:
            raise ValueError(f"need 1 <= min_solution_len <= max_solution_len, got "
                             f"{min_solution_len}, {max_solution_len}")
        if max_steps < max_solution_len:
            raise ValueError(f"max_steps ({max_steps}) must be >= max_solution_len ({max_solution_len}) "
                             "so that every level can be solved in time")
        if not 0.0 <= min_floor <= 1.0:
            raise ValueError(f"min_floor must be in [0, 1], got {min_floor}")
        inner = (size - 2) ** 2
        if inner * math.comb(inner, num_boxes) > 200_000:
            raise ValueError(f"a {size}x{size} room with {num_boxes} boxes has too many states for the BFS "
                             "solver; use a smaller room or fewer boxes")
        if reward not in ("sparse", "shaped"):
            raise ValueError(f"reward must be 'sparse' or 'shaped', got {reward!r}")
        if num_train < 1 or num_test < 1:
            raise ValueError("num_train and num_test must be >= 1")
        self.size, self.num_boxes = size, num_boxes
        self.min_solution_len, self.max_solution_len = min_solution_len, max_solution_len
        self.min_floor = min_floor
        self.max_turns = max_steps
        self.reward_type = reward
        self.num_train, self.num_test, self.seed = num_train, num_test, seed
        key = (f"v{GENERATOR_VERSION}-s{size}-b{num_boxes}-L{min_solution_len}-{max_solution_len}"
               f"-f{min_floor:g}-t{num_test}-seed{seed}")
        if key not in _LEVEL_SETS:
            _LEVEL_SETS[key] = _LevelSet(key, size, num_boxes, min_solution_len, max_solution_len,
                                         min_floor, num_test)
        self._levels = _LEVEL_SETS[key]
        # Everything that changes the levels, the prompts or the episodes.
        self.version = f"{key}-n{num_train}-steps{max_steps}-{reward}"
        self.task_prompt = (f"Push every box (B) onto a target (T).\n{LEGEND}\n"
                            f"Actions: {', '.join(ACTIONS)}")
        self.system_prompt = (
            "You are playing Sokoban. The room is a grid, one symbol per cell: # wall, _ floor, "
            "P you, B box, T target, * box on a target, Q you on a target. Each turn you move one cell "
            "up, down, left or right. Walking into a box pushes it one cell if the cell behind it is "
            "free; boxes cannot be pulled, and a box pushed into a corner is stuck for good. Push every "
            f"box onto a target within {max_steps} moves. Valid actions: up, down, left, right. "
            + INSTRUCT_FORMAT)
        self.level: Optional[Level] = None
        self.player, self.boxes = 0, ()

    # -- levels --------------------------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        n = self.num_train if split == "train" else self.num_test
        return [f"{split}-{i}" for i in range(n)]

    def get_level(self, task_id: str) -> Level:
        """The level of a task id: "train-<i>", "test-<i>", or "grid:<rows separated by />"."""
        task_id = str(task_id)
        if task_id.startswith("grid:"):
            return parse_grid(task_id[5:])
        split, _, idx = task_id.partition("-")
        n = {"train": self.num_train, "test": self.num_test}.get(split)
        if n is None or not idx.isdigit() or int(idx) >= n:
            raise ValueError(f"unknown Sokoban task id {task_id!r}: use train-<0..{self.num_train - 1}>, "
                             f"test-<0..{self.num_test - 1}> or grid:<rows separated by />")
        return self._levels.get(split, int(idx))

    # -- protocol ------------------------------------------------------------------------------
    def _reset(self, task_id: str) -> str:
        self.level = self.get_level(task_id)
        self.player, self.boxes = self.level.player, self.level.boxes
        return self.state_key()

    def _table(self) -> dict:
        lv = self.level
        return solve_table(lv.size, lv.walls, lv.targets)

    def solution_length(self) -> Optional[int]:
        """Optimal number of moves from the current state to the goal (None: unsolvable)."""
        return self._table().get((self.player, self.boxes))

    def _n_on_target(self, boxes) -> int:
        return len(set(boxes) & set(self.level.targets))

    def _progress(self) -> float:
        d = self.solution_length()
        if d is None:
            return 0.0
        init = self.level.opt_len
        if init <= 0:
            return 1.0
        return float(min(1.0, max(0.0, 1.0 - d / init)))

    def _step(self, action: str) -> Step:
        act = parse_action(action)
        shaped = self.reward_type == "shaped"
        if act is None:
            obs = f"{INVALID_MSG}\n{self.state_key()}"
            info = {"success": False, "invalid": True, "progress": self._progress(), "moved": False,
                    "pushed": False}
            return Step(obs, -0.1 if shaped else 0.0, False, info)
        before = self._n_on_target(self.boxes)
        lv = self.level
        player, boxes, pushed = move(lv.size, lv.walls, self.player, self.boxes, act)
        moved = player != self.player
        self.player, self.boxes = player, boxes
        after = self._n_on_target(boxes)
        solved = after == len(boxes)
        if shaped:
            reward = -0.1 + (after - before) + (10.0 if solved else 0.0)
        else:
            reward = 10.0 if solved else 0.0
        info = {"success": solved, "invalid": False, "progress": self._progress(), "moved": moved,
                "pushed": pushed, "boxes_on_target": after}
        return Step(self.state_key(), float(reward), solved, info)

    def state_key(self) -> str:
        lv = self.level
        if lv is None:
            return ""
        return render(lv.size, lv.walls, lv.targets, self.player, self.boxes)

    def expert_action(self) -> str:
        """First move of an optimal solution from the current state (ties: up, down, left, right).
        On a solved or dead-end state it returns "up"."""
        lv = self.level
        if lv is None:
            return ACTIONS[0]
        table = self._table()
        d = table.get((self.player, self.boxes))
        if not d:
            return ACTIONS[0]
        for act in ACTIONS:
            p, b, _ = move(lv.size, lv.walls, self.player, self.boxes, act)
            if table.get((p, b)) == d - 1:
                return act
        return ACTIONS[0]  # unreachable: a state at depth d has a successor at depth d - 1

    def admissible_actions(self) -> list[str]:
        return list(ACTIONS)

    def corrupt_action(self, rng) -> str:
        """A uniformly random move (noise for demonstrations)."""
        return str(ACTIONS[int(rng.integers(4)) if hasattr(rng, "integers") else rng.randrange(4)])
