"""``examples/generate.py --tiny``: a 2-layer random Llama whose decode attention runs on
pagedattn (Triton's interpreter on the CPU) gives the tokens of transformers' own greedy
generation."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="the example needs transformers (the examples extra)")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "generate.py"


@pytest.mark.skipif(
    tuple(int(x) for x in __import__("numpy").__version__.split(".")[:2]) >= (2, 4),
    reason="Triton's interpreter needs numpy < 2.4 (the package's dependency pins it; "
    "this environment has another)",
)
def test_generate_tiny_matches_transformers():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens match: True" in result.stdout, result.stdout
    assert "kv cache: bf16" in result.stdout
    # 2 layers x 5 decode steps (the first token comes from the prefill) ran on pagedattn.
    assert "pagedattn.paged_decode calls (Python side): 10" in result.stdout, result.stdout
    assert "max logit difference:" in result.stdout and "tokens/s" in result.stdout
    # Steady-state decode: the 4 decode steps after the first (which compiles), 3 sequences.
    assert "decode steady state (eager): " in result.stdout, result.stdout
    assert "(median of 4 steps of 3 sequences" in result.stdout, result.stdout
