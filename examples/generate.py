"""Greedy generation with a Hugging Face Llama-architecture model whose decode attention runs
on pagedattn over a paged KV cache.

The model's attention is replaced through transformers' attention interface: a function
registered as ``"pagedattn"`` (``AttentionInterface.register``) and selected with
``model.set_attn_implementation("pagedattn")``. The model itself keeps no cache
(``use_cache=False``); the function writes each step's keys and values (after RoPE) into a
paged cache (pages handed out by a small block allocator, in shuffled order) and:

- at prefill (one prompt at a time), runs transformers' own sdpa attention;
- at each decode step (the whole batch, one new token per sequence), runs
  ``pagedattn.paged_decode`` with the step's plan (made once per step, reused by every layer).

With a bf16 cache the tokens are checked against ``model.generate(do_sample=False)`` with
transformers' sdpa attention, prompt by prompt; the exit code is 0 when they match, or when
they part only at a near tie (transformers' own top two logits closer than the logit
difference seen up to that step, so rounding picks the token; reported as such). On a
GPU the decode step (plan refill, cache writes, the model, argmax) is captured in one CUDA graph
and replayed (``--cuda-graph``, default on with CUDA).

    python examples/generate.py --tiny              # CPU, Triton's interpreter, seconds
    python examples/generate.py                     # random-weight Llama on the GPU
    python examples/generate.py --model PATH --kv-cache fp8
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

if "--tiny" in sys.argv[1:]:
    # --tiny runs on the CPU even beside a GPU: Triton must pick its interpreter at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import pagedattn
from pagedattn.testing import random_llama

# isort: split
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PROMPTS = ["The paged cache", "Attention is all", "Once upon a time, in a land far away"]


class PagedKVCache:
    """Per-layer K/V pages, a block table and lengths for a fixed batch of sequences.

    Pages are handed out one at a time as sequences grow (``reserve``), from a shuffled free
    list, so a sequence's pages are scattered as in a serving engine. With ``fp8`` the values
    are stored as e4m3 with one float32 scale per (token, head).
    """

    def __init__(
        self, *, num_layers, batch, max_len, page_size, num_kv_heads, head_dim, dtype, fp8, device
    ):
        self.page_size, self.fp8, self.dtype = page_size, fp8, dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        max_pages = math.ceil(max_len / page_size)
        num_pages = batch * max_pages + 1
        store = pagedattn.cache.FP8_DTYPE if fp8 else dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        self.k_scale = self.v_scale = [None] * num_layers
        if fp8:
            self.k_scale = [torch.ones(shape[:3], device=device) for _ in range(num_layers)]
            self.v_scale = [torch.ones(shape[:3], device=device) for _ in range(num_layers)]
        self.free = list(range(num_pages))
        random.Random(0).shuffle(self.free)
        self.block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.lens = [0] * batch  # host copy: the allocator never reads the GPU
        self.pages = [[] for _ in range(batch)]
        self.plan = None
        self.mode = "prefill"
        self.prefill_seq = 0
        self.decode_calls = 0
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def reserve(self, seq: int, new_tokens: int) -> None:
        """Pages for ``new_tokens`` more tokens of ``seq`` (host side, before a step)."""
        need = math.ceil((self.lens[seq] + new_tokens) / self.page_size)
        while len(self.pages[seq]) < need:
            page = self.free.pop()
            self.block_table[seq, len(self.pages[seq])] = page
            self.pages[seq].append(page)

    def _store(self, layer, slot_mapping, key, value):
        """key/value ``[tokens, num_kv_heads, head_dim]`` into the cache at ``slot_mapping``
        (``page * page_size + offset``), in one launch; FP8 with a scale per (token, head)."""
        pagedattn.append_kv(
            key.to(self.dtype),
            value.to(self.dtype),
            self.k[layer],
            self.v[layer],
            slot_mapping,
            k_scale=self.k_scale[layer],
            v_scale=self.v_scale[layer],
            kv_scale="per_token" if self.fp8 else None,
        )

    def write_prefill(self, layer, key, value):
        """A prompt's keys/values ``[1, H, S, D]`` for sequence ``prefill_seq``."""
        seq, n = self.prefill_seq, key.shape[2]
        positions = torch.arange(n, device=key.device)
        pages = torch.tensor(self.pages[seq], device=key.device)[positions // self.page_size]
        slot_mapping = pages * self.page_size + positions % self.page_size
        self._store(layer, slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))

    def write_decode(self, layer, key, value):
        """One new token per sequence ``[B, H, 1, D]`` at ``positions`` (device-side
        indices, so the writes can be captured in a CUDA graph)."""
        pos = self.positions[:, 0]
        rows = torch.arange(pos.shape[0], device=pos.device)
        pages = self.block_table[rows, pos // self.page_size].long()
        slot_mapping = pages * self.page_size + pos % self.page_size
        self._store(layer, slot_mapping, key[:, :, 0], value[:, :, 0])


ACTIVE: PagedKVCache | None = None  # the cache of the generation running now


def pagedattn_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention function: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]``
    (this step's only, RoPE applied); returns ``([B, S, Hq, D], None)``."""
    cache, layer = ACTIVE, module.layer_idx
    if cache.mode == "prefill":
        cache.write_prefill(layer, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
    cache.write_decode(layer, key, value)
    cache.decode_calls += 1  # counted while tracing/capturing too: once per layer per call
    batch, heads, _, head_dim = query.shape
    out = pagedattn.paged_decode(
        query[:, :, 0],  # [B, Hq, D]: one query row per sequence
        cache.k[layer],
        cache.v[layer],
        cache.block_table,
        cache.seq_lens,
        plan=cache.plan,
        sm_scale=scaling,
        k_scale=cache.k_scale[layer],
        v_scale=cache.v_scale[layer],
    )
    return out.view(batch, 1, heads, head_dim), None


# No mask function is registered beside it, so transformers builds no mask: prefill is one
# unpadded prompt (sdpa's is_causal), and decode is causal by construction.
AttentionInterface.register("pagedattn", pagedattn_attention)


def make_model(args, device):
    if args.model:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    else:
        model = random_llama(
            "tiny" if args.tiny else "small",
            vocab_size=512 if args.tiny else 32000,
            seed=args.seed,
        )
    head_dim = getattr(model.config, "head_dim", None) or (
        model.config.hidden_size // model.config.num_attention_heads
    )
    if head_dim not in (64, 128, 256):
        sys.exit(f"--model: pagedattn takes head_dim 64, 128 or 256, this model has {head_dim}")
    return model.to(device).eval(), head_dim


def prompt_ids(args, model, device) -> list[torch.Tensor]:
    if args.model:
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.model)
            return [tokenizer(p, return_tensors="pt").input_ids[0].to(device) for p in PROMPTS]
        except (OSError, ValueError):
            pass  # no tokenizer beside the weights: random prompts
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=g).to(device) for n in (5, 9, 14)]


def reference(model, prompts, new_tokens):
    """transformers' own greedy generation (sdpa attention, its DynamicCache), per prompt."""
    model.set_attn_implementation("sdpa")
    tokens, logits = [], []
    sync = torch.cuda.synchronize if prompts[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for ids in prompts:
        result = model.generate(
            ids[None],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens.append(result.sequences[0, len(ids) :].tolist())
        logits.append(torch.stack([step[0] for step in result.logits]).float())
    sync()
    return tokens, logits, time.perf_counter() - start


def generate_paged(model, prompts, new_tokens, head_dim, args):
    """Greedy generation over a paged cache: prefill prompt by prompt, then batched decode."""
    global ACTIVE
    device = prompts[0].device
    config = model.config
    batch = len(prompts)
    cache = PagedKVCache(
        num_layers=config.num_hidden_layers,
        batch=batch,
        max_len=max(len(p) for p in prompts) + new_tokens,
        page_size=args.page_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        fp8=args.kv_cache == "fp8",
        device=device,
    )
    ACTIVE = cache
    model.set_attn_implementation("pagedattn")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()

    tokens = [[] for _ in range(batch)]
    logits = [[] for _ in range(batch)]
    cache.mode = "prefill"
    with torch.no_grad():
        for b, ids in enumerate(prompts):
            cache.prefill_seq = b
            cache.reserve(b, len(ids))
            step_logits = model(input_ids=ids[None], use_cache=False).logits[0, -1].float()
            cache.lens[b] = len(ids)
            logits[b].append(step_logits)
            tokens[b].append(int(step_logits.argmax()))
    sync()
    timing = {"prefill_s": time.perf_counter() - start, "decode_steps_s": []}

    cache.mode = "decode"
    kv_dtype = pagedattn.cache.FP8_DTYPE if cache.fp8 else torch.bfloat16
    plan_sizes = dict(
        num_q_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        page_size=args.page_size,
        kv_dtype=kv_dtype,
        kv_scale="per_token" if cache.fp8 else None,
        num_programs=args.num_programs,
    )
    input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    cache.seq_lens.copy_(torch.tensor([n + 1 for n in cache.lens], dtype=torch.int32))
    cache.plan = pagedattn.plan_decode(cache.seq_lens, **plan_sizes)

    def step():
        # Everything here reads the static tensors only: capturable in a CUDA graph.
        pagedattn.plan_decode(cache.seq_lens, **plan_sizes, reuse=cache.plan)
        out = model(input_ids=input_ids, position_ids=cache.positions, use_cache=False)
        return out.logits[:, -1].float()

    def set_inputs():
        """Host side of a step: pages for the new token, then the static inputs."""
        for b in range(batch):
            cache.reserve(b, 1)
        lens = torch.tensor(cache.lens, dtype=torch.int64)
        input_ids.copy_(torch.tensor([t[-1] for t in tokens])[:, None])
        cache.positions.copy_(lens[:, None])
        cache.seq_lens.copy_((lens + 1).to(torch.int32))

    graph, graph_logits = None, None
    with torch.no_grad():
        for _ in range(new_tokens - 1):
            step_start = time.perf_counter()
            set_inputs()
            if args.cuda_graph and graph is None:
                # Warm up (compiles the kernels) on a side stream, then capture. The warm-up
                # writes this step's K/V, which the replay below writes again unchanged.
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_logits = step()
            if graph is not None:
                graph.replay()
                step_logits = graph_logits
            else:
                step_logits = step()
            chosen = step_logits.argmax(-1).tolist()
            for b in range(batch):
                cache.lens[b] += 1
                tokens[b].append(chosen[b])
                logits[b].append(step_logits[b].clone())
            # A whole step, host side included; .tolist() above waited for the device.
            timing["decode_steps_s"].append(time.perf_counter() - step_start)
    sync()
    elapsed = time.perf_counter() - start
    faults = cache.plan.faults() if cache.plan is not None else []
    if faults:
        sys.exit(f"pagedattn recorded faults: {faults}")
    print(f"pagedattn.paged_decode calls (Python side): {cache.decode_calls}")
    return tokens, [torch.stack(x) for x in logits], elapsed, timing


def report_decode(timing: dict, batch: int, mode: str) -> None:
    """Steady-state decode: the median whole step (host side, plan refill, the model, argmax)
    over the decode steps after the first, which compiles the kernels (and, with CUDA graphs,
    warms up and captures the graph); prefill is timed apart."""
    steps = timing["decode_steps_s"]
    print(f"prefill (prompt by prompt, sdpa): {timing['prefill_s'] * 1e3:.1f} ms")
    if steps:
        print(f"first decode step (compile, warm-up, capture): {steps[0] * 1e3:.1f} ms")
    steady = sorted(steps[1:])
    if not steady:
        print("decode steady state: n/a (needs --new-tokens >= 3)")
        return
    step = steady[len(steady) // 2]
    print(
        f"decode steady state ({mode}): {batch / step:.1f} tokens/s, step {step * 1e3:.3f} ms "
        f"(median of {len(steady)} steps of {batch} sequences; range "
        f"{steady[0] * 1e3:.3f}-{steady[-1] * 1e3:.3f} ms)"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local Llama-architecture checkpoint (default: random)")
    parser.add_argument(
        "--tiny", action="store_true", help="2 layers, tiny width, a few tokens, on the CPU"
    )
    parser.add_argument("--kv-cache", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture the decode step in a CUDA graph (default: on with CUDA)",
    )
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--num-programs",
        type=int,
        default=None,
        help="persistent grid of the decode kernel (default: the library's on a GPU; on the "
        "CPU one program per kv head, as the interpreter runs programs one after another)",
    )
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.cuda_graph is None:
        args.cuda_graph = device.type == "cuda"
    if args.cuda_graph and device.type != "cuda":
        parser.error("--cuda-graph needs a CUDA GPU (and no --tiny)")
    if args.tiny:
        args.page_size = 4 if args.page_size == 16 else args.page_size
    new_tokens = args.new_tokens or (6 if args.tiny else 64)
    if new_tokens < 1:
        parser.error("--new-tokens: expected >= 1")

    model, head_dim = make_model(args, device)
    if args.num_programs is None and device.type == "cpu":
        args.num_programs = model.config.num_key_value_heads
    prompts = prompt_ids(args, model, device)
    ref_tokens, ref_logits, ref_time = reference(model, prompts, new_tokens)
    tokens, logits, paged_time, timing = generate_paged(model, prompts, new_tokens, head_dim, args)

    count = len(prompts) * new_tokens
    match = tokens == ref_tokens
    # Step i's logits are comparable while the tokens before it agree. Where the tokens part,
    # transformers' own top two logits at that step say whether it was a near tie: closer than
    # the logit difference seen so far, so rounding decides the pick.
    diffs, ties = [], []
    for b, (mine, theirs, x, y) in enumerate(zip(logits, ref_logits, tokens, ref_tokens)):
        agree = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        last = len(x) - 1 if agree is None else agree
        diff = float((mine[: last + 1] - theirs[: last + 1]).abs().max())
        diffs.append(diff)
        if agree is not None:
            top2 = theirs[agree].float().topk(2).values
            margin = float(top2[0] - top2[1])
            ties.append((b, agree, margin, diff, margin <= diff))
    mode = "CUDA graph" if args.cuda_graph else "eager"
    print(f"device: {device}, kv cache: {args.kv_cache}, decode steps: {mode}")
    for b, (mine, theirs) in enumerate(zip(tokens, ref_tokens)):
        print(f"sequence {b}: pagedattn {mine}")
        print(f"{'':12}transformers {theirs}")
    print(f"tokens match: {match}")
    for b, step, margin, diff, tie in ties:
        print(
            f"sequence {b} parts at step {step}: transformers' top two logits {margin:.4g} apart, "
            f"logits so far within {diff:.4g}: {'a near tie' if tie else 'NOT a near tie'}"
        )
    print(f"max logit difference: {max(diffs, default=float('nan')):.4g}")
    report_decode(timing, len(prompts), mode)
    print(
        f"pagedattn end to end (prefill, compile, decode): {count / paged_time:.1f} tokens/s "
        f"({count} tokens in {paged_time:.2f} s)"
    )
    print(f"transformers generate (sdpa): {count / ref_time:.1f} tokens/s ({ref_time:.2f} s)")
    if args.kv_cache == "fp8":
        return 0  # FP8 rounding may change tokens: reported, not required
    # bf16: the same tokens, or a parting only where rounding decides between two tokens.
    return 0 if all(tie for *_, tie in ties) else 1


if __name__ == "__main__":
    sys.exit(main())
