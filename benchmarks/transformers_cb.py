"""Throughput of transformers' continuous batching (``model.generate_batch``) with its own paged
attention (``paged|sdpa``) and with pagedattn's (``pagedattn.integrations.transformers``), on
the same random-weight Llama, prompts and greedy decoding.

The model: a Llama of about 1.1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
head_dim 64, MLP 8192, vocabulary 32000, untied embeddings; the sizes of Llama 3.2 1B but its
vocabulary), random weights, bf16 weights and cache. The workload: ``--requests`` prompts of
random tokens and lengths uniform in ``--prompt-lens`` (NumPy seed ``--seed``), each
generating ``--new-tokens`` greedily (no end token). Each implementation first runs a short
warm-up batch (the same prompts, ``--warmup-tokens`` new tokens: kernels compile there), then
the measured one.

Reported per implementation: generated tokens / wall time of ``generate_batch`` (prefill
included), and the decode steps' time: a forward pre-hook on the model notes each step's start
(host clock) and its longest row (``max_seqlen_q``); a decode step (every row one token) lasts
until the next step starts, which with transformers' synchronous loop (CUDA graphs off, the
default here) covers the forward, the sampling, the copy of the tokens to the host and the
scheduling of the next step. Then whether the two implementations gave the same tokens, and
where they first part (request, position, and transformers' own top-two logit margin there:
a near tie lets rounding decide).

    python benchmarks/transformers_cb.py                 # on a CUDA GPU
    python benchmarks/transformers_cb.py --tiny          # tests' model; seconds on the CPU

Run from the repository root with ``PYTHONPATH=$PWD/src``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time

import numpy as np
import torch

if not torch.cuda.is_available():
    # --tiny without a GPU: Triton's interpreter, which must be chosen before Triton's import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# isort: split
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

from pagedattn.integrations import transformers as pagedattn_transformers
from pagedattn.testing import LLAMA_SIZES, random_llama

SDPA = "paged|sdpa"
VOCAB = 32000  # the model: pagedattn.testing.random_llama's "1b" (~1.1B parameters)
# tests/test_transformers.py's model and prompts: greedy picks stand clear of the runner-up.
TINY_VOCAB = 64
TINY_PROMPT_LENGTHS = (5, 12, 20, 37, 3)
TINY_SEED = 13


@dataclasses.dataclass
class Step:
    """One continuous-batching step as the model's forward saw it."""

    start: float  # host clock, seconds
    rows: int | None  # requests in the step
    longest: int | None  # max_seqlen_q: 1 in a decode step


@dataclasses.dataclass
class Result:
    name: str
    tokens: list[list[int]]  # generated tokens per request, in request order
    seconds: float  # wall time of the measured generate_batch
    decode_steps: list[float]  # seconds of each decode step (the last step excluded)
    decode_rows: list[int]  # requests in each of those steps

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


def make_model(tiny: bool, device: torch.device, seed: int) -> LlamaForCausalLM:
    if tiny:  # as the test builds it, for the same weights (drawn on the CPU)
        return random_llama("tiny", vocab_size=TINY_VOCAB, seed=seed).to(device)
    return random_llama("1b", vocab_size=VOCAB, seed=seed, device=device)


def make_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_lengths(requests: int, low: int, high: int, seed: int) -> list[int]:
    """``requests`` lengths uniform in ``low..high``, both included (NumPy ``default_rng``)."""
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.integers(low, high, size=requests, endpoint=True)]


def cb_config(args, prompts: list[list[int]], new_tokens: int) -> ContinuousBatchingConfig:
    """The continuous-batching settings, named as the installed release names them (the page
    size is ``block_size`` in 5.17); the cache holds every request whole."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    pages = sum(-(-(len(p) + new_tokens) // args.page_size) for p in prompts)
    settings = {
        "page_size" if "page_size" in fields else "block_size": args.page_size,
        "num_blocks": pages + len(prompts),
        "use_cuda_graph": {"off": False, "on": True, "auto": None}[args.cuda_graph],
    }
    if args.max_batch_tokens:
        settings["max_batch_tokens"] = args.max_batch_tokens
    if args.max_requests_per_batch:
        settings["max_requests_per_batch"] = args.max_requests_per_batch
    return ContinuousBatchingConfig(**settings)


def generate(model, prompts, args, new_tokens: int, steps: list[Step] | None = None):
    """Greedy tokens per request (request order) and the wall time of ``generate_batch``."""
    generation_config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    hook = None
    if steps is not None:

        def note(module, hook_args, kwargs):
            cu = kwargs.get("cu_seq_lens_q")
            longest = kwargs.get("max_seqlen_q")
            steps.append(
                Step(
                    start=time.perf_counter(),
                    rows=None if cu is None else cu.shape[0] - 1,
                    longest=None if longest is None else int(longest),
                )
            )

        hook = model.register_forward_pre_hook(note, with_kwargs=True)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    try:
        sync()
        start = time.perf_counter()
        outputs = model.generate_batch(
            inputs=prompts,
            generation_config=generation_config,
            continuous_batching_config=cb_config(args, prompts, new_tokens),
            progress_bar=False,
        )
        sync()
        seconds = time.perf_counter() - start
    finally:
        if hook is not None:
            hook.remove()
    errors = [o.error for o in outputs.values() if o.error is not None]
    if errors:
        sys.exit(f"generate_batch reported errors: {errors[:3]}")
    ordered = sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))
    return [list(outputs[k].generated_tokens) for k in ordered], seconds


def run(model, prompts, args, name: str) -> Result:
    model.set_attn_implementation(name)
    if args.warmup_tokens:
        generate(model, prompts, args, args.warmup_tokens)
    steps: list[Step] = []
    tokens, seconds = generate(model, prompts, args, args.new_tokens, steps)
    decode = [
        (later.start - step.start, step.rows)
        for step, later in itertools.pairwise(steps)
        if step.longest == 1
    ]
    return Result(
        name,
        tokens,
        seconds,
        decode_steps=[s for s, _ in decode],
        decode_rows=[r for _, r in decode if r is not None],
    )


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """``(request, position)`` of the first token where ``a`` and ``b`` part, requests in
    order (a missing token counts as a difference); None when they are the same."""
    for request, (x, y) in enumerate(zip(a, b)):
        for position in range(max(len(x), len(y))):
            if position >= len(x) or position >= len(y) or x[position] != y[position]:
                return request, position
    if len(a) != len(b):
        return min(len(a), len(b)), 0
    return None


def top_two_margin(model, ids: list[int]) -> float:
    """transformers' own (``sdpa``, no cache) gap between its two largest next-token logits
    after ``ids``."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1]
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def report(results: list[Result], prompts, model) -> None:
    print(
        "| attention | tokens/s (generate_batch) | seconds | decode steps | mean decode step ms "
        "| median ms | requests per decode step | decode tokens/s |"
    )
    print("|---" * 8 + "|")
    for r in results:
        if r.decode_steps:
            mean = statistics.fmean(r.decode_steps) * 1e3
            median = statistics.median(r.decode_steps) * 1e3
            rows = statistics.fmean(r.decode_rows) if r.decode_rows else float("nan")
            rate = sum(r.decode_rows) / sum(r.decode_steps) if r.decode_rows else float("nan")
            decode = f"{len(r.decode_steps)} | {mean:.2f} | {median:.2f} | {rows:.1f} | {rate:.0f}"
        else:
            decode = "0 | n/a | n/a | n/a | n/a"
        label = r.name.replace("|", "\\|")  # a markdown cell
        print(f"| {label} | {r.tokens_per_s:.0f} | {r.seconds:.2f} | {decode} |")
    base = results[0]
    for other in results[1:]:
        where = first_difference(base.tokens, other.tokens)
        if where is None:
            print(f"tokens identical ({other.name} vs {base.name}): True")
            continue
        request, position = where
        same = sum(x == y for x, y in zip(base.tokens, other.tokens))
        margin = top_two_margin(model, prompts[request] + base.tokens[request][:position])
        print(
            f"tokens identical ({other.name} vs {base.name}): False; {same} of {len(prompts)} "
            f"requests the same; first difference: request {request}, position {position} "
            f"(transformers' top two logits {margin:.4g} apart there)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="tests' 2-layer model (the GPU if any, else the CPU)"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument(
        "--prompt-lens", default="16:512", help="low:high prompt tokens, both included"
    )
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (tiny: 5)")
    parser.add_argument("--page-size", type=int, default=None, help="default 256 (tiny: 16)")
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="new tokens of the warm-up batch, 0: none (default 4; tiny: 0, nothing compiles)",
    )
    parser.add_argument(
        "--cuda-graph",
        choices=("off", "on", "auto"),
        default="off",
        help="transformers' CUDA graphs for both implementations (auto: its own choice); "
        "decode step times need off",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="default: auto")
    parser.add_argument("--max-requests-per-batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        lengths, seed = list(TINY_PROMPT_LENGTHS), TINY_SEED
        args.new_tokens = args.new_tokens or 5
        args.page_size = args.page_size or 16
        args.warmup_tokens = args.warmup_tokens or 0
        args.max_batch_tokens = args.max_batch_tokens or 16
        args.max_requests_per_batch = args.max_requests_per_batch or 8
        # The interpreter runs the programs in turn: one a kv head there.
        num_programs = LLAMA_SIZES["tiny"]["num_key_value_heads"] if device.type == "cpu" else None
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --tiny)")
        device = torch.device("cuda")
        low, high = (int(x) for x in args.prompt_lens.split(":"))
        lengths, seed = prompt_lengths(args.requests, low, high, args.seed), args.seed
        args.new_tokens = args.new_tokens or 128
        args.page_size = args.page_size or 256
        args.warmup_tokens = 4 if args.warmup_tokens is None else args.warmup_tokens
        num_programs = None
    model = make_model(args.tiny, device, seed)
    prompts = make_prompts(lengths, model.config.vocab_size, seed)
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: random Llama, {params / 1e6:.1f}M parameters: hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
        f"head_dim {c.head_dim}, MLP {c.intermediate_size}, vocabulary {c.vocab_size}; bf16 "
        f"weights and cache; {device}"
    )
    print(
        f"workload: {len(prompts)} requests, prompts {min(lengths)}..{max(lengths)} tokens "
        f"(mean {statistics.fmean(lengths):.0f}), {args.new_tokens} new tokens each, greedy; "
        f"page {args.page_size}, CUDA graphs {args.cuda_graph}; transformers "
        f"{__import__('transformers').__version__}, torch {torch.__version__}"
    )
    name = pagedattn_transformers.register(num_programs=num_programs)
    results = [run(model, prompts, args, SDPA), run(model, prompts, args, name)]
    report(results, prompts, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
