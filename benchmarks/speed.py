"""Where a method script's time goes, before and after a change, measured side by side on one machine.

    python benchmarks/speed.py --baseline ffa6081                       # this checkout vs that commit
    python benchmarks/speed.py --scripts istar --before-flags "--no-reuse-sampling-logprobs"
    python benchmarks/speed.py --full --repeats 1 --scripts aria        # the default runs themselves

Each script runs a fixed run (`SHORT`: its default run cut to a few iterations and test tasks, one torch
thread; `--full`: the default run as a user gets it) in two arms, "before" and "after", alternating
which arm goes first from one repeat to the next, so that drift in the machine's load falls on both:

- before: the same command in a git worktree of `--baseline REV` (the old code), or in this checkout
  with `--before-flags` added (a flag that turns an optimisation off);
- after: this checkout as it is.

From each run's metrics.jsonl and its wall time: start-up (the wall time not spent in an evaluation or
an iteration: imports, model load, env set-up, writing files), evaluation, and per iteration rollout,
credit (iStar: its PRM step, `perf/prm_seconds`; ARIA: embedding and clustering) and update (iStar: with
the old-policy log-probs it takes before the PRM step). One JSON line per run goes to
--out (docs/results/speed.jsonl); the table of medians per phase, with the after/before ratio, is
written to docs/speed.md by `--report` (and after every invocation). A line also records whether the
run's deterministic training metrics equal the other arm's of the same repeat on every key both logged
(`same_metrics`): a speed change that computes the same thing must say yes.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from learning import git_info, log_tail, machine_info  # noqa: E402

SCRIPTS = ("graphgpo", "istar", "delta_belief", "aria", "epo")
# A run short enough to repeat: two iterations (an evaluation before, one at the end), a few test tasks.
SHORT = ["--num-iterations", "2", "--eval-every", "2", "--eval-num-tasks", "20", "--checkpoint-every", "0"]
PHASES = ("startup", "eval", "rollout", "credit", "update", "wall")
CLOCK = ("perf/", "_seconds", "_time_frac")  # keys that hold times, not results


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/speed.py", description=__doc__.split("\n")[0])
    p.add_argument("--scripts", nargs="+", default=list(SCRIPTS), help="method scripts (default: all five)")
    p.add_argument("--baseline", default=None, metavar="REV", help="the before arm: this git revision")
    p.add_argument("--before-flags", default="", help="the before arm: this checkout with these flags added")
    p.add_argument("--flags", default="", help="flags added to both arms")
    p.add_argument("--full", action="store_true", help="the default runs, not the short ones")
    p.add_argument("--repeats", type=int, default=2, help="runs per arm and script (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    p.add_argument("--out", default=str(REPO / "docs" / "results" / "speed.jsonl"))
    p.add_argument("--doc", default=str(REPO / "docs" / "speed.md"))
    p.add_argument("--label", default=None, help="the name of this comparison in the table (default: the arms)")
    p.add_argument("--report", action="store_true", help="only write the table from --out")
    args = p.parse_args(argv)
    args.scripts = [s.removesuffix(".py") for s in args.scripts]
    bad = [s for s in args.scripts if s not in SCRIPTS]
    if bad:
        p.error(f"--scripts: not a method script: {', '.join(bad)}; use {', '.join(SCRIPTS)}")
    if not args.report and bool(args.baseline) == bool(args.before_flags):
        p.error("give the before arm: --baseline REV (old code) or --before-flags FLAGS (a switch off)")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def worktree(rev: str) -> Path:
    """A detached worktree of `rev` in a temporary directory (removed by `drop_worktree`)."""
    path = Path(tempfile.mkdtemp(prefix="speed_baseline_"))
    out = subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: cannot check out --baseline {rev!r}: {out.stderr.strip()}")
    return path


def drop_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)


def phases(run_dir: Path, wall: float) -> dict:
    """Seconds per phase of one finished run, from its metrics.jsonl and the process's wall time."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    total = {k: sum(r.get(f"perf/{k}_seconds") or 0.0 for r in rows)
             for k in ("eval", "rollout", "credit", "prm", "old_logprob", "update", "iteration")}
    return {"startup": wall - total["eval"] - total["iteration"], "eval": total["eval"],
            "rollout": total["rollout"], "credit": total["credit"] + total["prm"],  # iStar: the PRM step
            "update": total["update"] + total["old_logprob"], "wall": wall,
            "iterations": sum(1 for r in rows if "perf/iteration_seconds" in r)}


def training_metrics(run_dir: Path) -> list:
    """The run's metrics without the wall-clock ones: equal in two runs that computed the same thing."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not any(c in k for c in CLOCK)} for r in rows]


def same_metrics(a: list, b: list) -> bool:
    """Two runs' training metrics agree: the same rows, equal on every key both logged (a change that moves
    a statistic out of the method file drops its keys, and that alone is no difference in training)."""
    return len(a) == len(b) and all(ra[k] == rb[k] for ra, rb in zip(a, b) for k in ra.keys() & rb.keys())


def largest_difference(a: list, b: list) -> float:
    """The largest relative difference |x - y| / max(|x|, |y|) over the numbers both runs logged (0: the same
    metrics; inf: different rows, or a value that is not a number differs). A change that keeps the sampled
    tokens but sums in another order (log-probs kept from sampling, merged weights) moves losses in the
    last digits: ~1e-7, where a changed episode moves a success rate by 1/n."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for ra, rb in zip(a, b):
        for k in ra.keys() & rb.keys():
            x, y = ra[k], rb[k]
            if x == y:
                continue
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y)):
                return math.inf
            worst = max(worst, abs(x - y) / max(abs(x), abs(y)))
    return worst


def run_one(tree: Path, script: str, flags: list, scratch: Path, threads: int) -> tuple[Path, float]:
    out = scratch / f"run_{time.time_ns()}"
    out.mkdir(parents=True)
    cmd = [sys.executable, f"{script}.py", "--torch-threads", str(threads), "--output-dir", str(out), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    runs = [d for d in out.iterdir() if d.is_dir() and (d / "metrics.jsonl").is_file()]
    if proc.returncode != 0 or len(runs) != 1:
        raise SystemExit(f"error: {script}.py failed in {tree} (exit {proc.returncode}): "
                         f"{shlex.join(cmd)}\n{log_tail(out / 'log.txt')}")
    return runs[0], wall


def measure(args) -> None:
    before_tree = worktree(args.baseline) if args.baseline else REPO
    base = ([] if args.full else SHORT) + shlex.split(args.flags)
    arms = {"before": (before_tree, base + shlex.split(args.before_flags)), "after": (REPO, base)}
    label = args.label or (f"{args.baseline} -> {git_info()['commit'][:10]}" if args.baseline
                           else f"{args.before_flags} -> (default)")
    machine = machine_info()
    try:
        with tempfile.TemporaryDirectory(prefix="speed_") as scratch:
            for script in args.scripts:
                for rep in range(args.repeats):
                    order = ("before", "after") if rep % 2 == 0 else ("after", "before")
                    done = {}
                    for arm in order:
                        tree, flags = arms[arm]
                        run_dir, wall = run_one(tree, script, flags, Path(scratch), args.threads)
                        done[arm] = (phases(run_dir, wall), training_metrics(run_dir))
                        print(f"{script} {arm} repeat {rep}: "
                              + ", ".join(f"{k} {v:.1f} s" for k, v in done[arm][0].items()
                                          if k != "iterations"), flush=True)
                    same = same_metrics(done["before"][1], done["after"][1])
                    diff = largest_difference(done["before"][1], done["after"][1])
                    for arm in order:
                        rec = {"label": label, "script": script, "arm": arm, "repeat": rep, "first": order[0],
                               "full": args.full, "flags": arms[arm][1], "threads": args.threads,
                               "seconds": done[arm][0], "same_metrics": same, "machine": machine,
                               "largest_difference": diff if math.isfinite(diff) else None,
                               "commit": git_info()["commit"] if arm == "after" else args.baseline,
                               "finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
                        with open(args.out, "a") as f:
                            f.write(json.dumps(rec) + "\n")
    finally:
        if args.baseline:
            drop_worktree(before_tree)


def report(out: Path, doc: Path) -> str:
    """docs/speed.md: per comparison and script, the median seconds per phase in each arm, the ratio."""
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()] if out.is_file() else []
    text = ["# Speed: where a run's time goes, before and after", "",
            "Generated by `python benchmarks/speed.py` from docs/results/speed.jsonl (one line per run);",
            "each comparison runs both arms on the same machine, alternating which goes first. Seconds are",
            "medians over the repeats (n) with their range, one torch thread per run; ratio = after / before of",
            "the medians;",
            "`same` says whether the two arms wrote the same training metrics in every repeat: `yes` (equal),",
            "the largest relative difference of any logged number where all are within 1e-4 (the same episodes,",
            "sums in another order), or `no`.", ""]
    for label in dict.fromkeys(r["label"] for r in lines):
        mine = [r for r in lines if r["label"] == label]
        full = "default runs" if mine[0]["full"] else "short runs (`SHORT`)"
        text += [f"## {label}", "", f"{full}; machine: {mine[0]['machine']['cpu_model']}, "
                 f"{mine[0]['machine']['cpu_count']} cores.", "",
                 "| script | phase | before s (range) | after s (range) | ratio | n | same |",
                 "|---|---|---|---|---|---|---|"]
        for script in dict.fromkeys(r["script"] for r in mine):
            rows = {arm: [r for r in mine if r["script"] == script and r["arm"] == arm] for arm in ("before", "after")}
            diffs = [r.get("largest_difference") for r in rows["after"]]
            same = ("yes" if all(r["same_metrics"] for r in rows["after"]) else
                    f"{max(diffs):.0e}" if all(d is not None and d <= 1e-4 for d in diffs) else "no")
            for phase in PHASES:
                vals = {arm: [r["seconds"][phase] for r in rs] for arm, rs in rows.items() if rs}
                if len(vals) < 2:
                    continue
                med = {arm: statistics.median(v) for arm, v in vals.items()}
                cell = {arm: f"{med[arm]:.1f} ({min(v):.1f}-{max(v):.1f})" for arm, v in vals.items()}
                ratio = med["after"] / med["before"] if med["before"] > 0 else float("nan")
                text.append(f"| {script} | {phase} | {cell['before']} | {cell['after']} | {ratio:.2f} | "
                            f"{len(rows['after'])} | {same} |")
        text.append("")
    doc.write_text("\n".join(text) + "\n")
    return doc.read_text()


def main(argv) -> int:
    args = parse_args(argv)
    if not args.report:
        measure(args)
    report(Path(args.out), Path(args.doc))
    print(f"table: {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
