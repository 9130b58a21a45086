"""Multi-turn reuse of a prompt cache, checked against mlx-lm itself.

The same conversation (3 turns, each sending only its new tokens) goes through
mlx-lm's `stream_generate` and through mlx-spec's, greedy: the tokens of every
turn and the cache offsets after every turn must be the same. Also when the
caller breaks out early while still holding the generator, breaks out and
drops it, or raises inside its loop; with and without a draft model, with
prompt lookup, on a hybrid (Gated DeltaNet) target and on sliding-window
targets, with the cache kept live per token and settled only at the end.
"""

import mlx.core as mx
import mlx_lm
import pytest
from families import shared_family
from tiny import once
from mlx_lm.models.cache import make_prompt_cache

from mlx_spec import load, stream_generate
from mlx_spec.cache import cache_length

TURNS = ["def f(x):\n    return x", "\ndef fibonacci(n):", "\n    if n < 2:\n"]
STOP_AFTER = 4  # responses taken before breaking out / raising
MAX_TOKENS = 12


class Stop(Exception):
    pass


def converse(generate_fn, cache, tokenizer, how, target_layers, stop_after=STOP_AFTER):
    """Run the turns; return [(tokens, target offset, every offset)] per turn."""
    held = []  # generators the caller keeps alive (never closed)
    out = []
    for turn, text in enumerate(TURNS):
        ids = tokenizer.encode(text)
        got = []
        stream = generate_fn(ids, cache)
        stop_early = how != "full" and turn == 0
        if not stop_early:
            got = [r.token for r in stream]
        elif how in ("break-held", "closed-late"):
            held.append(stream)
            for r in stream:
                got.append(r.token)
                if len(got) == stop_after:
                    break
        elif how == "break-dropped":
            for r in stream:
                got.append(r.token)
                if len(got) == stop_after:
                    break
            del stream
        elif how == "raise":
            with pytest.raises(Stop):
                for r in stream:
                    got.append(r.token)
                    if len(got) == stop_after:
                        raise Stop
            del stream
        if how == "closed-late" and turn == 1:
            held.pop().close()  # turn 0's generator, closed after a later turn used the cache
        out.append((got, cache_length(cache[:target_layers]),
                    [getattr(c, "offset", None) for c in cache]))
    return out


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


def mlx_lm_turns(model, tokenizer, how, stop_after=STOP_AFTER):
    """mlx-lm's turns, computed once per model, way of stopping and stop point (many tests
    compare against the same ones)."""
    def run(ids, cache):
        return mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=MAX_TOKENS,
                                      prompt_cache=cache)
    return once(("mlx-lm turns", how, stop_after), lambda: converse(
        run, make_prompt_cache(model), tokenizer, how, None, stop_after), holds=(model, tokenizer))


def raw_turns(target_model, draft_model, tokenizer, how, stop_after=STOP_AFTER, **kwargs):
    """mlx-spec's turns as `converse` gives them (stream_generate gets `kwargs`)."""
    cache = make_prompt_cache(target_model)
    n = len(cache)
    if draft_model is not None:
        cache += make_prompt_cache(draft_model)

    def run(ids, c):
        return stream_generate(target_model, tokenizer, ids, draft_model=draft_model,
                               max_tokens=MAX_TOKENS, prompt_cache=c, **kwargs)
    return converse(run, cache, tokenizer, how, n, stop_after)


def mlx_spec_turns(target_model, draft_model, tokenizer, how, stop_after=STOP_AFTER, **kwargs):
    turns = raw_turns(target_model, draft_model, tokenizer, how, stop_after, **kwargs)
    for _, target_offset, offsets in turns:  # the draft's layers hold what the target's hold
        assert all(o in (None, target_offset) for o in offsets)
    return [(tokens, offset) for tokens, offset, _ in turns]


HOWS = ["full", "break-held", "break-dropped", "raise", "closed-late"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("drafting", ["target-alone", "draft-k3", "draft-adaptive", "lookup"])
def test_conversation_matches_mlx_lm(pair, how, drafting):
    target_model, draft_model, tokenizer = pair
    want = [(tokens, offset) for tokens, offset, _ in mlx_lm_turns(target_model, tokenizer, how)]
    kwargs = {"draft-k3": dict(num_draft_tokens=3), "draft-adaptive": {},
              "lookup": dict(prompt_lookup=True), "target-alone": {}}[drafting]
    draft = draft_model if drafting.startswith("draft") else None
    got = mlx_spec_turns(target_model, draft, tokenizer, how, **kwargs)
    assert got == want


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("drafting", ["self-k3", "lookup"])
def test_breaking_out_anywhere_in_a_round_leaves_what_the_caller_saw(pair, drafting, stop_after):
    """The target drafting for itself accepts everything: long rounds, broken anywhere."""
    target_model, _, tokenizer = pair
    want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, "break-held", stop_after)]
    draft = target_model if drafting == "self-k3" else None
    got = mlx_spec_turns(target_model, draft, tokenizer, "break-held", stop_after,
                         num_draft_tokens=3, prompt_lookup=drafting == "lookup")
    assert got == want


@pytest.fixture(scope="module")
def hybrid_pair(pair):
    vocab = len(pair[2].vocab)
    return (shared_family("qwen3_5", vocab_size=vocab),
            shared_family("qwen3_5", seed=5, vocab_size=vocab))


@pytest.mark.parametrize("stop_after", [1, 2, 3, 5, 6, 8, 10])
@pytest.mark.parametrize("draft", ["self", "8-bit"])
def test_hybrid_broken_anywhere(pair, hybrid_pair, draft, stop_after):
    """Long rounds on a hybrid, fully accepted (the target drafts for itself) or
    partly (its 8-bit copy drafts): the recurrent state shown at each response is
    rebuilt from the recorded recurrence, lazily."""
    tokenizer = pair[2]
    target_model = hybrid_pair[0]
    draft_model = target_model if draft == "self" else shared_family(
        "qwen3_5", vocab_size=len(tokenizer.vocab), quantize_bits=8)
    want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, "break-held", stop_after)]
    got = mlx_spec_turns(target_model, draft_model, tokenizer, "break-held", stop_after,
                         num_draft_tokens=4, prompt_lookup=False)
    assert got == want


@pytest.mark.parametrize("how,stop_after", [(how, STOP_AFTER) for how in HOWS]
                         + [("break-held", n) for n in (1, 2, 3, 5, 7)])
@pytest.mark.parametrize("drafting", ["draft-k3", "target-alone", "draft-adaptive"])
def test_hybrid_conversation_matches_mlx_lm(pair, hybrid_pair, how, stop_after, drafting):
    tokenizer = pair[2]
    target_model, draft_model = hybrid_pair
    want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, how, stop_after)]
    kwargs = {"draft-k3": dict(num_draft_tokens=3), "target-alone": {},
              "draft-adaptive": dict(adaptive=True)}[drafting]
    got = mlx_spec_turns(target_model, None if drafting == "target-alone" else draft_model,
                         tokenizer, how, stop_after, prompt_lookup=False, **kwargs)
    assert got == want


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("drafting", ["target-alone", "draft-k3"])
def test_sliding_window_conversation_matches_mlx_lm(pair, name, how, drafting):
    tokenizer = pair[2]
    vocab = len(tokenizer.vocab)
    target_model = shared_family(name, vocab_size=vocab)
    draft_model = shared_family(name, vocab_size=vocab, quantize_bits=8)
    want = [(t, o) for t, o, _ in mlx_lm_turns(target_model, tokenizer, how)]
    got = mlx_spec_turns(target_model, None if drafting == "target-alone" else draft_model,
                         tokenizer, how, num_draft_tokens=3, prompt_lookup=False)
    assert got == want


@pytest.mark.parametrize("live", [True, False])
def test_a_stale_generator_cannot_continue(pair, live):
    target_model, draft_model, tokenizer = pair
    cache = make_prompt_cache(target_model) + make_prompt_cache(draft_model)
    old = stream_generate(target_model, tokenizer, "def f(x):", draft_model=draft_model,
                          prompt_cache=cache, max_tokens=10, prompt_cache_live=live)
    next(old)
    list(stream_generate(target_model, tokenizer, "\nx = 1", draft_model=draft_model,
                         prompt_cache=cache, max_tokens=5, prompt_cache_live=live))
    with pytest.raises(ValueError, match="used by a later call"):
        next(old)


def _assert_same_conversation(got, want, how):
    """The same tokens every turn; the same cache after every turn the caller finished or
    closed. A generator left open (turn 0 of break-held, closed-late) is settled by the
    next call that takes the cache over, so its cache is checked after the next turn."""
    assert [tokens for tokens, _, _ in got] == [tokens for tokens, _, _ in want]
    left_open = {0} if how in ("break-held", "closed-late") else set()
    for turn, ((_, offset, offsets), (_, want_offset, _)) in enumerate(zip(got, want)):
        if turn not in left_open:
            assert offset == want_offset
            assert all(o in (None, offset) for o in offsets)  # the draft's layers too


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("drafting", ["draft-k3", "draft-adaptive", "lookup"])
def test_a_cache_settled_only_at_the_end_gives_the_same_conversation(pair, how, drafting):
    """prompt_cache_live=False (what the server uses): no per-token upkeep, the same turns."""
    target_model, draft_model, tokenizer = pair
    want = mlx_lm_turns(target_model, tokenizer, how)
    kwargs = {"draft-k3": dict(num_draft_tokens=3), "draft-adaptive": {},
              "lookup": dict(prompt_lookup=True)}[drafting]
    draft = draft_model if drafting.startswith("draft") else None
    got = raw_turns(target_model, draft, tokenizer, how, prompt_cache_live=False, **kwargs)
    _assert_same_conversation(got, want, how)


@pytest.mark.parametrize("how,stop_after", [(how, STOP_AFTER) for how in HOWS]
                         + [("break-held", n) for n in (1, 3, 5)])
def test_a_hybrid_cache_settled_only_at_the_end(pair, hybrid_pair, how, stop_after):
    tokenizer = pair[2]
    target_model, draft_model = hybrid_pair
    want = mlx_lm_turns(target_model, tokenizer, how, stop_after)
    got = raw_turns(target_model, draft_model, tokenizer, how, stop_after,
                    prompt_cache_live=False, num_draft_tokens=3, prompt_lookup=False)
    _assert_same_conversation(got, want, how)


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("how", HOWS)
def test_a_sliding_window_cache_settled_only_at_the_end(pair, name, how):
    tokenizer = pair[2]
    vocab = len(tokenizer.vocab)
    target_model = shared_family(name, vocab_size=vocab)
    draft_model = shared_family(name, vocab_size=vocab, quantize_bits=8)
    want = mlx_lm_turns(target_model, tokenizer, how)
    got = raw_turns(target_model, draft_model, tokenizer, how, prompt_cache_live=False,
                    num_draft_tokens=3, prompt_lookup=False)
    _assert_same_conversation(got, want, how)


def test_prompt_cache_live_must_be_a_flag(pair):
    target_model, _, tokenizer = pair
    with pytest.raises(ValueError, match="prompt_cache_live must be True or False"):
        next(stream_generate(target_model, tokenizer, "x", prompt_cache_live="no"))


def test_the_conversation_example_runs():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "conversation.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    turns = [line for line in out.stdout.splitlines() if "new prompt tokens prefilled" in line]
    assert len(turns) == 3


def _same_as_fed(layers, model, tokens):
    """The layers hold exactly `tokens`: offsets, and what the next token's logits come out as."""
    fed = make_prompt_cache(model)
    model(mx.array([tokens]), cache=fed)
    assert all(c.offset == len(tokens) for c in layers)
    probe = mx.array([[7, 11]])
    got, want = model(probe, cache=layers)[0, -1], model(probe, cache=fed)[0, -1]
    return mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("held", [True, False])
@pytest.mark.parametrize("drafting", ["draft-k3", "lookup-and-draft", "self-k3"])
@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])
def test_a_cache_read_right_after_a_break_holds_the_yielded_tokens(pair, held, drafting, stop_after):
    """Read (offsets and contents, target and draft) right after `break`, the generator still
    held or dropped: the prompt and exactly the yielded tokens, whatever the caches computed."""
    target_model, draft_model, tokenizer = pair
    draft = target_model if drafting == "self-k3" else draft_model
    cache = make_prompt_cache(target_model) + make_prompt_cache(draft)
    n = len(target_model.layers)
    prompt = tokenizer.encode(TURNS[0] + TURNS[0])  # a repeat: lookup has something to find
    got = []
    stream = stream_generate(target_model, tokenizer, prompt, draft_model=draft, max_tokens=20,
                             prompt_cache=cache, num_draft_tokens=3,
                             prompt_lookup=drafting == "lookup-and-draft")
    for response in stream:
        got.append(response.token)
        if len(got) == stop_after:
            break
    if not held:
        del stream
    assert _same_as_fed(cache[:n], target_model, prompt + got)
    assert _same_as_fed(cache[n:], draft, prompt + got)


def test_the_next_turn_looks_up_the_earlier_turns(pair):
    """A reused cache remembers the tokens it holds, so prompt lookup in the next turn searches
    the earlier turns too (a proposal source only: the tokens are the target's either way)."""
    from mlx_spec.drafters import PromptLookupDrafter
    from mlx_spec.session import held_tokens
    target_model, draft_model, tokenizer = pair
    cache = make_prompt_cache(target_model)
    first = tokenizer.encode(TURNS[0])
    out = [r.token for r in stream_generate(target_model, tokenizer, first, max_tokens=6,
                                            prompt_cache=cache)]
    assert held_tokens(cache, cache_length(cache)) == first + out
    assert held_tokens(cache, 3) == first[:3]  # a trimmed cache holds a prefix
    ids = tokenizer.encode(TURNS[1])
    list(stream_generate(target_model, tokenizer, ids, max_tokens=4, prompt_cache=cache))
    assert held_tokens(cache, cache_length(cache))[:len(first + out) + len(ids)] == first + out + ids
    other = make_prompt_cache(target_model)  # fed by something else: nothing claimed
    target_model(mx.array([first]), cache=other)
    assert held_tokens(other, cache_length(other)) == []
    earlier = PromptLookupDrafter(300, greedy=True, context=[5, 6, 7, 8, 9])
    assert earlier.lookup([1, 6, 7], 3) == [8, 9, 1]  # (6, 7) occurred in the earlier turns
    assert PromptLookupDrafter(300, greedy=True).lookup([1, 6, 7], 3) == []
