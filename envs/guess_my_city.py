"""Guess My City with a rule-based answerer (the `guess_my_city` env).

The secret is the home city of the answerer, one of the 161 cities of
`envs/data/guess_my_city_cities.csv` (columns: country, continent, coast (the sea or ocean the city
lies on, or "inland"), capital, population band, climate, main language, hemisphere, a landmark and
a dish or two; other spellings of countries, languages and seas are in
`envs/data/guess_my_city_names.json`). The agent asks one question per turn, at most 20, and wins
(reward 1, answer "Goal reached") when a question names the city. As in ARIA and ΔBelief-RL (after
Tajwar et al., 2025), questions may be open ("Which continent is your city in?" -> "My city is in
Europe.") or yes/no ("Is your city on the coast?" -> "Yes"); asking for the name of the city or of
its country is refused, while guessing a country ("Is your city in Japan?") is answered.

The answerer (`parse_question` + `GuessMyCityEnv._step`) reads a question as follows:

1. Text: Unicode-normalised, accents dropped ("São Paulo" = "Sao Paulo"), lower-cased; a leading
   "Question:" / "Q:" is dropped; apostrophes are removed and other punctuation becomes spaces for
   matching ("Xi'an" = "xian"). The normalised question used for Repeated keeps letters, digits and
   single spaces.
2. Form. **Invalid** when empty or longer than 300 characters, when it holds more than one question
   mark or more than one sentence, when it joins a second question ("... and is it a capital?",
   "... and what ..."), or when it contains a negation ("Is your city not in Asia?"). A question that
   starts with a wh-word (what, which, where, how, tell, describe, ...) is *open*; one that starts
   with a yes/no auxiliary (is, does, do, can, ...) or ends with "?" is *yes/no*; otherwise the text
   must be a bare guess ("Tokyo", "guess: Tokyo", "My guess is Tokyo, Japan"), else it is Invalid.
3. Refused (**Invalid**, with the answer "I cannot tell you the name of my city or its country; guess
   it and I will confirm."): asking for the name of the city or the country ("What country is your
   city in?", "What is the name of your city?", "Which city is it?", "Where are you from?").
4. Guess. The names of every city (with their other spellings: "Bombay" for Mumbai, "Kiev" for Kyiv)
   are found in the text; where phrases overlap the longest wins ("Mexico City" is a city, "Mexico" a
   country, "Gulf of Mexico" a sea). Two or more cities named: **Invalid**. One city in an open
   question ("What is Tokyo famous for?"): **Invalid**. One city otherwise: a guess, answered
   **Goal reached** (the game ends, reward 1) when it is the secret, else **No** ("Is your city
   Tokyo, Japan?", "Is it Tokyo?", "Tokyo?" and "guess Tokyo" all guess Tokyo).
5. Open questions have one topic, found by keywords: continent ("Which continent ...", "Where is your
   city located?"), language, climate (also "weather"), population ("How many people ...", "How big
   ..."), coast ("Which sea or ocean ...", also "Is your city on the coast or inland?"), hemisphere
   (also "Is your city north or south of the equator?"), landmark ("What is your city famous for?")
   and food ("What food is your city known for?"). Several topics or none: **Invalid**. The answer is
   one sentence built from the table ("Most people in my city speak Spanish.", "My city lies on the
   coast of the Mediterranean Sea."); it never names the city or its country.
6. Yes/no questions test one property: a continent, the coast (any sea, or one sea by name; "inland"),
   capital, population over or under 1, 5 or 10 million, climate, language ("Do people speak
   Chinese?" covers Mandarin and Cantonese), hemisphere, or a country ("Is your city in Korea?" covers
   both Koreas). Properties of other attributes in the same question, or properties the table does
   not hold (rivers, history, "east coast", "big city", ...): **Invalid** rather than answered wrongly.
   The answer is **Yes** or **No**.
7. **Repeated**: the same normalised text as an earlier valid question. Invalid and Repeated answers
   still use a turn (`info["invalid"]` / `info["repeated"]` are set; refusals set `info["refused"]`).
   An invalid question is answered "Invalid: <reason>." (e.g. "Invalid: negated question.").

State and progress. What the agent knows is, per table attribute (continent, country, coast,
capital, population, climate, language, hemisphere), the set of values still possible (an open
answer leaves one; "Is your city in Asia? No" removes Asia), plus the cities guessed and the clue
topics asked (landmark, food). `state_key()` is that knowledge as a frozenset: two question orders or
wordings that reach the same knowledge have the same key. Landmark and food answers are clues for a
model that knows the world (a landmark names one city); the rule-based bookkeeping does not use them
to narrow the candidates, so the candidate list below never gives the city away from one clue.
`info["progress"]` = 1 - log(n) / log(N), where n is the number of cities consistent with the
knowledge and not yet guessed (n = 1 once the secret is found) and N the number of cities.

Expert. Among the cities consistent with the knowledge (train and test cities alike), it guesses the
first (file order) when at most two are left; otherwise it asks the canonical question (open questions
first, then yes/no questions, in `canonical_questions` order) whose answers split those cities with
the highest entropy (ties: the first), and guesses when no question splits them (cities with the same
attributes in the same country do not exist in the table, so a country question always splits).

Prompt. The user message is the task line with the question topics (left out with
`instructions=False`, as for the tiny policies, which read no instructions), the
numbered list of questions and answers so far (all of them with the default `history=None`;
`numbered=False` writes each as one "<question> <answer>" line, without the number and the Q:/A:
markers), the list of still possible cities once at most `show_candidates` are left (0 turns it off), and the turn
counter.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import re
import unicodedata
from functools import lru_cache
from pathlib import Path
from typing import Hashable, NamedTuple, Optional

from envs.base import INSTRUCT_FORMAT, QuestionGameEnv, Step

DATA_DIR = Path(__file__).resolve().parent / "data"
CITIES_FILE = DATA_DIR / "guess_my_city_cities.csv"
NAMES_FILE = DATA_DIR / "guess_my_city_names.json"

# Bump the number when the answerer's rules change; the data hash follows edits of the tables.
VERSION = "2." + hashlib.sha256(CITIES_FILE.read_bytes() + NAMES_FILE.read_bytes()).hexdigest()[:8]

MAX_QUESTIONS = 20
MAX_QUESTION_CHARS = 300

YES, NO, GOAL, REPEATED = "Yes", "No", "Goal reached", "Repeated"
REFUSAL = "I cannot tell you the name of my city or its country; guess it and I will confirm."

# The table attributes that the bookkeeping tracks (columns of the city table).
ATTRIBUTES = ("continent", "country", "coast", "capital", "population", "climate", "language", "hemisphere")
CONTINENTS = ("Africa", "Asia", "Europe", "North America", "Oceania", "South America")
POPULATION_BANDS = ("under_1m", "1m_5m", "5m_10m", "over_10m")
CLIMATES = ("tropical", "arid", "mediterranean", "subtropical", "oceanic", "continental", "highland")
INLAND = "inland"

# One-sentence answers to the open questions.
POPULATION_TEXT = {
    "under_1m": "Fewer than 1 million people live in my city.",
    "1m_5m": "Between 1 and 5 million people live in my city.",
    "5m_10m": "Between 5 and 10 million people live in my city.",
    "over_10m": "More than 10 million people live in my city.",
}
CLIMATE_TEXT = {
    "tropical": "My city has a tropical climate, hot and humid all year.",
    "arid": "My city has a dry desert climate with very little rain.",
    "mediterranean": "My city has a Mediterranean climate, with hot dry summers and mild wet winters.",
    "subtropical": "My city has a humid subtropical climate, with hot humid summers and mild winters.",
    "oceanic": "My city has a mild oceanic climate, cool and often rainy.",
    "continental": "My city has a continental climate, with warm summers and cold snowy winters.",
    "highland": "My city has a cool highland climate, high above sea level.",
}
# How the canonical yes/no climate question names each climate.
CLIMATE_NAME = {"tropical": "tropical", "arid": "desert", "mediterranean": "Mediterranean",
                "subtropical": "humid subtropical", "oceanic": "oceanic", "continental": "continental",
                "highland": "highland"}

# Canonical open questions, in the order the expert prefers them (landmark and food last: the
# bookkeeping does not narrow on them).
OPEN_QUESTIONS = {
    "language": "What language do people speak in your city?",
    "continent": "Which continent is your city in?",
    "climate": "What is the climate of your city?",
    "population": "How many people live in your city?",
    "coast": "Which sea or ocean is your city on?",
    "hemisphere": "Which hemisphere is your city in?",
    "landmark": "What is your city famous for?",
    "food": "What food is your city known for?",
}
CLUE_TOPICS = ("landmark", "food")

# ----------------------------------------------------------------------------------------------
# Keyword phrases. Each is a regular expression over the normalised text (lower case, accents and
# apostrophes dropped, other punctuation replaced by spaces) matched on whole words; where phrases
# overlap the longest wins.
# ----------------------------------------------------------------------------------------------
_N1, _N5, _N10 = r"(?:a|one|1)", r"(?:five|5)", r"(?:ten|10)"
_MORE = r"(?:more than|over|above|at least|greater than|bigger than|larger than|upwards of|in excess of)"
_LESS = r"(?:fewer than|less than|under|below|smaller than|at most|up to)"
_PEOPLE = r"(?: (?:people|inhabitants|residents|citizens|persons))?"
_WATER_WORD = r"(?:sea|ocean|coast|beach|seaside|water|waterfront|shore)"

# Yes/no predicates that are not names: (regex, attribute, values or a callable of the domain).
YESNO_PHRASES: list[tuple[str, str, object]] = [
    (r"europe|european", "continent", {"Europe"}),
    (r"asia|asian", "continent", {"Asia"}),
    (r"africa|african", "continent", {"Africa"}),
    (r"north america|north american", "continent", {"North America"}),
    (r"south america|south american", "continent", {"South America"}),
    (r"oceania|oceanian", "continent", {"Oceania"}),
    (r"the americas", "continent", {"North America", "South America"}),
    (r"coast(?:al|line)?|seaside|sea ?port|port city|harbou?rs?|beach(?:es)?|oceans?|seas?|shore|"
     r"(?:on|by|near|at|next to|beside|close to) (?:the |a )?" + _WATER_WORD, "coast", "coastal"),
    (r"inland|landlocked|(?:far|away) from the (?:sea|ocean|coast)", "coast", {INLAND}),
    (r"capital(?: city)?|national capital|capital of (?:its|the|your|their|a|this|that) (?:country|nation)|"
     r"seat of (?:the )?government", "capital", {"1"}),
    (_MORE + " " + _N1 + " million" + _PEOPLE + r"|" + _N1 + r" million" + _PEOPLE + r"|millions of people",
     "population", {"1m_5m", "5m_10m", "over_10m"}),
    (_MORE + " " + _N5 + " million" + _PEOPLE, "population", {"5m_10m", "over_10m"}),
    (_MORE + " " + _N10 + " million" + _PEOPLE + r"|mega ?city|megacity|megalopolis", "population", {"over_10m"}),
    (_LESS + " " + _N1 + " million" + _PEOPLE, "population", {"under_1m"}),
    (_LESS + " " + _N5 + " million" + _PEOPLE, "population", {"under_1m", "1m_5m"}),
    (_LESS + " " + _N10 + " million" + _PEOPLE, "population", {"under_1m", "1m_5m", "5m_10m"}),
    (r"tropical|tropics", "climate", {"tropical"}),
    (r"desert(?: climate)?|arid|semi arid|dry climate", "climate", {"arid"}),
    (r"mediterranean climate", "climate", {"mediterranean"}),
    (r"(?:humid )?subtropical", "climate", {"subtropical"}),
    (r"oceanic|maritime climate|marine climate", "climate", {"oceanic"}),
    (r"continental(?: climate)?", "climate", {"continental"}),
    (r"highland|alpine climate|mountain climate|high (?:altitude|elevation)", "climate", {"highland"}),
    (r"southern hemisphere|south of the equator|below the equator", "hemisphere", {"S"}),
    (r"northern hemisphere|north of the equator|above the equator", "hemisphere", {"N"}),
]

# Yes/no texts that are really open questions ("Is your city north or south of the equator?").
ALTERNATIVES: list[tuple[str, str]] = [
    (r"north(?:ern)? or south(?:ern)?(?: hemisphere| of the equator)?|"
     r"south(?:ern)? or north(?:ern)?(?: hemisphere| of the equator)?", "hemisphere"),
    (r"(?:on the coast|coastal|by the sea|near the sea|on the sea) or inland|"
     r"inland or (?:on the coast|coastal|by the sea|near the sea|on the sea)", "coast"),
]

# Properties the table does not hold: a yes/no question about them is Invalid, not answered wrongly.
YESNO_UNSUPPORTED = [
    r"rivers?", r"lakes?", r"mountains?", r"hills?", r"islands?", r"universit(?:y|ies)", r"olympics?",
    r"snow(?:s|y)?", r"rain(?:s|y)?", r"hot", r"cold", r"warm", r"humid", r"old", r"ancient",
    r"histor(?:y|ic|ical)", r"modern", r"rich", r"wealthy", r"poor", r"touris(?:m|ts?|tic)",
    r"skyscrapers?", r"famous", r"known", r"popular", r"big", r"large", r"small", r"tiny", r"huge",
    r"major", r"equator", r"thousands?", r"(?:east|west|north|south)(?:ern)? (?:coast|part|side|region|half)",
    r"(?:state|provincial|regional) capital", r"middle east", r"scandinavia(?:n)?", r"balkans?",
    r"(?:south ?east|south|east|west|central|north|northern|southern|eastern|western) (?:asia|africa|europe)",
    r"(?:latin|central) america(?:n)?",
    r"(?:\d+|two|three|four|six|seven|eight|nine|eleven|twelve|fifteen|twenty|fifty|hundred) million",
]

# Open-question topics: (regex, topic, specific). A generic phrase ("famous for", "where") names its
# topic only when no specific phrase is present.
OPEN_PHRASES: list[tuple[str, str, bool]] = [
    (r"continents?|part of the (?:world|globe|earth)|region of the (?:world|globe|earth)", "continent", True),
    (r"where|located|situated|location", "continent", False),
    (r"languages?|speak|spoken|tongue|dialects?", "language", True),
    (r"climate|weather|temperatures?|seasons?|rain(?:fall|y)?|hot|cold|warm|humid(?:ity)?|snow", "climate", True),
    (r"population|how many (?:people|inhabitants|residents|citizens|persons)|"
     r"how (?:big|large|populous|populated|small)|size|inhabitants|residents|populous|populated", "population", True),
    (r"seas?|oceans?|coast(?:al|line)?|bod(?:y|ies) of water|bay|gulf|shore|beach(?:es)?|port|waterfront|"
     r"coast or inland|inland or (?:on the )?coast", "coast", True),
    (r"hemispheres?|equator|latitude|north or south|south or north", "hemisphere", True),
    (r"landmarks?|monuments?|sights?|attractions?|buildings?|architecture|tourists?|visit(?:ors)?|see|"
     r"towers?|museums?|icons?|iconic", "landmark", True),
    (r"famous|known|special|notable|unique|recogni[sz]ed", "landmark", False),
    (r"foods?|dish(?:es)?|cuisine|eat|meals?|specialt(?:y|ies)|drinks?|delicac(?:y|ies)|cook(?:ing|ed)?|"
     r"snacks?|culinary", "food", True),
]
OPEN_UNSUPPORTED = [
    r"rivers?", r"lakes?", r"mountains?", r"universit(?:y|ies)", r"sports?", r"teams?", r"histor(?:y|ic|ical)",
    r"founded", r"mayor", r"religions?", r"currency", r"time ?zones?", r"industr(?:y|ies)", r"economy",
    r"neighbou?r(?:ing|s)?", r"festivals?", r"music",
]

# Asking for the name of the city or of its country (refused as the paper's rules say).
REFUSE_PHRASES = [
    r"(?:what|which) (?:country|nation|city|town)",
    r"name of (?:your|the|this|that|its|my) (?:home ?town|home city|city|country|town|nation)",
    r"(?:city|country|town|nation|hometown)s? name",
    r"(?:what|how) is (?:your |the |this |that |its )?(?:home ?town|home city|city|country|town) called",
    r"what do you call (?:your|the|this) (?:city|country|town)",
    r"(?:tell|give|reveal|say|share|spell)(?: me| us)?(?: the| your| its)? (?:name|city name|country name)",
    r"(?:what|whats) (?:is )?(?:your|the|its) (?:home ?town|home city|country)$",
    r"where (?:are|do) you (?:from|live|come from)",
]

_AUX = ("is", "are", "does", "do", "can", "could", "has", "have", "will", "would", "was", "were", "did",
        "should", "may", "might", "shall", "am")
_WH = ("what", "whats", "which", "where", "wheres", "when", "why", "who", "whose", "how", "hows", "tell",
       "describe", "name", "give", "list", "share")
_SECOND_Q = re.compile(r"\b(?:and|or|but|also)\s+(?:(?:" + "|".join(_AUX)
                       + r")\s+(?:it|they|this|that|you|its|your|the|there)|what|which|where|how|who|when|why)\b")
_NEGATION = re.compile(r"\b(?:not|never|no|nor|neither|none|isnt|arent|doesnt|dont|cant|cannot|wasnt|werent|"
                       r"hasnt|havent|wont|wouldnt|couldnt|shouldnt|didnt|aint)\b")
_PREFIX = re.compile(r"^\s*(?:question|q|my question|ask)\s*\d*\s*[:\-]\s*")
_GUESS_PREFIX = re.compile(r"^(?:(?:my |final |the )?(?:guess|answer)(?: is)?|i (?:guess|think|believe|say)"
                           r"(?: that)?(?: (?:it is|its|your city is|the city is|your home city is))?|"
                           r"it is|its|it must be|your city is|the city is|your home city is)\b")
_FILLER = {"the", "city", "of", "in", "your", "home", "town", "is", "it", "a"}


class Parsed(NamedTuple):
    """What a question asks. kind: "invalid", "refuse", "guess" (city), "open" (topic) or "yesno"
    (attr, values: the set of values of attr for which the answer is Yes)."""

    kind: str
    topic: Optional[str] = None
    attr: Optional[str] = None
    values: Optional[frozenset] = None
    city: Optional[str] = None
    reason: str = ""


def _fold(text: str) -> str:
    """NFKD, accents dropped, lower case."""
    t = unicodedata.normalize("NFKD", text)
    return "".join(c for c in t if not unicodedata.combining(c)).lower()


def normalize_question(text: str) -> str:
    """Lower case, letters and digits and single spaces only: the key used for Repeated."""
    t = _PREFIX.sub("", _fold(unicodedata.normalize("NFKC", text)).replace("\u2019", "'"))
    return " ".join(re.findall(r"[a-z0-9]+", t.replace("'", "")))


def _match_form(text: str) -> str:
    """The matching alphabet: folded, apostrophes dropped, dotted abbreviations joined ("d.c." -> "dc"),
    other punctuation to spaces, single spaces."""
    t = _fold(text).replace("\u2019", "'").replace("\u2018", "'").replace("'", "")
    t = re.sub(r"\b((?:[a-z]\.){2,})", lambda m: m.group(1).replace(".", ""), t)
    return " ".join(re.sub(r"[^a-z0-9]+", " ", t).split())


class Table(NamedTuple):
    cities: list[str]
    rows: dict[str, dict[str, str]]      # city -> column -> value
    splits: dict[str, str]
    domains: dict[str, frozenset]         # attribute -> all values in the table
    countries: list[str]
    country_article: dict[str, str]
    languages: list[str]
    waters: list[str]
    city_patterns: list[tuple[re.Pattern, str, object]]   # shared by every form
    yesno_patterns: list[tuple[re.Pattern, str, object]]
    open_patterns: list[tuple[re.Pattern, str, object]]


def _compile(rx: str) -> re.Pattern:
    return re.compile(r"(?<![a-z0-9])(?:" + rx + r")(?![a-z0-9])")


def _names_rx(forms) -> str:
    """An alternation of folded names, longest first, spaces optional between words."""
    forms = sorted({_match_form(f) for f in forms if _match_form(f)}, key=lambda f: (-len(f), f))
    return "|".join(re.escape(f).replace(r"\ ", " ?") for f in forms)


@lru_cache(maxsize=None)
def load_table() -> Table:
    """Read the city table and the names, and compile the matching patterns."""
    names = json.loads(NAMES_FILE.read_text())
    with open(CITIES_FILE, newline="") as f:
        raw = list(csv.DictReader(f))
    cities = [r["city"] for r in raw]
    rows = {r["city"]: r for r in raw}
    splits = {r["city"]: r["split"] for r in raw}
    domains = {a: frozenset(r[a] for r in raw) for a in ATTRIBUTES}
    countries = sorted(domains["country"])
    languages = sorted(domains["language"])
    waters = sorted(domains["coast"] - {INLAND})
    for c in countries:
        assert c in names["countries"], f"country {c!r} missing from {NAMES_FILE.name}"
    for lang in languages:
        assert lang in names["languages"], f"language {lang!r} missing from {NAMES_FILE.name}"
    for w in waters:
        assert w in names["waters"], f"sea {w!r} missing from {NAMES_FILE.name}"

    common: list[tuple[re.Pattern, str, object]] = []
    # City names: one alternation, longest first; the matched text (spaces removed) names the city.
    surface: dict[str, str] = {}
    for c in cities:
        for form in [c] + [v for v in rows[c]["variants"].split(";") if v]:
            key = _match_form(form).replace(" ", "")
            assert surface.setdefault(key, c) == c, f"name {form!r} names both {surface[key]!r} and {c!r}"
    all_forms = list(cities) + [v for c in cities for v in rows[c]["variants"].split(";") if v]
    common.append((_compile(_names_rx(all_forms)), "city", surface))
    for c in countries:
        common.append((_compile(_names_rx([c] + names["countries"][c]["variants"])), "country", frozenset({c})))
    for group, members in names.get("country_groups", {}).items():
        common.append((_compile(_names_rx([group])), "country", frozenset(members)))
    for rx in REFUSE_PHRASES:
        common.append((_compile(rx), "refuse", None))

    yesno = list(common)
    for rx, attr, values in YESNO_PHRASES:
        vals = frozenset(domains["coast"] - {INLAND}) if values == "coastal" else frozenset(values)
        assert vals <= domains[attr], (rx, vals)
        yesno.append((_compile(rx), "pred", (attr, vals)))
    for lang in languages:
        yesno.append((_compile(_names_rx([lang] + names["languages"][lang]["variants"])), "pred",
                      ("language", frozenset({lang}))))
    for group, members in names.get("language_groups", {}).items():
        yesno.append((_compile(_names_rx([group])), "pred", ("language", frozenset(members))))
    for w in waters:
        yesno.append((_compile(_names_rx([w] + names["waters"][w]["variants"])), "pred", ("coast", frozenset({w}))))
    for rx, topic in ALTERNATIVES:
        yesno.append((_compile(rx), "alt", topic))
    for rx in YESNO_UNSUPPORTED:
        yesno.append((_compile(rx), "block", None))

    opened = list(common)
    for rx, topic, specific in OPEN_PHRASES:
        opened.append((_compile(rx), "topic", (topic, specific)))
    for rx in OPEN_UNSUPPORTED:
        opened.append((_compile(rx), "block", None))
    article = {c: names["countries"][c]["article"] for c in countries}
    return Table(cities, rows, splits, domains, countries, article, languages, waters, common, yesno, opened)


# Where two phrases of the same length overlap: a city beats a country beats everything else.
_KIND_RANK = {"city": 0, "country": 1, "refuse": 2, "alt": 3, "pred": 4, "topic": 5, "block": 6}


def _find(patterns, body: str) -> list[tuple[str, object, str]]:
    """Non-overlapping matches (kind, payload, matched text), longest first."""
    found = []
    for rx, kind, payload in patterns:
        for m in rx.finditer(body):
            if m.end() > m.start():
                found.append((-(m.end() - m.start()), _KIND_RANK[kind], m.start(), m.end(), kind, payload))
    found.sort()
    taken: list[tuple[int, int]] = []
    out = []
    for _, _, s, e, kind, payload in found:
        if any(s < te and ts < e for ts, te in taken):
            continue
        taken.append((s, e))
        out.append((kind, payload, body[s:e]))
    return out


def parse_question(text) -> Parsed:
    """Read one question (any string) into what it asks, independent of the secret (see module doc)."""
    if not isinstance(text, str):
        return Parsed("invalid", reason="not text")
    raw = text.strip()
    if not raw:
        return Parsed("invalid", reason="empty")
    if len(raw) > MAX_QUESTION_CHARS:
        return Parsed("invalid", reason="too long")
    t = _fold(unicodedata.normalize("NFKC", raw)).replace("\u2019", "'").replace("\u2018", "'")
    t = _PREFIX.sub("", t).strip()
    t = re.sub(r"\b((?:[a-z]\.){2,})", lambda m: m.group(1).replace(".", ""), t)   # d.c. -> dc
    t = re.sub(r"\b(st|mt|ft)\.", r"\1", t)                                        # st. petersburg
    if t.count("?") > 1:
        return Parsed("invalid", reason="more than one question")
    sentences = [s for s in re.split(r"[?.!;\n]+", t) if s.strip(" \t\"'()[]*:,-")]
    if len(sentences) != 1:
        return Parsed("invalid", reason="not a single question")
    body = _match_form(sentences[0])
    if not body:
        return Parsed("invalid", reason="nothing understood")
    words = body.split(" ")
    lead = ("in", "on", "at", "from", "of", "to", "and", "so", "ok", "okay")   # "In which continent ..."
    first = words[1] if words[0] in lead and len(words) > 1 else words[0]
    if first in _WH:
        form = "open"
    elif first in _AUX or t.rstrip(" \"')*").endswith("?"):
        form = "yesno"
    else:
        form = "statement"
    if _SECOND_Q.search(body):
        return Parsed("invalid", reason="more than one question")
    table = load_table()
    patterns = table.open_patterns if form == "open" else table.yesno_patterns
    found = _find(patterns, body)
    named = {payload[m.replace(" ", "")] for k, payload, m in found if k == "city"}
    refused = any(k == "refuse" for k, _, _ in found)
    if refused and (form == "open" or not named):   # "Is your city's name Tokyo?" is a guess
        return Parsed("refuse", reason="asks for the name of the city or country")
    if _NEGATION.search(body):
        return Parsed("invalid", reason="negated question")
    if len(named) > 1:
        return Parsed("invalid", reason="several cities")
    if form == "statement":
        rest = body
        m = _GUESS_PREFIX.match(rest)
        if m:
            rest = rest[m.end():]
        for k, _, matched in found:
            if k in ("city", "country"):
                rest = re.sub(r"(?<![a-z0-9])" + re.escape(matched) + r"(?![a-z0-9])", " ", rest, count=1)
        if named and not [w for w in rest.split() if w not in _FILLER]:
            return Parsed("guess", city=named.pop())
        return Parsed("invalid", reason="not a question")
    if named:
        if form == "open":
            return Parsed("invalid", reason="open question about a named city")
        return Parsed("guess", city=named.pop())
    if form == "open":
        if any(k == "country" for k, _, _ in found):
            return Parsed("invalid", reason="open question about a named country")
        if any(k == "block" for k, _, _ in found):
            return Parsed("invalid", reason="unsupported property")
        specific = {p[0] for k, p, _ in found if k == "topic" and p[1]}
        generic = {p[0] for k, p, _ in found if k == "topic" and not p[1]}
        topics = specific or generic
        if not topics:
            return Parsed("invalid", reason="nothing understood")
        if len(topics) > 1:
            return Parsed("invalid", reason="several questions")
        return Parsed("open", topic=topics.pop())
    # yes/no
    alts = {p for k, p, _ in found if k == "alt"}
    preds = []
    for k, p, matched in found:
        if k == "country":
            preds.append(("country", p))
        elif k == "pred":
            attr, vals = p
            if attr == "coast" and matched == "mediterranean" and re.search(r"\b(?:climate|weather)\b", body):
                attr, vals = "climate", frozenset({"mediterranean"})   # "Is the climate Mediterranean?"
            preds.append((attr, vals))
    if alts:
        if len(alts) > 1 or preds:
            return Parsed("invalid", reason="several questions")
        return Parsed("open", topic=alts.pop())
    if any(k == "block" for k, _, _ in found):
        return Parsed("invalid", reason="unsupported property")
    if not preds:
        return Parsed("invalid", reason="nothing understood")
    attrs = {a for a, _ in preds}
    if len(attrs) > 1:
        return Parsed("invalid", reason="several properties")
    attr = attrs.pop()
    sets = sorted({v for _, v in preds}, key=len)
    if any(not sets[0] <= s for s in sets[1:]):   # nested sets ("Pacific coast") keep the narrowest
        return Parsed("invalid", reason="several properties")
    return Parsed("yesno", attr=attr, values=sets[0])


def guess_question(city: str) -> str:
    """The canonical guess: "Is your city Tokyo?"."""
    return f"Is your city {city}?"


def _country_phrase(country: str) -> str:
    art = load_table().country_article.get(country, "")
    return f"the {country}" if art == "the" else country


def canonical_yesno() -> list[tuple[str, str, frozenset]]:
    """The canonical yes/no questions: (text, attribute, values for which the answer is Yes)."""
    t = load_table()
    d = t.domains
    out = [("Is your city on the coast?", "coast", frozenset(d["coast"] - {INLAND})),
           ("Is your city a capital?", "capital", frozenset({"1"}))]
    out += [(f"Is your city in {c}?", "continent", frozenset({c})) for c in CONTINENTS]
    out += [("Is your city in the southern hemisphere?", "hemisphere", frozenset({"S"}))]
    out += [("Does your city have over 1 million people?", "population", frozenset({"1m_5m", "5m_10m", "over_10m"})),
            ("Does your city have over 5 million people?", "population", frozenset({"5m_10m", "over_10m"})),
            ("Does your city have over 10 million people?", "population", frozenset({"over_10m"}))]
    out += [(f"Does your city have {'an' if CLIMATE_NAME[c][0] in 'aeiou' else 'a'} {CLIMATE_NAME[c]} climate?",
             "climate", frozenset({c})) for c in CLIMATES]
    out += [(f"Do people in your city speak {lang}?", "language", frozenset({lang})) for lang in t.languages]
    out += [(f"Is your city in {_country_phrase(c)}?", "country", frozenset({c})) for c in t.countries]
    out += [(f"Is your city on the {w}?", "coast", frozenset({w})) for w in t.waters]
    return out


def open_answer(city: str, topic: str) -> str:
    """The one-sentence answer of the open question `topic` for `city` (never names city or country)."""
    r = load_table().rows[city]
    if topic == "continent":
        return f"My city is in {r['continent']}."
    if topic == "language":
        return f"Most people in my city speak {r['language']}."
    if topic == "climate":
        return CLIMATE_TEXT[r["climate"]]
    if topic == "population":
        return POPULATION_TEXT[r["population"]]
    if topic == "coast":
        if r["coast"] == INLAND:
            return "My city lies inland, away from the sea."
        return f"My city lies on the coast of the {r['coast']}."
    if topic == "hemisphere":
        return "My city is " + ("south" if r["hemisphere"] == "S" else "north") + " of the equator."
    if topic == "landmark":
        return f"My city is known for {r['landmark']}."
    if topic == "food":
        return f"My city is famous for {r['dishes']}."
    raise ValueError(f"unknown topic {topic!r}")


class GuessMyCityEnv(QuestionGameEnv):
    """Guess My City against the rule-based answerer (see the module docstring)."""

    env_id = "guess_my_city"
    candidates_label = "cities"
    version = VERSION
    max_turns = MAX_QUESTIONS
    task_prompt = ("Guess My City: find my home city. Ask about its continent, language, climate, population, sea, "
                   "hemisphere, capital, country, landmark or food; guess with: Is your city <city>?")
    system_prompt = (
        "You are playing Guess My City: find the other player's home city within 20 questions. The city "
        "is one of about 160 well-known cities on every continent. Each turn ask exactly one question. Open "
        "questions get a one-sentence answer: the continent (\"Which continent is your city in?\"), the "
        "main language (\"What language do people speak in your city?\"), the climate, the population "
        "(\"How many people live in your city?\"), the sea or ocean it lies on (\"Which sea or ocean is "
        "your city on?\"), the hemisphere, a famous landmark (\"What is your city famous for?\") or its "
        "food (\"What food is your city known for?\"). Yes/no questions about one property get Yes or No: "
        "continent, coast (\"Is your city on the coast?\", \"Is your city on the Mediterranean Sea?\"), "
        "capital (\"Is your city a capital?\"), population over 1, 5 or 10 million, climate, language, "
        "hemisphere, or country (\"Is your city in Japan?\"). Do not ask for the name of the city or its "
        "country: that is refused. To guess, ask \"Is your city <city>?\"; a wrong guess counts as a "
        "question, the right one ends the game with \"Goal reached\". Repeated means you already asked "
        "this; an invalid question (two questions at once, a negation, several properties, a property "
        "the answerer does not know) still uses a turn. " + INSTRUCT_FORMAT
    )

    def __init__(self, history: Optional[int] = None, show_candidates: int = 5, instructions: bool = True,
                 numbered: bool = True):
        super().__init__(history=history, show_candidates=show_candidates, instructions=instructions,
                         numbered=numbered)
        self.table = load_table()
        self.cities = list(self.table.cities)
        self.yesno = canonical_yesno()
        self.canonical_questions = list(OPEN_QUESTIONS.values()) + [q for q, _, _ in self.yesno]
        self.guess_targets = list(self.cities)
        self.target: Optional[str] = None
        self.possible: dict[str, frozenset] = {}
        self.guessed: list[str] = []
        self.clues: set[str] = set()
        self.asked: set[str] = set()
        self.solved = False

    # -- protocol ------------------------------------------------------------------------------
    def _reset(self, task_id: str) -> str:
        if task_id not in self.table.rows:
            raise ValueError(f"unknown guess_my_city task id {task_id!r}; the ids are the cities listed "
                             f"by task_ids('train') and task_ids('test')")
        self.target = task_id
        self.possible, self.guessed, self.clues, self.asked, self.solved = {}, [], set(), set(), False
        return "Ask your first question."

    def _learn(self, attr: str, values: frozenset, answer_yes: bool) -> None:
        cur = self.possible.get(attr, self.table.domains[attr])
        new = cur & values if answer_yes else cur - values
        if new != self.table.domains[attr]:
            self.possible[attr] = new

    def _step(self, action: str) -> Step:
        info = {"success": False, "invalid": False, "repeated": False, "refused": False,
                "kind": None, "topic": None, "attribute": None, "guess": None}
        key = normalize_question(action)
        parsed = parse_question(action)
        info["kind"] = parsed.kind
        if parsed.kind in ("open", "yesno", "guess") and key in self.asked:
            answer = REPEATED
            info["repeated"] = True
        elif parsed.kind == "invalid":
            answer = f"Invalid: {parsed.reason}."
            info["invalid"] = True
            info["reason"] = parsed.reason
        elif parsed.kind == "refuse":
            answer = REFUSAL
            info["invalid"] = info["refused"] = True
            info["reason"] = parsed.reason
        elif parsed.kind == "guess":
            self.asked.add(key)
            info["guess"] = parsed.city
            if parsed.city not in self.guessed:
                self.guessed.append(parsed.city)
            if parsed.city == self.target:
                answer = GOAL
                self.solved = True
                info["success"] = True
            else:
                answer = NO
        elif parsed.kind == "open":
            self.asked.add(key)
            info["topic"] = parsed.topic
            answer = open_answer(self.target, parsed.topic)
            if parsed.topic in CLUE_TOPICS:
                self.clues.add(parsed.topic)
            else:
                self._learn(parsed.topic, frozenset({self.table.rows[self.target][parsed.topic]}), True)
        else:
            self.asked.add(key)
            info["attribute"] = parsed.attr
            yes = self.table.rows[self.target][parsed.attr] in parsed.values
            self._learn(parsed.attr, parsed.values, yes)
            answer = YES if yes else NO
        info["answer"] = answer
        info["progress"] = self.progress()
        return Step(answer, 1.0 if self.solved else 0.0, self.solved, info)

    def state_key(self) -> Hashable:
        return frozenset([(a, tuple(sorted(v))) for a, v in self.possible.items()]
                         + [("guess", c) for c in self.guessed] + [("clue", t) for t in self.clues])

    def candidates(self) -> list[str]:
        """Cities consistent with what was learnt and not guessed yet (the secret only, once found)."""
        if self.solved:
            return [self.target]
        rows = self.table.rows
        return [c for c in self.cities if c not in self.guessed
                and all(rows[c][a] in vals for a, vals in self.possible.items())]

    def progress(self) -> float:
        n = max(1, len(self.candidates()))
        return 1.0 - math.log(n) / math.log(len(self.cities))

    def expert_action(self) -> str:
        cands = self.candidates()
        if len(cands) <= 2:
            return guess_question(cands[0] if cands else self.target)
        rows = self.table.rows
        best, best_h = None, 1e-9

        def entropy(counts) -> float:
            n = sum(counts)
            return -sum(k / n * math.log(k / n) for k in counts if k)

        for topic, q in OPEN_QUESTIONS.items():
            if topic in CLUE_TOPICS:
                continue
            counts: dict[str, int] = {}
            for c in cands:
                counts[rows[c][topic]] = counts.get(rows[c][topic], 0) + 1
            h = entropy(counts.values())
            if h > best_h + 1e-12:
                best, best_h = q, h
        for q, attr, vals in self.yesno:
            yes = sum(rows[c][attr] in vals for c in cands)
            h = entropy([yes, len(cands) - yes])
            if h > best_h + 1e-12:
                best, best_h = q, h
        return best if best is not None else guess_question(cands[0])

    def guess_text(self, target: str) -> str:
        return guess_question(target)
