"""Each method script runs a hub-style checkpoint it has never seen: a random Qwen2 whose generation config
carries a repetition penalty, top-k, a temperature and two EOS ids (tests/conftest.py), in 4-bit nf4 and in
plain weights, on a CPU, one iteration each, with the real-model defaults (no tiny recipe applies)."""

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
