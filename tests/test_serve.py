"""The OpenAI-compatible server (qdflash.serve) on a tiny target + untrained drafter, through the official
`openai` client: temperature 0 gives exactly the target's greedy tokens (plain and streamed,
completions and chat); bad requests get OpenAI-shaped 4xx and the server keeps serving; a full queue
answers 503 (made deterministic by a generation that waits on an event)."""

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from qdflash.data.chat import render_prompt_ids
from qdflash.drafter import init_drafter
from qdflash.serve import Stack, build_app, selected_variant
from qdflash.spec import autoregressive_generate, choose

uvicorn = pytest.importorskip("uvicorn")

PROMPT = "The quick brown fox"
NEW = 12


class Running:
    """A uvicorn server of `app` in a thread on a free port; stopped by close()."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def stack(varied_llama):
    drafter = init_drafter(varied_llama, block_size=4, num_layers=1, mask_token_id=3).eval()
    return Stack("tiny", varied_llama, drafter, window=None, mode="spec", context=256)


@pytest.fixture(scope="module")
def server(stack):
    running = Running(build_app(stack, max_queue=4))
    yield running
    running.close()


def reference(target, ids, n=NEW):
    return autoregressive_generate(target, [ids], n).tokens


def text_of(target, tokens):
    return target.tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_completions_plain_and_streamed_are_the_targets_greedy_tokens(server, stack):
    ids = stack.target.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = reference(stack.target, ids)
    assert len(set(expected)) > 1
    out = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == expected and choice.text == text_of(stack.target, expected)
    assert out.usage.completion_tokens == NEW and out.usage.prompt_tokens == len(ids)
    assert out.usage.model_extra["tau"] >= 1 and sum(out.usage.model_extra["acceptance_lengths"]) == NEW - 1
    tokens, text, reasons = [], "", []
    for chunk in server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True):
        tokens += chunk.choices[0].model_extra["token_ids"]
        text += chunk.choices[0].text
        reasons.append(chunk.choices[0].finish_reason)
    assert tokens == expected and text == choice.text and reasons[-1] == "length" and set(reasons[:-1]) == {None}
    # token ids as the prompt give the same
    again = server.client.completions.create(model="tiny", prompt=ids, max_tokens=NEW, temperature=0)
    assert again.choices[0].model_extra["token_ids"] == expected


def test_chat_plain_and_streamed_use_the_chat_template(server, stack):
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    expected = reference(stack.target, render_prompt_ids(stack.target.tokenizer, messages[0]["content"]))
    out = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    assert out.choices[0].model_extra["token_ids"] == expected
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text_of(stack.target, expected)
    stream = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0,
                                                   stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks if c.choices), []) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == NEW


def test_stop_strings_cut_the_text(server, stack):
    full = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop and full.find(stop) > 0
    out = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0, stop=stop, stream=True))
    assert streamed == out.choices[0].text
    # chat: while a possible stop string holds text back, the rounds' token ids wait with it (none lost)
    messages = [{"role": "user", "content": "Write a haiku about rain."}]
    full = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 4]
    # the long second stop never matches, but its length holds the first rounds' text back
    args = dict(model="tiny", messages=messages, max_tokens=NEW, temperature=0, stop=[stop, "#" * 30])
    cut = server.client.chat.completions.create(**args)
    chunks = [c for c in server.client.chat.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == cut.choices[0].message.content == text[: text.find(stop)]
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks), []) == cut.choices[0].model_extra["token_ids"]


def test_sampling_follows_the_seed(server):
    def sample(seed):
        return server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=1.5, top_p=0.9,
                                                seed=seed).choices[0].model_extra["token_ids"]

    assert sample(1) == sample(1)
    assert len({tuple(sample(s)) for s in range(2, 6)}) > 1


def test_top_p_keeps_the_nucleus_only():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    # the top token holds ~64% of the mass: top_p 0.5 keeps it alone, 0.8 the top two
    assert {int(choose(logits, 1.0, g, top_p=0.5)) for _ in range(50)} == {0}
    assert {int(choose(logits, 1.0, g, top_p=0.8)) for _ in range(200)} == {0, 1}


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, stack):
    c = server.client
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="word " * 300, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"best_of": 3})
    assert "best_of" in err.value.body["message"]
    raw = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW, temperature=0)
    ids = stack.target.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert out.choices[0].model_extra["token_ids"] == reference(stack.target, ids)


class Gated(Stack):
    """A stack whose generation waits until the test opens the gate: the queue fills deterministically."""

    gate: threading.Event = None

    def generate(self, *args, **kwargs):
        assert self.gate.wait(60)
        return super().generate(*args, **kwargs)


def test_a_full_queue_answers_503_and_then_serves(stack):
    gated = Gated("tiny", stack.target, stack.drafter, context=256)
    gated.gate = threading.Event()
    app = build_app(gated, max_queue=2)
    running = Running(app)
    try:
        results = []

        def ask():
            results.append(running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0))

        threads = []
        for admitted in (1, 2):  # one decoding (held at the gate), one waiting
            threads.append(threading.Thread(target=ask))
            threads[-1].start()
            deadline = time.monotonic() + 60
            while app.state.scheduler.admitted < admitted:
                assert time.monotonic() < deadline, "request was not admitted"
                time.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as err:
            running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
        assert err.value.status_code == 503 and err.value.body["code"] == "queue_full"
        gated.gate.set()
        for t in threads:
            t.join(60)
        assert len(results) == 2 and all(len(r.choices[0].model_extra["token_ids"]) == 3 for r in results)
        assert httpx.get(f"{running.url}/health").json()["admitted"] == 0
        running.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    finally:
        gated.gate.set()
        running.close()


def test_hf_baseline_mode_gives_the_same_greedy_tokens(varied_llama):
    running = Running(build_app(Stack("base", varied_llama, mode="hf", context=256)))
    try:
        ids = varied_llama.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        out = running.client.completions.create(model="base", prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert out.choices[0].model_extra["token_ids"] == reference(varied_llama, ids)
    finally:
        running.close()


def test_selected_variant_reads_the_summary(tmp_path):
    from qdflash.errors import QdflashError

    (tmp_path / "tables").mkdir()
    header = "variant,target,target_bits,drafter,drafter_bits,window,passes_gates,selected\n"
    (tmp_path / "tables" / "summary.csv").write_text(header + "a+b+win256,qad_x,4,gptq_w4g64,4,256,1,1\nc,qad_x,4,stage2,16,,1,0\n")
    chosen = selected_variant(tmp_path)
    assert chosen == {"variant": "a+b+win256", "window": 256, "target": tmp_path / "target/qad_x/model",
                      "drafter": tmp_path / "drafter/gptq_w4g64/drafter"}
    # the verify length it was benchmarked with comes along, where the benchmark job recorded it
    bench = tmp_path / "bench" / "speedup_win256"
    bench.mkdir(parents=True)
    (bench / "metrics.json").write_text(json.dumps({"verify_tokens": 6, "verify_adaptive": 1, "block_size": 16}))
    assert selected_variant(tmp_path) == {**chosen, "verify_tokens": 6, "verify_adaptive": True}
    (bench / "metrics.json").write_text(json.dumps({"verify_tokens": 16, "verify_adaptive": 0, "block_size": 16}))
    assert selected_variant(tmp_path) == {**chosen, "verify_tokens": None, "verify_adaptive": False}
    (bench / "metrics.json").write_text(json.dumps({"verify_tokens": 6, "verify_adaptive": 1, "block_size": 16, "no_repeat": 1}))
    assert selected_variant(tmp_path) == {**chosen, "verify_tokens": 6, "verify_adaptive": True, "no_repeat": True}
    (bench / "metrics.json").write_text(json.dumps({"verify_tokens": 6, "verify_adaptive": 1, "block_size": 16,
                                                    "no_repeat": 1, "tree_nodes": 15}))
    assert selected_variant(tmp_path) == {**chosen, "verify_tokens": 6, "verify_adaptive": True, "no_repeat": True,
                                          "tree_nodes": 15}
    # and the engines it ran: their attention (the QAD target's) and what went through torch.compile
    for compile_flags, mode in (({"bench.compile": 1, "bench.compile_drafter": 1}, "all"),
                                ({"bench.compile": 0, "bench.compile_drafter": 1}, "drafter"), ({"bench.compile": 0}, "none")):
        (bench / "metrics.json").write_text(json.dumps({"verify_tokens": 16, "block_size": 16, "engine.qad.attention": "kernel",
                                                        **compile_flags}))
        assert selected_variant(tmp_path) == {**chosen, "verify_tokens": None, "verify_adaptive": False, "attention": "kernel",
                                              "compile": mode}
    (tmp_path / "tables" / "summary.csv").write_text(header + "c,qad_x,4,stage2,16,,0,0\n")
    with pytest.raises(QdflashError, match="found 0"):
        selected_variant(tmp_path)


def test_serve_command_says_what_is_wrong(tmp_path, capsys):
    from qdflash import cli, serve

    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "--results", str(tmp_path)])
    assert exit.value.code == 2 and "tables/summary.csv not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        serve.main(["--target", "tiny-llama", "--mode", "spec", "--device", "cpu"])
    assert exit.value.code == 2 and "needs a drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        cli.main(["nope"])
    assert exit.value.code == 2 and "usage: qdflash" in capsys.readouterr().err


def test_engine_options_are_checked_and_the_attention_kernel_needs_the_engines_kernels(varied_llama):
    """--attention / --compile take their choices only (a clear error naming the flag); --engine with the attention kernel
    where the engine runs no Triton kernels (the CPU without the interpreter's opt-in) is an error, not a quiet SDPA."""
    from qdflash.errors import QdflashError
    from qdflash.serve import _build_engines

    with pytest.raises(QdflashError, match="--attention 'flash': expected one of sdpa, kernel"):
        Stack("x", varied_llama, mode="ar", context=64, attention="flash")
    with pytest.raises(QdflashError, match="--compile 'yes': expected one of none, drafter, all"):
        Stack("x", varied_llama, mode="ar", context=64, compile="yes")
    with pytest.raises(QdflashError, match="needs the engine's Triton kernels"):
        _build_engines(Stack("x", varied_llama, mode="ar", context=64, attention="kernel"))
    varied_llama.engine = None  # a session fixture: leave it as found


def test_served_engines_default_to_what_the_variant_was_benchmarked_with_on_a_gpu(monkeypatch, tmp_path):
    """load_stack with --results: on a GPU the engines take the attention and compile settings the variant's benchmark
    recorded (selected_variant), unless --attention / --compile say otherwise; off the GPU sdpa and none, where the
    attention kernel runs only in Triton's interpreter and a compile pays off in no CUDA graph."""
    import types

    from qdflash import models, serve

    monkeypatch.setattr(serve, "selected_variant", lambda results: {
        "variant": "v", "window": None, "target": tmp_path / "t", "drafter": tmp_path / "d", "attention": "kernel",
        "compile": "drafter"})
    for device, want in (("cuda", ("kernel", "drafter")), ("cpu", ("sdpa", "none"))):
        loaded = types.SimpleNamespace(device=torch.device(device), config=None)
        monkeypatch.setattr(models, "load_target", lambda *a, loaded=loaded, **k: loaded)
        stack = serve.load_stack(results=tmp_path, mode="ar", context=64)
        assert (stack.attention, stack.compile) == want
    stack = serve.load_stack(results=tmp_path, mode="ar", context=64, attention="kernel", compile_mode="all")
    assert (stack.attention, stack.compile) == ("kernel", "all")  # asked for: taken as given (an engine checks it)


def test_adaptive_verify_without_a_shorter_verify_is_refused(varied_llama):
    from qdflash.errors import QdflashError

    drafter = init_drafter(varied_llama, block_size=4, num_layers=1, mask_token_id=3)
    for verify in (None, 4):
        with pytest.raises(QdflashError, match="--verify-adaptive grows a shorter verify.*block size \\(4\\)"):
            Stack("x", varied_llama, drafter, context=128, verify_tokens=verify, verify_adaptive=True)


@pytest.mark.parametrize("verify_tokens, adaptive, no_repeat, tree_nodes", [(None, False, False, None), (2, True, True, None),
                                                                        (None, False, True, 6)])
def test_engine_path_serves_the_same_tokens(varied_llama, verify_tokens, adaptive, no_repeat, tree_nodes, monkeypatch):
    """--engine: the lean target engine and the static drafter (the GPU speed path) give the same tokens,
    verifying whole blocks, or 2 tokens and whole blocks after a round that accepted (--verify-adaptive) with
    the no-repeat drafts (--drafts no-repeat), or trees of 6 drafts (--tree-nodes), which reach the decoding loop;
    a sampled request verifies chains."""
    from qdflash import serve
    from qdflash.serve import _build_engines

    calls = []
    decode = serve.speculative_generate
    monkeypatch.setattr(serve, "speculative_generate", lambda *a, **k: calls.append(k) or decode(*a, **k))
    drafter = init_drafter(varied_llama, block_size=4, num_layers=1, mask_token_id=3).eval()
    stack = Stack("fast", varied_llama, drafter, context=128, verify_tokens=verify_tokens, verify_adaptive=adaptive,
                  no_repeat=no_repeat, tree_nodes=tree_nodes)
    _build_engines(stack)
    running = Running(build_app(stack))
    try:
        assert varied_llama.engine is not None and drafter.engine is not None
        ids = varied_llama.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        out = running.client.completions.create(model="fast", prompt=PROMPT, max_tokens=NEW, temperature=0)
        varied_llama.engine = None  # the reference on transformers' forward
        assert out.choices[0].model_extra["token_ids"] == reference(varied_llama, ids)
        assert calls and all(k["no_repeat"] is no_repeat and k["tree_nodes"] == tree_nodes for k in calls)
        running.client.completions.create(model="fast", prompt=PROMPT, max_tokens=4, temperature=0.7, seed=1)
        assert calls[-1]["tree_nodes"] is None  # sampled: a chain
    finally:
        varied_llama.engine = drafter.engine = None  # a session fixture: leave it as found
        running.close()


def test_ignore_eos_answers_past_the_end_of_sequence_token_in_both_modes(server, stack, varied_llama, monkeypatch):
    # vLLM's ignore_eos (the latency harness sends it: each category asks for exactly N new tokens): with the target's
    # third greedy token made its end-of-sequence token, a request stops there, and with ignore_eos runs on to
    # max_tokens with the target's greedy tokens, in the speculative and the transformers-generate server alike
    ids = varied_llama.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    expected = reference(varied_llama, ids)
    assert expected[2] not in expected[:2]
    monkeypatch.setattr(varied_llama.model.generation_config, "eos_token_id", expected[2])
    baseline = Running(build_app(Stack("base", varied_llama, mode="hf", context=256)))
    try:
        for running, model in ((server, "tiny"), (baseline, "base")):
            stopped = running.client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0)
            assert stopped.choices[0].model_extra["token_ids"] == expected[:3] and stopped.choices[0].finish_reason == "stop"
            whole = running.client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                                      extra_body={"ignore_eos": True})
            assert whole.choices[0].model_extra["token_ids"] == expected and whole.choices[0].finish_reason == "length"
            with pytest.raises(openai.BadRequestError, match="ignore_eos"):
                running.client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, extra_body={"ignore_eos": "yes"})
    finally:
        baseline.close()
