"""Tiny local policies: a small Llama model per env, trained from scratch on the env expert's demos.

`ensure_tiny(env_id, preset="default")` returns a checkpoint directory that
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` load like any hub model. It is
built on first use and cached under `$CREDIT_TINY_CACHE` (default `~/.cache/credit_assignment/tiny`) in
`<env_id>__<preset>__<hash>/`, where the hash covers the whole recipe (every hyperparameter, the env's
`version` attribute when it has one, and this builder's version), so a changed recipe builds a new model.
`tiny_meta.json` beside the weights holds the recipe, the build time, the SFT loss curve and the measured
success on the env's test tasks, greedy and sampled at temperature 1.

The build, in four steps:

1. Demonstrations. The expert (`env.expert_action()`) plays the TRAIN tasks; with probability `eps` a
   noise action is played instead (`env.corrupt_action(rng)`, by default a random admissible action).
   Each turn gives one (prompt messages, label) pair. With `label="expert"` (the default preset) the
   label is the expert's action at the visited state (noisy states, clean labels, DAgger-like): the
   policy sees recovery states, and its imperfection comes from its small size and short training
   (it learns a 2-box Sokoban or a 20-question decision tree only partly in a 10-minute build).
   `label="taken"` (the micro preset) labels the action actually played, so the policy imitates the
   eps-noisy expert: greedy decoding stays near the expert while sampling at temperature 1 keeps about
   eps of mass on other actions; use it for an env where the default policy comes out too strong.
   Two-player games (`envs.TWO_PLAYER`): the expert plays both roles in self-play and, in the other
   episodes, one role against a scripted opponent style (`game.scripted_action`); the pairs
   (`game.observe(player)`, action) of every expert-played role are kept, so one model plays both roles.
2. Tokenizer. Byte-level BPE (`tokenizers`) trained on the rendered demo texts
   (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n<action><|im_end|>`), so role words are
   single tokens. A `Split` pre-tokenizer before ByteLevel isolates every character that is not a letter
   or a space (symbols and digits) and every capital letter not followed by a lower-case one (cells like
   `P`, `B` inside a grid row), so each grid cell is exactly one token and the layout has fixed positions.
   Special tokens `<|im_start|>`, `<|im_end|>` (EOS) and `<|pad|>`; a ChatML chat template that drops
   system messages (instruct-model prompts are not needed by a tiny model and would make prompts long).
3. Model. `LlamaForCausalLM` from scratch (tied embeddings), trained by SFT with the loss on the
   completion tokens only (the action and `<|im_end|>`), AdamW, linear warm-up then cosine decay.
4. Evaluation. Batched rollouts on the env's test tasks (one `generate` per turn for all live episodes,
   left padding), greedy and sampled at temperature 1 with `top_k=0, top_p=1.0` (transformers fills
   `top_k=50` when it is unset, which is not sampling from the policy). Two-player games are evaluated in
   both roles against a scripted opponent through `envs.vs_opponent`.

Command line: `python -m common.tiny --env-id sokoban [--preset micro] [--cache-dir D] [--force]`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

# Bump when the build procedure changes in a way that changes the model (it is part of the recipe hash).
BUILDER_VERSION = "2"

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

# ChatML without system messages. `add_generation_prompt` appends the assistant header.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] != 'system' -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Every character that is neither a letter nor whitespace (grid symbols, punctuation, each digit), and
# every capital letter that does not start a capitalised word (grid cells such as P, B, T, Q).
PRETOKENIZE_REGEX = r"[^A-Za-z\s]|[A-Z](?![a-z])"

# Decoding settings. Sampling is unrestricted: transformers would fill top_k=50 if top_k were unset.
GREEDY_KWARGS = dict(do_sample=False)


def sample_kwargs(temperature: float = 1.0) -> dict:
    """`generate` keyword arguments for true sampling at `temperature` (no top-k, no nucleus)."""
    return dict(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0)


# ----------------------------------------------------------------------------------------------
# Recipes
# ----------------------------------------------------------------------------------------------
PRESETS: dict[str, dict] = {
    # Runs and benchmarks: 2 layers, d=128 (about 0.5M parameters), as in the calibration notes.
    "default": dict(
        n_layers=2, d_model=128, n_heads=4, d_ffn=512,
        vocab_size=1024, min_frequency=2,
        demo_episodes=1500, eps=0.3, label="expert",
        steps=600, batch_size=64, lr=2e-3, warmup_frac=0.05, decay_frac=1.0, weight_decay=0.01, grad_clip=1.0,
        val_frac=0.02, eval_tasks=100, max_new_tokens=24, env_kwargs={}, demo_split="train", seed=0,
    ),
    # Tests: builds in seconds on one core; its quality does not matter.
    "micro": dict(
        n_layers=1, d_model=32, n_heads=2, d_ffn=64,
        vocab_size=400, min_frequency=2,
        demo_episodes=40, eps=0.3, label="taken",
        steps=120, batch_size=16, lr=3e-3, warmup_frac=0.05, decay_frac=1.0, weight_decay=0.0, grad_clip=1.0,
        val_frac=0.0, eval_tasks=8, max_new_tokens=16, env_kwargs={}, demo_split="train", seed=0,
    ),
}

# Recipe keys that a preset does not carry: stored in a recipe (and its hash) only when set, so that the
# recipes, hashes and cached builds of every env that does not use them stay what they were.
OPTIONAL_KEYS: dict[str, Any] = {
    # ε of the first completion token's target: (1 - ε) on the expert's token, ε spread evenly over the
    # first tokens of the env's admissible actions. The policy then keeps about ε of its mass on other
    # moves when it samples, like a pretrained model that knows the move but does not always play it.
    "action_smoothing": 0.0,
    # ε of the demonstration labels: with probability ε a state's label is a noise move (the env's
    # `corrupt_action`, e.g. a random canonical question or guess) instead of the expert's. For envs whose
    # actions are several tokens, where smoothing the first token cannot reach the other actions (Twenty
    # Questions: 308 of its 332 actions start with "Is"), this leaves about ε of the policy's mass on other
    # whole actions while its greedy move stays the expert's.
    "label_noise": 0.0,
    # Two-player games, {"share": q, "env_kwargs": {...}}: a share q of the demonstration episodes is played
    # with these env options on top of the recipe's (their prompts must be the same), e.g. Negotiation's
    # second expert `expert="style"`. Where the two experts differ, the policy keeps about q of its mass on
    # the second one's play, and its own earlier moves in the prompt keep an episode on one of the two.
    "demo_mix": None,
}

# Per-env changes to the "default" preset (micro stays generic). Chosen so that the default build takes
# under 10 minutes on 2 CPU cores and its sampled test success lies well inside (0.2, 0.8).
ENV_OVERRIDES: dict[str, dict] = {
    # Sokoban: 1 box, no history, no instruction text in the user message (68 tokens instead of 129);
    # eps 0.2; a constant learning rate until the last 30% of the steps (eps 0.3, a plain cosine schedule
    # or 2 boxes all stayed near 0 for 1000+ steps: the loss sits at ln 4 per action until the model
    # starts to read the grid). 1500 steps and action smoothing 0.3 (docs/learning.md): the greedy policy
    # is good (0.70 on the test levels) while sampling keeps about 0.22 of the mass on other moves
    # (0.44 sampled), which RL can remove. The 1000-step policy without smoothing (0.22 / 0.26) fails by
    # deadlocks that RL did not fix, and a sharp 1500-step one (0.73 / 0.72) had nothing to sharpen.
    # Seed 1: the shipped build is the one of three build seeds (0, 1, 2 gave greedy / sampled 0.52 / 0.31,
    # 0.65 / 0.34, 0.63 / 0.36 on one machine) with the most greedy skill and the widest gap to sampling.
    "sokoban": dict(env_kwargs={"num_boxes": 1, "history": 0, "instructions": False}, eps=0.2, steps=1500,
                    batch_size=128, lr=1e-3, decay_frac=0.3, max_new_tokens=4, action_smoothing=0.3, seed=1),
    # Twenty Questions: compound secrets ("<colour> <thing>", envs/twenty_questions.py), demonstrations on the
    # train secrets only: the test secrets are pairs of a thing and a colour that no train secret shows, while
    # every thing and every colour is in train secrets. (The word game needed demos of the test words too: a
    # model from scratch never writes a word it has not seen, docs/tiny.md.) The candidate list once at most 5
    # secrets are left (show_candidates=5): without it the policy wrote a train pair at the guess ("purple
    # dog" for a purple cat; 0.73 greedy on the test secrets, and supervised training on the train secrets
    # did not raise them); with it, 0.94. No instruction text, history without numbers and Q:/A: markers.
    "twenty_questions": dict(env_kwargs={"secrets": "compound", "instructions": False, "numbered": False,
                                         "show_candidates": 5},
                             demo_episodes=1000, steps=800, batch_size=128, lr=2e-3, decay_frac=0.3,
                             max_new_tokens=16),
    # Guess My City: the demonstrations cover every city, test cities included, as a stand-in for the knowledge
    # a pretrained model brings (a policy from scratch never writes a test city it has not seen); RL and
    # evaluation keep the split. 400 steps: at 800 it nearly solved the test cities (0.97 sampled).
    "guess_my_city": dict(env_kwargs={"instructions": False}, demo_split="all", demo_episodes=1000,
                          steps=400, batch_size=128, lr=2e-3, decay_frac=0.3, max_new_tokens=24),
    # ALFWorld-lite: no past turns in the prompt (history=0; the observation already states the location,
    # what is held, what was seen and what is left to look into): 200 tokens per prompt instead of 241;
    # eps 0.2. With the preset (history 2, eps 0.3) the build took 637 s for 0.07 greedy / 0.14 sampled.
    "alfworld": dict(env_kwargs={"history": 0}, eps=0.2),
    # Bargaining: a share 0.3 of the demonstration labels is a random move (a proposal on the $5 grid or accept).
    # Without it the policy plays the expert's moves sampled as greedily (payoff share against the four
    # scripted styles 0.357 sampled, 0.360 greedy, the expert's 0.355), and ARIA's self-play had nothing to
    # sharpen; with it greedy play is unchanged (0.360) while sampling gives 0.31, and supervised training
    # of the adapter on the expert's labels raises that to 0.355 in 100 steps (docs/aria.md, "Testbed").
    "bargaining": dict(label_noise=0.3),
    # WebShop-lite: 122 tokens per prompt without the generic task line; results clicked by number.
    # With the plain recipe the policy stayed at 0 success; 1500 cosine steps reached 0.32 greedy,
    # 0.10 sampled. Actions are at most 13 tokens.
    "webshop": dict(env_kwargs={"instructions": False}, eps=0.2, steps=1200, batch_size=64, lr=2e-3,
                    decay_frac=0.3, max_new_tokens=16),
}


# The sampling temperature at which RL on a tiny policy has room to improve it, through
# `common.models.policy_prompt_options` (default preset only; envs not listed: 1.0; delta_belief.py reads it,
# aria.py still samples at 1.0 unless told). It is not part of a recipe: the build is the same, only how
# it is sampled differs. Twenty Questions: the compound-secret policy plays its test secrets well greedily
# (0.94) and sampled at 1.0 (0.91), which leaves RL little room; at 1.5 it wins 0.54 of sampled games with
# the same greedy play (at 2.0: 0.01), and supervised training on the train secrets' expert labels, scored
# at 1.5, raises that to 0.74 in 300 steps (measured by a script since removed: `git show
# bee9ea9:benchmarks/sharpen_check.py`).
RL_TEMPERATURE: dict[str, float] = {"twenty_questions": 1.5}


def recipe_for(env_id: str, preset: str = "default", overrides: Optional[dict] = None) -> dict:
    """The full build recipe: preset, then per-env overrides (default preset only), then `overrides`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny preset {preset!r}; known presets: {', '.join(PRESETS)}")
    recipe = copy.deepcopy(PRESETS[preset])
    if preset == "default":
        recipe.update(copy.deepcopy(ENV_OVERRIDES.get(env_id, {})))
    for key, value in (overrides or {}).items():
        if key not in recipe and key not in OPTIONAL_KEYS:
            known = sorted(set(recipe) | set(OPTIONAL_KEYS))
            raise ValueError(f"unknown tiny recipe key {key!r}; known keys: {', '.join(known)}")
        if key == "env_kwargs":  # merged, so an override adds env options to the per-env ones
            value = {**recipe["env_kwargs"], **dict(value)}
        recipe[key] = value
    for key, default in OPTIONAL_KEYS.items():  # at its default an optional key is absent (same hash)
        if key in recipe and recipe[key] == default:
            del recipe[key]
    if recipe["label"] not in ("taken", "expert"):
        raise ValueError(f"label must be 'taken' or 'expert', got {recipe['label']!r}")
    if recipe["demo_split"] not in ("train", "all"):
        raise ValueError(f"demo_split must be 'train' or 'all', got {recipe['demo_split']!r}")
    mix = recipe.get("demo_mix")
    if mix is not None and not (isinstance(mix, dict) and set(mix) == {"share", "env_kwargs"}
                                and isinstance(mix["env_kwargs"], dict) and 0.0 <= mix["share"] <= 1.0):
        raise ValueError(f"demo_mix must be {{'share': q in [0, 1], 'env_kwargs': {{...}}}}, got {mix!r}")
    recipe.update(env_id=env_id, preset=preset, builder_version=BUILDER_VERSION)
    return recipe


def recipe_hash(recipe: dict) -> str:
    """A short stable hash of a recipe (any change of any value changes it)."""
    blob = json.dumps(recipe, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def cache_root(cache_dir: Optional[os.PathLike] = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("CREDIT_TINY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "credit_assignment" / "tiny"


def _make_env(env_id: str, recipe: dict):
    import envs

    return envs.make(env_id, **recipe.get("env_kwargs", {}))


def full_recipe(env_id: str, preset: str = "default", overrides: Optional[dict] = None) -> dict:
    """`recipe_for` plus the env's `version` string (when the env has one). Unknown env -> ValueError."""
    import importlib

    import envs

    recipe = recipe_for(env_id, preset, overrides)
    version = None
    if env_id in envs.REGISTRY and env_id in envs.available():
        module, name = envs.REGISTRY[env_id].split(":")
        version = getattr(getattr(importlib.import_module(module), name), "version", None)
    if not isinstance(version, (str, int, float)):  # no class attribute: ask an instance
        env = _make_env(env_id, recipe)  # ValueError listing the known ids when env_id is unknown
        version = getattr(env, "version", None)
    recipe["env_version"] = str(version)
    return recipe


def checkpoint_dir(env_id: str, preset: str = "default", cache_dir=None, overrides: Optional[dict] = None) -> Path:
    """Where `ensure_tiny` keeps (or would keep) the checkpoint of this recipe."""
    recipe = full_recipe(env_id, preset, overrides)
    return cache_root(cache_dir) / f"{env_id}__{preset}__{recipe_hash(recipe)}"


# ----------------------------------------------------------------------------------------------
# Demonstrations
# ----------------------------------------------------------------------------------------------
def _noise_action(env, rng: random.Random, player: Optional[str] = None) -> str:
    """A noise move: the env's corrupted action, else a random admissible one, else a random style."""
    if player is None:
        try:
            return str(env.corrupt_action(rng))
        except (AttributeError, NotImplementedError):
            acts = list(env.admissible_actions() or [])
            return rng.choice(acts) if acts else "???"
    acts = []
    with contextlib.suppress(Exception):
        acts = list(env.admissible_actions(player) or [])
    if acts:
        return str(rng.choice(acts))
    with contextlib.suppress(Exception):
        return str(env.scripted_action(player, rng.choice(list(env.opponent_styles()))))
    return "???"


def _demo_tasks(env, recipe: dict) -> list:
    """The tasks the demonstrations are played on: the train split, or train and test ("all")."""
    tasks = list(env.task_ids("train"))
    if recipe["demo_split"] == "all":
        tasks += [t for t in env.task_ids("test") if t not in set(tasks)]
    return tasks


def _single_agent_demos(env_id: str, recipe: dict, rng: random.Random, bar) -> tuple[list, dict]:
    env = _make_env(env_id, recipe)
    tasks = _demo_tasks(env, recipe)
    if not tasks:
        raise ValueError(f"env {env_id!r} has no train tasks")
    order = tasks[:]
    rng.shuffle(order)
    demos, wins, noisy = [], 0, 0
    for ep in range(recipe["demo_episodes"]):
        env.reset(order[ep % len(order)])
        step = None
        for _ in range(max(1, env.max_turns)):
            expert = str(env.expert_action())
            take = expert
            if rng.random() < recipe["eps"]:
                take = _noise_action(env, rng)
                noisy += 1
            label = take if recipe["label"] == "taken" else expert
            if recipe.get("label_noise") and rng.random() < recipe["label_noise"]:
                label = _noise_action(env, rng)
            demos.append((copy.deepcopy(env.messages()), label))
            step = env.step(take)
            if step.done:
                break
        wins += bool(step is not None and step.info.get("success"))
        bar.update(1)
    return demos, dict(demo_episodes=recipe["demo_episodes"], demo_success=wins / max(1, recipe["demo_episodes"]),
                       noise_fraction=noisy / max(1, len(demos)))


def _two_player_demos(env_id: str, recipe: dict, rng: random.Random, bar) -> tuple[list, dict]:
    base = _make_env(env_id, recipe)
    mix = recipe.get("demo_mix")
    alt = _make_env(env_id, {"env_kwargs": {**recipe["env_kwargs"], **mix["env_kwargs"]}}) if mix else None
    tasks = _demo_tasks(base, recipe)
    if not tasks:
        raise ValueError(f"env {env_id!r} has no train tasks")
    order = tasks[:]
    rng.shuffle(order)
    styles = list(base.opponent_styles())
    players = list(base.players)
    demos, noisy, selfplay, mixed = [], 0, 0, 0
    for ep in range(recipe["demo_episodes"]):
        game = alt if mix and rng.random() < mix["share"] else base
        mixed += game is alt
        game.reset(order[ep % len(order)])
        # A third of the episodes are expert self-play; the others pit the expert (one random role)
        # against a random scripted style, so the model sees the states those opponents lead to.
        if not styles or ep % 3 == 0:
            scripted = {}
            selfplay += 1
        else:
            scripted = {rng.choice(players): rng.choice(styles)}
        for _ in range(400):  # hard cap; invalid moves repeat the turn
            if game.done:
                break
            player = game.current_player
            if player in scripted:
                game.step(game.scripted_action(player, scripted[player]))
                continue
            expert = str(game.expert_action(player))
            take = expert
            if rng.random() < recipe["eps"]:
                take = _noise_action(game, rng, player)
                noisy += 1
            label = take if recipe["label"] == "taken" else expert
            if recipe.get("label_noise") and rng.random() < recipe["label_noise"]:
                label = _noise_action(game, rng, player)
            demos.append((copy.deepcopy(game.observe(player)), label))
            game.step(take)
        bar.update(1)
    stats = dict(demo_episodes=recipe["demo_episodes"], selfplay_episodes=selfplay,
                 noise_fraction=noisy / max(1, len(demos)))
    if mix:
        stats["mixed_episodes"] = mixed
    return demos, stats


def collect_demos(env_id: str, recipe: dict, progress: bool = True) -> tuple[list[tuple[list, str]], dict]:
    """Noisy-expert demonstrations on the train tasks: a list of (messages, action label) and stats."""
    import envs
    from tqdm.auto import tqdm

    rng = random.Random(recipe["seed"])
    if recipe.get("demo_mix") and env_id not in envs.TWO_PLAYER:
        raise ValueError(f"demo_mix applies to two-player games; {env_id!r} is not one")
    with tqdm(total=recipe["demo_episodes"], desc=f"{env_id} demos", disable=not progress, leave=False) as bar:
        if env_id in envs.TWO_PLAYER:
            return _two_player_demos(env_id, recipe, rng, bar)
        return _single_agent_demos(env_id, recipe, rng, bar)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = 1024, min_frequency: int = 2):
    """A byte-level BPE tokenizer trained on `texts`, with the cell-isolating pre-tokenizer, the special
    tokens and the chat template, as a transformers fast tokenizer (left padding)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, padding_side="left",
        chat_template=CHAT_TEMPLATE, model_max_length=4096)
    return tok


def render_prompt(tok, messages: list[dict]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ----------------------------------------------------------------------------------------------
# Model and SFT
# ----------------------------------------------------------------------------------------------
def build_model(recipe: dict, tok, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=recipe["d_model"], intermediate_size=recipe["d_ffn"],
        num_hidden_layers=recipe["n_layers"], num_attention_heads=recipe["n_heads"],
        num_key_value_heads=recipe["n_heads"], max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(config)


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Left-padded batch: input ids, attention mask, position ids, completion mask, completion width."""
    width = max(len(p) + len(c) for p, c in examples)
    comp = max(len(c) for _, c in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    cmask = torch.zeros((len(examples), width), dtype=torch.bool)
    for i, (p, c) in enumerate(examples):
        n = len(p) + len(c)
        ids[i, width - n:] = torch.tensor(p + c)
        mask[i, width - n:] = 1
        cmask[i, width - len(c):] = True
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, cmask, comp


def completion_loss(model, examples, pad_id: int, reduction: str = "mean", smooth_ids=None,
                    smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over completion tokens. Completions sit at the right end of a left-padded
    row, so only the last `comp + 1` logits are computed (`logits_to_keep`). With `smoothing` ε > 0 the
    first completion token's target is (1 - ε) on the label and ε spread evenly over `smooth_ids`:
    loss = (1 - ε) NLL(label) + ε mean_k NLL(k) at that position."""
    ids, mask, pos, cmask, comp = _batch(examples, pad_id)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=comp + 1).logits
    logits = logits[:, :-1].float()
    target = ids[:, -comp:]
    m = cmask[:, -comp:]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none")
    nll = nll.view_as(target)
    if smoothing and smooth_ids is not None and len(smooth_ids):
        first = m & (m.long().cumsum(-1) == 1)
        k = torch.as_tensor(list(smooth_ids), dtype=torch.long, device=logits.device)
        spread = -(logits.log_softmax(-1)[..., k]).mean(-1)
        nll = torch.where(first, (1.0 - smoothing) * nll + smoothing * spread, nll)
    nll = nll[m]
    return nll.sum() if reduction == "sum" else nll.mean()


def lr_factor(step: int, recipe: dict) -> float:
    """Learning-rate multiplier at `step`: linear warm-up over `warmup_frac` of the steps, constant, then a
    cosine decay to 0 over the last `decay_frac` of the steps (1.0: cosine right after the warm-up).
    A long constant phase helps: the tiny models sit on a plateau before they start to read the grid."""
    steps = recipe["steps"]
    warm = max(1, int(recipe["warmup_frac"] * steps))
    if step < warm:
        return (step + 1) / warm
    start = max(warm, steps - int(recipe.get("decay_frac", 1.0) * steps))
    if step < start:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * (step - start) / max(1, steps - start)))


def sft(model, examples, recipe: dict, pad_id: int, progress: bool = True, desc: str = "sft",
        smooth_ids=None) -> list[float]:
    """SFT on (prompt ids, completion ids) pairs; returns the per-step training losses. `smooth_ids`:
    the first tokens of the admissible actions, for the recipe's `action_smoothing`."""
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(recipe["seed"])
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe["lr"], betas=(0.9, 0.95))
    steps = recipe["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, recipe))
    model.train()
    losses = []
    bs = min(recipe["batch_size"], len(examples))
    # Batches of similar lengths (less padding): a random window of 4 batches in length order.
    by_len = sorted(range(len(examples)), key=lambda i: len(examples[i][0]) + len(examples[i][1]))
    window = min(len(by_len), 4 * bs)
    with tqdm(range(steps), desc=desc, disable=not progress, leave=False) as bar:
        for step in bar:
            start = int(torch.randint(len(by_len) - window + 1, (1,), generator=gen))
            pick = torch.randperm(window, generator=gen)[:bs].tolist()
            loss = completion_loss(model, [examples[by_len[start + j]] for j in pick], pad_id,
                                   smooth_ids=smooth_ids, smoothing=recipe.get("action_smoothing", 0.0))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip"])
            opt.step()
            sched.step()
            losses.append(loss.item())
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    model.eval()
    return losses


def _curve_summary(losses: list[float], points: int = 20) -> list[dict]:
    """The loss curve as about `points` window means: [{"step": last step of window, "loss": mean}]."""
    if not losses:
        return []
    size = max(1, len(losses) // points)
    out = []
    for start in range(0, len(losses), size):
        win = losses[start:start + size]
        out.append({"step": start + len(win), "loss": round(float(np.mean(win)), 4)})
    return out


# ----------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_actions(model, tok, prompts: list[str], max_new_tokens: int, greedy: bool,
                     temperature: float = 1.0, batch_size: int = 128) -> list[str]:
    """One batched `generate` per chunk of prompts (left padding); returns the decoded completions."""
    out: list[str] = []
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        kwargs = dict(GREEDY_KWARGS) if greedy else sample_kwargs(temperature)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, **kwargs)
        width = enc["input_ids"].shape[1]
        out.extend(tok.batch_decode(gen[:, width:], skip_special_tokens=True))
    return out


def rollout_success(model, tok, env_list: list, task_ids: list[str], max_new_tokens: int, greedy: bool,
                    temperature: float = 1.0) -> dict:
    """Run one episode per (env, task) pair in lock-step; returns success rate, return, length, invalid."""
    for env, task in zip(env_list, task_ids):
        env.reset(task)
    live = list(range(len(env_list)))
    ret = [0.0] * len(env_list)
    length = [0] * len(env_list)
    invalid = [0] * len(env_list)
    success = [False] * len(env_list)
    while live:
        prompts = [render_prompt(tok, env_list[i].messages()) for i in live]
        actions = generate_actions(model, tok, prompts, max_new_tokens, greedy, temperature)
        still = []
        for i, text in zip(live, actions):
            step = env_list[i].step(text)
            ret[i] += float(step.reward)
            length[i] += 1
            invalid[i] += bool(step.info.get("invalid"))
            if step.done:
                success[i] = bool(step.info.get("success"))
            else:
                still.append(i)
        live = still
    n = max(1, len(env_list))
    return dict(success=sum(success) / n, return_mean=sum(ret) / n, episode_length=sum(length) / n,
                invalid_rate=sum(invalid) / max(1, sum(length)), episodes=len(env_list))


def evaluate(model, tok, env_id: str, env_kwargs: Optional[dict] = None, max_tasks: Optional[int] = 100,
             max_new_tokens: int = 24, temperature: float = 1.0, seed: int = 0) -> dict:
    """Greedy and sampled (temperature, top_k=0, top_p=1) success on the env's test tasks.

    Two-player games: each role against the scripted "fair" opponent (else its first style), through
    `envs.vs_opponent`; success = a win for the learner. Returns {"greedy": {...}, "sampled": {...}}.
    """
    import envs

    env_kwargs = env_kwargs or {}
    probe = envs.make(env_id, **env_kwargs)
    tasks = list(probe.task_ids("test"))[: max_tasks or None]
    if env_id in envs.TWO_PLAYER:
        styles = list(probe.opponent_styles())
        style = "fair" if "fair" in styles else styles[0]
        pairs = [(role, t) for role in probe.players for t in tasks]

        def make_envs():
            return [envs.vs_opponent(envs.make(env_id, **env_kwargs), f"rule:{style}", learner=r) for r, _ in pairs]

        task_list = [t for _, t in pairs]
    else:
        style = None

        def make_envs():
            return [envs.make(env_id, **env_kwargs) for _ in tasks]

        task_list = tasks
    result = {"test_tasks": len(tasks)}
    if style is not None:
        result["opponent"] = f"rule:{style}"
    torch.manual_seed(seed)
    result["greedy"] = rollout_success(model, tok, make_envs(), task_list, max_new_tokens, greedy=True)
    result["sampled"] = rollout_success(model, tok, make_envs(), task_list, max_new_tokens, greedy=False,
                                        temperature=temperature)
    result["sampled"]["temperature"] = temperature
    return result


# ----------------------------------------------------------------------------------------------
# Build and cache
# ----------------------------------------------------------------------------------------------
def action_first_tokens(env_id: str, recipe: dict, tok) -> list[int]:
    """The distinct first tokens of the admissible actions at the start of the first train task (the
    support of `action_smoothing`). An env without a fixed action list cannot use the option."""
    env = _make_env(env_id, recipe)
    env.reset(list(env.task_ids("train"))[0])
    actions = list(env.admissible_actions()) if hasattr(env, "admissible_actions") else []
    if not actions:
        raise ValueError(f"action_smoothing needs admissible actions; env {env_id!r} has none")
    return sorted({tok(a, add_special_tokens=False)["input_ids"][0] for a in actions})


def build_tiny(env_id: str, recipe: dict, out_dir: Path, progress: bool = True) -> dict:
    """Build the tiny policy of `recipe` into `out_dir` (weights, tokenizer, tiny_meta.json)."""
    from transformers import GenerationConfig

    t0, cpu0 = time.time(), time.process_time()
    random.seed(recipe["seed"])
    np.random.seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    demos, demo_stats = collect_demos(env_id, recipe, progress)
    if not demos:
        raise ValueError(f"env {env_id!r} produced no demonstrations")
    t_demos = time.time() - t0

    # Tokenizer on full rendered texts (a bounded sample of them is plenty for a small vocabulary).
    rng = random.Random(recipe["seed"])
    sample = demos if len(demos) <= 20000 else rng.sample(demos, 20000)
    scratch = train_tokenizer([], 300)  # only for the chat template rendering
    texts = [render_prompt(scratch, m) + a + EOS_TOKEN for m, a in sample]
    tok = train_tokenizer(texts, recipe["vocab_size"], recipe["min_frequency"])

    prompt_cache: dict[str, list[int]] = {}
    examples = []
    for messages, action in demos:
        text = render_prompt(tok, messages)
        ids = prompt_cache.get(text)
        if ids is None:
            ids = prompt_cache[text] = tok(text, add_special_tokens=False)["input_ids"]
        comp = tok(action, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        examples.append((ids, comp))
    lengths = [len(p) + len(c) for p, c in examples]
    rng.shuffle(examples)
    n_val = int(len(examples) * recipe["val_frac"])
    val, train = examples[:n_val], examples[n_val:]
    max_positions = max(512, 2 ** math.ceil(math.log2(2 * max(lengths))))

    torch.manual_seed(recipe["seed"])
    model = build_model(recipe, tok, max_positions)
    t1 = time.time()
    smooth_ids = action_first_tokens(env_id, recipe, tok) if recipe.get("action_smoothing") else None
    losses = sft(model, train, recipe, tok.pad_token_id, progress, desc=f"{env_id} sft", smooth_ids=smooth_ids)
    t_sft = time.time() - t1
    val_loss = None
    if val:
        with torch.no_grad():
            total = sum(float(completion_loss(model, val[i:i + 256], tok.pad_token_id, "sum"))
                        for i in range(0, len(val), 256))
            val_loss = total / sum(len(c) for _, c in val)

    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=recipe["max_new_tokens"],
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    t2 = time.time()
    result = evaluate(model, tok, env_id, recipe["env_kwargs"], recipe["eval_tasks"], recipe["max_new_tokens"],
                      temperature=1.0, seed=recipe["seed"])
    t_eval = time.time() - t2

    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    if not progress:
        transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    tok.save_pretrained(out_dir)

    meta = dict(
        env_id=env_id, preset=recipe["preset"], recipe=recipe, recipe_hash=recipe_hash(recipe),
        build_seconds=round(time.time() - t0, 1),
        build_cpu_seconds=round(time.process_time() - cpu0, 1),
        load_average=[round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        seconds=dict(demos=round(t_demos, 1), sft=round(t_sft, 1), eval=round(t_eval, 1)),
        torch_threads=torch.get_num_threads(),
        demos=dict(pairs=len(demos), **demo_stats, tokens_per_example_mean=round(float(np.mean(lengths)), 1),
                   tokens_per_example_max=int(max(lengths))),
        model=dict(parameters=sum(p.numel() for p in model.parameters()), vocab_size=len(tok),
                   max_position_embeddings=max_positions),
        sft=dict(first_loss=round(losses[0], 4), final_loss=round(float(np.mean(losses[-20:])), 4),
                 val_loss=None if val_loss is None else round(val_loss, 4), curve=_curve_summary(losses)),
        success=result,
        versions=dict(torch=torch.__version__, transformers=transformers.__version__),
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    (out_dir / "tiny_meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return meta


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock (POSIX); a no-op where fcntl is missing (then "rename wins")."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_complete(path: Path) -> bool:
    return (path / "tiny_meta.json").is_file() and (path / "config.json").is_file()


@contextlib.contextmanager
def _global_rng_kept():
    """Restore the global python, numpy and torch (CPU and CUDA) RNG states on exit, so that a run which
    builds its tiny policy first draws the same numbers as a run that finds it cached."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------------------------
# Shipped weights
# ----------------------------------------------------------------------------------------------
def strategist_overrides(env_id: str) -> Optional[dict]:
    """The recipe overrides of EPO's tiny strategist (epo.py) in an env whose moves can be strategies
    (negotiation), else None: built from the expert's strategies, with every past move in the prompt
    (`history=None`: the opening that gives a scripted style away stays in view) and 30 % of the
    demonstration episodes played by the style-aware expert (docs/epo.md)."""
    import envs

    if env_id not in envs.STRATEGY_MOVES:
        return None
    return {"env_kwargs": {"moves": "strategy", "history": None},
            "demo_mix": {"share": 0.3, "env_kwargs": {"expert": "style"}}}


# The tiny policies the project ships: every testbed a method script uses by default or documents.
# name -> (env id, recipe overrides). The name is what `python -m common.tiny --testbed` takes.
TESTBEDS: dict[str, tuple[str, Optional[dict]]] = {
    "sokoban": ("sokoban", None),
    "twenty_questions": ("twenty_questions", None),
    "guess_my_city": ("guess_my_city", None),
    "bargaining": ("bargaining", None),
    "negotiation": ("negotiation", None),
    # EPO's strategist (strategist_overrides): strategies, every past move shown, 30% style-aware demos
    "negotiation_strategist": ("negotiation", {"env_kwargs": {"moves": "strategy", "history": None},
                                               "demo_mix": {"share": 0.3, "env_kwargs": {"expert": "style"}}}),
    "webshop": ("webshop", None),
    "alfworld": ("alfworld", None),
}

# <name>/ per policy and MANIFEST.json; $CREDIT_TINY_WEIGHTS points elsewhere (tests, a copy of the weights)
SHIPPED_DIR = Path(os.environ.get("CREDIT_TINY_WEIGHTS") or Path(__file__).resolve().parent / "weights")
MANIFEST = "MANIFEST.json"
# Every file of a build is shipped and checked; a build without these is not a checkpoint.
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "tiny_meta.json")


class UserError(Exception):
    """A problem with what the user asked for (bad flag value, unknown env, missing model), for all of
    common/ (`common.models` re-exports it). Scripts catch it in their main and exit with
    `sys.exit(f"error: {e}")`: one line, no traceback."""


def _first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): for a UserError."""
    text = str(e).strip()
    return text.splitlines()[0].strip() if text else type(e).__name__


class ShippedWeightsError(ValueError):
    """A shipped tiny policy is listed in the manifest but a file is missing or its checksum differs."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(shipped_dir: Optional[os.PathLike] = None) -> dict:
    """The manifest of the shipped policies ({"policies": {dir name: entry}}; empty if there is none)."""
    path = Path(shipped_dir or SHIPPED_DIR) / MANIFEST
    if not path.is_file():
        return {"policies": {}}
    return json.loads(path.read_text())


def verify_shipped(name: str, shipped_dir: Optional[os.PathLike] = None) -> Path:
    """Check every file of the shipped policy `name` against the manifest's SHA-256; return its directory.

    A missing file or a checksum that differs -> ShippedWeightsError, one line that says what to do.
    """
    root = Path(shipped_dir or SHIPPED_DIR)
    entry = read_manifest(root)["policies"][name]
    where = root / name
    with contextlib.suppress(ValueError):
        where = where.relative_to(Path(__file__).resolve().parent.parent)
    fix = (f"restore it with `git checkout -- {where}`, or rebuild and ship it with "
           f"`python -m common.tiny --testbed {entry.get('testbed', entry['env_id'])} --ship` (docs/tiny.md)")
    check_checksums(root / name, entry["files"], f"shipped tiny policy {name}", fix, ShippedWeightsError)
    return root / name


def check_checksums(directory: Path, files: dict, what: str, fix: str, error=ValueError) -> None:
    """Every file of a shipped directory against the SHA-256 of its manifest entry ({name: {"sha256"}}).
    A missing file or another digest -> `error`, one line that names `what` and ends with `fix`."""
    for fname, info in files.items():
        path = directory / fname
        if not path.is_file():
            raise error(f"{what}: {fname} is missing; {fix}")
        digest = _sha256(path)
        if digest != info["sha256"]:
            raise error(f"{what}: {fname} has SHA-256 {digest[:12]}..., the manifest says "
                        f"{info['sha256'][:12]}... (corrupted or edited); {fix}")


def shipped_path(env_id: str, preset: str = "default", overrides: Optional[dict] = None,
                 shipped_dir: Optional[os.PathLike] = None) -> Optional[Path]:
    """The verified shipped checkpoint of this recipe, or None when the project ships none for it."""
    name = f"{env_id}__{preset}__{recipe_hash(full_recipe(env_id, preset, overrides))}"
    if name not in read_manifest(shipped_dir)["policies"]:
        return None
    return verify_shipped(name, shipped_dir)


def ensure_tiny(env_id: str, preset: str = "default", cache_dir: Optional[os.PathLike] = None,
                progress: bool = True, force: bool = False, overrides: Optional[dict] = None,
                shipped: bool = True) -> Path:
    """Return the checkpoint dir of the tiny policy of `env_id`: the shipped one (common/weights, checked
    against its checksums) when the project ships this recipe, else the cached build, building it first.

    A shipped policy whose files are missing or corrupted raises ShippedWeightsError (never a silent
    rebuild). `force` rebuilds into the cache; `shipped=False` ignores the shipped weights (both are for
    maintainers: `python -m common.tiny --build`). The build writes into a temporary directory next to
    the target and renames it into place, under a file lock, so a killed build never leaves a partial
    checkpoint and two processes build it once. Unknown env id or preset -> ValueError (one line that
    lists the known ones).
    """
    recipe = full_recipe(env_id, preset, overrides)
    if shipped and not force:
        ship = shipped_path(env_id, preset, overrides)
        if ship is not None:
            return ship
    root = cache_root(cache_dir)
    final = root / f"{env_id}__{preset}__{recipe_hash(recipe)}"
    if _is_complete(final) and not force:
        return final
    if progress and preset != "micro":
        print(f"no shipped weights for the tiny {preset} policy of {env_id} (recipe {recipe_hash(recipe)}): "
              f"building it once, minutes on a CPU (docs/tiny.md)", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if _is_complete(final) and not force:
            return final  # another process built it while we waited
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        if progress:
            print(f"building the tiny {preset} policy of {env_id} into {final}", file=sys.stderr)
        try:
            with _global_rng_kept():  # the build seeds the global RNGs; the caller's run must not see it
                build_tiny(env_id, recipe, tmp, progress)
            if final.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".old-{final.name}-", dir=root))
                os.replace(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if not _is_complete(final):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_meta(path: os.PathLike) -> dict:
    return json.loads((Path(path) / "tiny_meta.json").read_text())


# ----------------------------------------------------------------------------------------------
# Greedy check and shipping (maintainers)
# ----------------------------------------------------------------------------------------------
CHECK_EPISODES = 3  # greedy episodes recorded per shipped policy
CHECK_MIN_GAP = 0.05  # a recorded episode's every greedy token wins by at least this logit margin


@torch.no_grad()
def greedy_episode(model, tok, env, task: str, max_new_tokens: int) -> dict:
    """One greedy episode, one prompt at a time: its actions, success and the smallest logit margin (top
    token minus runner-up) of any generated token. A margin well above float rounding means another CPU
    plays the same episode."""
    env.reset(task)
    actions, gap, step = [], float("inf"), None
    for _ in range(max(1, env.max_turns) + 50):  # invalid moves of two-player games repeat the turn
        enc = tok(render_prompt(tok, env.messages()), return_tensors="pt", add_special_tokens=False)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True,
                             **GREEDY_KWARGS)
        for scores in out.scores:
            top2 = torch.topk(scores[0].float(), 2).values
            gap = min(gap, float(top2[0] - top2[1]))
        text = tok.decode(out.sequences[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        actions.append(text)
        step = env.step(text)
        if step.done:
            break
    return dict(task=task, actions=actions, success=bool(step is not None and step.info.get("success")),
                min_gap=round(gap, 4))


def _check_env(env_id: str, env_kwargs: dict, role: Optional[str]):
    import envs

    env = envs.make(env_id, **env_kwargs)
    return envs.vs_opponent(env, "rule:fair", learner=role) if role else env


def record_greedy_check(path: os.PathLike, n: int = CHECK_EPISODES, min_gap: float = CHECK_MIN_GAP,
                        scan: int = 40) -> list[dict]:
    """Up to `n` greedy test episodes of the policy at `path` whose every token wins by `min_gap` (from the
    first `scan` test tasks; two-player games: both roles against the scripted fair style, alternating)."""
    import envs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = read_meta(path)
    recipe = meta["recipe"]
    env_id = meta["env_id"]
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    probe = envs.make(env_id, **recipe["env_kwargs"])
    tasks = list(probe.task_ids("test"))[:scan]
    roles = list(probe.players) if env_id in envs.TWO_PLAYER else [None]
    chosen = []
    for i, task in enumerate(tasks):
        role = roles[i % len(roles)]
        ep = greedy_episode(model, tok, _check_env(env_id, recipe["env_kwargs"], role), task,
                            recipe["max_new_tokens"])
        if ep["min_gap"] >= min_gap:
            chosen.append(dict(role=role, **ep))
        if len(chosen) == n:
            break
    return chosen


def replay_greedy_check(path: os.PathLike, check: list[dict]) -> list[str]:
    """Play the recorded greedy episodes again; returns one line per episode that differs (none: all equal)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = read_meta(path)
    recipe = meta["recipe"]
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    diffs = []
    for rec in check:
        ep = greedy_episode(model, tok, _check_env(meta["env_id"], recipe["env_kwargs"], rec.get("role")),
                            rec["task"], recipe["max_new_tokens"])
        if ep["actions"] != rec["actions"] or ep["success"] != rec["success"]:
            diffs.append(f"task {rec['task']} (role {rec.get('role')}): played {ep['actions']} "
                         f"(success {ep['success']}), recorded {rec['actions']} (success {rec['success']})")
    return diffs


def ship(testbed: str, cache_dir: Optional[os.PathLike] = None, shipped_dir: Optional[os.PathLike] = None,
         progress: bool = True) -> Path:
    """Copy the cached build of `testbed` into the shipped weights (building it if it is not cached), with
    the SHA-256 of every file and a greedy check in the manifest; older shipped builds of the same testbed
    are removed. For maintainers after a recipe change (docs/tiny.md, "Updating the shipped weights")."""
    env_id, overrides = TESTBEDS[testbed]
    root = Path(shipped_dir or SHIPPED_DIR)
    built = ensure_tiny(env_id, "default", cache_dir, progress=progress, overrides=overrides, shipped=False)
    name = built.name
    root.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(root)
    for old in [k for k, v in manifest["policies"].items() if v.get("testbed") == testbed and k != name]:
        shutil.rmtree(root / old, ignore_errors=True)
        del manifest["policies"][old]
    target = root / name
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    missing = [f for f in SHIPPED_FILES if not (built / f).is_file()]
    if missing:
        raise ValueError(f"the build at {built} has no {', '.join(missing)}")
    names = sorted(p.name for p in built.iterdir() if p.is_file())
    for fname in names:
        shutil.copyfile(built / fname, target / fname)
    meta = read_meta(target)
    files = {f: {"sha256": _sha256(target / f), "bytes": (target / f).stat().st_size} for f in names}
    manifest["policies"][name] = dict(
        testbed=testbed, env_id=env_id, preset="default", recipe_hash=meta["recipe_hash"], overrides=overrides,
        success=dict(greedy=meta["success"]["greedy"]["success"], sampled=meta["success"]["sampled"]["success"],
                     test_tasks=meta["success"]["test_tasks"], opponent=meta["success"].get("opponent")),
        bytes=sum(f["bytes"] for f in files.values()), files=files, greedy_check=record_greedy_check(target))
    manifest["policies"] = dict(sorted(manifest["policies"].items()))
    manifest["format"] = ("one directory per policy, named <env>__<preset>__<recipe hash>: the fp32 weights "
                          "(model.safetensors), config, tokenizer and tiny_meta.json of the build, unchanged")
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------
def _describe(path: Path) -> str:
    meta = read_meta(path)
    s = meta["success"]
    return (f"{meta['env_id']} [{meta['preset']}]: success on {s['test_tasks']} test tasks "
            f"greedy {s['greedy']['success']:.3f}, sampled (T=1) {s['sampled']['success']:.3f}"
            + (f" vs {s['opponent']}" if "opponent" in s else "") + f"; built in {meta['build_seconds']:.0f} s")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m common.tiny",
        description="Find (shipped, else cached, else built) the tiny policy of an env; maintainers rebuild and "
                    "ship with --build/--ship and check the shipped weights with --check (docs/tiny.md).")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--env-id", help="env id, e.g. sokoban or twenty_questions (its plain recipe)")
    which.add_argument("--testbed", help=f"a shipped testbed: {', '.join(TESTBEDS)}, or 'all'")
    parser.add_argument("--preset", default="default", help=f"size preset: {', '.join(PRESETS)}")
    parser.add_argument("--cache-dir", default=None, help="cache root (default $CREDIT_TINY_CACHE or ~/.cache/credit_assignment/tiny)")
    parser.add_argument("--build", action="store_true", help="build into the cache even if the weights are shipped")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached build exists (implies --build)")
    parser.add_argument("--ship", action="store_true", help="copy the build into common/weights and its manifest")
    parser.add_argument("--check", action="store_true", help="check the shipped weights' checksums and greedy episodes")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if args.testbed is not None:
        names = list(TESTBEDS) if args.testbed == "all" else [args.testbed]
        if any(n not in TESTBEDS for n in names):
            print(f"error: unknown testbed {args.testbed!r}; testbeds: {', '.join(TESTBEDS)}, all", file=sys.stderr)
            sys.exit(2)
        jobs = [(n, *TESTBEDS[n]) for n in names]
    else:
        name = args.env_id if TESTBEDS.get(args.env_id, (None, 1))[1] is None else None
        jobs = [(name, args.env_id, None)]
    if (args.ship or args.check) and (args.preset != "default" or any(n is None for n, _, _ in jobs)):
        print("error: --ship and --check take a shipped testbed (--testbed NAME or all) and the default preset",
              file=sys.stderr)
        sys.exit(2)
    failed = False
    for name, env_id, overrides in jobs:
        try:
            if args.ship:
                path = ship(name, args.cache_dir, progress=not args.no_progress)
                print(f"shipped {path}")
            elif args.check:
                path = shipped_path(env_id, "default", overrides)
                if path is None:
                    raise ShippedWeightsError(f"testbed {name}: no shipped weights for its current recipe; "
                                              f"`python -m common.tiny --testbed {name} --ship` ships them")
                diffs = replay_greedy_check(path, read_manifest()["policies"][path.name]["greedy_check"])
                print(f"{path.name}: checksums ok, greedy check " + ("ok" if not diffs else "DIFFERS"))
                for d in diffs:
                    print(f"  {d}")
                failed |= bool(diffs)
                continue
            else:
                path = ensure_tiny(env_id, args.preset, args.cache_dir, progress=not args.no_progress,
                                   force=args.force, overrides=overrides, shipped=not (args.build or args.force))
                print(path)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        print(_describe(path))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
