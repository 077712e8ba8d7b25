"""Why RL does not raise the tiny Sokoban policy's success: the experiments behind docs/learning.md.

Every experiment uses graphgpo.py's own rollout, credit and update functions (imported, not copied),
on a tiny Sokoban checkpoint, and appends one JSON line per run to <out>/results.jsonl:

    python benchmarks/learning_diag.py snr   --model DIR            # gradient signal of one big batch
    python benchmarks/learning_diag.py train --model DIR --mode grpo  --lr 5e-4 --iters 40
    python benchmarks/learning_diag.py train --model DIR --mode oracle --lr 5e-4 --iters 40
    python benchmarks/learning_diag.py sft   --model DIR --data dagger --lr 1e-4 --steps 80
    python benchmarks/learning_diag.py evalnoise --evals 4           # the SE of a change, paired or not
    python benchmarks/learning_diag.py report                       # docs/learning_diag.md from results.jsonl

- `snr`: 64 train levels x 8 sampled episodes; the per-group policy-gradient vectors (ratio 1, the
  script's token-mean weighting) of GRPO, GraphGPO and positive-only advantages. Reports the unbiased
  estimate of |E g|^2 / E|g - E g|^2 per group (the signal-to-noise ratio of one group; a batch of B
  groups has B times it), the median cosine between the summed gradients of random halves of the
  groups, and the cosine of the mean gradient with the imitation gradient (log-likelihood of the
  expert's move at the same visited states).
- `train`: `--mode grpo|graph` trains with the script's credit and `update`; `--mode oracle` feeds the
  same `update` with the expert's move at every visited solvable state and advantage +1 (perfect
  supervision on the policy's own states, DAgger-style). Sampled success (T=1) on all 200 test levels
  x 2 episodes (fixed sampling seed) every `--eval-every` iterations.
- `sft`: continued supervised training, all weights, with the tiny builder's own loss and optimizer
  settings, either on fresh demonstrations of the build's kind (`--data demos`) or on the policy's
  own visited solvable states labelled by the expert (`--data dagger`).
- `evalnoise`: `--evals` sampled evaluations (T=1, one episode per level, torch seeds 100, 101, ...) of
  one unchanged policy on all 200 test levels. Each consecutive pair is a change whose true value is 0;
  for it, the standard error of two independent evaluations (their SEs in quadrature, what the scripts
  reported before their evaluations drew common random numbers) and the SE of the per-level
  differences (the evaluations paired by level). Their ratio says how much of the noise
  of a change is the levels' own difficulty, which pairing by level would remove.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import envs  # noqa: E402
import graphgpo as G  # noqa: E402
from common import tiny  # noqa: E402
from common.models import load_policy, policy_defaults  # noqa: E402

OUT = REPO / "runs" / "learning_diag"


def label(model_dir):
    """'tiny, N SFT steps[, smoothing ε]' from the checkpoint's recipe."""
    recipe = tiny.read_meta(model_dir)["recipe"]
    smooth = recipe.get("action_smoothing", 0.0)
    return f"tiny, {recipe['steps']} SFT steps" + (f", smoothing {smooth:g}" if smooth else "")


def setup(model_dir, seed, full=False):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model, tok = load_policy(model_dir, env_id="sokoban")
    if full:  # train every weight, not only the LoRA adapter
        for p in model.parameters():
            p.requires_grad_(True)
    kw = dict(policy_defaults(model_dir, "sokoban", learning_rate=5e-4, max_new_tokens=4).env_kwargs)

    def make():
        return envs.make("sokoban", **kw)

    return model, tok, make


def rollout_labelled(model, tok, make, tasks, group):
    """graphgpo.rollout, then a replay of every episode that records the expert's move and whether the
    state was still solvable before each step."""
    eps = G.rollout(model, tok, make, [t for t in tasks for _ in range(group)],
                    [g for g in range(len(tasks)) for _ in range(group)], 1.0, 4)
    for ep in eps:
        env = make()
        env.reset(ep.task_id)
        ep.expert, ep.solvable = [], []
        for a in ep.actions:
            ep.expert.append(env.expert_action())
            ep.solvable.append(env.solution_length() is not None)
            env.step(a)
    return eps


def success(model, tok, make, test):
    torch.manual_seed(123)
    eps = G.rollout(model, tok, make, test + test, [0] * (2 * len(test)), 1.0, 4)
    return float(np.mean([e.success for e in eps]))


def flat_grad(model, tok, samples, ntok):
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    model.train()
    for s in range(0, len(samples), 128):
        ch = samples[s:s + 128]
        lp, m = G.completion_logprobs(model, tok, [x["prompt"] for x in ch], [x["completion"] for x in ch])
        w = torch.tensor([x["w"] for x in ch], dtype=torch.float32).unsqueeze(1)
        (-(lp * m * w).sum() / ntok).backward()
    g = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in params])
    model.zero_grad(set_to_none=True)
    model.eval()
    return g


def cos(a, b):
    return float(torch.dot(a, b) / (a.norm() * b.norm() + 1e-12))


def cmd_snr(a):
    model, tok, make = setup(a.model, a.seed)
    train = make().task_ids("train")
    rng = np.random.default_rng(a.seed)
    tasks = [train[i] for i in rng.choice(len(train), size=a.tasks, replace=False)]
    eps = rollout_labelled(model, tok, make, tasks, 8)
    imit = [{"prompt": e.prompts[t], "completion": G.encode(tok, e.expert[t]) + [tok.eos_token_id], "w": 1.0}
            for e in eps for t in range(e.length)]
    g_imit = flat_grad(model, tok, imit, sum(len(x["completion"]) for x in imit))
    out = {"exp": "snr", "model": label(a.model), "episodes": len(eps),
           "success": float(np.mean([e.success for e in eps])), "schemes": {}}
    for mode in ("none", "graph"):
        samples, _ = G.compute_advantages(eps, G.Args(step_advantage=mode, omega=0.8))
        for scheme in ("token", "positive"):
            name = f"{'GRPO' if mode == 'none' else 'GraphGPO'}{'' if scheme == 'token' else ', A > 0 only'}"
            ss = [{"prompt": s.prompt, "completion": s.completion, "group": s.group,
                   "w": s.adv if scheme == "token" else max(s.adv, 0.0)} for s in samples]
            ntok = sum(len(s["completion"]) for s in ss)
            groups = sorted({s["group"] for s in ss})
            gs = torch.stack([flat_grad(model, tok, [s for s in ss if s["group"] == g], ntok) for g in groups])
            n = len(groups)
            sig2 = (gs.sum(0).norm() ** 2 - (gs.norm(dim=1) ** 2).sum()) / (n * (n - 1))
            var = (gs.norm(dim=1) ** 2).mean() - sig2
            r = np.random.default_rng(1)
            halves = []
            for _ in range(50):
                p = r.permutation(n)
                halves.append(cos(gs[p[: n // 2]].sum(0), gs[p[n // 2:]].sum(0)))
            out["schemes"][name] = {"snr_per_group": float(sig2 / var), "half_cos_median": float(np.median(halves)),
                                    "cos_mean_imitation": cos(gs.sum(0), g_imit)}
            print(name, out["schemes"][name], flush=True)
    half = len(imit) // 2
    out["imitation_half_cos"] = cos(flat_grad(model, tok, imit[:half], 1), flat_grad(model, tok, imit[half:], 1))
    return out


def cmd_train(a):
    model, tok, make = setup(a.model, a.seed, full=a.full)
    probe = make()
    train, test = probe.task_ids("train"), probe.task_ids("test")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.SGD(params, lr=a.lr, momentum=0.9) if a.optimizer == "sgd"
           else torch.optim.AdamW(params, lr=a.lr))
    args = G.run_size(G.Args(step_advantage="graph" if a.mode == "graph" else "none", learning_rate=a.lr,
                             num_minibatches=a.minibatches, kl_coef=0.0 if a.mode == "oracle" else 0.01,
                             omega=0.8))
    rng = np.random.default_rng(a.seed)
    curve = [{"iteration": 0, "success": success(model, tok, make, test)}]
    print(curve[-1], flush=True)
    t0 = time.time()
    for it in range(1, a.iters + 1):
        tasks = [train[i] for i in rng.choice(len(train), size=a.tasks, replace=False)]
        if a.mode == "oracle":
            eps = rollout_labelled(model, tok, make, tasks, a.group)
            samples = [G.Sample(e.prompts[t], G.encode(tok, e.expert[t]) + [tok.eos_token_id],
                                e.group_id, e.traj_id, t, 1.0)
                       for e in eps for t in range(e.length) if e.solvable[t]]
        else:
            eps = G.rollout(model, tok, make, [t for t in tasks for _ in range(a.group)],
                            [g for g in range(a.tasks) for _ in range(a.group)], 1.0, 4)
            samples, _ = G.compute_advantages(eps, args)
        G.update(model, tok, opt, samples, args, rng)
        if it % a.eval_every == 0:
            curve.append({"iteration": it, "success": success(model, tok, make, test), "seconds": time.time() - t0})
            print(curve[-1], flush=True)
    return {"exp": "train", "model": label(a.model), "mode": a.mode, "lr": a.lr, "tasks": a.tasks,
            "group": a.group, "minibatches": a.minibatches, "optimizer": a.optimizer, "full": a.full,
            "seed": a.seed, "curve": curve}


def cmd_sft(a):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_pretrained(a.model)
    tok = AutoTokenizer.from_pretrained(a.model)
    recipe = tiny.read_meta(a.model)["recipe"]
    kw = dict(policy_defaults(a.model, "sokoban", learning_rate=5e-4, max_new_tokens=4).env_kwargs)

    def make():
        return envs.make("sokoban", **kw)

    test = make().task_ids("test")
    if a.data == "demos":  # fresh demonstrations of the build's kind (another seed)
        demos, _ = tiny.collect_demos("sokoban", dict(recipe, seed=a.seed + 100, demo_episodes=300), progress=False)
        ex = [(G.encode(tok, tiny.render_prompt(tok, m)), G.encode(tok, act) + [tok.eos_token_id]) for m, act in demos]
    else:  # the policy's own states on 300 train levels, the expert's move as the label
        torch.manual_seed(a.seed)
        eps = rollout_labelled(model, tok, make, make().task_ids("train")[:300], 1)
        ex = [(e.prompts[t], G.encode(tok, e.expert[t]) + [tok.eos_token_id])
              for e in eps for t in range(e.length) if e.solvable[t]]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=recipe["weight_decay"])
    rng = random.Random(a.seed)
    curve = [{"step": 0, "success": success(model, tok, make, test)}]
    print(len(ex), "examples", curve[-1], flush=True)
    for s in range(1, a.steps + 1):
        model.train()
        loss = tiny.completion_loss(model, rng.sample(ex, min(a.batch_size, len(ex))), tok.pad_token_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe["grad_clip"])
        opt.step()
        if s % a.eval_every == 0:
            curve.append({"step": s, "loss": float(loss), "success": success(model, tok, make, test)})
            print(curve[-1], flush=True)
    return {"exp": "sft", "model": label(a.model), "data": a.data, "lr": a.lr, "examples": len(ex),
            "seed": a.seed, "curve": curve}


def change_ses(before, after):
    """SEs of mean(after) - mean(before) for two evaluations of the same tasks (one 0/1 outcome per
    task each): (quadrature of the two evaluations' SEs, SE of the per-task differences)."""
    a, b = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    n = len(a)
    quadrature = math.sqrt(a.var(ddof=1) / n + b.var(ddof=1) / n)
    return quadrature, float((b - a).std(ddof=1) / math.sqrt(n))


def cmd_evalnoise(a):
    model, tok, make = setup(a.model, a.seed)
    test = list(make().task_ids("test"))
    outcomes = []
    for i in range(a.evals):
        torch.manual_seed(100 + i)
        eps = G.rollout(model, tok, make, test, [0] * len(test), 1.0, 4)
        outcomes.append([float(e.success) for e in eps])
        print(f"evaluation {i}: success {np.mean(outcomes[-1]):.3f}", flush=True)
    pairs = []
    for before, after in zip(outcomes[:-1], outcomes[1:]):
        quadrature, paired = change_ses(before, after)
        pairs.append({"change": float(np.mean(after) - np.mean(before)), "se_quadrature": quadrature,
                      "se_paired": paired})
        print(f"change {pairs[-1]['change']:+.3f}: SE {quadrature:.4f} in quadrature, {paired:.4f} paired by "
              f"level ({paired / quadrature:.2f} of it)")
    rate = np.mean(outcomes, axis=0)
    return {"exp": "evalnoise", "model": label(a.model), "levels": len(test), "evals": a.evals,
            "success": [float(np.mean(o)) for o in outcomes], "pairs": pairs,
            "levels_never_solved": float(np.mean(rate == 0)), "levels_always_solved": float(np.mean(rate == 1))}


def cmd_report(a):
    rows = [json.loads(x) for x in (Path(a.out) / "results.jsonl").read_text().splitlines() if x.strip()]
    lines = ["Written by `python benchmarks/learning_diag.py report` from runs/learning_diag/results.jsonl; "
             "the commands are in docs/learning.md. Success: sampled (T=1) on the 200 test levels x 2 episodes "
             "(standard error about 0.023 near 0.7, 0.018 near 0.2).", ""]
    snr = [r for r in rows if r["exp"] == "snr"]
    if snr:
        lines += ["## Gradient signal of one batch (64 levels x 8 episodes)", "",
                  "| policy | success of the batch | advantages | SNR per group | median cos of halves | cos(mean, imitation) |",
                  "|---|---|---|---|---|---|"]
        for r in snr:
            for name, v in r["schemes"].items():
                lines.append(f"| {r['model']} | {r['success']:.3f} | {name} | {v['snr_per_group']:+.4f} | "
                             f"{v['half_cos_median']:+.3f} | {v['cos_mean_imitation']:+.3f} |")
            lines.append(f"| {r['model']} | | imitation (expert move at the same states), halves | | "
                         f"{r['imitation_half_cos']:+.3f} | |")
        lines.append("")
    for exp, title, key in (("train", "Training with graphgpo.py's update", "iteration"),
                            ("sft", "Continued supervised training (all weights, the builder's loss)", "step")):
        sel = [r for r in rows if r["exp"] == exp]
        if not sel:
            continue
        lines += [f"## {title}", "", "| policy | run | success at " + key + " 0, ... |", "|---|---|---|"]
        for r in sel:
            if exp == "train":
                desc = (f"{r['mode']}, lr {r['lr']:g}, {r['tasks']} x {r['group']}, {r['minibatches']} minibatches, "
                        f"{r['optimizer']}{', all weights' if r['full'] else ', LoRA'}, seed {r['seed']}")
            else:
                desc = f"{r['data']} ({r['examples']} examples), lr {r['lr']:g}, seed {r['seed']}"
            pts = ", ".join(f"{c[key]}: {c['success']:.3f}" for c in r["curve"])
            lines.append(f"| {r['model']} | {desc} | {pts} |")
        lines.append("")
    Path(a.doc).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.doc}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["snr", "train", "sft", "evalnoise", "report"])
    p.add_argument("--model", default=None, help="tiny Sokoban checkpoint directory (default: the default build)")
    p.add_argument("--sft-steps", type=int, default=None, help="build (or find) the default recipe with this many SFT steps")
    p.add_argument("--smoothing", type=float, default=None, help="... and this action_smoothing (0: none)")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--doc", default=str(REPO / "docs" / "learning_diag.md"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--mode", choices=["grpo", "graph", "oracle"], default="grpo")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--tasks", type=int, default=None)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--full", action="store_true", help="train every weight instead of the LoRA adapter")
    p.add_argument("--data", choices=["demos", "dagger"], default="dagger")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--evals", type=int, default=4, help="evalnoise: evaluations of the unchanged policy")
    a = p.parse_args()
    if a.cmd == "report":
        return cmd_report(a)
    torch.set_num_threads(a.threads)
    overrides = {k: v for k, v in (("steps", a.sft_steps), ("action_smoothing", a.smoothing)) if v is not None} or None
    a.model = a.model or str(tiny.ensure_tiny("sokoban", overrides=overrides))
    a.tasks = a.tasks or (64 if a.cmd == "snr" else 4)
    res = {"snr": cmd_snr, "train": cmd_train, "sft": cmd_sft, "evalnoise": cmd_evalnoise}[a.cmd](a)
    res["command"] = " ".join(sys.argv[1:])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with open(Path(a.out) / "results.jsonl", "a") as fh:
        fh.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
