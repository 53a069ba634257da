"""An OpenAI-compatible server for one stack: a target and its drafter, decoded by this project's
lossless speculative loop (qdflash.spec), batch 1.

    python -m qdflash.serve --results results/<experiment>          # its `selected` variant
    python -m qdflash.serve --target tiny-llama --drafter PATH [--window N] [--verify-tokens V [--verify-adaptive]]
    python -m qdflash.serve --target tiny-llama --mode hf           # the baseline: transformers' generate

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the target's
chat template), with `stream: true` as server-sent events the way the OpenAI API sends them.

One worker thread decodes one request at a time (the loops are batch 1); requests wait in a bounded
queue, and a request that finds `max_queue` requests admitted (running + waiting) gets a 503 at once:
nothing is dropped silently. Bad requests get a 4xx in the OpenAI error shape
({"error": {"message", "type", "param", "code"}}) and the server keeps serving.

Every response's `usage` carries, beside the OpenAI counts, this request's acceptance (`tau`,
`acceptance_lengths`) and timings (`queue_seconds`, `prefill_seconds`, `seconds`, `tokens_per_s`);
each choice carries the generated `token_ids` (as vLLM's `return_token_ids` does), so a client can
check the tokens, not only the text. The same numbers go to a log line per request.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
# at module level: FastAPI resolves the handlers' (string) annotations in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from .errors import QdflashError
from .spec import (GenerationResult, autoregressive_generate, end_tokens, speculative_generate, verify_length,
                   verify_sizes)
from .variants import window_name

log = logging.getLogger("qdflash.serve")

MODES = ("spec", "ar", "hf")  # speculative (with the drafter), the target alone, transformers' generate
ATTENTION = ("sdpa", "kernel")  # the engines' attention in decode steps, verify blocks and drafts (EngineBase.set_attention)
COMPILE = ("none", "drafter", "all")  # --engine on a GPU: which captured steps go through torch.compile


# ----------------------------------------------------------------------------------------------
# what is served


def selected_variant(results) -> dict:
    """The `selected` row of results/<experiment>/tables/summary.csv (qdflash.report), with the folders
    of its target and drafter as the DAG writes them, and the verify length (`verify_tokens`, None for
    the whole block; `verify_adaptive`), drafts' rules (`no_repeat`, `tree_nodes`) and engines (`attention`,
    `compile`) its benchmark job ran, where that job's metrics.json says."""
    results = Path(results)
    path = results / "tables" / "summary.csv"
    if not path.is_file():
        raise QdflashError(f"{path} not found: expected the tables of a finished report (snakemake report)")
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("selected") == "1"]
    if len(rows) != 1:
        raise QdflashError(f"{path}: expected exactly one row with selected = 1, found {len(rows)} "
                           "(no variant passed every gate: see the report's metrics.json)")
    row = rows[0]
    window = int(row["window"]) if row["window"] else None
    chosen = {"variant": row["variant"], "window": window,
              "target": results / "target" / row["target"] / "model",
              "drafter": results / "drafter" / row["drafter"] / "drafter"}
    # the verify length its speed was measured with (bench_speedup's metrics.json), so it is served the same way
    bench = results / "bench" / f"speedup_{window_name(window)}" / "metrics.json"
    if bench.is_file():
        measured = json.loads(bench.read_text())
        if "verify_tokens" in measured:
            verify = int(measured["verify_tokens"])
            block = int(measured.get("block_size", verify))
            chosen["verify_tokens"] = None if verify == block else verify
            chosen["verify_adaptive"] = bool(measured.get("verify_adaptive", 0))
        if "no_repeat" in measured:  # the drafts' rule (benchmarks before it drafted argmax)
            chosen["no_repeat"] = bool(measured["no_repeat"])
        if measured.get("tree_nodes"):  # a tree a round (0, or benchmarks before it: a chain)
            chosen["tree_nodes"] = int(measured["tree_nodes"])
        # how its engines ran (the served target is the QAD one): so that --engine serves at the speed measured
        if measured.get("engine.qad.attention") in ATTENTION:
            chosen["attention"] = measured["engine.qad.attention"]
        if "bench.compile" in measured:
            chosen["compile"] = ("all" if measured["bench.compile"] else "drafter" if measured.get("bench.compile_drafter")
                                 else "none")
    return chosen


@dataclass
class Stack:
    """The served model: `mode` spec decodes with the drafter, ar with the target alone, hf with
    transformers' own generate (the unoptimized baseline)."""

    name: str
    target: Any
    drafter: Any = None
    window: int | None = None
    mode: str = "spec"
    context: int = 0  # prompt + new tokens, at most
    verify_tokens: int | None = None  # tokens a speculative round verifies (None: the drafter's block)
    verify_adaptive: bool = False     # the whole block after a round that accepted as far as verify_tokens reaches
    no_repeat: bool = False           # no draft repeats the draft before it (qdflash.drafter.blocks.distinct_drafts)
    tree_nodes: int | None = None     # greedy requests: a tree of this many drafts a round (qdflash.spec); sampled ones: a chain
    attention: str = "sdpa"           # with the engines: how their steps attend (ATTENTION; kernel needs Triton on the GPU)
    compile: str = "none"             # with the engines on a GPU: which steps go through torch.compile (COMPILE)

    def __post_init__(self):
        if self.mode not in MODES:
            raise QdflashError(f"serve: mode {self.mode!r} is not one of {MODES}")
        if self.attention not in ATTENTION:
            raise QdflashError(f"serve: --attention {self.attention!r}: expected one of {', '.join(ATTENTION)}")
        if self.compile not in COMPILE:
            raise QdflashError(f"serve: --compile {self.compile!r}: expected one of {', '.join(COMPILE)}")
        if self.mode == "spec" and self.drafter is None:
            raise QdflashError("serve: mode 'spec' needs a drafter (--drafter or --results); use --mode ar or hf without one")
        if self.context <= 0:
            self.context = int(getattr(self.target.config, "max_position_embeddings", 0) or 4096)
        if self.mode == "spec":
            verify = verify_length(self.drafter, self.verify_tokens)  # a bad --verify-tokens fails at start, not per request
            if self.verify_adaptive and verify == self.drafter.block_size:
                raise QdflashError("serve: --verify-adaptive grows a shorter verify to the whole block; give --verify-tokens V "
                                   f"with V < the drafter's block size ({self.drafter.block_size})")
            if self.tree_nodes is not None and (isinstance(self.tree_nodes, bool) or not isinstance(self.tree_nodes, int)
                                                or self.tree_nodes < 1):
                raise QdflashError(f"serve: --tree-nodes {self.tree_nodes!r}: expected a positive integer")

    def generate(self, ids: list[int], max_tokens: int, temperature: float, top_p: float, seed: int,
                 stop: list[str], on_tokens: Callable[[list[int]], None], ignore_eos: bool = False) -> GenerationResult:
        common = dict(temperature=temperature, top_p=top_p, seed=seed, stop_strings=stop or None, on_tokens=on_tokens,
                      ignore_eos=ignore_eos)
        if self.mode == "spec":
            # a tree keeps greedy decoding exact only: a sampled request verifies the chain
            return speculative_generate(self.target, self.drafter, [ids], max_tokens, window=self.window,
                                        verify_tokens=self.verify_tokens, verify_adaptive=self.verify_adaptive,
                                        no_repeat=self.no_repeat, tree_nodes=self.tree_nodes if temperature == 0 else None,
                                        **common)
        if self.mode == "ar":
            return autoregressive_generate(self.target, [ids], max_tokens, **common)
        return self._hf_generate(ids, max_tokens, temperature, top_p, seed, stop, on_tokens, ignore_eos)

    def _hf_generate(self, ids, max_tokens, temperature, top_p, seed, stop, on_tokens, ignore_eos=False) -> GenerationResult:
        """transformers' `generate` with its dynamic cache: the baseline the latency harness compares to."""
        from .models import synchronize

        model, device = self.target.model, self.target.device
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(do_sample=False)
        stops = dict(stop_strings=stop, tokenizer=self.target.tokenizer) if stop else {}
        started = time.perf_counter()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # generate samples from the global generator
            out = model.generate(input_ids=torch.tensor([ids], device=device),
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                 max_new_tokens=max_tokens, eos_token_id=None if ignore_eos else self.target.eos_token_ids,
                                 pad_token_id=self.target.tokenizer.pad_token_id, **sampling, **stops)
        synchronize(device)
        tokens = out[0, len(ids):].tolist()
        on_tokens(tokens)
        eos = end_tokens(self.target, ignore_eos)
        reason = "eos" if tokens and tokens[-1] in eos else "length" if len(tokens) >= max_tokens else "stop_string"
        return GenerationResult(tokens, stop_reason=reason, seconds=time.perf_counter() - started)


def load_stack(*, results=None, target=None, drafter=None, window=None, mode="spec", name=None, device=None,
               dtype=None, context=0, engine=False, verify_tokens=None, verify_adaptive=False, no_repeat=None,
               tree_nodes=None, attention=None, compile_mode=None) -> Stack:
    """A Stack from a results folder's selected variant or from a target (+ drafter + window). `no_repeat` /
    `tree_nodes` None: the rule the variant's benchmark ran (with `results`), else off (`tree_nodes` 0: off).
    `attention` / `compile_mode` None: on a GPU, what the variant's benchmark ran its engines with (with `results`), else
    sdpa and none (the attention kernel off the GPU only runs in Triton's interpreter, and a compile pays off only
    where steps replay CUDA graphs)."""
    from .drafter import load_drafter
    from .models import load_target

    chosen = {}
    if results is not None:
        if target is not None or drafter is not None:
            raise QdflashError("serve: give --results or --target/--drafter, not both")
        chosen = selected_variant(results)
        target, drafter, name = chosen["target"], chosen["drafter"], name or chosen["variant"]
        window = chosen["window"] if window is None else window
        if verify_tokens is None and not verify_adaptive:  # none given: the benchmark's, where it recorded them
            verify_tokens, verify_adaptive = chosen.get("verify_tokens"), chosen.get("verify_adaptive", False)
        if no_repeat is None:
            no_repeat = chosen.get("no_repeat", False)
        if tree_nodes is None:
            tree_nodes = chosen.get("tree_nodes")
    if target is None:
        raise QdflashError("serve: nothing to serve; give --results <experiment folder> or --target <preset or path>")
    if mode == "spec" and drafter is None:  # said before minutes of loading
        raise QdflashError("serve: mode 'spec' needs a drafter (--drafter or --results); use --mode ar or hf without one")
    loaded = load_target(str(target), dtype=dtype, device=device)
    draft = load_drafter(drafter, loaded).eval() if drafter is not None and mode == "spec" else None
    gpu = loaded.device.type == "cuda"
    attention = attention or (chosen.get("attention", "sdpa") if gpu else "sdpa")
    compile_mode = compile_mode or (chosen.get("compile", "none") if gpu else "none")
    stack = Stack(name or Path(str(target)).name, loaded, draft, window, mode, context, verify_tokens, verify_adaptive,
                  bool(no_repeat), tree_nodes or None, attention, compile_mode)
    if engine:
        _build_engines(stack)
    return stack


def _build_engines(stack: Stack) -> None:
    """The lean target engine and the drafter's static engine, as the speed benchmark (stages.bench_speedup) runs
    them: `stack.attention` in both, and on a GPU the kernels tuned for this model's shapes and the steps captured
    (`stack.compile`: none, the drafts, or every step through torch.compile)."""
    from .drafter.static import DrafterEngine
    from .engine import build_engine

    target, drafter = stack.target, stack.drafter
    extra = max(drafter.block_size, stack.tree_nodes or 0) + 1 if drafter is not None else 1
    target.engine = build_engine(target, max_len=stack.context + extra)
    target.engine.set_attention(stack.attention)  # kernel without the engine's kernels: an error, not a fallback
    gpu = target.device.type == "cuda"
    steps, drafts = gpu and stack.compile == "all", gpu and stack.compile != "none"
    if gpu:
        started = time.perf_counter()
        target.engine.tune_kernels()  # before capture: a graph keeps the kernels it was captured with
        target.engine.capture([1], None, compile=steps)
        if drafter is not None:
            target.engine.capture([1, *verify_sizes(drafter, stack.verify_tokens, stack.verify_adaptive)],
                                  drafter.config.target_layer_ids, compile=steps)
        if drafter is not None and stack.tree_nodes:
            target.engine.capture([stack.tree_nodes + 1], drafter.config.target_layer_ids, compile=steps, tree=True)
        log.info("target engine: kernels tuned, %d graphs captured%s in %.1f s", len(target.engine.graphs),
                 " (compiled)" if steps else "", time.perf_counter() - started)
    if drafter is not None:
        drafter.engine = DrafterEngine(drafter, max_len=stack.context + extra, attention=stack.attention, compile=drafts)
        drafter.engine.tune_kernels()  # its fused (and, quantized, packed) shapes; before capture, as the target's
        drafter.engine.capture(stack.window)


# ----------------------------------------------------------------------------------------------
# requests


class RequestError(Exception):
    """A bad request: answered with `status` and the OpenAI error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ignore_eos: vLLM's extra parameter of that name (the openai client's extra_body): an end-of-sequence token does
# not end the answer, so a latency protocol gets exactly max_tokens new tokens
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
               "ignore_eos"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens"}


@dataclass
class Params:
    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


def _number(body, key, default, lo, hi, lo_open=False):
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"'{key}' must be a number, got {value!r}", key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise RequestError(400, f"'{key}' = {value} is out of range: expected {'(' if lo_open else '['}{lo}, {hi}]", key)
    return float(value)


def _integer(body, key, default, lo):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"'{key}' must be an integer, got {value!r}", key)
    if lo is not None and value < lo:
        raise RequestError(400, f"'{key}' = {value}: expected an integer >= {lo}", key)
    return value


def _prompt_ids(stack: Stack, body: dict, chat: bool) -> list[int]:
    tokenizer = stack.target.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
        turns = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise RequestError(400, f"messages[{i}].content: only text parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(content, str):
                raise RequestError(400, f"messages[{i}] must be {{role: system|user|assistant, content: string}}", "messages")
            turns.append({"role": m["role"], "content": content})
        from .data.chat import _render

        try:
            return _render(tokenizer, turns, add_generation_prompt=True, template_kwargs={})
        except QdflashError as err:
            raise RequestError(400, str(err), "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < stack.target.vocab_size]
        if bad:
            raise RequestError(400, f"'prompt' token ids {bad[:3]} are outside the vocabulary (0..{stack.target.vocab_size - 1})", "prompt")
        return list(prompt)
    raise RequestError(400, "'prompt' must be a non-empty string or list of token ids (one prompt: the server decodes batch 1)", "prompt")


def parse_request(stack: Stack, body: Any, chat: bool) -> Params:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - (CHAT_KEYS if chat else COMPLETION_KEYS))
    if unknown:
        raise RequestError(400, f"unsupported parameter(s) {unknown}; this server takes {sorted(CHAT_KEYS if chat else COMPLETION_KEYS)}", unknown[0])
    model = body.get("model")
    if model != stack.name:
        raise RequestError(404, f"The model `{model}` does not exist: this server serves `{stack.name}`", "model", "model_not_found")
    if _integer(body, "n", 1, 1) != 1:
        raise RequestError(400, "'n' must be 1: the server decodes one sequence per request", "n")
    ids = _prompt_ids(stack, body, chat)
    room = stack.context - len(ids)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # OpenAI's defaults: 16 new tokens for a completion, the rest of the context for a chat
    max_tokens = _integer(body, key, None, 1)
    if max_tokens is None:
        max_tokens = room if chat else 16
    if room < 1 or max_tokens > room:
        raise RequestError(400, f"This model's maximum context length is {stack.context} tokens. However, you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the completion)",
                           "messages" if chat else "prompt", "context_length_exceeded")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, "'stop' must be a non-empty string or a list of at most 4 of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(400, "'stream_options' must be an object", "stream_options")
    seed = _integer(body, "seed", None, None)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(400, "'ignore_eos' must be true or false", "ignore_eos")
    return Params(ids=ids, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                  top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                  # no seed: a fresh one (the loops' own default, 0, would make every sample the same)
                  seed=secrets.randbits(63) if seed is None else seed % 2**63,
                  stop=stop, stream=stream, include_usage=bool(options.get("include_usage", False)), ignore_eos=ignore_eos)


# ----------------------------------------------------------------------------------------------
# the worker and its bounded queue


class Cancelled(Exception):
    """Raised inside a generation whose client went away."""


@dataclass
class Job:
    params: Params
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float = 0.0

    def push(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Scheduler:
    """At most `max_queue` admitted requests (one decoding, the rest waiting, in order)."""

    def __init__(self, stack: Stack, max_queue: int):
        if max_queue < 1:
            raise QdflashError(f"serve: max_queue={max_queue} must be >= 1 (the request being decoded counts)")
        self.stack, self.max_queue = stack, max_queue
        self.admitted = 0
        self.served = 0
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="qdflash-decode", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self.admitted >= self.max_queue:
                return False
            self.admitted += 1
        self._jobs.put(job)
        return True

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.started = time.perf_counter()
            try:
                if job.cancelled.is_set():
                    raise Cancelled()

                def on_tokens(new: list[int], job=job) -> None:
                    if job.cancelled.is_set():
                        raise Cancelled()  # the client left: free the worker for the next request
                    job.push("tokens", new)

                p = job.params
                result = self.stack.generate(p.ids, p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, on_tokens,
                                             p.ignore_eos)
                job.push("done", result)
            except Cancelled:
                job.push("error", RequestError(499, "client closed the request", kind="cancelled"))
            except Exception as err:  # a bug or a device error: this request fails, the server goes on
                log.exception("generation failed")
                job.push("error", RequestError(500, f"generation failed: {type(err).__name__}: {err}", kind="server_error"))
            finally:
                with self._lock:
                    self.admitted -= 1
                    self.served += 1


# ----------------------------------------------------------------------------------------------
# text out


class Detokenizer:
    """Text of the generated tokens so far, released in pieces that cannot change any more: a piece
    ending in an incomplete UTF-8 character, or that could be the start of a stop string, waits."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.tokens: list[int] = []
        self.sent = 0  # characters released
        self.stopped = False

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        return text

    def add(self, new: list[int], final: bool = False) -> str:
        self.tokens += new
        text = self.text()
        end = len(text)
        if not final and not self.stopped:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = max(self.sent, end - hold)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


def usage(params: Params, result: GenerationResult, job: Job) -> dict:
    done = time.perf_counter()
    n = len(result.tokens)
    return {
        "prompt_tokens": len(params.ids), "completion_tokens": n, "total_tokens": len(params.ids) + n,
        "tau": round(result.tau, 4) if result.acceptance_lengths else None,
        "acceptance_lengths": result.acceptance_lengths,
        "queue_seconds": round(job.started - job.submitted, 6),
        "prefill_seconds": round(result.prefill_seconds, 6),
        "seconds": round(result.seconds, 6),
        "latency_seconds": round(done - job.submitted, 6),
        "tokens_per_s": round(n / result.seconds, 3) if result.seconds > 0 else None,
    }


def finish_reason(result: GenerationResult, detok: Detokenizer) -> str:
    return "stop" if result.stop_reason in ("eos", "stop_string") or detok.stopped else "length"


# ----------------------------------------------------------------------------------------------
# the app


def build_app(stack: Stack, max_queue: int = 8):
    """The FastAPI app serving `stack` (its scheduler under app.state.scheduler)."""
    scheduler = Scheduler(stack, max_queue)

    @asynccontextmanager
    async def lifespan(app):
        yield
        scheduler.close()

    app = FastAPI(title="qdflash", lifespan=lifespan)
    app.state.scheduler, app.state.stack = scheduler, stack

    def error(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": stack.name, "mode": stack.mode, "admitted": scheduler.admitted,
                "max_queue": scheduler.max_queue, "served": scheduler.served}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": stack.name, "object": "model", "created": 0, "owned_by": "qdflash",
                                            "max_model_len": stack.context}]}

    async def handle(request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError) as err:
                raise RequestError(400, f"the request body is not valid JSON ({err})") from None
            params = parse_request(stack, body, chat)
        except RequestError as err:
            return error(err)
        job = Job(params, asyncio.get_running_loop())
        if not scheduler.submit(job):
            return error(RequestError(503, f"the server is busy: {scheduler.max_queue} requests are already admitted "
                                           "(--max-queue); retry later", kind="server_busy", code="queue_full"))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        detok = Detokenizer(stack.target.tokenizer, params.stop)
        if params.stream:
            return StreamingResponse(stream(job, rid, created, chat, detok), media_type="text/event-stream")
        kind, value = None, None
        while kind not in ("done", "error"):
            kind, value = await job.events.get()
        if kind == "error":
            return error(value)
        detok.add(value.tokens, final=True)  # this path skipped the per-round events
        use = usage(params, value, job)
        log_request(rid, use, value)
        text = detok.text()
        choice = {"index": 0, "finish_reason": finish_reason(value, detok), "logprobs": None, "token_ids": value.tokens}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": stack.name, "choices": [choice], "usage": use}

    async def stream(job: Job, rid: str, created: int, chat: bool, detok: Detokenizer):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, tokens: list[int], reason: str | None = None, first=False) -> str:
            choice: dict = {"index": 0, "finish_reason": reason, "logprobs": None, "token_ids": tokens}
            if chat:
                choice["delta"] = ({"role": "assistant", "content": ""} if first else
                                   {} if delta_text is None else {"content": delta_text})
            else:
                choice["text"] = delta_text or ""
            return sse({"id": rid, "object": obj, "created": created, "model": stack.name, "choices": [choice]})

        held: list[int] = []  # chat: token ids of rounds that released no text yet go with the next chunk
        try:
            if chat:
                yield chunk(None, [], first=True)
            while True:
                kind, value = await job.events.get()
                if kind == "tokens":
                    piece = detok.add(value)
                    held += value
                    if piece or not chat:
                        yield chunk(piece, held)
                        held = []
                    continue
                if kind == "error":
                    yield sse(value.body())
                    break
                rest = detok.add([], final=True)
                yield chunk(rest if rest or not chat else None, held, finish_reason(value, detok))
                use = usage(job.params, value, job)
                log_request(rid, use, value)
                if job.params.include_usage:
                    yield sse({"id": rid, "object": obj, "created": created, "model": stack.name, "choices": [], "usage": use})
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client that left stops its generation at the next round (no effect after "done")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def log_request(rid: str, use: dict, result: GenerationResult) -> None:
    log.info("%s prompt=%d new=%d tau=%s queue=%.3fs prefill=%.3fs decode=%.3fs latency=%.3fs tok/s=%s stop=%s",
             rid, use["prompt_tokens"], use["completion_tokens"], use["tau"], use["queue_seconds"],
             use["prefill_seconds"], use["seconds"] - use["prefill_seconds"], use["latency_seconds"],
             use["tokens_per_s"], result.stop_reason)


# ----------------------------------------------------------------------------------------------
# command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qdflash serve", description="OpenAI-compatible server of a target + DFlash drafter")
    what = p.add_argument_group("what to serve (--results, or --target [--drafter])")
    what.add_argument("--results", help="an experiment folder (results/<name>): serve its selected variant")
    what.add_argument("--target", help="a target: preset name, Hub id or folder (a quantized export's model/)")
    what.add_argument("--drafter", help="a drafter folder written by the pipeline (drafter/<name>/drafter)")
    what.add_argument("--window", type=int, default=None, help="the drafter's sliding window (default: the variant's, else none)")
    what.add_argument("--verify-tokens", type=int, default=None,
                      help="tokens a speculative round verifies: the committed one + V-1 drafts, 1 < V <= block size "
                           "(default: with --results, what the variant's benchmark ran; else the whole block)")
    what.add_argument("--verify-adaptive", action="store_true",
                      help="verify the whole block after a round whose drafts were accepted as far as --verify-tokens reaches")
    what.add_argument("--drafts", choices=["argmax", "no-repeat"], default=None,
                      help="no-repeat: a draft that repeats the draft before it gives way to the drafter's second choice "
                           "(default: with --results, what the variant's benchmark ran; else argmax)")
    what.add_argument("--tree-nodes", type=int, default=None,
                      help="greedy requests verify a tree of the drafter's N best paths a round instead of a chain "
                           "(0: a chain; default: with --results, what the variant's benchmark ran; else a chain)")
    what.add_argument("--mode", choices=MODES, default="spec", help="spec: speculative (default); ar: the target alone; "
                      "hf: transformers' generate (the latency harness's baseline)")
    what.add_argument("--name", help="the model id clients ask for (default: the variant or target name)")
    run = p.add_argument_group("how")
    run.add_argument("--device", default=None, help="cuda / cpu (default: cuda when there is one)")
    run.add_argument("--dtype", default=None, help="bfloat16 / float16 / float32 (default: the loader's)")
    run.add_argument("--context", type=int, default=0, help="max prompt + new tokens (default: the target's max positions)")
    run.add_argument("--engine", action="store_true", help="decode on the lean engine + static drafter (GPU speed path)")
    run.add_argument("--attention", choices=ATTENTION, default=None,
                     help="--engine: the engines' attention (kernel: the Triton decode attention, GPU; default: on a GPU with "
                          "--results, what the variant's benchmark ran; else sdpa)")
    run.add_argument("--compile", choices=COMPILE, default=None,
                     help="--engine on a GPU: the drafter's draft steps (drafter) or every captured step (all) through "
                          "torch.compile, minutes at start (default: with --results, what the variant's benchmark ran; else none)")
    run.add_argument("--max-queue", type=int, default=8, help="requests admitted at once, the decoding one included (more: 503)")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    return p


def main(argv: list[str] | None = None) -> None:
    import sys

    import uvicorn

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        stack = load_stack(results=args.results, target=args.target, drafter=args.drafter, window=args.window,
                           mode=args.mode, name=args.name, device=args.device, dtype=args.dtype,
                           context=args.context, engine=args.engine, verify_tokens=args.verify_tokens,
                           verify_adaptive=args.verify_adaptive,
                           no_repeat=None if args.drafts is None else args.drafts == "no-repeat",
                           tree_nodes=args.tree_nodes, attention=args.attention, compile_mode=args.compile)
        app = build_app(stack, args.max_queue)
    except QdflashError as err:
        print(f"\nqdflash serve failed: {err}", file=sys.stderr)
        sys.exit(2)
    log.info("serving %s (%s, window %s, verify %s%s%s, context %d) on http://%s:%d/v1", stack.name, stack.mode, stack.window,
             stack.verify_tokens or "block", ", the block after a full accept" if stack.verify_adaptive else "",
             (", no-repeat drafts" if stack.no_repeat else "")
             + (f", trees of {stack.tree_nodes} drafts (greedy)" if stack.tree_nodes else "")
             + (f", engines: {stack.attention} attention, compiled: {stack.compile}" if args.engine else ""),
             stack.context, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
