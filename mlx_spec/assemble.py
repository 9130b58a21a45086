"""API arguments -> what the loop runs: caches, drafters, the policy, the ranks' agreement.

`assemble` is the one place that turns `speculative_generate_step`'s
arguments (already checked where they entered) into a target `ModelCache`,
the drafters in the order they are asked, the draft-length policy (from a
stored calibration when there is one) and, for a sharded target, the wrappers
that make every rank take rank 0's drafts and timings.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import mlx.core as mx

from .arguments import check_instance
from .cache import (DEFAULT_RESERVE, ModelCache, cache_length, check_prompt_cache,
                    check_rewindable, make_cache, make_rewindable, unsupported_kinds)
from .calibration import Calibration, dflash_key, eagle3_key, load_calibration, mtp_key
from .calibration.record import ROUND_K
from .costmodel import CostPrior
from .defaults import DEFAULT_MAX_LOOKUP_TOKENS
from .dflash import DFlashModel, check_fits, dflash_directory, is_dflash_model, load_dflash
from .dflash.taps import decoder_layers, tap_capture
from .distributed.agreement import agree_across_ranks
from .eagle3 import eagle3_directory, is_eagle3_head, load_eagle3
from .eagle3 import check_fits as check_eagle3_fits
from .distributed.group import sharding_group
from .drafters import (CrossTokenizerDrafter, DFlash2Drafter, DFlashDrafter, DraftModelDrafter,
                       MTPDrafter, PromptLookupDrafter, SuffixDrafter, SuffixIndex,
                       default_suffix_index)
from .drafters.eagle3 import Eagle3Drafter
from .drafters.prompt_lookup import PAIRED_MIN_NGRAM, behind_by_default, on_by_default
from .drafters.suffix import suffix_min_match
from .drafters.vocab_bridge import VocabBridge, bridge_for, too_small
from .loading import check_pair, tokenizer_of, vocab_size
from .loading import load as load_model
from .mtp import load_mtp, split_target
from .policy import (DEFAULT_ACCEPTANCE_PRIOR, FREE_SOURCES, SAMPLING_ACCEPTANCE_PRIOR,
                     make_policy)
from .precision import prepare_drafter
from .sampling import SamplingConfig
from .session import held_context, held_tokens, take_over


@dataclass
class Assembly:
    """What one call's rounds run on."""

    target: ModelCache
    drafters: List  # asked in this order; the first proposal wins
    # The drafter whose own state a session settles: a draft model's cache, a DFlash context
    draft: Optional[Union[DraftModelDrafter, DFlashDrafter]]
    policy: object  # a DraftPolicy
    agree: Optional[Callable[[mx.array], mx.array]]  # rank 0's values (a sharded target)
    earlier: List[int]  # the tokens a reused cache held before the call, when known ([] if not)


def assemble(model, draft_model, sampling: SamplingConfig, *, prompt_cache, num_draft_tokens,
             adaptive, max_draft_tokens, auto_off, draft_confidence, prompt_lookup,
             prompt_lookup_max_ngram, max_kv_size, policy, calibration,
             mtp_weights, logits_processors=None, suffix=None, tokenizer=None,
             draft_tokenizer=None, machine=None) -> Assembly:
    """Caches, drafters, policy and agreement for one call (see speculative_generate_step)."""
    target_vocab = vocab_size(model)
    if isinstance(draft_model, os.PathLike):
        draft_model = str(draft_model)
    mtp_head = mtp_head_for(model, draft_model, mtp_weights)
    if mtp_head is not None:
        mtp_head = mtp_head.drafting()  # float32 on the CPU backend (precision.py)
        draft_model = None  # no second model: no draft cache, no pair to check
    block_drafter = block_drafter_for(model, draft_model)
    eagle3_head = eagle3_head_for(model, draft_model) if block_drafter is None else None
    if block_drafter is not None or eagle3_head is not None:
        draft_model = None  # it reads the target's hidden states: no cache of its own to keep
    elif isinstance(draft_model, str):  # the directory of an ordinary draft model
        draft_model = load_model(draft_model)[0]
    bridge = None  # to a draft of another vocabulary
    if draft_model is not None:
        draft_model, bridge = pair_for(model, draft_model, tokenizer, draft_tokenizer)
    if draft_model is not None:
        prepare_drafter(draft_model, model)  # float32 on the CPU backend (precision.py)
    drafting = draft_model is not None or mtp_head is not None or block_drafter is not None \
        or eagle3_head is not None
    suffix_index = suffix_index_for(suffix)
    # At T > 0 behind a paid drafter, lookup is asked only while the drafter sits out (an
    # adaptive policy's fallback: policy.fall_back); in front of it, it would take its rounds.
    fallback = prompt_lookup is None and behind_by_default(drafting, sampling.greedy)
    if prompt_lookup is None:  # on, but never where it would refuse what plain decoding does
        prompt_lookup = on_by_default(drafting, sampling.greedy) and (
            drafting or suffix_index is not None or not unsupported_kinds(make_cache(model)))
    block = block_drafter.dflash_config.block_size if block_drafter is not None else 0
    reserve = max(DEFAULT_RESERVE,
                  max(num_draft_tokens or 0, max_draft_tokens, DEFAULT_MAX_LOOKUP_TOKENS,
                      block) + 2)
    speculating = drafting or prompt_lookup or suffix_index is not None
    take_over(prompt_cache)  # an earlier call left open settles it first
    target_cache, draft_cache = _caches(prompt_cache, model, draft_model, max_kv_size,
                                        speculating, reserve)
    earlier = held_tokens(prompt_cache, cache_length(target_cache))
    drafters = []
    if suffix_index is not None:  # in front: it knows the request's text and earlier ones'
        drafters.append(SuffixDrafter(suffix_index, target_vocab, sampling.greedy,
                                      min_match=suffix_min_match(prompt_lookup, drafting)))
    if prompt_lookup:
        # In front of a draft model a single-token match is too weak a signal:
        # in code the last token has nearly always occurred before.
        min_ngram = min(PAIRED_MIN_NGRAM, prompt_lookup_max_ngram) if drafting else 1
        drafters.append(PromptLookupDrafter(target_vocab, sampling.greedy,
                                            max_ngram=prompt_lookup_max_ngram, min_ngram=min_ngram,
                                            context=earlier))
    draft = None
    if draft_model is not None and bridge is not None:  # it keeps its own cache in step
        drafters.append(CrossTokenizerDrafter(draft_model, bridge, sampling, target_vocab,
                                              vocab_size(draft_model), draft_cache,
                                              context=earlier))
    elif draft_model is not None:
        draft = DraftModelDrafter(draft_model, sampling, target_vocab, draft_cache,
                                  confidence=draft_confidence, processors=logits_processors)
        drafters.append(draft)
    if mtp_head is not None:
        drafters.append(MTPDrafter(mtp_head, sampling))
    if block_drafter is not None:  # with the earlier turns' context a reused cache kept
        block_class = DFlash2Drafter if block_drafter.dflash_config.dflash2 else DFlashDrafter
        draft = block_class(block_drafter, model, sampling, start=cache_length(target_cache),
                            context=held_context(prompt_cache))
        drafters.append(draft)
    if eagle3_head is not None:
        drafters.append(Eagle3Drafter(eagle3_head, model, sampling))
    if policy is None:
        if sharding_group(model) is not None:  # a calibration measures one machine: start cold
            calibration = None
        prior = cost_prior(calibration, model, draft_model, sampling, mtp_head, block_drafter,
                           eagle3_head)
        acceptance = DEFAULT_ACCEPTANCE_PRIOR if sampling.greedy else SAMPLING_ACCEPTANCE_PRIOR
        policy = make_policy(num_draft_tokens, adaptive, max_draft_tokens, auto_off, prior,
                             acceptance_prior=acceptance,
                             block_tokens={"dflash": block - 1} if block else None)
    if machine is not None:  # what earlier calls measured of the machine (a server's)
        machine.hand_on(policy)
    if fallback and hasattr(policy, "fall_back"):
        paid = [d.source for d in drafters if d.source not in FREE_SOURCES]
        policy.fall_back("lookup", paid)
        # asked only while the drafters sit out, it is lookup alone: a 1-gram match will do
        drafters.insert(len(drafters) - len(paid), PromptLookupDrafter(
            target_vocab, sampling.greedy, max_ngram=prompt_lookup_max_ngram, context=earlier))
    # A sharded target: every rank takes rank 0's drafts, decisions and timings (no-op otherwise).
    drafters, policy, agree = agree_across_ranks(model, drafters, policy, draft_confidence)
    # A reused cache is shown at each response by a trim: sliding windows must rewind too.
    target = ModelCache(model, target_cache, rewindable=speculating or prompt_cache is not None,
                        reserve=reserve, split=split_target(model) if mtp_head is not None else None,
                        capture=tap_capture(model, block_drafter.dflash_config.target_layer_ids)
                        if block_drafter is not None else eagle3_capture(model, eagle3_head))
    return Assembly(target, drafters, draft, policy, agree, earlier)


def draft_bridge(target_model, draft_model, tokenizer=None,
                 draft_tokenizer=None) -> Optional[VocabBridge]:
    """The bridge to the draft's vocabulary when it differs from the target's, else None.

    The tokenizers are the ones given, else the ones `load` read with each model. Without
    both nothing is known (None: `check_pair` judges by sizes); a draft_tokenizer given
    without the target's is one sentence.
    """
    tokenizer = tokenizer if tokenizer is not None else tokenizer_of(target_model)
    if draft_tokenizer is not None and tokenizer is None:
        raise ValueError("draft_tokenizer needs the target's tokenizer too: pass "
                         "target_tokenizer=, or load the target with mlx_spec.load.")
    draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else tokenizer_of(draft_model)
    if draft_tokenizer is None or tokenizer is None:
        return None
    return bridge_for(tokenizer, draft_tokenizer)


def pair_for(model, draft_model, tokenizer, draft_tokenizer):
    """(the draft model or None, the bridge to its vocabulary or None): a draft of the
    target's vocabulary is checked (`check_pair`); one of another gets a bridge, or is left out
    with a warning when the two share too little to help."""
    bridge = draft_bridge(model, draft_model, tokenizer, draft_tokenizer)
    if bridge is None:
        check_pair(model, draft_model)
        return draft_model, None
    if too_small(bridge):
        warnings.warn(f"The draft's vocabulary shares only {bridge.shared} tokens with the "
                      "target's: too few for its drafts to help, so the draft is off.",
                      stacklevel=4)
        return None, None
    return draft_model, bridge


def _split_prompt_cache(prompt_cache, target_model, draft_model):
    """The caller's (target layers, draft layers or None), each checked against its model."""
    if not isinstance(prompt_cache, list):
        raise ValueError("prompt_cache must be a list of caches, as make_prompt_cache(model) "
                         "returns (target layers first, then the draft's).")
    n = len(make_cache(target_model))
    if draft_model is None:
        check_prompt_cache(prompt_cache, target_model, "target")
        return prompt_cache, None
    if len(prompt_cache) == n:
        raise ValueError("prompt_cache holds only the target's layers; with a draft model pass "
                         "make_cache(target_model) + make_cache(draft_model).")
    check_prompt_cache(prompt_cache[:n], target_model, "target")
    check_prompt_cache(prompt_cache[n:], draft_model, "draft")
    return prompt_cache[:n], prompt_cache[n:]


def _caches(prompt_cache, target_model, draft_model, max_kv_size, speculating: bool,
            reserve: int):
    """(target layers, draft layers or None): the caller's, checked, or new ones.

    When speculating or reusing a cache, sliding windows become rewindable (with
    room for the longest round) in the caller's list itself, so that a reused
    prompt cache stays the one in use; a kind no rewind path handles gets one
    sentence when speculating.
    """
    if prompt_cache is None:  # as mlx-lm: max_kv_size makes sliding windows of that size
        target_cache = make_cache(target_model, max_kv_size)
        draft_cache = make_cache(draft_model, max_kv_size) if draft_model is not None else None
        if speculating:
            for layers in (target_cache, draft_cache or []):
                make_rewindable(layers, reserve)
    else:
        target_cache, draft_cache = _split_prompt_cache(prompt_cache, target_model, draft_model)
        make_rewindable(prompt_cache, reserve)  # in the caller's list; the slices are re-cut
        n = len(target_cache)
        target_cache = prompt_cache[:n]
        draft_cache = prompt_cache[n:] if draft_cache is not None else None
    if speculating or prompt_cache is not None:  # rejected drafts, or a response's trim
        check_rewindable(target_cache, "target")
        if draft_cache is not None:
            check_rewindable(draft_cache, "draft")
    return target_cache, draft_cache


def check_calibration(calibration) -> None:
    if calibration is None or (isinstance(calibration, str) and calibration == "auto"):
        return
    check_instance("calibration", calibration, Calibration,
                   '"auto", None or a Calibration (mlx_spec.calibration)')


def suffix_index_for(suffix) -> Optional[SuffixIndex]:
    """The index `suffix` names: None/False none, True the process's shared one, or the
    caller's own `SuffixIndex`."""
    if suffix is None or suffix is False:
        return None
    if suffix is True:
        return default_suffix_index()
    check_instance("suffix", suffix, SuffixIndex, "None, True, False or a SuffixIndex")
    return suffix


def block_drafter_for(model, draft_model) -> Optional[DFlashModel]:
    """The DFlash drafter when draft_model is one (loaded, or the path of one), checked to fit
    the target; None for any other draft."""
    if isinstance(draft_model, str) and draft_model != "mtp":
        if dflash_directory(draft_model) is None:
            return None
        draft_model = load_dflash(draft_model)
    if not is_dflash_model(draft_model):
        return None
    check_fits(draft_model, model)
    if sharding_group(model) is not None:
        raise ValueError("A DFlash drafter reads the target's hidden states, which a sharded "
                         "target does not hold whole on every rank; draft with a draft model, "
                         "prompt lookup or MTP there.")
    return prepare_drafter(draft_model)


def eagle3_head_for(model, draft_model):
    """The EAGLE-3 head when draft_model is one (loaded, or the path of one), checked to fit
    the target; None for any other draft."""
    if isinstance(draft_model, str) and draft_model != "mtp":
        if eagle3_directory(draft_model) is None:
            return None
        draft_model = load_eagle3(draft_model)
    if not is_eagle3_head(draft_model):
        return None
    check_eagle3_fits(draft_model, model)
    if sharding_group(model) is not None:
        raise ValueError("An EAGLE-3 head reads the target's hidden states, which a sharded "
                         "target does not hold whole on every rank; draft with a draft model, "
                         "prompt lookup or MTP there.")
    return prepare_drafter(draft_model)


def eagle3_capture(model, head):
    """The target's taps an EAGLE-3 head reads (None without one)."""
    if head is None:
        return None
    return tap_capture(model, head.eagle3_config.tap_layers(len(decoder_layers(model))))


def mtp_head_for(model, draft_model, mtp_weights):
    """The target's MTP layer when draft_model is "mtp"."""
    if isinstance(draft_model, str) and draft_model == "mtp":
        return load_mtp(model, mtp_weights)
    if mtp_weights is not None:
        raise ValueError('mtp_weights is only used with draft_model="mtp"; pass both, or neither.')
    return None


def resolve_calibration(calibration, target_model) -> Optional[Calibration]:
    """A calibration argument as the policy reads it: "auto" is this machine's `mlx-spec tune`
    file for `target_model`, if any (a corrupt one is warned about and left out)."""
    if not (isinstance(calibration, str) and calibration == "auto"):
        return calibration
    try:
        return load_calibration(target_model)
    except ValueError as exc:  # a corrupt file must not stop generation
        warnings.warn(f"{exc} Starting without it.", stacklevel=3)
        return None


def cost_prior(calibration, target_model, draft_model, sampling,
               mtp_head=None, block_drafter=None, eagle3_head=None) -> Optional[CostPrior]:
    """The adaptive policy's starting point from a calibration (see the `calibration` argument),
    for a request of this `sampling`."""
    calibration = resolve_calibration(calibration, target_model)
    if calibration is None:
        return None
    steps, acceptance, extra = {"lookup": 0.0, "suffix": 0.0}, {}, {}
    measured_mtp = mtp_head is not None and any(fp.startswith("mtp:") for fp in calibration.drafts)
    measured_dflash = block_drafter is not None and \
        any(fp.startswith("dflash:") for fp in calibration.drafts)
    sources = {"draft": calibration.draft(draft_model) if draft_model is not None else None,
               # fingerprinting the layer reads its weights: only when a layer was measured
               "mtp": calibration.drafts.get(mtp_key(mtp_head)) if measured_mtp else None,
               # a step of 0: its one block pass per round is in the measured round's offset
               "dflash": calibration.drafts.get(dflash_key(block_drafter))
               if measured_dflash else None,
               "eagle3": calibration.drafts.get(eagle3_key(eagle3_head))
               if eagle3_head is not None and
               any(fp.startswith("eagle3:") for fp in calibration.drafts) else None}
    for source, draft in sources.items():
        if draft is None:
            continue
        steps[source] = draft.step_s
        parts = CostPrior(calibration.plain_step_s, dict(calibration.verify_s), steps)
        # What a real round measured beyond the sum of the parts (timed at other moments)
        offset = 0.0 if draft.round_s is None else \
            draft.round_s - parts.round_seconds(source, ROUND_K)
        if not sampling.greedy and draft.sampling_extra_s is not None:
            offset += draft.sampling_extra_s
        if offset:
            extra[source] = offset
        measured = draft.acceptance_at(0.0 if sampling.greedy else sampling.temp)
        if measured is not None:
            acceptance[source] = measured
        elif draft.acceptance is not None:  # only greedy measured: sampling accepts less, as a rule
            acceptance[source] = min(draft.acceptance, SAMPLING_ACCEPTANCE_PRIOR)
    return CostPrior(calibration.plain_step_s, dict(calibration.verify_s), steps, acceptance,
                     extra)
