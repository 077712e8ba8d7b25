"""ΔBelief-RL vs StarPO on the tiny Twenty Questions policy, several seeds; writes a markdown table and a
plot to docs/.

    python benchmarks/delta_belief_bench.py                       # seeds 4 5 6 x {delta, starpo}, defaults
    python benchmarks/delta_belief_bench.py --parallel 1 --no-ood --num-iterations 24
    python benchmarks/delta_belief_bench.py --report-only         # rebuild table and plot from the runs

Every run is `delta_belief.py` as a subprocess with one torch thread, through benchmarks/delta_belief_games.py
(the same run with its evaluation games measured: pass@k, questions, repeated and invalid shares); the same
seeds, budget and evaluation for both reward modes (only `--reward-mode` differs); budget flags left unset here
are delta_belief.py's defaults. Guess My City is evaluated as the out-of-distribution column when that env
is present in the checkout (`--no-ood` skips it). The report gives, per seed, the sampled test success
before and after training with its standard error, whether the learning target holds (ΔBelief-RL: mean
change >= +0.08 with every seed above 0; StarPO: mean change above 0), and whether the paper's ordering
(ΔBelief-RL above StarPO) holds on the final success. Seed 1 was used to tune delta_belief.py's defaults.
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
from learning import learning_summary  # noqa: E402  (the change of the main metric and its SE)

NAMES = {"delta": "ΔBelief-RL", "starpo": "StarPO"}
TARGET = 0.08  # ΔBelief-RL's mean change of sampled test success that counts as learning
BUDGET = ("num_iterations", "tasks_per_iteration", "eval_every", "eval_num_tasks", "eval_k")
METRICS = [("success", "success"), ("pass_at_k", "pass@k"), ("success_greedy", "greedy"),
           ("num_questions", "questions"), ("repeated_frac", "repeated"), ("invalid_frac", "invalid")]


def run_one(mode, seed, args, out_dir):
    cmd = [sys.executable, str(REPO / "benchmarks" / "delta_belief_games.py"), "--reward-mode", mode,
           "--seed", str(seed), "--exp-name", f"bench_{mode}", "--output-dir", str(out_dir),
           "--torch-threads", "1", "--checkpoint-every", "0", "--model-name", args.model_name]
    for key in BUDGET:
        if getattr(args, key) is not None:
            cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    cmd += args.extra
    if args.ood:
        cmd += ["--eval-env-id", "guess_my_city"]
    log = out_dir / f"{mode}_{seed}.log"
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT), cmd


def load_runs(out_dir):
    runs = {}
    for d in sorted(out_dir.iterdir()):
        if not (d / "summary.json").is_file():
            continue
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        summary = json.loads((d / "summary.json").read_text())
        if "learning" not in summary:  # summaries of later runs leave it to benchmarks/learning.py
            summary["learning"] = learning_summary(summary["first_eval"], summary["last_eval"],
                                                   "eval/success")
        runs[(cfg["reward_mode"], cfg["seed"])] = (cfg, rows, summary)
    return runs


def fmt(vals):
    v = np.asarray([x for x in vals if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{np.median(v):.3f} [{v.min():.3f}, {v.max():.3f}]"


def seed_stats(values):
    """Mean, standard deviation (ddof 1) and standard error over seeds."""
    v = np.asarray(values, dtype=float)
    sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
    return float(v.mean()), sd, sd / math.sqrt(len(v))


def learning_tables(runs, modes, seeds):
    """Per seed: before, after, change (± standard error over the evaluation episodes); over seeds: mean,
    spread; the learning targets and the paper's ordering."""
    lines = ["Sampled test success per seed (± standard error over the evaluation episodes; the change: the "
             "SE summary.json gives, of the per-game differences in runs with common random numbers, else the "
             "two in quadrature):", "", "| method | seed | before | after | change | greedy before → after |",
             "|---|---|---|---|---|---|"]
    changes, finals = {}, {}
    for m in modes:
        for s in seeds:
            if (m, s) not in runs:
                continue
            L, f, la = (runs[(m, s)][2][k] for k in ("learning", "first_eval", "last_eval"))
            changes.setdefault(m, []).append(L["change"])
            finals.setdefault(m, {})[s] = (L["after"], L["after_se"])
            lines.append(f"| {NAMES[m]} | {s} | {L['before']:.3f} ± {L['before_se']:.3f} | {L['after']:.3f} ± "
                         f"{L['after_se']:.3f} | {L['change']:+.3f} ± {L['change_se']:.3f} | "
                         f"{f['eval/success_greedy']:.3f} → {la['eval/success_greedy']:.3f} |")
    lines += ["", "Over seeds:", "", "| method | mean change ± SE over seeds | sd | per seed | every seed above 0 |",
              "|---|---|---|---|---|"]
    for m in modes:
        mc, sd, se = seed_stats(changes[m])
        lines.append(f"| {NAMES[m]} | {mc:+.3f} ± {se:.3f} | {sd:.3f} | {', '.join(f'{c:+.3f}' for c in changes[m])} | "
                     f"{'yes' if min(changes[m]) > 0 else 'no'} |")
    lines.append("")
    if "delta" in changes:
        mc = float(np.mean(changes["delta"]))
        ok = mc >= TARGET and min(changes["delta"]) > 0
        lines.append(f"Target for ΔBelief-RL (mean change ≥ +{TARGET}, every seed above 0): **{'met' if ok else 'not met'}** "
                     f"(mean {mc:+.3f}).")
    if "starpo" in changes:
        mc = float(np.mean(changes["starpo"]))
        lines.append(f"Baseline StarPO (mean change above 0): **{'met' if mc > 0 else 'not met'}** (mean {mc:+.3f}).")
    if "delta" in finals and "starpo" in finals:
        both = [s for s in seeds if s in finals["delta"] and s in finals["starpo"]]
        diff = [finals["delta"][s][0] - finals["starpo"][s][0] for s in both]
        se = [math.hypot(finals["delta"][s][1], finals["starpo"][s][1]) for s in both]
        md = float(np.mean(diff))
        lines.append(f"Paper's ordering (ΔBelief-RL above StarPO, final sampled success): **{'holds' if md > 0 else 'does not hold'}** "
                     f"(mean difference {md:+.3f}; per seed " + ", ".join(f"{d:+.3f} ± {e:.3f}" for d, e in zip(diff, se)) + ").")
    return lines + [""]


def report(runs, out_md, out_png, cmd_line, wall):
    modes = [m for m in ("delta", "starpo") if any(k[0] == m for k in runs)]
    seeds = sorted({k[1] for k in runs})
    ood = any("eval/ood_success" in s["last_eval"] for _, _, s in runs.values())
    cfg = next(iter(runs.values()))[0]
    n_eval = next(iter(runs.values()))[2]["first_eval"].get("eval/episodes")
    lines = [f"Tiny Twenty Questions policy, seeds {seeds} (defaults tuned on seed 1); {cfg['num_iterations']} iterations "
             f"of {cfg['tasks_per_iteration']} secrets × {cfg['group_size']} games, learning rate "
             f"{cfg.get('resolved_learning_rate', cfg['learning_rate'])}; evaluation on {cfg['eval_num_tasks'] or 'all'} test secrets × "
             f"{cfg['eval_k']} sampled games (temperature {cfg['eval_temperature']}"
             f"{', ' + str(n_eval) + ' episodes' if n_eval else ''}) and 1 greedy game per secret.", ""]
    lines += learning_tables(runs, modes, seeds)
    lines += ["All evaluation metrics, median [min, max] over seeds:", ""]
    head = "| method | when | " + " | ".join(n.replace("@k", f"@{cfg['eval_k']}") for _, n in METRICS) + (" | GMC success (OOD) | GMC questions |" if ood else " |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in modes:
        for when in ("first_eval", "last_eval"):
            evs = [runs[(m, s)][2][when] for s in seeds if (m, s) in runs]
            keys = [k.replace("_k", f"_{cfg['eval_k']}") if k == "pass_at_k" else k for k, _ in METRICS]
            cells = [fmt([e.get(f"eval/{k}") for e in evs]) for k in keys]
            if ood:
                cells += [fmt([e.get("eval/ood_success") for e in evs]), fmt([e.get("eval/ood_num_questions") for e in evs])]
            lines.append(f"| {NAMES[m]} | {'before' if when == 'first_eval' else 'after'} | " + " | ".join(cells) + " |")
    # paired per-seed difference in final success
    lines += ["", f"Training games (train secrets, G = {cfg['group_size']} per secret), mean over the last 3 iterations, median "
              "[min, max] over seeds:", "", "| method | success | invalid | repeated | mean ΔBelief | share of turns with ΔBelief > 0 |",
              "|---|---|---|---|---|---|"]
    for m in modes:
        def last3(key):
            out = []
            for s in seeds:
                if (m, s) in runs:
                    vals = [r[key] for r in runs[(m, s)][1] if key in r][-3:]
                    out.append(float(np.mean(vals)) if vals else None)
            return out
        lines.append(f"| {NAMES[m]} | " + " | ".join(fmt(last3(k)) for k in (
            "charts/success", "charts/invalid_rate", "charts/repeated_rate", "credit/delta_belief_mean",
            "credit/delta_belief_pos_frac")) + " |")
    walls = [s["wall_seconds"] for _, _, s in runs.values()]
    total = f" Total benchmark wall time {wall:.0f} s." if wall else ""
    lines += ["", f"Wall time per run: median {np.median(walls):.0f} s (one torch thread each).{total}", "",
              f"Command: `{cmd_line}`", ""]
    out_md.write_text("\n".join(lines))
    print("\n".join(lines))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    panels = [("charts/success", "training games: success"), ("charts/invalid_rate", "training games: invalid"),
              ("charts/repeated_rate", "training games: repeated"), ("eval/success", "test success (sampled)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    colors = {"delta": "tab:blue", "starpo": "tab:orange"}
    for m in modes:
        for ax, (key, title) in zip(axes, panels):
            curves = []
            for s in seeds:
                if (m, s) not in runs:
                    continue
                rows = [r for r in runs[(m, s)][1] if key in r]
                curves.append(([r["iteration"] for r in rows], [r[key] for r in rows]))
            if not curves:
                continue
            n = min(len(c[0]) for c in curves)
            x = np.asarray(curves[0][0][:n])
            y = np.asarray([c[1][:n] for c in curves])
            ax.plot(x, np.median(y, 0), color=colors[m], label=NAMES[m], marker="o", ms=3)
            ax.fill_between(x, y.min(0), y.max(0), color=colors[m], alpha=0.2)
            ax.set_title(title)
            ax.set_xlabel("iteration")
    # belief curve after training
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_md} and {out_png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[4, 5, 6], help="seeds (1 was used for tuning)")
    p.add_argument("--modes", nargs="+", default=["delta", "starpo"], choices=list(NAMES))
    p.add_argument("--num-iterations", type=int, default=None, help="default: delta_belief.py's")
    p.add_argument("--eval-every", type=int, default=None, help="default: delta_belief.py's")
    p.add_argument("--eval-num-tasks", type=int, default=None, help="default: delta_belief.py's")
    p.add_argument("--eval-k", type=int, default=None, help="default: delta_belief.py's")
    p.add_argument("--tasks-per-iteration", type=int, default=None, help="default: delta_belief.py's")
    p.add_argument("--model-name", default="tiny", help="'tiny' or a tiny checkpoint directory")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses one torch thread)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_delta_belief"))
    p.add_argument("--no-ood", action="store_true",
                   help="skip the Guess My City column (out of distribution; costly when every game runs to 20 questions)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more delta_belief.py flags")
    args = p.parse_args()
    import envs

    args.ood = not args.no_ood and "guess_my_city" in envs.available()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shown = ["<tiny checkpoint dir>" if a == args.model_name and a != "tiny" else a for a in sys.argv[1:]
             if a != "--report-only"]
    cmd_line = "python benchmarks/delta_belief_bench.py " + " ".join(shown)
    if not args.report_only:
        if args.model_name == "tiny":
            from common.tiny import ensure_tiny

            ensure_tiny("twenty_questions")  # build once before the parallel runs
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
    wall = None
    if not args.report_only:
        wall = time.time() - t0
        record.write_text(json.dumps({"command": cmd_line, "wall_seconds": wall}))
    elif record.is_file():
        kept = json.loads(record.read_text())
        cmd_line, wall = kept["command"], kept["wall_seconds"]
    runs = load_runs(out_dir)
    if not runs:
        sys.exit(f"error: no finished runs in {out_dir}")
    report(runs, REPO / "docs" / "delta_belief_bench.md", REPO / "docs" / "delta_belief_bench.png", cmd_line, wall)


if __name__ == "__main__":
    main()
