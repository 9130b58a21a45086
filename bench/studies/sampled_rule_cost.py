"""What a sampled round's host-built graphs cost: a batch row's keyed rule and draws against the loop's.

    python -m bench.studies.sampled_rule_cost --out sampled-rule-cost-openblas

At T > 0 the loop judges k drafts with `speculative_accept_with_chances` and draws each draft
with `sampling.sample`, both compiled with MLX's global random state. A batch row draws from a
key of its own (`Row.next_key`), so its rule and draws are other graphs: until 2026-12-07 they
ran uncompiled, the rule's chances from a second exponential of p. Each variant is timed on
random logits (k = 4 drafts, the vocabularies of the shipped pair, SmolLM2 and Gemma 3),
evaluated every call, `--calls` calls a block after a warm-up, the median of `--blocks` blocks,
the variants interleaved block by block. Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from mlx_spec.acceptance import (_rejection_sample, acceptance_chances, keyed_rule,
                                 speculative_accept_with_chances)
from mlx_spec.bench.timing import median
from mlx_spec.sampling import SamplingConfig, keyed_categorical, logprobs_from_logits, sample
from . import study_header, write_results

K = 4
SAMPLING = SamplingConfig(temp=0.7)


def variants(vocab: int) -> dict:
    """name -> a function doing one call's work, evaluated."""
    target_logprobs = logprobs_from_logits(mx.random.normal((K + 1, vocab)), SAMPLING)
    q = mx.softmax(mx.random.normal((K, vocab)), axis=-1)
    drafts = mx.array(list(range(1, K + 1)), mx.uint32)
    logits = mx.random.normal((vocab,))
    mx.eval(target_logprobs, q, logits)
    state = {"key": mx.random.key(0)}
    rule = keyed_rule()
    split = mx.compile(lambda key: tuple(mx.random.split(key)))

    def uncompiled_key():
        state["key"], sub = mx.random.split(state["key"])
        return sub

    def compiled_key():
        state["key"], sub = split(state["key"])
        return sub

    return {
        "rule: the loop's (compiled, global state)":
            lambda: mx.eval(*speculative_accept_with_chances(drafts, q, target_logprobs)),
        "rule: a batch row's, uncompiled (before)":
            lambda: mx.eval(*_rejection_sample(drafts, q, target_logprobs, True,
                                               uncompiled_key()),
                            acceptance_chances(drafts, q, target_logprobs)),
        "rule: a batch row's, compiled (now)":
            lambda: mx.eval(*rule.with_chances(drafts, q, target_logprobs, compiled_key())),
        "draw: the loop's (compiled, global state)":
            lambda: mx.eval(sample(logprobs_from_logits(logits, SAMPLING), SAMPLING)),
        "draw: a batch row's, uncompiled (before)":
            lambda: mx.eval(mx.random.categorical(logprobs_from_logits(logits, SAMPLING),
                                                  key=uncompiled_key())),
        "draw: a batch row's, compiled (now)":
            lambda: mx.eval(keyed_categorical(logprobs_from_logits(logits, SAMPLING),
                                              compiled_key())),
    }


def block_seconds(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def measure(args) -> list:
    rows = []
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        calls = variants(vocab)
        for call in calls.values():  # warm-up (compiles)
            block_seconds(call, 5)
        times = {name: [] for name in calls}
        for _ in range(args.blocks):
            for name, call in calls.items():
                times[name].append(block_seconds(call, args.calls))
        for name, values in times.items():
            rows.append({"vocab": vocab, "variant": name, "us_per_call": median(values) * 1e6,
                         "blocks_us": [v * 1e6 for v in values]})
            print(f"V={vocab}: {name}: {median(values) * 1e6:.0f} us", flush=True)
    return rows


def render(header: dict, rows: list, args) -> str:
    lines = ["# A sampled round's rule and draws: a batch row's keyed graphs against the loop's",
             "", f"`{header['command']}`  ",
             f"{header['machine']}; k = {K}, T = 0.7, random logits, {args.calls} calls a "
             f"block, the median of {args.blocks} blocks, variants interleaved.", "",
             "| vocabulary | variant | µs a call | ÷ the loop's |", "|---|---|---|---|"]
    loop = {(r["vocab"], r["variant"].split(":")[0]): r["us_per_call"]
            for r in rows if "the loop's" in r["variant"]}
    for r in rows:
        base = loop[(r["vocab"], r["variant"].split(":")[0])]
        lines.append(f"| {r['vocab']} | {r['variant']} | {r['us_per_call']:.0f} | "
                     f"{r['us_per_call'] / base:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", default="4096,49152,262144")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=9)
    parser.add_argument("--out", default="sampled-rule-cost")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.blocks < 1:
        parser.error("--calls and --blocks must be >= 1.")
    rows = measure(args)
    header = study_header("sampled_rule_cost", argv, calls=args.calls, blocks=args.blocks)
    write_results(args.out, header, rows, render(header, rows, args))


if __name__ == "__main__":
    main()
