"""Throughput and latency of `mlx-spec serve` under 1, 2, 4 and 8 concurrent clients.

    python -m mlx_spec.bench.studies.serve_load [--max-tokens 64] [--clients 1,2,4,8] [--json out.json]

Starts `mlx-spec serve` (the shipped pair) as a child process on a free local
port, once with speculation (the defaults: adaptive k, prompt lookup in front
of the draft at temperature 0), once with `--no-draft` (the target alone) and
once with speculation but no prompt cache store (`--prompt-cache-bytes 0`:
no cache is passed to the API, so the reuse contract costs nothing).
Each client streams greedy /v1/completions requests for code prompts one
after another; at each level the clients send max(MIN_REQUESTS, 2 x clients)
requests in all. Per request: time to the first text chunk (TTFT), time to
the end, completion tokens (from `usage`). Per level: requests/s and tokens/s
over the level's wall-clock time, and the medians of TTFT and latency. One
warm-up request per server is left out. Only 127.0.0.1 is contacted. Prints a
Markdown table; writes a file only with --json (bench/results/ holds one).
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = ["def fibonacci(n):", "def quicksort(xs):", "class Stack:\n    def __init__(self):",
           "import os\n\ndef list_files(path):", "def is_prime(n):",
           "def binary_search(xs, target):", "class Node:\n    def __init__(self, value):",
           "def merge(a, b):"]
MIN_REQUESTS = 8
MODES = {  # name -> `mlx-spec serve` flags
    "speculative": [],
    "target alone": ["--no-draft"],
    "speculative, no reuse": ["--prompt-cache-bytes", "0"],  # no prompt cache passed at all
}
START_TIMEOUT_S = 120


def start_server(extra_args):
    """(process, base URL) of `mlx-spec serve` on a free port, once /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_spec", "serve", "--port", "0", *extra_args],
                            stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    if not line.startswith("Serving "):
        proc.kill()
        raise SystemExit(f"mlx-spec serve did not start: {line}{proc.stderr.read()}")
    url = line.split(" at ")[1].split(";")[0].removesuffix("/v1")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # never let its pipe fill
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("mlx-spec serve did not answer /health in time.")


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_request(client: httpx.Client, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage = None, None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"ttft_s": (first or end) - start, "latency_s": end - start,
            "completion_tokens": usage["completion_tokens"]}


def run_level(url: str, clients: int, max_tokens: int) -> dict:
    total = max(MIN_REQUESTS, 2 * clients)
    shares = [total // clients + (i < total % clients) for i in range(clients)]

    def client_run(index: int):
        with httpx.Client(base_url=url, timeout=600) as client:
            return [one_request(client, PROMPTS[(index + 3 * j) % len(PROMPTS)], max_tokens)
                    for j in range(shares[index])]

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        records = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    wall = time.perf_counter() - start
    tokens = sum(r["completion_tokens"] for r in records)
    return {"clients": clients, "requests": len(records), "wall_s": wall,
            "requests_per_s": len(records) / wall, "tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(r["ttft_s"] for r in records),
            "latency_median_s": statistics.median(r["latency_s"] for r in records),
            "records": records}


def measure(mode: str, extra_args, levels, max_tokens: int) -> list:
    proc, url = start_server(extra_args)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            one_request(client, PROMPTS[0], max_tokens)  # warm-up, left out
        results = []
        for clients in levels:
            level = run_level(url, clients, max_tokens)
            level["mode"] = mode
            results.append(level)
            print(f"{mode:>21} {clients} clients: {level['requests_per_s']:.2f} req/s, "
                  f"{level['tokens_per_s']:.1f} tok/s, TTFT {level['ttft_median_s'] * 1e3:.0f} ms, "
                  f"latency {level['latency_median_s']:.2f} s", file=sys.stderr)
        return results
    finally:
        stop_server(proc)


def markdown(results: list, max_tokens: int) -> str:
    lines = [f"max_tokens {max_tokens}, greedy, streamed /v1/completions; medians of each level's "
             "requests", "",
             "| mode | clients | requests | requests/s | tokens/s | TTFT median (ms) | latency median (s) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_median_s'] * 1e3:.0f} | "
                     f"{r['latency_median_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts")
    parser.add_argument("--json", default=None, help="also write every request's figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    results = []
    for mode, extra_args in MODES.items():
        results += measure(mode, extra_args, levels, args.max_tokens)
    print(markdown(results, args.max_tokens))
    if args.json:
        import mlx.core as mx

        machine = {"platform": platform.platform(), "processor": platform.processor(),
                   "mlx": mx.__version__, "device": str(mx.default_device())}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "max_tokens": args.max_tokens, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
