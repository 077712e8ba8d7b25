"""SmolLM2-135M-Instruct (`--model-name smollm2-135m`) through every script on CPU: zero-shot success on
every env, with and without the think format; time per iteration (rollout / credit / update), tokens per
second and peak memory of each script, plain and 4-bit. (Its SFT-then-RL stage on Sokoban, superseded by
the shipped SmolLM2 adapters, docs/smollm2.md, is in git history: `git show bee9ea9:benchmarks/real_model.py`.)

    python benchmarks/real_model.py zeroshot                 # every env x {think, action}: greedy episodes
    python benchmarks/real_model.py timing                   # every script x {plain, 4-bit}: one iteration
    python benchmarks/real_model.py report                   # docs/real_model.md from the raw results

Every stage appends one JSON object per measurement to docs/results/real_model.jsonl (the raw results;
`report` keeps the last record of each key) and rewrites docs/real_model.md from that file. One process
at a time, `--threads` torch threads (default 2). The load average of the machine is recorded with every
measurement: on a shared machine other jobs slow every number down.

Zero-shot: the model plays the first `--num-tasks` test tasks of every env greedily for at most
`--max-turns` turns (default 6; 0: the env's own limit), all envs in one batch (one `generate` per turn for every live episode), with the scripts' own shared blocks (graphgpo.render_prompt, encode, generate, completion_text: a
completion cut at max_new_tokens is an invalid action). "think" is the envs' own instruct format ("Think
briefly inside <think>...</think>, then give exactly one action inside <action>...</action>."), "action"
replaces that sentence by "Give exactly one action inside <action>...</action> and nothing else.".
Two-player games are played as the first role against the scripted "fair" style (`envs.vs_opponent`).

Timing: each script as a subprocess on its default env with a fixed small budget (`TIMING_ARGS`); the
per-phase seconds are the script's own `perf/` metrics, peak memory is the subprocess's maximum resident
set size (`os.wait4`), and the zero-shot column is the script's own first evaluation (its main metric).

"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from learning import mean_se, run_learning  # noqa: E402 - the before -> after of a finished run


RESULTS = REPO / "docs" / "results" / "real_model.jsonl"
REPORT = REPO / "docs" / "real_model.md"
MODEL = "smollm2-135m"
ACTION_FORMAT = "Give exactly one action inside <action>...</action> and nothing else."
FORMATS = ("think", "action")
SCRIPTS = ("graphgpo.py", "istar.py", "delta_belief.py", "aria.py", "epo.py")
# One iteration of each script on its default env: 1 task x group 4 where the script groups (ARIA: 4
# self-play games, EPO: 4 episodes), at most 2 turns where the script can cut episodes, 32 new tokens,
# evaluation on 1 test task: a budget that a loaded 2-core machine runs for all 10 cases in well under an hour.
TIMING_COMMON = ["--num-iterations", "1", "--max-new-tokens", "32", "--eval-num-tasks", "1", "--checkpoint-every", "0"]
TIMING_ARGS = {
    "graphgpo.py": ["--tasks-per-iteration", "1", "--group-size", "4", "--max-turns", "2"],
    "istar.py": ["--tasks-per-iteration", "1", "--group-size", "4", "--max-turns", "2"],
    "delta_belief.py": ["--tasks-per-iteration", "1", "--group-size", "4", "--max-turns", "2", "--eval-k", "1"],
    "aria.py": ["--games-per-iteration", "4", "--max-turns", "2", "--eval-k", "1", "--eval-opponents", "fair",
                "--num-epochs", "1"],
    "epo.py": ["--episodes-per-iteration", "4", "--num-epochs", "1", "--trajectories-per-step", "4",
               "--eval-opponents", "fair", "--no-eval-selfplay"],
}


def load_avg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return float("nan")


def append(record: dict, path=RESULTS) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg": record.get("load_avg", load_avg())}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KB on Linux


# ----------------------------------------------------------------------------------------------
# Zero-shot
# ----------------------------------------------------------------------------------------------
def with_format(env, fmt: str):
    """The env with its instruct format sentence kept ("think") or replaced ("action"), in the system prompt."""
    import envs

    if fmt == "think":
        return env
    original = env.messages

    def messages():
        msgs = original()
        system = msgs[0]["content"]
        if envs.INSTRUCT_FORMAT not in system:
            raise ValueError(f"{env.env_id}: the system prompt has no instruct format sentence to replace")
        return [{**msgs[0], "content": system.replace(envs.INSTRUCT_FORMAT, ACTION_FORMAT)}, *msgs[1:]]

    env.messages = messages
    return env


def make_single_agent(env_id: str, fmt: str):
    import envs

    game = envs.make(env_id)
    env = envs.vs_opponent(game, "rule:fair") if env_id in envs.TWO_PLAYER else game
    return with_format(env, fmt)


def play(model, tok, specs, fmt, max_new_tokens, max_turns=0):
    """Greedy episodes of every (env_id, task) in `specs` in one batch (all envs of all env ids stepped
    together: one generate per turn for every live episode); returns per-episode records."""
    import graphgpo as g

    envs_ = []
    for env_id, task in specs:
        env = make_single_agent(env_id, fmt)
        if max_turns:
            env.max_turns = max_turns
        env.reset(task)
        envs_.append(env)
    eps = [{"env_id": env_id, "success": False, "turns": 0, "invalid": 0, "cut": 0, "tokens": 0}
           for env_id, _ in specs]
    while True:
        live = [i for i, e in enumerate(envs_) if not e.done]
        if not live:
            break
        prompts = [g.encode(tok, g.render_prompt(tok, envs_[i].messages())) for i in live]
        comps = g.generate(model, tok, prompts, 1.0, max_new_tokens, greedy=True)
        for k, i in enumerate(live):
            st = envs_[i].step(g.completion_text(tok, comps[k]))
            e = eps[i]
            e["turns"] += 1
            e["invalid"] += bool(st.info.get("invalid"))
            e["cut"] += comps[k][-1:] != [tok.eos_token_id]
            e["tokens"] += len(comps[k])
            if st.done:
                e["success"] = bool(st.info.get("success"))
    return eps


def zeroshot(args):
    import torch

    import envs
    from common.models import load_policy

    torch.set_num_threads(args.threads)
    model, tok = load_policy(MODEL, load_in_4bit=False, device="cpu")
    model.eval()
    env_ids = args.envs or envs.available()
    specs, horizon = [], {}
    for env_id in env_ids:
        probe = make_single_agent(env_id, "think")
        horizon[env_id] = args.max_turns or probe.max_turns
        specs += [(env_id, t) for t in list(probe.task_ids("test"))[: args.num_tasks]]
    for fmt in args.formats:
        budget = args.think_tokens if fmt == "think" else args.action_tokens
        t0, load0 = time.time(), load_avg()
        eps = play(model, tok, specs, fmt, budget, args.max_turns)
        sec = time.time() - t0
        all_tokens = sum(e["tokens"] for e in eps)
        for env_id in env_ids:
            mine = [e for e in eps if e["env_id"] == env_id]
            turns = sum(e["turns"] for e in mine)
            succ, se = mean_se([float(e["success"]) for e in mine])
            rec = {"kind": "zeroshot", "model": MODEL, "env_id": env_id, "format": fmt, "tasks": len(mine),
                   "max_new_tokens": budget, "max_turns": horizon[env_id], "success": succ, "success_se": se,
                   "invalid_rate": sum(e["invalid"] for e in mine) / max(turns, 1),
                   "cut_rate": sum(e["cut"] for e in mine) / max(turns, 1),
                   "tokens_per_turn": sum(e["tokens"] for e in mine) / max(turns, 1), "turns": turns,
                   "batch_seconds": round(sec, 1), "batch_episodes": len(eps),
                   "tokens_per_second": all_tokens / max(sec, 1e-9),
                   "peak_rss_gb": round(peak_rss_gb(), 2), "threads": args.threads,
                   "load_avg": max(load0, load_avg())}
            append(rec, args.results)
            print(f"{env_id:17s} {fmt:6s} success {succ:.3f} ± {se:.3f}  invalid {rec['invalid_rate']:.2f}  "
                  f"cut {rec['cut_rate']:.2f}", flush=True)
        print(f"{fmt}: {len(eps)} episodes in {sec:.0f} s, {all_tokens / max(sec, 1e-9):.1f} generated tokens/s",
              flush=True)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
def run_script(script, extra, out_dir, threads, log, model=MODEL):
    """Run a method script on `model`; returns (exit code, wall seconds, peak RSS GB, run dir or None, cmd)."""
    cmd = [sys.executable, str(REPO / script), "--model-name", str(model), "--output-dir", str(out_dir),
           "--torch-threads", str(threads), *extra]
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    runs = sorted((p for p in Path(out_dir).iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return proc.returncode, time.time() - t0, usage.ru_maxrss / 2 ** 20, (runs[-1] if runs else None), cmd


def timing(args):
    out_root = Path(args.work_dir) / "timing"
    for script in args.scripts:
        for four_bit in args.precisions:
            out = out_root / f"{script[:-3]}_{'4bit' if four_bit else 'plain'}"
            out.mkdir(parents=True, exist_ok=True)
            load0 = load_avg()
            extra = ["--load-in-4bit", str(four_bit), *TIMING_COMMON, *TIMING_ARGS[script]]
            rc, wall, rss, run_dir, cmd = run_script(script, extra, out, args.threads, out / "log.txt")
            if rc != 0 or run_dir is None:
                tail = (out / "log.txt").read_text()[-800:]
                raise SystemExit(f"{script} failed (exit {rc}):\n{tail}")
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            it = [r for r in rows if "perf/update_seconds" in r][0]
            config = json.loads((run_dir / "config.json").read_text())
            learning = run_learning(run_dir)
            perf = {k: v for k, v in it.items() if k.startswith("perf/")}
            rec = {"kind": "timing", "model": MODEL, "script": script, "four_bit": four_bit,
                   "env_id": config["env_id"], "micro_batch_size": config.get("micro_batch_size"),
                   "perf": perf, "peak_rss_gb": round(rss, 2), "wall_seconds": round(wall, 1),
                   "eval_seconds": rows[0].get("perf/eval_seconds"), "zeroshot_metric": learning["metric"],
                   "zeroshot": learning["before"], "zeroshot_se": learning["before_se"],
                   "invalid_rate": it.get("charts/invalid_rate"), "threads": args.threads,
                   "args": extra, "load_avg": max(load0, load_avg())}
            append(rec, args.results)
            print(f"{script:16s} {'4-bit' if four_bit else 'plain':5s} {json.dumps(phases(rec))} "
                  f"peak {rss:.2f} GB, {wall:.0f} s", flush=True)


def phases(rec):
    """rollout / credit / update seconds of one iteration from a script's perf metrics."""
    p = rec["perf"]
    rollout = p.get("perf/rollout_seconds", 0.0)
    update = p.get("perf/update_seconds", 0.0) + p.get("perf/old_logprob_seconds", 0.0)
    # credit: the kernel (credit_seconds; ARIA's includes its clustering) plus the model work that
    # feeds it: iStar's PRM scoring and update, ARIA's utterance embeddings. Rows from before the
    # scripts logged credit_seconds have ARIA's clustering separately.
    credit = (p.get("perf/credit_seconds", p.get("perf/cluster_seconds", 0.0))
              + p.get("perf/prm_seconds", 0.0) + p.get("perf/embed_seconds", 0.0))
    total = p.get("perf/iteration_seconds", rollout + credit + update)
    return {"rollout": round(rollout, 1), "credit": round(credit, 1), "update": round(update, 1),
            "iteration": round(total, 1)}


def latest(records, kind, key):
    out = {}
    for r in records:
        if r.get("kind") == kind:
            out[key(r)] = r
    return out


def render_report(records) -> str:
    lines = ["# SmolLM2-135M-Instruct on CPU", "",
             "Generated by `python benchmarks/real_model.py report` from the raw results in "
             "[results/real_model.jsonl](results/real_model.jsonl) (one JSON object per measurement; the "
             "last of each key is shown). How to read and rerun them: [the benchmark's docstring]"
             "(../benchmarks/real_model.py). Load average: the machine's 1-minute load while a row was "
             "measured (2 cores; above 2, other jobs shared the CPU and every time is inflated).", "",
             "The committed rows: zero-shot with the defaults (`zeroshot --threads 1`: 4 test tasks per "
             "env, at most 6 turns), the timing of all five scripts in fp32 and 4-bit (`timing --threads 2`, "
             "nothing else running: load 1.5-2.0; ARIA's update is near 0 s because every zero-shot "
             "self-play turn was invalid, so every REINFORCE weight was 0 and nothing was back-propagated). "
             "Each stage's command appends new rows; the report shows the last of each key.", "",
             "These rows do not use the shipped SmolLM2 adapters. Learning from them (each script's SmolLM2 "
             "run and its baseline on held-out seeds, beside the tiny rows, generated by "
             "`benchmarks/report.py`): [results.md](results.md#smollm2-135m); the adapters, run sizes and the "
             "experiments behind each row: [smollm2.md](smollm2.md).", ""]
    zs = latest(records, "zeroshot", lambda r: (r["env_id"], r["format"]))
    if zs:
        any_r = next(iter(zs.values()))
        lines += ["## Zero-shot success, greedy", "",
                  f"Greedy episodes on the first {any_r['tasks']} test tasks of each env, at most `turns/episode "
                  "max` turns each (below the env's own limit only where `--max-turns` capped it, which makes success "
                  "harder: it is success within that many turns; two-player games: the "
                  "first role against the scripted fair style). think: the envs' instruct format "
                  "(`<think>` then `<action>`); action: only `<action>...</action>`. invalid: share of turns "
                  "that were invalid actions; cut: share of completions cut at max new tokens (invalid too).", "",
                  "| env | format | success ± SE | invalid | cut | tokens/turn | max new tokens | turns/episode max "
                  "| load avg |", "|---|---|---|---|---|---|---|---|---|"]
        for (env_id, fmt), r in sorted(zs.items(), key=lambda kv: (kv[0][0], FORMATS.index(kv[0][1]))):
            lines.append(f"| {env_id} | {fmt} | {r['success']:.3f} ± {r['success_se']:.3f} | {r['invalid_rate']:.2f} "
                         f"| {r['cut_rate']:.2f} | {r['tokens_per_turn']:.1f} | {r['max_new_tokens']} | "
                         f"{r['max_turns']} | {r['load_avg']:.1f} |")
        for fmt in FORMATS:
            r = next((r for (e, f), r in zs.items() if f == fmt), None)
            if r:
                lines.append(f"\n{fmt}: all {r['batch_episodes']} episodes in one batch (one generate per turn), "
                             f"{r['batch_seconds']:.0f} s, {r['tokens_per_second']:.1f} generated tokens/s, "
                             f"peak memory {r['peak_rss_gb']:.2f} GB, {r['threads']} torch threads (fp32).")
        lines += ["", "What the invalid turns are: the 135M instruct model does not follow the envs' formats. Greedy, "
                  "64 new tokens, the first test task (a check by hand with the scripts' own `render_prompt` and "
                  "`generate`): on Twenty Questions (word game) it wrote `No questions asked yet.\\nQuestion 2 of "
                  "20:` (it continues the user message; the env: \"not a single question\"), on Sokoban "
                  "`#1\\n#2\\n#3 ...` until cut; neither has `<action>`. So the zero rows measure the model, not the "
                  "parser: a run on SmolLM2 starts from a policy with almost no valid actions, which is why the "
                  "scripts start SmolLM2 from SFT adapters ([smollm2.md](smollm2.md)).", ""]
    tm = latest(records, "timing", lambda r: (r["script"], r["four_bit"]))
    if tm:
        any_r = next(iter(tm.values()))
        lines += ["## One iteration of each script, plain and 4-bit", "",
                  f"Each script on its default env, one iteration with `{' '.join(TIMING_COMMON)}` and the "
                  f"per-script arguments in `TIMING_ARGS`; {any_r['threads']} torch threads. Seconds from the "
                  "script's own `perf/` metrics (update includes the old-policy log-probs; credit: the credit "
                  "kernel and the model work that feeds it: GraphGPO's graph, iStar's PRM scoring and DPO step, "
                  "ARIA's embeddings and clustering, EPO's PRM; ΔBelief reads its beliefs during the rollout, "
                  "so they count there); tokens/s: generated tokens per rollout second; peak memory: the "
                  "process's maximum resident set; turns/forward: the run's `--micro-batch-size` (its DEFAULTS value; – where the "
                  "row predates the record); zero-shot: the script's first evaluation of its main metric.", "",
                  "| script | env | weights | rollout s | credit s | update s | iteration s | tokens/s | "
                  "peak memory GB | turns/forward | eval s | zero-shot ± SE | load avg |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (script, fb), r in sorted(tm.items(), key=lambda kv: (SCRIPTS.index(kv[0][0]), kv[0][1])):
            ph = phases(r)
            lines.append(f"| {script} | {r['env_id']} | {'4-bit nf4' if fb else 'fp32'} | {ph['rollout']} | "
                         f"{ph['credit']} | {ph['update']} | {ph['iteration']} | "
                         f"{r['perf'].get('perf/tokens_per_second', float('nan')):.1f} | {r['peak_rss_gb']:.2f} | "
                         f"{r.get('micro_batch_size') or '–'} | {(r.get('eval_seconds') or 0):.0f} | "
                         f"{r['zeroshot_metric']} {r['zeroshot']:.3f} ± {r['zeroshot_se']:.3f} | {r['load_avg']:.1f} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def report(args):
    records = [json.loads(x) for x in Path(args.results).read_text().splitlines() if x.strip()] \
        if Path(args.results).is_file() else []
    Path(args.report_path).write_text(render_report(records))
    print(f"wrote {args.report_path} from {len(records)} records")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["zeroshot", "timing", "report"])
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--results", default=str(RESULTS), help="raw results, JSON lines (appended)")
    p.add_argument("--report-path", default=str(REPORT))
    p.add_argument("--work-dir", default="runs/real_model", help="run directories")
    p.add_argument("--no-report", action="store_true", help="do not rewrite the report after the stage")
    z = p.add_argument_group("zeroshot")
    z.add_argument("--envs", nargs="*", default=None, help="env ids (default: every env)")
    z.add_argument("--formats", nargs="*", default=list(FORMATS), choices=FORMATS)
    z.add_argument("--num-tasks", type=int, default=4, help="test tasks per env")
    z.add_argument("--think-tokens", type=int, default=64, help="max new tokens per turn, think format")
    z.add_argument("--action-tokens", type=int, default=24, help="max new tokens per turn, action format")
    z.add_argument("--max-turns", type=int, default=6,
                   help="turns per episode (0: the env's own limit, up to 50 turns: hours on a CPU for "
                        "a model whose every turn so far is invalid)")
    t = p.add_argument_group("timing")
    t.add_argument("--scripts", nargs="*", default=list(SCRIPTS), choices=SCRIPTS)
    t.add_argument("--precisions", nargs="*", type=lambda s: s == "4bit", default=[False, True],
                   help="plain and/or 4bit (default both)")
    args = p.parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    {"zeroshot": zeroshot, "timing": timing, "report": lambda a: None}[args.stage](args)
    if args.stage == "report" or not args.no_report:
        report(args)


if __name__ == "__main__":
    main()
