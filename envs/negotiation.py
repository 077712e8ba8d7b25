"""Negotiation (ARIA, appendix H, after GLEE; EPO's social game in place of SOTOPIA).

A seller (Alice) and a buyer (Bob) negotiate the price of a product with a public market value M.
Each has a private valuation: the seller's V_S (what the product is worth to her; no deal means she
keeps it) and the buyer's V_B (the most it is worth to him). The buyer's outside option, as in ARIA's
prompt, is another seller, John, who sells the product at the known price V_B: the buyer may `walk away`
at any of his turns, which ends the game with no deal. Rounds t = 1..T: Alice proposes a price at odd
rounds, Bob at even rounds; the responder accepts or rejects with a counter-offer (the last proposal can
only be accepted or rejected). A deal at price p gives the utilities

    u_S = p - V_S,        u_B = V_B - p,

no deal gives 0 to both. A player wins when its utility is higher than the other's (ARIA's metric: the
seller wins iff p > (V_S + V_B) / 2). `scores()` adds the 0-10 goal-completion score of each side, how
close the deal came to that side's target price (the other side's valuation, the best deal it could
accept): score_S = 10 clip((p - V_S) / (V_B - V_S), 0, 1), score_B = 10 clip((V_B - p) / (V_B - V_S), 0, 1),
0 for both without a deal (EPO's outcome is score / 10). `info["progress"]` is the same position for
the acting player (of the deal, or of the other side's latest offer).

Tasks: 12 products (envs/data/negotiation_tasks.json) x V_S / M in {0.7, 0.8, 0.9} x V_B / M in
{1.1, 1.2, 1.3} x T in {6, 8, 10} = 324 ids like "p03_s0.8_b1.2_T8"; 81 of them form the fixed test split.

Canonical moves: `propose N` (a price in dollars; as a reply it rejects and counters), `accept`,
`reject` (to the last proposal only), `walk away` (buyer only). Free text is parsed too.

Scripted styles, in units of M on the side of each player: tough opens 40% past the market value,
concedes 3% a round and stops 25% short of its own valuation, accepting only offers as good as its next
proposal; fair opens 20% past, then proposes the midpoint of its last proposal and the other's last offer
(split the difference), accepting offers within 6% of its last proposal; conceding opens 10% past,
concedes 10% a round down to its valuation and accepts any offer that does not lose it money;
tit_for_tat opens 25% past and concedes exactly as much as the other side did in its last proposal.

Strategy-following agent (EPO's frozen agent, `rule_agent_action(player, strategy)`): keyword rules map
a short strategy ("Strategy: anchor high", "hold firm", "concede slightly", "concede a lot", "split the
difference", "accept the offer", "walk away") to a move; it never proposes a price that would lose it
money, accepts rather than counter with something worse than the offer on the table, and falls back on
a slight concession for a strategy it does not understand. The expert picks a strategy
(`expert_strategy(player)`) and plays it through that agent: anchor, accept any offer as good as its
next proposal, concede slightly, concede a lot when the other side stalls, split the difference with its
last proposal, and take any offer that pays something at the last round.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

from envs.base import extract_action
from envs.two_player_common import OfferGame, Style, instruct_suffix

DATA = Path(__file__).parent / "data" / "negotiation_tasks.json"
# Bump the number when the rules or the prompts change; tiny-policy caches key on it (and on the data).
VERSION = "2-" + hashlib.sha1(DATA.read_bytes()).hexdigest()[:8]
_ID = re.compile(r"^p(\d\d)_s(\d\.\d)_b(\d\.\d)_T(\d+)$")

MOVES = ("propose N (N = a price in dollars; as a reply it rejects the offer and counters) | accept | "
         "reject (only to the last proposal) | walk away (buyer only: buy from John instead)")

# Strategy-following agent: own-position steps in units of the market value.
ANCHOR_Z = 1.35
SMALL_STEP = 0.03
LARGE_STEP = 0.10

# Canonical strategies (EPO demos and noise), by role.
STRATEGIES = {
    "Alice": ["Strategy: anchor high", "Strategy: hold firm", "Strategy: concede slightly",
              "Strategy: concede a lot", "Strategy: split the difference", "Strategy: accept the offer"],
    "Bob": ["Strategy: anchor low", "Strategy: hold firm", "Strategy: concede slightly",
            "Strategy: concede a lot", "Strategy: split the difference", "Strategy: accept the offer",
            "Strategy: walk away"],
}

_STRATEGY_RULES = [  # (intent, pattern), first match wins
    ("walk", r"\b(walk|outside option|leave|john|another seller|quit)\b"),
    ("accept", r"\b(accept|agree|take (?:it|the offer|their offer|the deal)|close the deal|say yes|deal now)\b"),
    ("split", r"\b(split|halfway|half way|middle|meet)\b"),
    ("large", r"\b(a lot|big|large|generous|significant|substantial|much)\b"),
    ("anchor", r"\b(anchor|open(?:ing)? (?:high|low)|ambitious|aggressive|extreme|start (?:high|low))\b"),
    ("hold", r"\b(hold|firm|stand|insist|repeat|stay|keep (?:the|my) (?:price|offer)|don'?t move|no concession)\b"),
    ("small", r"\b(concede|concession|slight|small|little|lower|raise|reduce|increase|compromise|budge|flexib)"),
]


@lru_cache(maxsize=1)
def _data() -> dict:
    return json.loads(DATA.read_text())


def strategy_intent(strategy: str) -> Optional[str]:
    """The intent of a strategy text by keyword rules (None = not understood)."""
    if not isinstance(strategy, str):
        return None
    s = strategy.lower()
    for intent, pattern in _STRATEGY_RULES:
        if re.search(pattern, s):
            return intent
    return None


class NegotiationEnv(OfferGame):
    env_id = "negotiation"
    version = VERSION
    allow_walk = ("Bob",)

    def __init__(self, history: Optional[int] = 4, max_invalid: int = 2, moves: str = "utterance",
                 expert: str = "plain"):
        """`moves="strategy"`: a message that starts with "Strategy:" is played through the
        strategy-following agent (EPO's strategist level: expert_action and admissible_actions give
        strategies, so a tiny strategist builds from the expert's strategies); other text is a move.
        `expert="style"`: `expert_action` plays `style_expert_strategy` (the reply to the scripted style
        the other side's opening gives away) instead of `expert_strategy`; the prompts are the same."""
        if moves not in ("utterance", "strategy"):
            raise ValueError(f"moves must be 'utterance' or 'strategy', got {moves!r}")
        if expert not in ("plain", "style"):
            raise ValueError(f"expert must be 'plain' or 'style', got {expert!r}")
        self.moves_mode = moves
        self.expert = expert
        super().__init__(history=history, max_invalid=max_invalid)
        self.max_rounds = max(_data()["rounds"])
        self.T = self.max_rounds
        self.product, self.M = "", 100.0
        self.value = {"Alice": 80.0, "Bob": 120.0}

    # -- tasks ---------------------------------------------------------------------------------------
    def _all_tasks(self) -> list[str]:
        data = _data()
        return [f"p{i:02d}_s{s:.1f}_b{b:.1f}_T{t}" for i in range(len(data["products"]))
                for s in data["seller_factors"] for b in data["buyer_factors"] for t in data["rounds"]]

    def _test_tasks(self) -> set[str]:
        return set(_data()["test"])

    def _load_task(self, task_id: str) -> None:
        m = _ID.match(task_id)
        if not m or task_id not in set(self._all_tasks()):
            raise ValueError(f"unknown negotiation task id {task_id!r} (e.g. {self._all_tasks()[0]!r})")
        prod = _data()["products"][int(m.group(1))]
        self.product, self.M = prod["name"], float(prod["market_value"])
        self.value = {"Alice": float(round(float(m.group(2)) * self.M)),
                      "Bob": float(round(float(m.group(3)) * self.M))}
        self.T = int(m.group(4))

    # -- offers: the internal offer is the price ------------------------------------------------------
    def _offer_from(self, player: str, value: float) -> Optional[float]:
        if value is None or not (0 < value <= 100 * self.M):
            return None
        return round(float(value), 2)

    def _stated_by(self, player: str, offer: float) -> float:
        return round(offer, 2)

    def _z(self, player: str, offer: float) -> float:
        return offer / self.M if player == "Alice" else 2.0 - offer / self.M

    def _offer_from_z(self, player: str, z: float) -> float:
        return float(round((z if player == "Alice" else 2.0 - z) * self.M))

    def reservation_z(self, player: str) -> float:
        """The own position of a price equal to the player's valuation (utility 0)."""
        return self._z(player, self.value[player])

    def utility(self, player: str, price: float) -> float:
        return price - self.value["Alice"] if player == "Alice" else self.value["Bob"] - price

    def _deal_payoffs(self, offer: float, rnd: int) -> dict[str, float]:
        return {p: self.utility(p, offer) for p in self.players}

    def score_at(self, player: str, price: float) -> float:
        """Goal completion 0-10 of `player` for a deal at `price`."""
        lo, hi = self.value["Alice"], self.value["Bob"]
        pos = (price - lo) / (hi - lo) if player == "Alice" else (hi - price) / (hi - lo)
        return 10.0 * min(1.0, max(0.0, pos))

    def strategy_understood(self, strategy: str) -> bool:
        return strategy_intent(strategy) is not None

    def scores(self) -> dict[str, float]:
        """Goal-completion score 0-10 per side (0 for both without a deal)."""
        if self.deal_offer is None:
            return {p: 0.0 for p in self.players}
        return {p: self.score_at(p, self.deal_offer) for p in self.players}

    def _describe(self, offer: float) -> str:
        return f"price ${offer:g}"

    def _progress_of(self, player: str, offer: float, rnd: int) -> float:
        return self.score_at(player, offer) / 10.0

    def _proposal_grid(self, player: str) -> list[float]:
        step = self.M / 20
        return [float(round(self.M * 0.5 + k * step)) for k in range(21)]  # 0.5 M .. 1.5 M

    def _step_result(self, player, invalid, note):
        step = super()._step_result(player, invalid, note)
        if self.ended:
            step.info["scores"] = self.scores()
        return step

    # -- styles ----------------------------------------------------------------------------------------
    def _style(self, player: str, style: str) -> Style:
        r = self.reservation_z(player)
        return {
            "tough": Style(open_z=1.40, rule="step", step=0.03, floor_z=r + 0.25, accept="next"),
            "fair": Style(open_z=1.20, rule="split", floor_z=r, accept="gap", gap=0.06),
            "conceding": Style(open_z=1.10, rule="step", step=0.10, floor_z=r, accept="min", accept_z=r),
            "tit_for_tat": Style(open_z=1.25, rule="mirror", floor_z=r, accept="next", first_mirror=0.0),
        }[style]

    # -- strategy-following agent (EPO) and expert -------------------------------------------------------
    def strategies(self, player: Optional[str] = None) -> list[str]:
        """Canonical strategies of a role (for EPO's noisy demos)."""
        return list(STRATEGIES[player or self.current_player])

    def _their_offer_z(self, player: str) -> Optional[float]:
        if self.offer is not None and self.proposer != player:
            return self._z(player, self.offer)
        return None

    def _proposal_z(self, player: str, intent: Optional[str]) -> float:
        """The own position of the proposal a strategy intent leads to (before clipping)."""
        mine = self.proposals[player]
        theirs = [self._z(player, self._offer_from_z(self.other(player), z)) for z in self.proposals[self.other(player)]]
        if intent == "anchor" or not mine:
            return ANCHOR_Z
        if intent == "hold":
            return mine[-1]
        if intent == "split" and theirs:
            return (mine[-1] + theirs[-1]) / 2
        if intent == "large":
            return mine[-1] - LARGE_STEP
        return mine[-1] - SMALL_STEP

    def rule_agent_action(self, player: Optional[str] = None, strategy: str = "") -> str:
        """EPO's frozen agent as keyword rules: the move that follows `strategy` for `player` now.

        It never offers a price that loses it money, accepts instead of countering with something no
        better than the offer on the table, and reads an unknown strategy as a slight concession."""
        self._require_task()
        player = player or self.current_player
        intent = strategy_intent(strategy)
        if intent == "walk" and player not in self.allow_walk:
            intent = "hold"
        if intent == "walk":
            return "walk away"
        their = self._their_offer_z(player)
        floor = self.reservation_z(player)
        if intent == "accept":
            if their is not None and their >= floor - 1e-9:
                return "accept"
            intent = "hold"
        if self.final_response:  # only accept or reject remain
            return "reject"
        z = max(self._proposal_z(player, intent), floor)
        if their is not None and z <= their + 1e-9:
            return "accept"
        return f"propose {self._offer_from_z(player, z):g}"

    def expert_strategy(self, player: Optional[str] = None) -> str:
        """A good short strategy (<= 10 words) for `player` now, from its own view only."""
        self._require_task()
        player = player or self.current_player
        their = self._their_offer_z(player)
        mine = self.proposals[player]
        if their is not None:
            if self.final_response:
                return "Strategy: accept the offer" if their > self.reservation_z(player) else "Strategy: hold firm"
            nxt = max(self._proposal_z(player, "small"), self.reservation_z(player))
            if mine and their >= nxt - 1e-9:
                return "Strategy: accept the offer"
            if self.round + 1 >= self.T and their > self.reservation_z(player):
                return "Strategy: accept the offer"  # my counter would be the last proposal: take a paying deal
        if not mine:
            return "Strategy: anchor high" if player == "Alice" else "Strategy: anchor low"
        theirs = self.proposals[self.other(player)]
        next_round = self.round + 1 if self.offer is not None else self.round
        if next_round >= self.T - 1:
            return "Strategy: split the difference"
        if len(theirs) >= 2 and theirs[-2] - theirs[-1] < 0.01:
            return "Strategy: concede a lot"
        return "Strategy: concede slightly"

    def opening_style(self, player: Optional[str] = None) -> Optional[str]:
        """The scripted style that the other side's opening proposal gives away (each opens at its own
        distance from the market value: tough 40 %, tit_for_tat 25 %, fair 20 %, conceding 10 %), or None
        (no proposal from the other side yet, or an opening that no style makes, e.g. a strategist's)."""
        self._require_task()
        player = player or self.current_player
        other = self.other(player)
        if not self.proposals[other]:
            return None
        first = self.proposals[other][0]  # in the other side's own units
        for style in self.opponent_styles():
            if abs(self._style(other, style).open_z - first) < 0.02:  # prices are whole dollars, M >= 150
                return style
        return None

    def style_expert_strategy(self, player: Optional[str] = None) -> str:
        """The expert's strategy for `player` when the other side's opening gives away its scripted style
        (`opening_style`), else `expert_strategy`. From the player's own view only (its valuation, the
        rounds, the moves so far), never the other side's valuation. Against a style:

        - fair: hold at the anchor (fair splits the difference towards it), take a paying offer when the
          counter would be the game's last proposal;
        - tit_for_tat: alternate a large concession, which it mirrors, and a return to the anchor, which it
          does not (it mirrors no retreat), then split the difference on the last own proposal;
        - tough: the seller holds (tough's offers stay below most sellers' valuations); the buyer holds,
          concedes a lot on his second- and third-last proposals and splits on his last (tough takes a
          last proposal above its floor);
        - conceding: `expert_strategy` (its slight concessions already meet conceding's).

        Always: on the final response take a paying offer, else hold. Measured against the styles and
        against the best strategy sequences in docs/epo.md ("What the strategist can see")."""
        self._require_task()
        player = player or self.current_player
        style = self.opening_style(player)
        if style is None or style == "conceding":
            return self.expert_strategy(player)
        their = self._their_offer_z(player)
        pays = their is not None and their > self.reservation_z(player)
        if self.final_response:
            return "Strategy: accept the offer" if pays else "Strategy: hold firm"
        mine = self.proposals[player]
        anchor = "Strategy: anchor high" if player == "Alice" else "Strategy: anchor low"
        if not mine:
            return anchor
        next_round = self.round + 1 if self.offer is not None else self.round  # of my next proposal
        left = len(range(next_round, self.T + 1, 2))  # my proposals still to come, this one included
        if style == "fair":
            return "Strategy: accept the offer" if pays and next_round >= self.T else anchor
        if style == "tit_for_tat":
            if left == 1:
                return "Strategy: split the difference"
            return "Strategy: concede a lot" if len(mine) % 2 == 1 else anchor
        # tough
        if player == "Alice" or left > 3:
            return anchor
        return "Strategy: split the difference" if left == 1 else "Strategy: concede a lot"

    def expert_action(self, player: Optional[str] = None) -> str:
        player = player or self.current_player
        strategy = self.style_expert_strategy(player) if self.expert == "style" else self.expert_strategy(player)
        if self.moves_mode == "strategy":
            return strategy
        return self.rule_agent_action(player, strategy)

    def step(self, text):
        if self.moves_mode == "strategy" and self.task_id is not None and not self.ended:
            said = extract_action(text)
            if said.lower().startswith("strategy"):
                player = self.current_player
                step = super().step(self.rule_agent_action(player, said))
                step.info["strategy"] = said if len(said) <= 200 else said[:200] + "..."
                step.info["strategy_understood"] = strategy_intent(said) is not None
                return step
        return super().step(text)

    def admissible_actions(self, player: Optional[str] = None) -> list[str]:
        if self.moves_mode == "strategy":
            self._require_task()
            return [] if self.ended else self.strategies(player or self.current_player)
        return super().admissible_actions(player)

    def legal_forms(self, player: str) -> str:
        if self.moves_mode == "strategy":
            return "Strategy: <at most 10 words>"
        return super().legal_forms(player)

    # -- texts -------------------------------------------------------------------------------------------
    def system_prompt_for(self, player: str) -> str:
        if player == "Alice":
            text = (
                f"You are Alice. You are selling one product ({self.product}, market value about ${self.M:g}) that is "
                f"worth no less than ${self.value['Alice']:g} to you.\n"
                "Bob is a potential buyer to whom you are offering the product.\n"
                "You will offer Bob to buy the product at a price of your choice. Bob can either accept or reject "
                "the offer.\n"
                "Your goal is to earn as much money as you can for the product.\n"
                "If Bob rejects the offer, he can make a counteroffer to buy your product. You can either accept or "
                "reject his counteroffer. If you reject Bob's counteroffer, you can make a new counteroffer, and so "
                "on.\n"
                f"You have {self.T} rounds to close the deal. At any moment Bob may stop the negotiation and buy "
                "the product from another seller; without a deal you keep the product.\n")
        else:
            text = (
                f"You are playing as Bob. You are looking for a product ({self.product}, market value about "
                f"${self.M:g}) that is worth no more than ${self.value['Bob']:g} to you.\n"
                "Alice is a seller trying to sell you the product.\n"
                "Alice will offer you a price to buy the product. You can either accept the offer or reject it.\n"
                "Your goal is to buy the product but save as much money as you can.\n"
                "If you reject the offer, you can make a counteroffer to buy the product. Alice can either accept "
                "or reject your counteroffer. If Alice rejects your counteroffer, Alice can make a new "
                "counteroffer, and so on.\n"
                f"You have {self.T} rounds to close the deal. However, at any moment, you can choose to stop the "
                "negotiation with Alice and buy the product from another seller, John, who is willing to sell the "
                f"product to you for ${self.value['Bob']:g}.\n")
        return text + instruct_suffix(MOVES)

    def task_header(self, player: str) -> str:
        if player == "Alice":
            return (f"You are Alice, selling a {self.product}. Market ${self.M:g}. Your value ${self.value['Alice']:g}. "
                    f"{self.T} rounds.")
        return (f"You are Bob, buying a {self.product}. Market ${self.M:g}. Your value ${self.value['Bob']:g} "
                f"(John sells at that price). {self.T} rounds.")
