"""Continuous batching with speculation: rows join and leave between rounds.

    engine = BatchEngine(target_model, draft_model)
    uid = engine.insert(RowRequest(prompt, max_tokens=64))
    while engine.busy:
        for out in engine.step():   # one prefill chunk, then one round for every row
            ...                     # out.uid, out.tokens, out.finish_reason

`step()` first prefills up to `prefill_step_size` prompt tokens of the
waiting rows, oldest first, each on its own one-row cache, so a long prompt
never stalls the rows already decoding for more than a chunk; a prompt fully
prefilled joins the batch (several short ones join in one step). Then one
round for every row: proposals (prompt lookup per row, then for all rows that
have none the draft model (one batched pass per draft position), the target's
MTP head or an EAGLE-3 head, or a DFlash block drafter (one pass for every row's block, reading
the taps the verify pass captured)); a draft of another tokenizer drafts for each row on its
own, row after row (cross.py), as a host search. With `tree=(depth, width)` the draft model's
rows propose token trees, each verified in the same one pass (trees.py). Then the batched
verify (verify.py), per-row acceptance and rewind (kv.py). Where no row drafts, the round is
one target step, the next one dispatched before it is read (plain.py). A row that ends (a
stop token, its budget, `cancel`) leaves the batch at once; with `keep_cache` its cache is
handed back holding exactly its prompt and output, for the prompt-cache store.

Not thread-safe: one thread calls insert, step and cancel (the server's
generation thread).
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from dataclasses import replace
from typing import Deque, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from .. import prompt_look
from ..acceptance import KeyedRule
from ..arguments import EMBEDDINGS_BESIDE_A_HEAD, check_arguments, check_input_embeddings
from ..assemble import check_calibration, cost_prior, draft_bridge, resolve_calibration
from ..cache import check_rewindable, unsupported_kinds
from ..cache.rewind import leaves, make_rewindable
from ..cache.window import prefilling
from ..cache.quantize import KVQuantizer, check_kv_quantization
from ..defaults import (DEFAULT_KV_GROUP_SIZE, DEFAULT_MAX_DRAFT_TOKENS,
                        DEFAULT_QUANTIZED_KV_START, default_prefill_step_size)
from ..dflash import check_fits, is_dflash_model
from ..drafters.protocol import Proposal
from ..drafters.tree import MAX_CHOSEN_WIDTH
from ..eagle3 import check_fits as check_eagle3_fits
from ..eagle3 import is_eagle3_head
from ..loading import vocab_size
from ..loop import first_proposal
from ..policy import DEFAULT_ACCEPTANCE_PRIOR, SAMPLING_ACCEPTANCE_PRIOR, AdaptivePolicy
from ..precision import prepare_drafter
from ..sampling import model_logprobs
from ..tree_verify import positions_follow
from ..session import CONTEXT, held_context
from ..mtp import load_mtp, split_target
from ..mtp.heads import model_type
from .cross import cross_draft
from .dflash import BatchDFlash
from .eagle3 import batch_eagle3
from .drafts import BatchDraft
from . import plain
from .kv import (UNBATCHABLE, BatchCache, arrays, batchable, masks_from_an_unwritten_layer,
                 recurrent, row_cache)
from .mtp import BatchMTP
from .policy import BatchPolicy
from .rows import Row, RowOutput, RowRequest, make_row
from .solo import SoloCache
from .trees import draft_trees, path_states, verify_trees
from .verify import (ACCEPT, chain_parts, emitted_tokens, read_chain, spine_kept, verify,
                     verify_input)


SOURCES = ("draft", "mtp", "eagle3", "dflash", "lookup", "suffix")  # where a row's drafts come from


class Joining:
    """A row whose prompt is being prefilled on one-row caches of its own."""

    def __init__(self, row: Row, target_layers: list, draft_layers: Optional[list], done: int,
                 head_layers: Optional[list] = None):
        self.row, self.target_layers, self.draft_layers = row, target_layers, draft_layers
        self.head_layers = head_layers  # the MTP head's or the DFlash drafter's one-row cache
        self.done = done  # prompt tokens the caches hold
        self.held = done  # ... when it was inserted (what a deferred draft's layers keep)
        self.target_cache = None  # a row alone on its own cache kinds: its ModelCache


def check_batchable(target_model, draft_model=None, tokenizer=None,
                    draft_tokenizer=None) -> None:
    """ValueError, in one sentence, unless these models can decode in a batch (a draft of
    another tokenizer than the target's `tokenizer` too: its own, `draft_tokenizer`, or the one
    `load` kept, needs the target's)."""
    check_drafter(target_model, draft_model, tokenizer, draft_tokenizer)
    why = unbatchable(target_model, draft_model)
    if why is not None:
        raise ValueError(why)


def check_drafter(target_model, draft_model=None, tokenizer=None, draft_tokenizer=None) -> None:
    """ValueError, in one sentence, unless the engine takes this drafter: a loaded model (of
    another tokenizer, only where it can bridge to the target's), "mtp", a DFlash drafter, an
    EAGLE-3 head or None."""
    if is_draft_model(draft_model):
        draft_bridge(target_model, draft_model, tokenizer, draft_tokenizer)  # (its refusal only)
    if isinstance(draft_model, str) and draft_model != "mtp":
        raise ValueError("Batched decoding takes loaded models: a draft model, a DFlash drafter "
                         "(mlx_spec.dflash.load_dflash) or the target's MTP head (\"mtp\").")


def unbatchable(target_model, draft_model=None) -> Optional[str]:
    """Why these models' caches cannot hold rows side by side, in one sentence (None: they
    can): a family whose code cannot share a batch, or cache kinds the batch does not merge
    (kv.batchable). One row at a time they still decode (`max_rows=1`: batch/solo.py)."""
    if not is_draft_model(draft_model):
        draft_model = None  # (a head reads the target's states: no cache kinds of its own)
    for role, model in (("target", target_model), ("draft model", draft_model)):
        why = UNBATCHABLE.get(model_type(model)) if model is not None else None
        if why is not None:
            return (f"The {role} ({model_type(model)}) cannot share a batch: {why}; decode it "
                    "one request at a time (max_rows=1).")
    for role, model in (("target", target_model), ("draft model", draft_model)):
        if model is not None and masks_from_an_unwritten_layer(model):
            return (f"The {role}'s first attention layer is one its attention never writes (a "
                    "linear layer: Nemotron-NAS) and every layer's mask is made from it, which "
                    "could not tell a batch's rows apart; decode it one request at a time "
                    "(max_rows=1).")
    if not batchable(target_model):
        return ("The target's cache layers are not plain or sliding-window KVCache layers, or "
                "the recurrent state of a family the batch was tested on "
                "(mlx_spec/batch/kv.py), which batched decoding needs; decode it one request "
                "at a time (max_rows=1).")
    if draft_model is not None and not batchable(draft_model):
        return ("The draft model's cache layers are not plain or sliding-window KVCache "
                "layers, or the recurrent state of a family the batch was tested on "
                "(mlx_spec/batch/kv.py), which a batched draft needs; decode with it one "
                "request at a time (max_rows=1).")
    return None


def is_draft_model(draft_model) -> bool:
    """A loaded draft model (not "mtp", a path, a DFlash drafter or an EAGLE-3 head)."""
    return draft_model is not None and not isinstance(draft_model, str) and \
        not is_dflash_model(draft_model) and not is_eagle3_head(draft_model)


class BatchEngine:
    def __init__(self, target_model, draft_model=None, *, num_draft_tokens: Optional[int] = None,
                 max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS,
                 prefill_step_size: Optional[int] = None, stop_tokens=(),
                 accept=ACCEPT, mtp_weights: Optional[str] = None, tokenizer=None,
                 draft_tokenizer=None, tree=None, calibration="auto", auto_off: bool = True,
                 draft_confidence: float = 0.0, max_rows: Optional[int] = None, policy=None,
                 kv_bits: Optional[int] = None, kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
                 quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
                 max_kv_size: Optional[int] = None):
        check_arguments(tree=tree, draft_confidence=draft_confidence, kv_bits=kv_bits,
                        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                        max_kv_size=max_kv_size)
        _check_policy(policy, num_draft_tokens)
        check_calibration(calibration)
        check_drafter(target_model, draft_model, tokenizer, draft_tokenizer)
        if max_rows is not None and max_rows < 1:
            raise ValueError(f"max_rows must be >= 1 (or None: no limit), got {max_rows}.")
        # One row at a time on the models' own cache kinds (batch/solo.py): what a batch
        # cannot hold (quantized KV caches: mlx-lm has no batched kind; mlx-lm's max_kv_size,
        # sliding windows that keep the first tokens)
        why = unbatchable(target_model, draft_model)
        if kv_bits is not None:
            check_kv_quantization(target_model, kv_bits, kv_group_size, max_kv_size)
            why = why or ("Quantized KV caches (kv_bits) are decoded one request at a time: "
                          "mlx-lm has no batched quantized cache; pass max_rows=1.")
        if max_kv_size is not None:
            why = why or ("A cache of max_kv_size tokens (mlx-lm's sliding window that keeps "
                          "the first tokens) is decoded one request at a time: a batch keeps "
                          "every row's whole history; pass max_rows=1.")
        self.max_kv_size = max_kv_size
        if why is not None and max_rows != 1:
            raise ValueError(why)
        self.solo = why is not None
        # A target whose cache no rewind handles (deepseek_v41's compressed LayerCache): its
        # rows decode plainly, as a call's with no drafter (a drafter: a call's sentence)
        self.plain_only = self.solo and bool(unsupported_kinds(make_prompt_cache(target_model)))
        if self.plain_only and draft_model is not None:
            check_rewindable(make_prompt_cache(target_model), "target")
        if self.solo and is_draft_model(draft_model):
            check_rewindable(make_prompt_cache(draft_model), "draft")
        self.kv_quantization = None if kv_bits is None else dict(
            bits=kv_bits, group_size=kv_group_size, start=quantized_kv_start)
        self.quantizer: Optional[KVQuantizer] = None  # the row's, with kv_bits
        prepare_drafter(draft_model, target_model)  # float32 on the CPU backend (precision.py)
        # This machine's calibration (`mlx-spec tune`), read once: each request's policy starts
        # from it as a call's does (assemble.cost_prior, for the request's sampling)
        self.calibration = resolve_calibration(calibration, target_model)
        self._priced = {"draft_model": draft_model if is_draft_model(draft_model) else None}
        self._priors: Dict[float, object] = {}  # its cost prior by temperature (_cost_prior)
        self.cross = None  # a draft of another tokenizer than `tokenizer`: one drafter a row
        if is_draft_model(draft_model):
            draft_model, self.cross = cross_draft(target_model, draft_model, tokenizer,
                                                  draft_tokenizer)
        if prefill_step_size is None:  # (512; with kv_bits or max_kv_size, mlx-lm's 2048)
            prefill_step_size = default_prefill_step_size(kv_bits, max_kv_size)
        if prefill_step_size < 1:
            raise ValueError(f"prefill_step_size must be >= 1, got {prefill_step_size}.")
        self.vocab_size = vocab_size(target_model)
        self.target = SoloCache(target_model) if self.solo else BatchCache(target_model)
        # A head that reads pairs (the target's state at a position, the token after it): the
        # target's MTP head, or an EAGLE-3 head (its state: fused taps).
        self.pairs = self.dflash = None
        if draft_model == "mtp":  # the target drafts with its own MTP head
            self.pairs = BatchMTP(load_mtp(target_model, mtp_weights).drafting())
            self._priced["mtp_head"] = self.pairs.head
            self.target.split = split_target(target_model)
            draft_model = None
        elif is_eagle3_head(draft_model):
            check_eagle3_fits(draft_model, target_model)
            self.pairs = batch_eagle3(draft_model, target_model)
            self._priced["eagle3_head"] = draft_model
            self.target.capture = self.pairs.head.capture  # the verify pass keeps fused taps
            draft_model = None
        elif draft_model is not None and is_dflash_model(draft_model):  # a block drafter
            check_fits(draft_model, target_model)
            self.dflash = BatchDFlash(draft_model, target_model)
            self._priced["block_drafter"] = draft_model
            self.target.capture = self.dflash.capture  # the verify pass keeps its taps
            draft_model = None
        self.target_model, self.draft_model = target_model, draft_model
        self.draft = BatchDraft(draft_model, self.vocab_size, draft_confidence, self.solo) \
            if draft_model is not None else None
        self.draft_recurrent = draft_model is not None and recurrent(draft_model)
        # The target as trunk and output layer, for the prompt look of a sampled row (None: no
        # draft model or block drafter, or a target without mlx-lm's trunk-and-head layout)
        self.look_split = _split(target_model) \
            if self.draft is not None or self.dflash is not None else None
        self.head = self.pairs or self.dflash  # a drafter with one-row caches beside the target's
        self.model_drafter = self.draft or self.head  # the one that drafts for the rows, if any
        # Token trees of this (depth, width) from the model drafter (batch/trees.py), where the
        # target's cache can verify them (no recurrent state); otherwise every row drafts
        # chains. (A row's prompt lookup and suffix drafting too: their trees are tries of
        # earlier text; a draft of another tokenizer drafts chains beside them, as for a call.)
        trees_fit = not recurrent(target_model) and isinstance(accept, KeyedRule) and (
            SoloCache.takes_trees(target_model) if self.solo else positions_follow(
                target_model))  # (another rule judges chains: as a call's with its own
        # `accept`; a row on its own cache kinds, where they can verify a tree: a call's; a
        # model that computes its own positions, GPT-2's, cannot take a tree's)
        self.tree = tuple(tree) if tree and trees_fit else None
        self.model_tree = self.tree if self.model_drafter is not None else None
        # tree=None: a row alone proposes trees as wide as its policy chooses each round (up to
        # MAX_CHOSEN_WIDTH), as a call's drafter does (drafters/tree.with_trees); rows beside
        # others, chains. False: chains.
        self.policy = BatchPolicy(max_draft_tokens, fixed=num_draft_tokens, auto_off=auto_off)
        # One row alone is the single-stream case: the single-stream adaptive policy (per
        # source, with its automatic off switch) chooses, as `generate` does; or the caller's
        # policy object, as a call's `policy=` (asked for what it has of the adaptive one's
        # methods, `_ask`, as loop.py asks it)
        self.single = policy if policy is not None else AdaptivePolicy(
            max_draft_tokens, auto_off=auto_off, block_tokens={
                "dflash": self.dflash.max_draft_tokens} if self.dflash is not None else None)
        self.chosen_width = tree is None and trees_fit and self.model_drafter is not None \
            and accept is ACCEPT and hasattr(self.single, "tree_width")
        self.single_uid = None  # the row the single policy has decoded for
        self.prefill_step_size = prefill_step_size
        self.max_rows = max_rows  # rows decoding or joining at once (the server's --no-batching: 1)
        self.stop_tokens = frozenset(stop_tokens)
        self.accept = accept
        self.rows: List[Row] = []
        self.joining: Deque[Joining] = deque()
        self._uids = itertools.count()
        self.rounds: Dict[int, int] = {}  # k -> rounds run (for reports)
        # A plain block (batch/plain.py): the step dispatched for the next round, the steps
        # still to dispatch after it, and the sources asked when it began (a proposal from
        # one ends it)
        self._queued: Optional[plain.Step] = None
        self._block_left = 0
        self._asked: frozenset = frozenset()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.joining)

    @property
    def vocab_overlap(self) -> Optional[float]:
        """A draft of another tokenizer: the fraction of the target's tokens it shares."""
        return self.cross.overlap if self.cross is not None else None

    @property
    def room(self) -> int:
        """How many more rows it takes now: up to `max_rows` at once, or any number (the
        server's admission limits them)."""
        if self.max_rows is None:
            return sys.maxsize
        return max(0, self.max_rows - len(self.rows) - len(self.joining))

    def insert(self, request: RowRequest, cache: Optional[list] = None, cached: int = 0) -> int:
        """Queue a row; `cache` (target layers, then the draft's) already holds `cached` of
        its prompt tokens. Returns the row's uid."""
        if not request.prompt:
            raise ValueError("The prompt is empty: give at least one token.")
        if self.plain_only:  # (nothing it drafts could be taken back)
            request = replace(request, num_draft_tokens=0, prompt_lookup=False, suffix=None)
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}.")
        if request.seed is not None and not request.sampling.greedy and (
                request.sampling.sampler is not None or not isinstance(self.accept, KeyedRule)):
            raise ValueError("A row's seed fixes its draws only under the batch's keyed rule: a "
                             "custom sampler or an accept rule with no key draws from MLX's "
                             "global random state (seed it with mx.random.seed).")
        bad = next((t for t in request.prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Prompt token id {bad} is outside the target's vocabulary "
                             f"(0..{self.vocab_size - 1}).")
        if not 0 <= cached < len(request.prompt):
            raise ValueError(f"cached must be in [0, {len(request.prompt) - 1}], got {cached}.")
        if self.room < 1:
            raise ValueError(f"The engine holds {self.max_rows} rows at once (max_rows): insert "
                             "when `room` says it has room.")
        if request.input_embeddings is not None:
            self._check_embeddings(request)
        row = make_row(next(self._uids), request, self.vocab_size, self.stop_tokens,
                       self.model_drafter is not None or self.cross is not None, self.tree)
        if not hasattr(self.single, "fall_back"):  # (a caller's policy: as a call's, assemble.py)
            row.fallbacks = []
        prior = self._cost_prior(request.sampling)
        drafter = self.model_drafter.source if self.model_drafter is not None else (
            "draft" if self.cross is not None else None)  # (a draft of another tokenizer)
        row.acceptance = self.policy.new_estimate(
            row.greedy, row.pinned or 0,
            None if prior is None or drafter is None else prior.acceptance.get(drafter))
        n_target = len(make_prompt_cache(self.target_model))  # (MLP-only layers have none)
        fresh = row_cache if not self.solo else (  # (a row alone: its own kinds)
            lambda model: make_prompt_cache(model, self.max_kv_size))
        if cache is None:
            cache = fresh(self.target_model) + (
                fresh(self.draft_model) if self.draft is not None else [])
        elif not self.solo and not all(
                isinstance(layer, (KVCache, ArraysCache)) for layer in leaves(
                    cache[:n_target] if self.cross is not None else cache)):  # (a draft of
            # another tokenizer's layers are its drafter's own kinds: a window's rewindable)
            raise ValueError("A cache handed to the batch must hold plain KVCache layers (and "
                             "recurrent state): one the batch made (RowOutput.cache), or "
                             "mlx_spec.batch.kv.row_cache(model)'s.")
        if self.solo:  # sliding windows made rewindable before any prefill, in `cache` itself
            make_rewindable(cache)
        draft_layers = cache[n_target:] if self.draft is not None else None
        if self.cross is not None and request.num_draft_tokens != 0:  # its own drafter
            self.cross.join(row, cache[n_target:] or None)
        if self.dflash is not None:  # with the context a reused cache kept, if any
            head_layers = self.dflash.held_row_cache(row, held_context(cache), cached)
        else:
            head_layers = self.head.new_row_cache() if self.head is not None else None
        joining = Joining(row, cache[:n_target], draft_layers, cached, head_layers)
        if self.solo:  # its caches as a call's go back (sliding windows rewindable, in place)
            joining.target_cache = SoloCache.prepare(self.target_model, joining.target_layers,
                                                     cached)
            if self.kv_quantization is not None:  # quantized where mlx-lm's would be (and in
                self.quantizer = KVQuantizer(joining.target_cache, shown=[cache],  # `cache`)
                                             **self.kv_quantization)
        self.joining.append(joining)
        return row.uid

    def _check_embeddings(self, request: RowRequest) -> None:
        """ValueError, in one sentence, unless this row's input_embeddings can be fed (as
        generate's: a target that takes them, one row per prompt token, as wide as its hidden
        size; beside a draft model, one of another tokenizer or the host searches, which read
        the ids, not a head or block drafter, which read the target's own prompt pass)."""
        check_input_embeddings(self.target_model, request.input_embeddings, len(request.prompt),
                               ids_optional=False)
        if self.head is not None:
            raise ValueError(EMBEDDINGS_BESIDE_A_HEAD)
        if request.keep_cache:
            raise ValueError("A row fed input_embeddings does not hand its cache back "
                             "(keep_cache).")

    def cancel(self, uid: int) -> Optional[RowOutput]:
        """End a row now (the client left): its cache, with keep_cache, as its end."""
        for j in list(self.joining):
            if j.row.uid == uid:
                self.joining.remove(j)
                if self.solo:  # (the quantizer was the row's)
                    self.quantizer = None
                return RowOutput(uid, [], "cancelled", 0, 0, "target")
        for i, row in enumerate(self.rows):
            if row.uid == uid:
                out = RowOutput(uid, [], "cancelled", 0, 0, "target",
                                cache=self._row_cache(i) if row.request.keep_cache else None)
                self._drop([i])
                return out
        return None

    def step(self) -> List[RowOutput]:
        if not self.rows:
            self._queued = None
        first = self._prefill_chunk()  # (rows fed input embeddings: their first tokens)
        if not self.rows:
            return first
        alone = len(self.rows) == 1 and self.policy.fixed is None
        if alone and self.rows[0].uid != self.single_uid:  # a request of its own: its text's
            self._single_policy(self.rows[0])  # policy
        self._looks(alone)
        start = time.perf_counter()
        width = 1  # the model drafter's trees' width, when a row alone's policy chooses it
        if self._queued is not None:  # a plain block's next step, dispatched last round
            k, lengths = 0, dict.fromkeys(SOURCES, 0)
        elif alone:  # the single-stream case: the single-stream policy, a k per source
            row = self.rows[0]
            sources = [s.source for s in row.searchers + row.fallbacks] + (
                [self.model_drafter.source] if self.model_drafter is not None else [])
            lengths = {s: self.single.proposal_length(s) if s in sources else 0
                       for s in SOURCES}
            k = max(lengths.values())
            if row.draft_waits and lengths["draft"]:  # its prompt now (no round's time)
                self._catch_up(row)
                start = time.perf_counter()
            if self.chosen_width and lengths[self.model_drafter.source]:
                width = self.single.tree_width(self.model_drafter.source)
        else:
            k = self.policy.choose(self.rows)
            lengths = dict.fromkeys(SOURCES, k)
        rows = self.rows  # (the round drops the rows that end)
        outputs = self._round(lengths, alone, width)
        if self.quantizer is not None and self.rows:
            self.quantizer.settle()
        seconds = time.perf_counter() - start
        if alone:
            self.single.observe(outputs[0], seconds)
            self.policy.count(rows[0], outputs[0])  # the row's acceptance, should others join
        else:
            self.policy.observe(rows, outputs, k, seconds)
        self.rounds[k] = self.rounds.get(k, 0) + 1
        return first + outputs

    def _cost_prior(self, sampling):
        """A request's calibration, as a call of its sampling reads it (None: none); one per
        temperature (what it depends on)."""
        if self.calibration is None:
            return None
        temp = 0.0 if sampling.greedy else sampling.temp
        if temp not in self._priors:
            self._priors[temp] = cost_prior(self.calibration, self.target_model,
                                            sampling=sampling, **self._priced)
        return self._priors[temp]

    def _single_policy(self, row: Row) -> None:
        """The policy of a request decoding alone, as a call of its own gets it (assemble.py):
        what the last one measured of the machine, the calibration, its sampling's acceptance
        prior, its reply's length, and prompt lookup behind the drafter at T > 0
        (`Row.fallbacks`)."""
        if hasattr(self.single, "next_request"):  # (a caller's policy object: the same one)
            self.single = self.single.next_request(
                DEFAULT_ACCEPTANCE_PRIOR if row.greedy else SAMPLING_ACCEPTANCE_PRIOR,
                self._cost_prior(row.request.sampling))
        self.single_uid = row.uid
        if row.prefilled:  # the target's prefill alone: v's prior, as a call's
            self._ask("observe_prefill", row.prefilled, row.prefill_seconds)
        if row.draft_prefill_seconds:  # the draft read the prompt: its catch-up price, as a call's
            self._ask("observe_catch_up", "draft", row.prefilled, row.draft_prefill_seconds)
        self._ask("expect_reply", row.room)
        if self.chosen_width and row.pinned is None and not row.request.chains_only:
            self._ask("allow_trees", self.model_drafter.source, MAX_CHOSEN_WIDTH)  # (a call's)
        if row.fallbacks:
            self.single.fall_back("lookup", [self.model_drafter.source
                                             if self.model_drafter is not None else "draft"])
        # One timed draft step, as a call's (then handed on, request to request): the draft
        # model's, a head's chained step, or the row's draft of another tokenizer
        timed = self.model_drafter if hasattr(self.model_drafter, "step_seconds") else row.cross
        if timed is not None and self._ask("wants_draft_step", timed.source) \
                and timed.source not in getattr(self.single, "step_seconds", {}):
            self._ask("observe_draft_step", timed.source, timed.step_seconds(row))

    def _ask(self, name: str, *args):
        """The row-alone policy's method `name` called, where it has one (a caller's policy
        object may have only the protocol's: policy.DraftPolicy), else None."""
        method = getattr(self.single, name, None)
        return method(*args) if method is not None else None

    def _looks(self, alone: bool) -> None:
        """A row alone whose first round was handed out takes its prompt look now (before its
        second round, as the loop's: the first token did not wait for it), a first round of
        plain steps once its block is over (as a call's first round is the whole block: its
        steps' time then tells `look_rows` what the look may cost); beside other rows no row
        looks, and the hidden states kept for it go."""
        for row in self.rows:
            if row.look_tail is not None and (not alone or (row.emitted
                                                            and self._queued is None)):
                if alone:
                    self._take_look(row)
                row.look_tail = None

    def _take_look(self, row: Row) -> None:
        """The prompt look (prompt_look.py) of a request decoding alone, as a call's
        (loop._take_look): its drafter's acceptance on the prompt's last positions (a draft
        model's, the MTP head's or a block drafter's: `_gather_look`), over as many of the
        rows its prefill kept as its reply buys
        (`AdaptivePolicy.look_rows`; the row's target's prefill time per token, as a call's),
        handed to its policy, unless the first round already switched the drafter off
        (`still_looks`). One host sync."""
        pending, row.look_tail = row.look_tail, None
        per_token = row.prefill_seconds / row.prefilled if row.prefilled else None
        rows = self.single.look_rows(per_token, row.request.max_tokens, prompt_look.ROWS)
        looks = prompt_look.look(pending, self.single.still_looks, rows)
        for source, (acceptance, seen) in looks.items():
            self.single.observe_prompt_look(source, acceptance, seen, greedy=row.greedy)

    def _gather_look(self, row: Row, kept, head_layers, end: int) -> dict:
        """{source: rows -> chances, lazy} (prompt_look.gather's) from what the last prefill
        chunk kept: the target's and the draft model's hidden states, or the target's and the
        MTP head's outputs at its pairs, through their output layers; or a block drafter's
        first row anchored at each of the prompt's last positions, over the row's context
        (`head_layers`, covering positions 0..`end`), against the target's own rows there."""
        sampling, rows = row.request.sampling, prompt_look.ROWS
        source = self._look_source()
        if source == "dflash":
            return self.dflash.look(row, head_layers, end, prompt_look.Tail.through(
                kept, self.look_split[1], rows), sampling)
        target_head, draft_head = (self.look_split[1], self.draft.split[1]) \
            if source == "draft" else (self.target.split[1], self.pairs.head.logits)
        return {source: prompt_look.chances_of(prompt_look.Tail.through(kept[0], target_head, rows),
                                               prompt_look.Tail.through(kept[1], draft_head, rows),
                                               rows, sampling)}

    def _look_source(self) -> Optional[str]:
        """The drafter a row alone's prompt look reads, as a call's, or None: a draft model of
        the target's tokenizer ("draft"; it and the target each with its output layer over its
        trunk: mtp.heads.split_target), the target's MTP head ("mtp": its logits over its
        outputs at the prefill's pairs, drafters/mtp.py's look) or a block drafter ("dflash":
        through a sequence's drafter over the row's context, BatchDFlash.look)."""
        if self.draft is not None:
            usable = self.look_split is not None and self.draft.split is not None
            return "draft" if usable and self.cross is None else None
        if self.pairs is not None and self.pairs.source == "mtp":
            return "mtp"
        return "dflash" if self.dflash is not None and self.look_split is not None else None

    def _may_look(self, row: Row) -> bool:
        """Whether a row may take the prompt look: a sampled row whose k the policy chooses,
        with no processors (they change p), under a policy that looks (no calibration), with
        a drafter that has one (`_look_source`)."""
        request = row.request
        return (self._look_source() is not None and not row.greedy
                and row.pinned is None and not request.logits_processors
                and request.input_embeddings is None
                and self.policy.fixed is None and getattr(self.single, "auto_off", False)
                and hasattr(self.single, "observe_prompt_look")
                and self._cost_prior(request.sampling) is None)

    def _gathers_look(self, j: Joining, chunk: List[int]) -> bool:
        """Whether this chunk, its prompt's last, keeps the target's and the draft's hidden
        states at its last positions for a prompt look (`_may_look`), the chunk at least
        prompt_look.MIN_ROWS long."""
        return (j.done + len(chunk) == len(j.row.history) - 1
                and len(chunk) >= prompt_look.MIN_ROWS and self._may_look(j.row))

    def _prefill_chunk(self) -> List[RowOutput]:
        """Up to prefill_step_size prompt tokens of the waiting rows, oldest first; then every
        row whose prompt is in joins, unless a plain step is queued (it holds the batch's
        rows: they join when it has been read, their prefill overlapping it). Returns the
        first token of each joining row fed input embeddings (`_first_token`)."""
        budget = self.prefill_step_size
        for j in self.joining:
            if budget <= 0:
                break
            if not self._ready(j):
                with prefilling(j.target_cache.trimmable if j.target_cache is not None else ()):
                    budget -= self._prefill_one(j, budget)  # (a kept window prefix: mlx-lm's
                    # chunk rule; the draft's layers are not the target's)
        first = []
        while self._queued is None and self.joining and self._ready(self.joining[0]):
            j = self.joining.popleft()
            if j.row.request.input_embeddings is not None and not j.row.emitted:
                first.append(self._first_token(j))
                if first[-1].finish_reason is not None:  # it ended there: it never joins
                    _release(j.row)
                    continue
            self._join(j)
        return first

    def _first_token(self, j: Joining) -> RowOutput:
        """The first token of a row fed input embeddings, from the prompt's last embedding on
        its one-row cache (as a call's first plain step: loop.generate_rounds), judged by the
        row's rule with its own key; its caches then hold the whole prompt, as a row's hold
        its history but the last token. One host sync, once a row."""
        row = j.row
        embedding = row.request.input_embeddings[None, -1:]
        logits = self.target_model(mx.array(row.history[-1:], mx.uint32)[None],
                                   cache=j.target_layers, input_embeddings=embedding)[0]
        self._fed(j, 1)
        parts, logits = chain_parts(row, None, logits, self.accept)
        verdict, _ = read_chain(row, 0, logits, parts.tolist(), 0)
        return self._emit(row, None, verdict, *emitted_tokens(row, verdict))

    def _fed(self, j: Joining, n: int) -> None:
        """A row alone's own cache was fed `n` positions before it joined (its prefill, its
        first token): counted, and quantized where mlx-lm's would be (kv_bits: after the
        forward that brings it to quantized_kv_start)."""
        if j.target_cache is not None:
            j.target_cache.length += n
            if self.quantizer is not None:
                self.quantizer.settle()

    def _fits(self) -> Optional[int]:
        """Positions the next target pass may compute before a row alone's cache is quantized
        (kv_bits: no pass reaches past that point, cache/quantize.py); None: no limit."""
        return self.quantizer.room() if self.quantizer is not None and self.rows else None

    def _defers_draft(self, row: Row) -> bool:
        """Whether a joining row's draft model waits to read its prompt until its policy first
        asks it for drafts, as a call's does (loop._prefills_later): a row that will decode
        alone (nothing else in the batch or waiting before it) under the adaptive policy, with
        no prompt look to take (a greedy row's, or one the look skips). Its draft is then never
        read when the policy never drafts, and its catch-up is timed apart from any round."""
        return (self.draft is not None and self.cross is None and not self.rows
                and not self.draft_recurrent
                and self.joining and self.joining[0].row is row and len(self.joining) == 1
                and self.policy.fixed is None and row.pinned is None
                and hasattr(self.single, "observe_catch_up") and not self._may_look(row))

    def _catch_up(self, row: Row) -> None:
        """A row alone whose draft waited (`Row.draft_waits`) and is asked for drafts now:
        the draft reads what it has not seen but the last token, in prefill-sized chunks,
        evaluated and timed apart from the round; its policy learns what a catch-up costs."""
        pending, started = row.draft_pending, time.perf_counter()
        for at in range(0, len(pending) - 1, self.prefill_step_size):
            chunk = pending[at:min(at + self.prefill_step_size, len(pending) - 1)]
            self.draft.cache.forward(mx.array(chunk, mx.uint32)[None], undoable=False)
            mx.eval(arrays(self.draft.cache.layers))
        row.draft_pending, row.draft_waits = pending[-1:], False
        self._ask("observe_catch_up", "draft", len(pending) - 1, time.perf_counter() - started)

    @staticmethod
    def _ready(j: Joining) -> bool:
        """Whether a waiting row's caches hold its prompt but the last token (it may join)."""
        return j.done >= len(j.row.history) - 1

    def _prefill_one(self, j: Joining, budget: int) -> int:
        """Prefill up to `budget` tokens of the waiting row `j`; returns how many (at least 1,
        so a loop over rows always ends)."""
        prompt = j.row.history
        chunk = prompt[j.done:min(j.done + budget, len(prompt) - 1)]
        if chunk:
            started, look, kept = time.perf_counter(), False, None
            x = mx.array(chunk, mx.uint32)[None]
            if self.pairs is not None:  # the head's pairs: a position's state, the next token
                if self.target.capture is not None:  # an EAGLE-3 head's fused taps
                    _, hidden = self.target.capture(x, j.target_layers)
                else:
                    hidden = self.target.split[0](x, cache=j.target_layers)  # the trunk's
                last = j.done + len(chunk) == len(prompt) - 1
                outputs = self.pairs.prefill(j.row, j.head_layers,
                                             prompt[j.done + 1:j.done + 1 + len(chunk)], hidden,
                                             last)
                if outputs is not None and self._gathers_look(j, chunk):  # an MTP head's look:
                    look = True  # its outputs at the pairs against the target's own rows
                    kept = (hidden[0, -prompt_look.ROWS:], outputs[0, -prompt_look.ROWS:])
            elif self.dflash is not None:  # the drafter's context: the taps at these positions
                look = j.held == 0 and self._gathers_look(j, chunk)  # (a context from 0)
                final, taps = self.dflash.capture(  # (the look: the trunk's last rows)
                    x, j.target_layers, forward=self.look_split[0] if look else None)
                self.dflash.prefill(j.row, j.head_layers, taps, j.done)
                kept = final[0, -prompt_look.ROWS:] if look else None
            elif self._gathers_look(j, chunk):  # the last positions' hidden states kept
                look = True
                kept = (self.look_split[0](x, cache=j.target_layers)[0, -prompt_look.ROWS:],
                        self.draft.split[0](x, cache=j.draft_layers)[0, -prompt_look.ROWS:])
            elif j.row.request.input_embeddings is not None:  # in place of the tokens' own
                self.target_model(x, cache=j.target_layers, input_embeddings=j.row.request.
                                  input_embeddings[None, j.done:j.done + len(chunk)])
            else:
                self.target_model(x, cache=j.target_layers)
            # The target's part (and a head's or a DFlash drafter's, as a call's followers)
            # evaluated and timed first: a row alone's v prior, as a call's prefill is timed.
            # The look's hidden states after (the last layer and the final norm over its
            # rows, which no cache needs: a call evaluates them at its look)
            mx.eval(arrays(j.target_layers) + arrays(j.head_layers or []))
            j.row.prefill_seconds += time.perf_counter() - started
            if look:  # (a draft model's rows with its own prefill, below)
                mx.eval(list(kept) if self.pairs is not None else
                        kept[0] if self.draft is not None else kept)
            if j.done == j.held:  # its first chunk: the draft reads the prompt now, or later
                j.row.draft_waits = self._defers_draft(j.row)
            if self.draft is not None:
                started = time.perf_counter()
                if not look and not j.row.draft_waits:
                    self.draft_model(x, cache=j.draft_layers)
                mx.eval(arrays(j.draft_layers))
                if look or not j.row.draft_waits:
                    j.row.draft_prefill_seconds += time.perf_counter() - started
                if look:
                    mx.eval(kept[1])
            j.done += len(chunk)
            self._fed(j, len(chunk))
            if look:
                j.row.look_tail = self._gather_look(j.row, kept, j.head_layers, j.done)
            j.row.prefilled += len(chunk)
            if j.row.cross is not None:  # its draft reads the same text, in its own vocabulary
                j.row.cross.prefill(prompt[:j.done], budget)
        return max(1, len(chunk))

    def _join(self, j: Joining) -> None:
        """A row whose prompt is in joins the batch."""
        if self.solo:
            self.target.join(j.target_layers, j.target_cache)
        else:
            self.target.join(j.target_layers)
        if self.draft is not None:
            self.draft.cache.join(j.draft_layers)
            # what its cache has not read (a row fed embeddings: the prompt's last token and
            # its first, `_first_token`)
            j.row.draft_pending = j.row.history[j.held if j.row.draft_waits else j.done:]
        if self.head is not None:
            self.head.cache.join(j.head_layers)
        self.rows.append(j.row)

    def _round(self, lengths: Dict[str, int], alone: bool = False,
               width: int = 1) -> List[RowOutput]:
        """One round for every row: propose -> verify -> accept -> rewind -> emit.
        `lengths`: the drafts each source is asked for (0: not asked); `alone`: one row under
        the single-stream policy (its fallbacks are asked too); `width`: its policy's tree
        width for the model drafter (1: chains; a forced `tree` shape wins)."""
        rows = self.rows
        step, self._queued = self._queued, None
        if step is not None:  # a plain block's queued step: nothing is proposed
            proposals, ran, opens_block = [None] * len(rows), False, False
        else:
            proposals, ran = self._propose(lengths, alone, width)
            step = self._begin_block(rows, lengths, alone) if not ran and all(
                p is None for p in proposals) else None
            opens_block = step is not None  # (the policy's steady plain laps follow the first)
        if step is not None:
            verdicts = self._plain_verdicts(step, rows, alone)  # the round's one sync
        elif any(p is not None and p.parents is not None for p in proposals):  # token trees
            verdicts, fed = verify_trees(self.target, rows, proposals, self.accept)  # one sync
        else:
            verdicts = verify(self.target, rows, proposals, self.accept,  # the round's one sync
                              chances=alone and self.accept is ACCEPT)
        # What a head reads of this round's target pass (a queued step's own: the next step's
        # pass has replaced the cache's)
        hidden = step.states(rows) if step is not None else self.target.hidden  # (B, T, .)
        if verdicts[0].nodes is not None and self.head is not None:  # a tree's: along each path
            hidden = path_states(hidden, [v.nodes for v in verdicts])
        emitted = [emitted_tokens(row, verdict) for row, verdict in zip(rows, verdicts)]
        kept = [len(tokens) for tokens, _ in emitted]
        if verdicts[0].nodes is not None:  # each row's accepted path, gathered
            self.target.keep_paths(fed, [v.nodes for v in verdicts], kept)
        else:
            self.target.keep(max(len(v.drafted) for v in verdicts) + 1, kept)
        if self.draft is not None:  # its own drafts kept (a tree's: along its spine)
            from_draft = [min(n - 1, spine_kept(p, v)) if p is not None and p.source == "draft"
                          else 0 for n, p, v in zip(kept, proposals, verdicts)]
            self.draft.settle(rows, ran, from_draft, [tokens for tokens, _ in emitted])
        if self.pairs is not None:
            self.pairs.settle(rows, ran, hidden, [tokens for tokens, _ in emitted])
        if self.dflash is not None:
            self.dflash.settle(rows, hidden, [tokens for tokens, _ in emitted])
        outputs = [self._emit(row, p, v, tokens, finish, opens_block)
                   for row, p, v, (tokens, finish) in zip(rows, proposals, verdicts, emitted)]
        ended = [i for i, (_, finish) in enumerate(emitted) if finish is not None]
        for i in ended:
            if rows[i].request.keep_cache:
                outputs[i] = replace(outputs[i], cache=self._row_cache(i))
        if ended:
            self._drop(ended)
        return outputs

    def _begin_block(self, rows: List[Row], lengths: Dict[str, int], alone: bool) -> plain.Step:
        """A round where no row proposed: its step dispatched as a plain block's first
        (batch/plain.py), the block as long as the policy's plain_steps()."""
        steps = self.single.plain_steps() if alone else self.policy.plain_steps(len(rows))
        self._block_left = min(steps, self._fits() or steps) - 1
        self._asked = frozenset(s for s, n in lengths.items() if n > 0)
        return plain.dispatch(self.target, rows, verify_input(rows, [None] * len(rows), 1),
                              self.accept)

    def _plain_verdicts(self, step: plain.Step, rows: List[Row], alone: bool):
        """The verdicts of a plain block's step, the next one dispatched before they are read
        (unless the block is over or a waiting row is ready to join); a host search that
        would propose after it ends the block at the step already queued."""
        if self._block_left > 0 and not any(self._ready(j) for j in self.joining):
            self._queued = plain.dispatch(self.target, rows, step.tokens(rows), self.accept,
                                          queued=True)
            self._block_left -= 1
        verdicts = plain.read(step, rows)  # the round's one sync
        if any(s.source in self._asked and s.can_propose(row.history + [v.token])
               for row, v in zip(rows, verdicts)
               for s in row.searchers + (row.fallbacks if alone else [])):
            self._block_left = 0
        return verdicts

    def _propose(self, lengths: Dict[str, int], alone: bool = False, width: int = 1):
        """(each row's proposal or None, whether the model drafter ran): the host searches
        first, row by row (one row alone: its fallbacks after them); then the draft model,
        MTP head or DFlash drafter for every row that has none, in one batch: chains, or
        trees of the forced `tree` shape, or `width` wide."""
        rows = self.rows
        fits = self._fits()  # (kv_bits: no row's drafts, a pinned k's too, past the point)

        def wanted(row: Row, k: int) -> int:
            return row.wants(k) if fits is None else min(row.wants(k), fits - 1)

        proposals: List[Optional[Proposal]] = [None] * len(rows)
        for i, row in enumerate(rows):
            proposals[i] = first_proposal(row.searchers + (row.fallbacks if alone else []),
                                          row.history, lambda source: wanted(row, lengths[source]))
        model = self.model_drafter
        if model is None:
            return proposals, False
        wants = [wanted(row, lengths[model.source]) if p is None and model.ready(row) else 0
                 for row, p in zip(rows, proposals)]
        if model is self.dflash:  # never past its block (a row's pinned k may ask more)
            wants = [min(n, model.max_draft_tokens) for n in wants]
        if self.model_tree is not None:
            depth, width = self.model_tree
            wants = [min(n, depth) for n in wants]
        if max(wants) == 0:
            return proposals, False
        model.keep_logits = width > 1  # (a tree's siblings are drawn from them)
        tokens, probs = model.propose(rows, max(wants), wants)  # (B, max(wants))
        if model is self.draft:  # a row's confidence stop may end its chain sooner
            wants = [min(n, cut) for n, cut in zip(wants, model.cut)]
            for row in rows:  # (its first pass fed every row what it had not seen)
                row.draft_waits = False
        if width > 1:
            for i, tree in enumerate(draft_trees(rows, wants, tokens, probs, model.kept_logits,
                                                 width, model.source)):
                proposals[i] = tree or proposals[i]
            return proposals, True
        for i, n in enumerate(wants):
            if n:
                proposals[i] = Proposal(tokens[i, :n], None if probs[i] is None
                                        else probs[i][:n], model.source)
        return proposals, True

    @staticmethod
    def _emit(row: Row, proposal, verdict, tokens: List[int], finish,
              opens_block: bool = False) -> RowOutput:
        """Hand the row its tokens: its history, its budget, its host search's record."""
        accepted = min(verdict.accepted, len(tokens))
        if proposal is not None and proposal.drafter is not None:  # (a tree's: its path)
            proposal.drafter.commit(accepted if proposal.parents is None
                                    else verdict.nodes[1:accepted + 1])
        row.history.extend(tokens)
        row.emitted += len(tokens)
        logprobs = model_logprobs(verdict.logits[:len(tokens)]) if row.request.logprobs else None
        tree = {}
        if proposal is not None and proposal.parents is not None:  # what the policy reads
            tree = dict(tree_nodes=len(proposal.parents) - 1, tree_width=proposal.width,
                        spine_kept=min(spine_kept(proposal, verdict), accepted),
                        spine_length=len(proposal.spine))
        return RowOutput(row.uid, tokens, finish, verdict.num_drafted, accepted,
                         proposal.source if proposal is not None else "target", logprobs,
                         cross_rule=proposal.cross_rule if proposal is not None else None,
                         opens_block=opens_block, chances=verdict.chances, **tree)

    def _row_cache(self, i: int) -> list:
        """Row i's caches as one-row lists holding exactly its history (target, then draft;
        a DFlash drafter's context rides on the first layer, as session.py leaves it; a draft of
        another tokenizer's layers hold the draft ids marked on their first, as its drafter
        leaves them for a reused cache).

        The row's entries are copied out now (cheap, and nothing then holds on to the batch's
        buffers); the forward that feeds the tokens the caches have not seen (the target's
        last token, the draft's pending ones) stays lazy: it runs with whatever next uses
        the cache (a reused prompt cache: the next turn's prefill), or never."""
        row = self.rows[i]
        if self.quantizer is not None:  # (a reused cache: quantized where mlx-lm's would be)
            self.quantizer.settle()
        target = self.target.extract(i)
        draft = self.draft.cache.extract(i) if self.draft is not None else (
            row.cross.layers if row.cross is not None else [])  # (its ids ride on the first)
        context = self.dflash.cache.extract(i) if self.dflash is not None else []
        mx.eval(arrays(target + draft + context))
        last = mx.array(row.history[-1:], mx.uint32)[None]
        queued = self._queued is not None and any(r.uid == row.uid for r in self._queued.rows)
        if queued:  # a queued plain step fed it already: the cache holds the whole history
            taps = self._queued.states([row]) if self.dflash is not None else None
        elif self.dflash is None:
            self.target_model(last, cache=target)
        else:
            _, taps = self.dflash.capture(last, target)
        if self.quantizer is not None and not queued:  # (that forward: then quantized, as
            self.quantizer.cache.length += 1  # mlx-lm's cache would be after it)
            self.quantizer.settle()
        if self.dflash is not None:  # the drafter's context goes with the cache (the next turn's)
            setattr(target[0], CONTEXT, self.dflash.kept_context(row, context, taps[0]))
        if draft and row.draft_pending:
            self.draft_model(mx.array(row.draft_pending, mx.uint32)[None], cache=draft)
        return target + draft

    def _drop(self, ended: List[int]) -> None:
        for i in ended:
            _release(self.rows[i])
        if self.solo:
            self.quantizer = None
        keep = [i for i in range(len(self.rows)) if i not in set(ended)]
        self.rows = [self.rows[i] for i in keep]
        self.target.drop(keep)
        if self.draft is not None:
            self.draft.cache.drop(keep)
        if self.head is not None:
            self.head.cache.drop(keep)


def _check_policy(policy, num_draft_tokens) -> None:
    """ValueError, in one sentence, unless `policy` is None or a draft policy a row alone may
    ask (policy.DraftPolicy's protocol), without a pinned k."""
    if policy is None:
        return
    if not all(callable(getattr(policy, name, None))
               for name in ("proposal_length", "plain_steps", "observe")):
        raise ValueError("policy must be a draft policy: proposal_length(source), plain_steps() "
                         "and observe(round, seconds), as mlx_spec.policy.DraftPolicy.")
    if num_draft_tokens is not None:
        raise ValueError("Pass a policy or num_draft_tokens, not both (a pinned k is the "
                         "batch's fixed policy).")


def _release(row: Row) -> None:
    """A row that ended lets go of its drafters (a drafter of another tokenizer holds its row's
    key and its own one-row cache: no cycle left)."""
    row.cross, row.searchers, row.fallbacks = None, [], []


def _split(model):
    """(trunk, head) of `model` (mtp.split_target), or None when it has not that layout."""
    try:
        return split_target(model)
    except (AttributeError, KeyError, TypeError):
        return None
