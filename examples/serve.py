"""Serve a Hugging Face causal LM over HTTP with transformers' continuous batching and
pagedattn's decode attention (``pagedattn.integrations.transformers``).

The server loads the checkpoint with ``attn_implementation=register()`` ("paged|pagedattn"),
starts transformers' ``ContinuousBatchingManager`` (its scheduler, paged cache and chunked
prefill) and answers on loopback, one thread per connection:

- ``POST /generate`` with ``{"input_ids": [...], "max_new_tokens": n}`` returns
  ``{"request_id": ..., "output_ids": [...]}`` (greedy; token ids in and out);
- ``GET /health`` returns ``{"ok": true}``.

Requests that arrive together are batched by the manager: decode rows run on pagedattn,
prefill chunks on transformers' own paged attention.

``--check`` also runs a client: it sends its prompts concurrently, then generates the same
prompts with transformers' own attention (``paged|sdpa``) on the same weights and compares
the tokens; the exit code is 0 when every answer matches.

    python examples/serve.py --tiny --check    # random tiny Llama (no GPU: Triton's interpreter)
    python examples/serve.py --model PATH --port 8000
    curl -s localhost:8000/generate -d '{"input_ids": [1, 2, 3], "max_new_tokens": 8}'

Without ``--model`` a random-weight Llama is saved to a temporary folder and served from
there (``--tiny``: two layers, head_dim 64, 4 query / 2 KV heads, vocabulary 64).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

if not torch.cuda.is_available():
    # Triton's interpreter on the CPU, which must be chosen before Triton's import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# isort: split
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
)

from pagedattn.integrations import transformers as pagedattn_transformers
from pagedattn.testing import random_llama

PROMPT_LENGTHS = (5, 12, 20, 37, 3, 9)
SEED = 13  # weights and prompts whose greedy picks stand clear of the runner-up (see the test)


def save_random_checkpoint(folder: str, *, tiny: bool, seed: int) -> None:
    """A random-weight Llama (bf16) saved with ``save_pretrained``."""
    model = random_llama("tiny" if tiny else "small", vocab_size=64 if tiny else 32000, seed=seed)
    model.save_pretrained(folder)


def batching_config(args) -> ContinuousBatchingConfig:
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_key = "page_size" if "page_size" in fields else "block_size"  # 5.17: block_size
    return ContinuousBatchingConfig(
        **{page_key: args.page_size},
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        max_requests_per_batch=args.max_requests,
    )


def generation_config(max_new_tokens: int) -> GenerationConfig:
    # eos_token_id -1: a random model has no end token worth stopping at.
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )


class Server:
    """transformers' continuous-batching manager behind a threaded HTTP server."""

    def __init__(self, model, args) -> None:
        self.manager = model.init_continuous_batching(
            generation_config=generation_config(args.max_new_tokens),
            continuous_batching_config=batching_config(args),
        )
        self.pending: dict[str, Future] = {}
        self.lock = threading.Lock()
        self.counter = 0
        self.running = True
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._reply(200, {"ok": True})
                else:
                    self._reply(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                if self.path != "/generate":
                    self._reply(404, {"error": f"no route {self.path}"})
                    return
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    input_ids = [int(t) for t in body["input_ids"]]
                    max_new_tokens = int(body.get("max_new_tokens", args.max_new_tokens))
                except (KeyError, TypeError, ValueError) as error:
                    self._reply(400, {"error": f"expected input_ids and max_new_tokens: {error}"})
                    return
                request_id, output = server.generate(input_ids, max_new_tokens)
                if output.error is not None:
                    self._reply(500, {"request_id": request_id, "error": output.error})
                else:
                    self._reply(
                        200, {"request_id": request_id, "output_ids": output.generated_tokens}
                    )

            def log_message(self, *_):  # quiet
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
        self.port = self.http.server_address[1]
        self.threads = [
            threading.Thread(target=self._dispatch, daemon=True),
            threading.Thread(target=self.http.serve_forever, daemon=True),
        ]

    def start(self) -> None:
        self.manager.start()
        for thread in self.threads:
            thread.start()

    def generate(self, input_ids: list[int], max_new_tokens: int):
        """Queues one request and waits for its result."""
        future = Future()
        with self.lock:
            request_id = f"http_{self.counter}"
            self.counter += 1
            self.pending[request_id] = future
        self.manager.add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens)
        return request_id, future.result()

    def _dispatch(self) -> None:
        """Hands each finished result to the connection waiting for it."""
        while self.running:
            output = self.manager.get_result(timeout=0.1)
            if output is None or not output.is_finished():
                continue
            with self.lock:
                future = self.pending.pop(output.request_id, None)
            if future is not None:
                future.set_result(output)

    def stop(self) -> None:
        self.http.shutdown()
        self.running = False
        self.manager.stop(block=True)


def post(port: int, input_ids: list[int], max_new_tokens: int) -> list[int]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps({"input_ids": input_ids, "max_new_tokens": max_new_tokens}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["output_ids"]


def check(model, server: Server, args) -> bool:
    """Concurrent requests over HTTP, then the same prompts with transformers' attention."""
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: post(server.port, p, args.max_new_tokens), prompts))
    elapsed = time.perf_counter() - start
    server.stop()
    model.set_attn_implementation("paged|sdpa")
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=generation_config(args.max_new_tokens),
        continuous_batching_config=batching_config(args),
        progress_bar=False,
    )
    expected = [outputs[k].generated_tokens for k in sorted(outputs, key=lambda k: int(k[4:]))]
    matches = sum(a == e for a, e in zip(answers, expected))
    for i, (a, e) in enumerate(zip(answers, expected)):
        print(f"request {i}: served {a}, transformers {e}")
    print(f"{len(prompts)} concurrent requests answered in {elapsed:.2f} s")
    print(f"answers match transformers' own attention: {matches}/{len(prompts)}")
    return matches == len(prompts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local checkpoint (default: random weights)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model")
    parser.add_argument("--check", action="store_true", help="run the client and compare")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--max-new-tokens", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        # Small enough for the interpreter; 16 tokens a step chunks the longer prompts, so
        # steps mix prefill chunks with other requests' decode rows.
        args.num_blocks = args.num_blocks or 64
        args.max_batch_tokens = args.max_batch_tokens or 16
        args.max_requests = args.max_requests or 8

    with tempfile.TemporaryDirectory() as folder:
        path = args.model
        if path is None:
            save_random_checkpoint(folder, tiny=args.tiny, seed=args.seed)
            path = folder
        config = AutoConfig.from_pretrained(path)
        # The library's grid on a GPU; on the CPU one program per kv head (the interpreter
        # runs programs one after another).
        num_programs = config.num_key_value_heads if device == "cpu" else None
        name = pagedattn_transformers.register(num_programs=num_programs)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, attn_implementation=name
        )
        model = model.to(device).eval()
        server = Server(model, args)
        server.start()
        print(f"serving {path} with {name} on http://127.0.0.1:{server.port}", flush=True)
        if args.check:
            return 0 if check(model, server, args) else 1
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
