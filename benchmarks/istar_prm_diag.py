"""Does iStar's implicit PRM learn, and with which settings? Several PRM settings trained side by side on one
stream of rollouts, so that they are compared on the same pairs (docs/istar.md, "PRM settings on the tiny policy").

    python benchmarks/istar_prm_diag.py run --seed 1 --configs lr=1e-3 lr=4e-3 lr=1e-3,k=4
    python benchmarks/istar_prm_diag.py report          # table from runs/istar_prm_diag/results.jsonl

The policy is trained exactly as `istar.py --alpha 0` trains it (RLOO, the default budget: 40 iterations of
4 tasks x 8 trajectories), so the stream does not depend on the PRM settings. Each setting is its own PRM
(the "prm" adapter's weights are swapped in and out, each setting has its own AdamW) trained with
`istar.prm_update` on every iteration's pairs, with π_θold = the policy that sampled them, as in istar.py.
Per setting and iteration it records the held-out pair accuracy (the new pairs scored before the PRM trains
on them), the DPO loss and margin, and how well the step rewards tell optimal moves from the others (AUC over
the iteration's steps: the probability that a step whose move lowered the solver's distance to the goal by one
has a higher implicit reward than one whose move did not; 0.5 = no step credit). One torch thread.
A setting is `key=value` pairs joined by commas: lr (PRM learning rate), k (--prm-updates-per-iteration),
beta, reduce (mean/sum), replay (--prm-replay); a key left out takes the official code's value (lr 2x the policy
lr, k 1, replay 0), not istar.py's tiny-policy default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import istar_prm_stats  # noqa: E402  (pair_counts, pooled_pair_accuracy)
OUT = REPO / "runs" / "istar_prm_diag"
KEYS = {"lr": ("prm_learning_rate", float), "k": ("prm_updates_per_iteration", int), "beta": ("beta", float),
        "reduce": ("dpo_reduce", str), "replay": ("prm_replay", int)}


def parse_config(text):
    out = {}
    for part in text.split(","):
        k, v = part.split("=")
        name, typ = KEYS[k]
        out[name] = typ(v)
    return out


def auc(pos, neg):
    """P(a random value of `pos` > one of `neg`), ties count 1/2 (Mann-Whitney); nan if a side is empty."""
    pos, neg = np.asarray(pos, dtype=np.float64), np.asarray(neg, dtype=np.float64)
    if not len(pos) or not len(neg):
        return float("nan")
    return float(((pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum())
                 / (len(pos) * len(neg)))


def optimal_moves(episodes, new_env):
    """Per step of every episode (in sample order): was the move optimal, i.e. did it lower the solver's
    distance to the goal by one (any of several optimal moves counts; a move from or into an unsolvable
    state is not optimal)?"""
    out = []
    for ep in episodes:
        env = new_env()
        env.reset(ep.task_id)
        for a in ep.actions:
            before = env.solution_length()
            env.step(a)
            after = env.solution_length()
            out.append(before is not None and after is not None and after == before - 1)
    return np.array(out, dtype=bool)


def cmd_run(a):
    import istar
    from common.models import add_adapter, load_policy

    torch.set_num_threads(a.threads)
    base = istar.run_size(istar.Args(seed=a.seed, alpha=0.0, torch_threads=a.threads))
    rng = istar.seed_everything(a.seed)
    new_env, probe, defaults, _ = istar.make_env(base)
    train_tasks = list(probe.task_ids("train"))
    model, tok = load_policy(base.model_name, env_id=base.env_id, lora_r=base.lora_r, lora_alpha=base.lora_alpha)
    add_adapter(model, "prm", lora_r=base.lora_r, lora_alpha=base.lora_alpha, lora_dropout=0.0)
    model.set_adapter("default")
    lr = defaults.learning_rate
    optimizer = torch.optim.AdamW(istar.adapter_params(model, "default"), lr=lr)
    prm_params = istar.adapter_params(model, "prm")
    init = [p.detach().clone() for p in prm_params]
    configs = []
    for text in a.configs:
        c = parse_config(text)
        official = {"prm_learning_rate": 2 * lr, "prm_updates_per_iteration": 1, "prm_replay": 0}
        args = dataclasses.replace(base, alpha=1.0, **{**official, **c})
        configs.append({"name": text, "args": args, "weights": [w.clone() for w in init],
                        "opt": torch.optim.AdamW(prm_params, lr=args.prm_learning_rate),
                        "replay": deque(maxlen=args.prm_replay), "cpu": 0.0})
    a.out.mkdir(parents=True, exist_ok=True)
    log = open(a.out / "results.jsonl", "a")
    run_id = f"seed{a.seed}-{int(time.time())}"
    for it in range(1, a.iters + 1):
        chosen = rng.choice(len(train_tasks), size=base.tasks_per_iteration, replace=False)
        tasks = [train_tasks[i] for i in chosen for _ in range(base.group_size)]
        groups = [g for g in range(len(chosen)) for _ in range(base.group_size)]
        episodes = istar.rollout(model, tok, new_env, tasks, groups, base.temperature, 4)
        turns = istar.old_logprob_turns(model, tok, episodes, base)  # one per turn, with π_θold's log-probs
        _, succ, grp = istar.trajectory_outcomes(episodes, base.invalid_penalty)
        optimal = optimal_moves(episodes, new_env)
        row = {"run": run_id, "seed": a.seed, "iteration": it, "success": float(succ.float().mean()), "configs": {}}
        for c in configs:
            t0 = time.process_time()
            with torch.no_grad():
                for p, w in zip(prm_params, c["weights"]):
                    p.copy_(w)
            _, step_r, st, mine = istar.prm_update(model, tok, c["opt"], turns, succ, grp, c["args"], c["replay"])
            held = istar_prm_stats.pair_counts(step_r, [x.traj for x in turns], succ, grp, c["args"].dpo_reduce)
            c["replay"].appendleft(mine)
            with torch.no_grad():
                c["weights"] = [p.detach().clone() for p in prm_params]
            c["cpu"] += time.process_time() - t0
            r = step_r.double().numpy()
            row["configs"][c["name"]] = {
                **st, "heldout_pair_acc": held["acc"], "heldout_margin": held["margin"],
                "heldout_correct": held["correct"].tolist(), "heldout_group_pairs": held["pairs"].tolist(),
                "optimal_auc": auc(r[optimal], r[~optimal]), "optimal_frac": float(optimal.mean()),
                "step_reward_abs_mean": float(np.abs(r).mean()), "prm_cpu_seconds": c["cpu"]}
        samples, _ = istar.compute_advantages(episodes, base)  # RLOO (no PRM signal)
        for x, turn in zip(samples, turns):
            x.old = turn.old
        istar.update(model, tok, optimizer, samples, base, rng)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"it {it}: success {row['success']:.2f} | " + " | ".join(
            f"{n}: acc {v.get('heldout_pair_acc', float('nan')):.2f} auc {v['optimal_auc']:.2f}"
            for n, v in row["configs"].items()), flush=True)


def cmd_report(a):
    rows = [json.loads(x) for x in (a.out / "results.jsonl").read_text().splitlines() if x.strip()]
    runs = sorted({r["run"] for r in rows})
    lines = ["PRM settings trained side by side on one RLOO stream (`benchmarks/istar_prm_diag.py`); per run "
             "(seed) and setting: held-out pair accuracy pooled over the pairs of iterations 1-10 and 31-40 "
             "(± SE, task group as the unit), optimal-move AUC of the step rewards (mean over the iterations of "
             "each quarter), DPO loss before the update (mean over iterations 31-40), PRM CPU seconds per "
             "iteration.", "",
             "| run | setting | pair acc it 1-10 | pair acc it 31-40 | optimal AUC it 1-10 | optimal AUC it 31-40 "
             "| DPO loss it 31-40 | PRM CPU s / it |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        rr = [r for r in rows if r["run"] == run]
        n = max(r["iteration"] for r in rr)
        q = max(1, n // 4)
        for name in rr[0]["configs"]:
            cells = []
            for lo, hi in ((1, q), (n - q + 1, n)):
                sel = [r["configs"][name] for r in rr if lo <= r["iteration"] <= hi]
                acc, se = istar_prm_stats.pooled_pair_accuracy(sum((s["heldout_correct"] for s in sel), []),
                                                     sum((s["heldout_group_pairs"] for s in sel), []))
                cells.append(f"{acc:.3f} ± {se:.3f}")
            for lo, hi in ((1, q), (n - q + 1, n)):
                v = [r["configs"][name]["optimal_auc"] for r in rr if lo <= r["iteration"] <= hi]
                cells.append(f"{np.nanmean(v):.3f}")
            late = [r["configs"][name].get("loss") for r in rr if r["iteration"] > n - q]
            late = [x for x in late if x is not None and np.isfinite(x)]
            cells.append(f"{np.mean(late):.4f}" if late else "-")
            cpu = max(r["configs"][name]["prm_cpu_seconds"] for r in rr) / n
            cells.append(f"{cpu:.2f}")
            lines.append(f"| {run} | `{name}` | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    Path(a.doc).write_text(text)
    print(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("cmd", choices=["run", "report"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", nargs="+", default=["lr=1e-3"])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--doc", default=str(REPO / "docs" / "istar_prm_diag.md"))
    a = p.parse_args()
    {"run": cmd_run, "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    main()
