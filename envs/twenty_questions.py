"""Twenty Questions with a rule-based answerer (the `twenty_questions` env).

The secret is one of the nouns of `envs/data/twenty_questions_words.csv` (237 words, each with 95
yes/no attributes; the definitions and canonical questions are in
`envs/data/twenty_questions_attributes.json`). The agent asks one yes/no question per turn, at most
20, and wins (reward 1) when a question names the secret.

The answerer (`parse_question` + `TwentyQuestionsEnv._step`) reads a question as follows:

1. Text: Unicode-normalised, lower-cased; a leading "Question:" / "Q:" / "Guess:" is dropped. The
   "normalised question" used for Repeated is the text reduced to letters, digits and single spaces.
2. Form. It is **Invalid** when it is empty or longer than 300 characters, holds more than one
   question mark or more than one sentence ("Is it red? Is it big?", "Is it red? I think so"),
   starts with a wh-word (what, where, how, ...), joins a second question ("... and does it fly?"),
   contains a negation (not, n't, never, no: "Is it not alive?" is ambiguous), or neither ends with
   "?" nor starts with a yes/no auxiliary (is, are, does, do, can, could, has, have, will, would,
   was, were, did, should, may, might, shall).
3. Matching. Keyword phrases of every attribute (with synonyms and negated forms, e.g. "Is it
   alive?", "Is it a living thing?", "Can you eat it?", "Is it larger than a microwave?", "Is it
   smaller than a breadbox?" = not bigger than a breadbox, "Is it natural?" = not man-made) and the
   surface forms of every word (the word, its regular plurals, the listed variants such as "kitten"
   for cat, and their plurals) are found in the text; where matches overlap the longest wins, so
   "bigger than a car" is a size question and not a guess of "car", and "washing machine" is a word
   and not the keyword "machine". A few unsupported properties (wild, dangerous, expensive, ...)
   make the question Invalid rather than being answered wrongly.
4. Answer. One word named: **Finished** if it is the secret (the game ends, reward 1), else
   **No** (a wrong guess; the word is recorded as guessed). Several words named ("Is it a cat or a
   dog?"): a guess of each, as App. B.1 of the ΔBelief-RL paper counts a question that includes the
   secret: **Finished** if one is the secret, else **No** (every word recorded as guessed). No word named: exactly one attribute must be matched (else
   **Invalid**: nothing understood, or several properties at once such as "Is it a mammal that can
   fly?"), and the answer is **Yes** or **No** from the table.
5. **Repeated**: the same normalised question text as an earlier valid question. Asking the same
   attribute in other words is answered again (it adds no fact). Invalid and Repeated answers still
   use a turn (`info["invalid"]` / `info["repeated"]` are set).

State and progress. `state_key()` is the frozenset of the facts learnt, `(attribute, bool)` for
each answered attribute question (the bool is the attribute's value, so "Is it smaller than a
breadbox? Yes" and "Is it bigger than a breadbox? No" give the same fact), plus `("guess", word)`
for each word guessed (the secret included once found). Two question orders that reach the same
knowledge have the same key. `info["progress"]` = 1 - log(n) / log(N), where n is the number of
words consistent with the facts and not yet guessed (n = 1 once the secret is found) and N the number
of words: 0 before any information, 1 when only the secret is left.

Expert. Among the words consistent with the facts (all words, train and test), it asks the
canonical question of the attribute whose split of those words is most balanced (max of
min(#yes, #no); ties go to the attribute listed first), and guesses ("Is it a <word>?") when one
word is left or no attribute splits the rest (words with identical attributes; first in file order).

Prompt. The user message is the task line, the numbered list of questions and answers so far (all
of them with the default `history=None`; the last `history` ones otherwise; `numbered=False` writes
each as one "<question> <answer>" line, without the number and the Q:/A: markers), the list of still
possible words once at most `show_candidates` are left (default 0: never; the set of secrets stays
unknown to the questioner, as in the paper's §4; the tiny recipe passes 5), and the turn counter.
The system prompts name the kinds of secret, never the secrets.

Compound secrets (`secrets="compound"`; `envs/data/twenty_questions_compound.json`). The secret is a thing
of some colour, "<colour> <thing>" ("red cat"): one of 16 things (animals, vehicles, furniture, household
objects) in one of 16 colours, 256 secrets. Each part has its own yes/no features (things: "Is it an
animal?", "Can it fly?", "Does it bark?", ...; colours: "Is it a warm colour?", "Is it a colour of the
rainbow?", "Is it a dark colour?", ...), each true for the items the file lists. The test secrets are the
combinations (thing i, colour j) with (i - j) % 5 == 0: 52 secrets, every thing and every colour in 3-4
of them and in 12-13 train secrets, so a test secret is an unseen combination of parts that the train
secrets all show. The same rules as the word game, except step 4: a question that names a colour and a
thing is a guess (several things or colours: Invalid, since the pairs are ambiguous) ("Is it a red cat?", "Is it an orange plane?"; any article); naming a thing alone or a
colour alone asks about that part ("Is it a cat?", "Is it red?": the identity attributes "thing=cat",
"colour=red", answered Yes or No and kept as facts; with a feature as well, "Is it a red animal?", or two
things or two colours: Invalid). The expert
finds the thing first, then the colour: the most balanced split over the consistent secrets among the
thing's features while the thing is open, then among the colour's; its first question is always "Is it
an animal?", and its next depends on the answers (7-9 questions, then the guess). `state_key`, progress
(N = 256) and the prompt are as above; the still-possible secrets are listed as "Possible secrets: ...".
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
WORDS_FILE = DATA_DIR / "twenty_questions_words.csv"
ATTRIBUTES_FILE = DATA_DIR / "twenty_questions_attributes.json"

# Bump the number when the answerer's rules change; the data hash follows edits of the table.
VERSION = "1." + hashlib.sha256(WORDS_FILE.read_bytes() + ATTRIBUTES_FILE.read_bytes()).hexdigest()[:8]

MAX_QUESTIONS = 20
MAX_QUESTION_CHARS = 300

YES, NO, FINISHED, INVALID, REPEATED = "Yes", "No", "Finished", "Invalid", "Repeated"

# ----------------------------------------------------------------------------------------------
# Keyword phrases of each attribute. Each entry is a regular expression matched on whole words of the
# normalised text (lower case, punctuation replaced by spaces, hyphens kept). Phrases under "not:" ask
# for the negation of the attribute. Where phrases (or words) overlap, the longest match wins.
# ----------------------------------------------------------------------------------------------
_A = r"(?:a |an |the )?"
_PERSON = r"(?:a |an |the )?(?:person|human|man|woman|adult|people|humans)"
_BREADBOX = r"(?:a |an |the )?(?:bread ?box|microwave(?: oven)?|shoe ?box|loaf of bread)"
_GOLFBALL = r"(?:a |an |the )?(?:golf ?ball|ping ?pong ball|marble|grape|coin|thumb)"
_WEAR = r"(?:(?:you |people |we )?(?:wear|wears|worn|wearing)(?: it)? )?"
_HOUSE = r"(?:a |the |your |my |our |someone's |people's |most )?(?:house|home|building|room)s?"

KEYWORDS: dict[str, list[str]] = {
    "living": [r"living(?: things?| organisms?| beings?| creatures?)?", r"alive", r"organisms?",
               r"life ?forms?", r"biological", "not:non-?living(?: things?)?", "not:inanimate",
               "not:lifeless"],
    "animal": [r"animals?", r"creatures?", r"beasts?", r"fauna", r"living creatures?"],
    "mammal": [r"mammals?", r"mammalian"],
    "bird": [r"birds?", r"avian", r"feathers?", r"feathered"],
    "fish": [r"fish(?:es)?", r"kind of fish"],
    "insect": [r"insects?", r"bugs?"],
    "reptile": [r"reptiles?", r"reptilian"],
    "plant": [r"plants?", r"flora", r"vegetation"],
    "food": [r"foods?", r"food items?", r"meals?", r"snacks?", r"ingredients?", r"grocer(?:y|ies)",
             r"foodstuffs?"],
    "drink": [r"drinks?", r"beverages?", r"drinkable", r"(?:can|do|would) (?:you|people|we|i|humans) drink(?: it)?",
              r"something (?:you|people|we) (?:can )?drink"],
    "fruit": [r"fruits?", r"fruity"],
    "vegetable": [r"vegetables?", r"veggies?"],
    "edible": [r"edible", r"eatable", r"eaten", r"consumable", r"eat it", r"eat them",
               r"(?:you|people|we|i|humans|one) (?:can |could |usually |commonly |normally |often )?(?:eat|consume)",
               r"something (?:you|people|we) (?:can )?eat", r"safe to eat", r"to eat", "not:inedible"],
    "sweet": [r"sweet", r"taste sweet", r"tastes sweet", r"sugary", r"sweet[- ]tasting"],
    "cooked": [r"cooked", r"cook it", r"cook them", r"baked", r"bake it", r"need(?:s)? cooking",
               r"(?:need|needs) to be cooked", r"served cooked", "not:raw", "not:uncooked"],
    "tree": [r"grows? on " + _A + r"trees?", r"grown on " + _A + r"trees?", r"from " + _A + r"trees?",
             r"tree fruits?", r"comes? from " + _A + r"trees?"],
    "vine": [r"grows? on " + _A + r"vines?", r"vines?", r"climbing plants?"],
    "underground": [r"underground", r"under " + _A + r"ground", r"in the (?:ground|soil|earth|dirt)",
                    r"below " + _A + r"ground", r"burrows?", r"dig(?:s)? (?:holes|tunnels)"],
    "citrus": [r"citrus(?: fruits?)?"],
    "tool": [r"tools?", r"hand tools?", r"implements?"],
    "vehicle": [r"vehicles?", r"means of transport(?:ation)?"],
    "watercraft": [r"boats?", r"watercraft", r"vessels?", r"sails?", r"sailing",
                   r"(?:travel|travels|go|goes|move|moves) (?:on|over|under|through|across) (?:the )?(?:water|sea|ocean|rivers?)",
                   r"float(?:s)? on (?:the )?water"],
    "passengers": [r"passengers?", r"public transport(?:ation)?", r"mass transit"],
    "furniture": [r"furniture", r"piece of furniture"],
    "sit": [r"sit(?:s)? (?:on|in)(?: it)?", r"seats?", r"sitting(?: on)?", r"for sitting"],
    "sleep": [r"sleep(?:s)? (?:on|in)(?: it)?", r"(?:used )?for sleeping", r"sleeping on", r"bedding"],
    "clothing": [r"clothing", r"clothes", r"garments?", r"apparel", r"attire", r"outfits?",
                 r"(?:item|piece|article) of clothing"],
    "wearable": [r"wear", r"wears", r"wearable", r"worn", r"wear it", r"put it on"],
    "head": [_WEAR + r"on (?:the |your |one's |a person's |someone's |their )?heads?", r"headwear",
             r"head ?gear"],
    "feet": [_WEAR + r"on (?:the |your |one's |a person's |their )?(?:feet|foot)", r"footwear"],
    "hands": [_WEAR + r"(?:on|around) (?:the |your |one's |a person's |their )?(?:hands?|wrists?|fingers?)"],
    "neck": [_WEAR + r"(?:on|around|round) (?:the |your |one's |a person's |their )?necks?"],
    "pair": [r"pairs?", r"come in twos", r"comes in twos"],
    "winter": [_WEAR + r"(?:to )?keep(?:s)? (?:you |people |someone |them |us )?warm", r"winter", r"cold weather"],
    "jewelry": [r"jewel(?:le)?ry", r"jewels?"],
    "electronic": [r"electronics?", r"electric(?:al)?", r"electricity", r"batter(?:y|ies)",
                   r"plug(?:ged)?(?: it)? in", r"powered", r"power outlet", r"(?:home |household |kitchen )?appliances?",
                   r"devices?", r"gadgets?", r"technology", r"tech", r"machines?", r"electronic devices?"],
    "screen": [r"screens?", r"displays?", r"monitors?"],
    "time": [r"tell(?:s)? (?:the )?time", r"show(?:s)? (?:the )?time", r"timekeeping", r"time ?pieces?",
             r"keep(?:s)? time"],
    "sound": [r"listen(?:ing)?(?: to)?(?: (?:music|sounds?|audio))?", r"hear(?:ing)?(?: (?:music|sounds?))?",
              r"audio", r"play(?:s)? music", r"music players?"],
    "instrument": [r"(?:musical )?instruments?", r"musical", r"make(?:s)? music", r"making music"],
    "toy": [r"toys?", r"games?", r"playthings?", r"play(?:ed)? with(?: it)?"],
    "sport": [r"sports?", r"sporting(?: goods)?", r"athletics?", r"exercise"],
    "container": [r"containers?", r"receptacles?", r"holders?",
                  r"(?:hold|holds|store|stores|keep|keeps|put|carry|carries) (?:things|stuff|items|objects)(?: in(?:side)?(?: it)?)?",
                  r"put things in(?:side)?(?: it)?"],
    "cleaning": [r"clean(?:ing|s|er)?", r"wash(?:ing|es)?"],
    "writing": [r"writ(?:e|es|ing)(?: with)?", r"draw(?:s|ing)?(?: with)?", r"paint(?:s|ing)?(?: with)?",
                r"stationery"],
    "cooking": [r"cook(?:ing)?", r"cook with(?: it)?", r"used (?:for|to|in) (?:cooking|cook)",
                r"heat(?:s|ing)? (?:up )?(?:food|things|water)", r"cookware"],
    "light": [r"(?:give|gives|giving|emit|emits|produce|produces|make|makes) (?:off )?light",
              r"light sources?", r"sources? of light", r"glows?", r"glowing", r"shines?", r"shining",
              r"illuminat\w*", r"lights? up"],
    "hot": [r"hot", r"warm", r"burn(?:s)? you", r"heat"],
    "building": [r"buildings?", r"architecture", r"edifice"],
    "sky": [r"(?:in|up in|seen in|found in|across) the sky", r"sky", r"skies", r"heavens"],
    "space": [r"(?:outer )?space", r"cosmos", r"universe", r"celestial(?: bod(?:y|ies)| objects?)?",
              r"astronomical(?: objects?)?"],
    "man_made": [r"man ?-?made", r"human ?-?made", r"artificial", r"manufactured", r"synthetic",
                 r"made by (?:people|humans|man|a person|hand)", r"built by (?:people|humans)",
                 r"handmade", r"factory made", "not:natural(?:ly occurring)?", "not:found in nature",
                 "not:occurs? (?:in )?nature", "not:made by nature"],
    "metal": [r"(?:made (?:of|from|out of) )?metal(?:lic)?", r"steel", r"iron", r"alumin(?:i)?um",
              r"gold", r"silver", r"copper", r"brass", r"tin"],
    "wood": [r"(?:made (?:of|from|out of) )?wood(?:en)?", r"timber", r"lumber"],
    "fabric": [r"(?:made (?:of|from|out of) )?(?:fabric|cloth|textiles?)", r"cotton", r"wool(?:len)?",
               r"silk", r"nylon"],
    "glass": [r"(?:made (?:of|from|out of) )?glass"],
    "paper": [r"(?:made (?:of|from|out of) )?(?:paper|cardboard)"],
    "stone": [r"made (?:of|from|out of) (?:stone|stones|rock|rocks)", r"stony", r"rocky",
              r"stone building"],
    "liquid": [r"liquids?", r"fluids?", r"runny"],
    "tiny": [r"(?:smaller|tinier|littler) than " + _GOLFBALL, r"tiny", r"very (?:small|little)",
             r"minuscule", r"microscopic",
             r"not:(?:bigger|larger) than " + _GOLFBALL],
    "handheld": [r"hold(?: it)? in (?:one|your|a|my) hand", r"hand-?held", r"fits? in (?:your |one |a |my )?hand",
                 r"carry(?: it)? in (?:one|your|a) hand", r"pick(?: it)? up", r"lift(?: it)?(?: with one hand)?",
                 r"hold it"],
    "breadbox": [r"(?:bigger|larger) than " + _BREADBOX, r"big", r"large", r"bigger", r"larger",
                 "not:(?:smaller|tinier) than " + _BREADBOX, "not:small", "not:little"],
    "person": [r"heavier than " + _PERSON, r"weighs? more than " + _PERSON, r"heavy",
               r"(?:bigger|larger|taller) than " + _PERSON,
               "not:lighter than " + _PERSON, "not:weighs? less than " + _PERSON,
               "not:(?:smaller|shorter) than " + _PERSON],
    "car": [r"(?:bigger|larger) than " + _A + r"(?:car|automobile)s?", r"huge", r"enormous",
            r"gigantic", r"massive", "not:smaller than " + _A + r"(?:car|automobile)s?"],
    "indoors": [r"indoors?", r"inside", r"in(?:side)? " + _HOUSE, r"at home", r"households?(?: items?| objects?)?",
                r"(?:found|kept|used) in " + _HOUSE],
    "outdoors": [r"outdoors?", r"outside", r"in the open air", r"open-air"],
    "kitchen": [r"kitchens?", r"kitchenware", r"utensils?", r"cutlery"],
    "bathroom": [r"bathrooms?", r"restrooms?", r"washrooms?"],
    "office": [r"offices?", r"(?:at |in |for )?school", r"classrooms?", r"office supply", r"office supplies"],
    "transport": [r"transport(?:ation|ing)?", r"travel(?:l?ing)?(?: in| on| with)?", r"ride(?: it| on it| in it| on| in)?",
                  r"riding", r"get around", r"carr(?:y|ies) people", r"move people", r"drive(?: it)?", r"commut(?:e|ing)"],
    "fly": [r"fly", r"flies", r"flying", r"flight", r"airborne"],
    "water": [r"(?:live|lives|living|found|swim|swims) (?:in|under|on) (?:the |a )?(?:water|sea|ocean|river|lake|pond)s?",
              r"aquatic", r"marine", r"swims?", r"swimming", r"underwater", r"in (?:the )?water",
              r"sea (?:animal|creature)s?"],
    "legs": [r"legs?", r"legged", r"walks?", r"walking"],
    "tail": [r"tails?"],
    "eggs": [r"(?:lay|lays|laying|hatch|hatches|hatched) (?:from )?(?:an )?eggs?", r"hatch(?:es|ed)?",
             r"comes? from (?:an |a )?eggs?", r"oviparous"],
    "carnivore": [r"carnivor(?:e|es|ous)", r"predators?", r"predatory", r"hunts?", r"hunting", r"hunter",
                  r"eats? (?:meat|other animals|animals|fish|insects|bugs|prey)", r"meat[- ]?eat(?:er|ing|ers)"],
    "pet": [r"pets?", r"house ?pets?", r"kept as (?:a )?pets?", r"companion animals?"],
    "farm": [r"farms?(?: animals?)?", r"livestock", r"ranch", r"barn(?:yard)?", r"on a farm"],
    "wheels": [r"wheels?", r"wheeled"],
    "engine": [r"engines?", r"motors?", r"motori[sz]ed", r"fuel", r"gasoline", r"petrol", r"diesel"],
    "road": [r"(?:(?:travel|travels|drive|drives|go|goes|run|runs) )?(?:on|along) (?:the )?roads?", r"roads?", r"streets?", r"highways?"],
    "sharp": [r"sharp", r"cut(?:s)?(?: things)?", r"pointy", r"pointed", r"blades?", r"thorns?", r"thorny",
              r"spines?", r"spiky", r"prickly"],
    "round": [r"round", r"circular", r"spherical", r"spheres?", r"ball[- ]shaped", r"circles?", r"round-shaped"],
    "flower": [r"flowers?", r"blossoms?", r"blooms?", r"petals?", r"flowering"],
    "stripes": [r"stripes?", r"striped", r"stripy"],
    "bark": [r"barks?", r"barking"],
    "horns": [r"horns?", r"antlers?", r"horned"],
    "spots": [r"spots?", r"spotted", r"spotty"],
    "red": [r"red(?: in colou?r)?"],
    "yellow": [r"yellow", r"golden"],
    "green": [r"green"],
    "white": [r"white"],
    "brown": [r"brown"],
    "gray": [r"gr[ae]y"],
    "black": [r"black"],
}

# Properties the table does not hold: a question about them is Invalid rather than answered wrongly.
UNSUPPORTED = [r"wild", r"domestic(?:ated)?", r"dangerous", r"poisonous", r"venomous", r"expensive",
               r"cheap", r"valuable", r"famous", r"rare", r"ha(?:ve|s) bark", r"colou?rs?", r"colou?rful",
               r"shapes?", r"wings?", r"herbivores?", r"omnivores?", r"eats? plants", r"smell(?:s|y)?",
               r"soft", r"hard", r"plastic", r"leather", r"ceramic", r"orange colou?r(?:ed)?",
               r"non-?[a-z]+", r"(?:one|two|three|four|five|six|seven|eight|nine|ten|\d+) (?:legs|wheels|arms|feet)",
               r"(?:bigger|larger|smaller|heavier|lighter|taller|shorter|longer|faster|slower) than (?:a |an |the )?[a-z'-]+"]

_AUX = ("is", "are", "does", "do", "can", "could", "has", "have", "will", "would", "was", "were", "did",
        "should", "may", "might", "shall", "am")
_WH = ("what", "which", "where", "when", "why", "who", "whom", "whose", "how")
_SECOND_Q = re.compile(r"\b(?:and|or|but|also)\s+(?:" + "|".join(_AUX) + r")\s+(?:it|they|this|that|you|its)\b")
_NEGATION = re.compile(r"\b(?:not|never|no|nor|neither|none)\b|n't\b")
_PREFIX = re.compile(r"^\s*(?:question|q|guess|my question|answer)\s*\d*\s*[:\-]\s*")


class Parsed(NamedTuple):
    """What a question asks: kind is "invalid", "attribute" (attr, value asked) or "guess" (word)."""

    kind: str
    attr: Optional[str] = None
    positive: bool = True
    word: Optional[str] = None
    reason: str = ""
    words: tuple = ()  # every word a guess names (the word game: one or several)


def normalize_question(text: str) -> str:
    """Lower case, letters and digits and single spaces only: the key used for Repeated."""
    t = unicodedata.normalize("NFKC", text).lower()
    t = _PREFIX.sub("", t)
    return " ".join(re.findall(r"[a-z0-9]+", t))


def _plurals(form: str) -> set[str]:
    head, _, last = form.rpartition(" ")
    pre = head + " " if head else ""
    out = {form}
    if re.search(r"(?:s|x|z|ch|sh)$", last):
        out.add(pre + last + "es")
    elif re.search(r"[^aeiou]y$", last):
        out.add(pre + last[:-1] + "ies")
    else:
        out.add(pre + last + "s")
        if last.endswith("o"):
            out.add(pre + last + "es")
        if last.endswith("fe"):
            out.add(pre + last[:-2] + "ves")
        if last.endswith("f"):
            out.add(pre + last[:-1] + "ves")
    return out


class Table(NamedTuple):
    words: list[str]
    categories: dict[str, str]
    splits: dict[str, str]
    articles: dict[str, str]
    variants: dict[str, list[str]]
    attributes: list[str]
    questions: dict[str, str]
    definitions: dict[str, str]
    values: dict[str, dict[str, bool]]  # word -> attribute -> value
    patterns: list[tuple[re.Pattern, str, object]]  # (regex, kind, payload), kind in attr/word/block


def compile_patterns(keywords: dict[str, list[str]], name_groups: list[dict], unsupported: list[str]) -> list:
    """The matching patterns of a table: (regex, kind, payload) with kind "attr" (payload (attr, positive);
    a phrase under "not:" asks for the negation), "word" (payload: compact surface form -> name) or "block"
    (an unsupported property). Each of `name_groups` maps a name (any hashable) to its forms; a group's forms
    and their regular plurals make one alternation, longest first (so "ice cream" beats "ice", "cats" beats
    "cat"), and the matched text without spaces and hyphens names the name."""
    patterns: list[tuple[re.Pattern, str, object]] = []

    def add(rx: str, kind: str, payload) -> None:
        patterns.append((re.compile(r"(?<![a-z0-9'-])(?:" + rx + r")(?![a-z0-9'-])"), kind, payload))

    for attr, phrases in keywords.items():
        for p in phrases:
            neg = p.startswith("not:")
            add(p[4:] if neg else p, "attr", (attr, not neg))
    for group in name_groups:
        surface: dict[str, object] = {}
        for name, forms in group.items():
            for form in forms:
                for s in _plurals(form):
                    assert surface.get(s, name) == name, f"surface form {s!r} names both {surface[s]!r} and {name!r}"
                    surface[s] = name
        forms = sorted(surface, key=lambda f: (-len(f), f))
        compact: dict[str, object] = {}
        for f, name in surface.items():
            c = re.sub(r"[ -]", "", f)
            assert compact.setdefault(c, name) == name, f"surface form {f!r} names both {compact[c]!r} and {name!r}"
        add("|".join(re.escape(f).replace(r"\ ", r"[ -]?").replace(r"\-", r"[ -]?") for f in forms), "word",
            compact)
    for rx in unsupported:
        add(rx, "block", None)
    return patterns


@lru_cache(maxsize=None)
def load_table() -> Table:
    """Read the word table and the attribute definitions, and compile the matching patterns."""
    meta = json.loads(ATTRIBUTES_FILE.read_text())
    attributes = [a["name"] for a in meta["attributes"]]
    questions = {a["name"]: a["question"] for a in meta["attributes"]}
    definitions = {a["name"]: a["definition"] for a in meta["attributes"]}
    words, categories, splits, articles, variants, values = [], {}, {}, {}, {}, {}
    with open(WORDS_FILE, newline="") as f:
        for row in csv.DictReader(f):
            w = row["word"]
            words.append(w)
            categories[w], splits[w], articles[w] = row["category"], row["split"], row["article"]
            variants[w] = [v for v in row["variants"].split(";") if v]
            values[w] = {a: row[a] == "1" for a in attributes}
    names = {w: [w] + variants[w] for w in words}
    patterns = compile_patterns(KEYWORDS, [names], UNSUPPORTED)
    assert all(attr in questions for attr in KEYWORDS)
    return Table(words, categories, splits, articles, variants, attributes, questions, definitions,
                 values, patterns)


_KIND_RANK = {"attr": 0, "word": 1, "block": 2}


def question_body(text) -> tuple[str, Optional[Parsed]]:
    """The form checks of step 2 of the module docstring, shared by both kinds of secret: (the normalised
    body of the one question, None), or ("", an invalid Parsed with its reason)."""
    if not isinstance(text, str):
        return "", Parsed("invalid", reason="not text")
    raw = text.strip()
    if not raw:
        return "", Parsed("invalid", reason="empty")
    if len(raw) > MAX_QUESTION_CHARS:
        return "", Parsed("invalid", reason="too long")
    t = unicodedata.normalize("NFKC", raw).lower().replace("\u2019", "'").replace("\u2018", "'")
    t = _PREFIX.sub("", t).strip()
    if t.count("?") > 1:
        return "", Parsed("invalid", reason="more than one question")
    sentences = [s for s in re.split(r"[?.!;\n]+", t) if s.strip(" \t\"'()[]*")]
    if len(sentences) != 1:
        return "", Parsed("invalid", reason="not a single question")
    body = re.sub(r"[^a-z0-9'\- ]+", " ", sentences[0])
    body = " ".join(re.sub(r"(?<![a-z])'|'(?![a-z])", " ", body).split())  # quotes, not apostrophes
    first = body.split(" ", 1)[0] if body else ""
    if first in _WH:
        return "", Parsed("invalid", reason="not a yes/no question")
    if not t.rstrip(" \"')*").endswith("?") and first not in _AUX:
        return "", Parsed("invalid", reason="not a question")
    if _SECOND_Q.search(body):
        return "", Parsed("invalid", reason="more than one question")
    if _NEGATION.search(body):
        return "", Parsed("invalid", reason="negated question")
    return body, None


def match_phrases(body: str, patterns) -> tuple[set, set, bool]:
    """Step 3: the attributes (attr, positive), the names and whether an unsupported property is matched in
    `body`; where matches overlap the longest wins (on equal length: attribute, then name, then block)."""
    found = []
    for rx, kind, payload in patterns:
        for m in rx.finditer(body):
            if m.end() > m.start():
                found.append((m.end() - m.start(), -_KIND_RANK[kind], -m.start(), m.start(), m.end(), kind, payload))
    found.sort(reverse=True)
    taken: list[tuple[int, int]] = []
    attrs, named, blocked = set(), set(), False
    for _, _, _, s, e, kind, payload in found:
        if any(s < te and ts < e for ts, te in taken):
            continue
        taken.append((s, e))
        if kind == "attr":
            attrs.add(payload)
        elif kind == "word":
            named.add(payload[re.sub(r"[ -]", "", body[s:e])])
        else:
            blocked = True
    return attrs, named, blocked


def parse_question(text: str) -> Parsed:
    """Read one question (any string) into what it asks, independent of the secret (see module doc)."""
    body, invalid = question_body(text)
    if invalid is not None:
        return invalid
    attrs, named, blocked = match_phrases(body, load_table().patterns)
    if named:  # one guess, or a guess of each named word (App. B.1)
        words = tuple(sorted(named, key=load_table().words.index))
        return Parsed("guess", word=words[0], words=words)
    if blocked:
        return Parsed("invalid", reason="unsupported property")
    if not attrs:
        return Parsed("invalid", reason="nothing understood")
    if len(attrs) > 1:
        return Parsed("invalid", reason="several properties")
    attr, positive = attrs.pop()
    return Parsed("attribute", attr=attr, positive=positive)


def guess_question(word: str) -> str:
    """The canonical guess: "Is it a cat?", "Is it an apple?", "Is it rice?", "Is it the sun?"."""
    art = load_table().articles.get(word, "a")
    return f"Is it {word}?" if art in ("-", "") else f"Is it {art} {word}?"


# ----------------------------------------------------------------------------------------------
# Compound secrets (secrets="compound"): "<colour> <thing>", every part seen in the train secrets
# ----------------------------------------------------------------------------------------------
COMPOUND_FILE = DATA_DIR / "twenty_questions_compound.json"
# Bump the number when the compound answerer's rules or its split change; the data hash follows the file.
COMPOUND_VERSION = "c1." + hashlib.sha256(COMPOUND_FILE.read_bytes()).hexdigest()[:8]
COMPOUND_TEST_EVERY = 5  # secret (colour j, thing i) is a test secret when (i - j) % 5 == 0

_COLOUR = r"colou?r(?:ed|s)?"


def _colour_phrases(adjective: str) -> list[str]:
    """"warm colour", "warm-coloured", "its colour is warm", "colour that is warm"."""
    return [adjective + r"[ -]" + _COLOUR, _COLOUR + r" (?:is |that is |which is )?" + adjective]


COMPOUND_KEYWORDS: dict[str, list[str]] = {
    "animal": [r"animals?", r"creatures?", r"beasts?", r"alive", r"living(?: things?| beings?| creatures?)?"],
    "vehicle": [r"vehicles?", r"means of transport(?:ation)?"],
    "mammal": [r"mammals?", r"mammalian"],
    "fly": [r"fly", r"flies", r"flying", r"airborne"],
    "water": [r"(?:live|lives|living|found) in (?:the )?(?:water|sea|ocean|river|pond|lake)s?", r"aquatic",
              r"water animals?"],
    "pet": [r"pets?", r"kept as (?:a )?pets?", r"house ?pets?"],
    "ride": [r"ride(?: it| on it| in it| on| in)?", r"ridden", r"riding"],
    "engine": [r"engines?", r"motors?", r"motori[sz]ed"],
    "furniture": [r"furniture", r"piece of furniture"],
    "wear": [r"wear(?: it)?", r"worn", r"wearable", r"clothing", r"clothes"],
    "legs": [r"legs?", r"legged"],
    "wheels": [r"wheels?", r"wheeled"],
    "handheld": [r"hold(?: it)? in (?:one|your|a|my) hand", r"hand-?held", r"fits? in (?:your |one |a |my )?hand"],
    "feathers": [r"feathers?", r"feathered"],
    "bark": [r"barks?", r"barking"],
    "hoot": [r"hoots?", r"hooting"],
    "sleep": [r"sleep(?:s)? (?:on|in)(?: it)?", r"for sleeping", r"sleeping on"],
    "warm": _colour_phrases("warm") + ["not:" + p for p in _colour_phrases("cool")],
    "rainbow": [_COLOUR + r" of (?:the |a )?rainbow", r"(?:in|on) (?:the |a )?rainbow", r"rainbow " + _COLOUR],
    "dark": _colour_phrases("dark"),
    "light": _colour_phrases("(?:light|pale)"),
    "neutral": _colour_phrases("neutral"),
    "metallic": _colour_phrases("(?:metallic|metal)") + [r"metallic"],
    "primary": _colour_phrases("primary"),
}

# Properties the compound table does not hold (size, danger, blood temperature, a bare "colour", ...): Invalid.
COMPOUND_UNSUPPORTED = [r"big", r"small", r"large", r"tiny", r"huge", r"little", r"heavy", r"wild", r"dangerous",
                        r"domestic(?:ated)?", r"warm-?blooded", r"cold-?blooded", r"fast", r"slow", r"expensive",
                        r"cheap", r"bright", r"colou?r(?:ed|s|ful)?", r"shades?",
                        r"(?:one|two|three|four|five|six|\d+) (?:legs|wheels|feet)",
                        r"(?:bigger|larger|smaller|heavier|lighter|taller|shorter|faster|slower) than"]


class CompoundTable(NamedTuple):
    words: list[str]  # the secrets "<colour> <thing>", thing by thing
    splits: dict[str, str]
    articles: dict[str, str]  # "a" or "an"
    parts: dict[str, list[str]]  # "thing" -> the things, "colour" -> the colours
    features: dict[str, list[str]]  # part -> its feature attributes in file order (the expert asks in this order)
    attributes: list[str]  # the features, then the identity attributes "thing=cat", "colour=red"
    questions: dict[str, str]
    definitions: dict[str, str]
    values: dict[str, dict[str, bool]]  # secret -> attribute -> value
    patterns: list[tuple[re.Pattern, str, object]]


@lru_cache(maxsize=None)
def load_compound_table() -> CompoundTable:
    """Read the parts, their items and features, build every secret, its attribute values and its split."""
    meta = json.loads(COMPOUND_FILE.read_text())
    part_data = {p["name"]: p for p in meta["parts"]}
    assert sorted(part_data) == ["colour", "thing"], sorted(part_data)
    parts = {name: [it["name"] for it in part_data[name]["items"]] for name in ("thing", "colour")}
    features = {name: [f["name"] for f in part_data[name]["features"]] for name in ("thing", "colour")}
    questions, definitions, truth = {}, {}, {}
    for name in ("thing", "colour"):
        for f in part_data[name]["features"]:
            assert f["name"] not in questions and set(f["true"]) <= set(parts[name]), f["name"]
            questions[f["name"]], definitions[f["name"]], truth[f["name"]] = f["question"], f["definition"], set(f["true"])
    identity = [f"{name}={item}" for name in ("thing", "colour") for item in parts[name]]
    for name in ("thing", "colour"):
        for item in parts[name]:
            art = "an" if item[0] in "aeiou" else "a"
            questions[f"{name}={item}"] = f"Is it {art} {item}?" if name == "thing" else f"Is it {item}?"
            definitions[f"{name}={item}"] = f"the {name} is {item}"
    words, splits, articles, values = [], {}, {}, {}
    for i, thing in enumerate(parts["thing"]):
        for j, colour in enumerate(parts["colour"]):
            w = f"{colour} {thing}"
            words.append(w)
            splits[w] = "test" if (i - j) % COMPOUND_TEST_EVERY == 0 else "train"
            articles[w] = "an" if colour[0] in "aeiou" else "a"
            values[w] = {**{a: thing in truth[a] for a in features["thing"]},
                         **{a: colour in truth[a] for a in features["colour"]},
                         **{f"thing={t}": t == thing for t in parts["thing"]},
                         **{f"colour={c}": c == colour for c in parts["colour"]}}
    assert set(COMPOUND_KEYWORDS) == set(features["thing"]) | set(features["colour"])
    name_groups = [{(name, it["name"]): [it["name"]] + it["variants"] for it in part_data[name]["items"]}
                   for name in ("thing", "colour")]
    patterns = compile_patterns(COMPOUND_KEYWORDS, name_groups, COMPOUND_UNSUPPORTED)
    return CompoundTable(words, splits, articles, parts, features, features["thing"] + features["colour"] + identity,
                         questions, definitions, values, patterns)


def parse_compound_question(text) -> Parsed:
    """Read one question about a compound secret: a guess names a colour and a thing ("Is it a red cat?");
    naming only a thing or only a colour asks about that part ("Is it a cat?", "Is it red?": attribute
    "thing=cat" / "colour=red"); otherwise as `parse_question`, with the compound table's features."""
    body, invalid = question_body(text)
    if invalid is not None:
        return invalid
    attrs, named, blocked = match_phrases(body, load_compound_table().patterns)
    things = [item for part, item in named if part == "thing"]
    colours = [item for part, item in named if part == "colour"]
    if len(things) > 1 or len(colours) > 1:
        return Parsed("invalid", reason="several guesses")
    if things and colours:
        return Parsed("guess", word=f"{colours[0]} {things[0]}")
    if named and attrs:  # "Is it a red animal?": two properties at once
        return Parsed("invalid", reason="several properties")
    if named:
        part, item = named.pop()
        return Parsed("attribute", attr=f"{part}={item}")
    if blocked:
        return Parsed("invalid", reason="unsupported property")
    if not attrs:
        return Parsed("invalid", reason="nothing understood")
    if len(attrs) > 1:
        return Parsed("invalid", reason="several properties")
    attr, positive = attrs.pop()
    return Parsed("attribute", attr=attr, positive=positive)


def _answers_rule(at_once: str) -> str:
    return ("The answerer replies Yes, No, Finished (you named the secret: you win), Repeated (you already asked "
            "this question) or Invalid (not a single yes/no question it understands: two questions, a negated "
            f"question, {at_once} at once, or a property it does not know). You have at most 20 questions. ")


class TwentyQuestionsEnv(QuestionGameEnv):
    """Twenty Questions against the rule-based answerer (see the module docstring). `secrets="word"` (the
    default): the secret is a noun of the word table; `secrets="compound"`: a thing of some colour."""

    env_id = "twenty_questions"
    max_turns = MAX_QUESTIONS

    WORD_TASK_PROMPT = ('Twenty Questions: find the secret word with yes/no questions, '
                        'then guess it with "Is it a <word>?".')
    WORD_SYSTEM_PROMPT = (
        "You are the questioner in a game of Twenty Questions. The secret is a common concrete noun: "
        "an animal, plant, food, drink, tool, vehicle, piece of furniture, piece of clothing, household "
        "object, building or natural thing. Each turn ask exactly one yes/no question about one "
        "property, for example \"Is it an animal?\", \"Is it bigger than a breadbox?\", \"Is it made "
        "of metal?\", \"Can you eat it?\". To guess, ask \"Is it a <word>?\"; a wrong guess counts as "
        "a question. " + _answers_rule("several properties") + INSTRUCT_FORMAT
    )
    COMPOUND_TASK_PROMPT = ('Twenty Questions: find the secret thing and its colour with yes/no questions, '
                            'then guess it with "Is it a <colour> <thing>?".')

    def __init__(self, history: Optional[int] = None, show_candidates: int = 0, instructions: bool = True,
                 numbered: bool = True, secrets: str = "word"):
        super().__init__(history=history, show_candidates=show_candidates, instructions=instructions,
                         numbered=numbered)
        if secrets == "word":
            self.table = load_table()
            self._parse = parse_question
            self.expert_groups = [list(self.table.attributes)]
            self.version = VERSION
            self.candidates_label = "words"
            self.task_prompt, self.system_prompt = self.WORD_TASK_PROMPT, self.WORD_SYSTEM_PROMPT
        elif secrets == "compound":
            self.table = load_compound_table()
            self._parse = parse_compound_question
            self.expert_groups = [self.table.features["thing"], self.table.features["colour"]]
            self.version = COMPOUND_VERSION
            self.candidates_label = "secrets"
            self.task_prompt = self.COMPOUND_TASK_PROMPT
            self.system_prompt = (
                "You are the questioner in a game of Twenty Questions. The secret is a thing of some colour, such "
                "as \"a red cat\": an animal, a vehicle, a piece of furniture or a household object, in a common "
                "colour. Each turn ask exactly one yes/no question "
                "about one property of the thing or of its colour, for example \"Is it an animal?\", \"Can it "
                "fly?\", \"Is it a warm colour?\", \"Is it a colour of the rainbow?\". To guess, ask \"Is it a "
                "<colour> <thing>?\"; a wrong guess counts as a question. " + _answers_rule("several properties or "
                                                                              "guesses") + INSTRUCT_FORMAT)
        else:
            raise ValueError(f"secrets must be 'word' or 'compound', got {secrets!r}")
        self.secrets = secrets
        self.words = list(self.table.words)
        self.attributes = list(self.table.attributes)
        self.canonical_questions = [self.table.questions[a] for group in self.expert_groups for a in group]
        self.guess_targets = list(self.words)
        self.target: Optional[str] = None
        self.facts: dict[str, bool] = {}
        self.guessed: list[str] = []
        self.asked: set[str] = set()
        self.solved = False

    # -- protocol ------------------------------------------------------------------------------
    def _reset(self, task_id: str) -> str:
        if task_id not in self.table.values:
            raise ValueError(f"unknown twenty_questions task id {task_id!r}; the ids are the secrets "
                             f"({self.secrets} secrets) listed by task_ids('train') and task_ids('test')")
        self.target = task_id
        self.facts, self.guessed, self.asked, self.solved = {}, [], set(), False
        return "Ask your first question."

    def _step(self, action: str) -> Step:
        info = {"success": False, "invalid": False, "repeated": False, "attribute": None, "guess": None}
        key = normalize_question(action)
        parsed = self._parse(action)
        if parsed.kind != "invalid" and key in self.asked:
            answer = REPEATED
            info["repeated"] = True
        elif parsed.kind == "invalid":
            answer = INVALID
            info["invalid"] = True
            info["reason"] = parsed.reason
        elif parsed.kind == "guess":
            self.asked.add(key)
            words = parsed.words or (parsed.word,)
            info["guess"] = self.target if self.target in words else parsed.word
            self.guessed += [w for w in words if w not in self.guessed]
            if self.target in words:
                answer = FINISHED
                self.solved = True
                info["success"] = True
            else:
                answer = NO
        else:
            self.asked.add(key)
            value = self.table.values[self.target][parsed.attr]
            self.facts[parsed.attr] = value
            info["attribute"] = parsed.attr
            answer = YES if value == parsed.positive else NO
        info["answer"] = answer
        info["progress"] = self.progress()
        return Step(answer, 1.0 if self.solved else 0.0, self.solved, info)

    def state_key(self) -> Hashable:
        return frozenset([(a, v) for a, v in self.facts.items()] + [("guess", w) for w in self.guessed])

    def candidates(self) -> list[str]:
        """Words consistent with the facts learnt and not guessed yet (the secret only, once found)."""
        if self.solved:
            return [self.target]
        vals = self.table.values
        return [w for w in self.words if w not in self.guessed
                and all(vals[w][a] == v for a, v in self.facts.items())]

    def progress(self) -> float:
        n = max(1, len(self.candidates()))
        return 1.0 - math.log(n) / math.log(len(self.words))

    def expert_action(self) -> str:
        cands = self.candidates()
        if len(cands) <= 1:
            return self.guess_text(cands[0] if cands else self.target)
        vals = self.table.values
        for group in self.expert_groups:  # the word game: one group; compound: the thing's, then the colour's
            best, best_score = None, 0
            for a in group:
                yes = sum(vals[w][a] for w in cands)
                score = min(yes, len(cands) - yes)
                if score > best_score:
                    best, best_score = a, score
            if best is not None:
                return self.table.questions[best]
        return self.guess_text(cands[0])

    def guess_text(self, target: str) -> str:
        """The canonical guess: "Is it a cat?", "Is it rice?" (word game); "Is it an orange cat?" (compound)."""
        art = self.table.articles.get(target, "a")
        return f"Is it {target}?" if art in ("-", "") else f"Is it {art} {target}?"
