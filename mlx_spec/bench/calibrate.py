"""`calibrate`: this machine's costs for a target (and a draft), in seconds, in a few seconds.

    cal = calibrate(target_model, draft_model, tokenizer)   # a few seconds
    calibrate(target_model, None, tokenizer, mtp=True)      # the target's MTP layer too
    save_calibration(cal)                                    # mlx_spec.calibration stores it

Five measurements, each reusing the benchmark's own:

1. plain decoding through mlx-spec's loop (the target alone), per token,
   from the first round on (the first round holds the prefill), and with a
   draft, real rounds at k = 2, greedy and at T = 1, the three interleaved
   run by run: the policy's prior is anchored to the greedy round (the parts
   below, timed one after another, drifted with the machine's load: six
   calibrations of one pair predicted 0.74-1.19x plain at T = 1, anchored
   0.82-0.97x, measured 0.85x);
2. the verify curve: one target forward over T tokens plus the log-softmax
   a verify pass takes, after a 128-token context (forward.py; attention
   caches are trimmed back after each pass, recurrent state just moves on,
   its size and so its cost unchanged);
3. one draft step: a forward over 1 token, log-softmax and argmax (for
   the target's MTP layer: the layer over one pair, the target's output
   head, log-softmax and argmax; a DFlash drafter has no per-token step: its
   one block pass per round is in the rounds of 1, stored under
   `dflash_key(drafter)` with a step of 0);
4. with a tokenizer, the draft's acceptance at k = 4 on one prompt of each
   kind (code, copy, prose; acceptance.py), greedy and at T = 1 with the
   exact rule (a strong draft keeps most of its acceptance when sampling, a
   weak one loses it: no fixed guess fits both);
5. what a round costs more at T = 1 than greedy (the real rounds of 1).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import mlx.core as mx

from ..cache import rewind
from ..batch.eagle3 import BatchEagle3Pairs
from ..drafters.head_chain import feed
from ..calibration.key import calibration_key, dflash_key, eagle3_key, model_fingerprint, mtp_key
from ..calibration.record import ROUND_K, Calibration, DraftCost
from ..dflash import is_dflash_model
from ..eagle3 import is_eagle3_head
from ..generate import speculative_generate_step
from ..loading import vocab_size
from ..mtp import load_mtp
from ..mtp.heads import split_target
from ..precision import prepare_drafter
from ..sampling import SamplingConfig, logprobs_from_logits, sample
from .acceptance import iid_rate, measure_point
from .forward import verify_curve
from .prompts import QUICK_PROMPTS, encode_prompts
from .timing import median, time_after_prefill

VERIFY_LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
CONTEXT_LENGTH = 128
VERIFY_REPEATS = 3
DRAFT_REPEATS = 9
PLAIN_TOKENS = 32  # timed per run, after the first round
PLAIN_RUNS = 6  # after one warm-up run; with a draft, each is followed by runs of rounds
PLAIN_PROMPT_LENGTH = 16
ACCEPTANCE_K = 4
ACCEPTANCE_TOKENS = 48
SAMPLING_ACCEPTANCE_TOKENS = 32
ROUND_TOKENS = 24  # per run of real rounds (at k = ROUND_K, greedy and at T = 1)
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


def verify_seconds(target_model) -> Dict[int, float]:
    """Seconds of one target verify pass over T tokens, for every T in VERIFY_LENGTHS."""
    return verify_curve(target_model, VERIFY_LENGTHS, CONTEXT_LENGTH, VERIFY_REPEATS,
                        timed=_AsVerified(target_model))


def draft_step_seconds(draft_model) -> float:
    """Seconds of one draft step (1 token: forward, log-softmax, argmax)."""
    return verify_curve(draft_model, [1], CONTEXT_LENGTH, DRAFT_REPEATS,
                        timed=_AsVerified(draft_model, draft_step=True))[1]


def _context_tokens(target_model, context: int = CONTEXT_LENGTH) -> mx.array:
    return mx.random.randint(0, vocab_size(target_model), (context + 1,),
                             key=mx.random.key(0)).astype(mx.uint32)


def mtp_step_seconds(target_model, head) -> float:
    """Seconds of one MTP drafting step after a CONTEXT_LENGTH context (its cache trimmed back)."""
    trunk, _ = split_target(target_model)
    tokens = _context_tokens(target_model)
    # (T, H): the target's, as drafting feeds them
    return pair_step_seconds(head, tokens, trunk(tokens[None, :-1])[0])


def eagle3_step_seconds(target_model, head, context: int = CONTEXT_LENGTH,
                        repeats: int = DRAFT_REPEATS) -> float:
    """Seconds of one EAGLE-3 drafting step after a `context`-token context (its cache trimmed
    back): the head over its own output and the token it drafted, as a chained step."""
    pairs = BatchEagle3Pairs(head, target_model)
    tokens = _context_tokens(target_model, max(context, 1))
    _, fused = pairs.capture(tokens[None, :-1], None)  # (1, T, H): the target's fused taps
    return pair_step_seconds(pairs, tokens, fused[0], repeats)


def pair_step_seconds(head, tokens: mx.array, hidden: mx.array,
                      repeats: int = DRAFT_REPEATS) -> float:
    """Seconds of one chained step of a head that reads pairs (an MTP head, an EAGLE-3 head's
    `Eagle3Pairs`), after the pairs (hidden (T, H), tokens[1:]); its cache trimmed back: the
    median of `repeats` after one untimed."""
    cache = head.make_cache()
    g = feed(head, tokens[None, 1:], hidden[None], cache[0])[0]
    mx.eval(g, [c.state for c in cache])
    last, times = g[-1:], []
    for _ in range(1 + repeats):
        start = time.perf_counter()
        # (1, H): depth 2's input, as a chained step
        g = feed(head, tokens[None, -1:], last[None], cache[0])[0]
        y = sample(logprobs_from_logits(head.logits(g), GREEDY), GREEDY)
        mx.eval(y)
        times.append(time.perf_counter() - start)
        rewind(cache, 1)
    return median(times[1:])


def _plain_run(target_model, prompt) -> float:
    """Seconds per token of one plain decoding run through mlx-spec's own loop."""
    decoded = time_after_prefill(speculative_generate_step(
        prompt, target_model, None, max_tokens=PLAIN_TOKENS + 1, prompt_lookup=False))
    return decoded.seconds / decoded.tokens


def _rounds_run(target_model, draft_model, prompt, temp: float, **options) -> float:
    """Median seconds of the real rounds drafting ROUND_K tokens in one run at `temp`."""
    times, last = [], None
    for round_ in speculative_generate_step(
            prompt, target_model, draft_model, max_tokens=ROUND_TOKENS,
            num_draft_tokens=ROUND_K, sampling=SamplingConfig(temp=temp),
            prompt_lookup=False, **options):
        now = time.perf_counter()
        if last is not None and round_.num_drafted == ROUND_K:
            times.append(now - last)
        last = now
    return median(times)


def plain_step_seconds(target_model) -> float:
    """Median seconds per token of plain decoding through mlx-spec's own loop."""
    prompt = _random_prompt(target_model)
    return median([_plain_run(target_model, prompt) for _ in range(1 + PLAIN_RUNS)][1:])


def _random_prompt(target_model) -> list:
    return mx.random.randint(0, vocab_size(target_model), (PLAIN_PROMPT_LENGTH,),
                             key=mx.random.key(0)).tolist()


def anchors(target_model, draft_model, **options):
    """(plain step, greedy round, what a round costs more at T = 1) in seconds, from runs
    interleaved.

    Each run decodes plainly, then in rounds of ROUND_K drafts greedy, then at
    T = 1, so a load that comes and goes slows all three alike. The rounds
    are the median of their per-run ratios to that run's plain step (paired:
    what the policy decides on), times the median plain step. `draft_model`
    may be "mtp" (`mtp_weights=` in `options`).
    """
    prompt, runs = _random_prompt(target_model), []
    for _ in range(1 + PLAIN_RUNS):
        runs.append((_plain_run(target_model, prompt),
                     _rounds_run(target_model, draft_model, prompt, 0.0, **options),
                     _rounds_run(target_model, draft_model, prompt, 1.0, **options)))
    runs = runs[1:]
    plain_s = median([plain for plain, _, _ in runs])
    greedy_s = plain_s * median([greedy / plain for plain, greedy, _ in runs])
    extra_s = plain_s * median([(sampled - greedy) / plain for plain, greedy, sampled in runs])
    return plain_s, greedy_s, extra_s


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
    sources = []  # (fingerprint, what draft_model= takes, its options, step seconds)
    prepare_drafter(draft_model, target_model)  # timed in the dtype generation drafts in
    if is_dflash_model(draft_model):  # its block pass is timed inside the real rounds
        sources.append((dflash_key(draft_model), draft_model, {}, 0.0))
    elif is_eagle3_head(draft_model):
        say("EAGLE-3 step")
        sources.append((eagle3_key(draft_model), draft_model, {},
                        eagle3_step_seconds(target_model, draft_model)))
    elif draft_model is not None:
        say("draft step")
        sources.append((model_fingerprint(draft_model), draft_model, {},
                        draft_step_seconds(draft_model)))
    if mtp:
        head = load_mtp(target_model, mtp_weights).drafting()
        say("MTP step")
        sources.append((mtp_key(head), "mtp", {"mtp_weights": mtp_weights},
                        mtp_step_seconds(target_model, head)))
    plain_runs, drafts = [], {}
    for fingerprint, source, options, step_s in sources:
        say(f"plain decoding and real rounds at k = {ROUND_K}, interleaved"
            + (" (MTP)" if source == "mtp" else ""))
        plain_s, greedy_s, extra_s = anchors(target_model, source, **options)
        plain_runs.append(plain_s)
        acceptances = _acceptances(target_model, source, tokenizer, say, **options)
        drafts[fingerprint] = DraftCost(step_s, *acceptances, max(extra_s, 0.0), greedy_s)
    if not plain_runs:
        say("plain decoding (target alone)")
        plain_runs.append(plain_step_seconds(target_model))
    say(f"verify cost over T = {VERIFY_LENGTHS[0]}..{VERIFY_LENGTHS[-1]} tokens")
    verify_s = verify_seconds(target_model)
    mx.clear_cache()
    return Calibration(key=calibration_key(target_model), created=time.time(),
                       plain_step_s=plain_runs[0], verify_s=verify_s, drafts=drafts)
