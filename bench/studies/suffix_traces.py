"""Suffix drafting on multi-request traces made from the shipped target's own outputs.

    python -m bench.studies.suffix_traces [--tokens 96] [--repeats 3] [--out NAME]
        [--cost-repeats 9] [--traces repeat,agent,edit,fresh] [--index-tokens 1000000]

A trace is a list of requests (prompt strings) sent in order to one app. Four,
on the shipped pair (greedy, float16):

- repeat: distinct code prompts, then each asked again. The second pass is
  measured: its answers repeat earlier answers that are not in its prompts.
- agent: an agent loop. Every request holds the same tool definitions, the
  previous tool call as the app recorded it (the target's own previous
  output with one field changed) and ends at the opening of the next JSON
  tool call. All but the first are measured.
- edit: the target writes functions; later requests show each one with one
  line changed and ask for it again. The re-emitting requests are measured.
- fresh: distinct prompts, nothing to reuse across them (the cost check).

Configurations, each with the API's defaults otherwise: plain (the target
alone, prompt_lookup=False), lookup (prompt_lookup=True), suffix (suffix= an
index), draft (draft_model= the shipped draft model) and suffix+draft (both).
What the defaults put behind the index (prompt lookup at temp 0 since commit
3f510f8, nothing before) is the package's choice, recorded by the commit in
the results. Each suffix configuration starts every trace on a
new, empty index and sends the trace's requests in order, so the first
requests fill it. Requests are interleaved across configurations (the order
reverses every other repeat) and every configuration's text must equal the
others' (greedy speculation is exact; the study exits with an error if not).
Decode speed of a trace = its measured requests' tokens over their decode
seconds (each request's generation_tokens / generation_tps: prefill
excluded); ratios are taken within a repeat, then the median over repeats
(the fresh trace runs --cost-repeats times: its bar is a 2% one). Tokens per
pass = generated tokens / target passes (speculative rounds and plain steps;
plain decoding is 1.0); drafted per round and the share accepted say how wide
the verify passes were.

The index's memory: tracemalloc while a SuffixIndex is filled with Python
standard-library source tokenized by the shipped tokenizer (in 2,048-token
requests), and with uniform random token ids (no repetition: the worst
case); then microseconds per added token, per add once the budget is full
(each add evicts), and per lookup (longest + follow, k as SuffixDrafter asks)
at held-out contexts. Writes bench/results/<out>.json and .md with --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import sysconfig
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import numpy as np

import mlx_spec
from mlx_spec.bench.machine import blas_library
from mlx_spec.bench.prompts import PROMPTS
from mlx_spec.bench.timing import median
from mlx_spec.drafters.suffix import LENGTH_PER_MATCHED_TOKEN
from . import RESULTS_DIR

CONFIGS = ("plain", "lookup", "suffix", "draft", "suffix+draft")
TRACES = ("repeat", "agent", "edit", "fresh")
# (trace, numerator, denominator, the bar or None)
RATIOS = (("repeat", "suffix", "plain", 2.5), ("repeat", "suffix", "lookup", 1.5),
          ("repeat", "suffix+draft", "draft", None), ("repeat", "suffix+draft", "plain", None),
          ("agent", "suffix", "lookup", None), ("agent", "suffix+draft", "draft", None),
          ("edit", "suffix", "lookup", None), ("edit", "suffix+draft", "draft", None),
          ("fresh", "suffix", "lookup", 0.98), ("fresh", "suffix+draft", "draft", 0.98),
          ("fresh", "suffix", "plain", None))

_BY_NAME = {p.name: p.text for p in PROMPTS}
REPEAT_PROMPTS = (
    _BY_NAME["fibonacci"], _BY_NAME["class_init"], _BY_NAME["parse_args"],
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """Run the command line interface."""\n'
    "    if argv is None:\n        argv = sys.argv[1:]\n",
)
AGENT_STEM = ('import json\n\n\ndef call_tool(call):\n'
              '    """Run one tool call (a JSON object) and return its result."""\n'
              '    return TOOLS[call["name"]](**call["arguments"])\n\n\n')
AGENT_OPEN = 'call = {"name": "'
AGENT_FIRST = 'read_file", "arguments": {"path": "setup.py", "line": 1}}'
AGENT_TURNS = 4
AGENT_FIELDS = ("write_file", "tests/test_io.py", "run_tests", "README.md", "src/main.py")
EDIT_PROMPTS = (
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self, maxsize=0):\n"
    "        self.maxsize = maxsize\n        self.queue = []\n\n    def put(self, item):\n",
    "class TestPath(unittest.TestCase):\n\n    def test_join(self):\n"
    "        self.assertEqual(os.path.join('a', 'b'), 'a/b')\n\n    def test_split(self):\n",
)
EDIT_AGAIN = "\n\n# The same code again, with that change kept:\n"
FRESH_PROMPTS = (_BY_NAME["rename"], _BY_NAME["repeat_list"], _BY_NAME["story"], _BY_NAME["explain"])


@dataclass
class Trace:
    name: str
    prompts: List[str]
    first_measured: int  # requests before it only fill the index


@dataclass
class Run:
    text: str
    tokens: int
    seconds: float  # decode only
    passes: int  # target forwards after the prefill's: speculative rounds + plain steps
    rounds: int  # of them, speculative rounds
    drafted: int
    accepted: int
    by_source: Dict[str, int]


def generate(target, tokenizer, prompt: str, tokens: int, kwargs) -> Run:
    text, last = "", None
    for last in mlx_spec.stream_generate(target, tokenizer, prompt, max_tokens=tokens,
                                         calibration=None, **kwargs):
        text += last.text
    s = last.stats
    return Run(text, s.generation_tokens, s.generation_tokens / s.generation_tps,
               s.rounds + s.plain_steps, s.rounds, s.drafted, s.accepted, dict(s.accepted_by_source))


def configurations(draft) -> Dict[str, dict]:
    """Keyword arguments per configuration; "suffix" marks where a new index goes."""
    return {"plain": dict(prompt_lookup=False), "lookup": dict(prompt_lookup=True),
            "suffix": dict(suffix="new"), "draft": dict(draft_model=draft),
            "suffix+draft": dict(draft_model=draft, suffix="new")}


# --- the traces ---

def change_field(call: str, turn: int) -> str:
    """The call line with its first field's value (the second quoted string, else the first
    name after the opening) changed: the app records the call it ran."""
    value = AGENT_FIELDS[turn % len(AGENT_FIELDS)]
    quoted = list(re.finditer(r'"[^"\n]*"', call))
    if len(quoted) >= 2:
        q = quoted[1]
        return call[:q.start()] + f'"{value}"' + call[q.end():]
    head = len(AGENT_OPEN)
    return call[:head] + re.sub(r"[A-Za-z_]\w+", value.replace("/", "_").replace(".", "_"),
                                call[head:], count=1)


def change_line(code: str) -> str:
    """The code with one line (the middle non-blank one) changed: its first name renamed."""
    lines = code.split("\n")
    candidates = [i for i, line in enumerate(lines) if re.search(r"[A-Za-z_]\w+", line)]
    if not candidates:
        return code + "\n# edited"
    i = candidates[len(candidates) // 2]
    lines[i] = re.sub(r"([A-Za-z_]\w+)", r"\1_edited", lines[i], count=1)
    return "\n".join(lines)


def build_traces(target, tokenizer, tokens: int, names) -> List[Trace]:
    """The traces; agent and edit are built from the target's own outputs (prompt lookup
    decodes them: exact, and checked again against every configuration)."""
    def answer(prompt):
        return generate(target, tokenizer, prompt, tokens, dict(prompt_lookup=True)).text

    traces = []
    if "repeat" in names:
        traces.append(Trace("repeat", list(REPEAT_PROMPTS) * 2, len(REPEAT_PROMPTS)))
    if "agent" in names:
        prompts, last_call = [], AGENT_OPEN + AGENT_FIRST
        for turn in range(AGENT_TURNS):
            prompts.append(AGENT_STEM + last_call + "\nresult = call_tool(call)\n" + AGENT_OPEN)
            if turn + 1 < AGENT_TURNS:  # the call the target just made, one field changed
                last_call = change_field(AGENT_OPEN + answer(prompts[-1]).split("\n")[0], turn)
        traces.append(Trace("agent", prompts, 1))
    if "edit" in names:
        edited = [p + change_line(answer(p)) for p in EDIT_PROMPTS]
        again = [e + EDIT_AGAIN + p for e, p in zip(edited, EDIT_PROMPTS)]
        traces.append(Trace("edit", list(EDIT_PROMPTS) + again, len(EDIT_PROMPTS)))
    if "fresh" in names:
        traces.append(Trace("fresh", list(FRESH_PROMPTS), 0))
    return traces


def run_trace(target, draft, tokenizer, trace: Trace, tokens: int, reverse: bool):
    """Every configuration's Runs of the trace, requests interleaved across configurations."""
    configs = configurations(draft)
    order = list(reversed(CONFIGS)) if reverse else list(CONFIGS)
    indexes = {c: mlx_spec.SuffixIndex() for c in CONFIGS if configs[c].get("suffix")}
    runs: Dict[str, List[Run]] = {c: [] for c in CONFIGS}
    for i, prompt in enumerate(trace.prompts):
        for c in order:
            kwargs = dict(configs[c])
            if "suffix" in kwargs:
                kwargs["suffix"] = indexes[c]
            runs[c].append(generate(target, tokenizer, prompt, tokens, kwargs))
        texts = {c: runs[c][i].text for c in CONFIGS}
        if len(set(texts.values())) != 1:
            raise SystemExit(f"NOT EXACT: {trace.name} request {i + 1} differs across "
                             f"configurations: {json.dumps(texts, indent=1)}")
    return runs


def aggregate(runs: List[Run]) -> dict:
    tokens = sum(r.tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    drafted, rounds = sum(r.drafted for r in runs), sum(r.rounds for r in runs)
    by_source: Dict[str, int] = {}
    for r in runs:
        for s, n in r.by_source.items():
            by_source[s] = by_source.get(s, 0) + n
    return {"tokens": tokens, "tokens_per_s": tokens / seconds,
            "tokens_per_pass": tokens / sum(r.passes for r in runs),
            "drafted_per_round": drafted / rounds if rounds else 0.0,
            "acceptance": sum(r.accepted for r in runs) / drafted if drafted else 0.0,
            "accepted_by_source": by_source}


# --- the index's memory and speed ---

def stdlib_sequences(tokenizer, length: int = 2048):
    """The standard library's source, tokenized, in `length`-token requests (a generator)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        for start in range(0, len(ids), length):
            yield ids[start:start + length]


def index_cost(sequences: List[List[int]], held_out: List[List[int]], lookups: int, seed: int):
    """Bytes per token under tracemalloc, then add and lookup times (no tracing)."""
    arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    total = sum(len(a) for a in arrays)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = mlx_spec.SuffixIndex(max_tokens=total + 1)
    for a in arrays:
        index.add(a.tolist())  # fresh int objects, as from a tokenizer
    gc.collect()
    held_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    gc.collect()

    index = mlx_spec.SuffixIndex(max_tokens=total + 1)
    start = time.perf_counter()
    for a in arrays:
        index.add(a.tolist())
    add_s = time.perf_counter() - start
    rng = random.Random(seed)
    times, matched = [], []
    for _ in range(lookups):
        seq = rng.choice(held_out)
        context = seq[:rng.randrange(8, len(seq))]
        t0 = time.perf_counter()  # as SuffixDrafter.lookup does it, without joining the index
        match = index.longest(context)
        if match.length:
            index.follow(match, context, min(8, math.ceil(LENGTH_PER_MATCHED_TOKEN * match.length)))
        times.append(time.perf_counter() - t0)
        matched.append(match.length)
    # Full budget: every add evicts least recently used requests first.
    full = mlx_spec.SuffixIndex(max_tokens=total // 2)
    for a in arrays[:len(arrays) // 2]:
        full.add(a.tolist())
    rest = arrays[len(arrays) // 2:]
    start = time.perf_counter()
    for a in rest:
        full.add(a.tolist())
    evict_s = time.perf_counter() - start
    times.sort()
    return {"tokens": total, "requests": len(arrays), "bytes_per_token": round(held_bytes / total, 1),
            "mb_per_million_tokens": round(held_bytes / total, 1),  # bytes/token == MB per 1e6
            "add_us_per_token": round(add_s / total * 1e6, 2),
            "add_us_per_token_evicting": round(evict_s / sum(len(a) for a in rest) * 1e6, 2),
            "lookup_us_median": round(times[len(times) // 2] * 1e6, 1),
            "lookup_us_p90": round(times[int(len(times) * 0.9)] * 1e6, 1),
            "lookup_median_match": median(matched), "lookups": lookups}


def index_costs(tokenizer, total: int, vocab: int) -> dict:
    code, held = [], 0
    chunks = stdlib_sequences(tokenizer)
    for chunk in chunks:
        code.append(chunk)
        held += len(chunk)
        if held >= total:
            break
    held_out = [c for c, _ in zip((c for c in chunks if len(c) >= 64), range(64))]  # never filed
    rng = np.random.default_rng(0)
    uniform = [rng.integers(0, vocab, 2048).tolist() for _ in range(max(1, total // 2048))]
    return {"stdlib code": index_cost(code, held_out, 2000, 0),
            "uniform random ids": index_cost(uniform, held_out, 2000, 0)}


def source_version() -> str:
    """The commit the package was imported from, and the files of mlx_spec/ that differ from
    it: the working tree is shared while other work goes on."""
    root = Path(mlx_spec.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", str(root)], cwd=root,
                                text=True, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    changed = [line[3:] for line in status.splitlines()]
    return commit + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


# --- the report ---

def summarise(per_repeat, traces: List[Trace]) -> dict:
    """Medians over repeats per trace and configuration, and the paired ratios."""
    out = {}
    for trace in traces:
        rows = {}
        for part, lo, hi in (("measured", trace.first_measured, None),
                             ("filling", 0, trace.first_measured)):
            if hi == 0:
                continue
            aggs = {c: [aggregate(rep[trace.name][c][lo:hi]) for rep in per_repeat
                        if trace.name in rep] for c in CONFIGS}
            rows[part] = {c: {"tokens_per_s": round(median([a["tokens_per_s"] for a in aggs[c]]), 1),
                              "tokens_per_s_repeats": [round(a["tokens_per_s"], 1) for a in aggs[c]],
                              "tokens_per_pass": round(median([a["tokens_per_pass"] for a in aggs[c]]), 2),
                              "drafted_per_round": round(median([a["drafted_per_round"] for a in aggs[c]]), 2),
                              "acceptance": round(median([a["acceptance"] for a in aggs[c]]), 3),
                              "tokens": aggs[c][0]["tokens"],
                              "accepted_by_source": aggs[c][0]["accepted_by_source"]}
                          for c in CONFIGS}
            rows[part + "_ratios"] = {}
            for num in CONFIGS:
                for den in CONFIGS:
                    if num != den:
                        r = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(aggs[num], aggs[den])]
                        rows[part + "_ratios"][f"{num}/{den}"] = {
                            "median": round(median(r), 3), "range": [round(min(r), 3), round(max(r), 3)]}
        first = per_repeat[0][trace.name]
        rows["requests"] = [{"prompt": p, "output": first["plain"][i].text,
                             "measured": i >= trace.first_measured,
                             "tokens_per_pass": {c: round(first[c][i].tokens / first[c][i].passes, 2)
                                                 for c in CONFIGS}}
                            for i, p in enumerate(trace.prompts)]
        rows["repeats"] = sum(1 for rep in per_repeat if trace.name in rep)
        out[trace.name] = rows
    return out


def render(result: dict, argv) -> str:
    blas = result["blas_label"]
    lines = [f"# Suffix drafting on multi-request traces ({blas})", "",
             f"{result['machine']}, MLX {result['mlx']}, mlx-spec {result['source']}, BLAS library "
             f"loaded: {result['blas']}; shipped "
             f"pair (float16), greedy, {result['tokens']} tokens per request, repeats "
             f"{', '.join(f'{t} {n}' for t, n in result['repeats'].items())}; `python -m bench.studies.suffix_traces {' '.join(argv)}`"
             + (" with OpenBLAS preloaded" if "OpenBLAS" in blas else "") + ".", "",
             "Requests interleaved across configurations (order reversed every other repeat), "
             "every suffix configuration on a new index per trace; all five configurations gave "
             "the same text for every request (checked). Decode tokens/s = the measured requests' "
             "tokens / their decode seconds (prefill excluded), median over repeats; ratios are "
             "paired within a repeat, median (range). This 2-core machine was shared with other "
             "work (tests) during the run, so absolute tokens/s are noisy; the interleaved ratios "
             "and tokens per pass are what count. Tokens per pass = generated tokens / target "
             "passes (plain = 1.00); it depends on timing only through the adaptive k.", "",
             "| trace (measured requests) | plain | lookup | suffix | draft | suffix+draft |",
             "|---|---|---|---|---|---|"]
    for name, rows in result["traces"].items():
        for part in ("measured", "filling"):
            if part not in rows:
                continue
            n = sum(1 for r in rows["requests"] if r["measured"] == (part == "measured"))
            label = f"{name}, {'first pass' if part == 'filling' else 'measured'} ({n})"
            cells = [f"{rows[part][c]['tokens_per_s']} tok/s, {rows[part][c]['tokens_per_pass']:.2f}/pass"
                     for c in CONFIGS]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| trace | ratio (tokens/s) | median | range | the issue's bar |", "|---|---|---|---|---|"]
    for name, num, den, bar in RATIOS:
        if name not in result["traces"]:
            continue
        r = result["traces"][name]["measured_ratios"][f"{num}/{den}"]
        verdict = "-" if bar is None else f">= {bar}x: {'met' if r['median'] >= bar else 'NOT met'}"
        lines.append(f"| {name} | {num} / {den} | {r['median']:.2f}x | {r['range'][0]:.2f}-"
                     f"{r['range'][1]:.2f} | {verdict} |")
    lines += ["", "Drafts of the measured requests: tokens drafted per speculative round / share "
              "accepted (medians over repeats):", "",
              "| trace | " + " | ".join(CONFIGS[1:]) + " |", "|---|---|---|---|---|"]
    for name, rows in result["traces"].items():
        m = rows["measured"]
        lines.append(f"| {name} | " + " | ".join(
            f"{m[c]['drafted_per_round']:.1f} / {m[c]['acceptance']:.2f}" for c in CONFIGS[1:]) + " |")
    lines += ["", "Accepted tokens by source (measured requests, first repeat):", ""]
    for name, rows in result["traces"].items():
        parts = [f"{c}: {rows['measured'][c]['accepted_by_source'] or '-'}" for c in CONFIGS[1:]]
        lines.append(f"- {name}: " + "; ".join(parts))
    lines += ["", "## What the target emits", "",
              "The shipped target is a toy trained on the standard library's code: it drifts into "
              "loops within a few dozen tokens, which prompt lookup already drafts well. First "
              "line of each request's output (first repeat) and tokens per pass for lookup / "
              "suffix / suffix+draft:", ""]
    for name, rows in result["traces"].items():
        lines.append(f"- {name}:")
        for i, r in enumerate(rows["requests"]):
            head = r["output"].strip("\n").split("\n")[0][:70]
            tpp = r["tokens_per_pass"]
            lines.append(f"  - {i + 1}{'' if r['measured'] else ' (fills)'}: `{head}` "
                         f"({tpp['lookup']} / {tpp['suffix']} / {tpp['suffix+draft']})")
    if result.get("index"):
        lines += ["", "## The index's memory and speed", "",
                  "tracemalloc over `SuffixIndex.add` of 2,048-token requests (the token lists' "
                  "int objects included), then timed without tracing: adds below the budget, adds "
                  "with the budget full (each evicts), and lookups (`longest` + `follow`, k = min(8, 2 x match) as "
                  "SuffixDrafter asks) at random cut points of held-out standard-library files.", "",
                  "| tokens filed | bytes per token (MB per 1M tokens) | add, us/token | add when "
                  "evicting, us/token | lookup median, us | lookup p90, us | median match |",
                  "|---|---|---|---|---|---|---|"]
        for kind, r in result["index"].items():
            lines.append(f"| {r['tokens']:,} ({kind}) | {r['bytes_per_token']:.0f} | "
                         f"{r['add_us_per_token']} | {r['add_us_per_token_evicting']} | "
                         f"{r['lookup_us_median']} | {r['lookup_us_p90']} | {r['lookup_median_match']} |")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=96, help="max_tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cost-repeats", type=int, default=None,
                    help="repeats of the fresh trace, whose bar (0.98x) is finer than the "
                         "others' (default: 3 x --repeats)")
    ap.add_argument("--traces", default=",".join(TRACES), help="comma-separated: " + ", ".join(TRACES))
    ap.add_argument("--index-tokens", type=int, default=1_000_000,
                    help="tokens to fill the index with for the memory measure (0: skip it)")
    ap.add_argument("--out", default=None, help="results file name (default: none written)")
    args = ap.parse_args(argv)
    names = [t.strip() for t in args.traces.split(",")]
    unknown = set(names) - set(TRACES)
    if unknown:
        ap.error(f"unknown trace(s) {sorted(unknown)}; choose from {', '.join(TRACES)}")
    blas = blas_library()
    blas_label = "OpenBLAS" if "openblas" in blas.lower() else "reference BLAS (netlib)"
    source = source_version()  # before anything runs: what was imported
    target, draft, tokenizer = mlx_spec.load_default_pair()
    started = time.perf_counter()
    for kwargs in configurations(draft).values():  # warm up every path
        if "suffix" in kwargs:
            kwargs["suffix"] = mlx_spec.SuffixIndex()
        generate(target, tokenizer, REPEAT_PROMPTS[0], 16, kwargs)
    traces = build_traces(target, tokenizer, args.tokens, names)
    cost_repeats = 3 * args.repeats if args.cost_repeats is None else args.cost_repeats
    repeats_of = {t.name: cost_repeats if t.name == "fresh" else args.repeats for t in traces}
    per_repeat = []
    for rep in range(max(repeats_of.values())):
        runs = {}
        for trace in traces:
            if rep >= repeats_of[trace.name]:
                continue
            runs[trace.name] = run_trace(target, draft, tokenizer, trace, args.tokens, reverse=rep % 2 == 1)
            m = {c: aggregate(runs[trace.name][c][trace.first_measured:]) for c in CONFIGS}
            print(f"repeat {rep + 1} {trace.name}: " + ", ".join(
                f"{c} {m[c]['tokens_per_s']:.1f} tok/s {m[c]['tokens_per_pass']:.2f}/pass" for c in CONFIGS),
                flush=True)
        per_repeat.append(runs)
    decode_minutes = (time.perf_counter() - started) / 60
    result = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "blas": blas,
              "blas_label": blas_label, "source": source, "mlx": mx.__version__, "python": platform.python_version(),
              "pair": "shipped (float16)", "greedy": True, "calibration": None,
              "tokens": args.tokens, "repeats": repeats_of, "argv": argv,
              "minutes_decoding": round(decode_minutes, 1),
              "traces": summarise(per_repeat, traces), "index": None}
    if args.index_tokens:
        result["index"] = index_costs(tokenizer, args.index_tokens, tokenizer.vocab_size)
    text = render(result, argv)
    print(text)
    if args.out:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS_DIR / f"{args.out}.md").write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
