"""The speculation options a call takes, in the batch: `draft_confidence` and `auto_off`.

- A confidence stop: one row drafts, round for round, as many drafts as the call's
  one-row draft model with the same stop (and the same tokens: greedy parity); ragged rows
  beside each other each stop on their own and still decode their own greedy text; a seeded
  row's text does not depend on a neighbour that drafts on after it stopped; at T = 1
  the rows' tokens 3 and 4 after rejections are the target's distribution (the broken rule,
  resampling from p, must fail the same test).
- `auto_off=False`: the batch policy never chooses plain decoding, where with it on plain
  decoding is what it settles on; the server's batched worker hands both options over.
"""

import mlx.core as mx
import pytest

from batch_exactness import SAMPLES, check_rows_after_a_rejection
from families import shared_plain_greedy
from test_batch import FakeRow, drive, ragged_prompts, run, small_pair  # noqa: F401 (a fixture)
from tiny import make_llama, perturbed

from mlx_spec import speculative_generate_step
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.batch.policy import BatchPolicy

CONFIDENCE = 0.2


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0)
    return target, perturbed(target, 0.05, 1)


def test_one_row_stops_drafting_where_a_call_does(pair):
    target, draft = pair
    prompt = [2, 7, 1, 8]
    call = [(r.tokens, r.num_drafted) for r in speculative_generate_step(
        prompt, target, draft_model=draft, num_draft_tokens=6, draft_confidence=CONFIDENCE,
        prompt_lookup=False, max_tokens=40)]
    engine = BatchEngine(target, draft, num_draft_tokens=6, draft_confidence=CONFIDENCE)
    uid = engine.insert(RowRequest(prompt, 40, prompt_lookup=False))
    rows = []
    while engine.busy:
        rows += [(o.tokens, o.num_drafted) for o in engine.step() if o.uid == uid]
    assert rows == call
    assert [t for tokens, _ in rows for t in tokens] == shared_plain_greedy(target, prompt, 40)
    drafted = [n for _, n in rows]
    assert min(drafted) < 6 and max(drafted) > 1, drafted  # chains of every length: it cut


def test_ragged_rows_stop_on_their_own_and_keep_their_text(pair):
    target, draft = pair
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, draft, num_draft_tokens=5, draft_confidence=CONFIDENCE)
    without = BatchEngine(target, draft, num_draft_tokens=5)
    requests = [RowRequest(p, 30, prompt_lookup=False) for p in prompts]
    got = run(engine, requests)
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, 30)
    assert run(without, requests) == got
    assert sum(engine.rounds.values()) > sum(without.rounds.values())  # shorter chains


def test_a_seeded_row_s_text_does_not_depend_on_a_neighbour_s_stop(pair):
    """A row that stopped drafting draws nothing more with its key while a neighbour's chain
    runs on: its sampled text is the same alone and beside a row that stops elsewhere."""
    from mlx_spec.sampling import SamplingConfig

    target, draft = pair
    sampling = SamplingConfig(temp=1.0)
    texts = []
    for neighbour in (None, [5, 9, 2, 6, 5, 3, 5]):
        engine = BatchEngine(target, draft, draft_confidence=CONFIDENCE)
        uid = engine.insert(RowRequest([2, 7, 1, 8], 30, sampling, seed=3, prompt_lookup=False))
        if neighbour is not None:
            engine.insert(RowRequest(neighbour, 30, sampling, seed=4, prompt_lookup=False))
        text = []
        while engine.busy:
            text += [t for o in engine.step() if o.uid == uid for t in o.tokens]
        texts.append(text)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_rows_with_a_confidence_stop_are_distributed_as_the_target(small_pair, residual, exact):
    """Drafts of a vocabulary of 8 are often drawn with a top probability below 0.4: chains
    of 1 and 2 drafts side by side; most rows still rewound a rejected draft before token 3."""
    check_rows_after_a_rejection(*small_pair, residual, exact, min_rewound=SAMPLES // 3,
                                 draft_confidence=0.4)


def test_without_auto_off_the_batch_never_goes_plain():
    """The compute-bound batch that settles on plain decoding with the switch on (test_batch)
    drafts at least one token every round without it."""
    def seconds(k):
        return 0.004 * 8 * (k + 1) + 0.002 * k

    on, off = BatchPolicy(max_k=8), BatchPolicy(max_k=8, auto_off=False)
    assert drive(on, [FakeRow(on, 0.6) for _ in range(8)], seconds, 60)[-1] == 0
    ks = drive(off, [FakeRow(off, 0.6) for _ in range(8)], seconds, 60)
    assert min(ks) == 1 and ks[-1] == 1, ks
    assert off.describe()["auto_off"] is False


def test_without_auto_off_a_row_alone_keeps_its_draft(pair):
    """A draft that agrees with the target nowhere: a row alone under the call's policy
    switches it off with the switch on, and drafts every round without it."""
    target = pair[0]
    weak = make_llama(seed=5)
    for auto_off in (True, False):
        engine = BatchEngine(target, weak, auto_off=auto_off, calibration=None)
        engine.insert(RowRequest([2, 7, 1, 8], 60, prompt_lookup=False))
        drafted = []
        while engine.busy:
            drafted += [o.num_drafted for o in engine.step()]
        assert (0 in drafted[-10:]) == auto_off, (auto_off, drafted)


def test_the_batched_server_hands_both_options_over():
    from mlx_spec import load_default_pair
    from mlx_spec.server.worker import GenerationWorker, SpeculationOptions

    target, draft, tokenizer = load_default_pair()
    options = SpeculationOptions(auto_off=False, draft_confidence=0.3)
    worker = GenerationWorker(target, tokenizer, draft, options, batching=True)  # not started
    assert worker.engine.draft.confidence == 0.3
    assert worker.engine.policy.min_k == 1 and not worker.engine.single.auto_off


@pytest.mark.parametrize("seconds,drafts", [(1.0, False), (1e-6, True)],
                         ids=["costly-draft", "free-draft"])
def test_a_row_alone_times_a_draft_step_before_its_first_round(pair, monkeypatch, seconds,
                                                                drafts):
    """As a call's policy, a row alone's knows what a draft step costs before it drafts (one
    timed step, handed on to the next request): a step said to cost a second is never tried,
    one said to cost nothing is; no calibration, as a call times it only then."""
    from mlx_spec.batch.drafts import BatchDraft

    from mlx_spec.policy import AdaptivePolicy

    timed = []
    monkeypatch.setattr(BatchDraft, "step_seconds", lambda self, row: timed.append(row.history[-1])
                        or seconds)
    # no prefill time for v's prior: on a loaded CPU the tiny target's prefill can read a
    # verified token as dear as a plain step, and then even a free draft never pays
    monkeypatch.setattr(AdaptivePolicy, "observe_prefill", lambda self, tokens, seconds: None)
    target, draft = pair
    engine = BatchEngine(target, draft, calibration=None)
    for prompt in ([2, 7, 1, 8], [3, 1, 4]):  # two requests, one after the other
        engine.insert(RowRequest(prompt, 40, prompt_lookup=False))
        drafted = []
        while engine.busy:
            drafted += [o.num_drafted for o in engine.step()]
        assert (max(drafted) > 0) == drafts, drafted
    assert timed == [8]  # once, on the first request's last prompt token


def test_a_sampled_row_alone_reports_each_draft_s_chance_to_its_policy(pair, monkeypatch):
    """As a call's rounds at T > 0, a row alone's sampled chains carry each draft's chance of
    being kept (sum_x min(p, q)), which its policy counts: about 1 for a draft that is the
    target itself, less for a perturbed one; rows beside others carry none."""
    from mlx_spec.policy import AdaptivePolicy, SourceEstimate
    from mlx_spec.sampling import SamplingConfig

    monkeypatch.setattr(AdaptivePolicy, "proposal_length",
                        lambda self, source: 3 if source == "draft" else 0)
    counted = []
    count_chain = SourceEstimate.count_chain
    monkeypatch.setattr(SourceEstimate, "count_chain", lambda self, drafted, accepted,
                        chances=None: counted.append(chances) or count_chain(
                            self, drafted, accepted, chances))
    target, draft = pair
    sampling = SamplingConfig(temp=1.0)
    for model, low in ((target, 0.99), (draft, 0.0)):
        engine = BatchEngine(target, model, calibration=None, tree=False)
        engine.insert(RowRequest([2, 7, 1, 8], 20, sampling, prompt_lookup=False))
        chained = []
        while engine.busy:
            chained += [o for o in engine.step() if o.num_drafted]
        assert chained and all(len(o.chances) == o.num_drafted for o in chained)
        chances = [c for o in chained for c in o.chances]
        assert low <= min(chances) and max(chances) <= 1.0 + 1e-6, chances
    assert min(c for o in chained for c in o.chances) < 0.9  # the perturbed draft's
    assert counted and all(c is not None for c in counted)
    beside = BatchEngine(target, draft, calibration=None, tree=False)
    for _ in range(2):
        beside.insert(RowRequest([2, 7, 1, 8], 8, sampling, prompt_lookup=False))
    together = []
    while beside.busy:
        two = len(beside.rows) == 2
        together += [o for o in beside.step() if two]
    assert together and all(o.chances is None for o in together)


PROMPT_40 = [(7 * i + 3) % 64 for i in range(40)]


def _costly_or_free(monkeypatch, seconds):
    from mlx_spec.batch.drafts import BatchDraft

    monkeypatch.setattr(BatchDraft, "step_seconds", lambda self, row: seconds)


@pytest.mark.parametrize("seconds,asked", [(1.0, False), (1e-6, True)],
                         ids=["never-asked", "asked"])
def test_a_row_alone_s_draft_reads_its_prompt_only_when_asked(pair, monkeypatch, seconds,
                                                               asked):
    """As a call's lazily prefilled draft: a greedy row decoding alone keeps its draft unread
    until its policy first asks it for drafts (never, for a draft timed as costly); then one
    catch-up, timed apart, that its policy learns the per-token cost of. The text is the
    target's either way, and the kept cache's draft layers hold the whole text."""
    _costly_or_free(monkeypatch, seconds)
    target, draft = pair
    engine = BatchEngine(target, draft, calibration=None)
    uid = engine.insert(RowRequest(PROMPT_40, 24, prompt_lookup=False, keep_cache=True))
    tokens, drafted, unread = [], 0, []
    while engine.busy:
        for o in engine.step():
            tokens += o.tokens
            drafted += o.num_drafted
            cache = o.cache
        if engine.rows:
            unread.append(engine.draft.cache.attention[0].keys is None)
    assert tokens == shared_plain_greedy(target, PROMPT_40, 24)
    assert (drafted > 0) == asked and unread[0] and all(unread) != asked
    assert ("draft" in engine.single.catch_up_seconds) == asked
    assert engine.single.prompt_tokens == len(PROMPT_40) - 1  # its prefill, the target's alone
    half = len(cache) // 2
    mx.eval([layer.keys for layer in cache])
    assert {layer.offset for layer in cache[half:]} == {cache[0].offset} == {40 + 24}
    assert uid == 0


def test_a_row_whose_draft_waited_catches_up_beside_a_newcomer(pair, monkeypatch):
    """A second request joins while the first's draft has not read its prompt: the batch's
    first draft pass feeds it the whole backlog, and both texts are the target's."""
    _costly_or_free(monkeypatch, 1.0)
    target, draft = pair
    engine = BatchEngine(target, draft, calibration=None)
    engine.insert(RowRequest(PROMPT_40, 30, prompt_lookup=False))
    got = {0: [], 1: []}
    for o in engine.step():
        got[o.uid] += o.tokens
    assert engine.rows[0].draft_waits
    engine.insert(RowRequest([3, 1, 4, 1, 5], 30, prompt_lookup=False))
    drafted = 0
    while engine.busy:
        for o in engine.step():
            got[o.uid] += o.tokens
            drafted += o.num_drafted
    assert drafted > 0
    assert got[0] == shared_plain_greedy(target, PROMPT_40, 30)
    assert got[1] == shared_plain_greedy(target, [3, 1, 4, 1, 5], 30)


@pytest.mark.parametrize("temp", [0.0, 0.7])
def test_a_row_alone_s_policy_takes_its_target_s_prefill_time_as_a_call_s(pair, monkeypatch,
                                                                           temp):
    """A call's policy is told the target's prefill time (`observe_prefill`: the prior of v,
    what one more verified token costs), the draft model's prefill not in it; so is a row
    alone's, whether its draft waits (greedy) or reads the prompt beside the target (sampled:
    chunks of 8, the last kept for the prompt look). The draft is made slow (0.3 s a forward):
    its prefill would show in the time."""
    import time

    from mlx_spec.policy import AdaptivePolicy
    from mlx_spec.sampling import SamplingConfig

    target, draft = pair
    told, observe = [], AdaptivePolicy.observe_prefill
    monkeypatch.setattr(AdaptivePolicy, "observe_prefill", lambda self, tokens, seconds:
                        told.append((tokens, seconds)) or observe(self, tokens, seconds))
    model_call = type(draft).__call__

    def slow(self, *args, **kwargs):
        if self is draft:
            time.sleep(0.3)
        return model_call(self, *args, **kwargs)

    monkeypatch.setattr(type(draft), "__call__", slow)
    engine = BatchEngine(target, draft, calibration=None, prefill_step_size=8)
    engine.insert(RowRequest(PROMPT_40, 4, SamplingConfig(temp=temp), prompt_lookup=False))
    while engine.busy:
        engine.step()
    assert len(told) == 1 and told[0][0] == len(PROMPT_40) - 1
    assert 0 < told[0][1] < 0.3, told
