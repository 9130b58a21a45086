"""`batch_generate`: many prompts at once, speculating, shaped like mlx-lm's batch_generate.

    from mlx_spec import load_default_pair, batch_generate
    target_model, draft_model, tokenizer = load_default_pair()
    result = batch_generate(target_model, tokenizer, ["def add(", "class Stack:"],
                            draft_model=draft_model, max_tokens=64)
    result.texts   # one string per prompt, in order

Every prompt is one row of a `BatchEngine`; all rows decode together and each
row's text is the one it would get alone (greedy: token for token; sampled:
from the same distribution, its own random stream). A draft of another tokenizer
(`draft_tokenizer=`, or the one `mlx_spec.load` kept) drafts for every row across the two
vocabularies, each row with a drafter of its own (cross.py). Rows beyond
`max_batch_size` wait and join as others finish (continuous batching).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import mlx.core as mx

from ..arguments import check_arguments
from ..defaults import DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_TOKENS, DEFAULT_PREFILL_STEP_SIZE
from ..sampling import sampling_of
from .engine import BatchEngine, check_batchable, is_draft_model
from .rows import RowRequest

DEFAULT_MAX_BATCH_SIZE = 16


@dataclass
class BatchResponse:
    texts: List[str]
    token_ids: List[List[int]]
    finish_reasons: List[str]
    stats: dict = field(default_factory=dict)  # tokens, seconds, tokens_per_s, rounds by k, ...
    # with return_prompt_caches (mlx-lm's): each row's cache at its end (target layers, then the
    # draft's), holding its prompt and output; with return_logprobs: the target's
    # log-probability of each token in token_ids
    caches: Optional[List[list]] = None
    logprobs: Optional[List[List[float]]] = None


def batch_generate(model, tokenizer, prompts: Sequence[Union[str, List[int]]], draft_model=None,
                   max_tokens: Union[int, Sequence[int]] = DEFAULT_MAX_TOKENS,
                   num_draft_tokens: Optional[int] = None,
                   max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                   temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                   seed: Optional[int] = None, prompt_lookup: Optional[bool] = None,
                   mtp_weights: Optional[str] = None,
                   max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                   prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
                   verbose: bool = False, tree=None, draft_tokenizer=None,
                   calibration="auto", auto_off: bool = True,
                   draft_confidence: float = 0.0, sampler=None,
                   logits_processors=None, prompt_caches=None,
                   return_prompt_caches: bool = False, return_token_ids: bool = True,
                   return_logprobs: bool = False) -> BatchResponse:
    """Generate for every prompt (text or token ids), speculating with `draft_model` (a
    loaded model, a loaded DFlash drafter or EAGLE-3 head, or "mtp": the target's own MTP head, from
    `mtp_weights` or the model's directory) and/or prompt lookup; `num_draft_tokens` pins k
    (0: plain batched decoding), None lets the batch policy choose it. `seed` gives row i the seed `seed + i`.
    A draft model of another vocabulary drafts across it when its tokenizer is known:
    `draft_tokenizer`, else the one `mlx_spec.load` read with it (docs/drafting.md).
    `tree=(depth, width)`: the rows of a draft model, the MTP / EAGLE-3 heads or a DFlash
    drafter propose token trees of that shape, each row its own, verified in the round's one
    pass (batch/trees.py), and prompt lookup and suffix drafting propose tries of the earlier
    text; rows of a draft of another tokenizer or a DFlash2 drafter, rows with logits
    processors, and targets with recurrent state keep chains. None: a row decoding alone
    proposes trees as wide as its policy chooses (as `generate`'s), rows beside others
    chains; False: chains. `calibration`: as speculative_generate_step's ("auto": this machine's `mlx-spec
    tune` file, if any; None: none; or a Calibration): a row decoding alone starts from it
    as a call does, and a row beside others from its acceptance at the row's temperature.
    `auto_off=False`: the policy never turns the drafts off (plain decoding is not a choice);
    `draft_confidence`: a row's draft model stops drafting at its first draft drawn with a top
    probability below it, as speculative_generate_step's. `sampler` and `logits_processors`, as
    mlx-lm's batch_generate takes them, for every row: a sampler made by mlx-lm's
    `make_sampler` is read back into temp/top_p/top_k/min_p (pass one or the other); any other
    callable draws each row's tokens itself (from MLX's global random state: no `seed`) and a
    draft is kept while it equals the sampler's draw (acceptance.sampler_match).
    mlx-lm's `return_prompt_caches` (each row's cache at its end, holding its prompt and
    output: `BatchResponse.caches`) and `return_logprobs` (the target's log-probability of
    each token: `BatchResponse.logprobs`); `token_ids` are always returned (with a row's stop
    token, which mlx-lm's leave out). mlx-lm's `prompt_caches` is refused in one sentence."""
    check_arguments(tree=tree)
    if prompt_caches is not None:
        raise ValueError("batch_generate takes no prompt_caches: a row's cache must come with "
                         "the tokens it holds; insert it with BatchEngine.insert(request, "
                         "cache, cached), or reuse it one prompt at a time with "
                         "stream_generate(prompt_cache=...).")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt.")
    budgets = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts.")
    for budget in budgets:
        check_arguments(max_tokens=budget)
    check_arguments(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
                    sampler=sampler, logits_processors=logits_processors)
    if num_draft_tokens is not None and (not isinstance(num_draft_tokens, int)
                                         or num_draft_tokens < 0):
        raise ValueError(f"num_draft_tokens must be an int >= 0 or None, got {num_draft_tokens!r}.")
    if not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}.")
    check_batchable(model, draft_model, tokenizer, draft_tokenizer)
    if is_draft_model(draft_model):
        from ..assemble import draft_bridge
        from ..loading import check_pair

        if draft_bridge(model, draft_model, tokenizer, draft_tokenizer) is None:  # one vocabulary
            check_pair(model, draft_model, tokenizer)
    sampling = sampling_of(temp, top_p, top_k, min_p, sampler)  # (with a seed: the first
    # insert refuses an opaque sampler, whose draws no row's key fixes)
    ids = [_token_ids(tokenizer, p, i) for i, p in enumerate(prompts)]
    engine = BatchEngine(model, draft_model, num_draft_tokens=num_draft_tokens,
                         max_draft_tokens=max_draft_tokens, prefill_step_size=prefill_step_size,
                         stop_tokens=tokenizer.eos_token_ids, mtp_weights=mtp_weights,
                         tokenizer=tokenizer, draft_tokenizer=draft_tokenizer, tree=tree,
                         calibration=calibration, auto_off=auto_off,
                         draft_confidence=draft_confidence)
    requests = [RowRequest(p, b, sampling, None if seed is None else seed + i, prompt_lookup,
                           logits_processors=tuple(logits_processors or ()),
                           logprobs=return_logprobs, keep_cache=return_prompt_caches)
                for i, (p, b) in enumerate(zip(ids, budgets))]
    start = time.perf_counter()
    waiting, uids = list(reversed(range(len(requests)))), {}
    tokens = [[] for _ in requests]
    reasons = [""] * len(requests)
    caches = [None] * len(requests)
    logprobs = [[] for _ in requests]
    cross_rules = {}  # a draft of another tokenizer: rule -> [rounds, drafted, accepted]
    trees = [0, 0]  # token trees: rounds, nodes verified (a round of a row)
    while waiting or engine.busy:
        while waiting and len(engine.rows) + len(engine.joining) < max_batch_size:
            i = waiting.pop()
            uids[engine.insert(requests[i])] = i
        outputs = engine.step()
        if return_logprobs:  # each token's, every row's read in one sync a step
            picked = [(uids[o.uid], o.logprobs[mx.arange(len(o.tokens)), mx.array(o.tokens)])
                      for o in outputs if o.tokens]
            values = mx.concatenate([p for _, p in picked]).tolist() if picked else []
            for i, p in picked:
                logprobs[i] += values[:p.shape[0]]
                values = values[p.shape[0]:]
        for out in outputs:
            i = uids[out.uid]
            tokens[i] += out.tokens
            if out.cache is not None:
                caches[i] = out.cache
            trees = [trees[0] + bool(out.tree_nodes), trees[1] + out.tree_nodes]
            if out.cross_rule is not None:
                counts = cross_rules.setdefault(out.cross_rule, [0, 0, 0])
                for j, n in enumerate((1, out.num_drafted, out.num_accepted)):
                    counts[j] += n
            if out.finish_reason is not None:
                reasons[i] = out.finish_reason
                if verbose:
                    print(f"[batch_generate] {sum(map(bool, reasons))}/{len(requests)} done",
                          end="\r")
    seconds = time.perf_counter() - start
    eos = set(tokenizer.eos_token_ids)
    texts = [tokenizer.decode([t for t in row if t not in eos]) for row in tokens]
    total = sum(len(row) for row in tokens)
    stats = {"tokens": total, "seconds": seconds, "tokens_per_s": total / seconds if seconds else 0.0,
             "rounds_by_k": dict(sorted(engine.rounds.items())), "policy": engine.policy.describe()}
    if trees[0]:  # as GenerationStats
        stats.update(tree_rounds=trees[0], tree_nodes=trees[1])
    if engine.vocab_overlap is not None:  # as GenerationStats: rule -> (rounds, drafted, accepted)
        stats.update(vocab_overlap=engine.vocab_overlap,
                     cross_rules={rule: tuple(c) for rule, c in sorted(cross_rules.items())})
    if verbose:
        print(f"\n[batch_generate] {total} tokens in {seconds:.2f} s "
              f"({stats['tokens_per_s']:.1f} tok/s); rounds by k: {stats['rounds_by_k']}")
    return BatchResponse(texts, tokens, reasons, stats,
                         caches if return_prompt_caches else None,
                         logprobs if return_logprobs else None)


def _token_ids(tokenizer, prompt, i: int) -> List[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"Prompt {i} is empty: give at least one token.")
        return list(tokenizer.encode(prompt))
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
        raise ValueError(f"Prompt {i} must be text or a list of int token ids.")
    if not prompt:
        raise ValueError(f"Prompt {i} is empty: give at least one token.")
    return list(prompt)
