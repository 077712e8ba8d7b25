"""The blocks every method file needs the same way are the same text in all five files. Each file reads
alone (the duplication is intended), but a fix made in one copy must be made in all: the same sampled
tokens must become the same training tokens whatever the method."""

from __future__ import annotations

import ast

import pytest

from conftest import REPO

METHODS = ["graphgpo.py", "istar.py", "delta_belief.py", "aria.py", "epo.py"]
SHARED = ["render_prompt", "encode", "generate", "completion_logprobs", "mean_se", "learning_summary",
          "print_learning", "Logger"]
SHARED_WHERE_DEFINED = ["save_adapter"]  # istar saves two adapters with its own save_adapters


def _blocks(name: str) -> dict[str, str]:
    text = (REPO / name).read_text()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(text, node)
    return out


@pytest.mark.parametrize("block", SHARED + SHARED_WHERE_DEFINED)
def test_block_is_the_same_text_in_every_method_file(block):
    texts = {name: _blocks(name).get(block) for name in METHODS}
    if block in SHARED:
        missing = [n for n, t in texts.items() if t is None]
        assert not missing, f"{block} is missing in {missing}"
    present = {n: t for n, t in texts.items() if t is not None}
    assert len(present) >= 2
    reference = present["graphgpo.py"]
    drifted = [n for n, t in present.items() if t != reference]
    assert not drifted, f"{block} differs from graphgpo.py's in {drifted}"
