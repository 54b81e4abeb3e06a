"""``benchmarks/transformers_cb.py --tiny``: transformers' continuous batching with its own
paged attention and with pagedattn's, on the tests' tiny random Llama (Triton's interpreter on
the CPU): the throughput table, the same tokens, and where they part when they do not."""

import importlib.util
import pathlib
import sys

import pytest
import torch

import pagedattn

transformers = pytest.importorskip("transformers", reason="needs transformers (the examples extra)")

from packaging.specifiers import SpecifierSet  # noqa: E402  (transformers' dependency)

from pagedattn.integrations import transformers as pagedattn_transformers  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "transformers_cb.py"
needs_supported = pytest.mark.skipif(
    transformers.__version__
    not in SpecifierSet(",".join(pagedattn_transformers.SUPPORTED_VERSIONS)),
    reason=f"transformers {transformers.__version__} is outside the integration's range",
)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("transformers_cb", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _table(out: str) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| paged\\|")]
    return {r[0][2:]: r[1:] for r in rows}


@needs_supported
@pytest.mark.parametrize("spoil", [False, True])
def test_tiny_run_reports_both_implementations(script, capsys, monkeypatch, spoil):
    """Both implementations in the table with their decode steps; the same tokens, and with
    pagedattn's decode output spoiled (zeros), the first request and position where they part
    and transformers' margin there."""
    decode = pagedattn.paged_decode
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        out = decode(*args, **kwargs)
        return out.zero_() if spoil else out

    monkeypatch.setattr(pagedattn, "paged_decode", spy)
    assert script.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "workload: 5 requests, prompts 3..37 tokens" in out and "5 new tokens each" in out
    table = _table(out)
    assert list(table) == ["paged\\|sdpa", "paged\\|pagedattn"], out
    for cells in table.values():
        assert float(cells[0]) > 0 and int(cells[2]) >= 2, out  # tokens/s, decode steps
    assert calls  # pagedattn served the second run's decode rows
    line = next(line for line in out.splitlines() if line.startswith("tokens identical"))
    if not spoil:
        assert line == "tokens identical (paged|pagedattn vs paged|sdpa): True"
    else:
        assert line.startswith("tokens identical (paged|pagedattn vs paged|sdpa): False; ")
        assert "first difference: request " in line and "top two logits " in line, line


def test_first_difference(script):
    same = [[1, 2, 3], [4, 5]]
    assert script.first_difference(same, [[1, 2, 3], [4, 5]]) is None
    assert script.first_difference(same, [[1, 2, 3], [4, 6]]) == (1, 1)
    assert script.first_difference(same, [[1, 9, 3], [4, 6]]) == (0, 1)
    assert script.first_difference(same, [[1, 2], [4, 5]]) == (0, 2)  # a token missing
    assert script.first_difference(same, [[1, 2, 3]]) == (1, 0)  # a request missing


def test_prompt_lengths_are_reproducible_and_in_range(script):
    lengths = script.prompt_lengths(64, 16, 512, seed=0)
    assert lengths == script.prompt_lengths(64, 16, 512, seed=0)
    assert len(lengths) == 64 and min(lengths) >= 16 and max(lengths) <= 512
    assert len(set(lengths)) > 32
    prompts = script.make_prompts([3, 7], vocab=50, seed=1)
    assert [len(p) for p in prompts] == [3, 7] and all(0 <= t < 50 for p in prompts for t in p)
    assert torch.is_tensor(torch.tensor(prompts[0]))
