"""What Bargaining and Negotiation share: an alternating-offers game engine, free-text move parsing,
the scripted opponent styles and the rendering of each player's private view.

The game (ARIA, appendix H, after GLEE): rounds t = 1..T; Alice proposes at odd rounds, Bob at even
rounds. The responder either accepts (the game ends with a deal at round t) or rejects, and a rejection
comes with the responder's counter-proposal, which opens round t + 1. After the proposal of round T the
responder can only accept or reject; a rejection there ends the game without a deal. Unparseable text is
invalid: the same player acts again, and `max_invalid` invalid messages in a row end the game with no deal.

Every move is one message. Canonical forms (what tiny policies learn, what scripted players write):
`propose N` (N = the proposer's own share in Bargaining, the price in Negotiation; as a responder it
means "reject, and I propose N"), `accept`, `reject` (only meaningful for the last proposal), and in
Negotiation `walk away` (the buyer takes the outside option). Free text is parsed too: "I propose $60 for
me", "60-40 split", "you get 40", "Reject. I offer 55", "<action>ACCEPT</action>", "How about $121.25?".

Scripted styles work in a normalised "own position" z of an offer for a player, where larger is better
for that player (Bargaining: own share / 100; Negotiation: price / market value for the seller and
2 - price / market value for the buyer). A style is an opening z, a concession rule (fixed step,
split-the-difference, or mirroring the other side's last concession), a floor, and an acceptance rule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from envs.base import INSTRUCT_FORMAT, Step, TwoPlayerEnv, extract_action

# ----------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------
_NUM = re.compile(r"(?<![\w.])\$?\s?((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)\s?(%|\$|dollars?\b|k\b)?(?!\w)", re.I)
_NEG_ACCEPT = re.compile(
    r"\b(?:not|never|n't|cannot|can ?not|won't|unable to|refuse to)\s+(?:\w+\s+){0,2}(?:accept|agree|take)", re.I)
_ACCEPT = re.compile(r"\b(?:accept(?:ed|s)?|agree(?:d)?|deal|i'?ll take it|yes|sounds good|it'?s a deal)\b", re.I)
_REJECT = re.compile(
    r"\b(?:reject(?:ed|s)?|decline(?:d)?|refuse|no deal|counter(?:[- ]?offer|[- ]?proposal)?|too (?:high|low|much|little))\b",
    re.I)
_OFFER_KW = re.compile(
    r"\b(?:propose|proposal|offer(?:ing)?|counter(?:[- ]?offer)?|how about|what about|suggest|i want|i'?ll pay|"
    r"i can pay|i can do|sell (?:it )?for|buy (?:it )?for|price of|split|give you|you get|i get|i keep|"
    r"for me|for you)\b", re.I)
_WALK = re.compile(
    r"\b(?:walk away|walking away|outside option|buy (?:it )?from (?:john|another seller)|go to john|"
    r"leave the negotiation|end the negotiation)\b", re.I)
_OTHER_MARK_BEFORE = re.compile(r"(?:you get|you'?d get|you receive|you'?ll get|give you|you can have|offer you|"
                                r"leaves you(?: with)?|you keep|for you is)\s*\$?\s?$", re.I)
_OTHER_MARK_AFTER = re.compile(r"^\s?(?:\$|dollars?)?\s*(?:for you|to you|is yours|for your side|goes to you)", re.I)
_SELF_MARK_AFTER = re.compile(r"^\s?(?:\$|dollars?)?\s*(?:for me|to me|for myself|is mine|for my side)", re.I)


@dataclass(frozen=True)
class Move:
    """A parsed move: kind in {"accept", "propose", "reject", "walk"}; value = the number stated (the
    proposer's own share or the price), None unless kind == "propose"."""

    kind: str
    value: Optional[float] = None


def _numbers(text: str) -> list[tuple[float, int, int, str]]:
    """All numbers in `text` as (value, start, end, unit): "$1,200" -> 1200, "1.5k" -> 1500, "-20" -> -20
    (but "60-40" is two numbers)."""
    out = []
    for m in _NUM.finditer(text):
        try:
            val = float(m.group(1).replace(",", ""))
        except ValueError:
            continue
        unit = (m.group(2) or "").lower()
        if unit == "k":
            val *= 1000
        before = text[:m.start()]
        if before.endswith("-") and not before[:-1].rstrip()[-1:].isdigit():  # "-20", not "60-40"
            val = -val
        if math.isfinite(val):
            out.append((val, m.start(), m.end(), unit))
    return out


def parse_move(text: Any, split_total: Optional[float] = None,
               names: tuple[str, str] = ("", "")) -> Optional[Move]:
    """Parse one message into a Move (None = unparseable). Never raises.

    `split_total`: the money to divide in a split game (Bargaining): the value returned is then the
    speaker's own share, read from "60 for me", "40 for you", "you get 40", "60-40", "Bob gets 40"...
    `names`: (speaker's name, other's name), lower-case matching.
    Without `split_total` the value is a price (the number after the last offer word, else the last
    number).
    """
    s = extract_action(text)
    if not s:
        return None
    s = s.replace("\u2019", "'").replace("\u2013", "-").replace("\u2014", "-")
    low = s.lower()
    if _WALK.search(low):
        return Move("walk")
    nums = _numbers(low)
    negated = bool(_NEG_ACCEPT.search(low))
    accept = bool(_ACCEPT.search(low)) and not negated
    reject = bool(_REJECT.search(low)) or negated
    if accept and not reject:
        return Move("accept")
    if not nums:
        return Move("reject") if reject else None
    value = (_split_value(low, nums, split_total, names) if split_total is not None
             else _price_value(low, nums))
    if value is None:
        return Move("reject") if reject else None
    return Move("propose", value)


def _after_last_offer_word(low: str, nums: list) -> list:
    kws = list(_OFFER_KW.finditer(low))
    if kws:
        # numbers after the last offer word that has one after it
        for kw in reversed(kws):
            after = [n for n in nums if n[1] >= kw.start()]
            if after:
                return after
    return nums


def _price_value(low: str, nums: list) -> Optional[float]:
    cands = _after_last_offer_word(low, nums)
    dollars = [n for n in cands if "$" in low[n[1]:n[2]] or n[3] in ("$", "dollar", "dollars")]
    pick = dollars[0] if dollars else cands[0]
    if pick[3] == "%":
        return None
    return pick[0]


def _split_value(low: str, nums: list, total: float, names: tuple[str, str]) -> Optional[float]:
    me, other = (n.lower() for n in names)
    # "60-40", "60/40", "60:40" (speaker first)
    pair = re.findall(r"(\d+(?:\.\d+)?)\s?%?\s?(?:-|/|:|to)\s?\$?(\d+(?:\.\d+)?)", low)
    for a, b in reversed(pair):
        a, b = float(a), float(b)
        if abs(a + b - total) < 1e-6 or (abs(a + b - 100) < 1e-6 and total != 100):
            return a if abs(a + b - total) < 1e-6 else a * total / 100
    cands = _after_last_offer_word(low, nums)
    for val, start, end, unit in cands:
        if unit == "%":
            val = val * total / 100
        before, after = low[max(0, start - 24):start], low[end:end + 24]
        if _OTHER_MARK_BEFORE.search(before) or _OTHER_MARK_AFTER.search(after):
            return total - val
        if _SELF_MARK_AFTER.search(after):
            return val
        if other and (re.search(rf"\b{re.escape(other)}(?:'s share)?\s*(?:gets|receives|takes|:)?\s*\$?\s?$", before)
                      or re.search(rf"^\s?\$?\s*(?:for|to)\s+{re.escape(other)}\b", after)):
            return total - val
        if me and (re.search(rf"\b{re.escape(me)}(?:'s share)?\s*(?:gets|receives|takes|:)?\s*\$?\s?$", before)
                   or re.search(rf"^\s?\$?\s*(?:for|to)\s+{re.escape(me)}\b", after)):
            return val
    val, _, _, unit = cands[0]
    return val * total / 100 if unit == "%" else val


# ----------------------------------------------------------------------------------------------
# Scripted styles
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Style:
    """A scripted negotiator in own-position units z (larger = better for it).

    open_z: first proposal; rule: "step" (concede `step` per own proposal), "split" (propose the midpoint
    of its last proposal and the other's last offer) or "mirror" (concede as much as the other side did
    in its last proposal, tit for tat); floor_z: never proposes below it; accept: "next" (accept an offer
    at least as good as its own next proposal), "min" (accept an offer >= accept_z) or "gap" (accept an
    offer within `gap` of its own last proposal). Any offer below the floor (below accept_z for "min") is
    refused; on the last proposal of the game anything at or above it is accepted.
    """

    open_z: float
    rule: str = "step"
    step: float = 0.0
    floor_z: float = 0.0
    accept: str = "next"
    accept_z: float = 0.0
    gap: float = 0.0
    first_mirror: float = 0.0


def style_accepts(style: Style, offered_z: float, mine: list[float], own_next: float, final: bool) -> bool:
    """Whether the style accepts an offer worth `offered_z` to it; `mine` = its earlier proposals,
    `own_next` = its own next proposal, `final` = the offer is the last proposal of the game."""
    least = style.accept_z if style.accept == "min" else style.floor_z
    if offered_z < least - 1e-9:
        return False
    if final or style.accept == "min":
        return True
    if style.accept == "gap":
        return bool(mine) and offered_z >= mine[-1] - style.gap - 1e-9
    return offered_z >= own_next - 1e-9


# ----------------------------------------------------------------------------------------------
# The alternating-offers engine
# ----------------------------------------------------------------------------------------------
class OfferGame(TwoPlayerEnv):
    """Engine shared by Bargaining and Negotiation. Subclasses set the task (`_load_task`), the meaning
    of a stated number (`_offer_from` / `_stated_by`), payoffs, own-position `_z`, styles, texts."""

    players = ("Alice", "Bob")
    version = "2"
    allow_walk: tuple[str, ...] = ()  # players with an outside option ("walk away")

    def __init__(self, history: Optional[int] = 4, max_invalid: int = 2):
        if history is not None and history < 0:
            raise ValueError(f"history must be None or >= 0, got {history}")
        if max_invalid < 1:
            raise ValueError(f"max_invalid must be >= 1, got {max_invalid}")
        self.history = history
        self.max_invalid = max_invalid
        self.task_id: Optional[str] = None
        self._clear()

    # -- task-specific hooks ---------------------------------------------------------------------
    def _load_task(self, task_id: str) -> None:
        raise NotImplementedError

    def _all_tasks(self) -> list[str]:
        raise NotImplementedError

    def _test_tasks(self) -> set[str]:
        raise NotImplementedError

    def _offer_from(self, player: str, value: float) -> Optional[float]:
        """Internal offer from a number stated by `player` (None = out of range)."""
        raise NotImplementedError

    def _stated_by(self, player: str, offer: float) -> float:
        """The number `player` would state for the internal offer (inverse of `_offer_from`)."""
        raise NotImplementedError

    def _z(self, player: str, offer: float) -> float:
        raise NotImplementedError

    def _offer_from_z(self, player: str, z: float) -> float:
        raise NotImplementedError

    def _style(self, player: str, style: str) -> Style:
        raise NotImplementedError

    def _deal_payoffs(self, offer: float, rnd: int) -> dict[str, float]:
        raise NotImplementedError

    def _describe(self, offer: float) -> str:
        raise NotImplementedError

    def _progress_of(self, player: str, offer: float, rnd: int) -> float:
        raise NotImplementedError

    def task_header(self, player: str) -> str:
        raise NotImplementedError

    def system_prompt_for(self, player: str) -> str:
        raise NotImplementedError

    def expert_action(self, player: Optional[str] = None) -> str:
        raise NotImplementedError

    # -- protocol --------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.round = 1               # the round whose proposal is expected or on the table
        self.offer: Optional[float] = None   # proposal on the table (internal units)
        self.proposer: Optional[str] = None
        self.moves: list[tuple[str, int, str, Optional[float]]] = []  # (player, round, kind, offer)
        self.proposals: dict[str, list[float]] = {p: [] for p in self.players}
        self.invalid_streak = 0
        self.deal_round: Optional[int] = None
        self.deal_offer: Optional[float] = None
        self.ended = False
        self.end_reason = ""
        self.last_raw: dict[str, str] = {p: "" for p in self.players}
        self.last_note = ""

    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        test = self._test_tasks()
        return [t for t in self._all_tasks() if (t in test) == (split == "test")]

    def reset(self, task_id: str) -> str:
        task_id = str(task_id)
        self._load_task(task_id)  # ValueError on an unknown id
        self.task_id = task_id
        self._clear()
        return self.last_view(self.current_player)

    def _require_task(self) -> None:
        if self.task_id is None:
            raise RuntimeError("call reset(task_id) first")

    def other(self, player: str) -> str:
        return self.players[1] if player == self.players[0] else self.players[0]

    @property
    def current_player(self) -> str:
        if self.offer is None or self.proposer is None:
            return self.players[0] if self.round % 2 == 1 else self.players[1]
        return self.other(self.proposer)

    @property
    def done(self) -> bool:
        return self.ended

    @property
    def final_response(self) -> bool:
        """True when the current player answers the last proposal of the game (accept or no deal)."""
        return self.offer is not None and self.round >= self.T

    def payoffs(self) -> dict[str, float]:
        if self.deal_round is None or self.deal_offer is None:
            return {p: 0.0 for p in self.players}
        return self._deal_payoffs(self.deal_offer, self.deal_round)

    def winner(self) -> Optional[str]:
        pay = self.payoffs()
        a, b = self.players
        if self.deal_round is None or abs(pay[a] - pay[b]) < 1e-9:
            return None
        return a if pay[a] > pay[b] else b

    def progress(self, player: str) -> float:
        """Deal position for `player` in [0, 1]: at a deal, its position; before, the position of the
        other side's latest proposal (what it could get by accepting), 0 if none; 0 without a deal."""
        if self.deal_round is not None and self.deal_offer is not None:
            return self._progress_of(player, self.deal_offer, self.deal_round)
        if self.ended:
            return 0.0
        for who, rnd, kind, off in reversed(self.moves):
            if who != player and kind == "propose":
                return self._progress_of(player, off, rnd)
        return 0.0

    def step(self, text: Any) -> Step:
        self._require_task()
        player = self.current_player
        if self.ended:
            return Step(self.last_view(player), 0.0, True, {"success": False, "invalid": True, "note": "game over"})
        raw = extract_action(text)
        move = parse_move(raw, split_total=self._split_total(), names=(player, self.other(player)))
        error = self._check(player, move)
        if error:
            self.invalid_streak += 1
            self.last_note = error
            if self.invalid_streak >= self.max_invalid:
                self.ended = True
                self.end_reason = f"{player} sent {self.invalid_streak} invalid messages in a row: no deal"
            return self._step_result(player, invalid=True, note=error)
        self.invalid_streak = 0
        self.last_note = ""
        self.last_raw[player] = raw if len(raw) <= 200 else raw[:200] + "..."
        if move.kind == "accept":
            self.moves.append((player, self.round, "accept", self.offer))
            self.deal_round, self.deal_offer = self.round, self.offer
            self.ended = True
            self.end_reason = f"deal at round {self.round}: {self._describe(self.offer)}"
        elif move.kind == "walk":
            self.moves.append((player, self.round, "walk", None))
            self.ended = True
            self.end_reason = f"{player} took the outside option: no deal"
        elif move.kind == "reject" or (move.kind == "propose" and self.final_response):
            self.moves.append((player, self.round, "reject", None))
            self.ended = True
            self.end_reason = f"{player} rejected the last proposal: no deal"
        else:  # a proposal (opening, or a rejection with a counter-proposal)
            if self.offer is not None:
                self.round += 1
            off = self._offer_from(player, move.value)
            self.offer, self.proposer = off, player
            self.proposals[player].append(self._z(player, off))
            self.moves.append((player, self.round, "propose", off))
        return self._step_result(player, invalid=False, note="")

    def _split_total(self) -> Optional[float]:
        return None

    def _check(self, player: str, move: Optional[Move]) -> str:
        """'' if `move` is legal for `player` now, else the reason (shown to the player)."""
        legal = self.legal_forms(player)
        if move is None:
            return f"Invalid message: no move found. Write one of: {legal}."
        if move.kind == "walk" and player not in self.allow_walk:
            return f"Invalid: you have no outside option. Write one of: {legal}."
        if move.kind == "accept" and self.offer is None:
            return f"Invalid: there is no proposal to accept yet. Write one of: {legal}."
        if move.kind == "reject" and not self.final_response:
            if self.offer is None:
                return f"Invalid: make a proposal. Write one of: {legal}."
            return f"Invalid: a rejection needs a counter-proposal. Write one of: {legal}."
        if move.kind == "propose" and not self.final_response and self._offer_from(player, move.value) is None:
            return f"Invalid number {move.value:g}. Write one of: {legal}."
        return ""

    def _step_result(self, player: str, invalid: bool, note: str) -> Step:
        info: dict[str, Any] = {"invalid": invalid, "player": player, "round": self.round}
        if note:
            info["note"] = note
        if self.ended:
            pay = self.payoffs()
            info.update(payoffs=pay, deal=self.deal_round is not None, winner=self.winner(),
                        end_reason=self.end_reason)
            info["success"] = self.winner() == player
        else:
            info["success"] = False
        info["progress_by_player"] = {p: self.progress(p) for p in self.players}
        info["progress"] = info["progress_by_player"][player]
        reward = float(self.payoffs()[player]) if self.ended else 0.0
        return Step(self.last_view(self.current_player if not self.ended else player), reward, self.ended, info)

    # -- views -----------------------------------------------------------------------------------
    def legal_forms(self, player: str) -> str:
        if self.final_response:
            forms = ["accept", "reject"]
        elif self.offer is None:
            forms = ["propose N"]
        else:
            forms = ["accept", "propose N"]
        if player in self.allow_walk:
            forms.append("walk away")
        return " | ".join(forms)

    def _move_line(self, mv: tuple[str, int, str, Optional[float]]) -> str:
        player, rnd, kind, off = mv
        if kind == "propose":
            return f"R{rnd} {player}: propose {self._stated_by(player, off):g}"
        return f"R{rnd} {player}: {'walk away' if kind == 'walk' else kind}"

    def last_view(self, player: str) -> str:
        """What `player` sees now: the other side's last move (or the opening) and what it can do."""
        if self.task_id is None:
            return ""
        if self.ended:
            pay = self.payoffs()
            return (f"Game over: {self.end_reason}. Payoffs: "
                    + ", ".join(f"{p} {pay[p]:.2f}" for p in self.players) + ".")
        parts = []
        if self.current_player == player and self.last_note:
            parts.append(self.last_note)
        other = self.other(player)
        if self.offer is not None and self.proposer == other:
            said = self.last_raw.get(other, "")
            canon = f"propose {self._stated_by(other, self.offer):g}"
            extra = f' ("{said}")' if said and said.lower() != canon else ""
            parts.append(f"Round {self.round} of {self.T}. {other} proposes {self._describe(self.offer)}{extra}.")
        elif self.offer is not None:
            parts.append(f"Round {self.round} of {self.T}. You proposed {self._describe(self.offer)}; "
                         f"waiting for {other}.")
        else:
            parts.append(f"Round {self.round} of {self.T}. No proposal yet.")
        if self.current_player == player:
            if self.final_response:
                parts.append("Last round: accept or no deal.")
            parts.append(f"Your move: {self.legal_forms(player)}.")
        return " ".join(parts)

    def observe(self, player: str) -> list[dict]:
        """[system, user]: the system prompt for instruct models; the user message carries what a tiny
        policy needs: the private task header, the history of moves (last `history`), the current view."""
        self._require_task()
        parts = [self.task_header(player)]
        past = self.moves
        if past and self.offer is not None and past[-1][2] == "propose" and not self.ended:
            past = past[:-1]  # the proposal on the table is spelled out in the view below
        if self.history is not None:
            past = past[-self.history:] if self.history else []
        if past:
            parts.append("History:\n" + "\n".join(self._move_line(m) for m in past))
        parts.append(self.last_view(player))
        system = self.system_prompt_override or self.system_prompt_for(player)
        return [{"role": "system", "content": system},
                {"role": "user", "content": "\n".join(parts)}]

    def max_turns_per_player(self) -> int:
        """Most messages one player can send: ceil((T_max + 1) / 2) moves, each after up to
        max_invalid - 1 invalid messages."""
        return math.ceil((self.max_rounds + 1) / 2) * self.max_invalid

    def state_key(self) -> Hashable:
        last = {p: (round(v[-1], 4) if v else None) for p, v in self.proposals.items()}
        prev = {p: (round(v[-2], 4) if len(v) > 1 else None) for p, v in self.proposals.items()}
        return (self.task_id, self.round, self.current_player, self.proposer,
                None if self.offer is None else round(self.offer, 4),
                tuple(last[p] for p in self.players), tuple(prev[p] for p in self.players),
                self.invalid_streak, self.ended, self.deal_round,
                None if self.deal_offer is None else round(self.deal_offer, 4))

    # -- scripted players ------------------------------------------------------------------------
    def opponent_styles(self) -> list[str]:
        return ["tough", "fair", "conceding", "tit_for_tat"]

    def scripted_action(self, player: str, style: str) -> str:
        """The canonical move of a scripted `style` player in the current state."""
        self._require_task()
        if style not in self.opponent_styles():
            raise ValueError(f"unknown style {style!r}; known: {', '.join(self.opponent_styles())}")
        st = self._style(player, style)
        mine = self.proposals[player]
        theirs_own = self.proposals[self.other(player)]
        # the other's proposals, expressed in our z units
        theirs = [self._z(player, self._offer_from_z(self.other(player), z)) for z in theirs_own]
        nxt = self._style_next(st, mine, theirs_own, theirs)
        if self.offer is not None and self.proposer != player:
            offered = self._z(player, self.offer)
            if style_accepts(st, offered, mine, nxt, self.final_response):
                return "accept"
            if self.final_response:
                return "reject"
        return f"propose {self._stated_by(player, self._offer_from_z(player, nxt)):g}"

    def _style_next(self, st: Style, mine: list[float], theirs_own: list[float], theirs: list[float]) -> float:
        if not mine:
            z = st.open_z
        elif st.rule == "split" and theirs:
            z = (mine[-1] + theirs[-1]) / 2
        elif st.rule == "mirror":
            conc = (theirs_own[-2] - theirs_own[-1]) if len(theirs_own) >= 2 else st.first_mirror
            z = mine[-1] - max(0.0, conc)
        else:
            z = mine[-1] - st.step
        z = max(z, st.floor_z)
        if theirs:  # never ask for less than the other side already offers
            z = max(z, theirs[-1])
        return z

    def admissible_actions(self, player: Optional[str] = None) -> list[str]:
        """A coarse list of canonical moves legal now (for noisy demos and random baselines)."""
        self._require_task()
        player = player or self.current_player
        if self.ended:
            return []
        if self.final_response:
            acts = ["accept", "reject"]
        else:
            acts = ([] if self.offer is None else ["accept"]) + [f"propose {v:g}" for v in self._proposal_grid(player)]
        if player in self.allow_walk:
            acts.append("walk away")
        return acts

    def _proposal_grid(self, player: str) -> list[float]:
        raise NotImplementedError


def play(game: OfferGame, task_id: str, policies: dict, max_messages: int = 400) -> dict[str, float]:
    """Play one game to the end; `policies[player](game, player) -> text`. Returns the payoffs."""
    game.reset(task_id)
    for _ in range(max_messages):
        if game.done:
            break
        player = game.current_player
        game.step(policies[player](game, player))
    return game.payoffs()


def scripted(style: str):
    """A policy for `play`: the scripted `style`."""
    return lambda game, player: game.scripted_action(player, style)


def expert(game: OfferGame, player: str) -> str:
    """A policy for `play`: the env's expert."""
    return game.expert_action(player)


def win_rate(game: OfferGame, tasks: list[str], role: str, policy, opponent_style: str) -> float:
    """Fraction of `tasks` that `policy` playing `role` wins against a scripted style."""
    other = game.other(role)
    wins = 0
    for task in tasks:
        play(game, task, {role: policy, other: scripted(opponent_style)})
        wins += game.winner() == role
    return wins / max(1, len(tasks))


def instruct_suffix(forms: str) -> str:
    """The end of every system prompt: the canonical move forms, then the shared action format."""
    return f"Moves: {forms}.\n{INSTRUCT_FORMAT}"


__all__ = ["Move", "parse_move", "Style", "style_accepts", "OfferGame", "instruct_suffix", "play", "scripted",
           "expert", "win_rate"]
