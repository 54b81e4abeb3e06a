"""transformers' continuous batching (``model.generate_batch``) with its own paged attention
(``paged|sdpa``) and with pagedattn's (``pagedattn.integrations.transformers``), on the same
random-weight Llama, prompts and greedy decoding: throughput, and whether pagedattn gives
transformers' tokens, with and without transformers' CUDA graphs.

The model: a Llama of about 1.1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
head_dim 64, MLP 8192, vocabulary 32000, untied embeddings; the sizes of Llama 3.2 1B but its
vocabulary), random weights, bf16 weights and cache, its output head scaled row by row so that
greedy choices have margin (below). The workload: ``--requests`` prompts of random tokens and
lengths uniform in ``--prompt-lens`` (NumPy seed ``--seed``), each generating
``--new-tokens`` greedily (no end token). Each run first makes a short warm-up batch (the
same prompts, ``--warmup-tokens`` new tokens: kernels compile there), then the measured one.

Modes (``--cuda-graph``, default both): transformers' CUDA graphs off, then on
(``ContinuousBatchingConfig(use_cuda_graph=...)``, which transformers 5.17 and 5.18 offer; the
script refuses a release without it, and skips the graph mode without a GPU). The reference is
``paged|sdpa`` with graphs off: its run records, at every step, each request's top two logits
(a forward hook on the model; the requests are told apart by the cache slot of their first
token). In each mode pagedattn's tokens are compared with the reference's, request by request:
a request is equal when all its tokens are; where one differs, the first differing token and
the reference's top-two gap at that step are printed. With graphs on, ``paged|sdpa`` runs with
graphs as well, for the table and as a control (its tokens against its own graphs-off run).

Reported per run: generated tokens / wall time of ``generate_batch`` (prefill included), and
the decode steps' time (graphs off): a forward pre-hook notes each step's start (host clock)
and its longest row (``max_seqlen_q``); a decode step (every row one token) lasts until the
next step starts, which with transformers' synchronous loop covers the forward, the sampling,
the copy of the tokens to the host and the scheduling of the next step. A replayed graph runs
no hook, so with graphs on the decode columns are n/a and the graphs captured are counted
instead; the wall time then includes the captures (each ``generate_batch`` captures its own
graphs before it starts), so it is no steady rate. The reference run's recording costs a few
device copies a step and no host sync.
The last lines, one per mode::

    cb tokens equal: R of N requests; differences at gaps <= G (cuda graphs off)
    cb tokens equal: R of N requests; differences at gaps <= G (cuda graphs on)

(``G``: the largest top-two gap, in logits, among the differences; ``none`` when there are
none.)

Margin: a random model's logits over a 32000-token vocabulary are nearly independent draws, so
the top two often sit within bf16's rounding of each other, and any difference in rounding
upstream (two correct attention implementations) picks another token there. Scaling the whole
head does not help: the logits, their gaps and bf16's rounding step scale together. The head's
row of token ``v`` is scaled instead by ``max(exp(-rank(v) / tau), 1e-4)``, ``rank`` a random
permutation of the vocabulary (seed 7): a few tokens compete, and the winner usually stands
clear. ``--head-tau`` (default 1; 0: none) chooses ``tau``. ``--margin-survey`` measures it on
the CPU with the tests' tiny sizes and this vocabulary (a step's logits are the head's rows
against one normalised hidden state, so their spread does not depend on the model's width): 32
prompts of 16..125 tokens, 32 greedy tokens each, transformers 5.18 (gaps in bf16 steps of the
top logit; "rounding": attention in fp32 instead of bf16, against bf16; "broken": an attention
that drops the oldest key at decode steps; at differences, the gap at each request's first
differing token, median / largest):

    head          gap 0 / <=1 / <=4 steps   median   rounding: equal; gaps   broken: equal; gaps
    as drawn      3.7% / 11.1% / 29.7%      8        13 of 32; 1 / 3         0 of 32; 5 / 32
    all rows x10  5.7% / 15.3% / 42.8%      5        13 of 32; 0 / 2         0 of 32; 4 / 20
    rows, tau 3   0.2% / 0.5% / 2.8%        82       22 of 32; 4 / 39        1 of 32; 19 / 173
    rows, tau 1   0.1% / 0.4% / 1.4%        129      24 of 32; 5 / 27        3 of 32; 80 / 231

With tau 1 near ties are 28 times rarer than as drawn (0.4% of steps within one bf16 step,
against 11.1%), a broken attention still changes 29 of 32 requests, at gaps of 80 steps
(median), and a difference of rounding alone at 5. Rounding upstream moves the logits by more
than their own rounding, so differences still come at gaps of a few to a few tens of steps:
read ``G`` against these figures. About 10 tokens are generated; the prompts are random.

    python benchmarks/transformers_cb.py                 # on a CUDA GPU, both modes
    python benchmarks/transformers_cb.py --tiny          # tests' model; seconds on the CPU
    python benchmarks/transformers_cb.py --margin-survey # the head scaling's justification

Run from the repository root with ``PYTHONPATH=$PWD/src``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import sys
import time
import traceback

import numpy as np
import torch

if not torch.cuda.is_available():
    # --tiny without a GPU: Triton's interpreter, which must be chosen before Triton's import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# isort: split
import transformers
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

from pagedattn.integrations import transformers as pagedattn_transformers
from pagedattn.testing import LLAMA_SIZES, random_llama

SDPA = "paged|sdpa"
VOCAB = 32000  # the model: pagedattn.testing.random_llama's "1b" (~1.1B parameters)
HEAD_TAU = 1.0  # the output head's row scaling (see the module's notes and --margin-survey)
HEAD_FLOOR = 1e-4  # rows scaled below this keep it: no exact ties among the rest
HEAD_SEED = 7
# tests/test_transformers.py's model and prompts: greedy picks stand clear of the runner-up.
TINY_VOCAB = 64
TINY_PROMPT_LENGTHS = (5, 12, 20, 37, 3)
TINY_SEED = 13
MODES = {"off": False, "on": True}


@dataclasses.dataclass
class Step:
    """One continuous-batching step as the model's forward saw it."""

    start: float  # host clock, seconds
    rows: int | None  # requests in the step
    longest: int | None  # max_seqlen_q: 1 in a decode step
    capturing: bool  # inside a CUDA-graph capture


@dataclasses.dataclass
class Result:
    name: str
    graphs: bool
    tokens: list[list[int]]  # generated tokens per request, in request order
    seconds: float  # wall time of the measured generate_batch
    decode_steps: list[float]  # seconds of each decode step (the last step excluded)
    decode_rows: list[int]  # requests in each of those steps
    captures: int  # forward passes seen inside a CUDA-graph capture

    @property
    def label(self) -> str:
        return f"{self.name} (cuda graphs)" if self.graphs else self.name

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


@dataclasses.dataclass
class Difference:
    """A request whose tokens part from the reference's, at its first differing token."""

    request: int
    index: int  # generated token index
    ours: int | None  # None: no token there
    reference: int | None
    gap: float | None  # the reference's top-two logit gap at that step (None: not recorded)
    top: float | None  # the reference's top logit there

    @property
    def bf16_steps(self) -> float | None:
        """The gap in bf16 rounding steps of the top logit (8 significant bits)."""
        if self.gap is None or not self.top:
            return None
        return self.gap / bf16_step(self.top)


def bf16_step(x: float) -> float:
    """Distance between consecutive bf16 values at ``x`` (its binade's spacing)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def scale_head(model: LlamaForCausalLM, tau: float, seed: int = HEAD_SEED) -> None:
    """Scales row ``v`` of the output head by ``max(exp(-rank(v) / tau), HEAD_FLOOR)``,
    ``rank`` a random permutation of the vocabulary (``seed``); ``tau`` 0 or None: nothing."""
    if not tau:
        return
    head = model.lm_head.weight
    vocab = head.shape[0]
    rank = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    factor = torch.exp(-rank.double() / tau).clamp(min=HEAD_FLOOR)
    with torch.no_grad():
        head.copy_((head.double() * factor.to(head.device)[:, None]).to(head.dtype))


def make_model(tiny: bool, device: torch.device, seed: int, head_tau: float) -> LlamaForCausalLM:
    if tiny:  # as the test builds it, for the same weights (drawn on the CPU)
        model = random_llama("tiny", vocab_size=TINY_VOCAB, seed=seed).to(device)
    else:
        model = random_llama("1b", vocab_size=VOCAB, seed=seed, device=device)
    scale_head(model, head_tau)
    return model


def make_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def prompt_lengths(requests: int, low: int, high: int, seed: int) -> list[int]:
    """``requests`` lengths uniform in ``low..high``, both included (NumPy ``default_rng``)."""
    rng = np.random.default_rng(seed)
    return [int(n) for n in rng.integers(low, high, size=requests, endpoint=True)]


def cuda_graph_option() -> str | None:
    """Why the installed transformers cannot run the graph mode, or None when it can."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "use_cuda_graph" not in fields:
        return (
            f"transformers {transformers.__version__}'s ContinuousBatchingConfig has no "
            "use_cuda_graph option (5.17 and 5.18 have it): CUDA graphs cannot be turned on or "
            "off"
        )
    return None


def cb_config(args, prompts: list[list[int]], new_tokens: int, graphs: bool):
    """The continuous-batching settings, named as the installed release names them (the page
    size is ``block_size`` in 5.17); the cache holds every request whole."""
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    pages = sum(-(-(len(p) + new_tokens) // args.page_size) for p in prompts)
    settings = {
        "page_size" if "page_size" in fields else "block_size": args.page_size,
        "num_blocks": pages + len(prompts),
        "use_cuda_graph": graphs,
    }
    if args.max_batch_tokens:
        settings["max_batch_tokens"] = args.max_batch_tokens
    if args.max_requests_per_batch:
        settings["max_requests_per_batch"] = args.max_requests_per_batch
    return ContinuousBatchingConfig(**settings)


class StepLogits:
    """Records, at every continuous-batching step of a run without CUDA graphs, each request's
    top two logits, and afterwards gives them per (request, generated token index).

    A forward hook on the model keeps the step's inputs (positions, tokens, ``cu_seq_lens_q``,
    ``logits_indices``), the top two of each next-token row, and the cache slot of each
    request's first token: ``write_index`` at the request's first row when the step starts it,
    else ``read_index`` at its first key (``read_index`` lists every key of every request, in
    order). All of it stays on the device until :meth:`gaps`. A request is one slot's life,
    from the step that writes its first token; its tokens as the steps saw them name the
    prompt it is."""

    def __init__(self, model):
        self.steps: list[dict] = []
        self._hook = model.register_forward_hook(self._record, with_kwargs=True)

    def remove(self) -> None:
        self._hook.remove()

    def _record(self, module, args, kwargs, output) -> None:
        cu_q = kwargs.get("cu_seq_lens_q")
        if cu_q is None:  # a plain forward
            return
        index = kwargs["logits_indices"]
        logits = output.logits[0]
        if kwargs.get("logits_to_keep") is None:
            logits = logits[index]
        top = logits.topk(2, dim=-1)
        starts = cu_q[:-1].to(torch.int64)
        write = kwargs["write_index"][0]
        read_index = kwargs.get("read_index") or []
        read = read_index[0] if len(read_index) else None
        if read is not None and read.numel():
            cu_k = kwargs["cu_seq_lens_k"]
            if isinstance(cu_k, dict):  # per layer type where a model has several
                cu_k = cu_k["full_attention"]
            first = read[cu_k[:-1].to(torch.int64).clamp(max=read.numel() - 1)]
        else:  # nothing read yet: every request starts in this step
            first = write[starts.clamp(max=max(write.numel() - 1, 0))]
        self.steps.append(
            dict(
                cu_q=cu_q.clone(),
                positions=kwargs["position_ids"][0].clone(),
                tokens=kwargs["input_ids"][0].clone(),
                index=index.clone(),
                first_slot=first.clone(),
                top_values=top.values.float(),
                top_tokens=top.indices,
            )
        )

    def gaps(self, prompts, tokens) -> dict[tuple[int, int], tuple[float, float, int]]:
        """``(request, generated index) -> (top-two gap, top logit, top token)``, for the
        requests ``prompts`` that generated ``tokens``."""
        lives: list[tuple[dict, dict]] = []  # (position -> token, position -> prediction)
        current: dict[int, int] = {}  # first token's slot -> its life
        for step in self.steps:
            step = {k: v.cpu().tolist() for k, v in step.items()}
            cu_q, positions = step["cu_q"], step["positions"]
            ends = {}
            for b, (lo, hi) in enumerate(itertools.pairwise(cu_q)):
                if hi <= lo or hi > len(positions):
                    continue
                slot = step["first_slot"][b]
                if positions[lo] == 0:
                    current[slot] = len(lives)
                    lives.append(({}, {}))
                seen, _ = lives[current[slot]]
                seen.update(zip(positions[lo:hi], step["tokens"][lo:hi]))
                ends[hi - 1] = current[slot]
            previous = -1
            for j, row in enumerate(step["index"]):
                if row <= previous or row not in ends:  # the static buffer's unused zeros
                    break
                previous = row
                values, top = step["top_values"][j], step["top_tokens"][j][0]
                lives[ends[row]][1][positions[row]] = (values[0] - values[1], values[0], top)
        found, taken = {}, set()
        for seen, predicted in lives:
            sequence = [seen[p] for p in itertools.takewhile(seen.__contains__, itertools.count())]
            owners = [
                r
                for r, (prompt, generated) in enumerate(zip(prompts, tokens))
                if len(sequence) >= len(prompt)
                and sequence == (list(prompt) + list(generated))[: len(sequence)]
            ]  # several only for requests alike in prompt and tokens: any one of them will do
            if not owners:
                raise RuntimeError("recorded steps match no request")
            # A request seen again (started anew after being evicted) keeps its own.
            r = next((r for r in owners if r not in taken), owners[0])
            taken.add(r)
            for position, prediction in predicted.items():
                index = position + 1 - len(prompts[r])
                if index < 0:  # a prompt token: an unused entry read as a prediction
                    continue
                gap, _, top = prediction
                if index < len(tokens[r]) and gap > 0 and top != tokens[r][index]:
                    raise RuntimeError(
                        f"request {r}, token {index}: recorded top token {top}, generated "
                        f"{tokens[r][index]}"
                    )
                found[(r, index)] = prediction
        return found


def generate(model, prompts, args, new_tokens: int, graphs: bool, steps=None):
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
                    capturing=torch.cuda.is_available()
                    and torch.cuda.is_current_stream_capturing(),
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
            continuous_batching_config=cb_config(args, prompts, new_tokens, graphs),
            progress_bar=False,
        )
        sync()
        seconds = time.perf_counter() - start
    finally:
        if hook is not None:
            hook.remove()
    errors = [o.error for o in outputs.values() if o.error is not None]
    if errors:
        raise RuntimeError(f"generate_batch reported errors: {errors[:3]}")
    ordered = sorted(outputs, key=lambda k: int(k.rsplit("_", 1)[-1]))
    return [list(outputs[k].generated_tokens) for k in ordered], seconds


def run(model, prompts, args, name: str, graphs: bool, record: bool = False):
    """The measured run (after its warm-up) and, with ``record``, its steps' logits."""
    model.set_attn_implementation(name)
    if args.warmup_tokens:
        generate(model, prompts, args, args.warmup_tokens, graphs)
    steps: list[Step] = []
    recorder = StepLogits(model) if record else None
    try:
        tokens, seconds = generate(model, prompts, args, args.new_tokens, graphs, steps)
    finally:
        if recorder is not None:
            recorder.remove()
    decode = [] if graphs else [
        (later.start - step.start, step.rows)
        for step, later in itertools.pairwise(steps)
        if step.longest == 1
    ]  # fmt: skip
    result = Result(
        name,
        graphs,
        tokens,
        seconds,
        decode_steps=[s for s, _ in decode],
        decode_rows=[r for _, r in decode if r is not None],
        captures=sum(s.capturing for s in steps),
    )
    return result, recorder


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


def differences(reference: list[list[int]], ours: list[list[int]], gaps) -> list[Difference]:
    """Each request whose tokens part from the reference's, at its first differing token, with
    the reference's top-two gap there (``gaps`` from :meth:`StepLogits.gaps`)."""
    found = []
    for request in range(max(len(reference), len(ours))):
        x = reference[request] if request < len(reference) else []
        y = ours[request] if request < len(ours) else []
        where = first_difference([x], [y])
        if where is None:
            continue
        index = where[1]
        gap, top, _ = gaps.get((request, index), (None, None, None))
        found.append(
            Difference(
                request,
                index,
                ours=y[index] if index < len(y) else None,
                reference=x[index] if index < len(x) else None,
                gap=gap,
                top=top,
            )
        )
    return found


def summary_line(requests: int, found: list[Difference], graphs: bool) -> str:
    """``cb tokens equal: R of N requests; differences at gaps <= G (cuda graphs on|off)``."""
    if not found:
        bound = "none"
    elif any(d.gap is None for d in found):
        bound = "unknown (a difference where the reference recorded no logits)"
    else:
        bound = f"{max(d.gap for d in found):.4g}"
    mode = "on" if graphs else "off"
    return (
        f"cb tokens equal: {requests - len(found)} of {requests} requests; "
        f"differences at gaps <= {bound} (cuda graphs {mode})"
    )


def describe(difference: Difference, name: str) -> str:
    d = difference
    where = f"request {d.request}, token {d.index}: {name} {d.ours} against {SDPA} {d.reference}"
    if d.gap is None:
        return f"{where}; {SDPA}'s logits there not recorded"
    return (
        f"{where}; {SDPA}'s top two logits {d.gap:.4g} apart there ({d.bf16_steps:.3g} bf16 "
        f"steps of its top logit {d.top:.4g})"
    )


def report_table(results: list[Result]) -> None:
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
            decode = "n/a | n/a | n/a | n/a | n/a"
        label = r.label.replace("|", "\\|")  # a markdown cell
        print(f"| {label} | {r.tokens_per_s:.0f} | {r.seconds:.2f} | {decode} |")


def margin_survey(args) -> int:
    """The head scaling's justification, on the CPU: the tests' tiny sizes with the benchmark's
    vocabulary (a step's logits are the head's rows against one normalised hidden state, so
    their spread over the vocabulary does not depend on the model's width), prompts of 16..128
    random tokens, greedy ``generate`` (no cache paging, no pagedattn). Per head scaling: the
    share of steps whose top two logits are 0, <= 1 and <= 4 bf16 steps of the top logit apart
    and the median; how many requests give the same tokens with attention computed in fp32
    (bf16 result), a difference of rounding only; how many give the same tokens with a broken
    attention that drops each request's oldest key at decode steps; the distinct tokens."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp32(module, q, k, v, mask, **kwargs):
        mask = None if mask is None else mask.float()
        out, weights = sdpa_attention_forward(
            module, q.float(), k.float(), v.float(), mask, **kwargs
        )
        return out.to(q.dtype), weights

    def broken(module, q, k, v, mask, **kwargs):
        if q.shape[2] == 1 and k.shape[2] > 1:
            k, v, mask = k[:, :, 1:], v[:, :, 1:], None if mask is None else mask[..., 1:]
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)

    AttentionInterface.register("survey_fp32", fp32)
    AttentionInterface.register("survey_broken", broken)
    lengths = prompt_lengths(args.survey_requests, 16, 128, args.seed)
    prompts = make_prompts(lengths, VOCAB, args.seed)
    new = args.survey_tokens

    def greedy(model, attention, logits=False):
        model.set_attn_implementation(attention)
        tokens, steps = [], {}
        for i, prompt in enumerate(prompts):
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new,
                do_sample=False,
                output_logits=logits,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            if logits:
                top = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
                for g, (a, b) in enumerate(top.tolist()):
                    steps[(i, g)] = (a - b) / bf16_step(a) if a else 0.0
        return tokens, steps

    def parted(reference, other, apart) -> str:
        """Requests equal, and the gaps (bf16 steps) at the others' first differences."""
        at = [
            apart[(n, first_difference([a], [b])[1])]
            for n, (a, b) in enumerate(zip(reference, other))
            if a != b
        ]
        equal = f"{len(reference) - len(at)} of {len(reference)}"
        if not at:
            return equal
        return f"{equal}; {statistics.median(at):.0f} / {max(at):.0f}"

    print(
        f"margin survey: random Llama, tiny sizes ({LLAMA_SIZES['tiny']}), vocabulary {VOCAB}, "
        f"bf16, CPU; {len(prompts)} prompts of {min(lengths)}..{max(lengths)} tokens, {new} new "
        f"tokens each, greedy (transformers' generate); transformers "
        f"{transformers.__version__}, torch {torch.__version__}. Gaps in bf16 steps of the top "
        "logit; at a difference: the reference's gap at the request's first differing token "
        "(median / largest)"
    )
    print(
        "| output head | steps with top two 0 / <= 1 / <= 4 bf16 steps apart | median gap "
        "| fp32 attention: requests equal; gaps at differences | broken attention: requests "
        "equal; gaps at differences | distinct tokens |"
    )
    print("|---" * 6 + "|")
    variants = [("as drawn", None, None), ("all rows x10", 10.0, None)]
    variants += [(f"rows, tau {tau:g}", None, tau) for tau in args.survey_taus]
    for label, uniform, tau in variants:
        model = random_llama("tiny", vocab_size=VOCAB, seed=args.seed)
        if uniform:
            with torch.no_grad():
                model.lm_head.weight.mul_(uniform)
        scale_head(model, tau)
        with torch.no_grad():
            reference, apart = greedy(model, "sdpa", logits=True)
            rounding, _ = greedy(model, "survey_fp32")
            bug, _ = greedy(model, "survey_broken")
        gaps = list(apart.values())
        shares = " / ".join(
            f"{100 * sum(a <= bound for a in gaps) / len(gaps):.1f}%" for bound in (0, 1, 4)
        )
        distinct = len({t for row in reference for t in row})
        print(
            f"| {label} | {shares} | {statistics.median(gaps):.0f} "
            f"| {parted(reference, rounding, apart)} | {parted(reference, bug, apart)} "
            f"| {distinct} |"
        )
    return 0


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
        default="off,on",
        help="modes, comma-separated: off (transformers' CUDA graphs off), on; default both "
        "(without a GPU the graph mode is skipped)",
    )
    parser.add_argument(
        "--head-tau",
        type=float,
        default=None,
        help=f"output head row scaling exp(-rank/tau), 0: none (default {HEAD_TAU:g}; tiny: 0, "
        "the tests' model)",
    )
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="default: auto")
    parser.add_argument("--max-requests-per-batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--margin-survey",
        action="store_true",
        help="measure the margin distribution for several head scalings on the CPU and exit",
    )
    parser.add_argument("--survey-requests", type=int, default=32)
    parser.add_argument("--survey-tokens", type=int, default=32)
    parser.add_argument(
        "--survey-taus", default="3,1", help="row scalings the survey measures (comma-separated)"
    )
    args = parser.parse_args(argv)
    if args.margin_survey:
        args.survey_taus = [float(t) for t in args.survey_taus.split(",") if t]
        return margin_survey(args)

    modes = [m.strip() for m in args.cuda_graph.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        parser.error(f"--cuda-graph: off, on or both (comma-separated), not {args.cuda_graph!r}")
    missing = cuda_graph_option()
    if missing:
        sys.exit(f"transformers_cb.py: {missing}")
    if args.tiny:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        lengths, seed = list(TINY_PROMPT_LENGTHS), TINY_SEED
        args.new_tokens = args.new_tokens or 5
        args.page_size = args.page_size or 16
        args.warmup_tokens = args.warmup_tokens or 0
        args.max_batch_tokens = args.max_batch_tokens or 16
        args.max_requests_per_batch = args.max_requests_per_batch or 8
        args.head_tau = args.head_tau or 0.0
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
        args.head_tau = HEAD_TAU if args.head_tau is None else args.head_tau
        num_programs = None
    skipped = None
    if "on" in modes and device.type != "cuda":
        skipped = "cuda graphs on: skipped, no CUDA device (transformers turns them off there)"
        modes.remove("on")
    model = make_model(args.tiny, device, seed, args.head_tau)
    prompts = make_prompts(lengths, model.config.vocab_size, seed)
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    head = f"rows scaled by exp(-rank/{args.head_tau:g})" if args.head_tau else "as drawn"
    print(
        f"model: random Llama, {params / 1e6:.1f}M parameters: hidden {c.hidden_size}, "
        f"{c.num_hidden_layers} layers, {c.num_attention_heads}/{c.num_key_value_heads} heads, "
        f"head_dim {c.head_dim}, MLP {c.intermediate_size}, vocabulary {c.vocab_size}, output "
        f"head {head}; bf16 weights and cache; {device}"
    )
    print(
        f"workload: {len(prompts)} requests, prompts {min(lengths)}..{max(lengths)} tokens "
        f"(mean {statistics.fmean(lengths):.0f}), {args.new_tokens} new tokens each, greedy; "
        f"page {args.page_size}, CUDA graphs {' and '.join(modes)}; transformers "
        f"{transformers.__version__}, torch {torch.__version__}"
    )
    name = pagedattn_transformers.register(num_programs=num_programs)

    # The reference: paged|sdpa without graphs, its logits recorded at every step.
    reference, recorder = run(model, prompts, args, SDPA, graphs=False, record=True)
    gaps = recorder.gaps(prompts, reference.tokens)
    results, lines, details = [reference], [], []
    failed = False

    def attempt(what: str, attention: str, graphs: bool) -> Result | None:
        """A measured run, or None after printing why it failed: a mode that fails (a
        transformers release whose graph path breaks, a fault) leaves the other modes'
        results."""
        nonlocal failed
        try:
            return run(model, prompts, args, attention, graphs=graphs)[0]
        except Exception as error:  # reported; the exit status says so
            traceback.print_exc()
            failed = True
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            details.append(f"{what}: failed, {reason}")
            return None

    for mode in modes:
        graphs = MODES[mode]
        if graphs:
            label = f"{SDPA} (cuda graphs)"
            control = attempt(label, SDPA, graphs=True)
            if control is not None:
                results.append(control)
                same = sum(a == b for a, b in zip(control.tokens, reference.tokens))
                details.append(
                    f"{control.label}: {control.captures} graph captures; tokens equal to "
                    f"{SDPA}'s without graphs in {same} of {len(prompts)} requests"
                )
        label = f"{name} (cuda graphs)" if graphs else name
        ours = attempt(label, name, graphs)
        if ours is None:
            lines.append(f"cb tokens equal: failed (cuda graphs {mode})")
            continue
        results.append(ours)
        if graphs:
            details.append(f"{ours.label}: {ours.captures} graph captures")
        found = differences(reference.tokens, ours.tokens, gaps)
        details += [f"{ours.label}: {describe(d, name)}" for d in found]
        lines.append(summary_line(len(prompts), found, graphs))
    report_table(results)
    for line in details + ([skipped] if skipped else []) + lines:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
