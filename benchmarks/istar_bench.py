"""iStar vs its vanilla baseline (the same file with --alpha 0) on the tiny Sokoban policy, several seeds;
writes a markdown table and a learning-curve plot to docs/.

    python benchmarks/istar_bench.py                                  # 3 seeds x {istar, rloo}
    python benchmarks/istar_bench.py --num-iterations 40 --parallel 2
    python benchmarks/istar_bench.py --modes istar rloo istar_grpo grpo --seeds 1 2 3
    python benchmarks/istar_bench.py --report-only                    # table and plot from the runs

Every run is `istar.py` as a subprocess with one torch thread. Both methods get the same seeds, tasks per
iteration, iterations and evaluation; only the flags in MODES differ. The table gives test success before
and after training (median [min, max] over seeds) and the PRM's pair accuracy over training (measured on
each iteration's fresh rollouts before the PRM update, so it is a held-out accuracy of the PRM so far).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import istar_prm_stats  # noqa: E402  (the PRM's statistics, from what istar.py logs)

MODES = {
    "istar": ("iStar (RLOO)", ["--alpha", "1", "--estimator", "rloo"]),
    "rloo": ("RLOO (--alpha 0)", ["--alpha", "0", "--estimator", "rloo"]),
    "istar_grpo": ("iStar (GRPO)", ["--alpha", "1", "--estimator", "grpo"]),
    "grpo": ("GRPO (--alpha 0)", ["--alpha", "0", "--estimator", "grpo"]),
    "istar_token": ("iStar token-level (RLOO)", ["--alpha", "1", "--step-reward-granularity", "token"]),
}
# metrics.jsonl of runs written before the PRM statistics moved from credit/ to prm/, read under the new names
OLD_KEYS = {"credit/prm_pair_acc": "prm/heldout_pair_acc", "credit/prm_pairs": "prm/pairs",
            "credit/prm_loss": "prm/loss", "credit/prm_margin": "prm/heldout_margin",
            "credit/prm_grad_norm": "prm/grad_norm"}
EVAL_KEYS = [("eval/success", "success (T=1)"), ("eval/success_greedy", "success (greedy)"),
             ("eval/episode_length", "episode length")]


def run_one(mode, seed, args, out_dir):
    cmd = [sys.executable, str(REPO / "istar.py"), *MODES[mode][1], "--seed", str(seed), "--exp-name", f"bench_{mode}",
           "--output-dir", str(out_dir), "--torch-threads", "1", "--env-id", args.env_id,
           "--num-iterations", str(args.num_iterations), "--eval-every", str(args.eval_every),
           "--eval-num-tasks", str(args.eval_num_tasks), "--tasks-per-iteration", str(args.tasks_per_iteration),
           "--checkpoint-every", "0", *args.extra]
    log = out_dir / f"{mode}_{seed}.log"
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT), cmd


def mode_of(cfg):
    return cfg["exp_name"].removeprefix("bench_")


def load_runs(out_dir):
    runs = {}
    for d in sorted(out_dir.iterdir()):
        if not (d / "summary.json").is_file():
            continue
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [{OLD_KEYS.get(k, k): v for k, v in r.items()} for r in rows]
        add_prm_stats(rows, d, cfg)
        runs[(mode_of(cfg), cfg["seed"])] = (cfg, rows, json.loads((d / "summary.json").read_text()))
    return runs


def add_prm_stats(rows, run_dir, cfg):
    """The PRM's statistics of every iteration with the PRM (benchmarks/istar_prm_stats.py, from the
    run's samples.jsonl: held-out pair accuracy and margin, step rewards of positive and negative
    trajectories, credit/step_reward_progress_corr: the Pearson correlation, over all steps of the
    iteration, of the step's implicit reward with its change of env progress; the first step of an
    episode has no progress before it and is left out), added to its metrics row; a value the row
    already holds (runs that logged it themselves) is kept, NaN becomes None as in metrics.jsonl."""
    recs = istar_prm_stats.records(run_dir)
    if not recs:
        return
    new_env = istar_prm_stats.run_env(cfg)
    by_it = {r["iteration"]: r for r in rows}
    for it, rec in recs:
        if it in by_it:
            stats = istar_prm_stats.iteration_stats(rec, cfg.get("dpo_reduce", "mean"), new_env)
            for k, v in stats.items():
                by_it[it].setdefault(k, v if math.isfinite(v) else None)


def fmt(vals, digits=3):
    v = np.asarray([x for x in vals if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return "n/a"
    return f"{np.median(v):.{digits}f} [{v.min():.{digits}f}, {v.max():.{digits}f}]"


def phase_mean(rows, key, lo, hi):
    """Mean of `key` over the training iterations in [lo, hi) (None where it was not defined)."""
    v = [r[key] for r in rows if key in r and r[key] is not None and lo <= r["iteration"] < hi]
    return float(np.mean(v)) if v else None


def first_reach(rows, target):
    """First evaluated iteration whose sampled success reaches `target` (None if never)."""
    for r in rows:
        if "eval/success" in r and r["eval/success"] >= target:
            return r["iteration"]
    return None


def report(runs, out_md, out_png, cmd_line, wall):
    modes = [m for m in MODES if any(k[0] == m for k in runs)]
    seeds = sorted({k[1] for k in runs})
    any_cfg = next(iter(runs.values()))[0]
    n_it = any_cfg["num_iterations"]
    lines = [f"Tiny {any_cfg['env_id']} policy, seeds {seeds}, {n_it} iterations of "
             f"{any_cfg['tasks_per_iteration']} tasks x {any_cfg['group_size']} trajectories; evaluation on "
             f"{any_cfg['eval_num_tasks']} test levels (one sampled episode at T=1 and one greedy episode each). "
             "Cells: median [min, max] over seeds.", ""]
    head = "| method | when | " + " | ".join(n for _, n in EVAL_KEYS) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in modes:
        for when in ("first_eval", "last_eval"):
            evs = [runs[(m, s)][2][when] for s in seeds if (m, s) in runs]
            cells = [fmt([e.get(k) for e in evs], 2 if "length" in k else 3) for k, _ in EVAL_KEYS]
            lines.append(f"| {MODES[m][0]} | {'before' if when == 'first_eval' else 'after'} | " + " | ".join(cells) + " |")
    # paired per-seed differences
    for m, base in (("istar", "rloo"), ("istar_grpo", "grpo")):
        both = [s for s in seeds if (m, s) in runs and (base, s) in runs]
        if both:
            d = [runs[(m, s)][2]["last_eval"]["eval/success"] - runs[(base, s)][2]["last_eval"]["eval/success"] for s in both]
            lines += ["", f"{MODES[m][0]} minus {MODES[base][0]}, final sampled success, per seed {both}: "
                      + ", ".join(f"{x:+.3f}" for x in d) + f" (mean {np.mean(d):+.3f})."]
            # steps to reach the baseline's final success (paper: about half)
            reach = []
            for s in both:
                tgt = runs[(base, s)][2]["last_eval"]["eval/success"]
                reach.append((first_reach(runs[(m, s)][1], tgt), first_reach(runs[(base, s)][1], tgt)))
            lines += [f"First evaluated iteration reaching the baseline's final success ({MODES[m][0]} / baseline), "
                      f"per seed: " + ", ".join(f"{a}/{b}" for a, b in reach) + "."]
    # PRM pair accuracy over training
    q = [1, n_it // 4 + 1, n_it // 2 + 1, 3 * n_it // 4 + 1, n_it + 1]
    prm_modes = [m for m in modes if m.startswith("istar")]
    if prm_modes:
        lines += ["", "PRM on each iteration's rollouts, before its update (mean over the iterations of each "
                  "quarter of training, then median [min, max] over seeds). Pair accuracy = fraction of "
                  "(positive, negative) pairs of the same task whose trajectory score is higher for the positive.", ""]
        head = "| method | statistic | " + " | ".join(f"it {q[i]}-{q[i + 1] - 1}" for i in range(4)) + " |"
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for m in prm_modes:
            for key, name in (("prm/heldout_pair_acc", "pair accuracy"), ("prm/pairs", "pairs / iteration"),
                              ("prm/loss", "DPO loss"),
                              ("credit/step_reward_success_mean", "step reward, successful traj."),
                              ("credit/step_reward_failure_mean", "step reward, failed traj."),
                              ("credit/step_reward_progress_corr", "corr(step reward, Δprogress)")):
                cells = []
                for i in range(4):
                    vals = [phase_mean(runs[(m, s)][1], key, q[i], q[i + 1]) for s in seeds if (m, s) in runs]
                    cells.append(fmt(vals, 1 if key == "prm/pairs" else (4 if "step_reward_s" in key or "failure" in key else 3)))
                lines.append(f"| {MODES[m][0]} | {name} | " + " | ".join(cells) + " |")
    walls = [s["wall_seconds"] for _, _, s in runs.values()]
    lines += ["", f"Wall time per run: median {np.median(walls):.0f} s (one torch thread each, on a shared 2-core "
              f"machine). Total benchmark wall time {wall:.0f} s.", "", f"Command: `{cmd_line}`", ""]
    out_md.write_text("\n".join(lines))
    print("\n".join(lines))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    colors = dict(zip(MODES, ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]))
    for m in modes:
        for ax, key, title, smooth in ((axes[0], "eval/success", "test success (sampled, T=1)", 1),
                                       (axes[1], "charts/success", "training success (rollouts)", 5),
                                       (axes[2], "prm/heldout_pair_acc", "PRM pair accuracy (before update)", 5)):
            curves = []
            for s in seeds:
                if (m, s) not in runs:
                    continue
                rows = [r for r in runs[(m, s)][1] if r.get(key) is not None]
                if rows:
                    curves.append((np.array([r["iteration"] for r in rows]), np.array([r[key] for r in rows], dtype=float)))
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            x = curves[0][0][:n]
            y = np.array([c[1][:n] for c in curves])
            if smooth > 1 and n >= smooth:
                kern = np.ones(smooth) / smooth
                y = np.array([np.convolve(row, kern, mode="valid") for row in y])
                x = x[smooth - 1:]
            ax.plot(x, np.median(y, 0), color=colors[m], label=MODES[m][0])
            ax.fill_between(x, y.min(0), y.max(0), color=colors[m], alpha=0.2)
            ax.set_title(title)
            ax.set_xlabel("iteration")
    axes[2].axhline(0.5, color="grey", lw=0.8, ls="--")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_md} and {out_png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6])
    p.add_argument("--modes", nargs="+", default=["istar", "rloo"], choices=list(MODES))
    p.add_argument("--env-id", default="sokoban")
    p.add_argument("--num-iterations", type=int, default=40)
    p.add_argument("--tasks-per-iteration", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-num-tasks", type=int, default=200)
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses one torch thread)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_istar"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more istar.py flags")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cmd_line = "python benchmarks/istar_bench.py " + " ".join(sys.argv[1:])
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
                    print(f"finished {item[0]} seed {item[1]} rc={item[2].returncode} ({time.time() - t0:.0f} s)", flush=True)
                    running.remove(item)
    record = out_dir / "bench_run.json"  # the command and wall time of the run, kept for --report-only
    if not args.report_only:
        record.write_text(json.dumps({"command": cmd_line, "wall_seconds": time.time() - t0}))
    elif record.is_file():
        kept = json.loads(record.read_text())
        cmd_line, t0 = kept["command"], time.time() - kept["wall_seconds"]
    runs = load_runs(out_dir)
    if not runs:
        sys.exit(f"error: no finished runs in {out_dir}")
    report(runs, REPO / "docs" / "istar_bench.md", REPO / "docs" / "istar_bench.png", cmd_line, time.time() - t0)


if __name__ == "__main__":
    main()
