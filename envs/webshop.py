"""WebShop-lite: find and buy the product an instruction describes in a small synthetic shop.

A rule-based stand-in for WebShop (Yao et al., 2022, https://webshop-pnlp.github.io), the shopping
benchmark of iStar, GraphGPO and EPO, small enough to run offline in pure Python.

Data. `envs/data/webshop_catalogue.json`: 364 products in 7 categories (tops, bottoms, shoes, bags,
bedding, drinkware, outerwear), 4 product types each; a product has a type, three attributes (one of
each attribute group of its category, e.g. "organic" / "slim fit" / "cotton"), a title made of its
attributes and its type ("organic slim fit cotton t-shirt"), an integer price in dollars and two
option groups, color and size (the category's sizes: s/m/l, shoe sizes, queen/king, 16 oz, ...).
`envs/data/webshop_tasks.json`: the instructions of the train and test splits, each generated from a
target product: its type, one to three of its attributes, one or two of its options and a price bound
(the next multiple of $10 above its price), e.g. "i need a red slim fit cotton t-shirt, size m, under
$30". `envs/data/webshop_generate.py` writes both files deterministically (see its docstring).

Pages and actions (the web shop as text):

- search page (start): `search[query]`.
- results page: products ranked by the number of distinct query words their text holds (title words,
  type, category and colors) plus POPULARITY_WEIGHT (3) times their popularity in [0, 1] (ties in
  catalogue order), so a popular product missing a query word can outrank the target;
  `results_per_page` per page, at most `max_results`.
  Clickables: each result by its number on the page (`click[1]`..`click[3]`; with `click_items="id"`
  by its product id, `click[p042]`, as WebShop's ASIN buttons), `click[next >]`, `click[< prev]`
  (page > 1) and `click[back to search]`.
- item page: title, price, the color and size options; clickables: each option value (clicking one
  chooses it for its group, replacing an earlier choice), `click[< prev]` (back to the results page),
  `click[back to search]` and `click[buy now]`.
- `search[...]` is accepted on every page (a new search). Everything else is invalid: the observation
  says why and repeats the page, the episode goes on, the turn counts. Clicks are case-insensitive and
  accept `next`, `prev`, `back` and `buy` for the page buttons.

Reward on `buy now` (the episode ends), WebShop's formula (Yao et al., 2022, Eq. 1; the official
`get_reward` in web_agent_site/engine/goal.py):

    r = r_type * (n_attr + n_opt + 1[price <= price_upper]) / (|goal attributes| + |goal options| + 1)

n_attr = goal attributes among the bought product's attributes, n_opt = goal options among the chosen
options. r_type = 1 for the goal's product type, 0.5 for another type of the same category, 0 for
another category (the official code derives r_type from noun overlap of the titles and the category
path, 0 when no noun is shared; exact matching replaces its fuzzy matching here). Success = r = 1.
The episode ends without reward after `max_steps` turns (15).

`info["progress"]`: on an item page, the reward that buying it now with the chosen options would give
(the attribute, option and price match of the current item), 0 on the search and results pages, the
reward after buying. `state_key()` is the current page: ("search",), ("results", query, page),
("item", query, page, product id, chosen options) or ("bought", product id, chosen options).

Expert. It searches the instruction's noun phrase (the instruction's words without size and price,
`task["query"]`), clicks the first result whose reward can reach 1 (right type, every goal attribute,
price under the bound, all goal options offered), turning pages when it lies further on, chooses the
goal options, one per turn, and buys. From a state off that path (after noise) it goes back with
`< prev` or searches again. The generator keeps only instructions whose first result that looks right
on the results page (type, attributes, price) is such a product, so the expert's choice can be read
from the page.

Prompt. The user message: the task line (left out with `instructions=False`) and the instruction, the
last `history` actions (invalid ones marked), the current page and the turn counter: 146 tokens on
average, at most 194, with the default tiny tokenizer on the noisy expert's demos (122 and 170 with
`instructions=False`).
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Hashable, Optional

from envs.base import INSTRUCT_FORMAT, Step, TextEnv

DATA_DIR = Path(__file__).resolve().parent / "data"
CATALOGUE_FILE = DATA_DIR / "webshop_catalogue.json"
TASKS_FILE = DATA_DIR / "webshop_tasks.json"

# Bump the number when the rules change; the data hash follows edits of the data files.
VERSION = "1." + hashlib.sha256(b"".join(f.read_bytes() for f in (CATALOGUE_FILE, TASKS_FILE)
                                          if f.is_file())).hexdigest()[:8]

MAX_STEPS = 15
OPTION_GROUPS = ("color", "size")
BACK, PREV, NEXT, BUY = "back to search", "< prev", "next >", "buy now"
_BUTTON_ALIASES = {"back": BACK, "back to search": BACK, "search page": BACK, "prev": PREV, "< prev": PREV,
                   "<prev": PREV, "previous": PREV, "next": NEXT, "next >": NEXT, "next>": NEXT,
                   "buy": BUY, "buy now": BUY}
_ACTION_RE = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*[.!]?\s*$", re.IGNORECASE | re.DOTALL)
_WORD_RE = re.compile(r"[a-z0-9$][a-z0-9$.'-]*")
MAX_QUERY_WORDS = 20
SHOW_CHARS = 60
TASK_LINE = "WebShop: buy what the instruction asks. Actions: search[words], click[a name in brackets]."
POPULARITY_WEIGHT = 3.0  # longest query or click text echoed back in an observation


# ----------------------------------------------------------------------------------------------
# Data, search and reward (pure functions)
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def load_catalogue() -> dict:
    """The catalogue: {"categories": {...}, "products": [...]}, plus "by_id" (id -> product)."""
    data = json.loads(CATALOGUE_FILE.read_text())
    data["by_id"] = {p["id"]: p for p in data["products"]}
    return data


@lru_cache(maxsize=1)
def load_tasks() -> dict:
    """The instructions: {"train": [...], "test": [...]}."""
    return json.loads(TASKS_FILE.read_text())


def query_words(text: str) -> list[str]:
    """The words of a search query: lower case, letters/digits/$ with inner . ' -, in order, no repeats."""
    out: list[str] = []
    for w in _WORD_RE.findall(text.lower()):
        w = w.rstrip(".'-")
        if w and w not in out:
            out.append(w)
    return out[:MAX_QUERY_WORDS]


def product_words(product: dict) -> frozenset:
    """The words a search matches against: title, type, category and color names."""
    text = " ".join([product["title"], product["type"], product["category"], *product["options"].get("color", [])])
    return frozenset(query_words(text) + [w for w in re.split(r"\s+", text.lower()) if w])


def search(products: list[dict], query: str, limit: int) -> list[str]:
    """Product ids ranked by relevance plus popularity: the number of distinct query words found in the
    product's words plus POPULARITY_WEIGHT * its popularity in [0, 1] (ties in catalogue order), so a
    popular product that misses a query word can rank above one that matches all of them. Products
    sharing no word with the query are left out; at most `limit` ids."""
    words = query_words(query)
    if not words:
        return []
    scored = []
    for i, p in enumerate(products):
        pw = _WORDS.get((p["id"], p["title"]))
        if pw is None:
            pw = _WORDS[(p["id"], p["title"])] = product_words(p)
        matched = sum(w in pw for w in words)
        if matched:
            scored.append((-(matched + POPULARITY_WEIGHT * p["popularity"]), i, p["id"]))
    scored.sort()
    return [pid for _, _, pid in scored[:limit]]


_WORDS: dict[tuple[str, str], frozenset] = {}  # (id, title) -> product_words, filled by search


def type_reward(product: dict, goal: dict) -> float:
    """r_type: 1 for the goal's type, 0.5 for another type of the goal's category, else 0."""
    if product["type"] == goal["type"]:
        return 1.0
    return 0.5 if product["category"] == goal["category"] else 0.0


def reward(product: dict, chosen: dict, goal: dict) -> float:
    """WebShop's reward of buying `product` with the `chosen` options {group: value} for `goal`:
    r_type * (n_attr + n_opt + price_ok) / (|goal attributes| + |goal options| + 1)."""
    n_attr = sum(a in product["attributes"] for a in goal["attributes"])
    n_opt = sum(chosen.get(g) == v for g, v in goal["options"].items())
    price_ok = float(product["price"] <= goal["price_upper"])
    total = len(goal["attributes"]) + len(goal["options"]) + 1
    return type_reward(product, goal) * (n_attr + n_opt + price_ok) / total


def looks_right(product: dict, goal: dict) -> bool:
    """What a results page shows is right: the goal's type, every goal attribute, price under the bound."""
    return (product["type"] == goal["type"] and all(a in product["attributes"] for a in goal["attributes"])
            and product["price"] <= goal["price_upper"])


def can_satisfy(product: dict, goal: dict) -> bool:
    """Buying `product` can give reward 1: it looks right and offers every goal option."""
    return looks_right(product, goal) and all(v in product["options"].get(g, []) for g, v in goal["options"].items())


def parse_action(action: str) -> Optional[tuple[str, str]]:
    """("search", query) or ("click", target) for "search[...]" / "click[...]" (case-insensitive), else None."""
    if not isinstance(action, str) or len(action) > 400:
        return None
    m = _ACTION_RE.match(action)
    if not m:
        return None
    verb, arg = m.group(1).lower(), " ".join(m.group(2).split())
    if "[" in arg or "]" in arg:
        return None
    return verb, arg


def _clip(text: str) -> str:
    return text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "..."


# ----------------------------------------------------------------------------------------------
# The env
# ----------------------------------------------------------------------------------------------
class WebShopEnv(TextEnv):
    """WebShop-lite (see the module docstring). Options:

    history: past actions shown in the prompt (None = all).
    instructions: False leaves the task line (what to do, the action forms) out of the user message;
        the instruction of the task is always shown, and the system prompt keeps everything.
    results_per_page: products per results page.
    max_results: results of a search (pages = ceil(max_results / results_per_page)).
    max_steps: turns per episode.
    click_items: how a results page names its products: "number" (default: [1], [2], [3] on each page,
        one token for a tiny policy) or "id" (the product id, [p042], as WebShop's ASIN buttons).
    """

    env_id = "webshop"
    version = VERSION
    max_turns = MAX_STEPS
    shared_data = ("products", "by_id", "tasks")  # the catalogue and task list, read-only

    def __init__(self, history: Optional[int] = 4, results_per_page: int = 3, max_results: int = 15,
                 max_steps: int = MAX_STEPS, instructions: bool = True, click_items: str = "number"):
        super().__init__(history=history, instructions=instructions)
        if results_per_page < 1:
            raise ValueError(f"results_per_page must be >= 1, got {results_per_page}")
        if max_results < results_per_page:
            raise ValueError(f"max_results ({max_results}) must be >= results_per_page ({results_per_page})")
        if max_steps < 6:
            raise ValueError(f"max_steps must be >= 6 (search, click, two options, buy and a page turn), "
                             f"got {max_steps}")
        if click_items not in ("number", "id"):
            raise ValueError(f"click_items must be 'number' or 'id', got {click_items!r}")
        self.click_items = click_items
        what = "a product id such as [p042]" if click_items == "id" else "a result number such as [1]"
        self.system_prompt = (
            "You are shopping in a web shop. Buy the product that the instruction describes: the right "
            "type, attributes, color and size options, and a price under the bound. Actions: search[words] "
            f"searches the shop (from any page); click[name] clicks a bracketed name on the current page: "
            f"{what} on a results page, [next >] and [< prev] to turn pages or go back, [back to search], "
            "an option value such as [red] or [m] on a product page to choose it, and [buy now] to buy the "
            f"product with the chosen options, which ends the episode. You have at most {max_steps} actions. "
            + INSTRUCT_FORMAT)
        self.results_per_page, self.max_results, self.max_turns = results_per_page, max_results, max_steps
        if (history, results_per_page, max_results, max_steps, instructions, click_items) != (
                4, 3, 15, MAX_STEPS, True, "number"):
            self.version = (f"{VERSION}|h{history}|r{results_per_page}|m{max_results}|s{max_steps}"
                            f"|i{int(self.instructions)}|{click_items}")
        cat = load_catalogue()
        self.products: list[dict] = cat["products"]
        self.by_id: dict[str, dict] = cat["by_id"]
        self.tasks = load_tasks()
        self.goal: Optional[dict] = None
        self._reset_page()

    def _reset_page(self) -> None:
        self.page = "search"        # search | results | item | bought
        self.query = ""
        self.results: list[str] = []
        self.page_no = 1
        self.item: Optional[str] = None
        self.chosen: dict[str, str] = {}
        self.final_reward = 0.0
        self.invalid_turns: set[int] = set()

    # -- protocol ------------------------------------------------------------------------------
    def task_ids(self, split: str) -> list[str]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return [f"{split}-{i}" for i in range(len(self.tasks[split]))]

    def _goal_of(self, task_id: str) -> dict:
        split, _, idx = task_id.partition("-")
        if split in ("train", "test") and idx.isdigit() and int(idx) < len(self.tasks[split]):
            return self.tasks[split][int(idx)]
        raise ValueError(f"unknown webshop task id {task_id!r}; ids are train-0..train-"
                         f"{len(self.tasks['train']) - 1} and test-0..test-{len(self.tasks['test']) - 1}")

    def _reset(self, task_id: str) -> str:
        self.goal = self._goal_of(task_id)
        self._reset_page()
        self.task_prompt = TASK_LINE + "\nInstruction: " + self.goal["instruction"]
        return self.render()

    @property
    def num_pages(self) -> int:
        return max(1, -(-len(self.results) // self.results_per_page))

    def page_results(self) -> list[str]:
        start = (self.page_no - 1) * self.results_per_page
        return self.results[start:start + self.results_per_page]

    def clickables(self) -> list[str]:
        """The names clickable on the current page, in page order."""
        if self.page == "results":
            out = [self._result_name(k, pid) for k, pid in enumerate(self.page_results(), 1)]
            if self.page_no > 1:
                out.append(PREV)
            if self.page_no < self.num_pages:
                out.append(NEXT)
            return out + [BACK]
        if self.page == "item":
            p = self.by_id[self.item]
            return [v for g in OPTION_GROUPS for v in p["options"].get(g, [])] + [PREV, BACK, BUY]
        return []

    def _result_name(self, k: int, pid: str) -> str:
        """The clickable name of the k-th result of the page (1-based): k, or the product id."""
        return pid if self.click_items == "id" else str(k)

    def _item_name(self, p: dict) -> str:
        return f"[{p['id']}] " if self.click_items == "id" else ""

    def render(self) -> str:
        """The current page as text."""
        if self.page == "search":
            return "Search page. Type search[words]."
        if self.page == "results":
            if not self.results:
                return f'No results for "{_clip(self.query)}".\n[{BACK}]'
            head = f'Results page {self.page_no}/{self.num_pages} for "{_clip(self.query)}":'
            lines = [head]
            for k, pid in enumerate(self.page_results(), 1):
                p = self.by_id[pid]
                lines.append(f"[{self._result_name(k, pid)}] {p['title']} ${p['price']}")
            buttons = [b for b in (PREV, NEXT, BACK) if b in self.clickables()]
            return "\n".join(lines + [" ".join(f"[{b}]" for b in buttons)])
        p = self.by_id[self.item]
        if self.page == "bought":
            opts = ", ".join(self.chosen[g] for g in OPTION_GROUPS if g in self.chosen) or "no options"
            return (f"You bought {self._item_name(p)}{p['title']} ${p['price']} ({opts}). "
                    f"Reward {self.final_reward:.2f}.")
        lines = [f"Item: {self._item_name(p)}{p['title']} ${p['price']}"]
        for g in OPTION_GROUPS:
            if p["options"].get(g):
                lines.append(f"{g}: " + " ".join(f"[{v}]" for v in p["options"][g]))
        if self.chosen:
            lines.append("chosen: " + ", ".join(self.chosen[g] for g in OPTION_GROUPS if g in self.chosen))
        lines.append(f"[{PREV}] [{BACK}] [{BUY}]")
        return "\n".join(lines)

    def progress(self) -> float:
        if self.page == "bought":
            return self.final_reward
        if self.page != "item" or self.goal is None:
            return 0.0
        return reward(self.by_id[self.item], self.chosen, self.goal)

    def _invalid(self, why: str) -> Step:
        self.invalid_turns.add(self.turn)
        return Step(f"Invalid action: {why}.\n{self.render()}", 0.0, False,
                    {"success": False, "invalid": True, "progress": self.progress(), "reason": why})

    def _step(self, action: str) -> Step:
        parsed = parse_action(action)
        if parsed is None:
            return self._invalid("write search[words] or click[name]")
        verb, arg = parsed
        if verb == "search":
            if not query_words(arg):
                return self._invalid("empty search")
            self.query = " ".join(query_words(arg))
            self.results = search(self.products, self.query, self.max_results)
            self.page, self.page_no, self.item, self.chosen = "results", 1, None, {}
            return self._ok()
        target = arg.lower().strip()
        target = _BUTTON_ALIASES.get(target, target)
        if target not in self.clickables():
            if self.page == "search":
                return self._invalid("nothing to click on the search page; use search[words]")
            return self._invalid(f'"{_clip(target)}" is not clickable on this page')
        if target == BACK:
            self.page, self.query, self.results, self.page_no, self.item, self.chosen = "search", "", [], 1, None, {}
        elif target == NEXT:
            self.page_no += 1
        elif target == PREV and self.page == "results":
            self.page_no -= 1
        elif target == PREV:  # item page -> the results page it came from
            self.page, self.item, self.chosen = "results", None, {}
        elif target == BUY:
            self.final_reward = reward(self.by_id[self.item], self.chosen, self.goal)
            self.page = "bought"
            success = self.final_reward >= 1.0 - 1e-9
            return Step(self.render(), float(self.final_reward), True,
                        {"success": success, "invalid": False, "progress": self.final_reward,
                         "reward_parts": self._parts()})
        elif self.page == "results":
            names = [self._result_name(k, pid) for k, pid in enumerate(self.page_results(), 1)]
            self.page, self.item, self.chosen = "item", self.page_results()[names.index(target)], {}
        else:  # an option value
            p = self.by_id[self.item]
            group = next(g for g in OPTION_GROUPS if target in p["options"].get(g, []))
            self.chosen[group] = target
        return self._ok()

    def _ok(self) -> Step:
        return Step(self.render(), 0.0, False, {"success": False, "invalid": False, "progress": self.progress()})

    def _parts(self) -> dict:
        p, g = self.by_id[self.item], self.goal
        return dict(r_type=type_reward(p, g), attributes=sum(a in p["attributes"] for a in g["attributes"]),
                    options=sum(self.chosen.get(k) == v for k, v in g["options"].items()),
                    price=p["price"] <= g["price_upper"], product=p["id"], target=g["target"])

    def state_key(self) -> Hashable:
        chosen = tuple(sorted(self.chosen.items()))
        if self.page == "search":
            return ("search",)
        if self.page == "results":
            return ("results", self.query, self.page_no)
        if self.page == "item":
            return ("item", self.query, self.page_no, self.item, chosen)
        return ("bought", self.item, chosen)

    # -- expert --------------------------------------------------------------------------------
    def expert_action(self) -> str:
        goal = self.goal
        if goal is None:
            return "search[shop]"
        search_goal = f"search[{goal['query']}]"
        if self.page == "search":
            return search_goal
        if self.page == "bought":
            return f"click[{BUY}]"
        if self.page == "item":
            p = self.by_id[self.item]
            if can_satisfy(p, goal):
                for g in OPTION_GROUPS:
                    want = goal["options"].get(g)
                    if want is not None and self.chosen.get(g) != want:
                        return f"click[{want}]"
                return f"click[{BUY}]"
            return f"click[{PREV}]" if self._best_index() is not None else search_goal
        best = self._best_index()
        if best is None:
            return search_goal
        page = best // self.results_per_page + 1
        if page > self.page_no:
            return f"click[{NEXT}]"
        if page < self.page_no:
            return f"click[{PREV}]"
        return f"click[{self._result_name(best % self.results_per_page + 1, self.results[best])}]"

    def _best_index(self) -> Optional[int]:
        """Index in the current results of the first product that can give reward 1 (None: none)."""
        for i, pid in enumerate(self.results):
            if can_satisfy(self.by_id[pid], self.goal):
                return i
        return None

    def admissible_actions(self) -> list[str]:
        """The clickables of the page and the search of the instruction's words."""
        acts = [f"click[{c}]" for c in self.clickables()]
        if self.goal is not None:
            acts.append(f"search[{self.goal['query']}]")
        return acts

    def corrupt_action(self, rng) -> str:
        """Noise for demonstrations: a random admissible action, or a search of the product type only."""
        acts = self.admissible_actions()
        if self.goal is not None:
            acts.append(f"search[{self.goal['type']}]")
        i = int(rng.integers(len(acts))) if hasattr(rng, "integers") else rng.randrange(len(acts))
        return acts[i]

    # -- prompt --------------------------------------------------------------------------------
    def messages(self) -> list[dict]:
        if self.instructions or self.goal is None:
            parts = [self.task_prompt]
        else:  # the task line left out, the instruction of the task kept
            parts = ["Instruction: " + self.goal["instruction"]]
        items = [(i, a) for i, (a, _) in enumerate(self.trajectory)]
        if self.history is not None:
            items = items[-self.history:] if self.history else []
        if items:
            shown = [_clip(a) + (" (invalid)" if i in self.invalid_turns else "") for i, a in items]
            more = len(self.trajectory) - len(items)
            parts.append("Past actions: " + ("... " if more else "") + " | ".join(shown))
        parts.append(self._last_obs)
        parts.append(self._turn_footer())
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "\n".join(parts)}]

    def _turn_footer(self) -> str:
        return f"Step {self.turn + 1} of {self.max_turns}."
