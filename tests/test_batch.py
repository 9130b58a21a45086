"""Batched speculative decoding (mlx_spec.batch): every row as if it were alone.

- Greedy: a batch of 1 row and ragged batches of 5, several k, draft model / prompt lookup /
  none: every row equals mlx-lm's own greedy decoding of its prompt, token for token.
- Rows joining mid-batch and rows cancelled mid-batch change nobody else's tokens; the
  caches are empty again when the batch drains; a row's kept cache holds its text exactly.
- T = 1: chi-square of tokens 3 and 4 of one prompt's rows in a batch that is refilled as
  rows end (other prompts beside it), with a poor draft: most samples rewound a rejected
  draft before token 3; the same with the target's MTP head drafting (made over-confident),
  and with prompt lookup alone (no draft model: on by default).
  The broken rule (resampling from p) must fail the same test.
"""

import random
import statistics

import mlx.core as mx

import pytest

from batch_exactness import SAMPLES, SMALL_VOCAB, check_rows_after_a_rejection
from families import plain_greedy, shared_family, shared_plain_greedy
from tiny import make_llama, perturbed

from mlx_spec.batch import BatchEngine, RowRequest, batchable
from mlx_spec.sampling import SamplingConfig

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0)
    return target, perturbed(target, 0.05, 1)


def ragged_prompts(count, seed=0):
    rng = random.Random(seed)
    lengths = [5, 1, 17, 9, 3][:count]
    return [[rng.randrange(64) for _ in range(n)] for n in lengths]


def run(engine, requests, joins=(), cancels=()):
    """Every row's tokens; `joins`: (step, request) inserted at that step; `cancels`: (step,
    index of a request in `requests`)."""
    uids = [engine.insert(r) for r in requests]
    out = {u: [] for u in uids}
    step = 0
    joins, cancels = list(joins), list(cancels)
    while engine.busy or joins:
        for at, request in [j for j in joins if j[0] == step]:
            uid = engine.insert(request)
            uids.append(uid)
            out[uid] = []
            joins.remove((at, request))
        for at, index in [c for c in cancels if c[0] == step]:
            engine.cancel(uids[index])
        for o in engine.step():
            out[o.uid] += o.tokens
        step += 1
    return [out[u] for u in uids]


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("k", [None, 1, 3])
@pytest.mark.parametrize("source", ["draft", "lookup", "draft+lookup"])
def test_every_row_equals_its_own_greedy_decoding(pair, rows, k, source, monkeypatch):
    from mlx_spec.batch.drafts import BatchDraft

    # a draft step timed as free: a draft as large as its target is otherwise never tried by
    # a row alone's policy (it times one step first), and these rows must speculate
    monkeypatch.setattr(BatchDraft, "step_seconds", lambda self, row: 1e-6)
    target, draft = pair
    prompts = ragged_prompts(rows)
    if "lookup" in source:  # something to look up: the prompt repeats itself
        prompts = [p + p + p for p in prompts]
    engine = BatchEngine(target, draft if "draft" in source else None, num_draft_tokens=k)
    got = run(engine, [RowRequest(p, MAX_TOKENS, prompt_lookup="lookup" in source)
                       for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert sum(n for kk, n in engine.rounds.items() if kk > 0) > 0  # it really speculated


def test_drafts_were_accepted_in_batches(pair):
    """The draft model's batched drafts are really the draft's: an identical draft is kept."""
    target, _ = pair
    engine = BatchEngine(target, target, num_draft_tokens=4)
    uids = [engine.insert(RowRequest(p, MAX_TOKENS, prompt_lookup=False)) for p in ragged_prompts(5)]
    drafted = accepted = 0
    while engine.busy:
        for o in engine.step():
            drafted += o.num_drafted
            accepted += o.num_accepted
    assert len(uids) == 5 and drafted > 100 and accepted >= 0.95 * drafted, (accepted, drafted)


@pytest.mark.parametrize("temp,penalty", [(0.0, None), (1.0, None), (0.0, 1.5)])
def test_one_batched_row_drafts_as_the_draft_model_alone(pair, monkeypatch, temp, penalty):
    """One row at a fixed k feeds the draft model what a call of its own feeds it and drafts
    from the same logits, round after round: the draft's chain is one implementation
    (drafters/chain.py). Greedy: the same drafts and the same kept count; sampled (each draws
    with its own random stream): the draft's distributions q over the first round's drafts.
    With a repetition penalty both drafts see it (its text and the drafts before each)."""
    from mlx_lm.sample_utils import make_logits_processors
    from mlx_spec.batch.drafts import BatchDraft
    from mlx_spec.drafters import DraftModelDrafter
    from mlx_spec.generate import speculative_generate_step

    target, draft = pair
    prompt = ragged_prompts(3)[2]
    drafted = {"alone": [], "batched": []}
    propose, batch_propose = DraftModelDrafter.propose, BatchDraft.propose

    def spy(self, history, k):
        proposal = propose(self, history, k)
        drafted["alone"].append((proposal.tokens.tolist(), proposal.probs))
        return proposal

    def batch_spy(self, rows, k, drawn):
        tokens, q = batch_propose(self, rows, k, drawn)
        drafted["batched"].append((tokens[0, :drawn[0]].tolist(), q[0]))
        return tokens, q

    monkeypatch.setattr(DraftModelDrafter, "propose", spy)
    monkeypatch.setattr(BatchDraft, "propose", batch_spy)
    sampling = SamplingConfig(temp=temp)
    processors = lambda: make_logits_processors(repetition_penalty=penalty) if penalty else None  # noqa: E731
    alone = sum(r.num_accepted for r in speculative_generate_step(
        prompt, target, draft, max_tokens=MAX_TOKENS, num_draft_tokens=3, prompt_lookup=False,
        calibration=None, sampling=sampling, logits_processors=processors()))
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    engine.insert(RowRequest(prompt, MAX_TOKENS, sampling, prompt_lookup=False,
                             logits_processors=processors()))
    batched = 0
    while engine.busy:
        batched += sum(out.num_accepted for out in engine.step())
    if temp == 0:
        assert batched == alone > 0
        assert [t for t, _ in drafted["batched"]] == [t for t, _ in drafted["alone"]]
        assert len(drafted["alone"]) > 5
    else:  # the first round: the same context, so the same q for the first draft
        (_, q_alone), (_, q_batched) = drafted["alone"][0], drafted["batched"][0]
        assert q_alone.shape == q_batched.shape == (3, 64)
        assert mx.allclose(q_alone[0], q_batched[0], atol=1e-5).item()


def test_rows_joining_and_cancelled_mid_batch_change_nobody_else(pair):
    target, draft = pair
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    late = RowRequest([7, 7, 1, 2], MAX_TOKENS)
    got = run(engine, [RowRequest(p, MAX_TOKENS) for p in prompts],
              joins=[(4, late)], cancels=[(6, 1)])
    for i, prompt in enumerate(prompts):
        if i != 1:
            assert got[i] == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert 0 < len(got[1]) < MAX_TOKENS  # cancelled mid-way
    assert got[5] == shared_plain_greedy(target, late.prompt, MAX_TOKENS)
    assert engine.target.layers is None and engine.draft.cache.layers is None  # drained


def test_a_kept_cache_holds_exactly_the_rows_text(pair):
    target, draft = pair
    prompts = ragged_prompts(3)
    engine = BatchEngine(target, draft, num_draft_tokens=2)
    uids = [engine.insert(RowRequest(p, 12, keep_cache=True)) for p in prompts]
    ends = {}
    tokens = {u: [] for u in uids}
    while engine.busy:
        for o in engine.step():
            tokens[o.uid] += o.tokens
            if o.finish_reason:
                ends[o.uid] = o.cache
    for uid, prompt in zip(uids, prompts):
        text = prompt + tokens[uid]
        cache = ends[uid]
        n_target = len(target.layers)
        assert [c.offset for c in cache] == [len(text)] * len(cache)
        # The next token from the kept cache is the one a fresh forward gives.
        from_cache = target(mx.array([[3]]), cache=cache[:n_target])[0, -1]
        fresh = target(mx.array([text + [3]]))[0, -1]
        assert mx.allclose(from_cache, fresh, atol=1e-4).item()


def seeded_alone_and_beside(pair, others, **engine):
    """A seeded T = 1 row's tokens decoded alone and after `others` in one batch, each on an
    engine of its own made with `engine`."""
    target, draft = pair
    seeded = RowRequest([5, 9, 2], 24, SamplingConfig(temp=1.0), seed=11)
    return (run(BatchEngine(target, draft, **engine), [seeded])[0],
            run(BatchEngine(target, draft, **engine), list(others) + [seeded])[-1])


def test_a_seeded_row_is_the_same_whatever_else_is_in_the_batch(pair):
    sampling = SamplingConfig(temp=1.0)
    alone, crowd = seeded_alone_and_beside(
        pair, [RowRequest(p, 24, sampling, seed=i) for i, p in enumerate(ragged_prompts(4))],
        num_draft_tokens=3)
    assert alone == crowd


def test_a_seeded_row_pinned_past_the_longest_k_is_the_same_in_any_batch(pair):
    """The batch policy choosing (no fixed k) with max_draft_tokens = 2: a seeded sampled row
    still drafts the default k (4) every round; the policy reads its acceptance that deep, and
    its text is the same alone and beside other rows."""
    alone, crowd = seeded_alone_and_beside(
        pair, [RowRequest(p, 24) for p in ragged_prompts(3)], max_draft_tokens=2)
    assert alone == crowd and len(alone) == 24


def test_targets_it_cannot_batch_are_refused_in_one_sentence():
    """Quantized KV caches: mlx-lm has no batched kind of them."""
    from mlx_lm.models.cache import QuantizedKVCache

    model = make_llama(vocab_size=64, seed=5, hidden=32, layers=1)
    model.make_cache = lambda: [QuantizedKVCache() for _ in model.layers]
    assert not batchable(model)
    with pytest.raises(ValueError, match="one request at a time"):
        BatchEngine(model)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5-4bit", "lfm2",
                                    "nemotron_h"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_recurrent_hybrid_rows_equal_their_own_greedy_decoding(family, k, rows):
    """Recurrent state per row: restored and re-run over each row's own kept prefix after a
    partial accept (Gated DeltaNets by their recurrence, masked per row; short convolutions
    (lfm2) and Mamba-2 mixers (nemotron_h) once per distinct kept length). An unrelated draft
    rejects often, so most rounds rewind some rows. The 4-bit target has quantized weights
    (its KV cache stays a plain KVCache)."""
    from tiny import make_llama

    name, _, bits = family.partition("-")
    target = shared_family(name, quantize_bits=int(bits[:-3]) if bits else None)
    assert batchable(target)
    draft = make_llama(vocab_size=64, seed=5, hidden=32, layers=1)
    prompts = ragged_prompts(rows)
    engine = BatchEngine(target, draft, num_draft_tokens=k)
    got = run(engine, [RowRequest(p, 24, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, 24)


@pytest.mark.parametrize("family", ["lfm2", "nemotron_h", "falcon_h1", "mamba2"])
def test_recurrent_rows_join_leave_and_continue_from_a_kept_cache(family):
    """Short-conv and Mamba-2 state through the batch's whole life (Falcon-H1's beside each
    layer's attention in one CacheList; Mamba-2's alone, rows with no padding): a row joins
    late, one is cancelled, the others keep their caches; a second turn on one of them (its
    cache holding the prompt and answer, the next prompt prefilled on top) equals decoding it
    fresh."""
    target = shared_family(family)
    engine = BatchEngine(target, make_llama(vocab_size=64, seed=5, hidden=32, layers=1),
                         num_draft_tokens=3)
    prompts = ragged_prompts(3) + [[7, 7, 1, 2]]
    uids = [engine.insert(RowRequest(p, 20, prompt_lookup=False, keep_cache=True))
            for p in prompts[:3]]
    tokens, kept, step = {}, {}, 0
    while engine.busy:
        if step == 2:
            uids.append(engine.insert(RowRequest(prompts[3], 20, prompt_lookup=False)))
        if step == 3:
            engine.cancel(uids[1])
        for o in engine.step():
            tokens[o.uid] = tokens.get(o.uid, []) + o.tokens
            if o.finish_reason:
                kept[o.uid] = o.cache
        step += 1
    for i in (0, 2, 3):
        assert tokens[uids[i]] == shared_plain_greedy(target, prompts[i], 20)
    assert 0 < len(tokens[uids[1]]) < 20
    text = prompts[0] + tokens[uids[0]]
    second = text + [5, 9, 11]
    engine.insert(RowRequest(second, 12, prompt_lookup=False), kept[uids[0]], cached=len(text))
    again = []
    while engine.busy:
        for o in engine.step():
            again += o.tokens
    assert again == shared_plain_greedy(target, second, 12)


def test_bad_rows_are_refused(pair):
    target, _ = pair
    engine = BatchEngine(target)
    with pytest.raises(ValueError, match="empty"):
        engine.insert(RowRequest([], 4))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.insert(RowRequest([1, 999], 4))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.insert(RowRequest([1], 0))


# --- T = 1: tokens 3 and 4 of rows in a continuously refilled batch ---

@pytest.fixture(scope="module")
def small_pair():
    return (make_llama(vocab_size=SMALL_VOCAB, seed=0),
            make_llama(vocab_size=SMALL_VOCAB, seed=7, hidden=32, layers=1))


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_rows_after_a_rejection_are_distributed_as_the_target(small_pair, residual, exact):
    # tokens 3 and 4 mostly came after a rewind
    check_rows_after_a_rejection(*small_pair, residual, exact, min_rewound=SAMPLES // 2)


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_lookup_rows_after_a_rejection_are_distributed_as_the_target(small_pair, residual, exact):
    """No draft model: every row looks up by default at T = 1 (q a point mass); 263 of the 600
    rows rewound a rejected lookup draft before token 3 (seed 0)."""
    check_rows_after_a_rejection(small_pair[0], None, residual, exact, min_rewound=SAMPLES // 3)


# --- the batch policy on synthetic rounds: seconds from a cost model, each row keeping each
# draft with its own chance (drawn with a fixed seed) ---

class FakeRow:
    """What the batch policy reads of a row: its acceptance and the drafts it verifies."""

    def __init__(self, policy, chance, greedy=True, pinned=None):
        self.chance, self.pinned = chance, pinned
        self.acceptance = policy.new_estimate(greedy)

    def wants(self, k):
        return k if self.pinned is None else self.pinned


class FakeOutput:
    def __init__(self, drafted, accepted):
        self.num_drafted, self.num_accepted = drafted, accepted
        self.tokens = [0] * (accepted + 1)


def drive(policy, rows, seconds_of, rounds, seed=0):
    """Run `rounds` rounds of `rows` (FakeRow); returns the k of every round."""
    rng, ks = random.Random(seed), []
    for _ in range(rounds):
        k = policy.choose(rows)
        outputs = []
        for row in rows:
            n, drafted = 0, row.wants(k)
            while n < drafted and rng.random() < row.chance:
                n += 1
            outputs.append(FakeOutput(drafted, n))
        policy.observe(rows, outputs, k, seconds_of(k))
        ks.append(k)
    return ks


def test_a_compute_bound_batch_goes_plain_and_stays_there():
    """Verify cost linear in B x (k + 1) (a CPU at B = 8) plus the draft's steps: drafting
    can never pay; the policy must be at k = 0 within a few rounds and try drafting again at
    most once."""
    from mlx_spec.batch.policy import BatchPolicy

    policy = BatchPolicy(max_k=8)
    rows = [FakeRow(policy, 0.6) for _ in range(8)]
    ks = drive(policy, rows, lambda k: 0.004 * 8 * (k + 1) + 0.002 * k, 200)
    assert all(k == 0 for k in ks[4:8]), ks[:10]
    assert sum(k > 0 for k in ks[8:]) <= 2, ks


def test_a_memory_bound_batch_keeps_drafting_deep():
    """Verify cost flat in k (a GPU at small B) and drafts always kept: k climbs to the top."""
    from mlx_spec.batch.policy import BatchPolicy

    policy = BatchPolicy(max_k=6)
    rows = [FakeRow(policy, 1.0) for _ in range(2)]
    ks = drive(policy, rows, lambda k: 0.01 + 0.0005 * k, 400)
    assert ks[-1] == 6 and sum(k == 6 for k in ks[-50:]) >= 40, ks[-50:]


def expected_rate(chances, per_row, k):
    from mlx_spec.costmodel import expected_tokens_per_round as E

    return sum(E(a, k) if k else 1.0 for a in chances) / (0.01 + per_row * len(chances) * (k + 1))


@pytest.mark.parametrize("chances,per_row", [((0.7,) * 4, 0.004), ((0.9,) * 4, 0.001),
                                             ((0.4,) * 4, 0.002), ((0.95, 0.95, 0.1, 0.1), 0.002)])
def test_the_batch_policy_reaches_the_best_k_of_its_model(chances, per_row):
    """B = 4 rows, a round costing 0.01 + per_row x B x (k + 1) seconds, row i keeping each
    draft with its own chance: over the last 150 of 300 rounds the policy makes at least 0.95
    of the best fixed k's expected tokens per second (k = 0 included), computed here (bar set
    before the first run; the mixed rows' case added with the per-row acceptance)."""
    from mlx_spec.batch.policy import BatchPolicy

    policy = BatchPolicy(max_k=8)
    rows = [FakeRow(policy, a) for a in chances]
    ks = drive(policy, rows, lambda k: 0.01 + per_row * 4 * (k + 1), 300)[150:]
    got = statistics.fmean(expected_rate(chances, per_row, k) for k in ks)
    assert got >= 0.95 * max(expected_rate(chances, per_row, k) for k in range(9)), (got, ks[-10:])


def test_a_request_starts_from_its_sampling_prior_not_the_rows_before_it():
    """Policy state per request: rows that kept every draft leave; a new row's acceptance is
    its sampling's prior (greedy 0.75, sampled 0.5), and a neighbour's rejections never move
    it; what the machine measured (the batch size's cost line) stays."""
    from mlx_spec.batch.policy import BatchPolicy
    from mlx_spec.policy import DEFAULT_ACCEPTANCE_PRIOR, SAMPLING_ACCEPTANCE_PRIOR

    policy = BatchPolicy(max_k=8)
    first = [FakeRow(policy, 1.0) for _ in range(2)]
    drive(policy, first, lambda k: 0.01 + 0.0005 * k, 40)
    assert all(row.acceptance.acceptance > 0.95 for row in first)
    line = policy._size(2).line.fit[:]
    fresh, sampled = FakeRow(policy, 0.0), FakeRow(policy, 1.0, greedy=False)
    assert fresh.acceptance.acceptance == pytest.approx(DEFAULT_ACCEPTANCE_PRIOR)
    assert sampled.acceptance.acceptance == pytest.approx(SAMPLING_ACCEPTANCE_PRIOR)
    assert policy._size(2).line.fit == line
    drive(policy, [fresh, sampled], lambda k: 0.01 + 0.0005 * k, 20)
    assert fresh.acceptance.acceptance < 0.3 < 0.9 < sampled.acceptance.acceptance


def test_pinned_rows_do_not_hide_a_longer_k_from_the_others():
    """Three rows pinned to 6 drafts, every draft kept, beside one the batch decides for, also
    keeping every draft, verify cost flat in k: the free row's k climbs to the top (a trial's
    ceiling counts a pinned row's own k, not the batch's k + 1)."""
    from mlx_spec.batch.policy import BatchPolicy

    policy = BatchPolicy(max_k=6)
    rows = [FakeRow(policy, 1.0, pinned=6) for _ in range(3)] + [FakeRow(policy, 1.0)]
    ks = drive(policy, rows, lambda k: 0.01 + 0.00005 * k, 400)
    assert ks[-1] == 6, ks[-20:]
    # A trial of k = 3 against k = 2 is not hopeless: with every draft kept the pinned rows
    # keep their 7 tokens a round, not the batch's k + 1 = 4 (that ceiling marked it hopeless).
    assert not policy._hopeless(4, 3, 2)


def test_a_pinned_k_is_never_changed():
    from mlx_spec.batch.policy import BatchPolicy

    policy = BatchPolicy(max_k=8, fixed=3)
    rows = [FakeRow(policy, 0.5) for _ in range(4)]
    assert set(drive(policy, rows, lambda k: 1.0, 50)) == {3}


def test_suffix_rows_draft_from_the_rows_before_them(pair):
    """Rows with suffix drafting: a second batch of the same prompts drafts the first batch's
    answers from the shared index (most tokens accepted from "suffix"), every row still
    equal to its own greedy decoding."""
    from mlx_spec import SuffixIndex

    target, draft = pair
    index = SuffixIndex()
    prompts = ragged_prompts(3)
    for batch in range(2):
        engine = BatchEngine(target, draft, num_draft_tokens=4)
        uids = [engine.insert(RowRequest(p, MAX_TOKENS, suffix=index)) for p in prompts]
        tokens, by_suffix = {u: [] for u in uids}, 0
        while engine.busy:
            for o in engine.step():
                tokens[o.uid] += o.tokens
                by_suffix += o.num_accepted if o.source == "suffix" else 0
        for uid, prompt in zip(uids, prompts):
            assert tokens[uid] == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert by_suffix >= 0.75 * len(prompts) * MAX_TOKENS, by_suffix


def test_drafters_it_cannot_batch_are_refused_in_one_sentence(pair):
    from mlx_spec.batch.api import batch_generate

    target, _ = pair
    with pytest.raises(ValueError, match="Batched decoding takes loaded models"):
        BatchEngine(target, "a-directory-name")
    with pytest.raises(ValueError, match="MTP drafting supports"):  # a llama has no MTP head
        BatchEngine(target, "mtp")
    with pytest.raises(ValueError, match="prompts is empty"):
        batch_generate(target, None, [])


def test_batch_generate_gives_each_prompt_its_own_text(model_dirs):
    """The API on loaded models (text prompts, a tokenizer, EOS): each text equals
    mlx_spec.generate's for that prompt alone; more prompts than max_batch_size wait."""
    from mlx_spec import batch_generate, generate, load

    target, tokenizer = load(str(model_dirs["target"]))
    draft, _ = load(str(model_dirs["draft"]))
    prompts = ["def fibonacci(n):", "    return", "if n < 2:", "def f"]
    result = batch_generate(target, tokenizer, prompts, draft_model=draft, max_tokens=24,
                            max_batch_size=3)
    assert result.texts == [generate(target, tokenizer, p, draft_model=draft, max_tokens=24)
                            for p in prompts]
    assert all(r in ("stop", "length") for r in result.finish_reasons)
    assert result.stats["tokens"] == sum(map(len, result.token_ids))


def test_a_long_prompt_joins_in_chunks_while_the_others_decode(pair):
    """Prefill is interleaved with decoding: while a 300-token prompt is prefilled 64 tokens a
    step, the rows already in the batch get tokens at every step; then it joins, and every
    row (it too) equals its own greedy decoding. Memory returns to its level when the batch
    drains."""
    import gc

    target, draft = pair
    gc.collect()
    before = mx.get_active_memory()
    engine = BatchEngine(target, draft, num_draft_tokens=2, prefill_step_size=64)
    short = ragged_prompts(2)
    uids = [engine.insert(RowRequest(p, MAX_TOKENS)) for p in short]
    tokens = {u: [] for u in uids}
    for o in engine.step():  # the short ones join
        tokens[o.uid] += o.tokens
    rng = random.Random(3)
    long_prompt = [rng.randrange(64) for _ in range(300)]
    late = engine.insert(RowRequest(long_prompt, MAX_TOKENS))
    tokens[late] = []
    waited = 0
    while engine.joining:
        outs = engine.step()
        waited += 1
        assert set(uids) <= {o.uid for o in outs} and all(o.tokens for o in outs)
        assert late not in {o.uid for o in outs} or not engine.joining  # only once it joined
        for o in outs:
            tokens[o.uid] += o.tokens
    assert waited >= 4  # 299 prompt tokens, 64 a step
    while engine.busy:
        for o in engine.step():
            tokens[o.uid] += o.tokens
    for uid, prompt in zip(uids + [late], short + [long_prompt]):
        assert len(tokens[uid]) <= MAX_TOKENS
        assert tokens[uid] == shared_plain_greedy(target, prompt, MAX_TOKENS)[:len(tokens[uid])]
    assert len(tokens[late]) == MAX_TOKENS
    del engine
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() <= before + 2**20, (before, mx.get_active_memory())


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("k", [1, 3])
def test_sliding_window_rows_equal_their_own_greedy_decoding(family, k):
    """Windows of 8 tokens, prompts of up to 17 and 24 generated tokens: every row runs far
    past its window; the batch keeps the whole history and masks the window. The draft is
    the same family with other weights (sliding too; many rejections)."""
    target = shared_family(family)
    assert batchable(target)
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, shared_family(family, seed=5), num_draft_tokens=k)
    got = run(engine, [RowRequest(p, 24, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, 24)


def test_rows_with_logits_processors_equal_mlx_lms_own_decoding(pair):
    """Per-row processors (a repetition penalty on one row, a logit bias on another, none on
    a third) see each row's own tokens, drafts included: every row equals mlx-lm's
    generate_step with the same processors."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    target, draft = pair
    prompts = ragged_prompts(3)
    kinds = [dict(repetition_penalty=1.5), dict(logit_bias={5: 3.0, 7: -2.0}), {}]
    engine = BatchEngine(target, draft, num_draft_tokens=3)
    got = run(engine, [RowRequest(p, 24, logits_processors=make_logits_processors(**kind))
                       for p, kind in zip(prompts, kinds)])
    for prompt, kind, tokens in zip(prompts, kinds, got):
        expected = [int(t) for t, _ in generate_step(
            mx.array(prompt), target, max_tokens=24, sampler=lambda lp: mx.argmax(lp, axis=-1),
            logits_processors=make_logits_processors(**kind))]
        assert tokens == expected


@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_rows_equal_their_own_greedy_decoding(name, k, tmp_path):
    """The target's MTP head drafting for every row: its pairs per row (the prompt's from
    the prefill, then each round's kept positions), the chained steps for all rows at once;
    every row equals mlx-lm's greedy decoding and the head's drafts are partly accepted."""
    from test_mtp import make_target, mtp_params, write_original

    target = make_target(name)
    weights = write_original(tmp_path / "mtp", target, mtp_params(target))
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, "mtp", num_draft_tokens=k, mtp_weights=str(weights))
    uids = [engine.insert(RowRequest(p, 24, prompt_lookup=False)) for p in prompts]
    tokens, drafted, accepted = {u: [] for u in uids}, 0, 0
    while engine.busy:
        for o in engine.step():
            tokens[o.uid] += o.tokens
            drafted += o.num_drafted
            accepted += o.num_accepted if o.source == "mtp" else 0
    for uid, prompt in zip(uids, prompts):
        assert tokens[uid] == plain_greedy(target, prompt, 24)
    assert 0 < accepted < drafted


@pytest.fixture(scope="module")
def small_mtp_target(tmp_path_factory):
    """A tiny deepseek_v3 target over SMALL_VOCAB tokens and its MTP head made over-confident
    (the final norm x3): q far sharper than p, so a rule that ignores q shows."""
    from test_mtp import make_target, mtp_params, write_original

    target = make_target("deepseek_v3", vocab_size=SMALL_VOCAB)
    params = mtp_params(target, seed=5)
    params["shared_head.norm.weight"] = params["shared_head.norm.weight"] * 3
    return target, write_original(tmp_path_factory.mktemp("mtp8") / "d", target, params)


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_mtp_rows_after_a_rejection_are_distributed_as_the_target(small_mtp_target, residual,
                                                                  exact):
    """The batched MTP path at T = 1: the head's q per row, the keyed rule's residual p - q."""
    target, weights = small_mtp_target
    check_rows_after_a_rejection(target, "mtp", residual, exact, min_rewound=SAMPLES // 2,
                                 mtp_weights=str(weights))


def test_rows_with_no_left_padding_take_a_one_row_cache_s_mask(pair):
    """A batch of one (or rows of one length) needs no padding mask: its attention layers
    answer as a one-row KVCache does (none for one query, "causal" for more, a sliding
    window's array once the window is passed); rows of other lengths get the padding mask."""
    from mlx_spec.batch.kv import BatchCache, row_cache

    target = pair[0]
    cache = BatchCache(target)

    def joined(length):
        layers = row_cache(target)
        target(mx.array([list(range(1, length + 1))]), cache=layers)
        cache.join(layers)

    joined(5)
    layer = cache.attention[0]
    assert layer.make_mask(1) is None and layer.make_mask(4) == "causal"
    assert layer.make_mask(1, window_size=6) is None
    assert layer.make_mask(2, window_size=6).shape[-1] == 7  # past the window: its mask
    assert layer.make_mask(3, return_array=True).shape[-1] == 8
    joined(3)  # a shorter row: left padding
    assert cache.padding == [0, 2]
    assert all(layer.make_mask(1).shape == (2, 1, 1, 6) for layer in cache.attention)
    cache.drop([1])  # the short row alone: its padding sliced off
    assert cache.padding == [0] and cache.attention[0].make_mask(2) == "causal"


def test_an_engine_of_one_row_at_a_time_takes_the_next_when_the_first_ends(pair):
    """max_rows=1 (the server's --no-batching): room for one row, a second insert refused in
    one sentence until the first ends; max_rows below 1 refused."""
    target, draft = pair
    engine = BatchEngine(target, draft, max_rows=1)
    assert engine.room == 1
    engine.insert(RowRequest([1, 2, 3], 4, prompt_lookup=False))
    assert engine.room == 0
    with pytest.raises(ValueError, match="rows at once"):
        engine.insert(RowRequest([4, 5], 4, prompt_lookup=False))
    while engine.busy:
        engine.step()
    assert engine.room == 1
    engine.insert(RowRequest([4, 5], 4, prompt_lookup=False))
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        BatchEngine(target, draft, max_rows=0)
