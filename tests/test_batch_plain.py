"""Plain batched rounds queued back to back (batch/plain.py): the same text, one step ahead.

When no row drafts, the engine dispatches the next plain step before reading this one, as the
loop's plain_rounds does. A queued step is always read; rows that end (a stop token, their
budget) or leave (cancel) meanwhile drop their queued token, rows that arrive join after it,
and a kept cache holds exactly the row's text. Every row's text is the one it gets without
queuing: greedy, its own greedy decoding; sampled with a seed, the same tokens.
"""

import mlx.core as mx
import pytest
from families import plain_greedy, shared_family, shared_plain_greedy
from test_batch import pair, ragged_prompts, run  # noqa: F401 (a fixture)

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.sampling import SamplingConfig

TOKENS = 24


def queued_steps(engine, monkeypatch):
    """Count the steps an engine's rounds dispatched ahead (read by a later round)."""
    seen = []
    step = engine.step

    def counting():
        out = step()
        seen.append(engine._queued is not None)
        return out

    monkeypatch.setattr(engine, "step", counting)
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "lfm2", "gemma3_text", "qwen3_5-4bit"])
@pytest.mark.parametrize("rows", [1, 5])
def test_queued_plain_rows_equal_their_own_greedy_decoding(pair, family, rows,  # noqa: F811
                                                           monkeypatch):
    """num_draft_tokens=0 (plain batched decoding), a row joining and one cancelled mid-way:
    attention, Gated DeltaNet, short-convolution and sliding-window (window 8: every row runs
    past it) targets, and a 4-bit one."""
    name, _, bits = family.partition("-")
    target = pair[0] if family == "llama" else shared_family(
        name, quantize_bits=int(bits[:-3]) if bits else None)
    prompts = ragged_prompts(rows)
    engine = BatchEngine(target, None, num_draft_tokens=0)
    seen = queued_steps(engine, monkeypatch)
    late = RowRequest([7, 7, 1, 2], TOKENS, prompt_lookup=False)
    cancels = [(6, 1)] if rows > 1 else []
    got = run(engine, [RowRequest(p, TOKENS, prompt_lookup=False) for p in prompts],
              joins=[(5, late)], cancels=cancels)
    for i, prompt in enumerate(prompts + [late.prompt]):
        if not (cancels and i == 1):
            assert got[i] == shared_plain_greedy(target, prompt, TOKENS)
    if cancels:
        assert 0 < len(got[1]) < TOKENS
    assert sum(seen) > TOKENS // 2  # most rounds left a step queued


def test_a_row_that_stops_mid_block_keeps_exactly_its_text(pair, monkeypatch):  # noqa: F811
    """A stop token ends a row while its next step is queued: its kept cache holds its prompt
    and answer (the queued step fed its last token already: not fed twice), and the next
    token from it is a fresh forward's; the other rows go on."""
    target, _ = pair
    prompts = ragged_prompts(3)
    answer = shared_plain_greedy(target, prompts[0], TOKENS)
    stop = answer[TOKENS // 2]  # the first row's token halfway: it stops there (or before)
    engine = BatchEngine(target, None, num_draft_tokens=0, stop_tokens=[stop])
    seen = queued_steps(engine, monkeypatch)
    uids = [engine.insert(RowRequest(p, TOKENS, prompt_lookup=False, keep_cache=True))
            for p in prompts]
    tokens, ends = {u: [] for u in uids}, {}
    while engine.busy:
        for o in engine.step():
            tokens[o.uid] += o.tokens
            if o.finish_reason:
                ends[o.uid] = (o.finish_reason, o.cache)
    assert ends[uids[0]][0] == "stop" and tokens[uids[0]][-1] == stop
    assert any(seen)
    for uid, prompt in zip(uids, prompts):
        text = prompt + tokens[uid]
        cache = ends[uid][1]
        assert [c.offset for c in cache] == [len(text)] * len(cache)
        from_cache = target(mx.array([[3]]), cache=cache)[0, -1]
        fresh = target(mx.array([text + [3]]))[0, -1]
        assert mx.allclose(from_cache, fresh, atol=1e-4).item()


@pytest.mark.parametrize("draft", [False, True])
def test_a_seeded_sampled_row_is_the_same_queued_or_not(pair, monkeypatch, draft):  # noqa: F811
    """Seeded T = 1 rows beside a greedy one: each row's key is split once a round whether
    its plain rounds were queued or not, so the texts are the same. With a draft model, under
    the policy (rounds that draft, rounds that do not)."""
    target, draft_model = pair
    requests = [RowRequest(p, TOKENS, SamplingConfig(temp=1.0), seed=i, prompt_lookup=False)
                for i, p in enumerate(ragged_prompts(3))] + [
        RowRequest([4, 4, 2], TOKENS, prompt_lookup=False)]
    options = dict(num_draft_tokens=None if draft else 0)
    queued = run(BatchEngine(target, draft_model if draft else None, **options), requests)
    monkeypatch.setattr(BatchEngine, "_begin_block", lambda self, *args: None)  # no queue
    unqueued = run(BatchEngine(target, draft_model if draft else None, **options), requests)
    assert queued == unqueued


def test_rows_with_logits_processors_queue_and_equal_mlx_lms_own_decoding(pair,  # noqa: F811
                                                                          monkeypatch):
    """Per-row processors (a repetition penalty, a logit bias, none) in queued plain steps: each
    step's processors see the step before's token, lazily, before the host has read it; every
    row equals mlx-lm's generate_step with the same processors."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    target = pair[0]
    prompts = ragged_prompts(3)
    kinds = [dict(repetition_penalty=1.5), dict(logit_bias={5: 3.0, 7: -2.0}), {}]
    engine = BatchEngine(target, None, num_draft_tokens=0)
    seen = queued_steps(engine, monkeypatch)
    got = run(engine, [RowRequest(p, TOKENS, prompt_lookup=False,
                                  logits_processors=make_logits_processors(**kind))
                       for p, kind in zip(prompts, kinds)])
    for prompt, kind, tokens in zip(prompts, kinds, got):
        expected = [int(t) for t, _ in generate_step(
            mx.array(prompt), target, max_tokens=TOKENS,
            sampler=lambda lp: mx.argmax(lp, axis=-1),
            logits_processors=make_logits_processors(**kind))]
        assert tokens == expected
    assert sum(seen) > TOKENS // 2  # most rounds left a step queued


def schedule_of(engine, ks, block):
    """The batch policy replaced by a fixed schedule: round r drafts ks[r] (the last k after
    them), plain blocks of `block` steps (ks's plain stretches are whole blocks, so a queued
    block and `block` unqueued plain rounds are the same rounds)."""
    engine.policy.choose = lambda rows: ks[min(sum(engine.rounds.values()), len(ks) - 1)]
    engine.policy.plain_steps = lambda batch: block


@pytest.mark.parametrize("drafter", ["mtp-qwen3_5", "mtp-deepseek_v3", "dflash"])
def test_a_head_drafts_the_same_after_queued_plain_steps(drafter, tmp_path, monkeypatch):
    """An MTP head (its pairs) and a DFlash drafter (its context) read each step's hidden
    states: a queued step keeps its own (the next step's pass replaces the cache's before it is
    read). Rows that decode plainly in blocks, then draft, propose exactly what they propose
    with no queue, round after round: a greedy row the same drafts, T = 1 rows (keyed alike)
    the same drafts and the same q (a greedy draft's argmax hides a slightly wrong context; q does not).
    The greedy row ends inside a plain block, a step queued past it, and keeps its cache: a
    second turn on it (a DFlash drafter's context rides with it) drafts the same as well."""
    if drafter == "dflash":
        from dflash_tiny import make_dflash
        from tiny import make_llama

        target = make_llama(layers=4, seed=2)
        model, options = make_dflash(tmp_path / "dflash", 48, [0, 2], block_size=6, seed=5), {}
    else:
        from test_mtp import make_target, mtp_params, write_original

        target = make_target(drafter.split("-")[1])
        model = "mtp"
        options = dict(mtp_weights=str(write_original(tmp_path / "mtp", target,
                                                      mtp_params(target))))
    prompts = ragged_prompts(3)
    ks = [0] * 8 + [2] * 3 + [0] * 4 + [3]
    first = 6  # the greedy row's tokens: it ends in the second plain block

    def drafts_and_text(queue):
        engine = BatchEngine(target, model, **options)
        schedule_of(engine, ks, block=4)
        seen = queued_steps(engine, monkeypatch)
        proposed, propose, kept, step = [], engine._propose, {}, engine.step

        def spy(lengths, alone=False, width=1):
            proposals, ran = propose(lengths, alone, width)
            if any(p is not None for p in proposals):
                proposed.append([None if p is None else (p.tokens.tolist(), p.probs)
                                 for p in proposals])
            return proposals, ran

        def keeping():
            out = step()
            kept.update({o.uid: o.cache for o in out if o.cache is not None})
            return out

        engine._propose, engine.step = spy, keeping
        if not queue:
            engine._begin_block = lambda *args: None
        requests = [RowRequest(prompts[0], first, prompt_lookup=False, keep_cache=True)] + [
            RowRequest(p, TOKENS, SamplingConfig(temp=1.0), prompt_lookup=False)
            for p in prompts[1:]]
        mx.random.seed(7)  # the sampled rows' keys (unseeded: a seed would pin their k)
        text = run(engine, requests)
        second = prompts[0] + text[0] + [5, 9]  # two rows (the schedule's, not one alone's):
        uids = [engine.insert(RowRequest(second, 8, prompt_lookup=False)),  # fresh
                engine.insert(RowRequest(second, 8, prompt_lookup=False), kept[min(kept)],
                              cached=len(prompts[0]) + first)]  # on the kept cache
        turn = {uid: [] for uid in uids}
        while engine.busy:
            for o in engine.step():
                turn[o.uid] += o.tokens
        return proposed, text + [turn[uid] for uid in uids], sum(seen), second

    queued, text, steps, second = drafts_and_text(True)
    alone, text_alone, no_steps, _ = drafts_and_text(False)
    assert steps > 3 and no_steps == 0
    assert text[0] == plain_greedy(target, prompts[0], first)
    assert text[3] == text[4] == plain_greedy(target, second, 8)  # fresh, and from the cache
    assert text == text_alone
    assert len(queued) == len(alone) > 3  # the head drafted after plain blocks
    for ours, theirs in zip(queued, alone):
        for a, b in zip(ours, theirs):
            assert (a is None) == (b is None)
            if a is not None:
                assert a[0] == b[0]
                assert (a[1] is None) == (b[1] is None)
                assert a[1] is None or mx.allclose(a[1], b[1], atol=1e-5).item()
