"""GPU check of the model path every method uses (common/models.py): 4-bit nf4 + LoRA on CUDA at real size.

No weights can be downloaded on the machines this project is developed on, so the model is a randomly
initialised causal LM with the configuration of a real one (Qwen2.5-0.5B by default: 24 layers,
hidden 896, 14 heads / 2 KV heads, FFN 4864, vocabulary 151,936, about 494M parameters). Random
weights do not change memory or speed: only the shapes do. Generation is forced to its full length
(`min_new_tokens`), the worst case of a rollout.

For each setting it measures: load time, GPU memory after loading, trainable parameters, a batched
sampled `generate` (tokens per second), one training step on the LoRA (forward with `logits_to_keep`,
backward, AdamW step: time and peak memory), and checks that only LoRA parameters get gradients, that
they are finite and nonzero, and that `disable_adapter()` gives the base model's logits after training.

    python benchmarks/gpu_check.py                      # writes docs/gpu_check.md
    python benchmarks/gpu_check.py --config qwen2.5-1.5b --out docs/gpu_check_1.5b.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = {
    # Published configurations (config.json of the hub checkpoints).
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # For a quick run of this script on a CPU.
    "test": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
}


def build_random_model(name: str, out: Path) -> dict:
    """Save a randomly initialised Qwen2 model of configuration `name` with a small chat tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common import tiny

    texts = [f"<|im_start|>user\nmove {i} up down left right<|im_end|>\n" for i in range(200)]
    tok = tiny.train_tokenizer(texts, vocab_size=300, min_frequency=1)
    cfg = Qwen2Config(**CONFIGS[name], max_position_embeddings=4096, bos_token_id=None,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return dict(parameters=sum(p.numel() for p in model.parameters()))


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="qwen2.5-0.5b", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=32, help="sequences per generate call and per training step")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--out", default=str(REPO / "docs" / "gpu_check.md"))
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = [(True, False), (True, True), (False, False)] if device == "cuda" else [(False, False)]
    with tempfile.TemporaryDirectory() as tmp:
        info = build_random_model(args.config, Path(tmp))
        rows = []
        for q, ac in settings:
            print(f"load_in_4bit={q} activation_checkpointing={ac} ...", flush=True)
            rows.append(check(Path(tmp), q, ac, args.batch, args.prompt_len, args.new_tokens, device))
            print(json.dumps(rows[-1]), flush=True)
    import bitsandbytes
    import peft
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    lines = [
        f"# GPU check: {args.config} (random weights), 4-bit LoRA path of common/models.py", "",
        f"Command: `python benchmarks/gpu_check.py --config {args.config} --batch {args.batch} "
        f"--prompt-len {args.prompt_len} --new-tokens {args.new_tokens}`", "",
        f"Device: {gpu}; torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
        f"bitsandbytes {bitsandbytes.__version__}; measured {time.strftime('%Y-%m-%d', time.gmtime())}. "
        f"Model: {info['parameters'] / 1e6:.0f}M parameters, LoRA r16 alpha 32 on all linear layers. "
        f"Generation: {args.batch} sequences x {args.new_tokens} new tokens after {args.prompt_len}-token prompts, "
        f"sampled (temperature 1, top_k 0). Training step: the same {args.batch} sequences, loss on the last "
        f"{args.new_tokens} tokens, one AdamW step (the second of two steps is timed).", "",
        "| 4-bit | act. ckpt | load s | GiB after load | trainable | generate tok/s | train step s | peak GiB (train) "
        "| only LoRA trainable | LoRA grads finite | frozen without grad | adapter changes logits | disable_adapter = base (max abs diff) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['load_in_4bit']} | {r['activation_checkpointing']} | {r['load_s']} | {r['mem_after_load_gib']} "
            f"| {r['trainable_parameters'] / 1e6:.2f}M | {r['generate_tokens_per_s']} | {r['train_step_s']} "
            f"| {r['train_peak_gib']} | {r['only_lora_trainable']} | {r['lora_grads_finite']} | {r['frozen_without_grad']} "
            f"| {r['adapter_changes_logits']} | {r['disable_adapter_max_abs_diff_to_base']:.2e} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
