"""benchmarks/gpu_check.py on a CPU: the step stage on a random model of the `test` configuration through
common/models.py, and the report built from raw records (numbers checked by hand)."""

from __future__ import annotations

import json

import pytest

from conftest import load_benchmark


@pytest.fixture(scope="module")
def gc():
    return load_benchmark("gpu_check")


ENV = {"device": "NVIDIA X", "gpu_memory_gib": 80.0, "torch": "2.11", "cuda": "13.0", "transformers": "5.24.0",
       "peft": "0.21.2", "bitsandbytes": "0.50.2", "time": "2026-11-26 01:00:00"}


def test_report_from_records(gc):
    step = {"kind": "step", "config": "qwen2.5-1.5b", "parameters": 1_543_714_304, **ENV, "batch": 32,
            "prompt_len": 512, "new_tokens": 128, "load_in_4bit": True, "activation_checkpointing": False,
            "load_s": 1.4, "mem_after_load_gib": 1.143, "trainable_parameters": 18_464_768,
            "only_lora_trainable": True, "generate_s": 15.08, "generate_tokens_per_s": 271.6, "train_step_s": 0.74,
            "train_peak_gib": 88.983, "lora_grads_finite": True, "frozen_without_grad": True,
            "disable_adapter_max_abs_diff_to_base": 0.0}
    script = {"kind": "script", "config": "qwen2.5-1.5b", **ENV, "script": "graphgpo.py", "threads": 4,
              "env_id": "sokoban", "wall_seconds": 58.0, "eval_seconds": 15.5,
              "perf": {"perf/rollout_seconds": 7.5, "perf/old_logprob_seconds": 1.5, "perf/update_seconds": 3.0,
                       "perf/credit_seconds": 0.01, "perf/iteration_seconds": 12.0,
                       "perf/tokens_per_second": 34.0, "perf/peak_memory_gb": 6.34}}
    failed = {"kind": "script", "config": "qwen2.5-1.5b", **ENV, "script": "epo.py", "threads": 4, "failed": True,
              "exit_code": 1, "log_tail": "Traceback ...\nRuntimeError: device mismatch\n"}
    text = gc.render_report([step, script, failed])
    assert "**NVIDIA X**" in text and "CUDA 13.0" in text
    # 15.08 s / 128 steps = 117.8 ms per decoding step; 1,543,714,304 parameters -> 1544M
    assert "| qwen2.5-1.5b | 1544M | 4-bit nf4 | False | 1.4 | 1.143 | 18.46M | 271.6 | 118 | 0.74 | 88.983 |" in text
    # update = 3.0 + 1.5 old log-probs; credit 0.01 rounds to 0.0
    assert "| qwen2.5-1.5b | graphgpo.py | sokoban | 7.5 | 0.0 | 4.5 | 12.0 | 34.0 | 6.34 | 15.5 | 58 |" in text
    assert "| qwen2.5-1.5b | epo.py | failed (exit 1): RuntimeError: device mismatch |" in text
    assert "Not run on a GPU yet" in gc.render_report([])


def test_step_stage_on_cpu_records_lora_only_gradients(gc, random_llama_dir, tmp_path):
    results, report = tmp_path / "gpu.jsonl", tmp_path / "gpu.md"
    gc.main(["--stages", "step", "report", "--configs", "test", "--device", "cpu", "--tokenizer",
             str(random_llama_dir), "--batch", "2", "--prompt-len", "8", "--new-tokens", "4",
             "--results", str(results), "--report-path", str(report)])
    (rec,) = [json.loads(x) for x in results.read_text().splitlines()]
    assert rec["kind"] == "step" and rec["config"] == "test" and rec["load_in_4bit"] is False
    assert rec["only_lora_trainable"] and rec["lora_grads_finite"] and rec["frozen_without_grad"]
    assert rec["adapter_changes_logits"] and rec["disable_adapter_max_abs_diff_to_base"] == 0.0
    assert rec["lora_grad_norm"] > 0
    assert "| test | " in report.read_text()


def test_generate_stage_on_cpu_compares_the_two_caches(gc, random_llama_dir, tmp_path):
    results, report = tmp_path / "gpu.jsonl", tmp_path / "gpu.md"
    gc.main(["--stages", "generate", "report", "--configs", "test", "--device", "cpu", "--tokenizer",
             str(random_llama_dir), "--batch", "3", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
             "--results", str(results), "--report-path", str(report)])
    plain, static = [json.loads(x) for x in results.read_text().splitlines()]
    assert (plain["cache"], static["cache"]) == ("dynamic", "static") and not plain["load_in_4bit"]
    assert static["greedy_rows_equal"] == "3/3" and "greedy_rows_equal" not in plain  # same tokens on a CPU
    assert plain["tokens_per_s"] > 0 and static["ms_per_step"] > 0
    text = report.read_text()
    assert "## Fast generation" in text and "| test | bf16 | static |" in text


def test_generate_report_speed_up_by_hand(gc):
    rec = {**ENV, "kind": "generate", "config": "smollm2-135m", "batch": 32, "prompt_len": 512, "new_tokens": 128,
           "load_in_4bit": False, "first_call_s": 9.0, "call_s": 6.4, "tokens_per_s": 640.0, "ms_per_step": 50.0,
           "five_rows_s": 5.0}
    fast = {**rec, "cache": "static", "first_call_s": 60.0, "call_s": 2.0, "tokens_per_s": 2048.0,
            "ms_per_step": 15.6, "greedy_rows_equal": "7/8"}
    text = gc.render_report([{**rec, "cache": "dynamic"}, fast])
    # 2048 / 640 = 3.2x
    assert "| smollm2-135m | bf16 | static | 60.0 | 2.0 | 2048.0 | 15.6 | 3.20x | 5.0 | 7/8 |" in text
    assert "| smollm2-135m | bf16 | dynamic | 9.0 | 6.4 | 640.0 | 50.0 | 1.00x | 5.0 | – |" in text
    failed = {**ENV, "kind": "script", "config": "c", "script": "graphgpo.py", "failed": True, "exit_code": 1,
              "log_tail": "x", "threads": 1}
    assert "Not measured yet" in gc.render_report([failed])


def test_unknown_script_is_one_line(gc):
    with pytest.raises(SystemExit, match="--scripts: unknown"):
        gc.main(["--stages", "report", "--scripts", "nope.py"])
