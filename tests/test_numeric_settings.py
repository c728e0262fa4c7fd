"""The numeric tests under another CPU kernel set and thread count, in every CI run.

Summation order changes with ``ATEN_CPU_CAPABILITY`` (vector width) and the intra-op thread
count; the tolerances are derived from float32 rounding (``conftest.float32_tol``), so the same
tests must pass under any setting. This runs a representative subset in a child process with the
generic (non-vector) kernels and 3 threads; the full matrix is
``ATEN_CPU_CAPABILITY={default,avx2} UNICON_TEST_THREADS={1,2,4} make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBSET = [
    "tests/test_ofa_parity.py::test_masked_dummy_image_equals_no_image",
    "tests/test_ofa_parity.py::test_fixture_case",
    "tests/test_vqgan.py::test_encode_decode_shapes_and_quantizer",
    "tests/test_ofa_unified.py::test_score_text_matches_naive_per_candidate_forwards",
    "tests/test_ofa_unified.py::test_score_boxes_and_score_image_match_independent_forwards",
    "tests/test_losses.py",
]


def test_numeric_subset_under_generic_kernels_and_three_threads(tmp_path):
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", UNICON_TEST_THREADS="3", OMP_NUM_THREADS="3")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'pytest'}", *SUBSET], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
