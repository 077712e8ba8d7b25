"""EPO vs its two ablations (--prm none: outcome only; --weights ones: EPO-SFT) on the tiny Negotiation
strategist, several seeds; writes a markdown table and a plot to docs/.

    python benchmarks/epo_bench.py                              # 3 seeds x {epo, prm_none, ones}
    python benchmarks/epo_bench.py --parallel 2 --num-iterations 8
    python benchmarks/epo_bench.py --report-only                # rebuild table and plot from the runs

Every run is `epo.py` as a subprocess with one torch thread: the same seeds, budget and evaluation for
the three variants (only `--prm` / `--weights` differ). The evaluation plays each test task in both
roles against every scripted style after every iteration; the table gives the goal score (0-10) per
iteration, mean and [min, max] over seeds, and per scripted style and role (`per_opponent`, from the
evaluation's per-game goal scores).
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

VARIANTS = {  # name -> (extra epo.py flags, label)
    "epo": ([], "EPO (rule PRM)"),
    "prm_none": (["--prm", "none"], "--prm none (outcome only)"),
    "ones": (["--weights", "ones"], "--weights ones (EPO-SFT)"),
}


def run_one(variant, seed, args, out_dir):
    flags, _ = VARIANTS[variant]
    cmd = [sys.executable, str(REPO / "epo.py"), *flags, "--seed", str(seed), "--exp-name", f"bench_{variant}",
           "--output-dir", str(out_dir), "--torch-threads", "1", "--num-iterations", str(args.num_iterations),
           "--episodes-per-iteration", str(args.episodes_per_iteration), "--eval-every", "1",
           "--eval-num-tasks", str(args.eval_num_tasks), "--checkpoint-every", "0", "--model-name", args.model_name,
           "--tiny-preset", args.tiny_preset, *args.extra]
    log = out_dir / f"{variant}_{seed}.log"
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def variant_of(cfg):
    if cfg.get("weights") == "ones":
        return "ones"
    return "prm_none" if cfg.get("prm") == "none" else "epo"


def load_runs(out_dir):
    runs = {}
    for d in sorted(out_dir.iterdir()):
        if not (d / "summary.json").is_file():
            continue
        cfg = json.loads((d / "config.json").read_text())
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[(variant_of(cfg), cfg["seed"])] = (cfg, rows, json.loads((d / "summary.json").read_text()))
    return runs


def per_opponent(cfg, ev):
    """The sampled evaluation's goal score per (scripted style, role) of a run (its config.json and an
    evaluation row), from `eval/goal_score_episodes`: epo.py's `evaluate` plays the test tasks style by
    style (`--eval-opponents`, else the game's styles), role by role (the game's players). Runs written
    before that list was logged carry the cells themselves (`eval/vs_<style>/<role>/goal_score`)."""
    import envs

    scores = ev.get("eval/goal_score_episodes")
    if scores is None or cfg["env_id"] not in envs.TWO_PLAYER:
        return {tuple(k.split("/")[1:3]): v for k, v in ev.items()
                if k.startswith("eval/vs_") and k.endswith("/goal_score")}
    probe = envs.make(cfg["env_id"], **cfg.get("env_kwargs", {}))
    cells = [(f"vs_{style}", role) for style in (cfg.get("eval_opponents") or probe.opponent_styles())
             for role in probe.players]
    n = len(scores) // len(cells)
    if n * len(cells) != len(scores):
        raise ValueError(f"{len(scores)} evaluation games do not split into {len(cells)} (style, role) cells")
    return {cell: float(np.mean(scores[k * n:(k + 1) * n])) for k, cell in enumerate(cells)}


def fmt(vals, digits=2):
    v = np.asarray([x for x in vals if x is not None], dtype=float)
    if not len(v):
        return "n/a"
    return f"{v.mean():.{digits}f} [{v.min():.{digits}f}, {v.max():.{digits}f}]"


def curve(rows, key):
    return {r["iteration"]: r[key] for r in rows if key in r}


def report(runs, out_md, out_png, cmd_line, wall):
    variants = [v for v in VARIANTS if any(k[0] == v for k in runs)]
    seeds = sorted({k[1] for k in runs})
    iters = sorted({it for (v, s), (_, rows, _) in runs.items() for it in curve(rows, "eval/goal_score")})
    lines = [f"Tiny Negotiation strategist, rule agent; seeds {seeds}; mean [min, max] over seeds. Evaluation: "
             "each test task in both roles against the four scripted styles (tough, fair, conceding, tit_for_tat), "
             "strategies sampled at temperature 0.7; iteration 0 = before training.", "",
             "Goal score (0-10) against the scripted styles, per iteration:", ""]
    head = "| method | " + " | ".join(f"it {i}" for i in iters) + " |"
    lines += [head, "|" + "---|" * (len(iters) + 1)]
    for v in variants:
        cells = [fmt([curve(runs[(v, s)][1], "eval/goal_score").get(i) for s in seeds if (v, s) in runs]) for i in iters]
        lines.append(f"| {VARIANTS[v][1]} | " + " | ".join(cells) + " |")
    lines += ["", "After training (last evaluation):", "",
              "| method | goal score | deal rate | win rate | greedy goal score | self-chat goal score | self-chat deal rate |",
              "|---|---|---|---|---|---|---|"]
    keys = ["eval/goal_score", "eval/deal_rate", "eval/success", "eval/goal_score_greedy", "eval/selfplay_goal_score",
            "eval/selfplay_deal_rate"]
    for v in variants:
        evs = [runs[(v, s)][2]["last_eval"] for s in seeds if (v, s) in runs]
        lines.append(f"| {VARIANTS[v][1]} | " + " | ".join(fmt([e.get(k) for e in evs]) for k in keys) + " |")
    cells = {key: per_opponent(cfg, s["last_eval"]) for key, (cfg, _, s) in runs.items()}
    styles = sorted({st[3:] for c in cells.values() for st, _ in c})
    roles = sorted({r for c in cells.values() for _, r in c})
    if styles:
        lines += ["", "Goal score after training, per scripted opponent and role:", "",
                  "| method | " + " | ".join(f"{st} / {r}" for st in styles for r in roles) + " |",
                  "|" + "---|" * (len(styles) * len(roles) + 1)]
        for v in variants:
            evs = [cells[(v, s)] for s in seeds if (v, s) in runs]
            lines.append(f"| {VARIANTS[v][1]} | " + " | ".join(
                fmt([e.get((f"vs_{st}", r)) for e in evs]) for st in styles for r in roles) + " |")
    lines += ["", "Training episodes (self-chat), mean over the last 3 iterations:", "",
              "| method | goal score | deal rate | critical turns | trajectories with zero weight |", "|---|---|---|---|---|"]
    for v in variants:
        def last3(key):
            out = []
            for s in seeds:
                if (v, s) in runs:
                    vals = [r[key] for r in runs[(v, s)][1] if key in r][-3:]
                    out.append(float(np.mean(vals)) if vals else None)
            return out
        lines.append(f"| {VARIANTS[v][1]} | " + " | ".join(fmt(last3(k)) for k in (
            "charts/goal_score", "charts/deal_rate", "credit/critical_frac", "credit/zero_weight_traj_frac")) + " |")
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
    panels = [("eval/goal_score", "goal score vs scripted styles"), ("eval/deal_rate", "deal rate vs scripted styles"),
              ("eval/selfplay_goal_score", "self-chat goal score (test)"), ("charts/goal_score", "training self-chat goal score")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    colors = {"epo": "tab:blue", "prm_none": "tab:orange", "ones": "tab:green"}
    for v in variants:
        for ax, (key, title) in zip(axes, panels):
            curves = [curve(runs[(v, s)][1], key) for s in seeds if (v, s) in runs]
            xs = sorted(set.intersection(*[set(c) for c in curves])) if curves else []
            if not xs:
                continue
            y = np.asarray([[c[x] for x in xs] for c in curves])
            ax.plot(xs, y.mean(0), color=colors[v], label=VARIANTS[v][1], marker="o", ms=3)
            ax.fill_between(xs, y.min(0), y.max(0), color=colors[v], alpha=0.2)
            ax.set_title(title)
            ax.set_xlabel("iteration")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    print(f"wrote {out_md} and {out_png}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--num-iterations", type=int, default=8)
    p.add_argument("--episodes-per-iteration", type=int, default=64)
    p.add_argument("--eval-num-tasks", type=int, default=12)
    p.add_argument("--model-name", default="tiny", help="'tiny' or a tiny strategist checkpoint directory")
    p.add_argument("--tiny-preset", default="default")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (each uses one torch thread)")
    p.add_argument("--out-dir", default=str(REPO / "runs" / "bench_epo"))
    p.add_argument("--docs-dir", default=str(REPO / "docs"), help="where epo_bench.md and epo_bench.png go")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more epo.py flags")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shown = ["<tiny checkpoint dir>" if a == args.model_name and a != "tiny" else a for a in sys.argv[1:]
             if a != "--report-only"]
    cmd_line = "python benchmarks/epo_bench.py " + " ".join(shown)
    if not args.report_only:
        if args.model_name == "tiny":
            from common.tiny import ensure_tiny, strategist_overrides

            # build once before the parallel runs (the same recipe epo.py asks for)
            ensure_tiny("negotiation", args.tiny_preset, overrides=strategist_overrides("negotiation"))
        queue = [(v, s) for s in args.seeds for v in args.variants]
        running = []
        while queue or running:
            while queue and len(running) < args.parallel:
                v, s = queue.pop(0)
                running.append((v, s, run_one(v, s, args, out_dir)))
                print(f"started {v} seed {s}")
            time.sleep(5)
            for item in list(running):
                if item[2].poll() is not None:
                    print(f"finished {item[0]} seed {item[1]} rc={item[2].returncode} ({time.time() - t0:.0f} s)")
                    running.remove(item)
    runs = load_runs(out_dir)
    if not runs:
        sys.exit(f"error: no finished runs in {out_dir}")
    docs = Path(args.docs_dir)
    report(runs, docs / "epo_bench.md", docs / "epo_bench.png", cmd_line,
           None if args.report_only else time.time() - t0)


if __name__ == "__main__":
    main()
