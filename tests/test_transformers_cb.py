"""``benchmarks/transformers_cb.py``: transformers' continuous batching with its own paged
attention and with pagedattn's, on the tests' tiny random Llama (Triton's interpreter on the
CPU): the throughput table, one summary line per CUDA-graph mode (requests with equal tokens,
and paged|sdpa's top-two gap where they part), the recording of paged|sdpa's logits step by
step, the output head's scaling and its margin survey."""

import importlib.util
import pathlib
import re
import sys

import pytest
import torch
from conftest import DEVICE

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
    """Both implementations in the table with their decode steps; one summary line per mode,
    last: all requests equal, and with pagedattn's decode output spoiled (zeros), fewer, each
    difference with paged|sdpa's top-two gap at that step (the tests' seed keeps every step's
    gap at 0.125 or more, so a gap read from the wrong step or request would show)."""
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
    graphs = torch.cuda.is_available()
    expected = ["paged\\|sdpa", "paged\\|pagedattn"]
    if graphs:
        expected += ["paged\\|sdpa (cuda graphs)", "paged\\|pagedattn (cuda graphs)"]
    assert list(table) == expected, out
    for label, cells in table.items():
        assert float(cells[0]) > 0, out  # tokens/s
        if "graphs" not in label:
            assert int(cells[2]) >= 2, out  # decode steps
    assert calls  # pagedattn served its runs' decode rows

    lines = out.splitlines()
    modes = ["off", "on"] if graphs else ["off"]
    summary = lines[-len(modes) :]
    assert [line.rsplit(" (", 1)[1] for line in summary] == [f"cuda graphs {m})" for m in modes]
    pattern = r"cb tokens equal: (\d) of 5 requests; differences at gaps <= (none|[0-9.]+) \("
    for line in summary:
        equal, bound = re.match(pattern, line).groups()
        if not spoil:
            assert (equal, bound) == ("5", "none"), line
            continue
        assert int(equal) < 5 and bound != "none", line
        mode = "paged|pagedattn (cuda graphs)" if "graphs on" in line else "paged|pagedattn"
        found = [
            re.search(r"top two logits ([0-9.]+) apart there \(([0-9.]+) bf16 steps", d)
            for d in lines
            if re.match(re.escape(mode) + r": request \d, token \d: ", d)
        ]
        assert len(found) == 5 - int(equal) and all(found), out
        gaps = [float(m.group(1)) for m in found]
        assert max(gaps) == pytest.approx(float(bound), rel=1e-3), out
        assert min(gaps) >= 0.125, out
    if not graphs:
        assert lines[-2] == (
            "cuda graphs on: skipped, no CUDA device (transformers turns them off there)"
        ), out


@needs_supported
def test_recorded_gaps_are_the_reference_runs_logits(script):
    """The reference run's top two logits, recorded at every step, land on the right request and
    token: every generated token has one, its top token is the token generated, and its gap is
    what a plain forward over the same tokens gives (up to bf16 rounding), with pages of 4
    tokens, requests queued behind a full batch and prompts chunked."""
    import argparse

    args = argparse.Namespace(
        page_size=4, max_batch_tokens=24, max_requests_per_batch=4, warmup_tokens=0, new_tokens=6
    )
    model = script.make_model(True, DEVICE, script.TINY_SEED, head_tau=1.0)
    prompts = script.make_prompts(script.prompt_lengths(10, 1, 40, seed=3), 64, seed=5)
    reference, recorder = script.run(model, prompts, args, script.SDPA, graphs=False, record=True)
    gaps = recorder.gaps(prompts, reference.tokens)
    assert sorted(gaps) == [(r, i) for r, t in enumerate(reference.tokens) for i in range(len(t))]
    model.set_attn_implementation("sdpa")
    for (r, i), (gap, top, token) in gaps.items():
        assert token == reference.tokens[r][i]
        ids = torch.tensor([prompts[r] + reference.tokens[r][:i]], device=DEVICE)
        with torch.no_grad():
            values = model(input_ids=ids).logits[0, -1].float().topk(2).values
        # One plain forward rounds otherwise than paged, chunked steps (up to 0.03 here, the
        # logits reaching 2); the gaps of neighbouring steps differ by 0.26 (median).
        assert top == pytest.approx(float(values[0]), abs=0.05)
        assert gap == pytest.approx(float(values[0] - values[1]), abs=0.05)


def test_summary_line_and_differences(script):
    reference = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    gaps = {(r, i): (0.25 * (r + 1) + i, 8.0, t) for r, row in enumerate(reference)
            for i, t in enumerate(row)}  # fmt: skip
    assert script.differences(reference, [list(r) for r in reference], gaps) == []
    line = script.summary_line(3, [], graphs=False)
    assert line == "cb tokens equal: 3 of 3 requests; differences at gaps <= none (cuda graphs off)"
    found = script.differences(reference, [[1, 2, 3], [4, 0, 6], [7, 8]], gaps)
    assert [(d.request, d.index, d.ours, d.reference) for d in found] == [
        (1, 1, 0, 5),
        (2, 2, None, 9),
    ]
    assert [d.gap for d in found] == [1.5, 2.75]
    assert found[0].bf16_steps == 1.5 / script.bf16_step(8.0) == 24
    line = script.summary_line(3, found, graphs=True)
    assert line == "cb tokens equal: 1 of 3 requests; differences at gaps <= 2.75 (cuda graphs on)"


def test_head_scaling(script):
    from pagedattn.testing import random_llama

    model = random_llama("tiny", vocab_size=64, seed=1)
    before = model.lm_head.weight.float().clone()
    script.scale_head(model, 0)
    assert torch.equal(model.lm_head.weight.float(), before)
    script.scale_head(model, 2.0)
    after = model.lm_head.weight.float()
    factor = (after.norm(dim=1) / before.norm(dim=1)).sort(descending=True).values
    expected = torch.exp(-torch.arange(64) / 2.0).clamp(min=script.HEAD_FLOOR)
    torch.testing.assert_close(factor, expected, rtol=2e-2, atol=0)
    assert script.bf16_step(1.0) == 2**-7 and script.bf16_step(-3.0) == 2**-6


def test_refuses_a_release_without_the_cuda_graph_option(script, monkeypatch):
    import dataclasses

    @dataclasses.dataclass
    class OlderConfig:
        page_size: int = 16

    monkeypatch.setattr(script, "ContinuousBatchingConfig", OlderConfig)
    with pytest.raises(SystemExit, match=r"has no use_cuda_graph option"):
        script.main(["--tiny"])


def test_margin_survey_runs(script, capsys):
    argv = [
        "--margin-survey",
        "--survey-requests",
        "3",
        "--survey-tokens",
        "4",
        "--survey-taus",
        "1",
    ]
    assert script.main(argv) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()]
    rows = {
        r[0][2:]: r[1:] for r in rows if r[0] in ("| as drawn", "| all rows x10", "| rows, tau 1")
    }
    assert list(rows) == ["as drawn", "all rows x10", "rows, tau 1"]
    assert all(re.fullmatch(r"[0-9.]+% / [0-9.]+% / [0-9.]+%", cells[0]) for cells in rows.values())
    # The row scaling's winners stand further from the runner-up than the drawn head's.
    assert int(rows["rows, tau 1"][1]) > 2 * int(rows["as drawn"][1])


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
