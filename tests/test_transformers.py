"""pagedattn as the attention of transformers' continuous batching
(``pagedattn.integrations.transformers``): a tiny random Llama (GQA, two layers) generates
greedily with ``generate_batch`` over transformers' own paged cache and gives the tokens of
transformers' own paged attention (``paged|sdpa``); every row of at most eight new tokens was
served by ``pagedattn.paged_decode``. On the GPU where there is one, else through Triton's
interpreter on the CPU."""

import dataclasses
import itertools
import re

import pytest
import torch
from conftest import DEVICE

import pagedattn

transformers = pytest.importorskip("transformers", reason="needs transformers (the examples extra)")

from packaging.specifiers import SpecifierSet  # noqa: E402  (transformers' dependency)

from pagedattn.integrations import transformers as pagedattn_transformers  # noqa: E402

SUPPORTED = transformers.__version__ in SpecifierSet(
    ",".join(pagedattn_transformers.SUPPORTED_VERSIONS)
)
needs_supported = pytest.mark.skipif(
    not SUPPORTED,
    reason=f"transformers {transformers.__version__} is outside the integration's range "
    f"{pagedattn_transformers.SUPPORTED_VERSIONS} (the examples extra installs one inside it)",
)

# Lengths that make transformers chunk the two long prompts over several steps (16 tokens a
# step), so that steps mix prefill chunks with other requests' decode rows, and the short
# prompts (<= 8 tokens) are themselves rows for pagedattn.
PROMPT_LENGTHS = (5, 12, 20, 37, 3)
NEW_TOKENS = 5
MAX_BATCH_TOKENS = 16
VOCAB = 64
# Weights and prompts of this seed give transformers' greedy picks a margin of at least 0.125
# between the top two logits (8 bf16 steps at their size) at every step: greedy tokens then
# compare attention implementations, not rounding at a near tie. (Most seeds have a step with
# a margin of 0 or 1 step: paged|eager and paged|sdpa part there.)
SEED = 13


@pytest.fixture(scope="module")
def model():
    from pagedattn.testing import random_llama

    # Drawn on the CPU, then moved: the same weights on either device.
    return random_llama("tiny", vocab_size=VOCAB, seed=SEED, max_position_embeddings=256).to(DEVICE)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _generate(model, prompts, attn_implementation, page_size):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_key = "page_size" if "page_size" in fields else "block_size"  # 5.17: block_size
    cb_config = ContinuousBatchingConfig(
        **{page_key: page_size},
        num_blocks=64,
        max_batch_tokens=MAX_BATCH_TOKENS,
        max_requests_per_batch=8,
    )
    generation_config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    model.set_attn_implementation(attn_implementation)
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=generation_config,
        continuous_batching_config=cb_config,
        progress_bar=False,
    )
    assert all(o.error is None for o in outputs.values()), outputs
    return [outputs[k].generated_tokens for k in sorted(outputs, key=lambda k: int(k[4:]))]


def _is_mixed(rows) -> bool:
    return min(rows) <= pagedattn_transformers.MAX_DECODE_ROWS < max(rows)


def _generate_on_pagedattn(model, prompts, page_size, monkeypatch, *, spoil_mixed=False):
    """Greedy tokens with pagedattn's attention, the rows of each request in each attention call
    (what transformers asked) and the rows each ``pagedattn.paged_decode`` call wrote. With
    ``spoil_mixed``, the decode calls of mixed steps (prefill chunks beside short rows) return
    zeros instead of their result."""
    asked, served = [], []

    def record(module, args, kwargs):
        cu = kwargs["cu_seq_lens_q"].tolist()
        asked.append([b - a for a, b in itertools.pairwise(cu)])

    decode = pagedattn.paged_decode

    def spy(q, *args, **kwargs):
        loc = kwargs.get("query_start_loc")
        served.append(q.shape[0] if loc is None else int(loc[-1]))
        out = decode(q, *args, **kwargs)
        return out.zero_() if spoil_mixed and _is_mixed(asked[-1]) else out

    hooks = [
        layer.self_attn.register_forward_pre_hook(record, with_kwargs=True)
        for layer in model.model.layers
    ]
    monkeypatch.setattr(pagedattn, "paged_decode", spy)
    try:
        name = pagedattn_transformers.register(num_programs=2)
        assert pagedattn_transformers.register(num_programs=2) == name == "paged|pagedattn"
        tokens = _generate(model, prompts, name, page_size)
    finally:
        for hook in hooks:
            hook.remove()
        monkeypatch.undo()
    return tokens, asked, served


@needs_supported
@pytest.mark.parametrize("page_size", [4, 16])
def test_generate_batch_matches_transformers_and_decodes_on_pagedattn(
    model, prompts, page_size, monkeypatch
):
    expected = _generate(model, prompts, "paged|sdpa", page_size)
    got, asked, served = _generate_on_pagedattn(model, prompts, page_size, monkeypatch)

    assert got == expected
    assert all(len(tokens) == NEW_TOKENS for tokens in got)
    # One decode call per layer per step, serving exactly the rows of <= 8 new tokens: in the
    # decode steps (one row per request) and beside prefill chunks alike.
    short = [sum(n for n in rows if n <= pagedattn_transformers.MAX_DECODE_ROWS) for rows in asked]
    assert served == short
    layers = len(model.model.layers)
    decode_steps = sum(max(rows) == 1 for rows in asked) / layers
    mixed_steps = sum(_is_mixed(rows) for rows in asked) / layers
    assert decode_steps >= NEW_TOKENS - 2 and mixed_steps >= 1, asked


@needs_supported
def test_mixed_steps_take_pagedattns_rows(model, prompts, monkeypatch):
    """In a step that mixes prefill chunks with short rows, the short rows' output is
    pagedattn's (spoiling it changes the tokens), not transformers' own for those rows."""
    expected = _generate(model, prompts, "paged|sdpa", 16)
    spoiled, asked, _ = _generate_on_pagedattn(model, prompts, 16, monkeypatch, spoil_mixed=True)
    assert any(_is_mixed(rows) for rows in asked)
    assert spoiled != expected


_FROM_5_19 = (
    r"from 5\.19 continuous batching accepts only 'paged\|eager', 'sdpa' or implementations "
    r"whose name contains 'flash'"
)
_FROM_5_24 = (
    r"from 5\.24 the model's attention layer writes the paged cache and gathers the keys and "
    r"values before it calls the attention function, so the function no longer receives the "
    r"cache"
)


@pytest.mark.parametrize(
    ("version", "reasons", "absent"),
    [
        # 5.19-5.23: continuous batching admits only its own names and FlashAttention ones.
        ("5.19.0", [_FROM_5_19], ["5.24"]),
        ("5.23.1", [_FROM_5_19], ["5.24"]),
        ("5.19.0.dev0", [_FROM_5_19], ["5.24"]),
        # 5.24 on: the layer writes and gathers the cache, and the 5.19 limit still holds.
        ("5.24.0", [_FROM_5_24, _FROM_5_19], []),
        ("5.25.2", [_FROM_5_24, _FROM_5_19], []),
        # Older releases: outside the tested range, neither limit applies.
        ("5.16.1", [], ["5.19", "5.24"]),
        ("4.57.0", [], ["5.19", "5.24"]),
    ],
)
def test_register_names_the_reason_for_the_release_in_use(monkeypatch, version, reasons, absent):
    import transformers  # the module as imported now (continuous batching may re-import it)

    monkeypatch.setattr(transformers, "__version__", version)
    with pytest.raises(RuntimeError) as refused:
        pagedattn_transformers.register()
    message = str(refused.value)
    assert message.startswith(f"pagedattn.integrations.transformers: transformers {version}: ")
    assert message.endswith("supported: transformers 5.17-5.18"), message
    for reason in reasons:
        assert re.search(reason, message), message
    for other in absent:
        assert other not in message, message


@pytest.mark.parametrize("version", ["5.17.0", "5.18.0", "5.18.2", "5.18.0rc1"])
def test_register_accepts_5_17_and_5_18(monkeypatch, version):
    import transformers

    monkeypatch.setattr(transformers, "__version__", version)
    monkeypatch.setitem(pagedattn_transformers._OPTIONS, "num_programs", None)  # restored after
    assert pagedattn_transformers.register(num_programs=2) == "paged|pagedattn"
    assert pagedattn_transformers._OPTIONS["num_programs"] == 2


def test_plain_forward_without_the_paged_cache_is_refused():
    module = torch.nn.Module()
    module.layer_idx = 0
    q = torch.zeros(1, 4, 3, 64, dtype=torch.bfloat16)
    kv = torch.zeros(1, 2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"paged\|pagedattn was called without a paged"):
        pagedattn_transformers.paged_attention_forward(module, q, kv, kv, None)
