"""Throughput and latency of `mlx-spec serve` and of mlx-lm's server under concurrent clients.

    python -m bench.studies.serve_load [--max-tokens 64] [--clients 1,2,4,8,16]
        [--repeats 2] [--modes spec,spec-plain,spec-serial,lm,lm-draft,spec-kv4]
        [--baseline DIR]
        [--temp 0] [--json out.json]

Starts every server at once, each a child process on a free local port with
the shipped pair's target: `mlx-spec serve` batched and speculating (the
defaults), batched with `--no-draft`, one request at a time (`--no-batching`,
speculating: what it was before batching), and mlx-lm's own server
(`python -m mlx_lm server`: batched, no draft) and the same with the draft
(mlx-lm then serves one request at a time). Then, for each repeat and each
client count, every server in turn (interleaved, so drift on a shared machine
hits all alike): the clients stream /v1/completions requests (greedy, or `--temp`) for code
prompts one after another, max(MIN_REQUESTS, 2 x clients) requests in all.
Per request: time to the first text chunk (TTFT), time to the end,
completion tokens (from `usage`). Per level: tokens/s over the level's
wall-clock time and the medians of TTFT and latency; the table gives the
median over repeats. One warm-up request per server is left out.

Reuse (the prompt-cache store): one client sends a turn 1, then a turn 2 that
repeats turn 1's prompt and answer and adds a follow-up, to the batched
speculative server (turn 2 reuses turn 1's cache) and to the same server
with `--prompt-cache-bytes 0` (turn 2 prefilled fresh), alternating; the
ratio of turn 2's decode speed (tokens after the first over the time after
the first text) reused / fresh, per prompt and repeat. Only 127.0.0.1 is
contacted. Prints a Markdown table; writes a file only with
--json (bench/results/ holds them).

`--modes` keeps some of the servers (short names: spec, spec-plain,
spec-serial, lm, lm-draft, spec-kv4: one at a time with `--kv-bits 4`, the cache quantized
from token 8). `--baseline DIR` adds every kept mlx-spec server
again, run from the checkout DIR (`python -m mlx_spec` with DIR as its working
directory: that checkout's code, e.g. a `git worktree` of an earlier commit),
named "... (baseline)" and interleaved with the others: an A/B of a change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
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
MLX_SPEC = [sys.executable, "-m", "mlx_spec", "serve", "--port", "{port}", "--max-concurrency", "32"]
MLX_LM = [sys.executable, "-m", "mlx_lm", "server", "--model", "{target}", "--port", "{port}"]
MODES = {  # name -> command line
    "mlx-spec batched, speculative": MLX_SPEC,
    "mlx-spec batched, no draft": MLX_SPEC + ["--no-draft"],
    "mlx-spec one at a time, speculative": MLX_SPEC + ["--no-batching"],
    "mlx-lm batched, no draft": MLX_LM,
    "mlx-lm with draft (unbatched)": MLX_LM + ["--draft-model", "{draft}"],
    # mlx-lm's kv_bits (requests one at a time), the cache quantized inside every prompt
    "mlx-spec one at a time, 4-bit KV cache": MLX_SPEC + ["--kv-bits", "4",
                                                          "--quantized-kv-start", "8"],
}
SHORT = dict(zip(["spec", "spec-plain", "spec-serial", "lm", "lm-draft", "spec-kv4"], MODES))
BASELINE = " (baseline)"
REUSE_FRESH = MLX_SPEC + ["--prompt-cache-bytes", "0"]
FOLLOW_UP = "\n\ndef test():\n"
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command, cwd=None):
    """(process, base URL) of a server started from `command` (in `cwd`), once /health
    answers."""
    from mlx_spec.loading import default_draft_path, default_target_path

    port = free_port()
    command = [c.format(port=port, target=default_target_path(), draft=default_draft_path())
               for c in command]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=cwd)
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # never let its pipe fill
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}.")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{' '.join(command)} did not answer /health in time.")


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def one_request(client: httpx.Client, prompt: str, max_tokens: int, text: bool = False,
                temperature: float = 0.0) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, usage, pieces = None, None, []
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                first = first or time.perf_counter()
                pieces.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    record = {"ttft_s": (first or end) - start, "latency_s": end - start,
              "completion_tokens": usage["completion_tokens"]}
    if text:
        record["text"] = "".join(pieces)
    return record


def reuse_ratios(reused_url: str, fresh_url: str, max_tokens: int, repeats: int) -> list:
    """Turn 2's decode speed on a reused cache over the same turn prefilled fresh."""
    out = []
    with httpx.Client(base_url=reused_url, timeout=600) as reused, \
            httpx.Client(base_url=fresh_url, timeout=600) as fresh:
        for repeat in range(repeats):
            for i, prompt in enumerate(PROMPTS[:4]):
                first = one_request(reused, prompt, max_tokens, text=True)
                turn2 = prompt + first["text"] + FOLLOW_UP
                pair = {}
                for name in (("reused", "fresh") if (i + repeat) % 2 == 0 else ("fresh", "reused")):
                    r = one_request(reused if name == "reused" else fresh, turn2, max_tokens)
                    pair[name] = (r["completion_tokens"] - 1) / max(r["latency_s"] - r["ttft_s"], 1e-9)
                out.append({"prompt": i, "repeat": repeat, "reused_tps": pair["reused"],
                            "fresh_tps": pair["fresh"], "ratio": pair["reused"] / pair["fresh"]})
                print(f"reuse: prompt {i} repeat {repeat}: {out[-1]['ratio']:.2f}x", file=sys.stderr)
    return out


def run_level(url: str, clients: int, max_tokens: int, temperature: float = 0.0) -> dict:
    total = max(MIN_REQUESTS, 2 * clients)
    shares = [total // clients + (i < total % clients) for i in range(clients)]

    def client_run(index: int):
        with httpx.Client(base_url=url, timeout=600) as client:
            return [one_request(client, PROMPTS[(index + 3 * j) % len(PROMPTS)], max_tokens,
                                temperature=temperature) for j in range(shares[index])]

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


def servers_to_run(modes, baseline=None) -> dict:
    """name -> (command, working directory) of the servers kept, baselines after each."""
    out = {}
    for mode in modes:
        out[mode] = (MODES[mode], None)
        if baseline is not None and mode.startswith("mlx-spec"):
            out[mode + BASELINE] = (MODES[mode], baseline)
    return out


def measure(levels, max_tokens: int, repeats: int, reuse: bool, modes=tuple(MODES)[:5],
            baseline=None, temperature: float = 0.0):
    servers = {}
    timed = servers_to_run(modes, baseline)
    try:
        for mode, (command, cwd) in list(timed.items()) + (
                [("fresh", (REUSE_FRESH, None))] if reuse else []):
            servers[mode] = start_server(command, cwd)
            with httpx.Client(base_url=servers[mode][1], timeout=600) as client:
                one_request(client, PROMPTS[0], max_tokens, temperature=temperature)  # warm-up
        runs = []
        reuse_runs = reuse_ratios(servers[list(MODES)[0]][1], servers["fresh"][1], max_tokens,
                                  repeats) if reuse else []
        for repeat in range(repeats):
            for clients in levels:
                order = list(timed) if repeat % 2 == 0 else list(reversed(timed))
                for mode in order:
                    url = servers[mode][1]
                    level = run_level(url, clients, max_tokens, temperature)
                    level.update(mode=mode, repeat=repeat)
                    runs.append(level)
                    print(f"{mode:>36} {clients:2d} clients: {level['tokens_per_s']:6.1f} tok/s, "
                          f"TTFT {level['ttft_median_s'] * 1e3:5.0f} ms, "
                          f"latency {level['latency_median_s']:.2f} s", file=sys.stderr)
        return runs, reuse_runs
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def summary(runs: list) -> list:
    """One row per (mode, clients): medians over repeats, and the ratio to mlx-lm batched."""
    rows = {}
    for r in runs:
        rows.setdefault((r["mode"], r["clients"]), []).append(r)
    out = []
    for (mode, clients), rs in rows.items():
        out.append({"mode": mode, "clients": clients, "repeats": len(rs),
                    "requests": rs[0]["requests"],
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                    "tokens_per_s_range": [min(r["tokens_per_s"] for r in rs),
                                           max(r["tokens_per_s"] for r in rs)],
                    "ttft_median_s": statistics.median(r["ttft_median_s"] for r in rs),
                    "latency_median_s": statistics.median(r["latency_median_s"] for r in rs)})
    base = {r["clients"]: r["tokens_per_s"] for r in out if r["mode"] == "mlx-lm batched, no draft"}
    for r in out:
        r["vs_mlx_lm_batched"] = r["tokens_per_s"] / base[r["clients"]] if r["clients"] in base else None
    return sorted(out, key=lambda r: (list(MODES).index(r["mode"].removesuffix(BASELINE)),
                                      r["mode"].endswith(BASELINE), r["clients"]))


def markdown(rows: list, max_tokens: int, temperature: float = 0.0) -> str:
    sampling = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    lines = [f"max_tokens {max_tokens}, {sampling}, streamed /v1/completions; per level the median "
             "over repeats of tokens/s (range) and of each level's median TTFT and latency", "",
             "| server | clients | requests | tokens/s | range | vs mlx-lm batched | "
             "TTFT median (ms) | latency median (s) |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        low, high = r["tokens_per_s_range"]
        ratio = "" if r["vs_mlx_lm_batched"] is None else f"{r['vs_mlx_lm_batched']:.2f}x"
        lines.append(f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
                     f"{low:.1f}-{high:.1f} | {ratio} | {r['ttft_median_s'] * 1e3:.0f} | "
                     f"{r['latency_median_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", default="1,2,4,8,16", help="comma-separated client counts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure turn 2 on a reused prompt cache against fresh")
    parser.add_argument("--modes", default="spec,spec-plain,spec-serial,lm,lm-draft",
                        help=f"comma-separated servers to run, of {', '.join(SHORT)}")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also run the mlx-spec servers from this checkout (an A/B)")
    parser.add_argument("--temp", type=float, default=0.0,
                        help="the requests' temperature (default 0: greedy)")
    parser.add_argument("--json", default=None, help="also write every request's figures here")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    unknown = [m for m in args.modes.split(",") if m not in SHORT]
    if unknown:
        parser.error(f"unknown mode {unknown[0]!r}; choose from {', '.join(SHORT)}.")
    if args.reuse and "spec" not in args.modes.split(","):
        parser.error("--reuse measures the spec server: keep it in --modes, or pass --no-reuse.")
    modes = [SHORT[m] for m in args.modes.split(",")]
    if args.temp < 0:
        parser.error(f"--temp must be >= 0, got {args.temp}.")
    runs, reuse_runs = measure(levels, args.max_tokens, args.repeats, args.reuse, modes,
                               args.baseline, args.temp)
    rows = summary(runs)
    print(markdown(rows, args.max_tokens, args.temp))
    if reuse_runs:
        ratios = sorted(r["ratio"] for r in reuse_runs)
        print(f"\nTurn 2 decode speed, reused / fresh prompt cache (batched speculative server, "
              f"{len(ratios)} pairs): median {statistics.median(ratios):.2f}x, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f}")
    if args.json:
        import mlx.core as mx

        machine = {"platform": platform.platform(), "processor": platform.processor(),
                   "mlx": mx.__version__, "device": str(mx.default_device()),
                   "ld_preload": os.environ.get("LD_PRELOAD", "")}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "max_tokens": args.max_tokens,
                       "temperature": args.temp, "summary": rows,
                       "modes": modes, "baseline": args.baseline,
                       "runs": runs, "reuse": reuse_runs}, f, indent=1)


if __name__ == "__main__":
    main()
