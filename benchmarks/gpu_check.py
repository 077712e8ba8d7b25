"""GPU check of the model path every method uses (common/models.py), at real sizes: 4-bit nf4 + LoRA on CUDA,
and all five scripts on it.

Stages (default: all four, in this order, for each `--configs` entry):
- `step`: load through `common.models.load_policy`, a batched sampled `generate` forced to its full length
  (`min_new_tokens`: the worst case of a rollout; tokens per second), one training step on the LoRA
  (forward with `logits_to_keep`, backward, AdamW: seconds and peak memory), and checks that only LoRA
  parameters get gradients, that they are finite, and that `disable_adapter()` gives the base model's
  logits after the step. On CUDA: 4-bit, 4-bit with activation checkpointing, and bf16.
- `generate`: the method files' `generate` with the plain dynamic KV cache and with `--static-cache` (a static
  cache that transformers compiles on CUDA), bf16 and 4-bit on CUDA: seconds of the first call (compilation),
  tokens per second and ms per decoding step of the later calls, and whether greedy tokens agree.
- `scripts`: each of the five scripts as a subprocess, 4-bit, one iteration on its default env with the
  budget of `benchmarks/real_model.py timing` (`TIMING_COMMON` + `TIMING_ARGS`), so that its rows compare
  with the CPU rows of docs/real_model.md; seconds per phase, tokens per second and peak GPU memory are
  the script's own `perf/` metrics.
- `report`: docs/gpu.md from the raw results (docs/results/gpu.jsonl; the last record of each key).

The models are randomly initialised with the configuration of a real one (`CONFIGS`, copied from the
published config.json files) and SmolLM2-135M-Instruct's tokenizer and chat template (`--tokenizer`, by
default the packaged model's directory, see `python -m common.models`). Random weights change neither
memory nor the speed of a forward pass, only what is generated: a random model almost never samples its
end-of-sequence token, so every completion runs to `--max-new-tokens` (the longest rollout the budget
allows) and every action is invalid (so credit and update see the same batch shapes as a trained
policy's, while reward-dependent work such as GraphGPO's goal distances is trivial). For the Qwen
configurations the embedding keeps Qwen's vocabulary size; sampled ids beyond SmolLM2's 49,152 tokens
decode to nothing.

    python benchmarks/gpu_check.py                                   # every stage, smollm2-135m and qwen2.5-1.5b
    python benchmarks/gpu_check.py --stages step --configs qwen2.5-7b
    python benchmarks/gpu_check.py --stages report                   # docs/gpu.md from the raw results
    python benchmarks/gpu_check.py --configs test --device cpu       # a quick run of the whole script on a CPU
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402  (the timing budget, the script runner and the results helpers)

RESULTS = REPO / "docs" / "results" / "gpu.jsonl"
REPORT = REPO / "docs" / "gpu.md"
CONFIGS = {
    # Published configurations (config.json of the hub checkpoints); the first entry is the model type.
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)),
    # For a quick run of this script on a CPU (the vocabulary of the tokenizer it borrows).
    "test": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True)),
}
STEP_SETTINGS = {"cuda": [(True, False), (True, True), (False, False)], "cpu": [(False, False)]}


def build_random_model(name: str, out: Path, tokenizer_dir: Path, device: str) -> dict:
    """Save a randomly initialised model of configuration `name` (bf16) with the tokenizer of `tokenizer_dir`."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    model_type, kwargs = CONFIGS[name]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = CONFIG_MAPPING[model_type](**{**kwargs, "vocab_size": max(kwargs["vocab_size"], len(tok))},
                                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device(device):  # initialised where it runs: seconds on a GPU even at 7B
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = dict(parameters=sum(p.numel() for p in model.parameters()), model_type=model_type,
                build_s=round(time.time() - t0, 1))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mem_gib(peak: bool = False) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) / 2**30


def check(path: Path, load_in_4bit: bool, activation_checkpointing: bool, batch: int, prompt_len: int,
          new_tokens: int, device: str) -> dict:
    from common.models import load_policy

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model, tok = load_policy(str(path), load_in_4bit=load_in_4bit, activation_checkpointing=activation_checkpointing,
                             device=device)
    sync()
    row = dict(load_in_4bit=load_in_4bit, activation_checkpointing=activation_checkpointing,
               load_s=round(time.time() - t0, 1), mem_after_load_gib=round(mem_gib(), 3))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    row["trainable_parameters"] = sum(p.numel() for p in trainable.values())
    row["only_lora_trainable"] = all("lora_" in n for n in trainable)
    dev = next(p for p in model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 300, (batch, prompt_len), generator=gen).to(dev)
    mask = torch.ones_like(ids)

    # batched sampled generation at full length (the worst case of a rollout)
    model.eval()
    with torch.no_grad():
        model.generate(input_ids=ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=4, do_sample=True,
                       top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)  # warm-up
        sync()
        t0 = time.time()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
        sync()
    dt = time.time() - t0
    row["generate_s"] = round(dt, 2)
    row["generate_tokens_per_s"] = round(batch * new_tokens / dt, 1)

    # base logits before any update (adapter B matrices start at 0, so adapter on = base)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=out[:2], attention_mask=torch.ones_like(out[:2]), logits_to_keep=new_tokens).logits.float()

    # one training step on the LoRA parameters
    model.train()
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-3)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    full = out
    am = torch.ones_like(full)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    times = []
    for _ in range(2):  # the first step includes one-off allocations; the second is reported
        sync()
        t0 = time.time()
        logits = model(input_ids=full, attention_mask=am, position_ids=pos, logits_to_keep=new_tokens + 1).logits
        logits = logits[:, :-1].float()
        target = full[:, -new_tokens:]
        logp = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        loss = -logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all().item() for p in trainable.values())
        grad_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in trainable.values())))
        opt.step()
        sync()
        times.append(time.time() - t0)
    row["train_step_s"] = round(times[-1], 2)
    row["train_peak_gib"] = round(mem_gib(peak=True), 3)
    row["lora_grads_finite"] = grads_ok
    row["lora_grad_norm"] = round(grad_norm, 4)
    row["frozen_without_grad"] = all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    model.eval()
    with torch.no_grad():
        on = model(input_ids=out[:2], attention_mask=torch.ones_like(out[:2]), logits_to_keep=new_tokens).logits.float()
        with model.disable_adapter():
            off = model(input_ids=out[:2], attention_mask=torch.ones_like(out[:2]), logits_to_keep=new_tokens).logits.float()
    row["adapter_changes_logits"] = bool((on - base).abs().max().item() > 1e-3)
    row["disable_adapter_max_abs_diff_to_base"] = float((off - base).abs().max().item())
    del model, opt
    return row


def time_generate(path: Path, load_in_4bit: bool, static: bool, batch: int, prompt_len: int, new_tokens: int,
                  device: str, repeats: int) -> tuple[dict, list]:
    """The method files' own `generate` (graphgpo's copy; the same text in all five) with the plain dynamic
    cache or `--static-cache`, sampled at temperature 1 on `batch` random prompts: the first call (where
    transformers compiles the static cache's decoding step on CUDA), the median of `repeats` later calls, and a
    5-row call (padded to 8 rows under `--static-cache`: a second compiled shape). Returns the row and the
    greedy completions of the first 8 prompts, to compare the two caches."""
    import graphgpo as g
    from common.models import load_policy

    model, tok = load_policy(str(path), load_in_4bit=load_in_4bit, device=device, static_cache=static)
    model.eval()
    prompts = torch.randint(5, 300, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    seconds, tokens, steps = [], 0, 0
    for i in range(1 + repeats):
        torch.manual_seed(i)
        sync()
        t0 = time.time()
        rows = g.generate(model, tok, prompts, 1.0, new_tokens)
        sync()
        seconds.append(time.time() - t0)
        if i:
            tokens, steps = tokens + sum(map(len, rows)), steps + max(map(len, rows))
    sync()
    t0 = time.time()
    g.generate(model, tok, prompts[:5], 1.0, new_tokens)
    sync()
    five = time.time() - t0
    greedy = g.generate(model, tok, prompts[:8], 1.0, min(new_tokens, 32), greedy=True)
    timed = sorted(seconds[1:])
    row = dict(load_in_4bit=load_in_4bit, cache="static" if static else "dynamic",
               first_call_s=round(seconds[0], 2), call_s=round(timed[len(timed) // 2], 2),
               tokens_per_s=round(tokens / sum(seconds[1:]), 1), ms_per_step=round(1000 * sum(seconds[1:]) / steps, 1),
               five_rows_s=round(five, 2))
    del model
    return row, greedy


def environment() -> dict:
    """The card and the library versions every record carries."""
    import bitsandbytes
    import peft
    import transformers

    return dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
                if torch.cuda.is_available() else None,
                torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                peft=peft.__version__, bitsandbytes=bitsandbytes.__version__)


def stage_step(config, model_dir, info, env, args):
    for q, ac in STEP_SETTINGS["cuda" if args.device == "cuda" else "cpu"]:
        print(f"[step] {config}: load_in_4bit={q} activation_checkpointing={ac} ...", flush=True)
        row = check(model_dir, q, ac, args.batch, args.prompt_len, args.new_tokens, args.device)
        real_model.append({"kind": "step", "config": config, **info, **env, "batch": args.batch,
                           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **row}, Path(args.results))
        print(json.dumps(row), flush=True)


def stage_generate(config, model_dir, info, env, args):
    for q in sorted({q for q, _ in STEP_SETTINGS["cuda" if args.device == "cuda" else "cpu"]}):
        plain = None
        for static in (False, True):
            print(f"[generate] {config}: load_in_4bit={q} static_cache={static} ...", flush=True)
            row, greedy = time_generate(model_dir, q, static, args.batch, args.prompt_len, args.new_tokens,
                                        args.device, args.repeats)
            if plain is None:
                plain = greedy
            else:
                row["greedy_rows_equal"] = f"{sum(a == b for a, b in zip(plain, greedy))}/{len(greedy)}"
            real_model.append({"kind": "generate", "config": config, **info, **env, "batch": args.batch,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **row},
                              Path(args.results))
            print(json.dumps(row), flush=True)


def stage_scripts(config, model_dir, info, env, args, deadline):
    four_bit = args.device == "cuda"
    for script in args.scripts:
        if time.time() > deadline:
            print(f"[scripts] {config}: --time-budget spent, {script} and the rest not run", flush=True)
            return
        out = Path(args.work_dir) / f"{config}_{script[:-3]}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        extra = ["--load-in-4bit", str(four_bit), *real_model.TIMING_COMMON, *real_model.TIMING_ARGS[script]]
        print(f"[scripts] {config}: {script} ...", flush=True)
        rc, wall, rss, run_dir, _ = real_model.run_script(script, extra, out, args.threads, out / "log.txt",
                                                          model=model_dir)
        rec = {"kind": "script", "config": config, **info, **env, "script": script, "four_bit": four_bit,
               "args": extra, "threads": args.threads, "wall_seconds": round(wall, 1), "peak_rss_gb": round(rss, 2)}
        metrics = (run_dir / "metrics.jsonl") if run_dir else None
        if rc != 0 or metrics is None or not metrics.is_file():
            rec.update(failed=True, exit_code=rc, log_tail=(out / "log.txt").read_text()[-1500:])
            real_model.append(rec, Path(args.results))
            print(f"{script} failed (exit {rc}):\n{rec['log_tail']}", flush=True)
            continue
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        it = [r for r in rows if "perf/update_seconds" in r][0]
        config_json = json.loads((run_dir / "config.json").read_text())
        rec.update(env_id=config_json["env_id"], micro_batch_size=config_json.get("micro_batch_size"),
                   perf={k: v for k, v in it.items() if k.startswith("perf/")},
                   eval_seconds=rows[0].get("perf/eval_seconds"), invalid_rate=it.get("charts/invalid_rate"))
        real_model.append(rec, Path(args.results))
        print(f"{script:16s} {json.dumps(real_model.phases(rec))} tokens/s "
              f"{rec['perf'].get('perf/tokens_per_second', float('nan')):.1f} GPU peak "
              f"{rec['perf'].get('perf/peak_memory_gb', float('nan')):.2f} GiB, {wall:.0f} s", flush=True)


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def cpu_iteration_seconds() -> dict:
    """The 4-bit CPU rows of docs/real_model.md (real SmolLM2 weights, same budget): script -> iteration s."""
    path = real_model.RESULTS
    if not path.is_file():
        return {}
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = real_model.latest(records, "timing", lambda r: (r["script"], r["four_bit"]))
    return {s: real_model.phases(r)["iteration"] for (s, fb), r in rows.items() if fb}


def render_report(records) -> str:
    lines = ["# The 4-bit LoRA path on a GPU", "",
             "Generated by `python benchmarks/gpu_check.py --stages report` from the raw results in "
             "[results/gpu.jsonl](results/gpu.jsonl) (one JSON object per measurement; the last of each key is "
             "shown). What each stage measures and why the weights are random: [the script's docstring]"
             "(../benchmarks/gpu_check.py).", ""]
    if not records:
        return "\n".join(lines + ["Not run on a GPU yet: `python benchmarks/gpu_check.py` on a CUDA machine.", ""])
    envs_seen = sorted({(r["device"], r["torch"], r.get("cuda"), r["transformers"], r["peft"], r["bitsandbytes"])
                        for r in records})
    for dev, tv, cu, trf, pft, bnb in envs_seen:
        lines.append(f"- Device: **{dev}**; torch {tv} (CUDA {cu}), transformers {trf}, peft {pft}, bitsandbytes {bnb}.")
    lines.append(f"- Measured {min(r['time'] for r in records)[:10]}; models randomly initialised with the "
                 "configuration of the named model and SmolLM2's tokenizer (see the docstring for what that changes).")
    lines.append("")
    steps = real_model.latest(records, "step", lambda r: (r["config"], r["load_in_4bit"], r["activation_checkpointing"]))
    if steps:
        r0 = next(iter(steps.values()))
        lines += ["## One LoRA step at real size (`--stages step`)", "",
                  f"Generation: {r0['batch']} sequences x {r0['new_tokens']} new tokens after {r0['prompt_len']}-token "
                  "prompts, sampled at temperature 1, forced to full length. Training step: the same sequences, loss "
                  "on the new tokens, one AdamW step on the LoRA (r 16, alpha 32, all linear layers; the second of "
                  "two steps is timed). Memory: PyTorch's allocated GiB after loading, and its peak during the step.",
                  "", "| model | parameters | weights | act. ckpt | load s | GiB after load | trainable | "
                  "generate tok/s | ms per decoding step | train step s | peak GiB (train) | only LoRA trainable | "
                  "LoRA grads finite | frozen without grad | disable_adapter = base (max abs diff) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (cfg, q, ac), r in steps.items():
            lines.append(
                f"| {cfg} | {r['parameters'] / 1e6:.0f}M | {'4-bit nf4' if q else 'bf16'} | {ac} | {r['load_s']} | "
                f"{r['mem_after_load_gib']} | {r['trainable_parameters'] / 1e6:.2f}M | {r['generate_tokens_per_s']} | "
                f"{1000 * r['generate_s'] / r['new_tokens']:.0f} | "
                f"{r['train_step_s']} | {r['train_peak_gib']} | {r['only_lora_trainable']} | {r['lora_grads_finite']} | "
                f"{r['frozen_without_grad']} | {r['disable_adapter_max_abs_diff_to_base']:.2e} |")
        lines.append("")
    gens = real_model.latest(records, "generate", lambda r: (r["config"], r["load_in_4bit"], r["cache"]))
    lines += ["## Fast generation (`--stages generate`)", ""]
    if not gens:
        lines += ["Not measured yet: `--static-cache` is built and tested on a CPU (tests/test_shared_blocks.py: the "
                  "same tokens as the dynamic cache, any batch size), where transformers does not compile it. "
                  "`python benchmarks/gpu_check.py --stages generate report` on a CUDA machine fills this table.", ""]
    else:
        r0 = next(iter(gens.values()))
        lines += [f"The method files' `generate` (sampled, temperature 1) on {r0['batch']} random prompts of "
                  f"{r0['prompt_len']} tokens, up to {r0['new_tokens']} new tokens: the plain dynamic KV cache and "
                  "`--static-cache` (a static cache, whose decoding step transformers compiles on CUDA; the batch "
                  "padded to a power of two). First call: includes compilation; per call: the median of the later "
                  "calls; 5 rows: one call on 5 prompts (8 rows compiled once more under the static cache); greedy "
                  "rows equal: of 8 greedy completions, how many are the dynamic cache's tokens.", "",
                  "| model | weights | cache | first call s | s per call | tokens/s | ms per decoding step | "
                  "speed-up | 5 rows s | greedy rows equal |", "|---|---|---|---|---|---|---|---|---|---|"]
        for (cfg, q, cache), r in gens.items():
            base = gens.get((cfg, q, "dynamic"))
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
            lines.append(f"| {cfg} | {'4-bit nf4' if q else 'bf16'} | {cache} | {r['first_call_s']} | {r['call_s']} | "
                         f"{r['tokens_per_s']} | {r['ms_per_step']} | {speed} | {r['five_rows_s']} | "
                         f"{r.get('greedy_rows_equal', '–')} |")
        lines.append("")
    scripts = real_model.latest(records, "script", lambda r: (r["config"], r["script"]))
    if scripts:
        cpu = cpu_iteration_seconds()
        r0 = next(iter(scripts.values()))
        lines += ["## One iteration of each script, 4-bit (`--stages scripts`)", "",
                  f"Each script on its default env with the budget of `benchmarks/real_model.py timing` "
                  f"(`{' '.join(real_model.TIMING_COMMON)}` and its `TIMING_ARGS`), {r0['threads']} torch threads, "
                  "4-bit nf4 with bf16 compute (the CUDA default). Seconds per phase as in docs/real_model.md "
                  "(update includes the old-policy log-probs; credit includes iStar's PRM and ARIA's embeddings); "
                  "tokens/s: generated tokens per rollout second; GPU peak: PyTorch's peak allocated memory in the "
                  "run; wall: the whole process (imports, loading, one iteration, evaluations). CPU 4-bit: the same "
                  "budget on 2 CPU cores with the real SmolLM2 weights (docs/real_model.md), for scale only (its "
                  "completions stop at the model's end of sequence, these run to the limit).", "",
                  "| model | script | env | rollout s | credit s | update s | iteration s | tokens/s | GPU peak GiB "
                  "| eval s | wall s | CPU 4-bit iteration s (SmolLM2) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (cfg, script), r in scripts.items():
            if r.get("failed"):
                first = r["log_tail"].strip().splitlines()[-1] if r["log_tail"].strip() else "no output"
                lines.append(f"| {cfg} | {script} | failed (exit {r['exit_code']}): {first[:160]} ||||||||||")
                continue
            ph = real_model.phases(r)
            p = r["perf"]
            lines.append(f"| {cfg} | {script} | {r['env_id']} | {ph['rollout']} | {ph['credit']} | {ph['update']} | "
                         f"{ph['iteration']} | {p.get('perf/tokens_per_second', float('nan')):.1f} | "
                         f"{p.get('perf/peak_memory_gb', float('nan')):.2f} | {(r.get('eval_seconds') or 0):.1f} | "
                         f"{r['wall_seconds']:.0f} | {cpu.get(script, '–')} |")
        lines += ["", "In the four scripts that parse actions, every action of a random model is invalid (invalid "
                  "rate 1.0 in each row), so every trajectory fails: ARIA's REINFORCE weights are all 0 and it "
                  "back-propagates nothing (update 0 s, as in its zero-shot CPU row), and the credit kernels see "
                  "ties everywhere. In EPO's Negotiation the frozen agent's text is an utterance, never invalid. "
                  "Rollout seconds are the longest the budget allows (completions run to the token limit)."]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", nargs="+", default=["step", "generate", "scripts", "report"],
                    choices=["step", "generate", "scripts", "report"])
    ap.add_argument("--configs", nargs="+", default=["smollm2-135m", "qwen2.5-1.5b"], choices=sorted(CONFIGS))
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with SmolLM2's tokenizer (default: the packaged smollm2-135m, fetched once)")
    ap.add_argument("--scripts", nargs="+", default=None, help="default: all five")
    ap.add_argument("--batch", type=int, default=32, help="step: sequences per generate call and per training step")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="generate: timed calls after the first")
    ap.add_argument("--threads", type=int, default=4, help="scripts: torch threads of each subprocess")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds after which no new model or script is started (0: no limit)")
    ap.add_argument("--work-dir", default="runs/gpu_check", help="the scripts' run directories")
    ap.add_argument("--results", default=str(RESULTS), help="raw results, JSON lines (appended)")
    ap.add_argument("--report-path", default=str(REPORT))
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    args.scripts = args.scripts or list(real_model.SCRIPTS)
    unknown = sorted(set(args.scripts) - set(real_model.SCRIPTS))
    if unknown:
        raise SystemExit(f"--scripts: unknown {unknown}; choose from {list(real_model.SCRIPTS)}")
    deadline = time.time() + args.time_budget if args.time_budget > 0 else float("inf")
    if {"step", "generate", "scripts"} & set(args.stages):
        if args.tokenizer is None:
            from common.models import ensure_packaged_model

            args.tokenizer = str(ensure_packaged_model("smollm2-135m"))
        env = environment()
        print(json.dumps(env), flush=True)
        for config in args.configs:
            if time.time() > deadline:
                print(f"--time-budget spent: {config} not run", flush=True)
                break
            with tempfile.TemporaryDirectory() as tmp:
                info = build_random_model(config, Path(tmp), Path(args.tokenizer), args.device)
                print(f"{config}: {info}", flush=True)
                if "step" in args.stages:
                    stage_step(config, Path(tmp), info, env, args)
                if "generate" in args.stages:
                    stage_generate(config, Path(tmp), info, env, args)
                if "scripts" in args.stages:
                    stage_scripts(config, Path(tmp), info, env, args, deadline)
    if "report" in args.stages:
        path = Path(args.results)
        records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
        Path(args.report_path).write_text(render_report(records))
        print(f"wrote {args.report_path} from {len(records)} records")


if __name__ == "__main__":
    main()
