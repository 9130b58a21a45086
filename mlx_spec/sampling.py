"""Logits -> the distribution actually sampled from, shared by target and draft.

The acceptance rule is exact only if p (target) and q (draft) are the
distributions the tokens are really drawn from, so both models' logits go
through the *same* transform, mlx-lm's: top-p, min-p and top-k filtering of
the model's own log-probabilities, then the temperature, then a normalised
log-softmax. Everything here is lazy, pure and
works on any leading shape (..., V).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import mlx.core as mx

from .arguments import check_arguments, check_instance

DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_MIN_P = 0.0


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn; temp == 0 means greedy (argmax)."""

    temp: float = DEFAULT_TEMP
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    min_p: float = DEFAULT_MIN_P
    min_tokens_to_keep: int = 1  # with min_p, as mlx-lm's make_sampler
    # A sampler mlx-spec cannot read (mlx-lm's signature: log-probabilities (1, V) -> token
    # (1,)): it draws every token, target's and drafts', from the model's own log-probabilities,
    # and the acceptance rule becomes the one exact for any sampler (acceptance.sampler_match).
    sampler: Optional[Callable[[mx.array], mx.array]] = None

    def __post_init__(self):
        check_arguments(temp=self.temp, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        min_tokens_to_keep=self.min_tokens_to_keep)

    @property
    def greedy(self) -> bool:
        return self.temp == 0 and self.sampler is None


def sampling_of(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                sampler=None) -> SamplingConfig:
    """The SamplingConfig of an API call's `temp`, `top_p`, `top_k`, `min_p`, or of mlx-lm's
    `sampler=` in their place (`read_sampler`); ValueError for both at once."""
    sampling = SamplingConfig(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    if sampler is None:
        return sampling
    if sampling != SamplingConfig():
        raise ValueError("Pass either sampler or temp/top_p/top_k/min_p, not both.")
    if not callable(sampler):
        raise ValueError("sampler must be a callable, as mlx_lm.sample_utils.make_sampler "
                         "returns.")
    return read_sampler(sampler)


def read_sampler(sampler) -> SamplingConfig:
    """The SamplingConfig of an mlx-lm sampler: read from what `make_sampler` built
    (temperature, top-p, min-p, top-k), or, for any other callable (XTC, a
    sampler of one's own), a config that hands every draw to it."""
    from mlx_lm.sample_utils import greedy_sampler

    if sampler is greedy_sampler:
        return SamplingConfig()
    fields = _made_by_make_sampler(sampler)
    return SamplingConfig(**fields) if fields is not None else SamplingConfig(temp=1.0, sampler=sampler)


def _made_by_make_sampler(sampler) -> Optional[dict]:
    """make_sampler's closure: `temp` and one lambda per filter, each closing over its parameters."""
    if getattr(sampler, "__module__", None) != "mlx_lm.sample_utils":
        return None
    try:
        outer = inspect.getclosurevars(sampler).nonlocals
        if set(outer) != {"sampling_methods", "temp"}:
            return None
        fields = {"temp": float(outer["temp"])}
        for method in outer["sampling_methods"]:
            names = inspect.getclosurevars(method).nonlocals
            if set(names) == {"top_p"}:
                fields["top_p"] = float(names["top_p"])
            elif set(names) == {"min_p", "min_tokens_to_keep"}:
                fields["min_p"] = float(names["min_p"])
                fields["min_tokens_to_keep"] = names["min_tokens_to_keep"]
            elif set(names) == {"top_k"}:
                fields["top_k"] = names["top_k"]
            else:  # XTC (random per draw) or a filter this version does not know
                return None
        return fields
    except (TypeError, ValueError):
        return None


def check_sampling(sampling) -> None:
    """ValueError unless `sampling` is a SamplingConfig (the API's `sampling` argument)."""
    check_instance("sampling", sampling, SamplingConfig)


def model_logprobs(logits: mx.array) -> mx.array:
    """The model's own normalised log-probabilities, before any sampling transform
    (what mlx-lm reports as `logprobs`)."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def logprobs_from_logits(logits: mx.array, config: SamplingConfig) -> mx.array:
    """Normalised log-probabilities of the distribution sampled from.

    mlx-lm's order (`make_sampler`): top-p, then min-p, then top-k filter the
    model's own (untempered) log-probabilities, and the temperature divides
    what is left. Filtered-out tokens get -inf. With temp == 0 this is the
    plain log-softmax (greedy decoding takes its argmax).
    """
    logits = _transformed(logits, config)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def probs_from_logits(logits: mx.array, config: SamplingConfig) -> mx.array:
    """exp(logprobs_from_logits(logits, config)), normalised in one pass of exp (a softmax of
    the transformed logits) where logprobs_from_logits and its exp take two: on a CPU exp is
    most of the prompt look's arithmetic."""
    return mx.softmax(_transformed(logits, config), axis=-1)


def _transformed(logits: mx.array, config: SamplingConfig) -> mx.array:
    """The logits of the distribution sampled from, in float32, not yet normalised (see
    logprobs_from_logits)."""
    if config.greedy or config.sampler is not None:  # (a sampler filters for itself)
        return logits.astype(mx.float32)
    if 0 < config.top_p < 1.0:  # the only filter that needs normalised probabilities
        logits = _top_p(model_logprobs(logits), config.top_p)
    else:
        logits = logits.astype(mx.float32)
    if config.min_p > 0.0:  # relative to the top token: no normalising needed
        logits = _min_p(logits, config.min_p, config.min_tokens_to_keep)
    if 0 < config.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -config.top_k][..., None]
        logits = mx.where(logits < kth, -mx.inf, logits)
    if config.temp != 1.0:
        logits = logits * (1.0 / config.temp)
    return logits


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Drop every token whose more likely tokens already hold top_p of the mass (a
    token tied with the last one kept stays, as in mlx-lm)."""
    ascending = mx.sort(logprobs, axis=-1)
    probs = mx.exp(ascending)
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(ascending, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _min_p(logits: mx.array, min_p: float, min_tokens_to_keep: int) -> mx.array:
    """Drop tokens less likely than min_p times the top token, keeping the
    `min_tokens_to_keep` most likely whatever their probability."""
    top = mx.max(logits, axis=-1, keepdims=True)
    drop = logits < top + math.log(min_p)
    if min_tokens_to_keep > 1:
        kth = mx.sort(logits, axis=-1)[..., -min_tokens_to_keep][..., None]
        drop = mx.logical_and(drop, logits < kth)
    return mx.where(drop, -mx.inf, logits)


def sample(logprobs: mx.array, config: SamplingConfig) -> mx.array:
    """Draw one token per row of (..., V) log-probabilities (lazy)."""
    if config.sampler is not None:  # row by row, each (1, V) as mlx-lm calls it
        rows = logprobs.reshape(-1, logprobs.shape[-1])
        drawn = [config.sampler(rows[i:i + 1]).reshape(-1) for i in range(rows.shape[0])]
        return mx.concatenate(drawn).reshape(logprobs.shape[:-1]).astype(mx.uint32)
    if config.greedy:
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
    return _categorical(logprobs).astype(mx.uint32)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _categorical(logprobs: mx.array) -> mx.array:
    """mx.random.categorical over the last axis, compiled with the global random state, as
    mlx-lm's sampler is: the same draw, built as one compiled graph per step (uncompiled it
    cost ~0.1 ms more per sampled plain step on a CPU: bench/results/plain-loop-openblas.md)."""
    return mx.random.categorical(logprobs, axis=-1)


@mx.compile
def keyed_categorical(logprobs: mx.array, key: mx.array) -> mx.array:
    """mx.random.categorical over the last axis with `key` (a batch row's own), compiled as
    _categorical is: the same draw as uncompiled."""
    return mx.random.categorical(logprobs, axis=-1, key=key)
