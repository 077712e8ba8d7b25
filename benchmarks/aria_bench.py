"""ARIA vs its REINFORCE ablation (`--no-aggregate`) on tiny Twenty Questions and tiny Bargaining (self-play),
several seeds, three collect-then-train iterations; writes a markdown table and a plot to docs/.

    python benchmarks/aria_bench.py                              # 3 seeds x {aria, reinforce} x 2 envs
    python benchmarks/aria_bench.py --envs bargaining --parallel 2
    python benchmarks/aria_bench.py --report-only                # rebuild table and plot from the runs

Every run is `aria.py` as a subprocess with one torch thread, evaluated before training and after every
iteration; both methods get the same seeds, games, epochs and evaluation (only `--no-aggregate` differs).
The table gives the test success (Twenty Questions) or the win rate against the scripted opponents
(Bargaining, both roles, all styles) per iteration, mean ± std over seeds, the selected k, and the
variance of the step rewards before and after aggregation (logged for both methods).
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

METHODS = {"aria": [], "reinforce": ["--no-aggregate"]}
NAMES = {"aria": "ARIA", "reinforce": "REINFORCE (--no-aggregate)"}


def run_one(env_id, method, seed, args, out_dir):
    cmd = [sys.executable, str(REPO / "aria.py"), "--env-id", env_id, "--seed", str(seed), "--exp-name",
           f"bench_{method}", "--output-dir", str(out_dir), "--torch-threads", "1", "--num-iterations",
           str(args.num_iterations), "--eval-every", "1", "--eval-num-tasks", str(args.eval_num_tasks),
           "--checkpoint-every", "0", "--model-name", args.model_name, "--tiny-preset", args.tiny_preset,
           *METHODS[method], *args.extra]
    if args.games_per_iteration:
        cmd += ["--games-per-iteration", str(args.games_per_iteration)]
    log = out_dir / f"{env_id}_{method}_{seed}.log"
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def load_runs(out_dir):
    runs = {}
    for d in sorted(out_dir.iterdir()):
        if not (d / "summary.json").is_file():
            continue
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        method = "aria" if cfg["aggregate"] else "reinforce"
        runs[(cfg["env_id"], method, cfg["seed"])] = (cfg, rows, json.loads((d / "summary.json").read_text()))
    return runs


def ms(vals, digits=3):
    v = np.asarray([x for x in vals if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}"


def per_iteration(rows, key):
    """{iteration: value} of the rows that have `key`."""
    return {r["iteration"]: r[key] for r in rows if key in r}


def report(runs, out_md, out_png, cmd_line, wall):
    envs_ = [e for e in ("twenty_questions", "bargaining", "negotiation", "guess_my_city") if any(k[0] == e for k in runs)]
    seeds = sorted({k[2] for k in runs})
    lines = [f"Seeds {seeds}; mean ± std over seeds. Test metric: Twenty Questions success (sampled at temperature "
             f"1), Bargaining/Negotiation win rate of the policy against the scripted styles in both roles "
             f"(sampled); iteration 0 is before training.", ""]
    for env_id in envs_:
        methods = [m for m in METHODS if any(k[:2] == (env_id, m) for k in runs)]
        iters = sorted({it for k, (_, rows, _) in runs.items() if k[0] == env_id
                        for it in per_iteration(rows, "eval/success")})
        metric = "success" if env_id in ("twenty_questions", "guess_my_city") else "win rate"
        lines += [f"### {env_id}: test {metric} per iteration", "",
                  "| method | " + " | ".join(f"iter {i}" for i in iters) + " | greedy, last |",
                  "|---|" + "---|" * (len(iters) + 1)]
        for m in methods:
            cur = [runs[(env_id, m, s)] for s in seeds if (env_id, m, s) in runs]
            cells = [ms([per_iteration(r[1], "eval/success").get(i) for r in cur]) for i in iters]
            cells.append(ms([r[2]["last_eval"].get("eval/success_greedy") for r in cur]))
            lines.append(f"| {NAMES[m]} | " + " | ".join(cells) + " |")
        lines += ["", f"Credit statistics per training iteration ({env_id}; mean ± std over seeds):", "",
                  "| method | iteration | selected k | max k | intentions / steps | reward var raw | reward var aggregated "
                  "| training success | nonzero weights |", "|---|---|---|---|---|---|---|---|---|"]
        for m in methods:
            cur = [runs[(env_id, m, s)] for s in seeds if (env_id, m, s) in runs]
            train_iters = sorted({it for r in cur for it in per_iteration(r[1], "credit/selected_k")})
            for it in train_iters:
                def col(key):
                    return [per_iteration(r[1], key).get(it) for r in cur]
                ratio = [None if a is None else a / max(b, 1) for a, b in zip(col("credit/num_intentions"),
                                                                             col("credit/num_steps"))]
                lines.append(f"| {NAMES[m]} | {it} | {ms(col('credit/selected_k'), 1)} | {ms(col('credit/max_k'), 1)} | "
                             f"{ms(ratio, 2)} | {ms(col('credit/reward_var_raw'), 4)} | "
                             f"{ms(col('credit/reward_var_aggregated'), 4)} | {ms(col('charts/success'))} | "
                             f"{ms(col('credit/weight_nonzero_frac'), 2)} |")
        both = [s for s in seeds if (env_id, "aria", s) in runs and (env_id, "reinforce", s) in runs]
        if both:
            diff = [runs[(env_id, "aria", s)][2]["last_eval"]["eval/success"]
                    - runs[(env_id, "reinforce", s)][2]["last_eval"]["eval/success"] for s in both]
            lines += ["", f"ARIA minus REINFORCE, last test {metric}, per seed {both}: "
                      + ", ".join(f"{d:+.3f}" for d in diff) + f" (mean {np.mean(diff):+.3f})."]
        lines.append("")
    walls = [s["wall_seconds"] for _, _, s in runs.values()]
    total = f" Total benchmark wall time {wall:.0f} s." if wall else ""
    lines += [f"Wall time per run: median {np.median(walls):.0f} s (one torch thread each).{total}", "",
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
    fig, axes = plt.subplots(2, len(envs_), figsize=(4.6 * len(envs_), 7.0), squeeze=False)
    colors = {"aria": "tab:blue", "reinforce": "tab:orange"}
    for c, env_id in enumerate(envs_):
        for m in METHODS:
            cur = [runs[(env_id, m, s)] for s in seeds if (env_id, m, s) in runs]
            if not cur:
                continue
            iters = sorted(set.intersection(*[set(per_iteration(r[1], "eval/success")) for r in cur]))
            y = np.array([[per_iteration(r[1], "eval/success")[i] for i in iters] for r in cur])
            axes[0, c].plot(iters, y.mean(0), marker="o", color=colors[m], label=NAMES[m])
            axes[0, c].fill_between(iters, y.mean(0) - y.std(0), y.mean(0) + y.std(0), color=colors[m], alpha=0.2)
            tr = sorted(set.intersection(*[set(per_iteration(r[1], "credit/reward_var_raw")) for r in cur]))
            if m == "aria" and tr:
                raw = np.array([[per_iteration(r[1], "credit/reward_var_raw")[i] for i in tr] for r in cur]).mean(0)
                agg = np.array([[per_iteration(r[1], "credit/reward_var_aggregated")[i] for i in tr] for r in cur]).mean(0)
                x = np.arange(len(tr))
                axes[1, c].bar(x - 0.2, raw, 0.4, label="before aggregation", color="tab:gray")
                axes[1, c].bar(x + 0.2, agg, 0.4, label="after aggregation", color="tab:blue")
                axes[1, c].set_xticks(x, [f"iter {i}" for i in tr])
        axes[0, c].set_title(f"{env_id}: test {'success' if env_id in ('twenty_questions', 'guess_my_city') else 'win rate'}")
        axes[0, c].set_xlabel("iteration")
        axes[1, c].set_title(f"{env_id}: variance of step rewards (ARIA runs)")
        axes[0, c].legend(fontsize=8)
        axes[1, c].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_md} and {out_png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--envs", nargs="+", default=["twenty_questions", "bargaining"])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--num-iterations", type=int, default=3)
    p.add_argument("--games-per-iteration", type=int, default=0, help="0: aria.py's default")
    p.add_argument("--eval-num-tasks", type=int, default=20)
    p.add_argument("--model-name", default="tiny", help="'tiny' (the env's tiny policy) or a checkpoint directory")
    p.add_argument("--tiny-preset", default="default")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses one torch thread)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_aria"))
    p.add_argument("--docs-dir", default=str(REPO / "docs"), help="where aria_bench.md and aria_bench.png go")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more aria.py flags (last on the line)")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = Path(args.docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shown = ["<checkpoint dir>" if a == args.model_name and a != "tiny" else a for a in sys.argv[1:]
             if a != "--report-only"]
    cmd_line = " ".join(["python benchmarks/aria_bench.py", *shown])
    if not args.report_only:
        if args.model_name == "tiny":
            from common.tiny import ensure_tiny

            for env_id in args.envs:  # build once before the parallel runs
                ensure_tiny(env_id, preset=args.tiny_preset)
        queue = [(e, m, s) for e in args.envs for s in args.seeds for m in args.methods]
        running = []
        while queue or running:
            while queue and len(running) < args.parallel:
                e, m, s = queue.pop(0)
                running.append((e, m, s, run_one(e, m, s, args, out_dir)))
                print(f"started {e} {m} seed {s}")
            time.sleep(2)
            for item in list(running):
                if item[3].poll() is not None:
                    print(f"finished {item[0]} {item[1]} seed {item[2]} rc={item[3].returncode} ({time.time() - t0:.0f} s)")
                    running.remove(item)
    report(load_runs(out_dir), docs / "aria_bench.md", docs / "aria_bench.png", cmd_line,
           None if args.report_only else time.time() - t0)


if __name__ == "__main__":
    main()
