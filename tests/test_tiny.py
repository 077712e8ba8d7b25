"""Tests of common/tiny.py: tokenizer, chat template, recipe hashing, true sampling, cache, micro build."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch

import envs
from common import tiny

GRID_TEXTS = [
    "<|im_start|>user\nObservation:\n######\n#____#\n#_PB_#\n#__T_#\n#____#\n######<|im_end|>\n"
    "<|im_start|>assistant\nright<|im_end|>\n"
] * 50


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Builds here use one torch thread (robust on a shared, loaded machine); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def grid_tok():
    return tiny.train_tokenizer(GRID_TEXTS, vocab_size=400, min_frequency=2)


def test_one_token_per_grid_cell(grid_tok):
    for row in ["######", "#____#", "#_PB_#", "#*Q_T#", "#_BBP#"]:
        ids = grid_tok(row, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(row), (row, [grid_tok.decode([i]) for i in ids])
        assert [grid_tok.decode([i]) for i in ids] == list(row)
    # BPE still merges words (so the pre-tokenizer did not reduce it to characters).
    assert len(grid_tok("Observation", add_special_tokens=False)["input_ids"]) == 1
    assert len(grid_tok("assistant", add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_drops_system_and_adds_generation_prompt(grid_tok):
    msgs = [{"role": "system", "content": "LONG SYSTEM PROMPT"}, {"role": "user", "content": "#_P#"}]
    text = grid_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "SYSTEM" not in text
    assert text == "<|im_start|>user\n#_P#<|im_end|>\n<|im_start|>assistant\n"
    plain = grid_tok.apply_chat_template(msgs + [{"role": "assistant", "content": "up"}], tokenize=False)
    assert plain.endswith("<|im_start|>assistant\nup<|im_end|>\n")


def test_special_tokens_eos_pad(grid_tok):
    assert grid_tok.eos_token == "<|im_end|>"
    assert grid_tok.eos_token_id == grid_tok.convert_tokens_to_ids("<|im_end|>")
    assert grid_tok.pad_token_id == grid_tok.convert_tokens_to_ids("<|pad|>") != grid_tok.eos_token_id
    assert grid_tok.padding_side == "left"
    # Special tokens inside text are single tokens.
    ids = grid_tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[0] == grid_tok.convert_tokens_to_ids("<|im_start|>") and len(ids) == 3


def test_recipe_hash_tracks_every_value():
    base = tiny.recipe_for("sokoban", "default")
    assert tiny.recipe_hash(base) == tiny.recipe_hash(tiny.recipe_for("sokoban", "default"))
    for key, value in [("steps", base["steps"] + 1), ("eps", 0.31), ("lr", 3e-3), ("label", "taken")]:
        changed = tiny.recipe_for("sokoban", "default", {key: value})
        assert tiny.recipe_hash(changed) != tiny.recipe_hash(base), key
    assert tiny.recipe_hash(tiny.recipe_for("sokoban", "micro")) != tiny.recipe_hash(base)
    assert tiny.recipe_hash(tiny.recipe_for("twenty_questions", "default")) != tiny.recipe_hash(base)
    with pytest.raises(ValueError, match="unknown tiny recipe key"):
        tiny.recipe_for("sokoban", "default", {"stepz": 3})
    with pytest.raises(ValueError, match="unknown tiny preset"):
        tiny.recipe_for("sokoban", "huge")


def test_optional_recipe_key_leaves_other_hashes_alone():
    base = tiny.recipe_for("twenty_questions", "default")
    assert "action_smoothing" not in base  # absent unless set: recipes that do not use it keep their hashes
    smoothed = tiny.recipe_for("twenty_questions", "default", {"action_smoothing": 0.3})
    assert smoothed["action_smoothing"] == 0.3 and tiny.recipe_hash(smoothed) != tiny.recipe_hash(base)
    assert tiny.recipe_for("sokoban", "default")["action_smoothing"] == 0.3  # the Sokoban default uses it
    off = tiny.recipe_for("sokoban", "default", {"action_smoothing": 0.0})  # set to its default: absent
    assert "action_smoothing" not in off
    assert tiny.recipe_hash(off) != tiny.recipe_hash(tiny.recipe_for("sokoban", "default"))


def test_label_noise_replaces_that_share_of_labels_and_leaves_states_alone():
    import envs

    def demos(noise):
        # eps 0: every state follows the expert, so the states do not depend on the label draws
        recipe = tiny.recipe_for("twenty_questions", "micro", {"eps": 0.0, "label": "expert", "label_noise": noise})
        return tiny.collect_demos("twenty_questions", recipe, progress=False)[0]

    clean, all_noise, half = demos(0.0), demos(1.0), demos(0.5)
    assert [m for m, _ in clean] == [m for m, _ in all_noise] == [m for m, _ in half]
    env = envs.make("twenty_questions")
    pool = set(env.canonical_questions) | {env.guess_text(t) for t in env.guess_targets}
    assert all(label in pool for _, label in all_noise)
    n = len(clean)
    changed_all = sum(a != b for (_, a), (_, b) in zip(clean, all_noise)) / n
    changed_half = sum(a != b for (_, a), (_, b) in zip(clean, half)) / n
    assert n > 200 and changed_all > 0.95  # a noise label equals the expert's move about 1 time in 300
    assert 0.4 < changed_half < 0.6, changed_half  # binomial, n > 200: SE < 0.035
    assert "label_noise" not in tiny.recipe_for("sokoban", "default")  # absent unless set: hashes kept


def test_twenty_questions_recipe_keeps_test_secrets_out_of_the_demonstrations(monkeypatch):
    import envs
    from envs.twenty_questions import TwentyQuestionsEnv

    recipe = tiny.recipe_for("twenty_questions", "default")
    assert recipe["demo_split"] == "train" and recipe["env_kwargs"]["secrets"] == "compound"
    env = envs.make("twenty_questions", **recipe["env_kwargs"])
    assert sorted(tiny._demo_tasks(env, recipe)) == sorted(env.task_ids("train"))
    played = []  # the secret of every demonstrated game
    reset = TwentyQuestionsEnv.reset
    monkeypatch.setattr(TwentyQuestionsEnv, "reset", lambda self, task_id: played.append(task_id) or reset(self, task_id))
    tiny.collect_demos("twenty_questions", dict(recipe, demo_episodes=100), progress=False)
    assert len(played) == 100 and set(played) <= set(env.task_ids("train"))


def test_completion_loss_action_smoothing_hand_computed():
    # logits [0, ln 3, 0, 0, 0] at every position -> p = (1, 3, 1, 1, 1) / 7. Completion [1, 4]:
    #   token 1: NLL ln(7/3) = 0.847298; smoothed over ids {0, 1, 2} with eps 0.3:
    #   0.7 * 0.847298 + 0.3 * (ln 7 + ln(7/3) + ln 7) / 3 = 0.593109 + 0.473913 = 1.067022
    #   token 4 (not the first): NLL ln 7 = 1.945910, never smoothed -> mean (1.067022 + 1.945910) / 2
    import math
    from types import SimpleNamespace

    class Fixed(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, logits_to_keep):
            z = torch.tensor([0.0, math.log(3.0), 0.0, 0.0, 0.0])
            return SimpleNamespace(logits=z.expand(input_ids.shape[0], logits_to_keep, 5))

    ex = [([2, 3], [1, 4]), ([3], [1, 4])]
    plain = tiny.completion_loss(Fixed(), ex, pad_id=0)
    assert abs(float(plain) - (0.847298 + 1.945910) / 2) < 1e-5
    smooth = tiny.completion_loss(Fixed(), ex, pad_id=0, smooth_ids=[0, 1, 2], smoothing=0.3)
    assert abs(float(smooth) - (1.067022 + 1.945910) / 2) < 1e-5


def _uniform_model(vocab: int = 400):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False,
                      eos_token_id=None, pad_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        # Nearly uniform but distinct logits (exact ties would all survive a top-k cut).
        model.lm_head.weight.normal_(0.0, 1e-3, generator=torch.Generator().manual_seed(0))
    return model


def test_sampling_is_unrestricted():
    assert tiny.sample_kwargs(1.0) == dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    model = _uniform_model(400)
    ids = torch.ones((800, 3), dtype=torch.long)
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, pad_token_id=0,
                         **tiny.sample_kwargs(1.0))
    # 800 near-uniform draws over 400 tokens hit about 400 * (1 - exp(-2)) = 346 distinct ones; top_k=50
    # would allow at most 50.
    assert len(set(out[:, -1].tolist())) > 250
    # The trap this guards against: without top_k, generate restricts sampling to the top 50.
    torch.manual_seed(0)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, pad_token_id=0,
                         do_sample=True, temperature=1.0)
    assert len(set(out[:, -1].tolist())) <= 50


def test_unknown_env_is_one_line_exit_2(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        tiny.main(["--env-id", "no_such_env", "--cache-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown env id") and "\n" not in err
    assert not any(tmp_path.iterdir())


needs_sokoban = pytest.mark.skipif("sokoban" not in envs.available(), reason="envs/sokoban.py is not in this checkout")


@pytest.fixture(scope="module")
def micro_sokoban(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiny")
    t0 = time.time()
    path = tiny.ensure_tiny("sokoban", "micro", cache_dir=cache, progress=False)
    return cache, path, time.time() - t0


@needs_sokoban
def test_micro_build_loads_and_records_meta(micro_sokoban):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache, path, _ = micro_sokoban
    assert path.parent == cache and path.name.startswith("sokoban__micro__")
    assert [p.name for p in cache.iterdir() if p.name.startswith(".tmp")] == []
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.padding_side == "left"
    assert tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>") == model.config.eos_token_id
    assert model.generation_config.top_k == 0 and model.generation_config.top_p == 1.0
    meta = json.loads((path / "tiny_meta.json").read_text())
    assert meta["recipe_hash"] == path.name.split("__")[-1] == tiny.recipe_hash(meta["recipe"])
    for mode in ("greedy", "sampled"):
        assert 0.0 <= meta["success"][mode]["success"] <= 1.0
        assert meta["success"][mode]["episodes"] == meta["success"]["test_tasks"] > 0
    assert meta["demos"]["pairs"] > 0 and meta["sft"]["final_loss"] < meta["sft"]["first_loss"]
    # A sokoban grid row from the env is one token per cell with the built tokenizer.
    env = envs.make("sokoban")
    obs = env.reset(env.task_ids("test")[0])
    rows = [r for r in obs.splitlines() if r and r[0] == "#" and r[-1] == "#"]
    assert rows, obs
    for row in rows:
        assert len(tok(row, add_special_tokens=False)["input_ids"]) == len(row), row


@needs_sokoban
def test_second_call_is_cache_hit(micro_sokoban, monkeypatch):
    cache, path, _ = micro_sokoban
    stamp = (path / "tiny_meta.json").stat().st_mtime_ns

    def no_build(*a, **k):
        raise AssertionError("cache hit expected, but a build started")

    monkeypatch.setattr(tiny, "build_tiny", no_build)
    again = tiny.ensure_tiny("sokoban", "micro", cache_dir=cache, progress=False)
    assert again == path  # and no build: `no_build` raises
    assert (path / "tiny_meta.json").stat().st_mtime_ns == stamp


@needs_sokoban
def test_build_leaves_the_callers_random_state_alone(tmp_path):
    # a run that builds its tiny policy must draw what a run with a cached one draws (same seed)
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = draws()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    tiny.ensure_tiny("sokoban", "micro", cache_dir=tmp_path, progress=False)
    assert draws() == expected


@needs_sokoban
def test_failed_build_leaves_no_checkpoint(tmp_path, monkeypatch):
    def broken(env_id, recipe, out_dir, progress=True):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(tiny, "build_tiny", broken)
    with pytest.raises(RuntimeError):
        tiny.ensure_tiny("sokoban", "micro", cache_dir=tmp_path, progress=False)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


class _SplitCoins(envs.TwoPlayerEnv):
    """A minimal two-player game for the generic two-player path: split 10 coins by 'offer N' (N kept
    by the proposer) or 'accept'; at most 3 moves each."""

    env_id = "split_coins"
    players = ("A", "B")
    version = "test"

    def task_ids(self, split):
        return [f"{split}-{i}" for i in range(20 if split == "train" else 4)]

    def reset(self, task_id):
        self.log, self.offer, self.deal, self.bad = [], None, False, 0

    @property
    def current_player(self):
        return self.players[len(self.log) % 2]

    @property
    def done(self):
        return self.deal or len(self.log) >= 6 or self.bad > 3

    def observe(self, player):
        hist = " | ".join(f"{p}: {m}" for p, m in self.log[-4:]) or "start"
        return [{"role": "system", "content": "ignored"},
                {"role": "user", "content": f"You are {player}. Say offer N or accept.\n{hist}"}]

    def last_view(self, player):
        return self.log[-1][1] if self.log else "start"

    def step(self, text):
        p, t = self.current_player, envs.extract_action(text).lower()
        if t == "accept" and self.offer is not None:
            self.deal = True
        elif t.startswith("offer ") and t[6:].isdigit() and int(t[6:]) <= 10:
            self.offer = (p, int(t[6:]))
        else:
            self.bad += 1
            return envs.Step("invalid", 0.0, self.done, {"invalid": True, "success": False})
        self.log.append((p, t))
        return envs.Step(t, 0.0, self.done, {"invalid": False, "success": False})

    def payoffs(self):
        if not self.deal:
            return {"A": 0.0, "B": 0.0}
        prop, keep = self.offer
        return {prop: keep / 10, ("B" if prop == "A" else "A"): 1 - keep / 10}

    def _move(self, player, keep, least):
        if self.offer and self.offer[0] != player and 10 - self.offer[1] >= least:
            return "accept"
        return f"offer {keep}"

    def expert_action(self, player=None):
        return self._move(player or self.current_player, 6, 5)

    def opponent_styles(self):
        return ["tough", "fair"]

    def scripted_action(self, player, style):
        return self._move(player, 8 if style == "tough" else 5, 6 if style == "tough" else 5)

    def state_key(self):
        return tuple(self.log)

    def system_prompt_for(self, player):
        return "ignored"

    def max_turns_per_player(self):
        return 5

    def admissible_actions(self, player=None):
        return [f"offer {k}" for k in range(11)] + ["accept"]


def test_two_player_path_builds_and_evaluates_both_roles(tmp_path, monkeypatch):
    real_make = envs.make
    monkeypatch.setattr(envs, "make", lambda env_id, **kw: _SplitCoins() if env_id == "split_coins" else real_make(env_id, **kw))
    monkeypatch.setattr(envs, "TWO_PLAYER", envs.TWO_PLAYER + ("split_coins",))
    recipe = tiny.full_recipe("split_coins", "micro", {"demo_episodes": 30, "steps": 40, "eval_tasks": 4})
    demos, stats = tiny.collect_demos("split_coins", recipe, progress=False)
    # Both roles are recorded (the prompt names the role), labels are moves of the game.
    roles = {m[1]["content"].split(".")[0] for m, _ in demos}
    assert roles == {"You are A", "You are B"}
    assert stats["selfplay_episodes"] == 10  # every third of 30 episodes
    path = tiny.ensure_tiny("split_coins", "micro", cache_dir=tmp_path, progress=False,
                            overrides={"demo_episodes": 30, "steps": 40, "eval_tasks": 4})
    meta = tiny.read_meta(path)
    assert meta["success"]["opponent"] == "rule:fair"
    assert meta["success"]["sampled"]["episodes"] == 8  # 4 test tasks x 2 roles
