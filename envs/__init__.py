"""Text environments: `envs.make(env_id, **options)`, `envs.Seated(env, seats)` and `envs.vs_opponent(...)`.

Every env follows the protocol in `envs/base.py` (docs/design.md, "Envs").
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Hashable, Optional

from envs.base import INSTRUCT_FORMAT, Step, TextEnv, TwoPlayerEnv, clone_env, extract_action

# env id -> "module:Class"; modules are imported on first use.
REGISTRY = {
    "sokoban": "envs.sokoban:SokobanEnv",
    "twenty_questions": "envs.twenty_questions:TwentyQuestionsEnv",
    "guess_my_city": "envs.guess_my_city:GuessMyCityEnv",
    "bargaining": "envs.bargaining:BargainingEnv",
    "negotiation": "envs.negotiation:NegotiationEnv",
    "webshop": "envs.webshop:WebShopEnv",
    "alfworld": "envs.alfworld:ALFWorldEnv",
}

TWO_PLAYER = ("bargaining", "negotiation")
STRATEGY_MOVES = ("negotiation",)  # games whose moves can be strategies: make(env_id, moves="strategy")


def available() -> list[str]:
    """The env ids whose module is present in this checkout."""
    out = []
    for env_id, target in REGISTRY.items():
        mod = target.split(":")[0]
        if importlib.util.find_spec(mod) is not None:
            out.append(env_id)
    return out


def make(env_id: str, **options: Any):
    """Build an env by id. Unknown id -> ValueError listing the known ids.

    `system_prompt="..."` (any env) replaces the env's system message, for every player of a two-player
    game: a fine-tuned policy that learned the rules from demonstrations needs one line, not the rules
    (the SmolLM2 starting policies, common/smollm2.py)."""
    if env_id not in REGISTRY or env_id not in available():
        raise ValueError(f"unknown env id {env_id!r}; known env ids: {', '.join(available())}")
    system_prompt = options.pop("system_prompt", None)
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"system_prompt must be a string, got {system_prompt!r}")
    module, cls = REGISTRY[env_id].split(":")
    env = getattr(importlib.import_module(module), cls)(**options)
    if system_prompt is not None and isinstance(env, TextEnv):
        env.system_prompt = system_prompt
    elif system_prompt is not None:
        env.system_prompt_override = system_prompt
    return env


class Seated:
    """A game with its seats filled: the one way the methods play an env (docs/envs.md, "Seated games").

    `seats` maps each player of a two-player game to "policy" (its moves come from outside, through
    `step`) or to one of the game's scripted styles (`opponent_styles()`); the default seats the policy
    everywhere (self-play). A single-agent env (a `TextEnv`) has one seat, "agent", the policy's.
    Scripted seats move by themselves, in `reset` when they open and in `step` after a policy move,
    until a policy seat is to act or the game is over: `current_player` is always a policy seat.

    `step(text)` plays the current player's raw text (the game parses it; text it cannot parse is an
    invalid move and the same player acts again) and returns a `Step` from that player's side after
    the scripted replies: its view, its payoff once the game is over (else 0), and in `info`, beside
    the game's own keys, "success" (its payoff beats the other's), "payoffs" ({} before the end),
    "progress" (its deal position), "progress_by_player" and, at the end, "scores". A single-agent
    env's `Step` is passed on as it is.
    """

    shared_data: tuple = ()  # none of its own; `clone_env` shares the game's

    def __init__(self, env, seats: Optional[dict] = None):
        self.env = env
        self.two_player = isinstance(env, TwoPlayerEnv)
        self.players = tuple(env.players) if self.two_player else ("agent",)
        self.seats = dict(seats) if seats is not None else {p: "policy" for p in self.players}
        if sorted(self.seats) != sorted(self.players) or "policy" not in self.seats.values():
            raise ValueError(f"seats must name each player of {self.players} and seat the policy at least once, "
                             f"got {seats!r}")
        styles = env.opponent_styles() if self.two_player else []
        for style in self.seats.values():
            if style != "policy" and style not in styles:
                raise ValueError(f"unknown opponent style {style!r}; known: {', '.join(styles)}")
        self._progress = 0.0  # single agent: the last info["progress"] the env reported

    @property
    def task_id(self) -> Optional[str]:
        return self.env.task_id

    def clone(self) -> "Seated":
        """An independent copy of the game and its seats in the current state (`clone_env`)."""
        return clone_env(self)

    @property
    def done(self) -> bool:
        return self.env.done

    @property
    def current_player(self) -> str:
        return self.env.current_player if self.two_player else "agent"

    def reset(self, task_id: str) -> "Seated":
        self.env.reset(task_id)
        self._progress = 0.0
        self._scripted_moves()
        return self

    def _scripted_moves(self) -> None:
        while self.two_player and not self.env.done and self.seats[self.env.current_player] != "policy":
            player = self.env.current_player
            self.env.step(self.env.scripted_action(player, self.seats[player]))

    def observe(self, player: str) -> list[dict]:
        """`player`'s chat messages now (a single-agent env's `messages()`)."""
        return self.env.observe(player) if self.two_player else self.env.messages()

    def progress(self, player: str) -> float:
        """`player`'s progress now: its deal position, or a single-agent env's last reported progress."""
        return float(self.env.progress(player)) if self.two_player else self._progress

    def step(self, text: Any) -> Step:
        if not self.two_player:
            step = self.env.step(text)
            self._progress = float(step.info.get("progress", self._progress))
            return step
        game, player = self.env, self.env.current_player
        step = game.step(text)
        self._scripted_moves()
        other = [p for p in self.players if p != player][0]
        done = game.done
        pay = game.payoffs() if done else {}
        info = dict(step.info)
        info["invalid"] = bool(step.info.get("invalid", False))
        info["success"] = bool(done and pay.get(player, 0.0) > pay.get(other, 0.0))
        info["payoffs"] = pay
        # after the scripted replies, from the player's side
        info["progress"] = float(game.progress(player))
        info["progress_by_player"] = {p: float(game.progress(p)) for p in self.players}
        if done:
            info["scores"] = game.scores()
        return Step(game.last_view(player), float(pay.get(player, 0.0)) if done else 0.0, done, info)


class VsOpponent(TextEnv):
    """A two-player game seen by one learner role, the other role played by a scripted opponent.

    The single-agent protocol holds: `reset`, `step` (the learner's raw text), `messages()` (the
    learner's private view), `state_key`, `expert_action`. It is a `Seated` game with the learner's
    seat the policy's: the opponent moves inside `reset` (when it opens) and inside `step` (after the
    learner). Reward is the learner's payoff at the end; `info["success"]` is a win (the learner's
    payoff is higher than the opponent's).
    """

    def __init__(self, game: TwoPlayerEnv, opponent: str = "rule:fair", learner: Optional[str] = None):
        super().__init__(history=None)
        self.game = game
        self.env_id = game.env_id
        self.learner = learner or game.players[0]
        if self.learner not in game.players:
            raise ValueError(f"learner must be one of {game.players}, got {learner!r}")
        self.opponent_role = [p for p in game.players if p != self.learner][0]
        if not opponent.startswith("rule:"):
            raise ValueError(f"opponent must look like 'rule:<style>', got {opponent!r}")
        self.opponent_style = opponent.split(":", 1)[1]
        self.seated = Seated(game, {self.learner: "policy", self.opponent_role: self.opponent_style})
        self.max_turns = game.max_turns_per_player()
        self.system_prompt = game.system_prompt_for(self.learner)
        self.target = getattr(game, "target", None)

    def task_ids(self, split: str) -> list[str]:
        return self.game.task_ids(split)

    def _reset(self, task_id: str) -> str:
        self.seated.reset(task_id)
        return self.game.last_view(self.learner)

    def _step(self, action: str) -> Step:
        return self.seated.step(action)

    def messages(self) -> list[dict]:
        return self.game.observe(self.learner)

    def state_key(self) -> Hashable:
        return self.game.state_key()

    def expert_action(self) -> str:
        return self.game.expert_action(self.learner)

    def admissible_actions(self) -> list[str]:
        return self.game.admissible_actions(self.learner)


def vs_opponent(env: TwoPlayerEnv, opponent: str = "rule:fair", learner: Optional[str] = None) -> VsOpponent:
    """Turn a two-player game into a single-agent env for `learner` against a scripted opponent."""
    return VsOpponent(env, opponent=opponent, learner=learner)


__all__ = ["make", "available", "Seated", "vs_opponent", "VsOpponent", "Step", "TextEnv", "TwoPlayerEnv",
           "extract_action", "clone_env", "INSTRUCT_FORMAT", "REGISTRY", "TWO_PLAYER"]
