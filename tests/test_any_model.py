"""Each method script runs a hub-style checkpoint it has never seen: a random Qwen2 whose generation config
carries a repetition penalty, top-k, a temperature and two EOS ids (tests/conftest.py), in 4-bit nf4, in
plain fp32 weights and in bf16 weights (the CUDA default without 4-bit), on a CPU, one iteration each, with the
real-model defaults (no tiny recipe applies)."""

import pytest

from conftest import assert_run_outputs

SIZE = ["--num-iterations", "1", "--eval-num-tasks", "1", "--max-new-tokens", "8", "--checkpoint-every", "0",
        "--lora-r", "4", "--lora-alpha", "8"]
FLAGS = {
    "graphgpo.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "2"],
    "istar.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "2"],
    "delta_belief.py": ["--tasks-per-iteration", "1", "--group-size", "2", "--max-turns", "2", "--eval-k", "1"],
    "aria.py": ["--games-per-iteration", "2", "--eval-k", "1", "--eval-opponents", "fair"],
    "epo.py": ["--episodes-per-iteration", "2", "--num-epochs", "1", "--trajectories-per-step", "2",
               "--eval-opponents", "fair"],
}


@pytest.fixture(scope="module")
def qwen2_runs(method_pool, random_qwen2_dir, tmp_path_factory):
    return {(script, bits): method_pool(script, "--model-name", str(random_qwen2_dir), "--load-in-4bit", bits,
                                        *SIZE, *FLAGS[script], out=tmp_path_factory.mktemp(script[:-3] + bits))
            for script in FLAGS for bits in ("True", "False")}


@pytest.mark.parametrize("bits", ["True", "False"])
@pytest.mark.parametrize("script", sorted(FLAGS))
def test_one_iteration_on_a_random_qwen2_with_generation_config_traps(qwen2_runs, script, bits):
    run_dir = qwen2_runs[(script, bits)].result()
    summary = assert_run_outputs(run_dir)
    assert summary["iterations"] == 1


@pytest.mark.parametrize("script", sorted(FLAGS))
def test_one_iteration_in_bf16_weights_as_on_a_gpu(script, random_qwen2_dir, tmp_path, monkeypatch):
    """Plain weights in bf16, what a CUDA run without 4-bit loads, here on a CPU (in process, the loader's
    dtype patched): no LoRA merge while sampling, π_θold's log-probs recomputed (sampling kept them in bf16),
    and the run ends with every logged loss finite."""
    import importlib
    import json

    import torch
    import tyro

    from common import models

    mod = importlib.import_module(script[:-3])
    monkeypatch.setattr(models, "_dtypes", lambda device, use_4bit: (torch.bfloat16, None))
    loaded, load = [], models.load_policy
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    threads = torch.get_num_threads()
    try:
        mod.main(tyro.cli(mod.Args, args=["--model-name", str(random_qwen2_dir), "--load-in-4bit", "False",
                                          *SIZE, *FLAGS[script], "--output-dir", str(tmp_path),
                                          "--torch-threads", "1"]))
    finally:
        torch.set_num_threads(threads)
    model = loaded[0][0]
    assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.bfloat16}
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert_run_outputs(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {k: v for row in rows for k, v in row.items() if k.startswith("losses/")}
    assert losses and all(v is not None for v in losses.values()), losses
