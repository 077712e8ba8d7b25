"""Run the porting snippets against the real verl and TRL, in a virtual environment of their own.

    python benchmarks/porting_check.py              # create (or reuse) .porting-venv/, run, write
    python benchmarks/porting_check.py --reinstall  # a fresh venv first

Each snippet is benchmarks/porting/<method>_<framework>.py (docs/porting.md says what it shows):
the part above its `# ---- check` line is what a user copies, the part below runs it on a small
hand-made batch and prints what it checked, ending with `PASS <method>_<framework>`. This script
installs the CPU build of torch (the wheel on this machine's disk: plain `torch` would pull CUDA
builds) and then verl and TRL at the versions below, runs every snippet with the
repository on sys.path and one torch thread, and writes docs/porting_check.md: the commands, the package versions, each snippet's output, pass/fail
(docs/porting.md links each snippet file; nothing is copied into it).

And two files that check all five methods at once (`PASS <method>_<name>` per method):
benchmarks/porting/verl_agent.py (verl-agent's rollout layout and trainer branch) and
benchmarks/porting/verl_v1.py (verl 0.9.1's v1 trainer). No warning is silenced: the doc lists
each run's warnings, as a user will see them.

Not part of the test suite (it installs verl, ray and TRL, about 2 GB): tests/ never imports it.
Runs in about a minute with the venv in place, a few minutes more to build it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNIPPETS = REPO / "benchmarks" / "porting"
DOC = REPO / "docs" / "porting_check.md"
METHODS = ["graphgpo", "istar", "delta_belief", "aria", "epo"]
FRAMEWORKS = ["verl", "trl"]
# files that check all five methods at once, printing `PASS <method>_<name>` for each
SUITES = {"verl_agent": "verl-agent", "verl_v1": "verl v1"}
VERL_AGENT_COMMIT = "796ed310287fa605c9292a0fce07a86d79fde05e"  # what verl_agent.py follows
TORCH = ["torch==2.13.0"]  # first and alone: the CPU wheel on disk (docs/porting_check.md)
# verl's own requirements, less its GPU extras; cachetools, uvicorn and fastapi are what importing
# verl.trainer.ppo.ray_trainer (verl's compute_advantage) needs beyond them (its verl-core extra).
# transformers: the newest verl 0.9.1 admits (< 5.11). tyro, tqdm, scipy: graphgpo.py's imports.
# TransferQueue, pyzmq, msgspec: what importing verl's v1 trainer (verl_v1.py) needs (verl-core).
PACKAGES = ["verl==0.9.1", "trl==1.16.0", "transformers==5.10.4", "cachetools==8.0.2",
            "uvicorn==0.54.0", "fastapi==0.165.0", "tyro==1.0.17", "tqdm==4.70.1", "scipy==1.17.1",
            "TransferQueue==0.1.11", "pyzmq==27.3.0", "msgspec==0.22.0"]
SHOWN = ["torch", "verl", "trl", "transformers", "accelerate", "datasets", "tensordict", "ray",
         "omegaconf", "numpy", "scipy", "tyro"]
# No warning is silenced: each snippet's warnings are what a user sees, listed in the doc.
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
CHECK_LINE = "# ---- check"


def shown(path: Path) -> str:
    """A path as the docs show it: relative to the repository when inside it (links not
    followed: a venv's python is a link out of it)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(REPO))
    except ValueError:
        return path.name


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install(venv: Path, reinstall: bool) -> tuple[list[str], bool]:
    """Create or reuse the venv; install TORCH, then PACKAGES. Returns the commands as shown and
    whether this call installed."""
    py = venv_python(venv)
    pins = venv / "porting-pins.txt"
    wanted = "\n".join(TORCH + PACKAGES) + "\n"
    commands = [f"python3 -m venv {shown(venv)}",
                f"{shown(py)} -m pip install {' '.join(TORCH)}",
                f"{shown(py)} -m pip install " + " \\\n    ".join(
                    " ".join(PACKAGES[i:i + 3]) for i in range(0, len(PACKAGES), 3))]
    if reinstall and venv.exists():
        shutil.rmtree(venv)
    if py.exists() and pins.exists() and pins.read_text() == wanted:
        print(f"reusing {shown(venv)} (same pins)")
        return commands, False
    start = time.time()
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for packages in (TORCH, PACKAGES):
        print(f"pip install {' '.join(packages)}", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    pins.write_text(wanted)
    seconds = time.time() - start
    (venv / "porting-build.json").write_text(json.dumps(
        {"seconds": round(seconds), "when": dt.datetime.now().strftime("%Y-%m-%d %H:%M")}))
    print(f"installed in {seconds:.0f} s")
    return commands, True


def versions(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(venv_python(venv)), "-m", "pip", "list", "--format=json"],
                         capture_output=True, text=True, check=True).stdout
    have = {p["name"].lower(): p["version"] for p in json.loads(out)}
    py = subprocess.run([str(venv_python(venv)), "-c", "import platform; "
                         "print(platform.python_version())"], capture_output=True, text=True)
    return {"python": py.stdout.strip(), **{n: have.get(n, "missing") for n in SHOWN}}


def run_snippet(venv: Path, path: Path, timeout: int) -> dict:
    """Run one snippet in the venv; its stdout, the end of its stderr, pass/fail, wall time."""
    env = {**os.environ, **ENV}
    start = time.time()
    try:
        p = subprocess.run([str(venv_python(venv)), str(path)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", e.stdout or "", f"timed out after {timeout} s"
        out = out.decode() if isinstance(out, bytes) else out
    name = path.stem
    ok = rc == 0 and f"PASS {name}" in out
    return {"name": name, "ok": ok, "rc": rc, "seconds": time.time() - start,
            "stdout": out.rstrip(), "stderr_tail": "\n".join(err.rstrip().splitlines()[-25:]),
            "warnings": warnings_of(out + "\n" + err)}


def warnings_of(text: str) -> list[str]:
    """The distinct warnings a run printed (Python's and the frameworks' log lines), each once,
    paths shortened to the package's own."""
    seen = {}
    for line in text.splitlines():
        if re.search(r"Warning\b|^WARNING", line) and "warnings.warn(" not in line:
            line = re.sub(r"^WARNING:\d{4}-\d\d-\d\d [\d:,]+:", "WARNING:", line.strip())
            line = re.sub(r"\S*site-packages/", "", line)
            line = re.sub(r"\S*/benchmarks/", "benchmarks/", line)
            seen.setdefault(line[:160], None)
    return list(seen)


def checked_lines(stdout: str) -> list[str]:
    """The snippet's output lines without the framework's own log lines."""
    return [ln for ln in stdout.splitlines() if not re.match(r"^(WARNING|INFO):\d{4}-", ln)]


def para(text: str) -> list[str]:
    """A paragraph wrapped at 100 characters, then a blank line."""
    return [*textwrap.wrap(text, 100, break_on_hyphens=False), ""]


def write_doc(results, commands, vers, build, wall, started):
    cores = os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    built = (f"built by this run in {build['seconds']} s" if build.get("this_run") else
             f"built {build['when']} in {build['seconds']} s, reused" if "when" in build else
             "reused")
    lines = [
        "# Porting check: the snippets run against the real verl and TRL", "",
        *para("Generated by `python benchmarks/porting_check.py`; do not edit by hand. What the "
              "snippets show and why: [porting.md](porting.md). A snippet is the part of "
              "`benchmarks/porting/<method>_<framework>.py` above its `# ---- check` line; the "
              "check below that line builds a small batch by hand, runs the snippet through the "
              "framework's own code and compares with the kernel called directly on the same "
              "per-turn arrays."),
        *para(f"Run {started} on {cores} CPU cores ({platform.machine()}, load {load:.1f} at "
              f"the end), one torch thread, no GPU: {wall:.0f} s in all, the venv {built}."),
        "## Environment", "",
        *para("A virtual environment of its own, ignored by git, built by these commands (torch "
              "first, alone: the CPU wheel on disk; verl 0.9.1 pins transformers below 5.11, so "
              "this cannot be the project's venv):"),
        "```", *commands, "```", "",
        "| package | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in vers.items()], "",
        "## Results", "",
        "| method | framework | snippet | result | wall s |", "|---|---|---|---|---|",
    ]
    for method in METHODS:
        for fw in FRAMEWORKS:
            r = results[f"{method}_{fw}"]
            res = "PASS" if r["ok"] else f"FAIL (exit {r['rc']})"
            lines.append(f"| {method} | {fw} | [{r['name']}.py](../benchmarks/porting/"
                         f"{r['name']}.py) | {res} | {r['seconds']:.0f} |")
    for suite, label in SUITES.items():
        r = results[suite]
        for method in METHODS:
            res = "PASS" if f"PASS {method}_{suite}" in r["stdout"] else "FAIL"
            lines.append(f"| {method} | {label} | [{suite}.py](../benchmarks/porting/{suite}.py) "
                         f"| {res} | {r['seconds']:.0f} (all five) |")
    lines += ["", *para(f"verl-agent: `verl_agent.py` follows verl-agent's layout at "
                        f"commit {VERL_AGENT_COMMIT} (read, not installed: the rows are built "
                        "with verl 0.9.1's DataProto, collate_fn and seqlen balancing). verl v1: "
                        "TransferQueue's kv_batch_get/kv_batch_put are an in-memory stand-in "
                        "(the real one starts Ray actors).")]
    for r in results.values():
        lines += ["", f"### {r['name']}", "", f"{r['seconds']:.0f} s, exit {r['rc']}:", "",
                  "```", f"$ PYTHONPATH=. OMP_NUM_THREADS=1 {r['python']} \\",
                  f"    benchmarks/porting/{r['name']}.py", *checked_lines(r["stdout"]), "```"]
        if r["warnings"]:
            lines += ["", "Warnings it printed (what a user sees; none is silenced):", "", "```",
                      *r["warnings"], "```"]
        if not r["ok"]:
            lines += ["", "End of stderr:", "", "```", r["stderr_tail"], "```"]
    DOC.write_text("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".porting-venv",
                    help="the virtual environment (default: .porting-venv in the repository)")
    ap.add_argument("--reinstall", action="store_true", help="delete and rebuild the venv first")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per snippet")
    args = ap.parse_args()
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    t0 = time.time()
    commands, installed = install(args.venv, args.reinstall)
    vers = versions(args.venv)
    results = {}
    for method in METHODS:
        for fw in FRAMEWORKS:
            r = run_snippet(args.venv, SNIPPETS / f"{method}_{fw}.py", args.timeout)
            r["python"] = shown(venv_python(args.venv))
            print(f"{r['name']}: {'PASS' if r['ok'] else 'FAIL'} ({r['seconds']:.0f} s)",
                  flush=True)
            if not r["ok"]:
                print(r["stdout"][-2000:] + "\n" + r["stderr_tail"])
            results[r["name"]] = r
    for suite in SUITES:
        path = SNIPPETS / f"{suite}.py"
        r = run_snippet(args.venv, path, args.timeout)
        r["python"] = shown(venv_python(args.venv))
        r["ok"] = r["rc"] == 0 and all(f"PASS {m}_{suite}" in r["stdout"] for m in METHODS)
        print(f"{suite}: {'PASS' if r['ok'] else 'FAIL'} ({r['seconds']:.0f} s)", flush=True)
        if not r["ok"]:
            print(r["stdout"][-2000:] + "\n" + r["stderr_tail"])
        results[suite] = r
    build_file = args.venv / "porting-build.json"
    build = json.loads(build_file.read_text()) if build_file.exists() else {}
    build["this_run"] = installed
    write_doc(results, commands, vers, build, time.time() - t0, started)
    print(f"wrote {shown(DOC)}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
