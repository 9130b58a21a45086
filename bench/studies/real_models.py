"""Real models with no draft: is mlx-spec's default (prompt lookup on) ever behind plain decoding or
mlx-lm, and how much faster is it on replies that quote their prompt?

Run from the repository root, the models in $MLX_SPEC_REAL_MODELS or
~/.cache/mlx-spec/real-models (`make real-models`):

    python -m bench.studies.real_models                    # both models, netlib (the default BLAS)
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python -m bench.studies.real_models                # the same with OpenBLAS
    python -m bench.studies.real_models --dequantize       # every matrix in float32 (the BLAS's)
    python -m bench.studies.real_models --models smollm2 --repeats 1 --tokens 8 --out NAME  # smoke

Writes bench/results/real-models-[f32-]<blas>.json and .md (--out another name); progress on
stderr. Time: the prefill dominates on a CPU, where MLX's quantized products cost as much per
token in a prompt as in a decoding step (SmolLM2 Q4_1 on the 2-core x86, a busy machine: 113-130
ms a token for a forward of 1, 4 or 16 tokens alike), and each of a model's 48 timed runs (2
sets x 2 T x 3 methods x 4 repeats) and 3 warm-ups prefills its prompt.

Each model is loaded once by `mlx_spec.load` (the GGUF file converted as the loader does by
default: quantized matrices stay quantized, the rest float32 on the CPU; with --dequantize
every matrix in float32) and decoded three ways, interleaved
(`endtoend.interleave`: every method once per repeat on the same prompt and the
same random seed, the order reversed every other repeat):
- plain: mlx-spec's `stream_generate` with no drafter (`prompt_lookup=False`);
- mlx-lm: mlx-lm's own `stream_generate` on the same loaded weights and tokenizer;
- defaults: mlx-spec's `stream_generate` as `mlx-spec generate --model X` runs it on a
  machine that never ran `mlx-spec tune` (prompt lookup on, the adaptive policy, no
  calibration).
Two prompt sets per model: "quote", replies that quote their prompt (SmolLM2, a chat model,
through its chat template: summarise a passage, extract fields, edit a code snippet, answer
from a passage; Gemma-3-270M, a base model, plain-text completions that copy: repeat a text,
a list and code with repeated structure, a passage's answer), and "open", open-ended
prompts. Greedy and T = 0.7. A repeat runs the set's next prompt; 4 repeats run each once.

Timing: each run from the end of its first round (the prefill's; mlx-lm's first token) to its
last token (`timing.time_after_prefill`), so a lookup round right after the prefill gives no
token for free; replies end at the model's end-of-turn token as `generate` does. A ratio is
the median of the per-repeat ratios (same prompt, same seed) with its distribution-free
interval (never_behind.paired_ratio). Greedy, the three replies must be the same text: the
table says in how many repeats they were.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterable, Iterator, List

from . import RESULTS_DIR, parse_temps, study_header, write_results
from .never_behind import blas_slug, paired_ratio

MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
PLAIN, MLX_LM, DEFAULTS = "plain", "mlx-lm", "defaults"
SETS = ("quote", "open")
DEFAULT_TEMPS = "0,0.7"

PASSAGE = (  # short: on a CPU a quantized model prefills a prompt token about as slowly as a step
    "The lighthouse at Point Carra was built in 1871. Its first keeper, Thomas Wren, kept the "
    "lamp burning for thirty-one years and recorded every passing ship in a logbook. In 1923 "
    "the oil lamp was replaced by an electric light, and in 1968 the station was automated. "
    "The logbooks are now kept at the county museum, where historians study them.")
RECORD = (
    "Payment received on 14 March 2024 from Margaret Okafor, account number 5521-0087-3349, "
    "for the sum of 1,250.00 euros, reference invoice INV-20931. The payment was made by bank "
    "transfer from Lisbon and cleared on 16 March 2024.")
CODE = (
    "def average(values):\n"
    "    total = 0\n"
    "    count = 0\n"
    "    for value in values:\n"
    "        total = total + value\n"
    "        count = count + 1\n"
    "    if count == 0:\n"
    "        return 0\n"
    "    return total / count\n")
ACCESSORS = (
    "class Person:\n"
    "    def get_name(self):\n        return self._name\n\n"
    "    def set_name(self, value):\n        self._name = value\n\n"
    "    def get_age(self):\n        return self._age\n\n"
    "    def set_age(self, value):\n        self._age = value\n\n"
    "    def get_email(self):\n        return self._email\n\n"
    "    def set_email(self, value):\n        self._email = value\n\n"
    "    def get_phone(self):\n")

CHAT = {  # through the chat template
    "quote": [
        ("summarise", "Summarise the following passage in three sentences, keeping its own "
                      f"wording where you can.\n\n{PASSAGE}"),
        ("extract", "Extract the payer, the date received, the account number, the amount and "
                    f"the reference from this text, one 'field: value' line each.\n\n{RECORD}"),
        ("edit code", "Rename the variable `total` to `running_sum` in this Python function "
                      f"and give the whole function back.\n\n```python\n{CODE}```"),
        ("answer", f"Read the passage, then answer the question by quoting the sentences that "
                   f"answer it.\n\nPassage: {PASSAGE}\n\nQuestion: What happened to the "
                   "lighthouse's lamp and its keepers in the twentieth century?"),
    ],
    "open": [
        ("poem", "Write a short poem about the sea at night."),
        ("tips", "Give me some advice for learning to play the guitar as an adult."),
        ("explain", "Explain why the sky is blue to a ten-year-old."),
        ("story", "Tell a short story about a robot who learns to bake bread."),
    ],
}
BASE = {  # plain-text completions
    "quote": [
        ("repeat", f"Repeat the following text exactly.\n\nText: {PASSAGE}\n\nRepeated text: "
                   "The lighthouse"),
        ("accessors", ACCESSORS),
        ("table", "name,city,country,population\nLisbon,Lisbon,Portugal,545000\n"
                  "Porto,Porto,Portugal,232000\nMadrid,Madrid,Spain,3300000\n"
                  "Seville,Seville,Spain,684000\nLyon,Lyon,France,516000\n"
                  "Marseille,Marseille,France,873000\nThe same table with the population in "
                  "thousands:\nname,city,country,population\nLisbon,Lisbon,Portugal,545\n"),
        ("answer", f"{PASSAGE}\n\nQuestion: Where are the logbooks kept, and who uses them?\n"
                   "Answer, quoting the text:"),
    ],
    "open": [
        ("village", "Once upon a time, in a small village by the mountains,"),
        ("printing", "The invention of the printing press changed Europe because"),
        ("market", "Every morning the market square fills with"),
        ("inventions", "The three most important inventions of the twentieth century are"),
    ],
}


def models_root() -> Path:
    return Path(os.environ.get("MLX_SPEC_REAL_MODELS")
                or "~/.cache/mlx-spec/real-models").expanduser()


def prompts_for(tokenizer, name: str, kind: str) -> List[tuple]:
    """(name, text) of a set: SmolLM2's through its chat template, Gemma's as they are."""
    if name != "smollm2":
        return list(BASE[kind])
    return [(title, tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                  tokenize=False, add_generation_prompt=True))
            for title, text in CHAT[kind]]


def as_rounds(responses: Iterable, seen: List[int], last: list) -> Iterator[SimpleNamespace]:
    """Streamed responses as time_after_prefill reads rounds, each the moment it arrives: a
    response is a round of its one token, except the first round's later tokens, which count
    none (that round carries the prefill and is not timed; mlx-spec's tokens of one round share
    their stats' pass count, mlx-lm's responses have no stats: one token a round). `seen` gets
    every token, `last` the last response."""
    first = None
    for response in responses:
        stats = getattr(response, "stats", None)
        passes = None if stats is None else stats.rounds + stats.plain_steps
        later_in_first = bool(seen) and passes is not None and passes == first
        if not seen:
            first = passes
        seen.append(response.token)
        last[:] = [response]
        yield SimpleNamespace(tokens=[] if later_in_first else [response.token],
                              num_drafted=0, num_accepted=0)


def measure_model(name: str, path: Path, kinds, temps, repeats: int, tokens: int, seed: int,
                  progress, dequantize: bool = False) -> dict:
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import mlx_spec
    from mlx_spec.bench.endtoend import RunResult, interleave
    from mlx_spec.bench.timing import time_after_prefill
    from mlx_spec.loading import gguf_report

    started = time.perf_counter()
    model, tokenizer = mlx_spec.load(str(path), **(
        {"dequantize": True, "dtype": "float32"} if dequantize else {}))
    loaded = time.perf_counter() - started
    report = gguf_report(model)
    logs: Dict[str, list] = {}

    def run(method: str, temp: float, text: str) -> RunResult:
        if method == MLX_LM:
            stream = mlx_lm.stream_generate(model, tokenizer, text, max_tokens=tokens,
                                            sampler=make_sampler(temp))
        else:
            options = {"prompt_lookup": False} if method == PLAIN else {"calibration": None}
            stream = mlx_spec.stream_generate(model, tokenizer, text, max_tokens=tokens,
                                              temp=temp, **options)
        seen, last = [], []
        decoded = time_after_prefill(as_rounds(stream, seen, last))
        stats = getattr(last[0], "stats", None)
        logs.setdefault(method, []).append((seen, stats))
        drafted, accepted = (stats.drafted, stats.accepted) if stats is not None else (0, 0)
        return RunResult(decoded.seconds, decoded.tokens, drafted, accepted)

    for method in (PLAIN, MLX_LM, DEFAULTS):  # every path compiled and warm before timing
        run(method, 0.0, prompts_for(tokenizer, name, "open")[0][1])
    rows = []
    for kind in kinds:
        prompts = prompts_for(tokenizer, name, kind)
        for temp in temps:
            logs.clear()
            methods = {m: (lambda text, m=m, temp=temp: run(m, temp, text))
                       for m in (PLAIN, MLX_LM, DEFAULTS)}
            results = interleave(methods, prompts, repeats=repeats, warmup=0, seed=seed,
                                 progress=lambda message: progress(
                                     f"{name} {kind} T={temp:g}: {message}"))
            rows.append(cell(name, kind, temp, prompts, repeats, results, logs, tokenizer))
    return {"model": name, "file": path.name, "load_seconds": round(loaded, 1),
            "conversion": report.summary() if report is not None else None,
            "seconds": round(time.perf_counter() - started, 1), "rows": rows}


def cell(name, kind, temp, prompts, repeats, results, logs, tokenizer) -> dict:
    """One (model, set, T) row: tokens/s, paired ratios, and what the defaults drafted."""
    from mlx_spec.bench.endtoend import prompt_index

    ratio = {f"{a} / {b}": paired_ratio(results[a], results[b])
             for a, b in ((DEFAULTS, PLAIN), (DEFAULTS, MLX_LM), (PLAIN, MLX_LM))}
    defaults = [stats for _, stats in logs[DEFAULTS]]
    generated = sum(s.generation_tokens for s in defaults)
    passes = sum(s.rounds + s.plain_steps for s in defaults)
    drafted, accepted = sum(s.drafted for s in defaults), sum(s.accepted for s in defaults)
    lookup = sum(s.accepted_by_source.get("lookup", 0) for s in defaults)
    same = [logs[PLAIN][r][0] == logs[MLX_LM][r][0] == logs[DEFAULTS][r][0]
            for r in range(repeats)]
    return {
        "model": name, "set": kind, "temp": temp,
        "prompts": [prompts[prompt_index(r, len(prompts))][0] for r in range(repeats)],
        "prompt_tokens": [len(tokenizer.encode(prompts[prompt_index(r, len(prompts))][1]))
                          for r in range(repeats)],
        "reply_tokens": {m: [len(seen) for seen, _ in log] for m, log in logs.items()},
        "methods": {m: dataclasses.asdict(r) for m, r in results.items()},
        "ratios": {k: dataclasses.asdict(v) if v is not None else None for k, v in ratio.items()},
        "defaults_tokens_per_pass": round(generated / passes, 3) if passes else None,
        "defaults_acceptance": round(accepted / drafted, 3) if drafted else None,
        "defaults_drafted": drafted,
        "defaults_lookup_share": round(lookup / generated, 3) if generated else None,
        "same_text": sum(same) if temp == 0 else None,
    }


def _x(r) -> str:
    return "-" if r is None else f"{r['value']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"


def markdown(header: dict, models: list) -> str:
    out = ["# Real models, no draft: mlx-spec's defaults against plain decoding and mlx-lm", "",
           f"`{header['command']}`", "", f"Machine: {header['machine']}; {header['blas']}; "
           f"weights {'dequantized to float32' if header['dequantized'] else 'as loaded'}.",
           f"{header['repeats']} repeats per row (a repeat: the set's next prompt, every method "
           f"on it with the same seed, interleaved), up to {header['tokens']} tokens, timed "
           "from the end of the first round. Ratios: median of the per-repeat ratios "
           "(interval).", ""]
    for m in models:
        out.append(f"- {m['model']}: {m['conversion']}; loaded in {m['load_seconds']} s, "
                   f"measured in {m['seconds']:.0f} s.")
    out += ["", "| model | set | T | plain tok/s | mlx-lm tok/s | defaults tok/s | defaults ÷ "
            "plain | defaults ÷ mlx-lm | plain ÷ mlx-lm | tokens per pass | acceptance | "
            "from lookup | same text |", "|" + "---|" * 13]
    for m in models:
        for r in m["rows"]:
            tps = {k: f"{v['tokens_per_s']:.1f}" for k, v in r["methods"].items()}
            acceptance = r["defaults_acceptance"]
            same = "-" if r["same_text"] is None else f"{r['same_text']}/{len(r['prompts'])}"
            out.append(
                f"| {r['model']} | {r['set']} | {r['temp']:g} | {tps[PLAIN]} | {tps[MLX_LM]} | "
                f"{tps[DEFAULTS]} | {_x(r['ratios'][f'{DEFAULTS} / {PLAIN}'])} | "
                f"{_x(r['ratios'][f'{DEFAULTS} / {MLX_LM}'])} | "
                f"{_x(r['ratios'][f'{PLAIN} / {MLX_LM}'])} | {r['defaults_tokens_per_pass']} | "
                f"{'-' if acceptance is None else f'{acceptance:.2f}'} | "
                f"{r['defaults_lookup_share']:.0%} | {same} |")
    return "\n".join(out) + "\n"


def blas_line() -> str:
    """The BLAS MLX loaded (read from the process's mapped libraries) and how it was chosen."""
    from mlx_spec.bench.machine import blas_library

    chosen = ", ".join(f"{k}={os.environ[k]}" for k in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS")
                       if k in os.environ)
    return f"BLAS loaded: {blas_library()}" + (f" ({chosen})" if chosen else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="of " + ", ".join(MODELS))
    parser.add_argument("--sets", default=",".join(SETS), help="of " + ", ".join(SETS))
    parser.add_argument("--temps", default=DEFAULT_TEMPS)
    parser.add_argument("--repeats", type=int, default=4,
                        help="timed runs of each method per model, set and T")
    parser.add_argument("--tokens", type=int, default=64, help="max tokens per reply")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dequantize", action="store_true",
                        help="load every matrix dequantized to float32 (products through the BLAS)")
    parser.add_argument("--out", default=None, help="results name (default real-models-<blas>)")
    args = parser.parse_args(argv)
    names, kinds = args.models.split(","), args.sets.split(",")
    for given, known, what in ((names, MODELS, "model"), (kinds, SETS, "set")):
        unknown = [n for n in given if n not in known]
        if unknown:
            parser.error(f"unknown {what} {unknown[0]!r}; choose from {', '.join(known)}.")
    temps = parse_temps(parser, args.temps)
    if args.repeats < 1 or args.tokens < 2:
        parser.error("--repeats must be >= 1 and --tokens >= 2 (the first round is not timed).")
    root = models_root()
    missing = [MODELS[n] for n in names if not (root / MODELS[n]).is_file()]
    if missing:
        parser.error(f"{missing[0]} is not in {root}; run `make real-models` first.")
    blas = blas_line()
    header = study_header("real_models", argv, blas=blas, repeats=args.repeats,
                          tokens=args.tokens, temps=temps, sets=kinds,
                          dequantized=args.dequantize)
    progress = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    models = [measure_model(n, root / MODELS[n], kinds, temps, args.repeats, args.tokens,
                            args.seed, progress, args.dequantize) for n in names]
    out = args.out or f"real-models-{'f32-' if args.dequantize else ''}{blas_slug(blas)}"
    write_results(out, header, models, markdown(header, models))
    return 0


if __name__ == "__main__":
    sys.exit(main())
