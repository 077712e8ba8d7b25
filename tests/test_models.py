"""common/models.py: 4-bit CPU loading, LoRA-only training, the reference policy via disable_adapter,
a second adapter, the bitsandbytes CPU repacking workaround, tokenizer set-up and user errors.

Most tests use `random_llama_dir` (tests/conftest.py): a random 2-layer Llama saved like a hub checkpoint,
whose tokenizer has no pad token and right padding. No network, no GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import REPO
from common.models import UserError, add_adapter, disable_cpu_weight_repacking, lora_state, load_policy

bnb = pytest.importorskip("bitsandbytes")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
N_LAYERS = 2  # random_llama_dir


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _batch(tok, texts=("push the box up to the target", "left")):
    return tok(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)


def _fill_lora(model, adapter: str = "default", seed: int = 0, scale: float = 0.3) -> None:
    """Deterministic non-zero values for every LoRA tensor of `adapter` (B starts at zero, which would
    make the adapter a no-op and the gradients of A zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if ".lora_" in name and f".{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def _loss(model, batch) -> torch.Tensor:
    """A fixed next-token loss over the non-pad positions of a left-padded batch."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1]
    target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100)


def _lora_grads(model, batch) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    _loss(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _linear4bit(model) -> list:
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def test_4bit_cpu_load_quantizes_linears_and_only_lora_trains(random_llama_dir):
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=True, lora_r=4, lora_alpha=8, device="cpu")
    assert type(model).__name__ == "PeftModelForCausalLM"
    # Every decoder linear is a LoRA layer over a bitsandbytes Linear4bit (nf4, double quant, fp32 compute).
    wrapped = {n: m for n, m in model.named_modules() if n.split(".")[-1] in TARGETS}
    assert len(wrapped) == N_LAYERS * len(TARGETS)
    for name, m in wrapped.items():
        assert isinstance(m.base_layer, bnb.nn.Linear4bit), name
        qs = m.base_layer.weight.quant_state
        assert qs.quant_type == "nf4" and qs.nested, name
        assert m.base_layer.compute_dtype == torch.float32, name
    assert len(_linear4bit(model)) == N_LAYERS * len(TARGETS)
    # The output head is neither quantized nor adapted.
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
    # Trainable = exactly the LoRA A and B of the "default" adapter (2 per wrapped linear), nothing else.
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(wrapped)
    assert all((".lora_A.default." in n or ".lora_B.default." in n) for n in trainable), trainable[:4]
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    # The bitsandbytes CPU repacking is off on every Linear4bit.
    assert all(m.support_avx512bf16_for_cpu is False for m in _linear4bit(model))
    # A forward and generate run.
    model.eval()
    with torch.no_grad():
        out = model.generate(**_batch(tok), max_new_tokens=3, do_sample=False)
    assert out.shape[0] == 2


def test_plain_cpu_load_by_default(random_llama_dir):
    model, _ = load_policy(str(random_llama_dir), device="cpu")
    assert not _linear4bit(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_tokenizer_left_padding_pad_and_eos(random_llama_dir):
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(random_llama_dir))
    assert raw.pad_token is None and raw.padding_side == "right"  # what load_policy has to fix
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=False)
    assert tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == tok.eos_token  # falls back to EOS
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    batch = _batch(tok, ["push the box up to the target", "up"])
    short = batch["attention_mask"][1]
    n_pad = int((short == 0).sum())
    assert n_pad > 0
    assert short[:n_pad].eq(0).all() and short[n_pad:].eq(1).all()  # padding on the left
    assert batch["input_ids"][1, :n_pad].eq(tok.pad_token_id).all()
    assert batch["input_ids"][1, -1] != tok.pad_token_id


# ----------------------------------------------------------------------------------------------
# Reference policy and adapters
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("four_bit", [False, True])
def test_disable_adapter_gives_base_model_logits(random_llama_dir, four_bit):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model, tok = load_policy(str(random_llama_dir), load_in_4bit=four_bit, lora_r=4, lora_alpha=8, device="cpu")
    _fill_lora(model)
    kwargs = dict(dtype=torch.float32)
    if four_bit:
        kwargs.update(device_map={"": "cpu"}, quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32))
    base = AutoModelForCausalLM.from_pretrained(str(random_llama_dir), **kwargs).eval()
    # the reference must take the same bitsandbytes kernels as the policy: on a CPU with AVX512-BF16 a
    # 4-bit model that keeps repacking on computes in bf16 on its first eval forward (2.6e-3 apart)
    disable_cpu_weight_repacking(base)
    batch = _batch(tok)
    model.eval()
    with torch.no_grad():
        base_logits = base(**batch).logits
        with_lora = model(**batch).logits
        with model.disable_adapter():
            ref = model(**batch).logits
        again = model(**batch).logits
    assert (with_lora - base_logits).abs().max() > 1e-2  # the adapter really changes the output
    torch.testing.assert_close(ref, base_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, with_lora, rtol=0, atol=0)  # the adapter is back after the block


def test_second_adapter_is_separate_and_trains_independently(random_llama_dir):
    model, tok = load_policy(str(random_llama_dir), load_in_4bit=True, lora_r=4, lora_alpha=8, device="cpu")
    add_adapter(model, "prm", lora_r=2, lora_alpha=4)
    assert model.active_adapter == "default"
    pol, prm = lora_state(model, "default"), lora_state(model, "prm")
    assert len(pol) == len(prm) == 2 * N_LAYERS * len(TARGETS)
    assert not set(pol) & set(prm)
    params = dict(model.named_parameters())
    assert not {params[n].data_ptr() for n in pol} & {params[n].data_ptr() for n in prm}  # separate storage
    assert all(t.shape[0] == 2 for n, t in prm.items() if ".lora_A." in n)  # its own rank
    assert all(t.shape[0] == 4 for n, t in pol.items() if ".lora_A." in n)
    with pytest.raises(UserError):
        add_adapter(model, "prm")

    # One optimizer over both adapters: a step with "prm" active moves only prm, and vice versa.
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if ".lora_" in n], lr=0.5)
    batch = _batch(tok)

    def step(adapter: str) -> None:
        model.set_adapter(adapter)
        model.train()
        opt.zero_grad(set_to_none=True)
        _loss(model, batch).backward()
        opt.step()

    step("prm")
    pol1, prm1 = lora_state(model, "default"), lora_state(model, "prm")
    assert all(torch.equal(pol[n], pol1[n]) for n in pol)
    assert any(not torch.equal(prm[n], prm1[n]) for n in prm)
    step("default")
    pol2, prm2 = lora_state(model, "default"), lora_state(model, "prm")
    assert all(torch.equal(prm1[n], prm2[n]) for n in prm)
    assert any(not torch.equal(pol1[n], pol2[n]) for n in pol)
    # The base stays frozen and the two adapters now give different outputs.
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".lora_" not in n)
    model.eval()
    with torch.no_grad():
        model.set_adapter("prm")
        a = model(**batch).logits
        model.set_adapter("default")
        b = model(**batch).logits
    assert not torch.allclose(a, b)


def test_lora_state_unknown_adapter_names_the_known_ones(random_llama_dir):
    model, _ = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=2, lora_alpha=2)
    with pytest.raises(ValueError, match="default"):
        lora_state(model, "nope")


# ----------------------------------------------------------------------------------------------
# The bitsandbytes CPU repacking trap (docs/design.md, "Models and traps")
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("avx512bf16", ["this_cpu", "simulated"])
def test_4bit_cpu_gradients_unchanged_by_eval_generate(random_llama_dir, monkeypatch, avx512bf16):
    """LoRA gradients after an eval-mode no-grad generate equal those of a fresh load that never ran
    eval. On a CPU with AVX512-BF16, bitsandbytes repacks the 4-bit weights in place during the generate
    and, without load_policy's workaround, the gradients below differ by 40-1600 % (measured by forcing
    the flag back on). "simulated" makes bitsandbytes believe this CPU has AVX512-BF16 (its repacking
    code then runs on any x86 CPU), so the check bites on every machine; "this_cpu" runs unpatched."""
    import bitsandbytes.nn.modules

    if avx512bf16 == "simulated":
        monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
        # Linear4bit reads the CPU capability when it is built: without the workaround it would be on.
        assert bnb.nn.Linear4bit(64, 64).support_avx512bf16_for_cpu is True
    grads = []
    for run_eval_first in (True, False):
        model, tok = load_policy(str(random_llama_dir), load_in_4bit=True, lora_r=4, lora_alpha=8, device="cpu")
        layers = _linear4bit(model)
        assert len(layers) == N_LAYERS * len(TARGETS)
        assert all(m.support_avx512bf16_for_cpu is False for m in layers)
        _fill_lora(model)
        batch = _batch(tok)
        if run_eval_first:
            model.eval()
            with torch.no_grad():
                model.generate(**batch, max_new_tokens=4, do_sample=False)
            assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)
        grads.append(_lora_grads(model, batch))
    after_eval, fresh = grads
    assert after_eval.keys() == fresh.keys() and len(fresh) == 2 * N_LAYERS * len(TARGETS)
    # The gradients reach layer 0 (what the repacking breaks) and are not all zero.
    assert any(".layers.0." in n and g.abs().max() > 0 for n, g in fresh.items())
    for name in fresh:
        denom = fresh[name].norm().clamp(min=1e-12)
        rel = float((after_eval[name] - fresh[name]).norm() / denom)
        assert rel < 1e-6, f"{name}: relative gradient difference {rel:.3g}"


# ----------------------------------------------------------------------------------------------
# Activation checkpointing
# ----------------------------------------------------------------------------------------------
def test_activation_checkpointing_keeps_gradients(random_llama_dir):
    plain, tok = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8)
    ckpt, _ = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8,
                          activation_checkpointing=True)
    assert ckpt.base_model.model.is_activation_checkpointing and not plain.base_model.model.is_activation_checkpointing
    _fill_lora(plain)
    _fill_lora(ckpt)
    batch = _batch(tok)
    g_plain, g_ckpt = _lora_grads(plain, batch), _lora_grads(ckpt, batch)
    assert g_plain.keys() == g_ckpt.keys()
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-5, atol=1e-7)


def test_activation_checkpointing_default_on_for_real_models_on_cuda_only():
    from common.models import use_activation_checkpointing as use

    assert use(None, is_tiny=False, device_type="cuda") is True  # a real model on a GPU: memory (gpu.md)
    assert use(None, is_tiny=True, device_type="cuda") is False  # a tiny policy's activations are small
    assert use(None, is_tiny=False, device_type="cpu") is False
    assert use(None, is_tiny=True, device_type="cpu") is False
    for is_tiny in (False, True):  # an explicit choice wins everywhere
        for device_type in ("cuda", "cpu"):
            assert use(True, is_tiny, device_type) is True and use(False, is_tiny, device_type) is False


def test_load_policy_asks_the_decision_with_what_it_loads(tmp_path, random_llama_dir, monkeypatch):
    """load_policy passes the request, whether the checkpoint is a tiny policy (a tiny_meta.json beside
    it) and the device to `use_activation_checkpointing`, and enables it when that says so."""
    import shutil

    from common import models

    calls = []
    monkeypatch.setattr(models, "use_activation_checkpointing", lambda *a: calls.append(a) or True)
    tiny_dir = tmp_path / "tiny_like"
    shutil.copytree(random_llama_dir, tiny_dir)
    (tiny_dir / "tiny_meta.json").write_text("{}")
    real, _ = load_policy(str(random_llama_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
    load_policy(str(tiny_dir), load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu",
                activation_checkpointing=False)
    assert calls == [(None, False, "cpu"), (False, True, "cpu")]
    assert real.base_model.model.is_activation_checkpointing


# ----------------------------------------------------------------------------------------------
# User errors: one line that says what to do
# ----------------------------------------------------------------------------------------------
def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_missing_local_path_is_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        load_policy(str(tmp_path / "no_such_model"))
    msg = _one_line(e)
    assert "no_such_model" in msg and "no such local directory" in msg and "--model-name tiny" in msg


def test_directory_without_model_is_one_line(tmp_path):
    with pytest.raises(UserError) as e:
        load_policy(str(tmp_path))
    assert str(tmp_path) in _one_line(e)


def test_hub_id_without_network_is_one_line(monkeypatch):
    import socket

    import huggingface_hub.constants

    def unreachable(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(UserError) as e:
        load_policy("credit-assignment-tests/no-such-model")
    msg = _one_line(e)
    assert "'credit-assignment-tests/no-such-model'" in msg and "no network" in msg and "--model-name tiny" in msg


def test_hub_id_in_offline_mode_is_one_line(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as e:
        load_policy("credit-assignment-tests/no-such-model")
    msg = _one_line(e)
    assert "no-such-model" in msg and "HF_HUB_OFFLINE" in msg and "--model-name tiny" in msg


def test_neither_directory_nor_hub_id_is_one_line():
    with pytest.raises(UserError) as e:
        load_policy("runs/no/such/adapter")
    assert "not a local directory and not a valid hub id" in _one_line(e)


def test_tiny_needs_a_known_env():
    with pytest.raises(UserError) as e:
        load_policy("tiny")
    assert "--env-id" in _one_line(e)
    with pytest.raises(UserError) as e:
        load_policy("tiny", env_id="no_such_env")
    msg = _one_line(e)
    assert "no_such_env" in msg and "sokoban" in msg  # lists the known envs
    with pytest.raises(UserError) as e:
        load_policy("tiny", env_id="sokoban", tiny_preset="huge")
    assert "micro" in _one_line(e)


def test_plain_weights_never_import_bitsandbytes_and_4bit_still_works_after(random_llama_dir):
    """A model without 4-bit weights is loaded with bitsandbytes hidden from peft (its import costs seconds
    at every start); a 4-bit load later in the same process still gets LoRA over Linear4bit layers."""
    import subprocess
    import sys

    code = f"""
import sys
from common.models import load_policy
model, _ = load_policy({str(random_llama_dir)!r}, load_in_4bit=False, lora_r=4, lora_alpha=8, device="cpu")
print("plain", "bitsandbytes" in sys.modules, type(model).__name__)
model, _ = load_policy({str(random_llama_dir)!r}, load_in_4bit=True, lora_r=4, lora_alpha=8, device="cpu")
import bitsandbytes as bnb
q = model.base_model.model.model.layers[0].self_attn.q_proj
print("4bit", type(q).__module__, isinstance(q.base_layer, bnb.nn.Linear4bit))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("plain", "4bit"))]
    assert lines == ["plain False PeftModelForCausalLM", "4bit peft.tuners.lora.bnb True"], out.stdout


def test_4bit_without_a_bitsandbytes_backend_is_one_line(random_llama_dir, monkeypatch):
    import bitsandbytes.functional

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel registered for this device\nmore detail")

    monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", broken)
    with pytest.raises(UserError) as e:
        load_policy(str(random_llama_dir), load_in_4bit=True, device="cpu")
    msg = _one_line(e)
    assert "4-bit" in msg and "--load-in-4bit False" in msg and "no kernel registered" in msg


def test_4bit_without_bitsandbytes_installed_is_one_line(random_llama_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(UserError) as e:
        load_policy(str(random_llama_dir), load_in_4bit=True, device="cpu")
    msg = _one_line(e)
    assert "pip install" in msg and "--load-in-4bit False" in msg


def test_bad_lora_settings_are_user_errors(random_llama_dir):
    with pytest.raises(UserError, match="lora-r"):
        load_policy(str(random_llama_dir), lora_r=0)
    with pytest.raises(UserError, match="lora-dropout"):
        load_policy(str(random_llama_dir), lora_dropout=1.5)
    with pytest.raises(UserError, match="LoRA"):
        load_policy(str(random_llama_dir), load_in_4bit=False, target_modules=["no_such_layer"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_cuda_is_one_line():
    with pytest.raises(UserError) as e:
        load_policy("anything", device="cuda")
    assert "CUDA is not available" in _one_line(e)


# ----------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_nf4_bf16(random_llama_dir):
    model, tok = load_policy(str(random_llama_dir), lora_r=4, lora_alpha=8)
    layers = _linear4bit(model)
    assert len(layers) == N_LAYERS * len(TARGETS)
    assert all(m.weight.device.type == "cuda" and m.compute_dtype == torch.bfloat16 for m in layers)
    assert all(m.weight.quant_state.quant_type == "nf4" and m.weight.quant_state.nested for m in layers)
    assert model.base_model.model.is_activation_checkpointing  # on by default for a real model on CUDA
    batch = {k: v.cuda() for k, v in _batch(tok).items()}
    model.train()
    _loss(model, batch).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if ".lora_B.default." in n)


# ----------------------------------------------------------------------------------------------
# The tiny local policy through the same path
# ----------------------------------------------------------------------------------------------
def test_tiny_goes_through_ensure_tiny(random_llama_dir, monkeypatch):
    """"tiny" asks common.tiny for the env's checkpoint and loads it like any local directory. (The real
    micro build through load_policy runs in every method's end-to-end test; here a stand-in path keeps
    this file fast.)"""
    envs = pytest.importorskip("envs")
    if "sokoban" not in envs.available():
        pytest.skip("envs/sokoban.py is not in this checkout")
    from common import tiny

    calls = []

    def fake_ensure_tiny(env_id, preset="default", **kwargs):
        calls.append((env_id, preset))
        return random_llama_dir

    monkeypatch.setattr(tiny, "ensure_tiny", fake_ensure_tiny)
    model, tok = load_policy("tiny", env_id="sokoban", tiny_preset="micro", load_in_4bit=False, lora_r=2, lora_alpha=2)
    assert calls == [("sokoban", "micro")]
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert model.base_model.model.name_or_path == str(random_llama_dir)
    assert tok.padding_side == "left" and tok.pad_token is not None


# ----------------------------------------------------------------------------------------------
# Model-dependent defaults, decided in one place for the five method files
# ----------------------------------------------------------------------------------------------
def test_policy_prompt_options_and_kind_tiny_name_dir_and_real_model(tmp_path, random_llama_dir):
    import json

    from common.models import policy_kind, policy_prompt_options
    from common.tiny import full_recipe

    envs = pytest.importorskip("envs")
    if "sokoban" not in envs.available():
        pytest.skip("envs/sokoban.py is not in this checkout")
    recipe = full_recipe("sokoban", "default")
    tiny = policy_prompt_options("tiny", "sokoban")
    assert tiny.is_tiny and policy_kind("tiny") == "tiny"
    assert tiny.max_new_tokens == recipe["max_new_tokens"] == 4  # Sokoban's longest action: "right" + EOS
    assert tiny.env_kwargs == recipe["env_kwargs"] and tiny.env_kwargs  # e.g. no instruction text

    # a tiny checkpoint directory is a tiny policy too (its recipe is in tiny_meta.json)
    d = tmp_path / "tiny_ckpt"
    d.mkdir()
    (d / "tiny_meta.json").write_text(json.dumps({"recipe": {"env_id": "sokoban", "env_kwargs": {"history": 0},
                                                             "max_new_tokens": 6}}))
    local = policy_prompt_options(str(d), "sokoban")
    assert (local.is_tiny, local.env_kwargs, local.max_new_tokens, policy_kind(str(d))) == (
        True, {"history": 0}, 6, "tiny")
    # ... but a tiny policy built for another env passes no env options
    assert policy_prompt_options(str(d), "webshop").env_kwargs == {}

    # any other model (a hub id, a real checkpoint directory): no env options, no budget (the method's)
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", str(random_llama_dir)):
        real = policy_prompt_options(name, "sokoban")
        assert (real.is_tiny, real.sft, real.env_kwargs, real.max_new_tokens) == (False, False, {}, None)
        assert policy_kind(name) == name
    # a SmolLM2 SFT directory (smollm2_meta.json): its recipe's prompts and budget, `sft`
    s = tmp_path / "sft_ckpt"
    s.mkdir()
    (s / "smollm2_meta.json").write_text(json.dumps({"recipe": {"env_id": "sokoban", "env_kwargs": {"history": 1},
                                                                "max_new_tokens": 9}}))
    sft = policy_prompt_options(str(s), "sokoban")
    assert (sft.is_tiny, sft.sft, sft.env_kwargs, sft.max_new_tokens) == (False, True, {"history": 1}, 9)
    assert not tiny.sft

    # the tiny policy's RL temperature (1.0 unless its env is listed; the micro preset: 1.0)
    assert tiny.temperature == 1.0 and real.temperature == 1.0
    assert policy_prompt_options("tiny", "twenty_questions").temperature == 1.5
    assert policy_prompt_options("tiny", "twenty_questions", "micro").temperature == 1.0
    assert policy_prompt_options("Qwen/Qwen3-1.7B", "twenty_questions").temperature == 1.0

    with pytest.raises(UserError) as e:
        policy_prompt_options("tiny", "no_such_env")
    assert "no_such_env" in _one_line(e)


def test_policy_prompt_options_hand_values_and_the_deprecated_wrapper(tmp_path):
    """What the policy fixes for a run, written out by hand (the shipped tiny recipes, common/adapters'
    manifest), and `policy_defaults` giving the same options plus the caller's rates and budget."""
    import json

    from common.models import PromptOptions, policy_defaults, policy_prompt_options
    from common.smollm2 import SYSTEM

    envs = pytest.importorskip("envs")
    if not {"sokoban", "twenty_questions", "webshop"} <= set(envs.available()):
        pytest.skip("needs envs sokoban, twenty_questions and webshop")
    d = tmp_path / "tiny_sokoban"  # a tiny checkpoint built for Sokoban, used on another env
    d.mkdir()
    (d / "tiny_meta.json").write_text(json.dumps({"recipe": {"env_id": "sokoban", "preset": "default",
                                                             "env_kwargs": {"history": 0}, "max_new_tokens": 6}}))
    questions = {"secrets": "compound", "instructions": False, "numbered": False, "show_candidates": 5}
    cases = {  # (model, env, preset): (is_tiny, sft, env_kwargs, max_new_tokens, temperature)
        ("tiny", "sokoban", "default"): (True, False, {"num_boxes": 1, "history": 0, "instructions": False}, 4, 1.0),
        ("tiny", "twenty_questions", "default"): (True, False, questions, 16, 1.5),  # RL_TEMPERATURE
        ("tiny", "twenty_questions", "micro"): (True, False, {}, 16, 1.0),
        (str(d), "sokoban", "default"): (True, False, {"history": 0}, 6, 1.0),
        (str(d), "twenty_questions", "default"): (True, False, {}, 6, 1.0),  # another env's policy
        ("smollm2-135m", "webshop", "default"): (
            False, True, {"instructions": False, "system_prompt": SYSTEM["webshop"]}, 16, 1.0),
        ("smollm2-135m", "twenty_questions", "default"): (
            False, True, {**questions, "show_candidates": 0, "system_prompt": SYSTEM["twenty_questions"]}, 16,
            1.0),  # the adapter plays the faithful game: no candidate list
        ("smollm2-135m", "sokoban", "default"): (False, False, {}, None, 1.0),  # no adapter shipped
        ("smollm2-135m-instruct", "webshop", "default"): (False, False, {}, None, 1.0),
        ("Qwen/Qwen2.5-1.5B-Instruct", "webshop", "default"): (False, False, {}, None, 1.0),
    }
    for (model, env_id, preset), want in cases.items():
        got = policy_prompt_options(model, env_id, preset)
        assert isinstance(got, PromptOptions) and tuple(got) == want, (model, env_id, preset, got)
        old = policy_defaults(model, env_id, preset, learning_rate=1e-5, max_new_tokens=512,
                              tiny_learning_rate=2e-4)
        is_tiny, sft, env_kwargs, budget, temperature = want
        assert (old.is_tiny, old.sft, old.env_kwargs, old.max_new_tokens, old.temperature) == (
            is_tiny, sft, env_kwargs, budget or 512, temperature)
        assert old.learning_rate == (2e-4 if is_tiny else 1e-5)
    with pytest.raises(UserError) as e:
        policy_prompt_options("tiny", "sokoban", "huge")
    assert "huge" in _one_line(e)


def test_common_imports_run_one_way():
    """common.models -> common.smollm2 -> common.tiny: no import back, not even inside a function."""
    import ast

    def imports(name):
        tree = ast.parse((REPO / "common" / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        return {m.removeprefix("common.") for m in found if m.startswith("common.")}

    assert imports("models") >= {"smollm2", "tiny"}
    assert "models" not in imports("smollm2") and "tiny" in imports("smollm2")
    assert not imports("tiny") & {"models", "smollm2"}
