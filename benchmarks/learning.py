"""One learning benchmark runner for all five method scripts: run variants x seeds of one script, each as
its DEFAULT run plus the variant's flags, and append one JSON line per finished run to a results file.

    python benchmarks/learning.py --script graphgpo \\
        --variants graphgpo= grpo="--step-advantage none" gigpo="--step-advantage gigpo" \\
        --seeds 4 5 6 7 8 --parallel 2 --out docs/results/graphgpo.jsonl
    python benchmarks/learning.py ... -- --eval-num-tasks 50     # flags after `--` go to every run

Every (variant, seed) runs, as a subprocess in the repository root,

    python <script>.py --seed S --torch-threads 1 --output-dir <scratch> --exp-name <variant> <variant flags> <extra>

so everything not named is the script's own default: the point is to measure the run a user gets. The
scratch run directory is deleted after its line is written (`--keep-runs DIR` keeps the runs there).
The line's keys: `RECORD_KEYS` (docs/design.md, "Benchmarks"); its tables: `python benchmarks/report.py`.

Resumable: a run whose (variant, seed, command) is already in the --out file is skipped (`--rerun` runs
it again; report.py uses the last line of each). With `--keep-runs DIR` a killed run also resumes: its
directory is DIR/learning_<bench>/<variant>__<seed>__<command hash>, so the same command continues it
from its last checkpoint (`<script>.py --resume RUN_DIR`); its `wall_seconds` sums the sittings and
`sittings` counts them. A run that fails is reported with the end of its log, is not written, and the
runner exits 1 after the other runs finish.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import scipy.stats

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ("graphgpo", "istar", "delta_belief", "aria", "epo")
RUNNER_FLAGS = ("--seed", "--torch-threads", "--output-dir", "--exp-name")  # the runner sets these
RECORD_KEYS = ("bench", "script", "variant", "variant_flags", "extra_flags", "command", "seed", "env_id",
               "metric", "before", "before_se", "after", "after_se", "change", "change_se", "fell", "paired",
               "change_se_quadrature", "greedy", "curve", "credit_means", "perf_means", "train_charts",
               "wall_seconds", "sittings", "iterations", "config",
               "tiny_policy", "machine", "git", "parallel", "finished_at")


class UsageError(Exception):
    """A bad flag: printed as one `error:` line."""


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    """The runner's flags; everything after the first `--` becomes `extra` (flags for every run)."""
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python benchmarks/learning.py", description=__doc__.split("\n")[0],
                                epilog="Flags after `--` are passed to every run.")
    p.add_argument("--script", required=True, help=f"the method script: one of {', '.join(SCRIPTS)}")
    p.add_argument("--variants", nargs="+", required=True, metavar="NAME=FLAGS",
                   help='NAME=FLAGS per variant, FLAGS quoted as one word, e.g. grpo="--step-advantage none"; '
                        "NAME= runs the script's defaults")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--out", required=True, help="the JSONL results file (appended to), e.g. docs/results/graphgpo.jsonl")
    p.add_argument("--bench", default=None, help="the bench name written in every line (default: the --out file's stem)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time, one torch thread each (default 1)")
    p.add_argument("--rerun", action="store_true", help="run (variant, seed, command)s already in --out again")
    p.add_argument("--keep-runs", default=None, metavar="DIR", help="keep the run directories under DIR; a killed run "
                        "found there again resumes from its last checkpoint")
    args = p.parse_args(argv)
    args.extra = extra
    args.script = args.script.removesuffix(".py")
    if args.script not in SCRIPTS:
        raise UsageError(f"--script {args.script!r} is not a method script; use one of {', '.join(SCRIPTS)}")
    args.variants = parse_variants(args.variants)
    if len(set(args.seeds)) != len(args.seeds):
        raise UsageError(f"--seeds has a repeated seed: {args.seeds}")
    if args.parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {args.parallel}")
    if not args.out.endswith(".jsonl"):
        raise UsageError(f"--out must be a .jsonl file, got {args.out!r}")
    check_flags("extra flags (after --)", args.extra)
    args.bench = args.bench or Path(args.out).stem
    return args


def parse_variants(tokens: list[str]) -> dict[str, list[str]]:
    """["graphgpo=", "grpo=--step-advantage none"] -> {"graphgpo": [], "grpo": ["--step-advantage", "none"]}."""
    variants = {}
    for tok in tokens:
        name, sep, flags = tok.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise UsageError(f"--variants: {tok!r} is not NAME=FLAGS (NAME: letters, digits, _ . -; "
                             f"e.g. grpo=\"--step-advantage none\", or graphgpo= for the defaults)")
        if name in variants:
            raise UsageError(f"--variants: the name {name!r} is given twice")
        try:
            variants[name] = shlex.split(flags)
        except ValueError as e:
            raise UsageError(f"--variants: cannot split the flags of {name!r} ({e})") from None
        check_flags(f"variant {name!r}", variants[name])
    return variants


def check_flags(where: str, flags: list[str]) -> None:
    for f in flags:
        if f.split("=", 1)[0] in RUNNER_FLAGS:
            raise UsageError(f"{where}: {f.split('=', 1)[0]} is set by the runner (it sets {', '.join(RUNNER_FLAGS)})")


def user_command(script: str, seed: int, flags: list[str], extra: list[str]) -> str:
    """The command as a user types it: the run's argv without the scratch --output-dir and --exp-name."""
    return shlex.join(["python", f"{script}.py", "--seed", str(seed), "--torch-threads", "1", *flags, *extra])


# ----------------------------------------------------------------------------------------------
# Results file, machine, git
# ----------------------------------------------------------------------------------------------
def read_results(path: Path) -> list[dict]:
    """Every line of a results file (none if it does not exist); a line that is not JSON is an error."""
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{n} is not a JSON line ({e.msg})") from None
    return out


def run_key(rec: dict) -> tuple:
    return rec["variant"], rec["seed"], rec["command"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict:
    """What the run's wall time and numbers depend on (the load average is added per run)."""
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": package_version("torch"),
            "transformers": package_version("transformers")}


def git_info() -> dict:
    """The commit, and the tracked files outside docs/ that differ from it (docs do not change a result)."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout

    commit = git("rev-parse", "HEAD").strip() or None
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    changed = [f for f in changed if not f.startswith("docs/")]
    return {"commit": commit, "dirty": bool(changed), "dirty_files": changed[:20]}


# ----------------------------------------------------------------------------------------------
# The tiny policy of a run (resolved in a subprocess before the runs, so a bad flag fails early)
# ----------------------------------------------------------------------------------------------
def resolve_policies(script: str, flag_sets: list[list[str]]) -> list[dict]:
    """For each flag list, the policy the script will load: parses the flags with the script's own `Args`
    (a bad flag -> UsageError, before any run starts) and, for a tiny policy, makes sure it is built
    (once, here, so that no run's wall time includes a build) and describes it. One subprocess for all."""
    print(f"checking the flags and the policy of {script}.py (a tiny policy not built yet is built now)", flush=True)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--resolve-policies", script,
                           json.dumps(flag_sets)], cwd=REPO, stdout=subprocess.PIPE, text=True)  # stderr: build progress
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise UsageError(f"could not resolve the policy of {script}.py (exit {proc.returncode}; its output is above)")
    out = json.loads(lines[-1])
    for flags, res in zip(flag_sets, out):
        if "error" in res:
            raise UsageError(f"{script}.py does not accept the flags {shlex.join(flags)!r}: {res['error']}")
    return out


def _resolve_policies_main(script: str, flag_sets_json: str) -> None:
    """The subprocess side of resolve_policies: prints one JSON list, one entry per flag list."""
    sys.path.insert(0, str(REPO))
    import torch
    import tyro

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location(script, REPO / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[script] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    out = []
    for flags in json.loads(flag_sets_json):
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                args = mod.with_defaults(tyro.cli(mod.Args, args=flags))  # the run size the script will take
        except SystemExit:
            lines = [ln.strip(" -│╭╮╰╯─") for ln in buf.getvalue().splitlines()]
            lines = [ln for ln in lines if ln and not ln.startswith("For full helptext")]  # tyro's box, as one line
            msg = f"{lines[0]}: {' '.join(lines[1:])}" if len(lines) > 1 else " ".join(lines)
            out.append({"error": re.sub(r"\s+", " ", msg).strip() or "rejected by the script's argument parser"})
            continue
        try:
            out.append(describe_policy(mod, args))
        except Exception as e:  # noqa: BLE001 - e.g. an unknown env id: one line back to the runner
            out.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
    print(json.dumps(out))


def describe_policy(mod, args) -> dict:
    """The tiny policy `args` loads (building it if needed): its directory name, where it came from, its
    recipe hash, a hash of its weights and its test success; {"model_name": ...} for any other model."""
    from common import tiny

    name = args.model_name
    if name == "tiny":
        # EPO's tiny strategist is built with its own recipe overrides (common/tiny.py)
        overrides = tiny.strategist_overrides(args.env_id) if mod.__name__ == "epo" else None
        path = tiny.ensure_tiny(args.env_id, preset=args.tiny_preset, overrides=overrides)
    else:
        path = Path(name).expanduser()
        if not (path / "tiny_meta.json").is_file():
            return {"model_name": name, "tiny": False}
    meta = tiny.read_meta(path)
    weights = path / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else None
    source = "shipped" if Path(path).resolve().is_relative_to(REPO / "common") else "cache"
    return {"model_name": name, "tiny": True, "dir": Path(path).name, "source": source,
            "recipe_hash": meta.get("recipe_hash"), "weights_sha256": digest, "success": meta.get("success"),
            "built_at": meta.get("built_at")}


# ----------------------------------------------------------------------------------------------
# One run -> one JSON line
# ----------------------------------------------------------------------------------------------
@dataclass
class Job:
    variant: str
    seed: int
    flags: list
    command: str


def numeric_means(rows: list[dict], prefix: str) -> dict:
    """Mean over the iterations that logged it of every numeric `prefix*` key."""
    vals: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and isinstance(v, (int, float)) and not isinstance(v, bool):
                vals.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sorted(vals.items())}


def window_means(rows: list[dict], prefix: str, frac: float = 0.25) -> dict:
    """Means of every numeric `prefix*` key over the first and over the last `frac` of the iterations
    that logged one (at least one iteration each; {} if none did): how the training rollouts changed,
    to read beside the change of the test metric."""
    logged = [r for r in rows if any(k.startswith(prefix) for k in r)]
    if not logged:
        return {}
    k = max(1, round(len(logged) * frac))
    return {"iterations": k, "first": numeric_means(logged[:k], prefix), "last": numeric_means(logged[-k:], prefix)}


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for fewer than two values) of per-episode values."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return (float(x.mean()) if x.size else 0.0), 0.0
    return float(x.mean()), float(scipy.stats.sem(x))


def learning_summary(first: dict, last: dict, metric: str) -> dict:
    """A run's main evaluation metric before and after training, the change and its standard error; `rose` /
    `fell`: the change is above +2 SE / below -2 SE. When both evaluations hold the metric per episode
    (`<metric>_episodes`: the same episodes, played with common random numbers) the SE is that of the
    per-episode differences (`paired`); otherwise the two evaluations' SEs in quadrature, which is also kept
    as `change_se_quadrature` (the SE two independent evaluations would give)."""
    before, after = float(first[metric]), float(last[metric])
    se0, se1 = float(first.get(metric + "_se", 0.0)), float(last.get(metric + "_se", 0.0))
    change, quadrature = after - before, math.sqrt(se0 ** 2 + se1 ** 2)
    a, b = first.get(metric + "_episodes"), last.get(metric + "_episodes")
    paired = a is not None and b is not None and len(a) == len(b) > 1
    se = mean_se(np.subtract(b, a))[1] if paired else quadrature
    return {"metric": metric, "before": before, "before_se": se0, "after": after, "after_se": se1,
            "change": change, "change_se": se, "change_se_quadrature": quadrature, "paired": paired,
            "rose": bool(change > 2.0 * se), "fell": bool(change < -2.0 * se)}


def run_learning(run_dir: Path) -> dict:
    """The learning block of a finished run: its summary.json's first and last evaluation of its main metric
    (older summaries carry the block themselves)."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    if "learning" in summary:
        return summary["learning"]
    return learning_summary(summary["first_eval"], summary["last_eval"], summary["metric"])


def learning_warning(s: dict) -> str | None:
    """The line a result that made the policy worse prints (a fall of more than two standard errors)."""
    if not s["fell"]:
        return None
    return (f"WARNING: {s['metric']} fell by more than two standard errors ({s['change']:+.3f} ± "
            f"{s['change_se']:.3f}): this run made the policy worse")


def greedy_block(first: dict, last: dict, metric: str):
    """The greedy counterpart of the main metric (`<metric>_greedy`, else `eval/success_greedy`) before
    and after, with its SE where the script logs one (None otherwise); None if the script logs none."""
    for key in (metric + "_greedy", "eval/success_greedy"):
        if first.get(key) is not None and last.get(key) is not None:
            return {"metric": key, "before": first[key], "before_se": first.get(key + "_se"),
                    "after": last[key], "after_se": last.get(key + "_se")}
    return None


def collect(run_dir: Path) -> dict:
    """The measured part of a result line, from a finished run's summary.json, metrics.jsonl, config.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    learning = run_learning(run_dir)
    metric = learning["metric"]
    curve = [{"iteration": r["iteration"], "value": r[metric], "se": r.get(metric + "_se")}
             for r in rows if r.get(metric) is not None]
    return {"env_id": config.get("env_id"), **{k: learning[k] for k in (
                "metric", "before", "before_se", "after", "after_se", "change", "change_se", "fell")},
            # summaries before common random numbers have neither: their change_se is the quadrature
            "paired": bool(learning.get("paired", False)),
            "change_se_quadrature": learning.get("change_se_quadrature", learning["change_se"]),
            "greedy": greedy_block(summary["first_eval"], summary["last_eval"], metric), "curve": curve,
            "credit_means": numeric_means(rows, "credit/"), "perf_means": numeric_means(rows, "perf/"),
            "train_charts": window_means(rows, "charts/"),
            "iterations": summary["iterations"], "config": config}


def job_dir(scratch: Path, job: Job, keep: bool) -> Path:
    """Where a job's run goes: <variant>__<seed>, and with --keep-runs also a hash of its command, so that
    the same command finds its killed run again and a different command never does."""
    name = f"{job.variant}__{job.seed}"
    if keep:
        name += "__" + hashlib.sha256(job.command.encode()).hexdigest()[:8]
    return scratch / name


def resume_point(out_dir: Path) -> tuple[Path | None, bool]:
    """(the run dir to go on with, finished?) from what an earlier sitting left in `out_dir`: a finished
    run (summary.json) is collected as it is, a run with a checkpoint.pt resumes; a run killed before its
    first checkpoint is removed (it starts again)."""
    runs = sorted(d for d in out_dir.iterdir() if d.is_dir() and (d / "config.json").is_file())
    for d in runs:
        if (d / "summary.json").is_file():
            return d, True
    resumable = [d for d in runs if (d / "checkpoint.pt").is_file()]
    for d in runs:
        if d not in resumable[-1:]:
            shutil.rmtree(d, ignore_errors=True)
    return (resumable[-1] if resumable else None), False


def run_job(job: Job, script: str, extra: list[str], out_dir: Path) -> tuple[Job, int, Path, float, int, tuple, tuple]:
    """Run one (variant, seed) to completion in `out_dir` (its output appended to out_dir/run.log), going
    on from an earlier sitting's checkpoint if one is there. Returns the wall seconds of all sittings."""
    out_dir.mkdir(parents=True, exist_ok=True)
    prior, finished = resume_point(out_dir)
    walls_file = out_dir / "sittings.json"
    walls = json.loads(walls_file.read_text()) if walls_file.is_file() and prior else []
    load0, t0 = os.getloadavg(), time.time()
    if finished:
        return job, 0, out_dir, sum(walls), max(len(walls), 1), load0, load0
    if prior is not None:
        argv = [sys.executable, str(REPO / f"{script}.py"), "--resume", str(prior), "--torch-threads", "1"]
    else:
        argv = [sys.executable, str(REPO / f"{script}.py"), "--seed", str(job.seed), "--torch-threads", "1",
                "--output-dir", str(out_dir), "--exp-name", job.variant, *job.flags, *extra]

    def clock():  # this sitting's seconds so far, beside the earlier sittings'
        walls_file.write_text(json.dumps(walls + [round(time.time() - t0, 1)]))

    with open(out_dir / "run.log", "a") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        while True:
            clock()
            try:
                rc = proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
    clock()
    walls = json.loads(walls_file.read_text())
    return job, rc, out_dir, sum(walls), len(walls), load0, os.getloadavg()


def log_tail(path: Path, n: int = 12) -> str:
    try:
        lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + ln for ln in [ln for ln in lines if ln.strip()][-n:])


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    from tqdm import tqdm

    args = parse_args(argv)
    out = Path(args.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    done = {run_key(r) for r in read_results(out)}
    jobs, skipped = [], 0
    for seed in args.seeds:
        for variant, flags in args.variants.items():
            job = Job(variant, seed, flags, user_command(args.script, seed, flags, args.extra))
            if (variant, seed, job.command) in done and not args.rerun:
                skipped += 1
            else:
                jobs.append(job)
    print(f"{args.bench}: {len(jobs)} to run, {skipped} already in {out} (skipped; --rerun runs them again)")
    if not jobs:
        return 0

    # one resolution per variant that has runs to do: bad flags fail here, and a tiny policy is built once
    names = sorted({j.variant for j in jobs}, key=list(args.variants).index)
    policies = dict(zip(names, resolve_policies(args.script, [args.variants[n] + args.extra for n in names])))
    if args.parallel > (os.cpu_count() or 1):
        print(f"warning: --parallel {args.parallel} is more than the {os.cpu_count()} CPU cores here")
    git, machine = git_info(), machine_info()
    if git["dirty"]:
        print(f"warning: tracked files differ from commit {git['commit'][:10]}: {', '.join(git['dirty_files'])}")

    out.parent.mkdir(parents=True, exist_ok=True)
    keep = Path(args.keep_runs) if args.keep_runs else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    if keep:  # a fixed place, so that the same command finds a killed run again
        scratch = keep / f"learning_{args.bench}"
        scratch.mkdir(exist_ok=True)
    else:
        scratch = Path(tempfile.mkdtemp(prefix=f"learning_{args.bench}_"))  # the system's tmp
    failed, written = [], 0
    bar = tqdm(total=len(jobs), desc=f"{args.bench} ({args.script}.py)", unit="run", dynamic_ncols=True)
    pool = ThreadPoolExecutor(max_workers=args.parallel)
    futures = [pool.submit(run_job, job, args.script, args.extra, job_dir(scratch, job, bool(keep)))
               for job in jobs]
    try:
        for fut in as_completed(futures):
            job, rc, run_root, wall, sittings, load0, load1 = fut.result()
            bar.update(1)
            run_dirs = [d for d in run_root.iterdir() if (d / "summary.json").is_file()]
            try:
                if rc != 0 or len(run_dirs) != 1:
                    raise RuntimeError(f"exit code {rc}" if rc != 0 else f"{len(run_dirs)} finished run dirs")
                measured = collect(run_dirs[0])
            except Exception as e:  # noqa: BLE001 - any broken run is reported, never written, never fatal
                failed.append(job)
                tqdm.write(f"FAILED: {job.variant} seed {job.seed} ({e}); not written. Command: {job.command}\n"
                           f"  log {run_root / 'run.log'}, last lines:\n{log_tail(run_root / 'run.log')}")
                continue
            rec = {"bench": args.bench, "script": f"{args.script}.py", "variant": job.variant,
                   "variant_flags": job.flags, "extra_flags": args.extra, "command": job.command, "seed": job.seed,
                   **measured, "wall_seconds": round(wall, 2), "sittings": sittings, "tiny_policy": policies[job.variant],
                   "machine": {**machine, "load_average_start": [round(x, 2) for x in load0],
                               "load_average_end": [round(x, 2) for x in load1]},
                   "git": git, "parallel": args.parallel,
                   "finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
            with open(out, "a") as f:
                f.write(json.dumps({k: rec[k] for k in RECORD_KEYS}) + "\n")
            written += 1
            if not keep:
                shutil.rmtree(run_root, ignore_errors=True)
            else:  # kept under a new name: a --rerun of the same command starts a new run
                run_root.rename(run_root.with_name(f"{run_root.name}__{rec['finished_at'].replace(':', '')}"))
            tqdm.write(f"{job.variant} seed {job.seed}: {rec['metric']} {rec['before']:.3f} -> {rec['after']:.3f} "
                       f"({rec['change']:+.3f} ± {rec['change_se']:.3f}), {wall:.0f} s")
            if learning_warning(rec):
                tqdm.write(f"{job.variant} seed {job.seed}: " + learning_warning(rec))
    except KeyboardInterrupt:  # the runs in flight got the same SIGINT; start no new ones
        pool.shutdown(wait=False, cancel_futures=True)
        print(f"\ninterrupted: {written} runs written to {out}; run the same command again to resume"
              + (" (the runs in flight go on from their last checkpoints)" if keep else ""), file=sys.stderr)
        return 130
    pool.shutdown()
    bar.close()
    if not keep and not failed:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.bench}: {written} written to {out}, {skipped} skipped, {len(failed)} failed")
    if failed:
        print("FAILED runs (not written; their logs are under " + str(scratch) + "):\n"
              + "\n".join(f"  {j.variant} seed {j.seed}: {j.command}" for j in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--resolve-policies"]:  # internal: the subprocess of resolve_policies
        _resolve_policies_main(sys.argv[2], sys.argv[3])
        sys.exit(0)
    try:
        sys.exit(main(sys.argv[1:]))
    except UsageError as e:
        sys.exit(f"error: {e}")
