"""A statistical exactness check anyone can run: does speculation change the output?

Sample the first two generated tokens many times with speculation and compare
their empirical distribution with the target's exact one, by a chi-square
test. The exact joint distribution is computed from the target alone: p(t1)
over the whole vocabulary, and p(t2 | t1) for the most likely first tokens
(every other first token is pooled into one bucket whose probability is known
exactly, so nothing is approximated).

The prompt is prefilled once; after each sample both caches are rewound to
the prompt, so a sample costs one or two rounds. Prompt lookup needs the
prompt as its history, and an MTP layer (`draft_model="mtp"`) the target's
hidden states over it, so with them each sample re-runs the (short) prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .arguments import check_arguments
from .assemble import draft_bridge
from .cache import ModelCache, make_cache
from .generate import speculative_generate_step
from .cache.prefill import prefill
from .dflash import is_dflash_model
from .eagle3 import is_eagle3_head
from .sampling import SamplingConfig, check_sampling, logprobs_from_logits

DEFAULT_SAMPLES = 2000
DEFAULT_ALPHA = 1e-3
DEFAULT_FIRST_TOKENS = 32  # first tokens whose second-token distribution is resolved
MIN_EXPECTED = 5.0  # chi-square cells with fewer expected counts are pooled


@dataclass(frozen=True)
class ExactnessResult:
    samples: int
    statistic: float
    dof: int
    p_value: float
    acceptance_rate: float
    alpha: float
    drafted: int = 0  # tokens the drafters proposed over all samples (0: nothing was speculated)

    @property
    def passed(self) -> bool:
        return self.p_value > self.alpha


def exact_distribution(target_model, prompt: List[int], sampling: SamplingConfig,
                       first_tokens: int = DEFAULT_FIRST_TOKENS,
                       logits_processors=()) -> Dict[Tuple[int, int], float]:
    """{(t1, t2): probability} for the likeliest t1; (-1, -1) pools every other t1.
    `logits_processors` (mlx-lm's) see the prompt, then the prompt and t1."""
    def processed(tokens, logits):
        for processor in logits_processors or ():
            logits = processor(mx.array(tokens, mx.uint32), logits[None])[0]
        return logits

    first = processed(prompt, target_model(mx.array([prompt]))[0, -1])
    p1 = np.array(mx.exp(logprobs_from_logits(first, sampling)))
    top = [int(t) for t in np.argsort(-p1)[:first_tokens] if p1[t] > 0]
    batch = target_model(mx.array([prompt + [t] for t in top]))[:, -1]
    second = mx.stack([processed(prompt + [t], batch[row]) for row, t in enumerate(top)])
    p2 = np.array(mx.exp(logprobs_from_logits(second, sampling)))  # (m, V)
    cells = {}
    for row, t1 in enumerate(top):
        for t2 in np.nonzero(p2[row] > 0)[0]:
            cells[(t1, int(t2))] = float(p1[t1] * p2[row, t2])
    rest = 1.0 - float(p1[top].sum())
    if rest > 0:
        cells[(-1, -1)] = rest
    return cells


def sample_first_two(target_model, draft_model, prompt: List[int], sampling: SamplingConfig,
                     samples: int, num_draft_tokens: int = 2, accept=None,
                     prompt_lookup: bool = False, mtp_weights=None,
                     logits_processors=None, suffix=None, tokenizers=(None, None)
                     ) -> Tuple[Dict[Tuple[int, int], int], float]:
    """Counts of (t1, t2) over `samples` speculative generations, and the acceptance rate."""
    counts, accepted, drafted = _sample_first_two(
        target_model, draft_model, prompt, sampling, samples, num_draft_tokens, accept,
        prompt_lookup, mtp_weights, logits_processors, suffix, tokenizers)
    return counts, (accepted / drafted if drafted else 0.0)


def _sample_first_two(target_model, draft_model, prompt: List[int], sampling: SamplingConfig,
                      samples: int, num_draft_tokens: int, accept, prompt_lookup: bool,
                      mtp_weights, logits_processors, suffix=None, tokenizers=(None, None),
                      tree=None) -> Tuple[Dict[Tuple[int, int], int], int, int]:
    """Counts of (t1, t2), and the tokens accepted and drafted over all samples.

    With `suffix` every sample's text joins the index, so later samples draft from earlier
    ones' (each sample's proposals depend only on earlier samples: the output stays exact).
    `tokenizers`: (the target's, the draft's) for a draft of another vocabulary."""
    target_tokenizer, draft_tokenizer = tokenizers
    # The whole prompt every sample: lookup, suffix drafting and block drafters read it (an MTP
    # layer or a DFlash drafter learns it from the target's prefill), logits processors see
    # it, and a draft of another vocabulary reads its text.
    fresh = prompt_lookup or suffix not in (None, False) or isinstance(draft_model, str) or \
        is_dflash_model(draft_model) or is_eagle3_head(draft_model) or \
        bool(logits_processors) or \
        (draft_model is not None and
         draft_bridge(target_model, draft_model, target_tokenizer, draft_tokenizer) is not None)
    target_cache = make_cache(target_model)
    draft_cache = make_cache(draft_model) if draft_model is not None and not fresh else []
    caches = [ModelCache(target_model, target_cache)]
    if draft_cache:
        caches.append(ModelCache(draft_model, draft_cache))
    for cache in caches:
        prefill(cache, prompt[:-1], 512)
    prefilled = [cache.checkpoint() for cache in caches]  # every sample starts from here
    counts: Dict[Tuple[int, int], int] = {}
    drafted = accepted = 0
    for _ in range(samples):
        out = []
        for round_ in speculative_generate_step(
            prompt if fresh else prompt[-1:], target_model, draft_model,
            max_tokens=2, num_draft_tokens=num_draft_tokens, sampling=sampling,
            accept=accept, prompt_lookup=prompt_lookup, mtp_weights=mtp_weights, suffix=suffix,
            prompt_cache=None if fresh else target_cache + draft_cache,
            calibration=None,  # k is fixed: nothing to calibrate (and no fingerprint per sample)
            logits_processors=logits_processors, target_tokenizer=target_tokenizer,
            draft_tokenizer=draft_tokenizer, tree=tree,
        ):
            out += round_.tokens
            drafted += round_.num_drafted
            accepted += round_.num_accepted
            if len(out) >= 2:
                break
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
        for cache, point in zip(caches, prefilled):
            cache.restore(point)  # whatever the call in between fed
    return counts, accepted, drafted


def chi_square(counts: Dict[Tuple[int, int], int],
               exact: Dict[Tuple[int, int], float]) -> Tuple[float, int, float]:
    """Pearson chi-square of counts against exact cell probabilities: (statistic, dof, p)."""
    resolved_first = {t1 for (t1, _) in exact if t1 >= 0}
    observed: Dict[Tuple[int, int], int] = {}
    for (t1, t2), c in counts.items():
        key = (t1, t2) if t1 in resolved_first else (-1, -1)
        if key not in exact:  # a pair the target never produces: the rule is not exact
            return math.inf, max(len(exact) - 1, 1), 0.0
        observed[key] = observed.get(key, 0) + c
    n = sum(counts.values())
    obs, exp, pooled_obs, pooled_exp = [], [], 0.0, 0.0
    for key, prob in exact.items():
        if prob * n >= MIN_EXPECTED:
            obs.append(observed.get(key, 0))
            exp.append(prob * n)
        else:
            pooled_obs += observed.get(key, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    obs_a, exp_a = np.array(obs, float), np.array(exp, float)
    statistic = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    dof = max(len(obs) - 1, 1)
    return statistic, dof, chi2_survival(statistic, dof)


def chi2_survival(x: float, dof: int) -> float:
    """P(X >= x) for a chi-square with `dof` degrees of freedom (no SciPy needed)."""
    return _upper_regularized_gamma(dof / 2.0, x / 2.0)


def _upper_regularized_gamma(a: float, x: float) -> float:
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower function
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    # Lentz's continued fraction for the upper function
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return min(1.0, h * math.exp(log_prefix))


def check_exactness(target_model, draft_model, prompt: List[int], sampling: SamplingConfig,
                    samples: int = DEFAULT_SAMPLES, num_draft_tokens: int = 2,
                    alpha: float = DEFAULT_ALPHA, accept=None, prompt_lookup: bool = False,
                    seed: Optional[int] = 0, mtp_weights=None,
                    logits_processors=None, suffix=None, draft_tokenizer=None,
                    target_tokenizer=None, tree=None) -> ExactnessResult:
    """Run the whole check; `result.passed` is False when speculation changed the output.
    With mlx-lm's `logits_processors` the exact distribution is the processed one. A draft of
    another vocabulary needs both tokenizers (given, or read by `mlx_spec.load`). `tree`: as
    speculative_generate_step's (a (depth, width) pair checks token trees)."""
    check_arguments(target_model=target_model, draft_model=draft_model, prompt=prompt,
                    samples=samples, num_draft_tokens=num_draft_tokens,
                    alpha=alpha, accept=accept, prompt_lookup=prompt_lookup, seed=seed,
                    mtp_weights=mtp_weights, logits_processors=logits_processors, suffix=suffix,
                    draft_tokenizer=draft_tokenizer, target_tokenizer=target_tokenizer, tree=tree)
    check_sampling(sampling)
    if sampling.sampler is not None:
        raise ValueError("The exactness check needs a sampler it can read (temp, top_p, top_k, "
                         "min_p); an opaque sampler's distribution is unknown to it.")
    if isinstance(prompt, str):
        raise ValueError("prompt must be token ids here; encode the text with the tokenizer first.")
    prompt = [int(t) for t in prompt]
    if sampling.greedy:
        raise ValueError("The exactness check samples; use a temperature > 0.")
    if len(prompt) == 0:
        raise ValueError("The prompt is empty; give some text to continue.")
    if seed is not None:
        mx.random.seed(seed)
    exact = exact_distribution(target_model, prompt, sampling, logits_processors=logits_processors)
    counts, accepted, drafted = _sample_first_two(
        target_model, draft_model, prompt, sampling, samples, num_draft_tokens, accept,
        prompt_lookup, mtp_weights, logits_processors, suffix, (target_tokenizer, draft_tokenizer),
        tree)
    statistic, dof, p_value = chi_square(counts, exact)
    acceptance = accepted / drafted if drafted else 0.0
    return ExactnessResult(samples, statistic, dof, p_value, acceptance, alpha, drafted)
