"""The latency harness: end-to-end request latency of the served stack against a baseline server,
through the official `openai` client, per length category (docs/recipe.md: 64 / 2,048 / 8,192 prompt
tokens with 128 / 256 / 256 new tokens), for both prompt kinds: real text (a summarization request
over the data's own text) and the repetitive filler prompt, each row labelled with its kind.

    python -m qdflash.bench_latency --results results/<experiment> --baseline-target <16-bit target> \\
        --data-dir results/<experiment>/data/bf16 --out results/<experiment>/latency

Each server is a `python -m qdflash.serve` subprocess (the stack: its selected variant, or --target /
--drafter / --window; the baseline: --mode hf, transformers' `generate` on the 16-bit target), started,
warmed up, then sent N timed greedy requests per (kind, category) one after another (batch 1, as served),
and stopped. Latency is the client's wall time of one non-streamed request. Reported per row: median and
p90 latency, tokens/s (completion tokens / latency, median over requests), the stack's mean tau (from
the server's usage fields) and the speedup (baseline median latency / stack median latency). Every
request decodes exactly its category's new tokens (`ignore_eos`, vLLM's parameter, which both servers
take), so the two servers do the same work whatever the text: a real-text answer that ended at EOS after 13
tokens made a 2,048-token row mostly prefill (results/published/2026-12-04-h200-qwen-block9).
`--stop-at-eos` ends requests at EOS as an ordinary client would; each row says how many tokens came.

Prompts come from qdflash.bench (`bucket_cases`, `FILLER`), the same the speed benchmark uses, sent as
token ids so their lengths are exact.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .errors import QdflashError
from .tracking import environment

log = logging.getLogger("qdflash.bench_latency")

CATEGORIES = [(64, 128), (2048, 256), (8192, 256)]  # (prompt tokens, new tokens): docs/recipe.md
COLUMNS = ["kind", "category", "prompt_tokens", "max_new_tokens", "server", "requests", "median_s", "p90_s",
           "tokens_per_s", "completion_tokens", "tau_mean", "speedup"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m qdflash.serve ARGS` on a free port, its output in `log_path`; a context manager that
    always stops it."""

    def __init__(self, args: list[str], log_path: Path, start_timeout: float = 1800):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "qdflash.serve", *args, "--port", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self._wait(start_timeout)

    def _wait(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise QdflashError(f"the server exited with code {self.proc.returncode} before serving; its log: {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.close()
        raise QdflashError(f"the server did not answer /health within {timeout:.0f} s; its log: {self.log_path}")

    def model(self) -> str:
        import httpx

        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]) of a non-empty list."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def prompt_cases(data_dir, tokenizer, categories, context: int) -> list[dict]:
    """Per category, the real-text prompt and the filler prompt of that length (qdflash.bench)."""
    from .bench import bucket_cases

    cases = []
    for prompt_tokens, new_tokens in categories:
        real, filler = bucket_cases(data_dir, tokenizer, [[prompt_tokens, new_tokens]], context, filler=True)
        for kind, case in (("real", real), ("filler", filler)):
            cases.append({"kind": kind, "category": f"p{prompt_tokens}", "ids": case.ids, "max_new_tokens": new_tokens})
    return cases


def time_requests(client, model: str, case: dict, requests: int, warmup: int, ignore_eos: bool = True) -> dict:
    """`warmup` untimed then `requests` timed greedy completions of one case; their latency stats."""
    def once():
        started = time.perf_counter()
        out = client.completions.create(model=model, prompt=case["ids"], max_tokens=case["max_new_tokens"], temperature=0,
                                        extra_body={"ignore_eos": True} if ignore_eos else None)
        return time.perf_counter() - started, out

    for _ in range(warmup):
        once()
    latencies, tokens, taus = [], [], []
    for _ in range(requests):
        seconds, out = once()
        latencies.append(seconds)
        tokens.append(out.usage.completion_tokens)
        tau = (out.usage.model_extra or {}).get("tau")
        if tau is not None:
            taus.append(tau)
    return {"requests": requests, "median_s": round(statistics.median(latencies), 6),
            "p90_s": round(percentile(latencies, 0.9), 6),
            "tokens_per_s": round(statistics.median(n / s for n, s in zip(tokens, latencies)), 3),
            "completion_tokens": int(statistics.median(tokens)),
            "tau_mean": round(statistics.mean(taus), 4) if taus else ""}


def measure(server_args: list[str], label: str, cases: list[dict], requests: int, warmup: int, out_dir: Path,
            ignore_eos: bool = True) -> list[dict]:
    import openai

    rows = []
    with ServerProcess(server_args, out_dir / f"server-{label}.log") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=3600)
        model = server.model()
        for case in cases:
            stats = time_requests(client, model, case, requests, warmup, ignore_eos)
            rows.append({"kind": case["kind"], "category": case["category"], "prompt_tokens": len(case["ids"]),
                         "max_new_tokens": case["max_new_tokens"], "server": label, **stats, "speedup": ""})
            log.info("%s %s %s: median %.3f s, p90 %.3f s", label, case["kind"], case["category"], stats["median_s"], stats["p90_s"])
    return rows


def with_speedups(stack_rows: list[dict], baseline_rows: list[dict]) -> list[dict]:
    base = {(r["kind"], r["category"]): r for r in baseline_rows}
    for r in stack_rows:
        b = base[(r["kind"], r["category"])]
        r["speedup"] = round(b["median_s"] / r["median_s"], 4)
    return stack_rows + baseline_rows


def load_tokenizer(target: str):
    """The target's tokenizer without its weights where the folder has tokenizer files (exports do),
    else through load_target (presets) on the CPU."""
    path = Path(target)
    if path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    from .models import load_target

    return load_target(target, device="cpu").tokenizer


def run(stack_args: list[str], baseline_args: list[str], tokenizer_source: str, data_dir, out_dir, *,
        categories=CATEGORIES, requests: int = 5, warmup: int = 2, context: int = 0, ignore_eos: bool = True) -> dict:
    """Both servers over every (kind, category); writes out_dir/latency.csv and latency.json."""
    if requests < 1 or warmup < 0:
        raise QdflashError(f"bench_latency: requests={requests} must be >= 1 and warmup={warmup} >= 0")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_source)
    context = context or max(p + n for p, n in categories) + 128
    cases = prompt_cases(data_dir, tokenizer, categories, context)
    stack_rows = measure(stack_args, "stack", cases, requests, warmup, out_dir, ignore_eos)
    baseline_rows = measure(baseline_args, "baseline", cases, requests, warmup, out_dir, ignore_eos)
    rows = with_speedups(stack_rows, baseline_rows)
    report = {"stack_server": stack_args, "baseline_server": baseline_args, "categories": [list(c) for c in categories],
              "requests": requests, "warmup": warmup, "ignore_eos": ignore_eos,
              "latency": "client wall time of one non-streamed greedy request",
              "rows": rows, **environment()}  # the device, versions and commit the numbers come from
    with (out_dir / "latency.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out_dir / "latency.json").write_text(json.dumps(report, indent=2))
    return report


def parse_categories(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
        assert all(len(p) == 2 and p[0] > 0 and p[1] > 0 for p in pairs)
    except (ValueError, AssertionError):
        raise QdflashError(f"--categories {text!r}: expected PROMPT:NEW pairs, comma-separated (e.g. 64:128,2048:256)") from None
    return pairs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="qdflash latency", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", help="serve this experiment's selected variant")
    p.add_argument("--target", help="or this target (with --drafter, --window)")
    p.add_argument("--drafter")
    p.add_argument("--window", type=int)
    # a variant served without its results folder is served with the rounds its benchmark ran only if told
    p.add_argument("--verify-tokens", type=int, help="passed to the stack server (qdflash serve --verify-tokens)")
    p.add_argument("--verify-adaptive", action="store_true", help="passed to the stack server (qdflash serve --verify-adaptive)")
    p.add_argument("--drafts", choices=["argmax", "no-repeat"], default=None,
                   help="passed to the stack server (qdflash serve --drafts; default: the variant's benchmark's)")
    p.add_argument("--baseline-target", required=True, help="the 16-bit target the baseline server runs (transformers' generate)")
    p.add_argument("--data-dir", required=True, help="a data folder with train.jsonl (the real-text prompts)")
    p.add_argument("--out", required=True, help="folder for latency.csv, latency.json and the servers' logs")
    p.add_argument("--categories", default=",".join(f"{a}:{b}" for a, b in CATEGORIES))
    p.add_argument("--requests", type=int, default=5, help="timed requests per (prompt kind, category)")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests first, per (kind, category)")
    p.add_argument("--device")
    p.add_argument("--engine", action="store_true", help="the stack server decodes on the lean engine (GPU)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="requests end at EOS (default: exactly the category's new tokens, ignore_eos)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        categories = parse_categories(args.categories)
        context = max(a + b for a, b in categories) + 128
        common = ["--context", str(context), *(["--device", args.device] if args.device else [])]
        if args.results:
            from .serve import selected_variant

            stack_args, source = ["--results", args.results], str(selected_variant(args.results)["target"])
        elif args.target:
            stack_args = ["--target", args.target, *(["--drafter", args.drafter] if args.drafter else ["--mode", "ar"])]
            source = args.target
        else:
            raise QdflashError("bench_latency: give --results or --target")
        if args.window is not None:
            stack_args += ["--window", str(args.window)]
        if args.verify_tokens is not None:
            stack_args += ["--verify-tokens", str(args.verify_tokens)]
        if args.verify_adaptive:
            stack_args += ["--verify-adaptive"]
        if args.drafts is not None:
            stack_args += ["--drafts", args.drafts]
        stack_args += common + (["--engine"] if args.engine else [])
        baseline_args = ["--target", args.baseline_target, "--mode", "hf", *common]
        report = run(stack_args, baseline_args, source, args.data_dir, args.out, categories=categories,
                     requests=args.requests, warmup=args.warmup, context=context, ignore_eos=not args.stop_at_eos)
    except QdflashError as err:
        print(f"\nqdflash latency failed: {err}", file=sys.stderr)
        sys.exit(2)
    for r in report["rows"]:
        print(f"{r['server']:8s} {r['kind']:6s} {r['category']:6s} median {r['median_s']:.3f} s  p90 {r['p90_s']:.3f} s  "
              f"{r['tokens_per_s']} tok/s  speedup {r['speedup']}")


if __name__ == "__main__":
    main()
