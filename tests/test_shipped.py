"""The shipped tiny policies (common/weights): every testbed ships its current recipe, within the size
budget; every shipped policy matches its checksums and plays its recorded greedy episodes again; a
corrupted or missing file is one clear error (from ensure_tiny, load_policy and a script), never a
rebuild; an empty cache never builds a shipped recipe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from common import tiny
from tests.conftest import REPO

MANIFEST = tiny.read_manifest()
SHIPPED = sorted(MANIFEST["policies"])


def test_every_testbed_ships_its_current_recipe_within_the_size_budget():
    for name, (env_id, overrides) in tiny.TESTBEDS.items():
        expected = f"{env_id}__default__{tiny.recipe_hash(tiny.full_recipe(env_id, 'default', overrides))}"
        assert expected in MANIFEST["policies"], (
            f"testbed {name}: its recipe is {expected}, which is not shipped (a recipe changed without "
            f"`python -m common.tiny --testbed {name} --ship`)")
        assert MANIFEST["policies"][expected]["testbed"] == name
    sizes = {k: sum(f.stat().st_size for f in (tiny.SHIPPED_DIR / k).iterdir()) for k in SHIPPED}
    assert all(size <= 3 * 2**20 for size in sizes.values()), sizes
    assert sum(sizes.values()) <= 30 * 2**20, sizes
    # nothing shipped that the manifest does not list (an orphan would be loaded by no one)
    on_disk = {p.name for p in tiny.SHIPPED_DIR.iterdir() if p.is_dir()}
    assert on_disk == set(SHIPPED)


def test_epo_strategist_testbed_is_the_recipe_epo_loads():
    assert tiny.TESTBEDS["negotiation_strategist"] == ("negotiation", tiny.strategist_overrides("negotiation"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policy_checksums_and_recorded_greedy_episodes(name):
    entry = MANIFEST["policies"][name]
    path = tiny.verify_shipped(name)
    assert set(tiny.SHIPPED_FILES) <= set(entry["files"])
    assert {p.name for p in path.iterdir()} == set(entry["files"])  # every file shipped is checked
    assert tiny.read_meta(path)["recipe_hash"] == entry["recipe_hash"] == name.split("__")[-1]
    assert len(entry["greedy_check"]) >= 2, "too few recorded greedy episodes to check the policy"
    assert tiny.replay_greedy_check(path, entry["greedy_check"]) == []


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch):
    """A writable copy of one shipped policy and the manifest, installed as the shipped weights."""
    name = next(k for k in SHIPPED if MANIFEST["policies"][k]["testbed"] == "sokoban")
    root = tmp_path / "weights"
    root.mkdir()
    shutil.copytree(tiny.SHIPPED_DIR / name, root / name)
    manifest = {"policies": {name: MANIFEST["policies"][name]}}
    (root / tiny.MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setattr(tiny, "SHIPPED_DIR", root)
    return root, name


def _never_build(*args, **kwargs):
    raise AssertionError("a shipped recipe must never be built")


def test_corrupted_weights_are_one_clear_error_never_a_rebuild(shipped_copy, tmp_path, monkeypatch):
    root, name = shipped_copy
    weights = root / name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    monkeypatch.setattr(tiny, "build_tiny", _never_build)
    with pytest.raises(tiny.ShippedWeightsError, match=r"model\.safetensors has SHA-256 .*git checkout") as e:
        tiny.ensure_tiny("sokoban", cache_dir=tmp_path / "cache", progress=False)
    assert "\n" not in str(e.value)
    from common.models import UserError, load_policy

    with pytest.raises(UserError, match="shipped tiny policy .*model.safetensors"):
        load_policy("tiny", env_id="sokoban")
    # the script prints it as one error line and exits non-zero
    env = dict(os.environ, CREDIT_TINY_WEIGHTS=str(root), CREDIT_TINY_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(REPO / "graphgpo.py"), "--output-dir", str(tmp_path / "runs")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("error: shipped tiny policy")
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_missing_weights_file_is_one_clear_error(shipped_copy, tmp_path, monkeypatch):
    root, name = shipped_copy
    (root / name / "model.safetensors").unlink()
    monkeypatch.setattr(tiny, "build_tiny", _never_build)
    with pytest.raises(tiny.ShippedWeightsError, match="model.safetensors is missing; restore it"):
        tiny.ensure_tiny("sokoban", cache_dir=tmp_path / "cache", progress=False)


def test_empty_cache_never_builds_a_shipped_recipe(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "build_tiny", _never_build)
    for env_id, overrides in tiny.TESTBEDS.values():
        path = tiny.ensure_tiny(env_id, cache_dir=tmp_path / "cache", progress=False, overrides=overrides)
        assert path.parent == tiny.SHIPPED_DIR
    assert not (tmp_path / "cache").exists()


def test_check_command_reports_every_testbed_ok():
    proc = subprocess.run([sys.executable, "-m", "common.tiny", "--testbed", "sokoban", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checksums ok, greedy check ok" in proc.stdout
