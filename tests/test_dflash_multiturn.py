"""A DFlash drafter across the turns of a reused prompt cache.

The conversation goes through `stream_generate(..., prompt_cache=cache)` with a
tiny drafter in the published layout: every turn's tokens and the cache's length
equal mlx-lm's own greedy conversation (also when the caller breaks out or raises,
and on hybrid and sliding-window targets), and from turn 2 on the drafter reads
the earlier turns: its context covers every token the cache holds, and it drafts
exactly what a fresh call on the whole conversation's text drafts (a blind drafter,
the control, drafts otherwise).
"""

import mlx.core as mx
import pytest
from families import make_family
from mlx_lm.models.cache import make_prompt_cache

from dflash_tiny import dflash_config, write_dflash_dir
from test_multiturn import HOWS, MAX_TOKENS, TURNS, converse, mlx_lm_turns

from mlx_spec import assemble, load, stream_generate
from mlx_spec.cache import cache_length
from mlx_spec.dflash import load_dflash
from mlx_spec.drafters import DFlashDrafter
from mlx_spec.session import CONTEXT

K = 3


class Recording(DFlashDrafter):
    """The drafter, noting every instance and each proposal's drafts by the position of the
    token it follows (the tokens the cache held before the call + the call's history)."""

    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.proposals = {}
        Recording.made.append(self)

    def propose(self, history, k):
        proposal = super().propose(history, k)
        if proposal is not None:
            self.proposals[self.call_start + len(history)] = proposal.tokens
        return proposal


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(assemble, "DFlashDrafter", Recording)
    Recording.made = []
    return Recording


@pytest.fixture(scope="module")
def llama(model_dirs):
    return load(str(model_dirs["target"]))


def drafter_for(path, hidden, vocab, taps=(0, 1), **kwargs):
    return load_dflash(write_dflash_dir(path, dflash_config(hidden, list(taps), block_size=6,
                                                            mask_token_id=vocab - 1, **kwargs)))


def spec_turns(target_model, drafter, tokenizer, how, **kwargs):
    cache = make_prompt_cache(target_model)

    def run(ids, c):
        return stream_generate(target_model, tokenizer, ids, draft_model=drafter,
                               max_tokens=MAX_TOKENS, prompt_cache=c, num_draft_tokens=K,
                               prompt_lookup=False, **kwargs)
    return [(t, o) for t, o, _ in converse(run, cache, tokenizer, how, None)], cache


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("live", [True, False])
def test_a_conversation_equals_mlx_lms_greedy_one(llama, tmp_path, recording, how, live):
    target_model, tokenizer = llama
    drafter = drafter_for(tmp_path / "d", 48, target_model.args.vocab_size)
    want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, how)]
    got, cache = spec_turns(target_model, drafter, tokenizer, how, prompt_cache_live=live)
    assert [t for t, _ in got] == [t for t, _ in want]
    # (not live: a generator left open, turn 0 of break-held and closed-late, is settled by
    # the next call, so its cache is not checked in between)
    left_open = not live and how in ("break-held", "closed-late")
    assert [o for _, o in got[left_open:]] == [o for _, o in want[left_open:]]
    assert [d.call_start for d in recording.made[1:]] == [o for _, o in want[:-1]]
    for d in recording.made[1:]:  # every later turn carries on from the earlier turns' taps
        assert d.context.start == 0
    assert getattr(cache[0], CONTEXT).end == cache_length(cache)  # ... and so would the next


@pytest.mark.parametrize("name, taps", [("qwen3_5", (0, 2)), ("gemma3_text", (0, 1))])
def test_hybrid_and_sliding_window_targets(llama, recording, tmp_path, name, taps):
    tokenizer = llama[1]
    target_model = make_family(name, seed=0, vocab_size=len(tokenizer.vocab))
    drafter = drafter_for(tmp_path / "d", 32, len(tokenizer.vocab), taps=taps,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    for how in ("full", "break-held"):
        want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, how)]
        got, cache = spec_turns(target_model, drafter, tokenizer, how)
        assert got == want
        assert getattr(cache[0], CONTEXT).end == cache_length(cache)


def conversation(target_model, tokenizer, drafter, turns=2, forget=False):
    """The turns on one reused cache; returns (the last turn's drafter, every token it held
    before the last turn's prompt, the last turn's prompt, its responses). `forget`: the cache
    loses the drafter's context before the last turn (a blind drafter, the control)."""
    cache = make_prompt_cache(target_model)
    text = []
    for i, turn in enumerate(TURNS[:turns]):
        ids = tokenizer.encode(turn)
        if forget and i == turns - 1:
            setattr(cache[0], CONTEXT, None)
        before = list(text)
        responses = list(stream_generate(
            target_model, tokenizer, ids, draft_model=drafter, prompt_cache=cache,
            max_tokens=MAX_TOKENS, num_draft_tokens=K, prompt_lookup=False))
        text += ids + [r.token for r in responses]
    return Recording.made[-1], before, ids, responses


def drafts(drafter):
    return {n: tokens.tolist() for n, tokens in drafter.proposals.items()}


@pytest.mark.parametrize("turns", [2, 3])
def test_a_later_turn_drafts_what_a_fresh_call_on_the_whole_text_drafts(llama, recording,
                                                                        tmp_path, turns):
    """Same context, same drafts, so the same accepted count at a fixed k; without the kept
    context (blind from the cache's length, as before) the drafts differ."""
    target_model, tokenizer = llama
    drafter = drafter_for(tmp_path / "d", 48, target_model.args.vocab_size)
    reused, before, ids, responses = conversation(target_model, tokenizer, drafter, turns)
    out = [r.token for r in responses]
    fresh_responses = list(stream_generate(
        target_model, tokenizer, before + ids, draft_model=drafter, max_tokens=MAX_TOKENS,
        num_draft_tokens=K, prompt_lookup=False))
    fresh = Recording.made[-1]
    assert [r.token for r in fresh_responses] == out
    assert reused.context.start == 0 and reused.context.end == len(before) + len(ids) + len(out)
    assert drafts(reused) == drafts(fresh) and len(drafts(fresh)) >= 3
    assert responses[-1].stats.accepted == fresh_responses[-1].stats.accepted
    for a, b in zip(reused.context.cache, fresh.context.cache):  # the same taps, position by position
        n = min(a.offset, b.offset)
        assert n >= len(before) + len(ids)
        assert mx.allclose(a.keys[..., :n, :], b.keys[..., :n, :], atol=1e-4)
        assert mx.allclose(a.values[..., :n, :], b.values[..., :n, :], atol=1e-4)
    blind, *_ = conversation(target_model, tokenizer, drafter, turns, forget=True)
    assert blind.context.start == len(before)
    assert drafts(blind) != drafts(fresh)  # the control: context matters here


def test_a_turn_without_the_drafter_leaves_the_next_one_blind_and_exact(llama, recording,
                                                                        tmp_path):
    """The cache was fed without taps (a target-alone turn): the context no longer covers it,
    so the next drafter starts from the cache's length; the tokens are the target's."""
    target_model, tokenizer = llama
    drafter = drafter_for(tmp_path / "d", 48, target_model.args.vocab_size)
    cache = make_prompt_cache(target_model)
    got = []
    for turn, draft in zip(TURNS, [drafter, None, drafter]):
        got.append([r.token for r in stream_generate(
            target_model, tokenizer, tokenizer.encode(turn), draft_model=draft,
            prompt_cache=cache, max_tokens=MAX_TOKENS, num_draft_tokens=K)])
    want = [t for t, _, _ in mlx_lm_turns(target_model, tokenizer, "full")]
    assert got == want
    first, last = recording.made
    assert last.context.start == last.call_start > first.context.end


def test_another_drafter_does_not_read_the_context(llama, recording, tmp_path):
    target_model, tokenizer = llama
    vocab = target_model.args.vocab_size
    one, other = (drafter_for(tmp_path / name, 48, vocab) for name in ("a", "b"))
    cache = make_prompt_cache(target_model)
    for draft in (one, other):
        list(stream_generate(target_model, tokenizer, tokenizer.encode(TURNS[0]),
                             draft_model=draft, prompt_cache=cache, max_tokens=6))
    assert recording.made[1].context.start == recording.made[1].call_start > 0
