"""ΔBelief-RL vs StarPO on the tiny Twenty Questions policy, several seeds; writes a markdown table and a
plot to docs/.

    python benchmarks/delta_belief_bench.py                       # 3 seeds x {delta, starpo}
    python benchmarks/delta_belief_bench.py --parallel 2 --num-iterations 40
    python benchmarks/delta_belief_bench.py --report-only         # rebuild table and plot from the runs

Every run is `delta_belief.py` as a subprocess with one torch thread; the same seeds, budget and
evaluation for both reward modes (only `--reward-mode` differs). Guess My City is evaluated as the
out-of-distribution column when that env is present in the checkout (`--no-ood` skips it).
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

METRICS = [("success", "success"), ("pass_at_4", "pass@4"), ("success_greedy", "greedy"),
           ("num_questions", "questions"), ("repeated_frac", "repeated"), ("invalid_frac", "invalid")]


def run_one(mode, seed, args, out_dir):
    cmd = [sys.executable, str(REPO / "delta_belief.py"), "--reward-mode", mode, "--seed", str(seed),
           "--exp-name", f"bench_{mode}", "--output-dir", str(out_dir), "--torch-threads", "1",
           "--num-iterations", str(args.num_iterations), "--eval-every", str(args.eval_every),
           "--eval-num-tasks", str(args.eval_num_tasks), "--eval-k", "4", "--checkpoint-every", "0",
           "--model-name", args.model_name, "--tasks-per-iteration", str(args.tasks_per_iteration),
           *args.extra]
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
        runs[(cfg["reward_mode"], cfg["seed"])] = (cfg, rows, summary)
    return runs


def fmt(vals):
    v = np.asarray([x for x in vals if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{np.median(v):.3f} [{v.min():.3f}, {v.max():.3f}]"


def report(runs, out_md, out_png, cmd_line, wall):
    modes = [m for m in ("delta", "starpo") if any(k[0] == m for k in runs)]
    seeds = sorted({k[1] for k in runs})
    ood = any("eval/ood_success" in s["last_eval"] for _, _, s in runs.values())
    lines = [f"Tiny Twenty Questions policy, seeds {seeds}; median [min, max] over seeds; "
             f"test targets, 4 sampled games each (temperature 1) and 1 greedy game.", ""]
    head = "| method | when | " + " | ".join(n for _, n in METRICS) + (" | GMC success (OOD) | GMC questions |" if ood else " |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for m in modes:
        for when in ("first_eval", "last_eval"):
            evs = [runs[(m, s)][2][when] for s in seeds if (m, s) in runs]
            cells = [fmt([e.get(f"eval/{k}") for e in evs]) for k, _ in METRICS]
            if ood:
                cells += [fmt([e.get("eval/ood_success") for e in evs]), fmt([e.get("eval/ood_num_questions") for e in evs])]
            name = {"delta": "ΔBelief-RL", "starpo": "StarPO"}[m]
            lines.append(f"| {name} | {'before' if when == 'first_eval' else 'after'} | " + " | ".join(cells) + " |")
    # paired per-seed difference in final success
    both = [s for s in seeds if ("delta", s) in runs and ("starpo", s) in runs]
    if both:
        diff = [runs[("delta", s)][2]["last_eval"]["eval/success"] - runs[("starpo", s)][2]["last_eval"]["eval/success"]
                for s in both]
        lines += ["", f"ΔBelief-RL minus StarPO, final sampled success, per seed {both}: "
                  + ", ".join(f"{d:+.3f}" for d in diff) + f" (mean {np.mean(diff):+.3f})."]
    lines += ["", "Training games (train secrets, G = 16 per secret), mean over the last 3 iterations, median "
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
        name = {"delta": "ΔBelief-RL", "starpo": "StarPO"}[m]
        lines.append(f"| {name} | " + " | ".join(fmt(last3(k)) for k in (
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
            label = {"delta": "ΔBelief-RL", "starpo": "StarPO"}[m]
            ax.plot(x, np.median(y, 0), color=colors[m], label=label, marker="o", ms=3)
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
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", default=["delta", "starpo"])
    p.add_argument("--num-iterations", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-num-tasks", type=int, default=30)
    p.add_argument("--tasks-per-iteration", type=int, default=2)
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
                print(f"started {m} seed {s}")
            time.sleep(5)
            for item in list(running):
                if item[2].poll() is not None:
                    print(f"finished {item[0]} seed {item[1]} rc={item[2].returncode} ({time.time() - t0:.0f} s)")
                    running.remove(item)
    report(load_runs(out_dir), REPO / "docs" / "delta_belief_bench.md", REPO / "docs" / "delta_belief_bench.png",
           cmd_line, None if args.report_only else time.time() - t0)


if __name__ == "__main__":
    main()
