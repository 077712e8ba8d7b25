"""Regenerate every results table in docs/*.md from the raw results in docs/results/*.jsonl.

    python benchmarks/report.py              # rewrite the tables (and the learning-curve PNGs)
    python benchmarks/report.py --check      # exit 1 if any table in the docs differs from the results
    python benchmarks/report.py --commands   # the benchmarks/learning.py command that fills each table

A generated table lives between two marker lines in a doc, `<!-- results:KEY -->` and
`<!-- /results:KEY -->`; only the text between them is rewritten. What each table shows is declared once,
in TABLES (a `Table`), SUMMARY, SMOLLM2_SUMMARY and the power table's rows (docs/design.md, "Benchmarks").
Only result lines whose script, variant flags and extra flags match the Table count (a Table's `earlier`
flags restore defaults the script had when it ran, and lines whose config has those values count); of
repeated (variant, seed) lines the last one counts. Missing markers are reported and skipped. With
matplotlib, the learning curves (mean over seeds, ± SE band) go to docs/results/<key>.png.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import read_results, user_command  # noqa: E402  (the runner writes the files read here)

SEEDS = (4, 5, 6, 7, 8, 9, 10, 11)  # held-out seeds: the defaults were tuned on seeds 1-3 (EPO's on 4-6: its table uses 7-13)


# ----------------------------------------------------------------------------------------------
# Table specs: the single place that says which table shows what
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Table:
    key: str  # marker name and results file: <!-- results:KEY -->, docs/results/KEY.jsonl
    doc: str  # the file holding the markers, relative to the repository root
    script: str  # graphgpo, istar, delta_belief, aria or epo
    variants: dict  # name -> (label, flags): the rows, in order; flags as given to learning.py --variants
    method: str  # the variant that is the method
    baselines: tuple  # the variants it is compared with, paired by seed
    seeds: tuple = SEEDS
    extra: str = ""  # flags for every run (learning.py's `-- ...`); "" measures the script's defaults
    parallel: int = 2  # runs at a time in the runner command (it changes the wall time)
    note: str = ""  # one sentence printed above the table
    summary: bool = False  # its (method, baseline) pairs are rows of the cross-method table (docs/results.md): the
    # script's default run now, with paired evaluations (one table per script and env)
    power: bool = True  # its (method, baseline) pairs are rows of the power table (docs/learning.md)
    earlier: str = ""  # flags restoring the defaults the runs had, when the script's defaults changed since:
    # part of the commands shown; lines run without them count if their config has these values
    model: str = "tiny"  # the policy the runs start from: "tiny", or the --model-name every variant passes

    @property
    def extras(self) -> list[str]:  # the flags after `--` that reproduce the table's runs
        return shlex.split(self.extra) + shlex.split(self.earlier)

    @property
    def results(self) -> str:  # relative to the repository root, like `doc`
        return f"docs/results/{self.key}.jsonl"

    @property
    def plot(self) -> str:
        return f"docs/results/{self.key}.png"

    def flags(self, variant: str) -> list[str]:
        return shlex.split(self.variants[variant][1])

    def runner_command(self) -> str:
        variants = " ".join(f"{n}=" + (shlex.quote(f) if f else "") for n, (_, f) in self.variants.items())
        cmd = (f"python benchmarks/learning.py --script {self.script} --variants {variants} --seeds "
               f"{' '.join(map(str, self.seeds))} --parallel {self.parallel} --out docs/results/{self.key}.jsonl")
        if self.model != "tiny":  # runs longer than a sitting: a killed one goes on from its checkpoint
            cmd += " --keep-runs runs"
        return cmd + (f" -- {shlex.join(self.extras)}" if self.extras else "")


TABLES = [
    Table("graphgpo", "docs/graphgpo.md", "graphgpo",
          {"graphgpo": ("GraphGPO", ""), "grpo": ("GRPO", "--step-advantage none"),
           "gigpo": ("GiGPO", "--step-advantage gigpo")}, method="graphgpo", baselines=("grpo", "gigpo"),
          seeds=tuple(range(4, 18))),
    Table("istar", "docs/istar.md", "istar",
          {"istar": ("iStar (RLOO)", ""), "rloo": ("RLOO", "--alpha 0")}, method="istar", baselines=("rloo",)),
    Table("delta_belief", "docs/delta_belief.md", "delta_belief",
          {"delta": ("ΔBelief-RL (4 × 8)", ""), "starpo": ("StarPO (4 × 8)", "--reward-mode starpo")},
          method="delta", baselines=("starpo",), seeds=tuple(range(4, 16)),
          earlier="--tasks-per-iteration 4 --group-size 8 --num-iterations 32 --eval-every 16",
          note="Twenty Questions with compound secrets (the default env); the test secrets are unseen thing-colour pairs. "
               "The earlier default of 4 secrets × 8 games per iteration."),
    # 8 secrets x 4 games per iteration at 32 iterations, chosen on seeds 1-3 (docs/delta_belief.md).
    Table("delta_belief_t8g4_crn", "docs/delta_belief.md", "delta_belief",
          {"delta": ("ΔBelief-RL (32 it.)", ""), "starpo": ("StarPO (32 it.)", "--reward-mode starpo"),
           "lam0": ("turn-wise GRPO (λ 0, 32 it.)", "--lam 0")}, method="delta",
          baselines=("starpo", "lam0"), seeds=(4, 5, 6, 7, 8), extra="--tasks-per-iteration 8 --group-size 4",
          earlier="--num-iterations 32 --eval-every 16",
          note="Evaluations with common random numbers. Twenty Questions with compound secrets; 8 secrets × 4 "
               "games per iteration (the default), for the earlier 32 iterations."),
    # The default: 64 iterations of 8 x 4 (docs/delta_belief.md). The last line of each seed is its run at the
    # current code; the first runs of seeds 4-8 (40abeb8, other rounding) stay in the file above them.
    Table("delta_belief_it64_crn", "docs/delta_belief.md", "delta_belief",
          {"delta": ("ΔBelief-RL", ""), "starpo": ("StarPO", "--reward-mode starpo")}, method="delta",
          baselines=("starpo",), seeds=tuple(range(4, 13)), extra="--num-iterations 64 --eval-every 32", summary=True,
          note="Evaluations with common random numbers. Twenty Questions with compound secrets; 64 iterations of "
               "8 secrets × 4 games (the default)."),
    # The same command on seeds 4-6 again, recording the training rollouts' success (`train_charts`).
    Table("delta_belief_trainsuccess", "docs/delta_belief.md", "delta_belief",
          {"delta": ("ΔBelief-RL", ""), "starpo": ("StarPO", "--reward-mode starpo")}, method="delta",
          baselines=("starpo",), seeds=(4, 5, 6), extra="--num-iterations 64 --eval-every 32", power=False,
          note="Evaluations with common random numbers. The default run again on seeds 4-6 at the current code, "
               "recording the success of the training games (train secrets) beside the test secrets'."),
    # ARIA's tiny learning rate was 5e-4 until 2026-11-27 (docs/aria.md): these two tables and aria_crn ran at it.
    Table("aria", "docs/aria.md", "aria",
          {"aria": ("ARIA (lr 5e-4)", ""), "reinforce": ("REINFORCE (lr 5e-4)", "--no-aggregate")}, method="aria",
          baselines=("reinforce",), earlier="--learning-rate 0.0005",
          note="Bargaining self-play (the default env); the metric is the payoff share against the scripted styles. "
               "The earlier learning rate 5e-4."),
    Table("aria_20q", "docs/aria.md", "aria",
          {"aria": ("ARIA (lr 5e-4)", ""), "reinforce": ("REINFORCE (lr 5e-4)", "--no-aggregate")}, method="aria",
          baselines=("reinforce",), extra="--env-id twenty_questions", earlier="--learning-rate 0.0005",
          note="Twenty Questions with compound secrets against the oracle (single agent); the metric is the "
               "success on the test secrets, never played in training. The earlier learning rate 5e-4."),
    Table("aria_lr25_crn", "docs/aria.md", "aria",
          {"aria": ("ARIA", ""), "reinforce": ("REINFORCE", "--no-aggregate")}, method="aria",
          baselines=("reinforce",), seeds=tuple(range(4, 16)), summary=True,
          note="Evaluations with common random numbers. Bargaining self-play (the default env), learning rate "
               "2.5e-4 (the default); the metric is the payoff share against the scripted styles."),
    Table("aria_20q_lr25_crn", "docs/aria.md", "aria",
          {"aria": ("ARIA", ""), "reinforce": ("REINFORCE", "--no-aggregate")}, method="aria",
          baselines=("reinforce",), extra="--env-id twenty_questions", summary=True,
          note="Evaluations with common random numbers. Twenty Questions with compound secrets against the oracle "
               "(single agent), learning rate 2.5e-4 (the default); the metric is the success on the test "
               "secrets, never played in training."),
    Table("epo", "docs/epo.md", "epo",
          {"epo": ("EPO", ""), "prm_none": ("outcome only", "--prm none")}, method="epo", baselines=("prm_none",),
          seeds=(7, 8, 9, 10, 11, 12, 13), note="The tiny strategist against the scripted styles (the default); "
                                                    "seeds from 7 on, because its defaults were chosen on seeds 4-6."),
]
# The default run of each script and its baselines again, evaluated with common random numbers
# (docs/learning.md), on held-out seeds; ΔBelief's and ARIA's summary rows are the tables above at
# their newer defaults.
CRN_SEEDS = {"graphgpo": tuple(range(4, 20)), "istar": tuple(range(4, 13)), "delta_belief": (4, 5, 6, 7, 8),
             "aria": tuple(range(4, 16)),
             "epo": (7, 8, 9, 10, 11)}
# ΔBelief's turn-wise GRPO without the belief term: what the belief gain adds beyond the normalisation.
CRN_EXTRA = {"delta_belief": {"lam0": ("turn-wise GRPO (λ 0)", "--lam 0")}}
CRN_NOTE = "Evaluations with common random numbers."
TABLES += [
    Table(f"{t.key}_crn", "docs/learning.md", t.script,
          {**t.variants, **CRN_EXTRA.get(t.key, {})},
          method=t.method, baselines=(*t.baselines, *CRN_EXTRA.get(t.key, {})), seeds=CRN_SEEDS[t.key],
          extra=t.extra, earlier=t.earlier, summary=not t.earlier, power=not t.earlier,
          note=f"{CRN_NOTE} {t.note}".strip())
    for t in list(TABLES) if t.key in CRN_SEEDS]


# Each script's SmolLM2 run (`--model-name smollm2-135m`: the env's shipped SFT adapter, the script's
# DEFAULTS row) against its paper's baseline on held-out seeds (docs/smollm2.md).
SMOLLM2 = "--model-name smollm2-135m"
SMOLLM2_BASELINES = {"graphgpo": ("graphgpo", "GraphGPO", "grpo", "GRPO", "--step-advantage none"),
                     "istar": ("istar", "iStar (RLOO)", "rloo", "RLOO", "--alpha 0"),
                     "delta_belief": ("delta", "ΔBelief-RL", "starpo", "StarPO", "--reward-mode starpo"),
                     "aria": ("aria", "ARIA", "reinforce", "REINFORCE", "--no-aggregate"),
                     "epo": ("epo", "EPO", "prm_none", "outcome only", "--prm none")}
SMOLLM2_SEEDS = {"istar": tuple(range(4, 12))}  # iStar: the rule fixed in smollm2.md counts seeds 4-11
# ΔBelief's table ran from the earlier Twenty Questions adapter; the faithful game is SMOLLM2_HIDDEN below.
SMOLLM2_NOTES = {"delta_belief": "Evaluations with common random numbers. The earlier Twenty Questions adapter "
                                 "(1548008d1e, trained with the list of candidate secrets and shown it) at 9 "
                                 "questions, the DEFAULTS row of then."}
SMOLLM2_TABLES = [
    Table(f"smollm2_{script}", "docs/smollm2.md", script,
          {m: (label_m, SMOLLM2), b: (label_b, f"{SMOLLM2} {flags}")}, method=m, baselines=(b,),
          seeds=SMOLLM2_SEEDS.get(script, (4, 5, 6)),
          power=False, model="smollm2-135m",
          note=SMOLLM2_NOTES.get(script, "Evaluations with common random numbers. SmolLM2-135M-Instruct from the "
                                          "env's shipped SFT adapter, the script's SmolLM2 run size (its DEFAULTS row)."))
    for script, (m, label_m, b, label_b, flags) in SMOLLM2_BASELINES.items()]
# ΔBelief vs StarPO on the faithful game, by the rule fixed in smollm2.md before its runs.
SMOLLM2_HIDDEN = Table(
    "smollm2_delta_belief_hidden", "docs/smollm2.md", "delta_belief",
    {"delta_belief": ("ΔBelief-RL", SMOLLM2), "starpo": ("StarPO", f"{SMOLLM2} --reward-mode starpo")},
    method="delta_belief", baselines=("starpo",), seeds=(4, 5, 6), power=False, model="smollm2-135m",
    note="Evaluations with common random numbers. The faithful game: the set of secrets hidden from the "
         "questioner (paper §4), the rebuilt adapter (1a5e9220e5), 12 questions (the DEFAULTS row).")
SMOLLM2_TABLES.insert(3, SMOLLM2_HIDDEN)  # after the earlier ΔBelief table; the summary shows this one
TABLES += SMOLLM2_TABLES

SCRIPT_ORDER = ("graphgpo", "istar", "delta_belief", "aria", "epo")  # the summary's order of the methods


@dataclass(frozen=True)
class Summary:
    key: str = "summary"  # <!-- results:summary --> in docs/results.md
    doc: str = "docs/results.md"
    rows: tuple = field(default_factory=lambda: tuple(  # (table key, method, baseline), in the summary's order
        (t.key, t.method, b) for t in sorted((t for t in TABLES if t.summary), key=lambda t: SCRIPT_ORDER.index(t.script))
        for b in t.baselines))
    power_rows: tuple = field(default_factory=lambda: tuple(  # the same for the power table
        (t.key, t.method, b) for t in TABLES if t.power for b in t.baselines))
    runs: str = "Each script's default run"  # what the rows are, the intro's first words


SUMMARY = Summary()
SMOLLM2_SUMMARY = Summary(  # <!-- results:summary_smollm2 --> in docs/results.md, below the tiny one
    key="summary_smollm2", rows=tuple((t.key, t.method, b) for t in SMOLLM2_TABLES for b in t.baselines
                                      if t.script != "delta_belief" or t is SMOLLM2_HIDDEN),
    power_rows=(), runs="Each script's SmolLM2-135M run (`--model-name smollm2-135m`: the env's shipped SFT "
                        "adapter, the script's DEFAULTS row; docs/smollm2.md)")

# The shipped tiny policies (docs/results.md): one row per testbed, from common/weights/MANIFEST.json and each
# policy's tiny_meta.json (written by `python -m common.tiny --testbed NAME --ship`). name -> what the
# recipe changes from the default preset, in words (the recipe itself is in common/tiny.py).
TESTBEDS_DOC = "docs/results.md"  # <!-- results:testbeds -->
POWER_DOC = "docs/learning.md"  # <!-- results:power -->
TESTBED_NOTES = {
    "sokoban": "1 box, no history, no instruction text; eps 0.2, 1500 steps x 128, action smoothing 0.3",
    "twenty_questions": "compound secrets (test secrets: unseen thing-colour pairs), demos on train secrets only, candidate "
                        "list once 5 are left, no instruction text, unnumbered history; 800 steps x 128, lr 2e-3",
    "guess_my_city": "demos over all cities, no instruction text; 400 steps x 128, lr 2e-3",
    "bargaining": "0.3 of the demonstration labels are random moves (`label_noise`; 600 steps x 64)",
    "negotiation": "none (600 steps x 64)",
    "negotiation_strategist": "`moves=strategy` (EPO's strategist writes strategies, a rule agent turns them into offers), "
                              "every past move shown, 30% of the demos by the style-aware expert",
    "webshop": "no task line; eps 0.2, 1200 steps x 64",
    "alfworld": "no past turns in the prompt (`history=0`); eps 0.2",
}


# ----------------------------------------------------------------------------------------------
# Statistics (pure functions of result lines; tests/test_results.py checks them by hand)
# ----------------------------------------------------------------------------------------------
def mean_se(values) -> tuple[float, float | None]:
    """Mean and standard error over seeds (sample std / sqrt(n)); the SE is None for one value."""
    v = [float(x) for x in values]
    if not v:
        raise ValueError("mean_se of no values")
    if len(v) == 1:
        return v[0], None
    return statistics.fmean(v), statistics.stdev(v) / math.sqrt(len(v))


def select(table: Table, records: list[dict]) -> dict[str, dict[int, dict]]:
    """variant -> seed -> result line, for the lines that match the table (the last of repeated ones)."""
    out: dict[str, dict[int, dict]] = {v: {} for v in table.variants}
    for r in records:
        v = r.get("variant")
        if (v in table.variants and r.get("script") == f"{table.script}.py" and r.get("seed") in table.seeds
                and r.get("variant_flags") == table.flags(v)
                and (r.get("extra_flags") == table.extras
                     or (table.earlier and r.get("extra_flags") == shlex.split(table.extra)
                         and config_has(r.get("config", {}), shlex.split(table.earlier))))):
            out[v][r["seed"]] = r
    return out


def config_has(config: dict, flags: list[str]) -> bool:
    """Whether a run's config.json has the values of `--name value` flags (compared as text), e.g.
    ["--group-size", "8"] and {"group_size": 8}. Runs of before 2026-11-25 evening kept an option
    left to its preset as None and its value under `resolved_<name>` (aria.py's learning rate)."""
    if len(flags) % 2:
        raise ValueError(f"flags must be --name value pairs: {flags}")

    def value(name):
        return config.get(name) if config.get(name) is not None else config.get(f"resolved_{name}")

    return all(f.startswith("--") and str(value(f[2:].replace("-", "_"))) == v
               for f, v in zip(flags[::2], flags[1::2]))


def variant_stats(runs: dict[int, dict]) -> dict:
    """One variant's runs (seed -> line): means over seeds, the mean change ± SE, per-seed changes with
    their run SEs, the greedy metric, and wall seconds."""
    lines = [runs[s] for s in sorted(runs)]
    change, change_se = mean_se([r["change"] for r in lines])
    greedy = [r["greedy"] for r in lines if r.get("greedy")]
    walls = [r["wall_seconds"] for r in lines]
    return {"n": len(lines), "seeds": sorted(runs), "rose": sum(r["change"] > 2 * r["change_se"] for r in lines),
            "before": statistics.fmean(r["before"] for r in lines), "after": statistics.fmean(r["after"] for r in lines),
            "change": change, "change_se": change_se,
            "per_seed": {s: (runs[s]["change"], runs[s]["change_se"]) for s in sorted(runs)},
            "greedy_metric": greedy[0]["metric"] if greedy else None,
            "greedy_before": statistics.fmean(g["before"] for g in greedy) if greedy else None,
            "greedy_after": statistics.fmean(g["after"] for g in greedy) if greedy else None,
            "wall_median": statistics.median(walls), "wall_min": min(walls), "wall_max": max(walls)}


def train_chart_key(runs_by_variant: list[dict[int, dict]], metric: str) -> str | None:
    """The training rollouts' counterpart of the test metric that the runs recorded in `train_charts`:
    `charts/<name>` of `eval/<name>`, else `charts/success`; None if no run recorded either (lines written
    before the runner kept them). One key for all variants, so a table compares like with like."""
    for key in ("charts/" + metric.split("/", 1)[-1], "charts/success"):
        if any(key in (r.get("train_charts") or {}).get("first", {}) for runs in runs_by_variant
               for r in runs.values()):
            return key
    return None


def train_chart(runs: dict[int, dict], key: str) -> dict | None:
    """`key`'s first- and last-quarter means over the training iterations, averaged over the runs that
    recorded it (None if none did)."""
    got = [runs[s]["train_charts"] for s in sorted(runs) if key in (runs[s].get("train_charts") or {}).get("first", {})]
    if not got:
        return None
    return {"n": len(got), "first": statistics.fmean(c["first"][key] for c in got),
            "last": statistics.fmean(c["last"][key] for c in got)}


def paired(method: dict[int, dict], baseline: dict[int, dict]) -> dict | None:
    """The paired difference of the changes, method minus baseline on the same seed: per seed, and mean ±
    SE over the seeds both have (None if they share none)."""
    seeds = sorted(set(method) & set(baseline))
    if not seeds:
        return None
    diffs = {s: method[s]["change"] - baseline[s]["change"] for s in seeds}
    mean, se = mean_se(diffs.values())
    return {"seeds": seeds, "per_seed": diffs, "mean": mean, "se": se}


def paired_curve(method: dict[int, dict], baseline: dict[int, dict]) -> dict | None:
    """How far ahead the method was during training, not only at the end: per seed, the mean over the
    evaluations after iteration 0 that both runs made of (method's metric - baseline's), and mean ± SE over
    the seeds (None without a common evaluation). A secondary statistic: the tables' main one is `paired`."""
    diffs = {}
    for s in sorted(set(method) & set(baseline)):
        a = {c["iteration"]: c["value"] for c in method[s].get("curve", []) if c["iteration"] > 0}
        b = {c["iteration"]: c["value"] for c in baseline[s].get("curve", []) if c["iteration"] > 0}
        common = sorted(set(a) & set(b))
        if common:
            diffs[s] = statistics.fmean(a[i] - b[i] for i in common)
    if not diffs:
        return None
    mean, se = mean_se(diffs.values())
    return {"seeds": sorted(diffs), "per_seed": diffs, "mean": mean, "se": se}


def power(method: dict[int, dict], baseline: dict[int, dict]) -> dict | None:
    """What the seeds of a (method, baseline) pair can resolve (None with fewer than two common seeds).

    sd: the sample std of the per-seed paired differences; eval_sd: the part the final evaluations'
    own noise would give if they were independent samples, the root mean square over the seeds of
    sqrt(after_se_m^2 + after_se_b^2) (both runs of a seed share the evaluation before training);
    resolvable: the smallest difference 2 SE would show now, 2 sd / sqrt(n); seeds_needed: the seeds
    for the current mean to be 2 SE, ceil((2 sd / mean)^2) (None when the mean is not positive)."""
    d = paired(method, baseline)
    if d is None or len(d["seeds"]) < 2:
        return None
    n, sd = len(d["seeds"]), statistics.stdev(d["per_seed"].values())
    eval_sd = math.sqrt(statistics.fmean(method[s]["after_se"] ** 2 + baseline[s]["after_se"] ** 2
                                         for s in d["seeds"]))
    needed = math.ceil((2 * sd / d["mean"]) ** 2) if d["mean"] > 0 else None
    return {"n": n, "mean": d["mean"], "se": d["se"], "sd": sd, "eval_sd": eval_sd,
            "resolvable": 2 * sd / math.sqrt(n), "seeds_needed": needed}


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------
def pm(mean: float, se: float | None, signed: bool = True) -> str:
    m = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return f"{m} ± {se:.3f}" if se is not None else f"{m} ± n/a (1 seed)"


def link(doc: str, target: str) -> str:
    """A link to `target` that works from `doc` (both relative to the repository root)."""
    return Path(os.path.relpath(target, os.path.dirname(doc) or ".")).as_posix()


def provenance(lines: list[dict]) -> str:
    """Where the numbers come from: tiny policy, machine, commit; a mix of builds is flagged."""
    def distinct(f):
        return sorted({f(r) for r in lines}, key=str)

    pol = distinct(lambda r: (r["tiny_policy"].get("dir"), r["tiny_policy"].get("weights_sha256"))
                   if r.get("tiny_policy", {}).get("tiny") else (r.get("tiny_policy", {}).get("model_name"), None))
    mach = distinct(lambda r: (r["machine"].get("cpu_model"), r["machine"].get("cpu_count")))
    commits = distinct(lambda r: (r["git"]["commit"] or "?")[:10] + (" (dirty)" if r["git"].get("dirty") else ""))
    par = distinct(lambda r: r.get("parallel"))
    loads = [x for r in lines for x in (r["machine"]["load_average_start"][0], r["machine"]["load_average_end"][0])]
    pol_s = "; ".join(f"`{d}`" + (f" (weights {w})" if w else "") for d, w in pol)
    out = (f"Policy {pol_s}. Machine: " + "; ".join(f"{m}, {c} CPU cores" for m, c in mach)
           + f", {'/'.join(map(str, par))} run(s) at a time, 1-min load average {min(loads):.1f}-{max(loads):.1f}. "
           + f"Commit {', '.join(commits)}.")
    if len(pol) > 1:
        out += " **Warning: the runs used different policy builds; their numbers are not comparable.**"
    return out


def render_table(table: Table, records: list[dict], with_plot: bool = False) -> str:
    """The generated text of one Table (what goes between its markers)."""
    src = f"[{link(table.doc, table.results)}]({link(table.doc, table.results)})"
    head = f"Generated by `python benchmarks/report.py` from {src}; do not edit by hand."
    runs = select(table, records)
    if not any(runs.values()):
        return (f"{head} No results yet: run `{table.runner_command()}`, then `python benchmarks/report.py`.")
    lines = [r for v in runs.values() for r in v.values()]
    stats = {v: variant_stats(runs[v]) for v in table.variants if runs[v]}
    metric = lines[0]["metric"]
    seeds = [s for s in table.seeds if any(s in runs[v] for v in runs)]
    iters = sorted({r["iterations"] for r in lines})
    greedy = next((s["greedy_metric"] for s in stats.values() if s["greedy_metric"]), None)
    out = [head + (f" {table.note}" if table.note else ""),
           "",
           f"Main metric `{metric}` (env {', '.join(sorted({r['env_id'] for r in lines}))}), "
           f"{'/'.join(map(str, iters))} iterations, seeds {', '.join(map(str, seeds))}. "
           f"Produced by `{table.runner_command()}`. {provenance(lines)}",
           "",
           f"| variant | command (seed S) | seeds | before | after | change ± SE | runs > 2 own SE | greedy before → after"
           f"{f' (`{greedy}`)' if greedy else ''} | wall s, median [min, max] |",
           "|---|---|---|---|---|---|---|---|---|"]
    for v, (label, _) in table.variants.items():
        cmd = user_command(table.script, "S", table.flags(v), table.extras)
        if v not in stats:
            out.append(f"| {label} | `{cmd}` | 0 | not run | | | | | |")
            continue
        s = stats[v]
        g = f"{s['greedy_before']:.3f} → {s['greedy_after']:.3f}" if s["greedy_metric"] else "not logged"
        out.append(f"| {label} | `{cmd}` | {s['n']} | {s['before']:.3f} | {s['after']:.3f} | "
                   f"{pm(s['change'], s['change_se'])} | {s['rose']}/{s['n']} | {g} | "
                   f"{s['wall_median']:.0f} [{s['wall_min']:.0f}, {s['wall_max']:.0f}] |")
    key = train_chart_key([runs[v] for v in stats], metric)
    charts = {v: train_chart(runs[v], key) for v in stats} if key else {}
    if charts:
        cells = [f"{table.variants[v][0]} {c['first']:.3f} → {c['last']:.3f} ({c['n']} run{'' if c['n'] == 1 else 's'})"
                 for v, c in charts.items() if c]
        out += ["", f"On the training tasks (`{key}` of the training rollouts, mean over the first → the last "
                    "quarter of the iterations, runs that recorded it): " + "; ".join(cells) + "."]
    paired_eval = any(r.get("paired") for r in lines)
    own_se = ("± the run's own SE: the first and last evaluation paired episode by episode, with common random "
              "numbers; in brackets the SE of two independent evaluations" if paired_eval else "± the run's own SE")
    out += ["", f"Change per seed ({own_se}) and the paired difference of the changes on the same seed:", "",
            "| | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± SE over seeds |",
            "|---|" + "---|" * (len(seeds) + 1)]
    for v, (label, _) in table.variants.items():
        if v in stats:
            cells = [(pm(*stats[v]["per_seed"][s]) + (f" [{runs[v][s]['change_se_quadrature']:.3f}]"
                                                        if runs[v][s].get("paired") else ""))
                     if s in runs[v] else "n/a" for s in seeds]
            out.append(f"| {label} change | " + " | ".join(cells) + f" | {pm(stats[v]['change'], stats[v]['change_se'])} |")
    for stat, what in ((paired, ""), (paired_curve, ", mean over the evaluations during training")):
        for b in table.baselines:
            d = stat(runs[table.method], runs[b])
            if d:
                cells = [f"{d['per_seed'][s]:+.3f}" if s in d["per_seed"] else "n/a" for s in seeds]
                out.append(f"| {table.variants[table.method][0]} − {table.variants[b][0]}{what} (paired) | "
                           + " | ".join(cells) + f" | {pm(d['mean'], d['se'])} |")
    if with_plot:
        out += ["", f"![{metric} per iteration, mean ± SE over seeds]({link(table.doc, table.plot)})"]
    return "\n".join(out)


HELDOUT = "docs/results/heldout_defaults.jsonl"  # <!-- results:heldout_defaults --> in docs/results.md


def render_heldout(root: Path, records_by_table: dict[str, list[dict]], tables=TABLES, summary=None) -> str:
    """Each script's default run on the held-out seed after the lean-files rework, beside the mean change of
    its row (same script and env) in the cross-method table (`summary`, default SUMMARY)."""
    lines = {r["script"]: r for r in read_results(root / HELDOUT)}  # the last line of each script counts
    head = f"Generated by `python benchmarks/report.py` from [{HELDOUT[5:]}]({HELDOUT[5:]}); do not edit by hand."
    if not lines:
        return f"{head} No results yet."
    table_change = {(t.script, next(iter(runs[m].values()))["env_id"]): variant_stats(runs[m]) for t, m, _, runs
                    in summary_pairs((summary or SUMMARY).rows, records_by_table, tables) if runs[m]}  # ARIA: one row per env
    out = [head, "", "| script | metric | seed | before → after | change ± own paired SE | the table's mean change | "
           "wall s |", "|---|---|---|---|---|---|---|"]
    for script in SCRIPT_ORDER:
        r = lines.get(f"{script}.py")
        if r:
            t = table_change.get((script, r["env_id"]))
            out.append(f"| {script} | {r['env_id']} `{r['metric']}` | {r['seed']} | {r['before']:.3f} → {r['after']:.3f} | "
                       f"{pm(r['change'], r['change_se'])} | {pm(t['change'], t['change_se']) if t else 'n/a'} | "
                       f"{r['wall_seconds']:.0f} |")
    return "\n".join(out)


def summary_pairs(rows: tuple, records_by_table: dict[str, list[dict]], tables):
    """(table, method, baseline, variant -> seed -> line) for each (table key, method, baseline) of `rows`."""
    by_key = {t.key: t for t in tables}
    for key, m, b in rows:
        yield by_key[key], m, b, select(by_key[key], records_by_table.get(key, []))


def render_summary(summary: Summary, records_by_table: dict[str, list[dict]], tables=TABLES) -> str:
    """The cross-method table: one row per (method, baseline) pair of `summary.rows`."""
    out = ["Generated by `python benchmarks/report.py` from docs/results/; do not edit by hand. "
           f"{summary.runs} and its baseline on held-out seeds, both evaluated with common random numbers (each run's "
           "change measured episode by episode). Change: the main metric after training minus before, mean ± SE "
           "over seeds; runs > 2 own SE: the method's runs whose change exceeds twice the run's own SE; paired "
           "difference: the method's change minus the baseline's on the same seed, mean ± SE over seeds, at the "
           "end and averaged over the evaluations during training; greedy: the method's greedy metric before → "
           "after. Details, the earlier tables, the policies and machines: each method's page.",
           "",
           "| method | baseline | env: metric | method change ± SE | runs > 2 own SE | baseline change ± SE "
           "| paired difference ± SE | during training ± SE | greedy before → after | seeds "
           "| wall s per run (median; one thread per run, load above the cores means a shared machine) | command |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t, m, b, runs in summary_pairs(summary.rows, records_by_table, tables):
        cmd = user_command(t.script, "S", t.flags(m), t.extras)
        label_m, label_b = t.variants[m][0], f"{t.variants[b][0]}" + (f" (`{t.variants[b][1]}`)" if t.variants[b][1] else "")
        if not runs[m] or not runs[b]:
            out.append(f"| {label_m} | {label_b} | | not run yet | | | | | | | | `{cmd}` |")
            continue
        sm, sb, d = variant_stats(runs[m]), variant_stats(runs[b]), paired(runs[m], runs[b])
        dc = paired_curve(runs[m], runs[b])
        any_line = next(iter(runs[m].values()))
        cores = sorted({r["machine"]["cpu_count"] for r in runs[m].values()})
        loads = [x for r in runs[m].values() for x in (r["machine"]["load_average_start"][0],
                                                         r["machine"]["load_average_end"][0])]
        diff = pm(d["mean"], d["se"]) if d else "no common seed"
        during = pm(dc["mean"], dc["se"]) if dc else ""
        greedy = (f"{sm['greedy_before']:.3f} → {sm['greedy_after']:.3f}" if sm["greedy_metric"] else "")
        out.append(f"| {label_m} | {label_b} | {any_line['env_id']}: `{any_line['metric']}` | "
                   f"{pm(sm['change'], sm['change_se'])} | {sm['rose']}/{sm['n']} | {pm(sb['change'], sb['change_se'])} | "
                   f"{diff} | {during} | {greedy} | {', '.join(map(str, d['seeds'] if d else sm['seeds']))} | "
                   f"{sm['wall_median']:.0f} ({'/'.join(map(str, cores))} CPU cores, load {min(loads):.1f}-{max(loads):.1f}) | `{cmd}` |")
    return "\n".join(out)


def render_power(summary: Summary, records_by_table: dict[str, list[dict]], tables=TABLES) -> str:
    """The power table: one row per (method, baseline) pair of `summary.power_rows` (see `power`)."""
    out = ["Generated by `python benchmarks/report.py` from docs/results/; do not edit by hand. Per (method, "
           "baseline) pair: the paired difference of the changes, mean ± SE over the seeds; its sample std from "
           "seed to seed; the part of that std the two final evaluations' own noise gives if they are independent "
           "samples (an upper bound where the runs share evaluation games); the smallest difference the seeds "
           "resolve at 2 SE (2 std / sqrt(seeds)); the seeds the current mean would need to be 2 SE; the wall "
           "time of one seed, both runs side by side (the slower median); evaluations: paired (common random "
           "numbers) or independent.",
           "",
           "| method − baseline | env: metric | evaluations | seeds | paired difference ± SE | std per seed | of it, "
           "evaluation noise | resolvable at 2 SE | seeds for the mean at 2 SE | wall s per seed |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for t, m, b, runs in summary_pairs(summary.power_rows, records_by_table, tables):
        label = f"{t.variants[m][0]} − {t.variants[b][0]}"
        pw = power(runs[m], runs[b])
        if pw is None:
            out.append(f"| {label} | | | fewer than 2 | | | | | | |")
            continue
        line = next(iter(runs[m].values()))
        wall = max(variant_stats(runs[m])["wall_median"], variant_stats(runs[b])["wall_median"])
        needed = "mean ≤ 0" if pw["seeds_needed"] is None else str(pw["seeds_needed"])
        kinds = {bool(r.get("paired")) for v in (m, b) for r in runs[v].values()}
        evals = "mixed" if len(kinds) > 1 else ("paired" if kinds.pop() else "independent")
        out.append(f"| {label} | {line['env_id']}: `{line['metric']}` | {evals} | {pw['n']} | {pm(pw['mean'], pw['se'])} | "
                   f"{pw['sd']:.3f} | {pw['eval_sd']:.3f} | {pw['resolvable']:.3f} | {needed} | {wall:.0f} |")
    return "\n".join(out)


def _rate_se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else 0.0


def render_testbeds(root: Path) -> str:
    """The shipped tiny policies: recipe, build-time success with its SE, size and build cost."""
    import json

    manifest_path = root / "common" / "weights" / "MANIFEST.json"
    head = ("Generated by `python benchmarks/report.py` from common/weights/MANIFEST.json and each policy's "
            "tiny_meta.json; do not edit by hand.")
    if not manifest_path.is_file():
        return head + " No shipped policies yet: `python -m common.tiny --testbed all --ship`."
    policies = json.loads(manifest_path.read_text())["policies"]
    out = [head + " Success on the env's first 100 test tasks (all of them where there are fewer; `n`: how many), "
           "greedy and sampled at temperature 1 (`top_k=0`; two-player games: the win rate against the scripted "
           "fair style in both roles), ± SE. Build: wall seconds with the machine's 1-minute load average, "
           "CPU seconds, torch threads.",
           "",
           "| testbed | shipped policy | recipe (differences from the default preset) | n | greedy | sampled (T=1) "
           "| MB | build wall s (load) | CPU s | threads |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    by_testbed = {e["testbed"]: (name, e) for name, e in policies.items()}
    for testbed in list(TESTBED_NOTES) + sorted(set(by_testbed) - set(TESTBED_NOTES)):
        if testbed not in by_testbed:
            out.append(f"| {testbed} | not shipped | {TESTBED_NOTES.get(testbed, '')} | | | | | | | |")
            continue
        name, e = by_testbed[testbed]
        meta = json.loads((root / "common" / "weights" / name / "tiny_meta.json").read_text())
        succ = meta["success"]
        n = succ["greedy"]["episodes"]
        g, sp = succ["greedy"]["success"], succ["sampled"]["success"]
        load = meta.get("load_average") or [float("nan")]
        out.append(f"| {testbed} | `{name}` | {TESTBED_NOTES.get(testbed, '')} | {n} | {g:.2f} ± {_rate_se(g, n):.2f} | "
                   f"{sp:.2f} ± {_rate_se(sp, n):.2f} | {e['bytes'] / 2**20:.1f} | {meta['build_seconds']:.0f} "
                   f"({load[0]:.1f}) | {meta['build_cpu_seconds']:.0f} | {meta['torch_threads']} |")
    return "\n".join(out)


def plot_curves(table: Table, records: list[dict], path: Path) -> bool:
    """The main metric per evaluation, mean over seeds with a ± SE band, one line per variant; False
    (and nothing written) without matplotlib or results."""
    runs = select(table, records)
    if not any(runs.values()):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (the tables do not need it)")
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for v, (label, _) in table.variants.items():
        curves = [{p["iteration"]: p["value"] for p in r["curve"]} for r in runs[v].values()]
        if not curves:
            continue
        its = sorted(set.intersection(*(set(c) for c in curves)))
        stats = [mean_se([c[i] for c in curves]) for i in its]
        mean = [m for m, _ in stats]
        se = [s or 0.0 for _, s in stats]
        ax.plot(its, mean, marker="o", label=f"{label} ({len(curves)} seeds)")
        ax.fill_between(its, [m - s for m, s in zip(mean, se)], [m + s for m, s in zip(mean, se)], alpha=0.2)
    metric = next(r for v in runs.values() for r in v.values())["metric"]
    ax.set_xlabel("iteration")
    ax.set_ylabel(metric)
    ax.set_title(f"{table.key}: mean ± SE over seeds")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------
# Markers
# ----------------------------------------------------------------------------------------------
class MarkerError(Exception):
    pass


MARKER = re.compile(r"^<!-- (/?)results:([\w-]+) -->$", re.M)  # a marker is a line of its own


def replace_block(text: str, key: str, body: str) -> str | None:
    """`text` with the lines between the marker lines `<!-- results:KEY -->` and `<!-- /results:KEY -->`
    replaced by `body` (the marker lines and everything else unchanged); None if there is no marker for
    KEY. A marker mentioned inside a line of text is not a marker. An opening marker without its closing
    one, or a marker given twice, raises MarkerError."""
    starts = [m for m in MARKER.finditer(text) if m[2] == key and not m[1]]
    ends = [m for m in MARKER.finditer(text) if m[2] == key and m[1]]
    if not starts and not ends:
        return None
    if len(starts) != 1 or len(ends) != 1 or ends[0].start() < starts[0].end():
        raise MarkerError(f"<!-- results:{key} --> and <!-- /results:{key} --> must each be a line of their own, "
                          f"once, in that order (found {len(starts)} and {len(ends)})")
    return text[:starts[0].end()] + "\n" + body.strip("\n") + "\n" + text[ends[0].start():]


def update_docs(root: Path, check: bool, tables=TABLES, summary=SUMMARY) -> tuple[list, list, list]:
    """Regenerate every block of `tables` and `summary` in the docs under `root` (with `check`, write
    nothing). Returns (blocks found, stale blocks, errors); a block is stale when its text in the doc
    differs from what the results give."""
    records = {t.key: read_results(root / t.results) for t in tables}
    bodies = []  # (doc, key, generated text)
    for t in tables:
        png = root / t.plot
        if not check:
            plot_curves(t, records[t.key], png)
        bodies.append((t.doc, t.key, render_table(t, records[t.key], with_plot=png.is_file())))
    bodies.append((summary.doc, summary.key, render_summary(summary, records, tables)))
    bodies.append((POWER_DOC, "power", render_power(summary, records, tables)))
    if tables is TABLES:  # the shipped policies of this repository (tests pass their own tables)
        bodies.append((TESTBEDS_DOC, "testbeds", render_testbeds(root)))
        bodies.append((TESTBEDS_DOC, "heldout_defaults", render_heldout(root, records, tables)))
        bodies.append((SMOLLM2_SUMMARY.doc, SMOLLM2_SUMMARY.key, render_summary(SMOLLM2_SUMMARY, records, tables)))

    texts: dict[str, str] = {}
    found, stale, errors = [], [], []
    for doc, key, body in bodies:
        path = root / doc
        text = texts.setdefault(doc, path.read_text() if path.is_file() else "")
        try:
            new = replace_block(text, key, body)
        except MarkerError as e:
            errors.append(f"{doc}: {e}")
            continue
        if new is None:
            print(f"{doc}: no <!-- results:{key} --> marker; table {key} skipped (add the two markers where it belongs)")
            continue
        found.append(f"{doc}: results:{key}")
        if new != text:
            stale.append(f"{doc}: results:{key}")
        texts[doc] = new
    known = {t.key for t in tables} | {summary.key, SMOLLM2_SUMMARY.key, "testbeds", "heldout_defaults", "power", "first_iteration"}  # first_iteration.py writes its own
    for path in sorted([root / "README.md", *(root / "docs").glob("*.md")]):
        for m in MARKER.finditer(path.read_text() if path.is_file() else ""):
            if m[2] not in known and not m[1]:
                errors.append(f"{path.relative_to(root)}: <!-- results:{m[2]} --> has no table spec in benchmarks/report.py")
    if not check:
        for doc, text in texts.items():
            if text != ((root / doc).read_text() if (root / doc).is_file() else ""):
                (root / doc).write_text(text)
                print(f"updated {doc}")
    return found, stale, errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/report.py", description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated table is stale")
    p.add_argument("--commands", action="store_true", help="print the runner command of every table and exit")
    args = p.parse_args(argv)
    if args.commands:
        for t in TABLES:
            print(f"# {t.key} -> {t.doc}\n{t.runner_command()}")
        return 0
    found, stale, errors = update_docs(REPO, check=args.check)
    for msg in errors:
        print(f"error: {msg}", file=sys.stderr)
    if args.check:
        for s in stale:
            print(f"stale: {s} (run python benchmarks/report.py)", file=sys.stderr)
        print(f"{len(found)} generated tables, {len(stale)} stale" + ("" if stale else ": up to date"))
        return 1 if stale or errors else 0
    print(f"{len(found)} generated tables, {len(stale)} rewritten")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
