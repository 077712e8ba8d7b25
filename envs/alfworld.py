"""ALFWorld-lite: household tasks in a text room, after ALFWorld (Shridhar et al., ICLR 2021).

World. A task is one room (kitchen, bathroom, bedroom or living room) with numbered receptacles
("cabinet 1", "fridge 1", "sinkbasin 1", "desk 1", ...) and numbered objects on or in them ("apple 2").
Cabinets, drawers, the fridge, the microwave and the safe start closed: their contents show only once
opened. The agent starts in the middle of the room, holds at most one object, and moves between
receptacles with "go to". The vocabulary (receptacle and object types, where each object may start,
where a task may ask to put it, what can be done to it) is the table `envs/data/alfworld_world.json`,
written for this project after ALFWorld's.

Tasks: the six ALFWorld task types, with ALFWorld's goal phrasing.

    pick   "put a pen on desk."                take it, put it in/on a receptacle of that type
    clean  "put a clean apple in fridge."      ... "clean apple 1 with sinkbasin 1" before putting it
    heat   "put a hot mug on countertop."      ... "heat mug 1 with microwave 1"
    cool   "put a cool tomato in microwave."   ... "cool tomato 1 with fridge 1"
    look   "look at book under the desklamp."  hold it at the lamp's receptacle with the lamp on ("use")
    two    "put two cd in safe."               two of them in/on the same receptacle of that type

Actions (ALFWorld's phrasing): go to R, open R, close R, take O from R, put O in/on R (also accepted:
"put O in R", "put O on R"), clean O with R, heat O with R, cool O with R, use L, examine R/O, inventory.
Actions are matched after lower-casing and collapsing spaces (a trailing period is ignored). Text that
is not an admissible action now is invalid: "Nothing happens.", the turn is used, nothing changes.
Heating, cooling and cleaning need the object in hand at the microwave, fridge or sinkbasin (not opened);
take and put need the receptacle open. Reward 10 on success (the goal holds after a step), 0 otherwise;
at most `max_steps` (30) turns.

Observation of a step: the feedback sentence (ALFWorld's: "You arrive at countertop 1. On the
countertop 1, you see a apple 1, and a knife 2.", "The fridge 1 is closed.", "You pick up ...") and a
status block that makes the prompt self-contained for a small model: where the agent is and what it
holds with the object's state (GraphGPO's augmentation), the receptacles not looked into yet, where
the objects of the task's type were seen, and the admissible actions. The user message
(`messages()`) is the task line, the last `history` (action, feedback) pairs plus the last one, the
status block and the turn counter (about 230 tokens of the default tiny tokenizer on average, at most
about 320).

Task generation (`generate_task`): deterministic from the task id. Test task i and train task i use
`random.Random("alfworld|<version>|seed<seed>|<split>|<i>[|<attempt>]")`; the type is the i-th of the
six in turn (balanced splits); the room's receptacle counts, the task object and goal receptacle, one to
three instances of the task object (two or three for "two"), four to seven other objects (at most three
objects per receptacle) and, in bedrooms and living rooms, a lamp, are drawn from the table. The task
object never starts in a receptacle of the goal type (nor on the lamp's receptacle). A train task that
equals a test task (same room, placements and goal) is drawn again, so the splits are disjoint.

State and progress. `state_key()` is the location, the held object, the placement of every object, the
open receptacles, the objects made clean/hot/cool and the lamps turned on (what the agent has looked at
is not part of it). `info["progress"]` is the fraction of the task recipe's subgoals that the current
state satisfies: pick = (hold a task object, put it); clean/heat/cool = (hold one, processed, put it);
look = (hold one, lamp on while holding it there); two = (hold the first, put it, hold the second, put
both), where a placed object counts for the holding steps before it.

Expert (`expert_action`): the task type's recipe with only what the agent has observed (no privileged
knowledge of where objects are): take a task object seen in reach; else go to where one was seen; else
search the receptacles not looked into yet, in the object's most-likely-first order of the table,
opening closed ones; then process it at the appliance (clean/heat/cool), and go to the first goal
receptacle (opening it) and put it, or, for look, go to the lamp and use it. Anything else in hand
(after noise) is put down first.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from envs.base import INSTRUCT_FORMAT, Step, TextEnv

DATA_FILE = Path(__file__).resolve().parent / "data" / "alfworld_world.json"
# Bump the number when generation, rules or prompts change; the data hash follows edits of the table.
VERSION = "1." + hashlib.sha256(DATA_FILE.read_bytes()).hexdigest()[:8]

TASK_TYPES = ("pick", "clean", "heat", "cool", "look", "two")
# Which rooms each task type is set in (processing needs the appliance, look needs a lamp).
TASK_SCENES = {
    "pick": ("kitchen", "bathroom", "bedroom", "livingroom"),
    "clean": ("kitchen", "bathroom"),
    "heat": ("kitchen",),
    "cool": ("kitchen",),
    "look": ("bedroom", "livingroom"),
    "two": ("kitchen", "bathroom", "bedroom", "livingroom"),
}
PROCESS = {"clean": "clean", "heat": "hot", "cool": "cool"}  # task type -> object state it needs
VERB_STATE = {"clean": "clean", "heat": "hot", "cool": "cool"}  # action verb -> object state it sets
SCENE_WORDS = {"kitchen": "kitchen", "bathroom": "bathroom", "bedroom": "bedroom", "livingroom": "living room"}
MAX_PER_RECEPTACLE = 3
INVALID_FEEDBACK = "Nothing happens."


@lru_cache(maxsize=1)
def world() -> dict:
    """The world table (envs/data/alfworld_world.json)."""
    return json.loads(DATA_FILE.read_text())


def rtype(name: str) -> str:
    """'cabinet 2' -> 'cabinet'."""
    return name.rsplit(" ", 1)[0]


def _natural(name: str) -> tuple:
    t, _, n = name.rpartition(" ")
    return (t, int(n) if n.isdigit() else 0)


def prep(receptacle: str) -> str:
    return world()["receptacles"][rtype(receptacle)]["prep"]


def openable(receptacle: str) -> bool:
    return bool(world()["receptacles"][rtype(receptacle)]["openable"])


def _a_list(names: list[str]) -> str:
    """ALFWorld's list style: 'a apple 1', 'a apple 1, and a knife 2', 'nothing'."""
    if not names:
        return "nothing"
    items = [f"a {n}" for n in names]
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


def _shown(action: str) -> str:
    """An invalid action as the history shows it: one line, plain characters, at most 60 of them."""
    text = re.sub(r"[^\w /.,'-]", "?", re.sub(r"\s+", " ", str(action)).strip())
    return text if len(text) <= 60 else text[:60] + "..."


# ----------------------------------------------------------------------------------------------
# Task generation
# ----------------------------------------------------------------------------------------------
def _weighted_choice(rng: random.Random, options: list, weights: list):
    x = rng.random() * sum(weights)
    for opt, w in zip(options, weights):
        x -= w
        if x < 0:
            return opt
    return options[-1]


def generate_task(rng: random.Random, task_type: str) -> dict:
    """One task of `task_type`: room, receptacles, object placements, lamp, goal (see module doc)."""
    data = world()
    for _ in range(200):
        scene = rng.choice(TASK_SCENES[task_type])
        spec = data["scenes"][scene]
        receptacles = []
        for rt, lo, hi in spec["receptacles"]:
            receptacles += [f"{rt} {k}" for k in range(1, rng.randint(lo, hi) + 1)]
        present = {rtype(r) for r in receptacles}
        lamp, lamp_at = None, None
        if spec["lamp"]:
            spots = [r for r in receptacles if rtype(r) in spec["lamp_on"]]
            if not spots:
                continue
            lamp, lamp_at = f"{spec['lamp']} 1", rng.choice(spots)
        appliance = data["appliances"].get(task_type)
        candidates = []
        for o in spec["objects"]:
            od = data["objects"][o]
            if not any(p in present for p in od["places"]):
                continue
            if task_type == "look":
                if od["look"]:
                    candidates.append((o, None))
                continue
            if task_type in PROCESS and task_type not in od["props"]:
                continue
            for g in od["goals"]:
                if g in present and g != appliance and any(p in present and p != g for p in od["places"]):
                    candidates.append((o, g))
        if not candidates:
            continue
        obj, goal = rng.choice(candidates)
        n_target = rng.randint(2, 3) if task_type == "two" else rng.randint(1, 2)
        placements: dict[str, str] = {}
        load = {r: 0 for r in receptacles}
        if lamp_at:
            load[lamp_at] += 1
        counts: dict[str, int] = {}

        def place(o: str, banned: set) -> bool:
            od = data["objects"][o]
            ranks = [(i, p) for i, p in enumerate(od["places"]) if p in present and p not in banned]
            for _ in range(20):
                if not ranks:
                    return False
                _, p = _weighted_choice(rng, ranks, [1.0 / (i + 1) for i, _ in ranks])
                spots = [r for r in receptacles if rtype(r) == p and load[r] < MAX_PER_RECEPTACLE
                         and r not in banned]
                if spots:
                    r = rng.choice(spots)
                    counts[o] = counts.get(o, 0) + 1
                    placements[f"{o} {counts[o]}"] = r
                    load[r] += 1
                    return True
            return False

        banned = {goal} if goal else set()
        if lamp_at:
            banned.add(lamp_at)
        if not all(place(obj, banned) for _ in range(n_target)):
            continue
        others = [o for o in spec["objects"] if o != obj
                  and any(p in present for p in data["objects"][o]["places"])]
        for _ in range(rng.randint(4, 7)):
            place(rng.choice(others), set())
        return dict(task_type=task_type, scene=scene, receptacles=receptacles, placements=placements,
                    lamp=lamp, lamp_at=lamp_at, obj=obj, goal=goal,
                    text=goal_text(task_type, obj, goal, lamp))
    raise ValueError(f"could not generate an alfworld {task_type!r} task")  # pragma: no cover


def goal_text(task_type: str, obj: str, goal: Optional[str], lamp: Optional[str]) -> str:
    """ALFWorld's goal phrasing: "put a hot apple in fridge.", "look at book under the desklamp."."""
    if task_type == "look":
        return f"look at {obj} under the {rtype(lamp)}."
    adj = {"pick": "a", "clean": "a clean", "heat": "a hot", "cool": "a cool", "two": "two"}[task_type]
    return f"put {adj} {obj} {world()['receptacles'][goal]['prep']} {goal}."


def parse_task(text: str) -> dict:
    """A hand-written task from JSON (task ids "json:{...}"): keys task_type, scene, receptacles (names in
    listing order), placements ({object: receptacle}), obj, and goal (receptacle type; not for look) or
    lamp and lamp_at (look, optional otherwise). ValueError when it is not a consistent task."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"alfworld json task: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("alfworld json task must be an object")
    data = world()
    t, scene = raw.get("task_type"), raw.get("scene")
    recs, placements = list(raw.get("receptacles") or []), dict(raw.get("placements") or {})
    obj, goal, lamp, lamp_at = raw.get("obj"), raw.get("goal"), raw.get("lamp"), raw.get("lamp_at")
    if t not in TASK_TYPES or scene not in data["scenes"] or obj not in data["objects"]:
        raise ValueError("alfworld json task needs task_type, scene and obj from the world table")
    if not recs or any(rtype(r) not in data["receptacles"] for r in recs) or len(set(recs)) != len(recs):
        raise ValueError("alfworld json task: receptacles must be distinct known names like 'cabinet 1'")
    if any(r not in recs for r in placements.values()) or any(rtype(o) not in data["objects"] for o in placements):
        raise ValueError("alfworld json task: placements must put known objects in listed receptacles")
    if (lamp is None) != (lamp_at is None) or (lamp_at is not None and lamp_at not in recs):
        raise ValueError("alfworld json task: lamp and lamp_at go together, lamp_at a listed receptacle")
    if t == "look" and lamp is None:
        raise ValueError("alfworld json task: a look task needs a lamp")
    if t != "look" and (goal not in data["receptacles"] or not any(rtype(r) == goal for r in recs)):
        raise ValueError("alfworld json task: goal must be a receptacle type present in the room")
    if t in PROCESS and not any(rtype(r) == data["appliances"][t] for r in recs):
        raise ValueError(f"alfworld json task: a {t} task needs a {data['appliances'][t]}")
    return dict(task_type=t, scene=scene, receptacles=recs, placements=placements, lamp=lamp, lamp_at=lamp_at,
                obj=obj, goal=goal if t != "look" else None, text=goal_text(t, obj, goal, lamp))


def task_signature(task: dict) -> str:
    return json.dumps([task["scene"], task["receptacles"], sorted(task["placements"].items()), task["lamp_at"],
                       task["task_type"], task["obj"], task["goal"]])


_TEST_SIGNATURES: dict[str, set] = {}


# ----------------------------------------------------------------------------------------------
# The env
# ----------------------------------------------------------------------------------------------
class ALFWorldEnv(TextEnv):
    """ALFWorld-lite (see the module docstring). Options:

    max_steps: turns per episode (invalid turns count), 30 by default.
    num_train, num_test: tasks per split.
    task_types: the task types used (a subset of pick, clean, heat, cool, look, two), in turn by index.
    seed: task-generation seed.
    history: (action, feedback) pairs shown before the last one (None = all).
    """

    env_id = "alfworld"

    def __init__(self, max_steps: int = 30, num_train: int = 3000, num_test: int = 120,
                 task_types: Optional[tuple] = None, seed: int = 0, history: Optional[int] = 2):
        super().__init__(history=history)
        types = tuple(task_types) if task_types else TASK_TYPES
        if isinstance(task_types, str):
            types = tuple(t.strip() for t in task_types.split(",") if t.strip())
        bad = [t for t in types if t not in TASK_TYPES]
        if bad or not types:
            raise ValueError(f"task_types must be a non-empty subset of {', '.join(TASK_TYPES)}, got {task_types!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if num_train < 1 or num_test < 1:
            raise ValueError("num_train and num_test must be >= 1")
        self.task_types = types
        self.max_turns = int(max_steps)
        self.num_train, self.num_test, self.seed = int(num_train), int(num_test), int(seed)
        self._key = f"v{VERSION}|seed{self.seed}|types{','.join(types)}"
        self.version = f"{self._key}|n{num_train}-{num_test}|steps{max_steps}"
        self.system_prompt = (
            "You are an agent in a household (ALFWorld). Each turn you see the task, what happened, where you "
            "are, what you hold, the receptacles you have not looked into yet, where you saw objects of the "
            "task's type, and the admissible actions. Closed receptacles must be opened to see or take what is "
            "inside. You hold one object at a time. Clean with a sinkbasin, heat with a microwave, cool with "
            "a fridge, and look at an object by holding it where a lamp is and using the lamp. Reply with one "
            f"admissible action, written exactly as listed. You have {self.max_turns} steps. " + INSTRUCT_FORMAT)
        self.task: Optional[dict] = None
        self.task_prompt = ""
        self._clear()

    def _clear(self) -> None:
        self.loc: Optional[str] = None
        self.held: Optional[str] = None
        self.where: dict[str, str] = {}
        self.opened: set[str] = set()
        self.state: dict[str, str] = {}  # object -> "clean" | "hot" | "cool"
        self.lamps_on: set[str] = set()
        self.checked: set[str] = set()
        self.seen: set[str] = set()
        self.feedback_log: list[tuple[str, str]] = []

    # -- tasks ---------------------------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        n = self.num_train if split == "train" else self.num_test
        return [f"{split}-{i}" for i in range(n)]

    def _generate(self, split: str, index: int, attempt: int = 0) -> dict:
        tag = f"alfworld|{self._key}|{split}|{index}" + (f"|{attempt}" if attempt else "")
        return generate_task(random.Random(tag), self.task_types[index % len(self.task_types)])

    def _test_signatures(self) -> set:
        key = f"{self._key}|{self.num_test}"
        if key not in _TEST_SIGNATURES:
            _TEST_SIGNATURES[key] = {task_signature(self._generate("test", i)) for i in range(self.num_test)}
        return _TEST_SIGNATURES[key]

    def get_task(self, task_id: str) -> dict:
        """The task of an id "train-<i>", "test-<i>" or "json:{...}" (see `parse_task`); ValueError otherwise."""
        if str(task_id).startswith("json:"):
            return parse_task(str(task_id)[5:])
        split, _, idx = str(task_id).partition("-")
        n = {"train": self.num_train, "test": self.num_test}.get(split)
        if n is None or not idx.isdigit() or int(idx) >= n:
            raise ValueError(f"unknown alfworld task id {task_id!r}: use train-<0..{self.num_train - 1}>, "
                             f"test-<0..{self.num_test - 1}> or json:{{...}}")
        return _cached_task(self, split, int(idx))

    # -- protocol ------------------------------------------------------------------------------
    def _reset(self, task_id: str) -> str:
        self.task = self.get_task(task_id)
        self._clear()
        self.where = dict(self.task["placements"])
        self.task_prompt = f"Task: {self.task['text']}"
        return self.status()

    def _step(self, action: str) -> Step:
        canon = self._match(action)
        if canon is None:
            feedback, invalid = INVALID_FEEDBACK, True
        else:
            feedback, invalid = self._apply(canon), False
        success = self.task is not None and self._goal_met()
        info = {"success": success, "invalid": invalid, "progress": self.progress(),
                "task_type": self.task["task_type"] if self.task else None}
        self.feedback_log.append((canon or _shown(action), feedback))
        return Step(self._observe(feedback), 10.0 if success else 0.0, success, info)

    # -- actions -------------------------------------------------------------------------------
    def _visible(self, r: str) -> bool:
        return not openable(r) or r in self.opened

    def _contents(self, r: str) -> list[str]:
        items = [o for o, at in self.where.items() if at == r]
        if self.task and self.task["lamp_at"] == r:
            items.append(self.task["lamp"])
        return sorted(items, key=_natural)

    def admissible_actions(self) -> list[str]:
        """Canonical admissible actions now: the ones at the current receptacle, then go to, examine,
        inventory."""
        if self.task is None:
            return []
        out = []
        r, h = self.loc, self.held
        if r is not None:
            if openable(r) and r not in self.opened:
                out.append(f"open {r}")
            if self._visible(r):
                if h is None:
                    out += [f"take {o} from {r}" for o in self._contents(r) if o != self.task["lamp"]]
                else:
                    out.append(f"put {h} in/on {r}")
            if h is not None:
                verb = {"sinkbasin": "clean", "microwave": "heat", "fridge": "cool"}.get(rtype(r))
                if verb:
                    out.append(f"{verb} {h} with {r}")
            if self.task["lamp_at"] == r:
                out.append(f"use {self.task['lamp']}")
            if openable(r) and r in self.opened:
                out.append(f"close {r}")
        out += [f"go to {x}" for x in self.task["receptacles"] if x != r]
        if r is not None:
            out.append(f"examine {r}")
        if h is not None:
            out.append(f"examine {h}")
        out.append("inventory")
        return out

    def _match(self, action: str) -> Optional[str]:
        """The canonical admissible action that `action` spells, else None."""
        if not isinstance(action, str) or len(action) > 200:
            return None
        text = re.sub(r"\s+", " ", action.strip().lower()).rstrip(".").strip()
        if not text:
            return None
        for canon in self.admissible_actions():
            if text == canon:
                return canon
            if canon.startswith("put ") and " in/on " in canon:
                if text in (canon.replace(" in/on ", " in "), canon.replace(" in/on ", " on ")):
                    return canon
        return None

    def _describe(self, r: str) -> str:
        if not self._visible(r):
            return f"The {r} is closed."
        self.checked.add(r)
        items = self._contents(r)
        self.seen.update(o for o in items if o in self.where)
        head = f"The {r} is open. In it" if openable(r) else f"{prep(r).capitalize()} the {r}"
        return f"{head}, you see {_a_list(items)}."

    def _apply(self, canon: str) -> str:
        words = canon.split(" ")
        verb = words[0]
        if canon.startswith("go to "):
            self.loc = canon[6:]
            return f"You arrive at {self.loc}. {self._describe(self.loc)}"
        if verb == "open":
            self.opened.add(self.loc)
            return f"You open the {self.loc}. {self._describe(self.loc)}"
        if verb == "close":
            self.opened.discard(self.loc)
            return f"You close the {self.loc}."
        if verb == "take":
            obj = canon[5:].split(" from ")[0]
            del self.where[obj]
            self.held = obj
            return f"You pick up the {obj} from the {self.loc}."
        if verb == "put":
            obj = self.held
            self.where[obj] = self.loc
            self.seen.add(obj)
            self.held = None
            return f"You put the {obj} {prep(self.loc)} the {self.loc}."
        if verb in VERB_STATE:
            self.state[self.held] = VERB_STATE[verb]
            return f"You {verb} the {self.held} using the {self.loc}."
        if verb == "use":
            self.lamps_on.add(self.task["lamp"])
            return f"You turn on the {self.task['lamp']}."
        if verb == "examine":
            target = canon[8:]
            if target == self.loc:
                return self._describe(self.loc)
            st = self.state.get(target)
            return f"This is a {st} {target}." if st else f"There's nothing special about {target}."
        if verb == "inventory":
            return f"You are carrying: a {self._held_text()}." if self.held else "You are not carrying anything."
        return INVALID_FEEDBACK  # pragma: no cover (every admissible verb is handled above)

    # -- goal and progress ---------------------------------------------------------------------
    def _matches(self, o: Optional[str]) -> bool:
        return o is not None and rtype(o) == self.task["obj"]

    def _ok(self, o: str) -> bool:
        need = PROCESS.get(self.task["task_type"])
        return self._matches(o) and (need is None or self.state.get(o) == need)

    def _placed(self) -> list[str]:
        """Task objects already where the goal wants them (with the needed state)."""
        g = self.task["goal"]
        return [o for o, r in self.where.items() if g and rtype(r) == g and self._ok(o)]

    def _goal_counts(self) -> list[tuple[str, int]]:
        """Goal receptacles with how many task objects each holds, most first (ties: listing order)."""
        g = self.task["goal"]
        goals = [r for r in self.task["receptacles"] if rtype(r) == g]
        placed = self._placed()
        counts = [(r, sum(self.where[o] == r for o in placed)) for r in goals]
        return sorted(counts, key=lambda rc: -rc[1])

    def _best_goal_count(self) -> int:
        return self._goal_counts()[0][1] if self.task["goal"] else 0

    def _goal_met(self) -> bool:
        t = self.task["task_type"]
        if t == "look":
            return (self._matches(self.held) and self.loc == self.task["lamp_at"]
                    and self.task["lamp"] in self.lamps_on)
        if t == "two":
            return self._best_goal_count() >= 2
        return bool(self._placed())

    def progress(self) -> float:
        """Fraction of the recipe's subgoals that the current state satisfies (see module doc)."""
        if self.task is None:
            return 0.0
        t = self.task["task_type"]
        if self._goal_met():
            return 1.0
        holding = self._matches(self.held)
        if t == "pick":
            return 0.5 if holding else 0.0
        if t in PROCESS:
            return 2 / 3 if holding and self._ok(self.held) else (1 / 3 if holding else 0.0)
        if t == "look":
            return 0.5 if holding else 0.0
        placed = self._best_goal_count()  # "two": 0 or 1 placed here
        return (2 * placed + (1 if holding else 0)) / 4

    # -- rendering -----------------------------------------------------------------------------
    def _held_text(self) -> str:
        if self.held is None:
            return "nothing"
        st = self.state.get(self.held)
        return f"{self.held} ({st})" if st else self.held

    def status(self) -> str:
        """Location, held object, unchecked receptacles, sightings of the task object, actions."""
        if self.task is None:
            return ""
        at = f"at {self.loc}" if self.loc else f"in the middle of the {SCENE_WORDS[self.task['scene']]}"
        lines = [f"You are {at}, holding {self._held_text()}."]
        unchecked = [r for r in self.task["receptacles"] if r not in self.checked]
        if unchecked:
            lines.append("Not looked in: " + ", ".join(unchecked) + ".")
        sightings = sorted((o for o in self.seen if o in self.where and self._matches(o)), key=_natural)
        if sightings:
            lines.append("Seen: " + ", ".join(f"{o} {prep(self.where[o])} {self.where[o]}" for o in sightings) + ".")
        lines.append("Actions: " + ", ".join(self.admissible_actions()))
        return "\n".join(lines)

    def _observe(self, feedback: str) -> str:
        return f"{feedback}\n{self.status()}"

    def messages(self) -> list[dict]:
        """System prompt, then one user message: the task, the recent (action, feedback) pairs, the
        status block (location, holding, unchecked receptacles, sightings, actions), the turn counter."""
        parts = [self.task_prompt] if self.task_prompt else []
        log = self.feedback_log
        if self.history is not None:
            log = log[-(self.history + 1):]
        if log:
            parts.append("\n".join(f"> {a}\n{f}" for a, f in log))
        parts.append(self.status())
        parts.append(self._turn_footer())
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n".join(p for p in parts if p)}]

    def state_key(self) -> str:
        if self.task is None:
            return ""
        place = ",".join(f"{o}@{r}" for o, r in sorted(self.where.items(), key=lambda kv: _natural(kv[0])))
        states = ",".join(f"{o}:{s}" for o, s in sorted(self.state.items(), key=lambda kv: _natural(kv[0])))
        return (f"at={self.loc or '-'}|hold={self.held or '-'}|{place}|open={','.join(sorted(self.opened, key=_natural))}"
                f"|state={states}|on={','.join(sorted(self.lamps_on))}")

    # -- expert --------------------------------------------------------------------------------
    def _go_or(self, r: str, action: str) -> str:
        """`action` when at r (opening r first when it is closed), else go to r."""
        if self.loc != r:
            return f"go to {r}"
        if openable(r) and r not in self.opened:
            return f"open {r}"
        return action

    def expert_action(self) -> str:
        """The recipe's next action from what the agent has observed (see module doc)."""
        if self.task is None:
            return "inventory"
        t, task = self.task["task_type"], self.task
        h = self.held
        if h is not None and not self._matches(h):  # put down what is in the way
            if self.loc is None:
                return f"go to {task['receptacles'][0]}"
            return self._go_or(self.loc, f"put {h} in/on {self.loc}")
        if h is not None:
            need = PROCESS.get(t)
            if need and self.state.get(h) != need:
                app = next(r for r in task["receptacles"] if rtype(r) == world()["appliances"][t])
                verb = {"clean": "clean", "hot": "heat", "cool": "cool"}[need]
                return f"{verb} {h} with {app}" if self.loc == app else f"go to {app}"
            if t == "look":
                return f"use {task['lamp']}" if self.loc == task["lamp_at"] else f"go to {task['lamp_at']}"
            goal = self._goal_counts()[0][0]  # "two": the one that already has one, else the first
            return self._go_or(goal, f"put {h} in/on {goal}")
        # Hands empty: a task object in reach, else one seen elsewhere, else search. Objects already in
        # the goal receptacle stay there ("two": the goal receptacle with the most).
        done = set()
        if task["goal"]:
            best = self._goal_counts()[0][0]
            done = {o for o in self._placed() if self.where[o] == best}
        known = sorted((o for o in self.seen if o in self.where and self._matches(o) and o not in done),
                       key=lambda o: (self.where[o] != self.loc, _natural(self.where[o]), _natural(o)))
        if known:
            o = known[0]
            return self._go_or(self.where[o], f"take {o} from {self.where[o]}")
        if self.loc is not None and openable(self.loc) and self.loc not in self.opened and self.loc not in self.checked:
            return f"open {self.loc}"
        order = world()["objects"][task["obj"]]["places"]
        unchecked = [r for r in task["receptacles"] if r not in self.checked]
        ranked = sorted((r for r in unchecked if rtype(r) in order),
                        key=lambda r: (order.index(rtype(r)), task["receptacles"].index(r)))
        if ranked:
            return f"go to {ranked[0]}"
        if unchecked:
            return f"go to {unchecked[0]}"
        return "inventory"  # nothing left to find (not reached on generated tasks)


def _cached_task(env: ALFWorldEnv, split: str, index: int) -> dict:
    """The task of (split, index), generated once per process; train tasks equal to a test task are
    drawn again."""
    cache_key = (env._key, env.num_test if split == "train" else 0, split, index)
    hit = _TASKS.get(cache_key)
    if hit is not None:
        return hit
    task = env._generate(split, index)
    if split == "train":
        banned = env._test_signatures()
        attempt = 0
        while task_signature(task) in banned:
            attempt += 1
            task = env._generate(split, index, attempt)
    _TASKS[cache_key] = task
    return task


_TASKS: dict = {}
