"""A draft model with recurrent state in a batch (issue 62: the batched draft takes what a
call's one-row draft takes). Gated DeltaNet (qwen3_5, qwen3_next), short-convolution (lfm2)
and Mamba-2 (nemotron_h) drafts propose for rows of different lengths that join, leave and
reject drafts mid-chain: each row's drafts, round after round, must be what the draft model
alone drafts from that row's text (a state that took in another row's filler, or kept a
rejected draft, drafts something else), and each row's text the target's own. At T = 1 the
rows' tokens 3 and 4, mostly after a rejection, keep the target's distribution."""

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from batch_exactness import SAMPLES, SMALL_VOCAB, check_rows_after_a_rejection
from families import make_family, plain_greedy, shared_family, shared_plain_greedy
from tiny import make_llama

from mlx_spec.batch import BatchEngine, RowRequest, batchable
from mlx_spec.batch.drafts import BatchDraft

MAX_TOKENS = 24


def related(name, noise=0.3, seed=1, **kwargs):
    """The target's family and weights plus Gaussian noise: a draft that keeps some drafts
    and rejects others, so chains end at every depth."""
    model = make_family(name, **kwargs)
    key = mx.random.key(seed)
    noisy = [(path, w + noise * mx.std(w).item() * mx.random.normal(w.shape, key=k))
             for (path, w), k in zip(tree_flatten(model.parameters()),
                                     mx.random.split(key, len(tree_flatten(model.parameters()))))]
    model.load_weights(noisy)
    mx.eval(model.parameters())
    return model


def ragged_prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(n)] for n in [5, 1, 17, 9, 3, 12][:count]]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "lfm2", "nemotron_h"])
def test_every_row_drafts_what_the_draft_alone_drafts(family, monkeypatch):
    target, draft = shared_family(family), related(family)
    assert batchable(draft)
    seen = []  # (the row's text, its drafts) of every row every round
    propose = BatchDraft.propose

    def spy(self, rows, k, drawn):
        tokens, q = propose(self, rows, k, drawn)
        seen.extend((list(row.history), tokens[i, :drawn[i]].tolist())
                    for i, row in enumerate(rows) if drawn[i])
        return tokens, q

    monkeypatch.setattr(BatchDraft, "propose", spy)
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    prompts = ragged_prompts(6)
    uids = [engine.insert(RowRequest(p, MAX_TOKENS, prompt_lookup=False)) for p in prompts[:5]]
    out, step, partial = {u: [] for u in uids}, 0, 0
    while engine.busy:
        if step == 2:  # a row joins while the others decode
            uids.append(engine.insert(RowRequest(prompts[5], MAX_TOKENS, prompt_lookup=False)))
            out[uids[-1]] = []
        if step == 4:
            engine.cancel(uids[1])
        for o in engine.step():
            out[o.uid] += o.tokens
            partial += 0 < o.num_accepted < o.num_drafted
        step += 1
    for i, (uid, prompt) in enumerate(zip(uids, prompts)):
        want = shared_plain_greedy(target, prompt, MAX_TOKENS)
        assert out[uid] == (want[:len(out[uid])] if i == 1 else want)
    assert partial >= 5  # chains cut short: rows kept different numbers of drafts
    assert len(seen) > 40
    for history, drafts in seen:
        assert drafts == plain_greedy(draft, history, len(drafts)), (history, drafts)


def test_a_kept_cache_holds_the_drafts_state_too():
    """A row's kept cache (the prompt-cache store's) holds the draft's recurrent state after
    exactly its text: a second turn on it equals a fresh row's, drafts included."""
    target, draft = shared_family("qwen3_5"), related("qwen3_5")
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    prompt = ragged_prompts(3)[2]
    engine.insert(RowRequest(prompt, 16, prompt_lookup=False, keep_cache=True))
    first, kept = [], None
    while engine.busy:
        for o in engine.step():
            first += o.tokens
            kept = o.cache if o.finish_reason else kept
    second = prompt + first + [5, 9, 11]

    def turn(cache=None, cached=0):
        engine.insert(RowRequest(second, 12, prompt_lookup=False), cache, cached=cached)
        tokens, accepted = [], 0
        while engine.busy:
            for o in engine.step():
                tokens += o.tokens
                accepted += o.num_accepted
        return tokens, accepted

    assert turn(kept, len(prompt) + len(first)) == turn()
    assert turn()[0] == shared_plain_greedy(target, second, 12)


@pytest.fixture(scope="module")
def small_hybrid_pair():
    return (make_llama(vocab_size=SMALL_VOCAB, seed=0),
            make_family("qwen3_5", seed=7, vocab_size=SMALL_VOCAB))


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_rows_after_a_rejection_are_distributed_as_the_target(small_hybrid_pair, residual,
                                                              exact):
    check_rows_after_a_rejection(*small_hybrid_pair, residual, exact, min_rewound=SAMPLES // 2)


def test_a_draft_it_cannot_batch_is_refused_in_one_sentence():
    """Attention sinks (a rotating window that keeps its first tokens) need a mask of their own."""
    from mlx_lm.models.cache import RotatingKVCache

    target = make_llama(seed=0)
    draft = make_llama(seed=3, hidden=32, layers=1)
    draft.make_cache = lambda: [RotatingKVCache(max_size=16, keep=4) for _ in draft.layers]
    with pytest.raises(ValueError, match="draft model's cache layers"):
        BatchEngine(target, draft)
