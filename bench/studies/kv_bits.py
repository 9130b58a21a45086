"""Speculation with mlx-lm's kv_bits: does prompt lookup still pay on a quantized KV cache?

    python -m bench.studies.kv_bits --out kv-bits-netlib

On a real model (SmolLM2-135M-Instruct, GGUF Q4_1: `make real-models`), greedy, each repeat
decodes one prompt four ways, in an order reversed every other repeat: the target alone
(`prompt_lookup=False`) and with prompt lookup (the defaults: adaptive k, lookup), each with
full-precision KV caches and with `kv_bits` (the cache quantized from its first token,
`quantized_kv_start=0`). Each is timed after its first token. Ratios: lookup's tokens/s ÷ the
target alone's, the median of the per-repeat ratios with an order-statistics interval, at
each cache precision. Descriptive: no bar. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse

from mlx_spec import load
from mlx_spec.bench.timing import median, time_after_prefill
from mlx_spec.generate import speculative_generate_step
from . import paired_ratio, study_header, write_results
from .cross_tokenizer import real_model

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A reply that copies its prompt (lookup's case) and one that does not
PROMPTS = {
    "copy": "Copy this paragraph exactly.\n\nThe keeper of the lighthouse wrote the wind, the "
            "swell and the ships that passed in a leather book every night, and in the "
            "morning he read it aloud to the gulls.\n\nCopy:",
    "chat": "Explain in a few sentences why the sky is blue.",
}
WAYS = [("alone", False, None), ("lookup", None, None), ("alone", False, 4), ("lookup", None, 4)]


def rate(model, ids, lookup, bits, tokens: int) -> float:
    quantized = {} if bits is None else {"kv_bits": bits, "quantized_kv_start": 0}
    decoded = time_after_prefill(speculative_generate_step(
        ids, model, None, max_tokens=tokens, prompt_lookup=lookup, calibration=None,
        **quantized))
    return decoded.tokens / decoded.seconds


def measure(args) -> list:
    model, tokenizer = load(str(real_model(MODEL)), **(
        {"dequantize": True, "dtype": "float32"} if args.dequantize else {}))
    rows = []
    for name, text in PROMPTS.items():
        ids = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)
        for way in WAYS:  # warm-up
            rate(model, ids, way[1], way[2], args.tokens)
        rates = {way: [] for way in WAYS}
        for repeat in range(args.repeats):
            for way in (WAYS if repeat % 2 == 0 else WAYS[::-1]):
                rates[way].append(rate(model, ids, way[1], way[2], args.tokens))
        for bits in (None, 4):
            alone, lookup = rates[("alone", False, bits)], rates[("lookup", None, bits)]
            r = paired_ratio(lookup, alone)
            rows.append({"prompt": name, "kv_bits": bits, "alone": alone, "lookup": lookup,
                         "ratio": r})
            print(f"{name}, kv_bits {bits}: lookup ÷ alone {r['median']:.3f} "
                  f"({r['low']:.2f}-{r['high']:.2f})", flush=True)
    return rows


def render(header: dict, rows: list, args) -> str:
    lines = ["# Prompt lookup with and without mlx-lm's kv_bits (a real model)", "",
             f"`{header['command']}`  ", f"{header['machine']}; {MODEL}"
             + (" dequantized to float32" if args.dequantize else "") + ", greedy, chat "
             f"template, {args.repeats} repeats of {args.tokens} tokens, each timed after its "
             "first token, the four ways in an order reversed every other repeat; kv_bits 4 "
             "from the first token (quantized_kv_start 0). Ratio: lookup's tokens/s ÷ the "
             "target alone's, the median of the per-repeat ratios (its order-statistics "
             "interval).", "",
             "| prompt | KV cache | alone tokens/s | lookup tokens/s | lookup ÷ alone |",
             "|---|---|---|---|---|"]
    for row in rows:
        r = row["ratio"]
        cache = "float" if row["kv_bits"] is None else f"{row['kv_bits']}-bit"
        lines.append(f"| {row['prompt']} | {cache} | {median(row['alone']):.1f} | "
                     f"{median(row['lookup']):.1f} | {r['median']:.3f}x "
                     f"({r['low']:.3f}-{r['high']:.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dequantize", action="store_true",
                        help="the model's matrices in float32 (BLAS multiplies them: a pass "
                             "over k tokens then costs 1-2 passes over one with OpenBLAS)")
    parser.add_argument("--out", default="kv-bits")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.tokens < 8:
        parser.error("--repeats must be >= 1 and --tokens >= 8.")
    rows = measure(args)
    header = study_header("kv_bits", argv, tokens=args.tokens, repeats=args.repeats)
    write_results(args.out, header, rows, render(header, rows, args))


if __name__ == "__main__":
    main()
