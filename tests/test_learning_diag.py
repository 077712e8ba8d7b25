"""benchmarks/learning_diag.py: the standard errors of a change, against numbers computed by hand."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import learning_diag  # noqa: E402


def test_change_ses_by_hand():
    # four tasks; before 1, 1, 0, 0 and after 1, 1, 1, 0 (the same two tasks solved, one more after):
    # each evaluation's sample variance: before 1/3, after 0.75 x 0.25 x 4/3 = 0.25; quadrature
    # sqrt(1/3 / 4 + 0.25 / 4) = sqrt(0.145833) = 0.381881. Differences 0, 0, 1, 0: variance 0.25,
    # paired SE sqrt(0.25 / 4) = 0.25: smaller, because the two evaluations agree on three tasks.
    quadrature, paired = learning_diag.change_ses([1, 1, 0, 0], [1, 1, 1, 0])
    assert quadrature == pytest.approx(0.381881, abs=1e-6) and paired == pytest.approx(0.25)
    # evaluations that disagree on every task: the differences -1, -1, +1, +1 vary more than either
    # evaluation (variance 4/3, SE sqrt(4/3 / 4) = 0.57735 against quadrature sqrt(2 x 1/3 / 4) = 0.408248)
    quadrature, paired = learning_diag.change_ses([1, 1, 0, 0], [0, 0, 1, 1])
    assert quadrature == pytest.approx(0.408248, abs=1e-6) and paired == pytest.approx(0.57735, abs=1e-5)
