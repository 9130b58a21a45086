"""`mlx-spec serve` under abuse: mixed bad and good requests from several threads at once.

    python -m bench.studies.serve_abuse [--requests 200] [--threads 8] [--out NAME]

Starts the server in this process (the shipped pair, an API key, the default
`Limits`, the `serve` defaults otherwise) on a free local port, sends every
well-formed request of the plan once, one after another (the reference
answers), then sends N requests mixed at random (seeded) from several threads
at once with httpx: well-formed greedy completions and chats (8-12 tokens,
streamed or not, some with logit_bias, penalties or logprobs) whose text must
equal the reference; 64 MiB bodies (with Content-Length, and chunked without
it); max_tokens 10**9 (400) and num_draft_tokens 10**9 (clamped: 200, same
answer); refused fields (tools, response_format json); bad and missing API
keys; malformed JSON; floods of submit-and-disconnect (a streamed request
whose connection is closed at once or halfway through its body, on a raw
socket, or after the answer's first line, with httpx); penalties and logprobs
out of range. Per category: the status codes seen and times; the 64 MiB
bodies' time to the 413; the process's resident memory (VmRSS: the server
runs in-process) before, after the abuse and after a gc; `/health` at the
end; errors the server logged. Every abusive request must get its 4xx, every
valid one 200 and its reference text, nothing a 5xx, and the server must log
no error (the exit status says whether all held). Only 127.0.0.1 is
contacted. Writes bench/results/<NAME>.json and .md only with --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import httpx

MODEL_ID = "mlx-spec-default"
API_KEY = "abuse-study-key"
MiB = 2**20
BIG_BODY_BYTES = 64 * MiB
FLOOD_SIZE = 8  # submit-and-disconnects per flood item
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n\ndef main():",
           "def quicksort(xs):"]
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that adds two numbers."}]


@dataclass
class Case:
    """One kind of request: how to send it and what it must get."""

    category: str
    send: Callable[[str, str], "Outcome"]  # (base URL, API key) -> outcome
    expect: Optional[int]  # the status it must get; None: the client leaves, no status
    reference: Optional[str] = None  # a valid request's key into the reference answers


@dataclass
class Outcome:
    status: Optional[int]
    seconds: float
    text: Optional[str] = None  # a 200's answer text
    code: Optional[str] = None  # an error's code
    error: Optional[str] = None  # a transport error on the client's side
    extra: Dict = field(default_factory=dict)


def _headers(key: Optional[str]) -> dict:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def _answer_text(response: httpx.Response, chat: bool, stream: bool) -> str:
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]
    text = []
    for line in response.text.splitlines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("error"):
            raise ValueError(f"error event in the stream: {chunk['error']}")
        for choice in chunk.get("choices", []):
            text.append((choice["delta"].get("content") or "") if chat else choice["text"])
    if not response.text.rstrip().endswith("data: [DONE]"):
        raise ValueError("the stream did not end with [DONE]")
    return "".join(text)


def _post(path: str, body=None, content=None, headers=None, key_override=False, chat=False):
    """A sender for one POST; a 200's text is read out (streamed or not)."""
    stream = isinstance(body, dict) and body.get("stream", False)

    def send(url: str, key: str) -> Outcome:
        h = dict(headers or {})
        if not key_override:
            h.update(_headers(key))
        start = time.perf_counter()
        try:
            with httpx.Client(base_url=url, timeout=300) as http:
                if body is not None:
                    r = http.post(path, json=body, headers=h)
                else:
                    r = http.post(path, content=content() if callable(content) else content,
                                  headers={"content-type": "application/json", **h})
        except httpx.HTTPError as exc:
            return Outcome(None, time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")
        seconds = time.perf_counter() - start
        if r.status_code == 200:
            return Outcome(200, seconds, text=_answer_text(r, chat, stream))
        try:
            code = r.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "(not OpenAI's error body)"
        return Outcome(r.status_code, seconds, code=code)
    return send


def _big_chunks(total: int):
    """A JSON body of `total` bytes, 1 MiB at a time (never held whole)."""
    head, tail = b'{"prompt": "', b'"}'
    block = b"x" * MiB
    yield head
    left = total - len(head) - len(tail)
    while left > 0:
        yield block[:min(left, MiB)]
        left -= MiB
    yield tail


def _raw_request(body: bytes, host: str, key: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


def _disconnect_flood(url: str, key: str) -> Outcome:
    """FLOOD_SIZE times: a streamed request whose connection closes at once (raw socket: the
    request sent, then close), one that closes halfway through its body, and one closed after
    the answer's first line (httpx)."""
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    errors = []
    for i in range(FLOOD_SIZE):
        body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 512,
                           "stream": True}).encode()
        for sent in (body, body[:len(body) // 2]):
            with socket.create_connection((host, int(port)), timeout=30) as sock:
                sock.sendall(_raw_request(body, host, key)[:-len(body)] + sent)
        try:
            with httpx.Client(base_url=url, timeout=300) as http, http.stream(
                    "POST", "/v1/completions", headers=_headers(key),
                    content=body) as response:
                if response.status_code != 200:
                    errors.append(f"status {response.status_code}")
                next(response.iter_lines())
        except httpx.HTTPError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return Outcome(None, time.perf_counter() - start, error="; ".join(errors) or None,
                   extra={"disconnects": 3 * FLOOD_SIZE})


def good_bodies(tokenizer) -> Dict[str, tuple]:
    """name -> (path, body, chat): the well-formed requests, each with a reference answer."""
    forced = tokenizer.encode(" x")[-1]
    bodies = {}
    for i, prompt in enumerate(PROMPTS):
        bodies[f"completion{i}"] = ("/v1/completions",
                                    {"prompt": prompt, "max_tokens": 12, "temperature": 0}, False)
        bodies[f"completion{i}-stream"] = ("/v1/completions", {
            "model": MODEL_ID, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}, False)
    bodies["chat"] = ("/v1/chat/completions",
                      {"model": "default", "messages": CHAT, "max_tokens": 12, "temperature": 0},
                      True)
    bodies["chat-stream"] = ("/v1/chat/completions",
                             {"messages": CHAT, "max_completion_tokens": 8, "stream": True}, True)
    bodies["clamped-k"] = ("/v1/completions",
                           {"prompt": PROMPTS[0], "max_tokens": 12, "num_draft_tokens": 10**9},
                           False)
    bodies["logit-bias"] = ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 8,
                                                "logit_bias": {str(forced): 100}}, False)
    bodies["penalties"] = ("/v1/completions", {
        "prompt": PROMPTS[2], "max_tokens": 8, "presence_penalty": 1.5, "frequency_penalty": 0.5,
        "repetition_penalty": 1.3}, False)
    bodies["logprobs"] = ("/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 8,
                                              "logprobs": 3}, False)
    bodies["chat-logprobs"] = ("/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
        "stream": True}, True)
    return bodies


def abusive_cases() -> List[Case]:
    """Every abusive kind, each with the 4xx it must get (or none: the client leaves)."""
    good = {"prompt": PROMPTS[0], "max_tokens": 8}
    return [
        Case("body 64 MiB (Content-Length)", _post(
            "/v1/completions", content=lambda: _big_chunks(BIG_BODY_BYTES),
            headers={"content-length": str(BIG_BODY_BYTES)}), 413),
        Case("body 64 MiB (chunked)", _post(
            "/v1/completions", content=lambda: _big_chunks(BIG_BODY_BYTES)), 413),
        Case("max_tokens 10**9", _post("/v1/completions", {**good, "max_tokens": 10**9}), 400),
        Case("tools", _post("/v1/chat/completions", {
            "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
            chat=True), 400),
        Case("response_format json", _post("/v1/chat/completions", {
            "messages": CHAT, "response_format": {"type": "json_object"}}, chat=True), 400),
        Case("bad API key", _post("/v1/completions", good, headers=_headers("wrong"),
                                  key_override=True), 401),
        Case("missing API key", _post("/v1/chat/completions", {"messages": CHAT},
                                      key_override=True), 401),
        Case("malformed JSON", _post("/v1/chat/completions", content=b'{"messages": [{"role": '),
             400),
        Case("not UTF-8", _post("/v1/completions", content=b'{"prompt": "\xff\xfe"}'), 400),
        Case("not an object", _post("/v1/completions", content=b"[1, 2, 3]"), 400),
        Case("penalty out of range", _post("/v1/completions", {**good, "presence_penalty": 3}),
             400),
        Case("logit_bias out of range", _post("/v1/completions",
                                              {**good, "logit_bias": {"5": 101}}), 400),
        Case("logit_bias outside the vocabulary", _post(
            "/v1/completions", {**good, "logit_bias": {"99999999": 1}}), 400),
        Case("top_logprobs 50", _post("/v1/chat/completions", {
            "messages": CHAT, "logprobs": True, "top_logprobs": 50}, chat=True), 400),
        Case("completion logprobs 9", _post("/v1/completions", {**good, "logprobs": 9}), 400),
        Case("submit-and-disconnect flood", _disconnect_flood, None),
    ]


def plan(tokenizer, n: int, seed: int = 0) -> List[Case]:
    """N cases: about a third well-formed (each good body in turn), the rest abusive, shuffled;
    every abusive kind at least once, the 64 MiB bodies and floods a little rarer."""
    goods = [Case(f"valid: {name}", _post(path, body, chat=chat), 200, reference=name)
             for name, (path, body, chat) in good_bodies(tokenizer).items()]
    abusive = abusive_cases()
    weights = {c.category: (2 if "64 MiB" in c.category or "flood" in c.category else 3)
               for c in abusive}
    n_good = max(len(goods), n // 3)
    cases = [goods[i % len(goods)] for i in range(n_good)] + list(abusive)
    rng = random.Random(seed)
    pool = [c for c in abusive for _ in range(weights[c.category])]
    cases += [rng.choice(pool) for _ in range(n - len(cases))]
    rng.shuffle(cases)
    return cases


def references(url: str, key: str, tokenizer) -> Dict[str, str]:
    """Each well-formed request sent once, alone: name -> its answer text."""
    out = {}
    for name, (path, body, chat) in good_bodies(tokenizer).items():
        outcome = _post(path, body, chat=chat)(url, key)
        if outcome.status != 200:
            raise RuntimeError(f"reference request {name} got {outcome.status} {outcome.code} "
                               f"{outcome.error}")
        out[name] = outcome.text
    return out


def run_abuse(url: str, key: str, cases: List[Case], threads: int) -> List[tuple]:
    """Every case sent from `threads` threads at once: [(case, outcome)] in plan order."""
    with ThreadPoolExecutor(threads) as pool:
        outcomes = list(pool.map(lambda case: case.send(url, key), cases))
    return list(zip(cases, outcomes))


def health(url: str, key: str, settle_s: float = 30) -> dict:
    """/health once nothing is admitted (a cancelled running job stops before its next token)."""
    deadline = time.monotonic() + settle_s
    while True:
        body = httpx.get(url + "/health", headers=_headers(key), timeout=30).json()
        if body["requests"]["admitted"] == 0 or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def summarize(results: List[tuple], refs: Dict[str, str]) -> Dict[str, dict]:
    """category -> statuses seen, expected status, failures, times, answers matched."""
    table: Dict[str, dict] = {}
    for case, outcome in results:
        row = table.setdefault(case.category, {
            "expect": case.expect, "count": 0, "statuses": Counter(), "codes": Counter(),
            "seconds": [], "failures": [], "matched": 0, "disconnects": 0})
        row["count"] += 1
        row["statuses"][str(outcome.status)] += 1
        if outcome.code:
            row["codes"][outcome.code] += 1
        row["seconds"].append(outcome.seconds)
        row["disconnects"] += outcome.extra.get("disconnects", 0)
        if outcome.status != case.expect or outcome.error:
            row["failures"].append(f"status {outcome.status}, {outcome.code or ''} "
                                   f"{outcome.error or ''}".strip())
        elif case.reference is not None:
            if outcome.text == refs[case.reference]:
                row["matched"] += 1
            else:
                row["failures"].append(f"answer differs: {outcome.text!r} vs "
                                       f"{refs[case.reference]!r}")
    for row in table.values():
        s = row.pop("seconds")
        row.update(statuses=dict(row["statuses"]), codes=dict(row["codes"]),
                   median_s=round(statistics.median(s), 3), max_s=round(max(s), 3))
    return table


def rss_bytes() -> int:
    """This process's resident memory (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def mlx_active_bytes() -> int:
    """MLX's memory in live arrays (the models, the prompt cache store's caches)."""
    import mlx.core as mx

    return mx.get_active_memory()


class ErrorLog(logging.Handler):
    """Counts ERROR records of the server's and uvicorn's loggers (a 500 the client never saw)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: List[str] = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")

    def __enter__(self):
        for name in ("mlx_spec.server", "uvicorn.error"):
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in ("mlx_spec.server", "uvicorn.error"):
            logging.getLogger(name).removeHandler(self)


def start_server(pair, api_key: str = API_KEY, max_concurrency: int = 16):
    """(uvicorn server, its thread, base URL): `mlx-spec serve`'s defaults, in this process."""
    from mlx_spec.server.app import Limits, create_app, serve_in_background
    from mlx_spec.server.cache_store import PromptCacheStore
    from mlx_spec.server.worker import GenerationWorker

    target, draft, tokenizer = pair
    worker = GenerationWorker(target, tokenizer, draft, store=PromptCacheStore(2 * 2**30),
                              max_concurrency=max_concurrency)
    return serve_in_background(create_app(worker, MODEL_ID, api_key=api_key, limits=Limits()))


def machine() -> dict:
    import mlx.core as mx

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    blas = ("OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "")
            else "reference (netlib)")
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas,
            "python": platform.python_version()}


def markdown(result: dict, argv: List[str]) -> str:
    m, mem, big = result["machine"], result["memory_mib"], result["big_body_s"]
    lines = [
        "# `mlx-spec serve` under abuse", "",
        f"`python -m bench.studies.serve_abuse {' '.join(argv)}` on {m['cpu']} "
        f"({m['cores']} cores), {m['platform']}, MLX {m['mlx']} on {m['device']} "
        f"(BLAS: {m['blas']}), the shipped pair; the server in the study's process with "
        f"`--api-key`, the default limits and `serve`'s defaults; {result['requests']} requests "
        f"from {result['threads']} threads at once, after {len(result['references'])} reference "
        "answers sent alone.", "",
        "| category | sent | must get | statuses seen | median s | max s | answers equal |",
        "|---|---:|---:|---|---:|---:|---:|"]
    for name, row in sorted(result["categories"].items(),
                            key=lambda kv: (kv[1]["expect"] or 0, kv[0])):
        statuses = ", ".join(f"{s}: {c}" for s, c in sorted(row["statuses"].items()))
        if row["disconnects"]:
            statuses += f" ({row['disconnects']} disconnects)"
        equal = f"{row['matched']}/{row['count']}" if row["expect"] == 200 else ""
        lines.append(f"| {name} | {row['count']} | {row['expect'] or 'none (left)'} | "
                     f"{statuses} | {row['median_s']} | {row['max_s']} | {equal} |")
    h = result["health_after"]
    lines += ["", f"- 5xx answers: {result['server_errors_5xx']}; requests that got another "
              f"status than they must: {result['failures_total']}; errors the server logged: "
              f"{len(result['server_log_errors'])}.",
              f"- 64 MiB body to its 413: median {big['median']} s, max {big['max']} s "
              f"(Content-Length: {big['content_length']} s median; chunked: {big['chunked']} s "
              "median).",
              f"- Resident memory (VmRSS of the process, server and clients): {mem['before']} MiB "
              f"before, {mem['after']} MiB after the abuse, {mem['after_gc']} MiB after a gc "
              f"({mem['after_gc'] - mem['before']:+.1f} MiB); MLX's live arrays (models and "
              f"stored prompt caches) {mem['mlx_active_before']} MiB before, "
              f"{mem['mlx_active_after_gc']} MiB after.",
              f"- `/health` after: status {h['status']}, admitted {h['requests']['admitted']}, "
              f"prompt cache store {h['prompt_cache']['entries']} entries, "
              f"{h['prompt_cache']['bytes'] / MiB:.1f} MiB.",
              f"- Abuse phase: {result['abuse_s']} s wall."]
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="results file name (default: none written)")
    args = ap.parse_args(argv)

    import mlx_spec

    pair = mlx_spec.load_default_pair()
    tokenizer = pair[2]
    server, thread, url = start_server(pair)
    try:
        with ErrorLog() as errors:
            refs = references(url, API_KEY, tokenizer)
            cases = plan(tokenizer, args.requests, args.seed)
            gc.collect()
            before, mlx_before = rss_bytes(), mlx_active_bytes()
            start = time.perf_counter()
            results = run_abuse(url, API_KEY, cases, args.threads)
            abuse_s = time.perf_counter() - start
            after = rss_bytes()
            health_after = health(url, API_KEY)
            gc.collect()
            after_gc, mlx_after = rss_bytes(), mlx_active_bytes()
    finally:
        server.should_exit = True
        thread.join(60)
    table = summarize(results, refs)
    big = {name: [o.seconds for c, o in results if c.category == f"body 64 MiB ({name})"]
           for name in ("Content-Length", "chunked")}
    all_big = big["Content-Length"] + big["chunked"]
    result = {
        "machine": machine(), "requests": len(cases), "threads": args.threads, "seed": args.seed,
        "references": refs, "abuse_s": round(abuse_s, 1), "categories": table,
        "server_errors_5xx": sum(1 for _, o in results if o.status is not None and o.status >= 500),
        "failures_total": sum(len(r["failures"]) for r in table.values()),
        "big_body_s": {"median": round(statistics.median(all_big), 3),
                       "max": round(max(all_big), 3),
                       "content_length": round(statistics.median(big["Content-Length"]), 3),
                       "chunked": round(statistics.median(big["chunked"]), 3)},
        "memory_mib": {"before": round(before / MiB, 1), "after": round(after / MiB, 1),
                       "after_gc": round(after_gc / MiB, 1),
                       "mlx_active_before": round(mlx_before / MiB, 1),
                       "mlx_active_after_gc": round(mlx_after / MiB, 1)},
        "health_after": health_after, "server_log_errors": errors.messages[:20],
    }
    text = markdown(result, argv)
    print(text)
    for name, row in table.items():
        for failure in row["failures"][:5]:
            print(f"FAILED {name}: {failure}", file=sys.stderr)
    if args.out:
        from bench.studies import RESULTS_DIR

        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS_DIR / f"{args.out}.md").write_text(text + "\n")
    ok = (result["failures_total"] == 0 and result["server_errors_5xx"] == 0
          and not errors.messages
          and health_after["requests"]["admitted"] == 0 and health_after["status"] == "ok")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
