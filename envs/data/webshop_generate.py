"""Write the WebShop-lite data: envs/data/webshop_catalogue.json and envs/data/webshop_tasks.json.

Run `python envs/data/webshop_generate.py [OUT_DIR]` (default: this directory). The output depends only on the
tables below and SEED (Python's `random.Random` with a string seed), so rerunning it rewrites the
same files.

Catalogue. For every category and each of its 4 product types, PER_TYPE products: one attribute from
each of the category's three attribute groups, the title "<group 3> <group 2> <group 1> <type>"
(e.g. "organic slim fit cotton t-shirt"), an integer price drawn from the type's price range, 2 to 5
colors from the category's palette and a run of 2 or more of the category's sizes. Products are
shuffled, then numbered p001, p002, ...

Instructions. Each is built from a target product: its type, k of its attributes (k = 1, 2 or 3 with
probabilities 0.25, 0.5, 0.25; in title order), its options (color and size with probability 0.7,
else only one of them) and the price bound, the next multiple of $10 strictly above its price:
"i need a red slim fit cotton t-shirt, size m, under $30". The query is the noun phrase: color,
attributes, type ("red slim fit cotton t-shirt"). An instruction is kept only when, in the results of
its query (the env's search, 15 results), the first product that looks right on the results page
(type, every goal attribute, price under the bound) also offers every goal option, so that the
scripted expert's choice can be read from the page; and when its text is new. Test instructions are
drawn first (TEST), then train instructions (TRAIN) that differ from every test instruction.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEED = "webshop-lite-1"
PER_TYPE = 13
TRAIN, TEST = 1500, 200
MAX_RESULTS = 15

# category -> types (with price ranges), three attribute groups (in the order listed in the title, last
# first), colors, sizes
CATEGORIES = {
    "tops": dict(
        types={"t-shirt": (8, 35), "hoodie": (25, 70), "sweater": (30, 90), "tank top": (8, 30)},
        groups=[["cotton", "linen", "wool", "fleece", "bamboo"],
                ["slim fit", "relaxed fit", "oversized"],
                ["organic", "long sleeve", "short sleeve", "quick dry"]],
        colors=["black", "white", "red", "blue", "navy", "green", "grey", "pink"],
        sizes=["xs", "s", "m", "l", "xl"]),
    "bottoms": dict(
        types={"jeans": (25, 90), "shorts": (12, 45), "joggers": (18, 60), "chinos": (22, 70)},
        groups=[["cotton", "denim", "corduroy", "linen"],
                ["slim fit", "straight leg", "relaxed fit", "high waist"],
                ["stretch", "distressed", "drawstring", "lightweight"]],
        colors=["black", "blue", "navy", "khaki", "grey", "olive", "white", "brown"],
        sizes=["28", "30", "32", "34", "36"]),
    "shoes": dict(
        types={"sneakers": (30, 120), "boots": (45, 160), "sandals": (15, 60), "loafers": (35, 110)},
        groups=[["leather", "canvas", "suede", "mesh"],
                ["low top", "high top", "slip on"],
                ["waterproof", "non slip", "memory foam", "lightweight"]],
        colors=["black", "white", "brown", "tan", "grey", "navy", "red", "beige"],
        sizes=["6", "7", "8", "9", "10", "11", "12"]),
    "bags": dict(
        types={"backpack": (20, 90), "tote bag": (12, 50), "duffel bag": (25, 95), "messenger bag": (20, 80)},
        groups=[["nylon", "canvas", "leather", "polyester"],
                ["zippered", "roll top", "drawstring"],
                ["waterproof", "padded", "anti theft", "foldable"]],
        colors=["black", "grey", "navy", "green", "brown", "red", "blue", "beige"],
        sizes=["small", "medium", "large"]),
    "bedding": dict(
        types={"pillow": (12, 50), "blanket": (20, 80), "duvet cover": (30, 110), "sheet set": (25, 100)},
        groups=[["cotton", "linen", "microfiber", "bamboo"],
                ["quilted", "knitted", "striped", "plain"],
                ["hypoallergenic", "cooling", "machine washable", "organic"]],
        colors=["white", "grey", "beige", "blue", "green", "pink", "navy", "yellow"],
        sizes=["twin", "full", "queen", "king"]),
    "drinkware": dict(
        types={"water bottle": (8, 40), "travel mug": (10, 35), "tumbler": (10, 45), "coffee mug": (6, 25)},
        groups=[["stainless steel", "glass", "ceramic", "plastic"],
                ["with straw", "with handle", "wide mouth", "with lid"],
                ["insulated", "leak proof", "dishwasher safe", "bpa free"]],
        colors=["black", "white", "silver", "blue", "green", "pink", "red", "purple"],
        sizes=["12 oz", "16 oz", "20 oz", "32 oz"]),
    "outerwear": dict(
        types={"rain jacket": (35, 130), "puffer jacket": (50, 180), "fleece vest": (20, 70), "parka": (70, 220)},
        groups=[["nylon", "down", "fleece", "softshell"],
                ["hooded", "zip up", "belted"],
                ["waterproof", "windproof", "packable", "insulated"]],
        colors=["black", "navy", "olive", "red", "grey", "blue", "yellow", "orange"],
        sizes=["xs", "s", "m", "l", "xl"]),
}

PLURAL = {"jeans", "shorts", "joggers", "chinos", "sneakers", "boots", "sandals", "loafers"}
OPENERS = ["i need", "i am looking for", "find me", "i want to buy"]


def make_products(rng: random.Random) -> list[dict]:
    products = []
    for cat, spec in CATEGORIES.items():
        for typ, (lo, hi) in spec["types"].items():
            for _ in range(PER_TYPE):
                attrs = [rng.choice(g) for g in spec["groups"]]
                title = " ".join(list(reversed(attrs)) + [typ])
                colors = rng.sample(spec["colors"], rng.randint(2, 5))
                colors.sort(key=spec["colors"].index)
                sizes = spec["sizes"]
                n = rng.randint(2, len(sizes))
                start = rng.randint(0, len(sizes) - n)
                products.append(dict(category=cat, type=typ, attributes=list(reversed(attrs)), title=title,
                                     price=rng.randint(lo, hi), popularity=round(rng.random(), 2),
                                     options={"color": colors, "size": sizes[start:start + n]}))
    rng.shuffle(products)
    return [dict(id=f"p{i:03d}", **p) for i, p in enumerate(products, 1)]


def make_goal(rng: random.Random, p: dict) -> dict:
    k = rng.choices([1, 2, 3], weights=[0.25, 0.5, 0.25])[0]
    keep = sorted(rng.sample(range(3), k))
    attrs = [p["attributes"][i] for i in keep]
    r = rng.random()
    color = rng.choice(p["options"]["color"])
    size = rng.choice(p["options"]["size"])
    options = {"color": color, "size": size} if r < 0.7 else ({"color": color} if r < 0.85 else {"size": size})
    bound = (p["price"] // 10 + 1) * 10
    phrase = " ".join(([options["color"]] if "color" in options else []) + attrs + [p["type"]])
    if p["type"] in PLURAL:
        article = "a pair of"
    else:
        article = "an" if phrase[0] in "aeiou" else "a"
    text = f"{rng.choice(OPENERS)} {article} {phrase}"
    if "size" in options:
        text += f", size {options['size']},"
    text += f" under ${bound}"
    return dict(instruction=text, query=phrase, category=p["category"], type=p["type"], attributes=attrs,
                options=options, price_upper=bound, target=p["id"])


def readable(goal: dict, products: list[dict], by_id: dict) -> bool:
    from envs.webshop import can_satisfy, looks_right, search

    for pid in search(products, goal["query"], MAX_RESULTS):
        if looks_right(by_id[pid], goal):
            return can_satisfy(by_id[pid], goal)
    return False


def main(out_dir: Path = Path(__file__).resolve().parent) -> None:
    rng = random.Random(SEED)
    products = make_products(rng)
    by_id = {p["id"]: p for p in products}
    cat_out = dict(description="WebShop-lite synthetic catalogue (envs/data/webshop_generate.py)",
                   categories={c: dict(types=list(s["types"]), attribute_groups=s["groups"], colors=s["colors"],
                                       sizes=s["sizes"]) for c, s in CATEGORIES.items()},
                   products=products)
    seen: set[str] = set()
    splits = {}
    for split, n in (("test", TEST), ("train", TRAIN)):
        out = []
        tries = 0
        while len(out) < n:
            tries += 1
            if tries > 50 * n:
                raise SystemExit(f"could not draw {n} {split} instructions")
            goal = make_goal(rng, rng.choice(products))
            if goal["instruction"] in seen or not readable(goal, products, by_id):
                continue
            seen.add(goal["instruction"])
            out.append(goal)
        splits[split] = out
        print(f"{split}: {n} instructions from {tries} drawn", file=sys.stderr)
    here = Path(out_dir)
    (here / "webshop_catalogue.json").write_text(dumps(cat_out))
    (here / "webshop_tasks.json").write_text(dumps({"train": splits["train"], "test": splits["test"]}))


def dumps(obj: dict) -> str:
    """JSON with one list item (product, instruction) per line."""
    lines = ["{"]
    for i, (key, value) in enumerate(obj.items()):
        end = "," if i < len(obj) - 1 else ""
        if isinstance(value, list):
            lines.append(f" {json.dumps(key)}: [")
            lines += [f"  {json.dumps(v)}" + ("," if j < len(value) - 1 else "") for j, v in enumerate(value)]
            lines.append(" ]" + end)
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}{end}")
    return "\n".join(lines + ["}"]) + "\n"

if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:2]))
