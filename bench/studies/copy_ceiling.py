"""How fast could the copy task be on this machine? The target told its own reply, in blocks.

    python -m bench.studies.copy_ceiling --pairs skip-f16,noisy-f16 --out NAME

never_behind's copy task (the target re-emits a function it was just shown, T = 0)
asks prompt lookup for 3x plain decoding. Two things bound it: the verify pass
(a block of L drafts costs one forward over L + 1 tokens, and no exact
proposer emits a reply in fewer than reply / (L + 1) such passes) and the
text (a token the prompt does not hold cannot be looked up). Here a told
drafter knows the target's greedy reply and proposes its next L tokens every
round (FixedPolicy(L)): every proposal is kept whole, so its speed is the
ceiling of any exact proposer of at most L drafts a round, the verify pass
alone. It runs interleaved with plain decoding, prompt lookup alone and the
defaults (uncalibrated) on never_behind's copy prompt. Every method is timed
from the end of the target's prefill to its last token, the first round
included (never_behind leaves out the first round, which carries the
prefill; here a draft model's prefill and the prompt look count against the
defaults). Reported per pair: tokens per second, each method over plain (the
median of the per-repeat ratios and its 90% interval), the tokens a round and
how many rounds were plain steps (tokens no proposal covered).
Writes bench/results/<out>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List, Sequence

from mlx_spec.cache import ModelCache, make_cache
from mlx_spec.drafters.protocol import TextSearchDrafter
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import vocab_size
from mlx_spec.loop import generate_rounds
from mlx_spec.policy import FixedPolicy
from mlx_spec.sampling import SamplingConfig
from mlx_spec.bench.endtoend import RunResult, interleave, run_target_alone
from mlx_spec.bench.prompts import PROMPTS
from mlx_spec.bench.timing import DEFAULT_WARMUP, ratio
from ..zoo import PAIR_NAMES, build_zoo
from . import check_pairs, study_header, write_results
from .lookup_track_record import greedy
from .never_behind import COPY_SOURCE_PROMPT, copy_prompt, paired_ratio

PLAIN, LOOKUP, DEFAULTS = "plain", "lookup alone", "defaults"
REPLY_SHOWN = 24  # tokens of each reply the results show


def told(block: int) -> str:
    return f"told, L = {block}"


class ToldDrafter(TextSearchDrafter):
    """Proposes the next tokens of a reply it was given (the target's own greedy reply)."""

    source = "lookup"  # a free host search, as far as anyone counting rounds can tell

    def __init__(self, reply: Sequence[int], prompt_length: int, target_vocab_size: int):
        self.reply, self.prompt_length = list(reply), prompt_length
        self.target_vocab_size, self.greedy = target_vocab_size, True

    def lookup(self, history: List[int], k: int) -> List[int]:
        done = len(history) - self.prompt_length
        return self.reply[done:done + k]


def timed_from_prefill(rounds_from: Callable, rounds_log: list, emitted: list) -> RunResult:
    """Run `rounds_from(progress)`'s rounds, timed from the end of the target's prefill (its
    progress callback's last chunk) to the last round."""
    started = []

    def progress(done: int, total: int) -> None:
        if done == total - 1:
            started.append(time.perf_counter())

    drafted = accepted = rounds = plain = 0
    for round_ in rounds_from(progress):
        emitted.extend(round_.tokens)
        drafted, accepted = drafted + round_.num_drafted, accepted + round_.num_accepted
        rounds, plain = rounds + 1, plain + (round_.num_drafted == 0)
    seconds = time.perf_counter() - started[0]
    rounds_log.append((len(emitted), rounds, plain))
    return RunResult(seconds, len(emitted), drafted, accepted)


def run_told(target_model, ids: List[int], reply: List[int], block: int,
             rounds_log: list) -> RunResult:
    """The told drafter at FixedPolicy(block)."""
    drafter = ToldDrafter(reply, len(ids), vocab_size(target_model))
    target = ModelCache(target_model, make_cache(target_model), reserve=block + 2)
    emitted: List[int] = []
    result = timed_from_prefill(lambda progress: generate_rounds(
        ids, target, [drafter], FixedPolicy(block), sampling=SamplingConfig(temp=0.0),
        max_tokens=len(reply), prompt_progress_callback=progress), rounds_log, emitted)
    if emitted != reply:  # exactness: a told reply is the reply
        raise RuntimeError("the told drafter's output differs from the target's greedy reply")
    return result


def run_speculative(target_model, draft_model, ids: List[int], tokens: int, rounds_log: list,
                    **options) -> RunResult:
    """speculative_generate_step (greedy), timed as run_told."""
    return timed_from_prefill(lambda progress: speculative_generate_step(
        ids, target_model, draft_model, max_tokens=tokens, sampling=SamplingConfig(temp=0.0),
        prompt_progress_callback=progress, **options), rounds_log, [])


def measure_pair(pair, blocks: Sequence[int], tokens: int, repeats: int) -> dict:
    source = next(p for p in PROMPTS if p.name == COPY_SOURCE_PROMPT)
    ids = copy_prompt(pair, source)
    reply = greedy(pair.target_model, ids, tokens)
    target_model = pair.target_model
    logs: Dict[str, list] = {name: [] for name in (LOOKUP, DEFAULTS, *map(told, blocks))}
    methods = {
        PLAIN: lambda ids_: run_target_alone(target_model, ids_, 0.0, tokens),
        LOOKUP: lambda ids_: run_speculative(target_model, None, ids_, tokens, logs[LOOKUP],
                                             prompt_lookup=True),
        DEFAULTS: lambda ids_: run_speculative(target_model, pair.draft_model, ids_, tokens,
                                               logs[DEFAULTS], **pair.draft_options),
        **{told(b): (lambda ids_, b=b: run_told(target_model, ids_, reply, b, logs[told(b)]))
           for b in blocks},
    }
    results = interleave(methods, [(source, ids)], repeats=repeats)
    row = {"pair": pair.name, "prompt_tokens": len(ids), "reply_tokens": len(reply),
           "reply_opens": pair.tokenizer.decode(reply[:REPLY_SHOWN]),
           "tokens_per_s": {name: result.tokens_per_s for name, result in results.items()},
           "over_plain": {}, "tokens_per_round": {}, "plain_steps": {}}
    for name in methods:
        if name != PLAIN:
            r = paired_ratio(results[name], results[PLAIN])
            row["over_plain"][name] = None if r is None else [r.value, r.low, r.high]
        timed = logs.get(name, [])[DEFAULT_WARMUP:]
        if timed:
            row["tokens_per_round"][name] = ratio(sum(t for t, _, _ in timed),
                                                  sum(n for _, n, _ in timed))
            row["plain_steps"][name] = sorted(p for _, _, p in timed)[len(timed) // 2]
    return row


def render(rows: List[dict], header: dict) -> str:
    names = list(rows[0]["over_plain"]) if rows else []
    out = ["# The copy task's ceiling: the target told its own reply", "",
           f"`{header['command']}`  ",
           f"{header['machine']}; never_behind's copy prompt, T = 0, {header['tokens']} tokens, "
           f"{header['repeats']} repeats after a warm-up, interleaved. A told drafter proposes "
           "the next L tokens of the target's greedy reply every round (every proposal kept "
           "whole): the most any exact proposer of at most L drafts a round reaches here. "
           "Each method ÷ plain decoding: the median of the per-repeat ratios (90% interval); "
           "then the tokens a round and the plain steps among the rounds (median call).", "",
           "| pair | plain tok/s | " + " | ".join(f"{n} ÷ plain" for n in names) + " |",
           "|---|---|" + "---|" * len(names)]
    for row in rows:
        cells = []
        for name in names:
            r = row["over_plain"][name]
            per_round = row["tokens_per_round"].get(name)
            cells.append("-" if r is None else
                         f"{r[0]:.2f}x ({r[1]:.2f}-{r[2]:.2f})"
                         + ("" if per_round is None else
                            f", {per_round:.1f} a round, {row['plain_steps'][name]} plain"))
        out.append(f"| {row['pair']} | {row['tokens_per_s'][PLAIN]:.1f} | "
                   + " | ".join(cells) + " |")
    out += ["", f"The replies' first {REPLY_SHOWN} tokens (the prompt ends with the function's "
            "opening, shown once before with its first continuation):", ""]
    out += [f"- {row['pair']}: `{row['reply_opens']!r}`" for row in rows]
    return "\n".join(out) + "\n"


def parse_blocks(parser, text: str) -> List[int]:
    try:
        blocks = [int(b) for b in text.split(",")]
    except ValueError:
        parser.error(f"--blocks must be comma-separated whole numbers, got {text!r}.")
    if any(b < 1 for b in blocks):
        parser.error(f"--blocks must each be >= 1, got {text!r}.")
    return blocks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="skip-f16,noisy-f16,skip-f32,mtp-f32")
    parser.add_argument("--blocks", default="16,32,64")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="copy-ceiling")
    args = parser.parse_args(argv)
    check_pairs(parser, args.pairs, PAIR_NAMES)
    blocks = parse_blocks(parser, args.blocks)
    if args.tokens < 2 or args.repeats < 1:
        parser.error("--tokens must be >= 2 and --repeats >= 1.")
    header = study_header("copy_ceiling", argv, tokens=args.tokens, repeats=args.repeats)
    rows = []
    for pair in build_zoo(args.pairs.split(",")):
        rows.append(measure_pair(pair, blocks, args.tokens, args.repeats))
        print(f"  {rows[-1]['pair']}: {rows[-1]['over_plain']}", file=sys.stderr, flush=True)
    write_results(args.out, header, rows, render(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
