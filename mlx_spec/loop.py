"""The decoding loop: token ids in, rounds of token ids out (no tokenizer here).

One speculative round is   propose -> verify -> accept -> rewind -> emit:
the drafts, the target's verify pass over [last token, d1..dk] and the
acceptance rule are one lazy MLX graph, evaluated by the round's only host
sync. Invariant between rounds: the target cache holds history[:-1]; the last
history token is the one the next verify pass starts from. Rewinding goes
through `ModelCache`, which knows how each cache kind goes back (attention:
trim; recurrent state: restore and replay the kept tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Collection, Iterator, List, Optional, Sequence

import mlx.core as mx

from . import prompt_look
from .acceptance import AcceptanceRule, greedy_accept, rule_for, speculative_accept
from .attention import round_attention
from .cache import ModelCache
from .cache.prefill import prefill
from .cache.quantize import KVQuantizer
from .cache.window import keeps_prefix
from .defaults import DEFAULT_PREFILL_STEP_SIZE
from .judge import read_verdict, stop_cut, verdict_parts
from .policy import DraftPolicy
from .tree import depths
from .tree_acceptance import read_tree, tree_parts
from .tree_verify import keep_path, tree_attention
from .sampling import SamplingConfig, logprobs_from_logits, model_logprobs, sample

@dataclass(frozen=True)
class Round:
    """What one round emitted: accepted drafts, then the target's own token."""

    tokens: List[int]
    num_drafted: int
    num_accepted: int
    source: str  # "draft", "lookup", "mtp" or "target" (a plain decoding step)
    logprobs: mx.array  # (len(tokens), V) the target's own log-probabilities (as mlx-lm), lazy
    # Under the residual rule (T > 0): each draft's chance of being kept given the drafts
    # before it (acceptance_chances), for the policy; None otherwise.
    chances: Optional[List[float]] = None
    # The first step of a plain block: its time carries the queue's fill (the policy's
    # t_plain is the median of the laps after it).
    opens_block: bool = False
    # A draft of another tokenizer: how its proposal crossed ("string" or "intersection")
    cross_rule: Optional[str] = None
    # A token tree's round: the nodes verified (num_drafted is then its depth); 0 for a chain
    tree_nodes: int = 0
    # ... its widest node, and how many of the kept drafts follow the spine (the base
    # drafter's own chain; num_accepted beyond it: a sibling was kept), for the policy
    tree_width: int = 0
    spine_kept: Optional[int] = None
    spine_length: Optional[int] = None  # the spine's drafts (a text search's may be shorter)


@dataclass
class Decoder:
    """Everything a round reads or advances."""

    target: ModelCache
    drafters: Sequence  # asked in order; the first proposal wins
    sampling: SamplingConfig
    history: List[int]
    accept: AcceptanceRule
    stop_tokens: Collection[int] = ()  # a round ends at the first accepted stop token
    followers: Sequence = ()  # drafters handed the target's hidden states (MTP): see _follow
    # mlx-lm's logits processors: (tokens so far, logits (1, V)) -> logits, at every position
    processors: Sequence = ()
    # A sharded target: rank 0's values of what the round syncs, for every rank
    # (mlx_spec.distributed.agreement); identity on one machine.
    agree: Callable[[mx.array], mx.array] = lambda x: x


def first_proposal(drafters, history: List[int], length: Callable[[str], int]):
    """The first proposal of `drafters`, asked in order, each for `length(source)` drafts (0:
    not asked): a call's drafters, and a batch row's host searches (batch/engine.py)."""
    for drafter in drafters:
        k = length(drafter.source)
        if k > 0:
            proposal = drafter.propose(history, k)
            if proposal is not None and proposal.num_tokens > 0:
                return proposal
    return None


def speculative_round(decoder: Decoder, proposal) -> Round:
    y = mx.array(decoder.history[-1:], mx.uint32)
    verify_input = mx.concatenate([y, proposal.tokens])  # (k+1,) lazy on the drafts
    decoder.target.anchor()
    with round_attention():
        target_logits = decoder.target.forward(verify_input)  # (k+1, V)
    if decoder.processors:
        target_logits = processed(decoder.processors, mx.array(decoder.history, mx.uint32),
                                  proposal.tokens, target_logits)
    hidden = decoder.target.hidden  # (k+1, H) when an MTP drafts; before a rewind replaces it
    target_logprobs = logprobs_from_logits(target_logits, decoder.sampling)  # (k+1, V)
    n, token, drafted, chances = _judge(decoder.accept, proposal, target_logits,
                                        target_logprobs, decoder.agree)  # the only sync
    n, token = _stop_at(decoder.stop_tokens, drafted, n, token)
    decoder.target.fed(decoder.history[-1:] + drafted)
    decoder.target.keep(n + 1)  # y and the accepted drafts
    proposal.drafter.commit(n)
    tokens = drafted[:n] + [token]
    _follow(decoder, tokens, hidden)
    decoder.history.extend(tokens)
    return Round(tokens, len(drafted), n, proposal.source,
                 _reported(target_logits[: n + 1], target_logprobs[: n + 1], decoder.sampling),
                 chances, cross_rule=proposal.cross_rule)


def tree_round(decoder: Decoder, proposal) -> Round:
    """speculative_round over a token tree (drafters/tree.py): one pass over the flattened
    tree, each node seeing the context and its ancestors (tree_verify), the multi-candidate
    rule (tree_acceptance), the cache compacted to the accepted path."""
    parents = proposal.parents
    verify_input = mx.concatenate([mx.array(decoder.history[-1:], mx.uint32), proposal.tokens])
    decoder.target.anchor()
    with round_attention(), tree_attention(decoder.target.trimmable, parents):
        target_logits = decoder.target.forward(verify_input)  # (N, V)
    hidden = decoder.target.hidden  # (N, H) when a head drafts: each node's, its path's alone
    target_logprobs = logprobs_from_logits(target_logits, decoder.sampling)  # (N, V)
    path, token, drafted = _judge_tree(decoder, proposal, target_logits, target_logprobs)
    n, token = _stop_at(decoder.stop_tokens, [drafted[i - 1] for i in path], len(path), token)
    path = path[:n]
    keep_path(decoder.target, [0] + path)
    proposal.drafter.commit(path)
    tokens = [drafted[i - 1] for i in path] + [token]
    rows = mx.array([0] + path)
    if hidden is not None:  # the root's and the accepted nodes' states, as a chain's
        _follow(decoder, tokens, hidden[rows])
    decoder.history.extend(tokens)
    depth = max(depths(parents))
    return Round(tokens, int(depth), n, proposal.source,
                 _reported(target_logits[rows], target_logprobs[rows], decoder.sampling),
                 tree_nodes=len(parents) - 1, tree_width=proposal.width,
                 spine_kept=proposal.along_spine(path), spine_length=len(proposal.spine))


def _judge_tree(decoder: Decoder, proposal, target_logits, target_logprobs):
    """(accepted nodes, the next token, every drafted token) as host values: one sync."""
    greedy = decoder.accept is greedy_accept
    parts = tree_parts(proposal.parents, proposal.tokens, proposal.probs, target_logits,
                       target_logprobs, greedy)
    values = decoder.agree(parts).tolist()  # the only sync of the round
    return read_tree(proposal.parents, values, greedy)


def processed(processors, seen: mx.array, drafts: mx.array, logits: mx.array) -> mx.array:
    """Each verified position's logits (k+1, V) through the caller's processors, each with
    the tokens before it (`seen`, then the drafts before that position), as mlx-lm's
    generate_step hands them over: the call's prompt and every token since."""
    tokens = mx.concatenate([seen, drafts.astype(mx.uint32)])
    rows = []
    for i in range(logits.shape[0]):
        row = logits[i:i + 1]
        for processor in processors:
            row = processor(tokens[:seen.shape[0] + i], row)
        rows.append(row)
    return mx.concatenate(rows)


def _judge(accept, proposal, target_logits, target_logprobs, agree=lambda x: x):
    """(accepted n, the target's next token, the drafted tokens, each draft's chance of being
    kept or None) as host values: one sync (judge.py: the same verdict a batch row gets)."""
    greedy, chances = accept is greedy_accept, accept is speculative_accept
    parts = verdict_parts(accept, proposal.tokens, proposal.probs, target_logits,
                          target_logprobs, chances=chances)
    values = agree(parts).tolist()  # the only sync of the round
    return read_verdict(values, proposal.num_tokens, greedy, chances)


def _follow(decoder: Decoder, tokens: List[int], hidden) -> None:
    """Hand the target's hidden states at the kept positions, with the token after each, on."""
    for drafter in decoder.followers:
        drafter.follow(tokens, hidden[: len(tokens)])


def _stop_at(stop_tokens, drafted: List[int], n: int, token: int):
    """End the round at an accepted stop token: (accepted n, the token after them)."""
    tokens = stop_cut(drafted[:n] + [token], stop_tokens)
    return len(tokens) - 1, tokens[-1]


def _reported(target_logits, target_logprobs, sampling: SamplingConfig) -> mx.array:
    """Log-probabilities to report: the model's own; at temp 0 they are the same array."""
    return target_logprobs if sampling.greedy else model_logprobs(target_logits)


def plain_rounds(decoder: Decoder, count: int,
                 until: Optional[Callable[[List[int]], bool]] = None,
                 embedding: Optional[mx.array] = None) -> Iterator[Round]:
    """Up to `count` ordinary decoding steps, the next one queued before yielding.

    `until(history)` true (say, prompt lookup found a match) stops queuing: the
    step already queued still completes, so the block ends one token later.
    """

    def step(y, seen, embedding=None):
        """Queue the step after `y` (the last of `seen`, the tokens so far: lazy after the first;
        `embedding`: fed in place of y's own)."""
        target_logits = decoder.target.forward(y, embedding)[-1]
        if decoder.processors:
            target_logits = processed(decoder.processors, seen, y[:0], target_logits[None])[0]
        target_logprobs = logprobs_from_logits(target_logits, decoder.sampling)  # (V,)
        token = decoder.agree(sample(target_logits if decoder.sampling.greedy else target_logprobs,
                                     decoder.sampling))  # greedy: the argmax, as in judge.py
        mx.async_eval(token)
        return token, _reported(target_logits, target_logprobs, decoder.sampling), \
            decoder.target.hidden, seen

    seen = mx.array(decoder.history, mx.uint32) if decoder.processors else None
    token, logprobs, hidden, seen = step(mx.array(decoder.history[-1:], mx.uint32), seen, embedding)
    for i in range(count):
        pending = None
        if i + 1 < count:
            pending = step(token[None], None if seen is None else
                           mx.concatenate([seen, token[None].astype(mx.uint32)]))
        value = token.item()  # the only sync of the step
        _follow(decoder, [value], hidden)
        decoder.history.append(value)
        yield Round([value], 0, 0, "target", logprobs[None], opens_block=i == 0)
        if value in decoder.stop_tokens or pending is None:
            return
        if until is not None and i + 2 < count and until(decoder.history):
            count = i + 2  # the queued step is the last
        token, logprobs, hidden, seen = pending


class RoundClock:
    """The seconds each round took, for the policy (which keeps no clock).

    The first round is timed from when the loop first asks the policy (after
    the prefill), not from the first answer: otherwise the first plain block
    loses its first step, which carries the next one's dispatch, while its
    last step (nothing queued after it) takes a quarter of a step. A trial's 3
    timed steps read 6.8 ms against 9.3 in long blocks (shipped-f16, T = 0.7),
    which switched a draft that wins at k = 1 off after two rounds.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._last: Optional[float] = None

    def start(self) -> None:
        if self._last is None:
            self._last = self.clock()

    def lap(self) -> Optional[float]:
        """Seconds since the last lap (or the start); None before any start."""
        now = self.clock()
        seconds = None if self._last is None else now - self._last
        self._last = now
        return seconds


def generate_rounds(
    prompt: List[int],
    target: ModelCache,
    drafters: Sequence,
    policy: DraftPolicy,
    *,
    sampling: SamplingConfig,
    max_tokens: int,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    accept: Optional[AcceptanceRule] = None,
    stop_tokens: Collection[int] = (),
    agree: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Sequence = (),
    input_embeddings: Optional[mx.array] = None,
    kv_quantizer: Optional[KVQuantizer] = None,
) -> Iterator[Round]:
    """Prefill, then yield rounds until `max_tokens` tokens or a stop token were emitted.

    No round goes past `max_tokens` or past an accepted stop token, so the
    caches never hold more than what was emitted (plus the last token, which
    the next pass starts from). With `kv_quantizer` (mlx-lm's kv_bits) no round
    reaches past the position where the target's cache is quantized, which
    happens between rounds (cache/quantize.py).
    """
    followers = [d for d in drafters if getattr(d, "follows_target", False)]
    decoder = Decoder(target, drafters, sampling, list(prompt),
                      accept or rule_for(sampling), frozenset(stop_tokens), followers,
                      processors=tuple(logits_processors or ()))
    if agree is not None:  # a sharded target (mlx_spec.distributed)
        decoder.agree = agree
    # Progress as mlx-lm reports it: (0, N), after each chunk of the first N - 1, (N, N) with
    # the first token.
    progress = prompt_progress_callback or (lambda done, total: None)
    progress(0, len(prompt))
    look_rows = _look_rows(drafters, policy, agree, decoder.processors, sampling) \
        if len(prompt) > prompt_look.MIN_ROWS else 0  # (a reused cache: the new tokens only)
    split = look_rows > 0 and prompt_look.keep_hidden(target)
    started = time.perf_counter()
    prefill(target, prompt[:-1], prefill_step_size, lambda done, _: progress(done, len(prompt)),
            followers, prompt[-1], None if input_embeddings is None else input_embeddings[:-1],
            tail=look_rows if split and kv_quantizer is None and not keeps_prefix(
                target.trimmable) else 0,  # (kv_bits, max_kv_size: mlx-lm's chunks)
            settle=kv_quantizer.settle if kv_quantizer is not None else None)
    per_token = (time.perf_counter() - started) / (len(prompt) - 1) if len(prompt) > 1 else None
    if per_token is not None and hasattr(policy, "observe_prefill"):  # v's prior
        policy.observe_prefill(len(prompt) - 1, per_token * (len(prompt) - 1))
    if hasattr(policy, "expect_reply"):  # what exploring can pay off over
        policy.expect_reply(max_tokens)
    target_tail = prompt_look.tail_logits(target, look_rows) if look_rows else None
    if split:
        prompt_look.drop_hidden(target)
    later = {}  # drafters whose prompt waits until the policy first asks them for drafts
    for drafter in drafters:
        if hasattr(drafter, "prefill"):
            if _prefills_later(drafter, policy, agree, look_rows):
                later[drafter.source] = drafter
            else:
                looks = {"look_rows": look_rows} if prompt_look.offers(drafter) else {}
                _prefill_drafter(drafter, prompt, prefill_step_size, policy, **looks)
        if hasattr(drafter, "step_seconds") and \
                getattr(policy, "wants_draft_step", lambda source: False)(drafter.source):
            policy.observe_draft_step(drafter.source, drafter.step_seconds(prompt[-1]))
        if hasattr(drafter, "attach"):  # it reads the history as it grows (suffix drafting)
            drafter.attach(decoder.history)
    looks = prompt_look.gather(target_tail, drafters, sampling) if look_rows else {}
    del target_tail
    # Drafters whose tree width the policy chooses (drafters/tree.py), if it can
    shaped = [d for d in drafters if getattr(d, "max_width", None)] \
        if hasattr(policy, "tree_width") else []
    for drafter in shaped:
        policy.allow_trees(drafter.source, drafter.max_width)
    emitted = 0
    clock = RoundClock()
    while emitted < max_tokens:
        clock.start()  # once: the first round is timed from when it is asked for
        room = max_tokens - emitted  # drafts beyond it are never wanted
        # positions before the target's cache is quantized (None: no limit)
        fits = kv_quantizer.room() if kv_quantizer is not None else None
        drafts = room if fits is None else min(room, fits - 1)
        lengths = {d.source: min(policy.proposal_length(d.source), drafts) for d in drafters}
        for drafter in shaped:
            drafter.width = policy.tree_width(drafter.source)
        for source in [source for source in later if lengths.get(source, 0) > 0]:
            _prefill_drafter(later.pop(source), decoder.history, prefill_step_size, policy)
            clock.lap()  # (its time is the prefill's, no round's)
        proposal = first_proposal(decoder.drafters, decoder.history, lambda s: lengths.get(s, 0)) \
            if input_embeddings is None or emitted else None
        if proposal is None and input_embeddings is not None and not emitted:
            # The first token comes from the prompt's last embedding: a plain step.
            rounds = plain_rounds(decoder, 1, embedding=input_embeddings[-1:])
        elif proposal is not None:
            verify = tree_round if getattr(proposal, "parents", None) else speculative_round
            round_ = verify(decoder, proposal)
            if len(round_.tokens) > room:  # every draft kept and the room full: the target's
                round_ = _without_own_token(decoder, round_)  # own token is not wanted (mlx-lm)
            rounds = iter([round_])
        else:
            waiting = [d for d in drafters if lengths[d.source] > 0]  # asked, nothing to offer
            steps = min(policy.plain_steps() if drafters else max_tokens, max_tokens - emitted,
                        fits or max_tokens)
            rounds = plain_rounds(decoder, max(1, steps), _offers(waiting) if waiting else None)
        for round_ in rounds:
            if emitted == 0:
                progress(len(prompt), len(prompt))
            emitted += len(round_.tokens)
            policy.observe(round_, clock.lap())
            yield round_
            if round_.tokens[-1] in decoder.stop_tokens:
                if kv_quantizer is not None:  # (as after any round: the cache the call leaves)
                    kv_quantizer.settle()
                return
        if looks:  # after the first round: see _take_look
            _take_look(policy, looks, sampling, look_rows, per_token, max_tokens)
            looks = {}
            clock.lap()  # its time is no round's
        if kv_quantizer is not None:  # (the caller has released what it was shown)
            kv_quantizer.settle()


def _prefills_later(drafter, policy, agree, look_rows: int) -> bool:
    """Whether a model drafter's prompt waits until the adaptive policy first asks it for
    drafts: on a machine where it cannot pay (its step, timed on no context, and the target's
    verify cost tell the policy so before the first round) it is never read at all; on a
    CPU a draft's prefill costs about as many of its steps as the prompt has tokens. Not
    when the prompt look reads its prefill, nor on a sharded target (every rank prefills
    together), nor under a fixed k (it drafts at once)."""
    return (getattr(drafter, "prefills_later", False) and agree is None
            and hasattr(policy, "observe_prefill")
            and not (look_rows and prompt_look.offers(drafter)))


def _prefill_drafter(drafter, tokens: List[int], step_size: int, policy, **looks) -> None:
    """Feed a model drafter all of `tokens` but the last (evaluated: its time is its own) and
    tell the policy what that cost per token (a catch-up's cost after an off period)."""
    started = time.perf_counter()
    drafter.prefill(tokens, step_size, **looks)
    if hasattr(policy, "observe_catch_up"):
        policy.observe_catch_up(drafter.source, len(tokens) - 1, time.perf_counter() - started)


def _take_look(policy, looks, sampling: SamplingConfig, most: int,
               per_token: Optional[float], max_tokens: int) -> None:
    """The prompt look, evaluated after the first round and handed to the policy: the first
    token does not wait for it, and a source the first plain step already switched off (a draft
    whose step costs a target step) is not looked at (`policy.still_looks`). Over as many of
    the `most` rows gathered as its share of the reply buys (policy.look_rows, from the
    target's prefill time `per_token`): none when too dear."""
    wanted = getattr(policy, "still_looks", lambda source: True)
    rows = getattr(policy, "look_rows", lambda per_token, tokens, most: most)(
        per_token, max_tokens, most)
    for source, (acceptance, seen) in prompt_look.look(looks, wanted, rows).items():
        policy.observe_prompt_look(source, acceptance, seen, greedy=sampling.greedy)


def _look_rows(drafters, policy, agree, processors, sampling: SamplingConfig) -> int:
    """How many prompt positions the prompt look compares (0: none): when the policy wants one
    (at T > 0), not on a sharded target (each rank would judge on its
    own) nor with logits processors (they change p)."""
    wants = getattr(policy, "wants_prompt_look", None)
    wanted = (wants is not None and wants(sampling.greedy)
              and agree is None and not processors
              and any(prompt_look.offers(d) for d in drafters))
    return prompt_look.ROWS if wanted else 0


def _without_own_token(decoder: Decoder, round_: Round) -> Round:
    """The round without its last token, the target's own after every draft was kept: the
    target cache then holds the whole history (the generation ends here)."""
    decoder.history.pop()
    return replace(round_, tokens=round_.tokens[:-1], logprobs=round_.logprobs[:-1])


def _offers(drafters) -> Callable[[List[int]], bool]:
    """Whether any of `drafters` would propose after this history (cheap: no model runs)."""
    return lambda history: any(d.can_propose(history) for d in drafters)
