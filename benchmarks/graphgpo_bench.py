"""GraphGPO vs GiGPO vs GRPO on the tiny Sokoban policy: same seeds, budget and evaluation; writes a
markdown table and a learning-curve plot to docs/.

    python benchmarks/graphgpo_bench.py                                  # 3 seeds x {graph, gigpo, none}
    python benchmarks/graphgpo_bench.py --num-iterations 60 --tasks-per-iteration 8 --parallel 2
    python benchmarks/graphgpo_bench.py --credit-quality               # model-free credit-quality table
    python benchmarks/graphgpo_bench.py --report-only                    # rebuild table and plot from the runs
    python benchmarks/graphgpo_bench.py --env-id alfworld                # once envs/alfworld.py exists

Every run is `graphgpo.py` as a subprocess with one torch thread, through benchmarks/graphgpo_graphs.py,
which adds the graph statistics of the credit table to its metrics; the three variants differ only in
`--step-advantage`. Output: docs/graphgpo_bench_<env>.md and docs/graphgpo_bench_<env>.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NAMES = {"graph": "GraphGPO", "gigpo": "GiGPO", "none": "GRPO"}
COLORS = {"graph": "tab:red", "gigpo": "tab:green", "none": "tab:blue"}
METRICS = [("success", "success (T=1)"), ("success_val_temp", "success (T=0.4)"),
           ("success_greedy", "success (greedy)"), ("episode_length", "steps"), ("invalid_rate", "invalid")]


def run_one(mode, seed, args, out_dir):
    cmd = [sys.executable, str(REPO / "benchmarks" / "graphgpo_graphs.py"), "--env-id", args.env_id,
           "--step-advantage", mode, "--seed", str(seed), "--exp-name", f"bench_{mode}", "--output-dir", str(out_dir),
           "--torch-threads", "1", "--num-iterations", str(args.num_iterations), "--eval-every", str(args.eval_every),
           "--eval-num-tasks", str(args.eval_num_tasks), "--eval-k", str(args.eval_k), "--checkpoint-every", "0",
           "--tasks-per-iteration", str(args.tasks_per_iteration), *args.extra]
    log = out_dir / f"{mode}_{seed}.log"
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT), cmd


def load_runs(out_dir, env_id):
    runs = {}
    for d in sorted(out_dir.iterdir()):
        if not d.is_dir() or not (d / "summary.json").is_file():
            continue
        cfg = json.loads((d / "config.json").read_text())
        if cfg["env_id"] != env_id:
            continue
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[(cfg["step_advantage"], cfg["seed"])] = (cfg, rows, json.loads((d / "summary.json").read_text()))
    return runs


def fmt(vals):
    v = np.asarray([x for x in vals if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{np.median(v):.3f} [{v.min():.3f}, {v.max():.3f}]"


def credit_value(row, key):
    """A metrics row's value of `key`; graph_time_frac from graph_seconds and the iteration's seconds in
    the runs that log only those (graphgpo_graphs.py)."""
    if key == "credit/graph_time_frac" and key not in row and "credit/graph_seconds" in row:
        return row["credit/graph_seconds"] / max(row["perf/iteration_seconds"], 1e-9)
    return row.get(key)


def mean_std(vals):
    v = np.asarray(vals, dtype=float)
    return f"{v.mean():.3f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.3f}"


def report(runs, env_id, out_md, out_png, cmd_line, wall):
    modes = [m for m in NAMES if any(k[0] == m for k in runs)]
    seeds = sorted({k[1] for k in runs})
    any_cfg = next(iter(runs.values()))[0]
    lines = [f"Tiny {env_id} policy, seeds {seeds}, {any_cfg['num_iterations']} iterations of "
             f"{any_cfg['tasks_per_iteration']} tasks x {any_cfg['group_size']} trajectories; evaluation on "
             f"{any_cfg['num_test_tasks']} test tasks x {any_cfg['eval_k']} sampled episodes per temperature "
             f"and 1 greedy episode. Cells: median [min, max] over seeds.", ""]
    head = "| method | when | " + " | ".join(n for _, n in METRICS) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in modes:
        for when in ("first_eval", "last_eval"):
            evs = [runs[(m, s)][2][when] for s in seeds if (m, s) in runs]
            cells = [fmt([e.get(f"eval/{k}") for e in evs]) for k, _ in METRICS]
            lines.append(f"| {NAMES[m]} | {'before' if when == 'first_eval' else 'after'} | " + " | ".join(cells) + " |")
    lines += ["", "Change of sampled test success (T=1), after minus before, per seed:", "",
              "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std |",
              "|---|" + "---|" * (len(seeds) + 1)]
    for m in modes:
        d = [runs[(m, s)][2]["last_eval"]["eval/success"] - runs[(m, s)][2]["first_eval"]["eval/success"]
             if (m, s) in runs else None for s in seeds]
        ok = [x for x in d if x is not None]
        lines.append(f"| {NAMES[m]} | " + " | ".join("n/a" if x is None else f"{x:+.3f}" for x in d)
                     + f" | {mean_std(ok) if ok else 'n/a'} |")
    # credit statistics, averaged over iterations and seeds
    keys = [("credit/graph_nodes", "graph nodes"), ("credit/graph_edges", "edges"),
            ("credit/singleton_frac", "singleton-step frac"), ("credit/group_success_frac", "groups with a success"),
            ("credit/adv_nonzero_frac", "non-zero adv frac"), ("credit/graph_time_frac", "graph time / iteration"),
            ("perf/iteration_seconds", "s / iteration")]
    lines += ["", "Credit statistics (mean over iterations and seeds):", "",
              "| method | " + " | ".join(n for _, n in keys) + " |", "|---|" + "---|" * len(keys)]
    for m in modes:
        cells = []
        for k, _ in keys:
            v = [x for s in seeds if (m, s) in runs for r in runs[(m, s)][1]
                 if (x := credit_value(r, k)) is not None]
            cells.append(f"{np.mean(v):.3g}" if v else "n/a")
        lines.append(f"| {NAMES[m]} | " + " | ".join(cells) + " |")
    walls = [s["wall_seconds"] for _, _, s in runs.values()]
    lines += ["", f"Wall time per run: median {np.median(walls):.0f} s (one torch thread each, shared CPU). "
              f"Total benchmark wall time {wall:.0f} s.", "", f"Command: `{cmd_line}`", ""]
    out_md.write_text("\n".join(lines))
    print("\n".join(lines))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = ((axes[0], "eval/success", "test success (sampled, T=1)"),
              (axes[1], "eval/success_greedy", "test success (greedy)"),
              (axes[2], "charts/success", "training success (EMA 0.9)"))
    for m in modes:
        for ax, key, title in panels:
            curves = []
            for s in seeds:
                if (m, s) not in runs:
                    continue
                rows = [r for r in runs[(m, s)][1] if key in r]
                y = [r[key] for r in rows]
                if key.startswith("charts/"):
                    ema, acc = [], y[0] if y else 0.0
                    for v in y:
                        acc = 0.9 * acc + 0.1 * v
                        ema.append(acc)
                    y = ema
                curves.append(([r["iteration"] for r in rows], y))
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            x = np.asarray(curves[0][0][:n])
            y = np.asarray([c[1][:n] for c in curves])
            ax.plot(x, np.median(y, 0), color=COLORS[m], label=NAMES[m])
            ax.fill_between(x, y.min(0), y.max(0), color=COLORS[m], alpha=0.15)
            ax.set_title(title)
            ax.set_xlabel("iteration")
    axes[0].legend()
    fig.suptitle(f"tiny {env_id}: median and min-max over seeds {seeds}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_md} and {out_png}")


def credit_quality(env_id, num_tasks, group_size, noise, seed):
    """How well each step advantage ranks actions, without a model: a noisy expert (random action with
    probability `noise`) plays groups of `group_size` episodes per train task; every step is labelled by
    the env's exact solver (`env.solution_length()`): 'good' if it lowers the true distance to the goal.
    Reports, per variant, the mean advantage of good and of other steps and the AUC (probability that a
    random good step gets a higher advantage than a random other step, ties count 1/2), over the steps of
    non-singleton state groups (the only ones a step term can rank) and over all steps."""
    import graphgpo as gg

    import envs

    rng = np.random.default_rng(seed)
    env = envs.make(env_id)
    if not hasattr(env, "solution_length"):
        print(f"{env_id} has no solution_length(): no credit-quality table")
        return
    omega = gg.OMEGA_BY_ENV.get(env_id, 0.5)
    tasks = env.task_ids("train")[:num_tasks]
    res = {m: {"adv": [], "good": [], "multi": []} for m in NAMES}
    n_success = n_groups_success = 0
    for task in tasks:
        eps, succ, inv, rews, good = [], [], [], [], []
        for _ in range(group_size):
            env.reset(task)
            states, iv, gd, rw = [env.state_key()], [], [], []
            done, ok = False, False
            while not done:
                d0 = env.solution_length()
                a = env.expert_action() if rng.random() >= noise else ["up", "down", "left", "right"][rng.integers(4)]
                st = env.step(a)
                d1 = 0 if st.info["success"] else env.solution_length()
                gd.append(d0 is not None and d1 is not None and d1 < d0)
                states.append(env.state_key())
                iv.append(st.info["invalid"])
                rw.append(0.0)
                done, ok = st.done, st.info["success"]
            if ok:
                rw[-1] = 10.0
            eps.append(states), succ.append(ok), inv.append(iv), rews.append(rw), good.append(gd)
        n_success += sum(succ)
        n_groups_success += any(succ)
        counts = {}
        for e in eps:
            for s in e[:-1]:
                counts[s] = counts.get(s, 0) + 1
        multi = [[counts[s] > 1 for s in e[:-1]] for e in eps]
        a_graph = gg.graph_step_advantages(eps, succ, omega, invalid=inv)
        a_gigpo = gg.gigpo_step_advantages(eps, rews, 0.95, invalid=inv)
        a_ep = gg.grpo_advantages([10.0 * s - 0.1 * sum(i) for s, i in zip(succ, inv)])
        for m, a_step in (("graph", a_graph), ("gigpo", a_gigpo), ("none", [np.zeros(len(g)) for g in good])):
            for i in range(group_size):
                res[m]["adv"] += list(a_step[i] + a_ep[i])
                res[m]["good"] += good[i]
                res[m]["multi"] += multi[i]

    def auc(a, g):
        a, g = np.asarray(a), np.asarray(g, dtype=bool)
        pos, neg = a[g], a[~g]
        if not len(pos) or not len(neg):
            return float("nan")
        order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
        allv = np.concatenate([pos, neg])[order]
        ranks = np.empty(len(allv))
        i = 0
        while i < len(allv):  # average ranks of ties
            j = i
            while j + 1 < len(allv) and allv[j + 1] == allv[i]:
                j += 1
            ranks[i:j + 1] = (i + j) / 2 + 1
            i = j + 1
        r = np.empty(len(allv))
        r[order] = ranks
        return float((r[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))

    n_steps = len(res["graph"]["good"])
    lines = [f"Credit quality on {env_id} (no model): noisy expert (random action with probability {noise}), "
             f"{len(tasks)} train tasks x {group_size} episodes, seed {seed}; {n_steps} steps, episode success "
             f"{n_success / (len(tasks) * group_size):.3f}, groups with a success {n_groups_success / len(tasks):.3f}, "
             f"good steps (lower the solver's distance) {np.mean(res['graph']['good']):.3f}, steps in non-singleton "
             f"state groups {np.mean(res['graph']['multi']):.3f}. A = step term + episode term (β = 1), ω = {omega}.",
             "", "| method | AUC good vs other (all steps) | AUC (non-singleton groups) | mean A good | mean A other |",
             "|---|---|---|---|---|"]
    for m in NAMES:
        a, g, mu = np.asarray(res[m]["adv"]), np.asarray(res[m]["good"], bool), np.asarray(res[m]["multi"], bool)
        lines.append(f"| {NAMES[m]} | {auc(a, g):.3f} | {auc(a[mu], g[mu]):.3f} | {a[g].mean():+.3f} | {a[~g].mean():+.3f} |")
    lines.append("")
    print("\n".join(lines))
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--credit-quality", action="store_true",
                   help="only the model-free credit-quality table (noisy expert, solver labels)")
    p.add_argument("--cq-tasks", type=int, default=200)
    p.add_argument("--cq-noise", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    p.add_argument("--env-id", default="sokoban")
    p.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6])
    p.add_argument("--modes", nargs="+", default=["graph", "gigpo", "none"], choices=list(NAMES))
    p.add_argument("--num-iterations", type=int, default=40)
    p.add_argument("--tasks-per-iteration", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-num-tasks", type=int, default=200)
    p.add_argument("--eval-k", type=int, default=1)
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses one torch thread)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_graphgpo"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more graphgpo.py flags")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd_line = "python benchmarks/graphgpo_bench.py " + " ".join(sys.argv[1:])
    if args.credit_quality:
        lines = []
        for noise in args.cq_noise:
            lines += credit_quality(args.env_id, args.cq_tasks, 8, noise, args.seeds[0]) or []
        out = REPO / "docs" / f"graphgpo_credit_quality_{args.env_id}.md"
        out.write_text("\n".join(lines) + f"\nCommand: `{cmd_line}`\n")
        return
    if not args.report_only:
        from common.tiny import ensure_tiny

        ensure_tiny(args.env_id)  # build once before the parallel runs
        queue = [(m, s) for s in args.seeds for m in args.modes]
        running = []
        while queue or running:
            while queue and len(running) < args.parallel:
                m, s = queue.pop(0)
                proc, _ = run_one(m, s, args, out_dir)
                running.append((m, s, proc))
                print(f"started {m} seed {s}", flush=True)
            time.sleep(5)
            for item in list(running):
                if item[2].poll() is not None:
                    print(f"finished {item[0]} seed {item[1]} rc={item[2].returncode} ({time.time() - t0:.0f} s)",
                          flush=True)
                    running.remove(item)
    record = out_dir / "bench_run.json"  # the command and wall time of the run, kept for --report-only
    if not args.report_only:
        record.write_text(json.dumps({"command": cmd_line, "wall_seconds": time.time() - t0}))
    elif record.is_file():
        kept = json.loads(record.read_text())
        cmd_line, t0 = kept["command"], time.time() - kept["wall_seconds"]
    runs = load_runs(out_dir, args.env_id)
    if not runs:
        sys.exit(f"error: no finished runs for {args.env_id} in {out_dir}")
    report(runs, args.env_id, REPO / "docs" / f"graphgpo_bench_{args.env_id}.md",
           REPO / "docs" / f"graphgpo_bench_{args.env_id}.png", cmd_line, time.time() - t0)


if __name__ == "__main__":
    main()
