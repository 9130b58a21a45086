"""Text in, text out: mlx-lm-compatible `stream_generate` and `generate`.

Layered as in mlx-lm: `speculative_generate_step` yields token ids (no
tokenizer), `stream_generate` adds detokenizing, EOS handling and stats in a
response dataclass, `generate` returns the whole string.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Iterator, List, Optional, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptance import rule_name
from .arguments import EMBEDDINGS_BESIDE_A_HEAD, check_arguments, check_input_embeddings
from .assemble import assemble, check_calibration, draft_bridge
from .cache.quantize import KVQuantizer, check_kv_quantization
from .dflash import dflash_directory, is_dflash_model
from .eagle3 import eagle3_directory, is_eagle3_head
from .defaults import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_NGRAM, DEFAULT_MAX_TOKENS,
                       DEFAULT_QUANTIZED_KV_START, default_prefill_step_size)
from .drafters.prompt_lookup import on_by_default
from .drafters.tree import with_trees
from .judge import stop_cut
from .loading import check_pair, vocab_size
from .loop import Round, generate_rounds
from .memory import wired_limit
from .policy import DEFAULT_MAX_DRAFT_TOKENS
from .sampling import SamplingConfig, check_sampling, sampling_of
from .session import Session
from .stats import GenerationStats, StatsRecorder

NO_LIMIT = sys.maxsize  # max_tokens=-1, as in mlx-lm: until a stop token or the caller stops

@dataclass(frozen=True)
class GenerationResponse:
    """One streamed token, as in mlx-lm, plus the running speculation stats."""

    text: str  # new text segment (may be empty)
    token: int
    logprobs: mx.array  # (V,) target log-probabilities at this position
    from_draft: bool  # proposed by a drafter and accepted by the target
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: Optional[str] = None  # "stop", "length" or None
    source: str = "target"  # "draft", "lookup", "mtp" or "target"
    stats: Optional[GenerationStats] = None


def _as_tokens(tokenizer, prompt) -> List[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("speculative_generate_step takes token ids; use stream_generate "
                             "or generate for a text prompt.")
        if not prompt:
            raise ValueError("The prompt is empty; give some text to continue.")
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not prompt.startswith(bos)
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
    elif isinstance(prompt, mx.array):
        tokens = prompt.tolist()  # 1-D and integer: check_prompt saw to it
    else:
        tokens = [int(t) for t in prompt]
    if len(tokens) == 0:
        raise ValueError("The prompt is empty; give some text or token ids to continue.")
    return tokens


def _check_token_ids(tokens: List[int], size: int) -> None:
    bad = [t for t in tokens if not 0 <= t < size]
    if bad:
        raise ValueError(f"prompt holds token id {bad[0]}, outside the target model's "
                         f"vocabulary (0..{size - 1}).")


def speculative_generate_step(
    prompt: List[int],
    model,
    draft_model=None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    num_draft_tokens: Optional[int] = None,
    sampling: SamplingConfig = SamplingConfig(),
    adaptive: Optional[bool] = None,
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
    auto_off: bool = True,
    draft_confidence: float = 0.0,
    prompt_lookup: Optional[bool] = None,
    prompt_lookup_max_ngram: int = DEFAULT_MAX_NGRAM,
    suffix=None,
    prompt_cache=None,
    max_kv_size: Optional[int] = None,
    kv_bits: Optional[int] = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prefill_step_size: Optional[int] = None,
    prompt_progress_callback=None,
    policy=None,
    machine=None,
    accept=None,
    stop_tokens=(),
    calibration="auto",
    mtp_weights=None,
    logits_processors=None,
    input_embeddings=None,
    draft_tokenizer=None,
    target_tokenizer=None,
    tree=None,
) -> "RoundStream":
    """Rounds of token ids from `model` (the target), speculating with the drafters.

    Returns an iterator of `Round`s (validation happens here, prefill on the
    first `next`). No round goes past `max_tokens` or an accepted token of
    `stop_tokens`. A reused `prompt_cache` (target layers, then the draft's)
    holds the prompt and the rounds' tokens, without the last one after a
    speculative round (the next pass starts from it) and with it after plain
    steps (as mlx-lm's generate_step); `stream_generate` gives mlx-lm's
    contract on top.

    With no draft model and `prompt_lookup=False` it decodes the target alone.
    `num_draft_tokens` pins k; left as None the default policy chooses
    (`adaptive=True`: k chosen each round from measured acceptance and cost,
    with an automatic fall-back to plain decoding when speculation loses).
    `draft_confidence` stops drafting when the draft's top probability falls
    below it (costs one host sync per draft step). `prompt_lookup` drafts from
    n-grams of the context (alone, or in front of the draft model); None (the
    default) turns it on for any target at every temperature, except in front of
    a draft model, MTP head or block drafter at temperature > 0 (there it took
    rounds from the drafter's better proposals), and leaves it off for a target
    whose cache no rewind path handles. The adaptive policy keeps it only while it
    pays. Its proposals may run up to DEFAULT_MAX_LOOKUP_TOKENS under the adaptive
    policy (they cost no draft steps).

    `suffix` drafts from everything seen before: True searches the process's
    shared `SuffixIndex` (every earlier call's prompt and output, and this
    one's), a `SuffixIndex` searches that one (an app keeps it across calls,
    and may save it to a file); the call's own text joins the index. It goes
    in front of the other drafters; prompt lookup, when on, goes behind it, for
    the matches shorter than 4 tokens.

    `calibration`: "auto" (the default) starts the adaptive policy from this
    machine's stored calibration (`mlx-spec tune`) when there is one for the
    target; None starts cold; a `Calibration` object is used as given.

    `machine`: a `mlx_spec.policy.MachineRecord` kept across calls of the same models (a
    server's requests): the adaptive policy starts from what the last call's measured of
    the machine (plain steps, verify and draft costs; nothing of its text) and leaves its
    own measurements there for the next.

    `draft_model="mtp"`: the target drafts for itself with its multi-token-
    prediction layer (qwen3_next, qwen3_5, deepseek_v3, glm4_moe), weights
    from `mtp_weights` (a local directory or Hugging Face repo of the
    original checkpoint) or else from the directory `mlx_spec.load` read the
    model from. A reused `prompt_cache` then holds the target's layers only.

    `input_embeddings` (N, H), as mlx-lm: the target prefills from them in
    place of the prompt's own embeddings; `prompt` is then their N token ids,
    which a draft model and prompt lookup draft from, or empty (drafting off).

    `logits_processors` (mlx-lm's, e.g. from `make_logits_processors`) change
    the target's logits at every verified position, each given the tokens
    before it (drafts included), and the draft model's logits the same way;
    the output is exactly the processed distribution's.

    A draft model of another vocabulary drafts across it when its tokenizer is known:
    `draft_tokenizer` (else the one `mlx_spec.load` read with it) and the target's
    (`target_tokenizer`, else the one `load` read with the target; stream_generate passes
    its own). Each round proposes the draft's text re-read by the target's tokenizer, or the
    draft's distribution restricted to the tokens both share (docs/drafting.md); exact either
    way. A reused `prompt_cache` holds the target's layers, then the draft's.

    `kv_bits`, `kv_group_size`, `quantized_kv_start`: mlx-lm's KV cache quantization. The
    target's attention layers are quantized to `kv_bits` once its cache holds
    `quantized_kv_start` tokens, at the token where mlx-lm's generate_step quantizes them (no
    verify pass reaches past it), so the text is mlx-lm's with the same arguments; sliding
    windows, recurrent state and the draft's cache stay as they are (cache/quantize.py).
    `prefill_step_size` (None: 512; with kv_bits or max_kv_size, mlx-lm's 2048, whose chunks
    decide where a long prompt's cache is quantized and what a chunk sees of a window's kept
    prefix).

    `tree`: a `(depth, width)` pair proposes token trees of that shape from the draft
    model, an MTP, EAGLE-3, DFlash or DFlash2 drafter, prompt lookup and suffix drafting, verified in
    one pass each (docs/drafting.md, "Token trees"); False keeps chains; None lets the policy
    choose the width of the draft model's (or a head's, or a DFlash drafter's) trees each
    round (1, the chain, up to 3: docs/drafting.md, "The policy"). Chains also where a tree
    cannot be verified (recurrent state or chunked caches, logits processors, a custom
    `accept` or sampler, a sharded target) and from a draft of another tokenizer.
    """
    check_arguments(**locals())  # every parameter, by name
    check_sampling(sampling)
    max_tokens = NO_LIMIT if max_tokens == -1 else max_tokens
    check_calibration(calibration)
    if input_embeddings is not None:
        prompt, draft_model, prompt_lookup, suffix = _with_embeddings(
            model, prompt, input_embeddings, draft_model, prompt_lookup, suffix, logits_processors)
    prompt = _as_tokens(None, prompt)
    _check_token_ids(prompt, vocab_size(model))
    if kv_bits is not None:
        check_kv_quantization(model, kv_bits, kv_group_size, max_kv_size)
    if prefill_step_size is None:
        prefill_step_size = default_prefill_step_size(kv_bits, max_kv_size)
    parts = assemble(
        model, draft_model, sampling, prompt_cache=prompt_cache,
        num_draft_tokens=num_draft_tokens, adaptive=adaptive, max_draft_tokens=max_draft_tokens,
        auto_off=auto_off, draft_confidence=draft_confidence, prompt_lookup=prompt_lookup,
        prompt_lookup_max_ngram=prompt_lookup_max_ngram, max_kv_size=max_kv_size, policy=policy,
        machine=machine, calibration=calibration, mtp_weights=mtp_weights,
        logits_processors=logits_processors,
        suffix=suffix, tokenizer=target_tokenizer, draft_tokenizer=draft_tokenizer)
    quantizer = None if kv_bits is None else KVQuantizer(
        parts.target, kv_bits, kv_group_size, quantized_kv_start,
        shown=[prompt_cache] if prompt_cache is not None else [])
    drafters = with_trees(parts.drafters, tree, parts.target, sampling,
                          accept is None and not logits_processors and parts.agree is None)
    rounds = generate_rounds(
        prompt, parts.target, drafters, parts.policy, sampling=sampling,
        max_tokens=max_tokens, prefill_step_size=prefill_step_size, stop_tokens=stop_tokens,
        prompt_progress_callback=prompt_progress_callback, accept=accept, agree=parts.agree,
        logits_processors=logits_processors, input_embeddings=input_embeddings,
        kv_quantizer=quantizer)
    session = Session(parts.target, parts.draft, parts.target.length, prompt_cache, parts.earlier,
                      quantizer=quantizer)
    bridges = [d.bridge for d in parts.drafters if hasattr(d, "bridge")]  # another vocabulary
    return RoundStream(rounds, session, parts.policy, bridges[0].overlap if bridges else None)


def _with_embeddings(model, prompt, input_embeddings, draft_model, prompt_lookup, suffix,
                     processors):
    """(prompt ids, draft model, prompt lookup, suffix) for a call given input_embeddings, or
    ValueError."""
    ids = [] if prompt is None else list(prompt.tolist() if isinstance(prompt, mx.array) else prompt)
    check_input_embeddings(model, input_embeddings, len(ids))
    if draft_model == "mtp" or is_dflash_model(draft_model) or is_eagle3_head(draft_model) or \
            isinstance(draft_model, (str, os.PathLike)) and \
            (dflash_directory(draft_model) or eagle3_directory(draft_model)):
        raise ValueError(EMBEDDINGS_BESIDE_A_HEAD)
    if ids:
        return ids, draft_model, prompt_lookup, suffix
    if processors:
        raise ValueError("logits_processors need the prompt's token ids with input_embeddings.")
    if draft_model is not None or prompt_lookup or suffix:
        warnings.warn("input_embeddings without token ids: drafting is off (drafters read "
                      "token ids); the target decodes alone.", stacklevel=3)
    return [0] * input_embeddings.shape[0], None, False, None  # placeholder ids: nothing reads them


class RoundStream:
    """The rounds of one call (an iterator, like a generator) and the caches they advance."""

    def __init__(self, rounds: Iterator[Round], session: Session, policy=None,
                 vocab_overlap: Optional[float] = None):
        self._rounds = rounds
        self.session = session
        self.policy = policy
        self.vocab_overlap = vocab_overlap  # a draft of another tokenizer: see GenerationStats

    def __iter__(self):
        return self

    def __next__(self) -> Round:
        return next(self._rounds)

    def close(self) -> None:
        self._rounds.close()


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, List[int], mx.array],
    draft_model=None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    num_draft_tokens: Optional[int] = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    prompt_cache_live: bool = True,
    sampler=None,
    **kwargs,
) -> Iterator[GenerationResponse]:
    """Generate text from `model`, speculating with `draft_model` when given.

    Mirrors `mlx_lm.stream_generate`. `num_draft_tokens` pins k (None: the
    default policy). Extra keyword arguments go to `speculative_generate_step`
    (adaptive, auto_off, draft_confidence, prompt_lookup, prompt_cache,
    prefill_step_size, logits_processors, ...).

    Sampling: `temp`, `top_p`, `top_k`, `min_p`, or mlx-lm's `sampler=` in
    their place. A sampler made by mlx-lm's `make_sampler` is read back into
    those parameters (the residual acceptance rule); any other callable draws
    every token itself and acceptance keeps a draft only while it equals the
    sampler's draw at that position (exact for any sampler; `stats.rule` says
    which rule ran).

    `prompt_cache_live` (with a reused `prompt_cache`): True, mlx-lm's
    contract, shows the caller's cache holding exactly the tokens handed out
    at every response, so the caller may stop anywhere, even keeping the
    generator open and reading the cache; it costs trims and lazy forwards
    that are dropped unread (the last token of a round is handed out after the
    next round, whose verify pass feeds it). Either way the cache is settled
    for good when the generator ends, is closed or collected, or the next call
    takes the cache over. False: nothing is shown mid-stream and no token
    waits for the next round.
    """
    check_arguments(model=model, tokenizer=tokenizer, prompt=prompt, draft_model=draft_model,
                    max_tokens=max_tokens, num_draft_tokens=num_draft_tokens, temp=temp,
                    top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                    prompt_cache_live=prompt_cache_live, sampler=sampler, **kwargs)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    sampling = sampling_of(temp, top_p, top_k, min_p, sampler)
    if isinstance(draft_model, os.PathLike):
        draft_model = str(draft_model)
    if _is_loaded_draft_model(draft_model) and draft_bridge(  # "mtp", a path, DFlash: later
            model, draft_model, tokenizer, kwargs.get("draft_tokenizer")) is None:
        check_pair(model, draft_model, tokenizer)
    embeddings = kwargs.get("input_embeddings")
    tokens = [] if embeddings is not None and _is_empty(prompt) else _as_tokens(tokenizer, prompt)
    max_tokens = NO_LIMIT if max_tokens == -1 else max_tokens
    if seed is not None:
        mx.random.seed(seed)

    if seed is not None and not sampling.greedy and kwargs.get("adaptive") is None:
        # The adaptive k follows timings, and the random stream follows k: a seeded
        # sampling run is reproducible only with a fixed k (the default one here).
        kwargs["adaptive"] = False
        if kwargs.get("prompt_lookup") is None:  # at a fixed k it would have no off switch
            kwargs["prompt_lookup"] = on_by_default(draft_model is not None, False, seeded=True)
    eos = set(tokenizer.eos_token_ids)
    rounds = speculative_generate_step(
        tokens, model, draft_model, max_tokens=max_tokens,
        num_draft_tokens=num_draft_tokens, sampling=sampling, stop_tokens=eos,
        target_tokenizer=tokenizer, **kwargs,
    )
    reused = kwargs.get("prompt_cache") is not None
    live = reused and prompt_cache_live  # held at every response, not only at the end
    recorder = StatsRecorder(len(tokens), rounds.policy.describe().get("calibrated"),
                             rule_name(sampling), rounds.vocab_overlap)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    session = rounds.session
    seen = list(tokens)  # the prompt, then every token the caller is given
    started = False  # caches are only settled once generation got going
    with wired_limit(model, None if isinstance(draft_model, str) else draft_model):
        try:
            handed = _handed_out(rounds, eos, max_tokens, recorder,
                                 session if live else None, len(tokens))
            for token, round_, i, finish, upcoming in handed:
                started = True
                session.seen = seen  # from now on a later call settles it if this one did not
                seen.append(token)
                if finish != "stop":  # the EOS is not text
                    detokenizer.add_token(token)
                if finish is not None:
                    detokenizer.finalize()
                if live:  # what the caller has, should it stop here (the last token too)
                    session.hold(seen, upcoming)
                recorder.handed()
                yield _response(detokenizer.last_segment, token, round_, i, recorder, finish)
                session.release()
        finally:
            if reused and started:  # for good once the stream stops, however it stops
                session.settle(seen)


def _is_empty(prompt) -> bool:
    return prompt is None or (len(prompt) == 0 if not isinstance(prompt, mx.array) else prompt.size == 0)


def _is_loaded_draft_model(draft_model) -> bool:
    return draft_model is not None and not isinstance(draft_model, str) and \
        not is_dflash_model(draft_model) and not is_eagle3_head(draft_model)


def _handed_out(rounds, eos: set, max_tokens: int, recorder, session, prompt_len: int):
    """(token, round, index in round, finish reason, the tokens after it in this batch) for
    each token the caller gets.

    With a reused prompt cache (`session` given) the last token of a round
    that is not in the target cache yet is handed out after the next round,
    whose verify pass puts it there (as mlx-lm's cache holds every token it
    yielded). A plain step has already fed it: nothing waits.
    """
    emitted = 0
    deferred = []
    for round_ in rounds:
        recorder.prompt_done()
        wanted, finish = _cut_round(round_.tokens, eos, max_tokens - emitted)
        recorder.record(round_)
        emitted += len(wanted)
        items = deferred + [(t, round_, i, None) for i, t in enumerate(wanted)]
        if finish == "length":
            items[-1] = items[-1][:3] + ("length",)
        elif finish == "stop":  # as in mlx-lm, the last response carries the EOS token
            items.append((round_.tokens[len(wanted)], round_, len(wanted), "stop"))
        fed = session.target.length - session.start if session is not None else 0
        waits = session is not None and finish is None and fed < prompt_len + emitted
        deferred = [items.pop()] if waits and items else []
        tokens = [item[0] for item in items]
        for j, item in enumerate(items):
            yield item + (tokens[j + 1:],)
        if finish is not None:
            return
    for item in deferred:
        yield item + ([],)


def _cut_round(tokens: List[int], eos: set, remaining: int):
    """The part of a round the caller gets: up to `remaining` tokens, stopping before EOS."""
    wanted = stop_cut(tokens[:remaining], eos)
    if wanted and wanted[-1] in eos:
        return wanted[:-1], "stop"
    return wanted, ("length" if len(wanted) >= remaining else None)


def _response(text, token, round_: Round, i, recorder, finish) -> GenerationResponse:
    stats = recorder.snapshot()
    from_draft = i < round_.num_accepted
    return GenerationResponse(
        text=text, token=token, logprobs=round_.logprobs[i], from_draft=from_draft,
        prompt_tokens=stats.prompt_tokens, prompt_tps=stats.prompt_tps,
        generation_tokens=stats.generation_tokens, generation_tps=stats.generation_tps,
        peak_memory=stats.peak_memory_gb, finish_reason=finish,
        source=round_.source if from_draft else "target", stats=stats,
    )


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """Return the whole generated text; `verbose=True` prints it and the stats."""
    check_arguments(verbose=verbose)
    text = ""
    response = None
    if verbose:
        print("=" * 10)
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if response is not None and response.stats is not None:
            print(response.stats.summary())
        sys.stdout.flush()
    return text
