"""The SmolLM2 starting policies (common/smollm2.py): compact prompts, a build that resumes where it was
stopped with the same result, shipped adapters checked against their checksums, and
`--model-name smollm2-135m` loading the env's adapter merged into the base (the KL reference is that policy).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import envs
from common import models, smollm2

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

# A build small enough for the suite: 20 demonstration episodes, 2 steps of 2 examples, 1 test task.
MICRO = {"demo_episodes": 20, "steps": 2, "batch_size": 2, "eval_tasks": 1, "max_new_tokens": 4, "lora_r": 2,
         "lora_alpha": 4, "lora_first_layer": 28}


@pytest.fixture(scope="module")
def smol_tok(smollm2_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_cache / "smollm2-135m"))


def test_system_prompt_option_replaces_the_system_message_of_every_env():
    line = "One line."
    for env_id in envs.available():
        env = envs.make(env_id, system_prompt=line)
        task = env.task_ids("train")[0]
        if env_id in envs.TWO_PLAYER:
            env.reset(task)
            for player in env.players:
                assert env.observe(player)[0] == {"role": "system", "content": line}, env_id
            duel = envs.vs_opponent(envs.make(env_id, system_prompt=line), "rule:fair")
            duel.reset(task)
            assert duel.messages()[0]["content"] == line
        else:
            env.reset(task)
            assert env.messages()[0] == {"role": "system", "content": line}, env_id
            full = envs.make(env_id)
            full.reset(task)
            assert env.messages()[1] == full.messages()[1]  # the user message is unchanged
    with pytest.raises(ValueError, match="system_prompt must be a string"):
        envs.make("sokoban", system_prompt=3)


def test_recipe_takes_the_tiny_demonstrations_and_a_one_line_system_prompt():
    from common import tiny

    recipe = smollm2.recipe_for("sokoban")
    demo = tiny.recipe_for("sokoban")
    assert recipe["env_kwargs"] == {**demo["env_kwargs"], "system_prompt": smollm2.SYSTEM["sokoban"]}
    assert (recipe["demo_episodes"], recipe["eps"], recipe["demo_seed"]) == (demo["demo_episodes"], demo["eps"], demo["seed"])
    assert smollm2.recipe_hash(recipe) != smollm2.recipe_hash(smollm2.recipe_for("sokoban", {"steps": 1}))
    with pytest.raises(ValueError, match="unknown SmolLM2 recipe key"):
        smollm2.recipe_for("sokoban", {"stepz": 1})
    with pytest.raises(ValueError, match="no SmolLM2 recipe"):
        smollm2.recipe_for("chess")


def test_epo_strategist_recipe_is_the_tiny_strategist_testbed():
    """EPO's strategist has its own recipe: the tiny strategist's demonstrations (strategies, every past move,
    the style-aware mix), under its testbed name; `--model-name smollm2-135m` finds it through the tiny
    overrides epo.py passes, and never takes the Negotiation move-level adapter for it."""
    from common import tiny

    overrides = tiny.strategist_overrides("negotiation")
    assert smollm2.testbed_name("negotiation", overrides) == "negotiation_strategist"
    assert smollm2.testbed_name("negotiation") == "negotiation"
    assert smollm2.testbed_name("negotiation", {"env_kwargs": {"moves": "strategy"}}) is None  # no such testbed
    recipe = smollm2.recipe_for("negotiation_strategist")
    demo = tiny.recipe_for("negotiation", "default", overrides)
    assert recipe["env_id"] == "negotiation" and recipe["testbed"] == "negotiation_strategist"
    assert recipe["env_kwargs"] == {**demo["env_kwargs"], "system_prompt": smollm2.SYSTEM["negotiation_strategist"]}
    assert recipe["env_kwargs"]["moves"] == "strategy" and recipe["demo_mix"] == demo["demo_mix"]
    assert smollm2.work_dir(recipe).name.startswith("negotiation_strategist__")
    # an env's own recipe has no testbed key, so its hash (and its shipped adapter) is what it was
    assert "testbed" not in smollm2.recipe_for("negotiation")


def test_compact_prompts_cost_well_under_half_the_full_prompt(smol_tok):
    # The same first state of a train task, rendered with SmolLM2's chat template: the env's full system
    # prompt is most of a turn, the compact one a line; the user message is the same.
    def tokens(env_kwargs, env_id):
        env = envs.make(env_id, **env_kwargs)
        env.reset(env.task_ids("train")[0])
        messages = env.observe(env.current_player) if env_id in envs.TWO_PLAYER else env.messages()
        text = smol_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, len(smol_tok(text, add_special_tokens=False)["input_ids"]), messages[1]

    for env_id in ("sokoban", "twenty_questions", "bargaining", "negotiation", "webshop"):
        kw = smollm2.recipe_for(env_id)["env_kwargs"]
        text, short, user = tokens(kw, env_id)
        _, long, full_user = tokens({k: v for k, v in kw.items() if k != "system_prompt"}, env_id)
        assert text.startswith(f"<|im_start|>system\n{smollm2.SYSTEM[env_id]}<|im_end|>"), text[:120]
        assert "SmolLM" not in text  # not the template's default system prompt
        assert user == full_user and short < 0.5 * long, (env_id, short, long)


def test_demonstration_targets_are_the_action_and_the_end_of_turn(smol_tok):
    recipe = smollm2.recipe_for("bargaining", {"demo_episodes": 5})
    examples, stats = smollm2.demonstrations(recipe, smol_tok, progress=False)
    assert stats["turns"] == len(examples) > 5
    for prompt, target in examples:
        assert smol_tok.decode(prompt).endswith("<|im_start|>assistant\n")
        assert target[-1] == smol_tok.eos_token_id
        action = smol_tok.decode(target[:-1])
        assert action in ("accept", "reject") or action.startswith("propose "), action


def test_batches_depend_on_seed_and_step_only():
    a = [smollm2.batch_indices(100, 8, seed=0, step=s) for s in range(5)]
    assert a == [smollm2.batch_indices(100, 8, seed=0, step=s) for s in range(5)]
    assert a[0] != a[1] and a[0] != smollm2.batch_indices(100, 8, seed=1, step=0)
    assert all(len(set(b)) == 8 for b in a)


@pytest.fixture(scope="module")
def micro_builds(smollm2_cache, tmp_path_factory):
    """The same micro build of Bargaining twice: in one sitting, and stopped after every step and resumed."""
    root = tmp_path_factory.mktemp("smollm2_sft")
    whole = smollm2.build("bargaining", MICRO, progress=False, out=root / "whole")
    pieces = root / "pieces"
    sittings = 0
    while smollm2.build("bargaining", MICRO, max_minutes=1e-9, progress=False, out=pieces) is None:
        sittings += 1
        ck = torch.load(pieces / "checkpoint.pt", weights_only=False)
        assert ck["step"] == sittings  # one step per sitting, written when the sitting ended
    return whole, pieces / "adapter", sittings


def test_a_stopped_build_resumes_to_the_same_adapter(micro_builds):
    from safetensors.torch import load_file

    whole, resumed, sittings = micro_builds
    assert sittings == MICRO["steps"] - 1  # the last sitting finished the build
    a = load_file(str(whole / "adapter_model.safetensors"))
    b = load_file(str(resumed / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 2 * len(smollm2.LORA_MODULES)  # A and B, layers 28-29
    assert all(v.dtype == torch.bfloat16 for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma = json.loads((whole / "smollm2_meta.json").read_text())
    mb = json.loads((resumed / "smollm2_meta.json").read_text())
    assert ma["loss_curve"] == mb["loss_curve"] and len(ma["loss_curve"]) == MICRO["steps"]
    assert ma["success"] == mb["success"] and ma["success"]["test_tasks"] == 1


@pytest.fixture
def shipped(micro_builds, tmp_path, monkeypatch):
    """The micro build shipped into a temporary adapters directory, installed as the project's."""
    root = tmp_path / "adapters"
    smollm2.ship("bargaining", root=root, built=micro_builds[0])
    monkeypatch.setattr(smollm2, "ADAPTERS_DIR", root)
    return root


def test_shipped_adapter_is_checked_and_a_corrupt_file_is_one_clear_error(shipped):
    manifest = smollm2.read_manifest(shipped)
    entry = manifest["adapters"]["bargaining"]
    assert entry["bytes"] <= smollm2.SIZE_BUDGET_BYTES and set(entry["files"]) == set(smollm2.SHIPPED_FILES)
    path = smollm2.shipped_adapter("bargaining")
    assert path == shipped / entry["dir"] and smollm2.shipped_adapter("sokoban") is None
    weights = path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(models.UserError) as e:
        models.load_policy("smollm2-135m", env_id="bargaining")
    msg = str(e.value)
    assert "\n" not in msg and "adapter_model.safetensors has SHA-256" in msg and "python -m common.smollm2" in msg
    weights.unlink()
    with pytest.raises(smollm2.AdapterError, match="is missing"):
        smollm2.shipped_adapter("bargaining")


def test_model_name_smollm2_starts_from_the_envs_adapter(shipped, micro_builds, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tok = models.load_policy("smollm2-135m", env_id="bargaining", load_in_4bit=False, lora_r=2, lora_alpha=4)
    merged = Path(model.peft_config["default"].base_model_name_or_path)
    assert merged == smollm2.ensure_policy("bargaining") and (merged / "smollm2_meta.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(str(models.ensure_packaged_model("smollm2-135m")), dtype=torch.float32)
    sft = PeftModel.from_pretrained(base, str(micro_builds[0])).eval()
    ids = tok("Round 1 of 10. Your move: accept | propose N.", return_tensors="pt")["input_ids"]
    with torch.no_grad(), model.disable_adapter():  # the reference policy of the KL term: the SFT policy
        ref = model(input_ids=ids).logits
    with torch.no_grad():
        want = sft(input_ids=ids).logits
    assert torch.allclose(ref, want, atol=1e-4)
    options = models.policy_prompt_options("smollm2-135m", "bargaining")
    assert options.env_kwargs["system_prompt"] == smollm2.SYSTEM["bargaining"] and not options.is_tiny
    assert options.max_new_tokens == MICRO["max_new_tokens"]  # the recipe's, not a method's budget
    # the raw instruct model, and an env without an adapter (a notice, then the raw model)
    assert models.policy_prompt_options("smollm2-135m-instruct", "bargaining").env_kwargs == {}
    raw, _ = models.load_policy("smollm2-135m", env_id="sokoban", load_in_4bit=False, lora_r=2, lora_alpha=4)
    assert "no SmolLM2 adapter is shipped for env 'sokoban'" in capsys.readouterr().err
    with torch.no_grad(), raw.disable_adapter():
        assert not torch.allclose(raw(input_ids=ids).logits, want, atol=1e-4)


def test_aria_on_smollm2_runs_the_shipped_bargaining_adapters_prompt():
    import aria

    entry = smollm2.read_manifest()["adapters"]["bargaining"]  # shipped in common/adapters
    assert entry["bytes"] <= smollm2.SIZE_BUDGET_BYTES
    args, _, probe, env_kwargs = aria.make_env(aria.Args(model_name="smollm2-135m"))
    assert env_kwargs == entry["env_kwargs"] == {"system_prompt": smollm2.SYSTEM["bargaining"]}
    assert args.max_new_tokens == entry["max_new_tokens"]
    probe.reset(probe.task_ids("test")[0])
    assert probe.observe(probe.current_player)[0]["content"] == smollm2.SYSTEM["bargaining"]


def test_the_twenty_questions_adapter_plays_the_faithful_game():
    """The paper (§4): the set of secrets is unknown to the questioner. The SmolLM2 recipe renders its
    demonstrations without the candidate list (the tiny recipe shows it once 5 are left), and the shipped
    adapter is that build, so `--model-name smollm2-135m` plays its env options: the list hidden."""
    from common import tiny

    assert tiny.recipe_for("twenty_questions")["env_kwargs"]["show_candidates"] == 5
    recipe = smollm2.recipe_for("twenty_questions")
    assert recipe["env_kwargs"]["show_candidates"] == 0 and recipe["env_kwargs"]["secrets"] == "compound"
    entry = smollm2.read_manifest()["adapters"]["twenty_questions"]
    assert entry["recipe_hash"] == smollm2.recipe_hash(recipe) and entry["env_kwargs"]["show_candidates"] == 0
