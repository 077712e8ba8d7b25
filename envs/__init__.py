"""Text environments: `envs.make(env_id, **options)` and `envs.vs_opponent(...)`.

Every env follows the protocol in `envs/base.py` (docs/design.md, "Envs").
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Hashable, Optional

from envs.base import INSTRUCT_FORMAT, Step, TextEnv, TwoPlayerEnv, extract_action

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
    """Build an env by id. Unknown id -> ValueError listing the known ids."""
    if env_id not in REGISTRY or env_id not in available():
        raise ValueError(f"unknown env id {env_id!r}; known env ids: {', '.join(available())}")
    module, cls = REGISTRY[env_id].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


class VsOpponent(TextEnv):
    """A two-player game seen by one learner role, the other role played by a scripted opponent.

    The single-agent protocol holds: `reset`, `step` (the learner's raw text), `messages()` (the
    learner's private view), `state_key`, `expert_action`. The opponent moves inside `reset` (when it
    opens) and inside `step` (after the learner). Reward is the learner's payoff at the end;
    `info["success"]` is a win (the learner's payoff is higher than the opponent's).
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
        styles = game.opponent_styles()
        if self.opponent_style not in styles:
            raise ValueError(f"unknown opponent style {self.opponent_style!r}; known: {', '.join(styles)}")
        self.max_turns = game.max_turns_per_player()
        self.system_prompt = game.system_prompt_for(self.learner)
        self.target = getattr(game, "target", None)

    def task_ids(self, split: str) -> list[str]:
        return self.game.task_ids(split)

    def _opponent_moves(self) -> None:
        while not self.game.done and self.game.current_player == self.opponent_role:
            self.game.step(self.game.scripted_action(self.opponent_role, self.opponent_style))

    def _reset(self, task_id: str) -> str:
        self.game.reset(task_id)
        self._opponent_moves()
        return self.game.last_view(self.learner)

    def _step(self, action: str) -> Step:
        step = self.game.step(action)
        invalid = step.info.get("invalid", False)
        if not invalid:
            self._opponent_moves()
        done = self.game.done
        pay = self.game.payoffs() if done else {}
        reward = float(pay.get(self.learner, 0.0)) if done else 0.0
        info = dict(step.info)
        info["invalid"] = invalid
        info["success"] = bool(done and pay.get(self.learner, 0.0) > pay.get(self.opponent_role, 0.0))
        info["payoffs"] = pay
        # after the opponent's reply, from the learner's side
        info["progress"] = float(self.game.progress(self.learner))
        info["progress_by_player"] = {p: float(self.game.progress(p)) for p in self.game.players}
        if done:
            info["scores"] = self.game.scores()
        return Step(self.game.last_view(self.learner), reward, done, info)

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


__all__ = ["make", "available", "vs_opponent", "VsOpponent", "Step", "TextEnv", "TwoPlayerEnv",
           "extract_action", "INSTRUCT_FORMAT", "REGISTRY", "TWO_PLAYER"]
