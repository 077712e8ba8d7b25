"""The text-environment protocol shared by every env (docs/design.md, "Envs").

Single-agent envs subclass `TextEnv`; two-player games subclass `TwoPlayerEnv`, are played with their
seats filled (a policy or a scripted style each) through `Seated`, and become single-agent envs against a
scripted opponent through `vs_opponent` (both in `envs/__init__.py`).

Action parsing is shared: `extract_action(text)` takes the content of the last `<action>...</action>`
tag (after an optional `<think>...</think>`) when tags are present, else the whole text, stripped.
Envs parse what it returns and never raise on any string.
"""

from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional

MAX_ACTION_CHARS = 2000  # longer model outputs are cut before parsing (they are invalid anyway)

_ACTION_TAG = re.compile(r"<action>(.*?)(?:</action>|$)", re.IGNORECASE | re.DOTALL)
_THINK_TAG = re.compile(r"<think>.*?(?:</think>|$)", re.IGNORECASE | re.DOTALL)

INSTRUCT_FORMAT = (
    "Think briefly inside <think>...</think>, then give exactly one action inside <action>...</action>."
)


def extract_action(text: Any) -> str:
    """Return the action string in a raw model output (never raises).

    `<think>..</think><action>up</action>` -> "up"; "up" -> "up"; non-strings -> "".
    """
    if not isinstance(text, str):
        return ""
    text = text[:MAX_ACTION_CHARS]
    tags = _ACTION_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    return _THINK_TAG.sub("", text).strip()


def clone_env(env):
    """An independent copy of `env` in its current state (a `TextEnv`, `TwoPlayerEnv` or `Seated` game):
    stepping the copy leaves the original as it was, and the copy continues exactly as the original would
    (scripted opponents keep no hidden state beyond the game's). Read-only data tables named in a class's
    `shared_data` (levels, word tables, catalogues) are shared, not copied. Monte Carlo rollouts from a
    saved state use it (benchmarks/credit_quality.py)."""
    memo, stack, seen = {}, [env], set()
    while stack:  # the env and every env it wraps (Seated -> game, VsOpponent -> game and its seats)
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for name in getattr(type(obj), "shared_data", ()):
            if hasattr(obj, name):
                value = getattr(obj, name)
                memo[id(value)] = value
        stack.extend(v for v in vars(obj).values() if hasattr(type(v), "shared_data"))
    return copy.deepcopy(env, memo)


@dataclass
class Step:
    """What `env.step` returns. `info` always has the bools "success" and "invalid"."""

    observation: str
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class TextEnv:
    """Base class of the single-agent text envs.

    Subclasses set `env_id`, `max_turns`, `system_prompt`, and implement `task_ids`, `_reset`,
    `_step`, `state_key`, `expert_action` and `_render_state` (the current observation text).
    The base class keeps the history of (action, observation) pairs and renders the chat prompt in
    `messages()`, the one place where prompts are built.
    """

    env_id: str = "base"
    max_turns: int = 1
    system_prompt: str = ""
    shared_data: tuple = ()  # attributes holding read-only data that clones share (see `clone_env`)
    # Text before the first observation, e.g. the rules or the instruction of the task.
    task_prompt: str = ""

    def __init__(self, history: Optional[int] = 2, instructions: bool = True):
        """`history`: how many past (action, observation) pairs the user message shows (None = all).
        `instructions=False` leaves `task_prompt` (task line, legend, action list) out of the user
        message; the system prompt keeps it. The tiny policies use it: their chat template drops the
        system message and they read no instructions, so the shorter prompt only saves compute."""
        if history is not None and history < 0:
            raise ValueError(f"history must be None or >= 0, got {history}")
        self.history = history
        self.instructions = bool(instructions)
        self.turn = 0
        self.done = False
        self.trajectory: list[tuple[str, str]] = []  # (action text as parsed, observation)
        self.task_id: Optional[str] = None
        self._last_obs = ""

    # -- protocol ------------------------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        raise NotImplementedError

    def clone(self) -> "TextEnv":
        """An independent copy in the current state (`clone_env`)."""
        return clone_env(self)

    def reset(self, task_id: str) -> str:
        self.task_id = str(task_id)
        self.turn = 0
        self.done = False
        self.trajectory = []
        self._last_obs = self._reset(self.task_id)
        return self._last_obs

    def step(self, text: Any) -> Step:
        if self.task_id is None:
            raise RuntimeError("call env.reset(task_id) before env.step")
        action = extract_action(text)
        if self.done:
            return Step(self._last_obs, 0.0, True, {"success": False, "invalid": True, "note": "episode over"})
        step = self._step(action)
        self.turn += 1
        step.info.setdefault("success", False)
        step.info.setdefault("invalid", False)
        step.info["success"] = bool(step.info["success"])
        step.info["invalid"] = bool(step.info["invalid"])
        if self.turn >= self.max_turns and not step.done:
            step.done = True
            step.info["truncated"] = True
        self.done = step.done
        shown = action if len(action) <= 200 else action[:200] + "..."
        self.trajectory.append((shown, step.observation))
        self._last_obs = step.observation
        return step

    def messages(self) -> list[dict]:
        """Chat messages for the current turn: system prompt, then one user message with the task,
        the last `history` (action, observation) pairs and the current observation."""
        parts = [self.task_prompt] if self.task_prompt and self.instructions else []
        past = self.trajectory[:-1]
        if self.history is not None:
            past = past[-self.history:] if self.history else []
        if past:
            parts.append("History:\n" + "\n".join(f"Action: {a}\nObservation: {o}" for a, o in past))
        if self.trajectory:
            parts.append(f"Last action: {self.trajectory[-1][0]}\nObservation: {self._last_obs}")
        else:
            parts.append(f"Observation: {self._last_obs}")
        parts.append(self._turn_footer())
        content = "\n".join(p for p in parts if p)
        return [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": content},
        ]

    def _turn_footer(self) -> str:
        return f"Turn {self.turn + 1} of {self.max_turns}."

    def state_key(self) -> Hashable:
        raise NotImplementedError

    def expert_action(self) -> str:
        raise NotImplementedError

    # -- optional ------------------------------------------------------------------------------
    def admissible_actions(self) -> list[str]:
        """Canonical actions admissible now (used for noisy demos and random baselines)."""
        return []

    def progress(self) -> Optional[float]:
        """How far the current state is towards solving the task, in [0, 1] (the same value as
        `info["progress"]` where the env reports one); None (the default) when the env does not measure it."""
        return None

    def guess_text(self, target: str) -> Optional[str]:
        """The env's canonical wording of a final guess of `target` ("Is it a cat?"), for a method that asks
        the policy about every possible target; None (the default) when the env has no guesses."""
        return None

    def corrupt_action(self, rng) -> str:
        """An action that is wrong or invalid (noise for demos): a random admissible one by default."""
        acts = self.admissible_actions()
        return rng.choice(acts) if acts else "???"

    # -- subclass hooks ------------------------------------------------------------------------
    def _reset(self, task_id: str) -> str:
        raise NotImplementedError

    def _step(self, action: str) -> Step:
        raise NotImplementedError


class QuestionGameEnv(TextEnv):
    """A guessing game against a rule-based answerer (Twenty Questions, Guess My City): what its prompt,
    admissible actions and noise moves have in common. A subclass sets `canonical_questions`,
    `guess_targets` (every guessable answer, which are also the task ids), `table` (with `splits`:
    answer -> "train" or "test"), `candidates_label` ("words", "cities"), `target`, and implements
    `candidates()` and `guess_text(target)`.

    The user message: the task line (unless `instructions=False`), the numbered questions and answers
    of the history window (`numbered=False`: one "<question> <answer>" line per turn, without
    the number and the Q:/A: markers, about a third fewer tokens), the still-possible answers once at most
    `show_candidates` are left, and the question counter."""

    canonical_questions: list = []
    guess_targets: list = []
    show_candidates: int = 0
    shared_data = ("table", "canonical_questions", "guess_targets", "words", "attributes", "cities", "yesno")
    candidates_label: str = "answers"
    target: Optional[str] = None

    def __init__(self, history: Optional[int] = None, show_candidates: int = 5, instructions: bool = True,
                 numbered: bool = True):
        super().__init__(history=history, instructions=instructions)
        if show_candidates < 0:
            raise ValueError(f"show_candidates must be >= 0, got {show_candidates}")
        self.show_candidates = int(show_candidates)
        self.numbered = bool(numbered)

    def task_ids(self, split: str) -> list[str]:
        """The answers of a split, in the table's order; the subclass's `table.splits` maps each answer to
        "train" or "test"."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return [t for t in self.guess_targets if self.table.splits[t] == split]

    def candidates(self) -> list:
        raise NotImplementedError

    def guess_text(self, target: str) -> str:
        raise NotImplementedError

    def admissible_actions(self) -> list[str]:
        return list(self.canonical_questions) + [self.guess_text(t) for t in self.guess_targets]

    def corrupt_action(self, rng) -> str:
        """A noise move for demonstrations: a canonical question or a guess, half and half; `rng` is a
        `random.Random` or a numpy Generator."""
        pool = (list(self.canonical_questions) if rng.random() < 0.5
                else [self.guess_text(t) for t in self.guess_targets])
        if hasattr(rng, "integers"):
            return pool[int(rng.integers(len(pool)))]
        return pool[rng.randrange(len(pool))]

    def messages(self) -> list[dict]:
        parts = [self.task_prompt] if self.instructions and self.task_prompt else []
        items = list(enumerate(self.trajectory, 1))
        if self.history is not None:
            items = items[-self.history:] if self.history else []
        if len(items) < len(self.trajectory):
            parts.append(f"({len(self.trajectory) - len(items)} earlier questions not shown)")
        if items:
            parts.extend(f"{i}. Q: {q} A: {a}" if self.numbered else f"{q} {a}" for i, (q, a) in items)
        elif not self.trajectory:
            parts.append("No questions asked yet.")
        if self.target is not None and self.show_candidates:  # kept after the end (the last belief's prompt)
            cands = self.candidates()
            if len(cands) <= self.show_candidates:
                parts.append(f"Possible {self.candidates_label}: " + ", ".join(cands) + ".")
        parts.append(self._turn_footer())
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n".join(parts)}]

    def _turn_footer(self) -> str:
        """"Question k of N:"; after a game lost at the limit it stays at N, so the prompt the last belief is
        elicited on has the format of the turns played (not "Question N+1 of N:")."""
        return f"Question {min(self.turn + 1, self.max_turns)} of {self.max_turns}:"


class TwoPlayerEnv:
    """Alternating-turn two-player game protocol (bargaining, negotiation).

    `players` names the roles, `current_player` is who acts now, `observe(player)` renders that
    player's private view as chat messages, `step(text)` applies the current player's raw text,
    `done` and `payoffs()` end the game. Unparseable text is invalid: the same player acts again
    (at most `max_invalid` times in a row, then the game ends with no deal).
    """

    env_id: str = "two_player"
    players: tuple[str, ...] = ("A", "B")
    max_rounds: int = 1
    shared_data: tuple = ()
    system_prompt_override: Optional[str] = None  # every player's system message (envs.make(system_prompt=))

    def task_ids(self, split: str) -> list[str]:
        raise NotImplementedError

    def clone(self) -> "TwoPlayerEnv":
        """An independent copy in the current state (`clone_env`)."""
        return clone_env(self)

    def reset(self, task_id: str) -> None:
        raise NotImplementedError

    @property
    def current_player(self) -> str:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    def observe(self, player: str) -> list[dict]:
        raise NotImplementedError

    def step(self, text: Any) -> Step:
        raise NotImplementedError

    def payoffs(self) -> dict[str, float]:
        raise NotImplementedError

    def expert_action(self, player: Optional[str] = None) -> str:
        raise NotImplementedError

    # -- used by Seated, vs_opponent and the tiny demos ------------------------------------------
    def opponent_styles(self) -> list[str]:
        """Names of the scripted opponent styles (e.g. "tough", "fair", "conceding", "tit_for_tat")."""
        raise NotImplementedError

    def scripted_action(self, player: str, style: str) -> str:
        """The move of a scripted player of the given style, as text, for the current state."""
        raise NotImplementedError

    def system_prompt_for(self, player: str) -> str:
        raise NotImplementedError

    def last_view(self, player: str) -> str:
        """The latest observation text for `player` (what the other side said, or the opening)."""
        raise NotImplementedError

    def max_turns_per_player(self) -> int:
        """The most moves one player can make in a game (its horizon in single-agent form)."""
        raise NotImplementedError

    def admissible_actions(self, player: str) -> list[str]:
        return []

    def state_key(self) -> Hashable:
        raise NotImplementedError

    # -- outcome, read by the methods ---------------------------------------------------------------
    deal_round: Optional[int] = None  # the round in which a deal was made; None while there is none

    def winner(self) -> Optional[str]:
        """The player whose payoff is higher at the end; None for a tie or without a deal."""
        raise NotImplementedError

    def progress(self, player: str) -> float:
        """`player`'s deal position in [0, 1] (0 by default, for a game that does not measure it)."""
        return 0.0

    def scores(self) -> dict[str, float]:
        """Each player's score on a 0-10 scale (EPO's outcome is score / 10); by default 10 x progress."""
        return {p: 10.0 * float(self.progress(p)) for p in self.players}

    # -- strategy moves (EPO): games in `envs.STRATEGY_MOVES` take `moves="strategy"` -------------------
    moves_mode: Optional[str] = None  # "utterance" or "strategy" in such a game; None in the others

    @contextlib.contextmanager
    def utterance_moves(self):
        """Within the block, messages are read (and shown) as utterance moves, not strategies: what EPO's base
        agent writes and sees. Nothing changes in a game without strategy moves."""
        old = self.moves_mode
        if old is not None:
            self.moves_mode = "utterance"
        try:
            yield
        finally:
            if old is not None:
                self.moves_mode = old

    def strategy_understood(self, strategy: str) -> bool:
        """Whether the game's strategy-following rule agent understands `strategy` (True by default)."""
        return True

    def rule_agent_action(self, player: str, strategy: str) -> str:
        """The move of the strategy-following rule agent of `player` (games with strategy moves only)."""
        raise NotImplementedError
