"""`calibrate`: this machine's costs for a target (and a draft), in seconds, in a few seconds.

Four measurements, each reusing the benchmark's own:

1. plain decoding through mlx-spec's loop (the target alone), per token,
   from the first round on (the first round holds the prefill);
2. the verify curve: one target forward over T tokens plus the log-softmax
   a verify pass takes, after a 128-token context (bench.forward; attention
   caches are trimmed back after each pass, recurrent state just moves on,
   its size and so its cost unchanged);
3. one draft step: a forward over 1 token, log-softmax and argmax (for
   the target's MTP layer: the layer over one pair, the target's output
   head, log-softmax and argmax);
4. with a tokenizer, the draft's acceptance at k = 4 on one prompt of each
   kind (code, copy, prose; bench.acceptance), greedy and at T = 1 with the
   exact rule (a strong draft keeps most of its acceptance when sampling, a
   weak one loses it: no fixed guess fits both);
5. what a round costs more at T = 1 than greedy (real rounds at k = 2).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..bench.acceptance import iid_rate, measure_point
from ..bench.forward import forward_seconds, prefilled_cache
from ..bench.prompts import QUICK_PROMPTS, encode_prompts
from ..bench.timing import median
from ..generate import speculative_generate_step
from ..cache import rewind
from ..loading import vocab_size
from ..mtp import load_mtp
from ..mtp.heads import split_target
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .key import calibration_key, model_fingerprint, mtp_key
from .record import Calibration, DraftCost

VERIFY_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
CONTEXT_LENGTH = 128
VERIFY_REPEATS = 3
DRAFT_REPEATS = 9
PLAIN_TOKENS = 32  # timed per run, after the first round
PLAIN_RUNS = 3  # after one warm-up run
PLAIN_PROMPT_LENGTH = 16
ACCEPTANCE_K = 4
ACCEPTANCE_TOKENS = 48
SAMPLING_ACCEPTANCE_TOKENS = 32
EXTRA_K, EXTRA_TOKENS, EXTRA_RUNS = 2, 24, 2  # the sampling overhead's rounds
GREEDY = SamplingConfig()


class _AsVerified:
    """A model as a round calls it: the forward, then the log-softmax over the vocabulary
    (and for a draft step the argmax). Other attributes are the model's, so the
    bench's forward timing takes it for the model."""

    def __init__(self, model, draft_step: bool = False):
        self._wrapped, self._draft_step = model, draft_step

    def __getattr__(self, name):
        return getattr(self._wrapped, name)

    def __call__(self, tokens, cache):
        logprobs = logprobs_from_logits(self._wrapped(tokens, cache=cache), GREEDY)  # (1, T, V)
        return sample(logprobs[:, -1], GREEDY) if self._draft_step else logprobs


def verify_curve(target_model) -> Dict[int, float]:
    """Seconds of one target verify pass over T tokens, for every T in VERIFY_LENGTHS."""
    cache = prefilled_cache(target_model, CONTEXT_LENGTH)
    return forward_seconds(_AsVerified(target_model), cache, VERIFY_LENGTHS,
                           repeats=VERIFY_REPEATS)


def draft_step_seconds(draft_model) -> float:
    """Seconds of one draft step (1 token: forward, log-softmax, argmax)."""
    cache = prefilled_cache(draft_model, CONTEXT_LENGTH)
    return forward_seconds(_AsVerified(draft_model, draft_step=True), cache, [1],
                           repeats=DRAFT_REPEATS)[1]


def mtp_step_seconds(target_model, head) -> float:
    """Seconds of one MTP drafting step after a CONTEXT_LENGTH context (its cache trimmed back)."""
    trunk, _ = split_target(target_model)
    tokens = mx.random.randint(0, vocab_size(target_model), (CONTEXT_LENGTH + 1,),
                               key=mx.random.key(0)).astype(mx.uint32)
    hidden = trunk(tokens[None, :-1])[0]  # (T, H): the target's, as drafting feeds them
    cache = head.make_cache()
    g = head(tokens[1:], hidden, cache[0])
    mx.eval(g, [c.state for c in cache])
    last, times = g[-1:], []
    for _ in range(1 + DRAFT_REPEATS):
        start = time.perf_counter()
        g = head(tokens[-1:], last, cache[0])  # (1, H): depth 2's input, as a chained step
        y = sample(logprobs_from_logits(head.logits(g), GREEDY), GREEDY)
        mx.eval(y)
        times.append(time.perf_counter() - start)
        rewind(cache, 1)
    return median(times[1:])


def plain_step_seconds(target_model) -> float:
    """Median seconds per token of plain decoding through mlx-spec's own loop."""
    prompt = _random_prompt(target_model)

    def run() -> float:
        rounds = speculative_generate_step(prompt, target_model, None,
                                           max_tokens=PLAIN_TOKENS + 1, prompt_lookup=False)
        next(rounds)  # prefill and the first token: not a decoding step
        start, tokens = time.perf_counter(), 0
        for round_ in rounds:
            tokens += len(round_.tokens)
        return (time.perf_counter() - start) / tokens

    return median([run() for _ in range(1 + PLAIN_RUNS)][1:])


def _random_prompt(target_model) -> list:
    return mx.random.randint(0, vocab_size(target_model), (PLAIN_PROMPT_LENGTH,),
                             key=mx.random.key(0)).tolist()


def round_seconds(target_model, draft_model, temp: float, **options) -> float:
    """Median seconds of a real round drafting EXTRA_K tokens at `temp` (after a warm-up run)."""
    prompt, times = _random_prompt(target_model), []
    for run in range(1 + EXTRA_RUNS):
        last = None
        for round_ in speculative_generate_step(
                prompt, target_model, draft_model, max_tokens=EXTRA_TOKENS,
                num_draft_tokens=EXTRA_K, sampling=SamplingConfig(temp=temp),
                prompt_lookup=False, **options):
            now = time.perf_counter()
            if run and last is not None and round_.num_drafted == EXTRA_K:
                times.append(now - last)
            last = now
    return median(times)


def sampling_extra_seconds(target_model, draft_model, **options) -> float:
    """What a round costs more at T = 1 than greedy: the drafts' sampling, the exact rule.

    Measured on real rounds, the two temperatures in the same way, so the
    difference is what the greedy costs above leave out (about half a plain
    step on a fast float32 pair here)."""
    return max(round_seconds(target_model, draft_model, 1.0, **options)
               - round_seconds(target_model, draft_model, 0.0, **options), 0.0)


def draft_acceptance(target_model, draft_model, tokenizer, temp: float = 0.0,
                     **options) -> float:
    """Per-draft acceptance at k = ACCEPTANCE_K and `temp` (the i.i.d. MLE over the rounds).

    `draft_model` may be "mtp" (with `mtp_weights=` in `options`)."""
    prompts = encode_prompts(tokenizer, QUICK_PROMPTS)
    point = measure_point(target_model, draft_model, prompts, ACCEPTANCE_K, temp,
                          ACCEPTANCE_TOKENS if temp == 0 else SAMPLING_ACCEPTANCE_TOKENS,
                          **options)
    return iid_rate([point])


def _acceptances(target_model, draft_model, tokenizer, say, **options):
    """(greedy, T = 1) acceptance, or (None, None) without a tokenizer."""
    if tokenizer is None:
        return None, None
    say(f"acceptance at k = {ACCEPTANCE_K}, T = 0 and 1, {len(QUICK_PROMPTS)} prompts")
    return (draft_acceptance(target_model, draft_model, tokenizer, **options),
            draft_acceptance(target_model, draft_model, tokenizer, 1.0, **options))


def calibrate(target_model, draft_model=None, tokenizer=None,
              progress: Optional[Callable[[str], None]] = None, mtp: bool = False,
              mtp_weights: Optional[str] = None) -> Calibration:
    """Measure this machine's costs for `target_model` (and `draft_model` when given).

    With `mtp`, the target's MTP layer (weights as `mtp_weights` or the
    model's own, see `mlx_spec.mtp.load_mtp`) is measured too, stored under
    `mtp_key(head)`. Acceptance needs `tokenizer` (prompts are text); without
    it acceptance is None. `progress(message)` is called before each stage.
    """
    say = progress or (lambda message: None)
    say("plain decoding (target alone)")
    plain_s = plain_step_seconds(target_model)
    say(f"verify cost over T = {VERIFY_LENGTHS[0]}..{VERIFY_LENGTHS[-1]} tokens")
    verify_s = verify_curve(target_model)
    drafts = {}
    if draft_model is not None:
        say("draft step")
        step_s = draft_step_seconds(draft_model)
        acceptances = _acceptances(target_model, draft_model, tokenizer, say)
        say("what sampling adds to a round")
        drafts[model_fingerprint(draft_model)] = DraftCost(
            step_s, *acceptances, sampling_extra_seconds(target_model, draft_model))
    if mtp:
        head = load_mtp(target_model, mtp_weights)
        say("MTP step")
        step_s = mtp_step_seconds(target_model, head)
        acceptances = _acceptances(target_model, "mtp", tokenizer, say, mtp_weights=mtp_weights)
        say("what sampling adds to an MTP round")
        drafts[mtp_key(head)] = DraftCost(
            step_s, *acceptances,
            sampling_extra_seconds(target_model, "mtp", mtp_weights=mtp_weights))
    mx.clear_cache()
    return Calibration(key=calibration_key(target_model), created=time.time(),
                       plain_step_s=plain_s, verify_s=verify_s, drafts=drafts)
