"""A reused prompt cache saved and loaded with mlx-lm's own functions between turns.

After a call the caller's list holds mlx-lm's classes again (the rewindable
sliding windows a call runs on go back to `RotatingKVCache`), so
`mlx_lm.models.cache.save_prompt_cache` / `load_prompt_cache` take it, and a
turn continued from the file gives what the in-memory cache gives and what
mlx-lm's own `stream_generate` gives over the same turns. Targets: sliding
windows (gemma3_text, gpt_oss; saved after and before the window wraps, and
mlx-lm's `keep` prefix on a llama), a plain llama (KVCache), a hybrid
(qwen3_5: ArraysCache) and a 4-bit model; each with prompt lookup alone and
with a draft model (its layers after the target's in the list), k = 3.

`WindowKVCache.to_rotating` itself: the ring mlx-lm's one-token decoding
leaves for the same keys and values, before, at and after the wrap, with and
without `keep`, and the same ring after more one- and multi-token updates.
"""

import mlx.core as mx
import mlx_lm
import pytest
from families import make_family
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)

import mlx_spec
from mlx_spec.cache import WindowKVCache, cache_length
from mlx_spec.cache.rewind import make_plain, make_rewindable
from mlx_spec.session import held_tokens

TURNS = ["def f(x):\n    return x", "\ndef fibonacci(n):", "\n    if n < 2:\n"]
SINGLE_TOKEN_TURNS = ["def f(x):\n    return x", "\n", "def"]  # see the "llama-keep4" case
MAX_TOKENS = 12
K = 3


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = mlx_spec.load(str(model_dirs["target"]))
    draft_model, _ = mlx_spec.load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


def _windows(size, keep):
    return lambda model: [RotatingKVCache(max_size=size, keep=keep) for _ in model.layers]


# name -> (target, draft, cache maker (None: make_prompt_cache), turns)
def _case(name, pair):
    llama, llama_draft, tokenizer = pair
    vocab = len(tokenizer.vocab)

    def family(kind, bits=None, window=8):
        return (make_family(kind, seed=0, vocab_size=vocab, window=window, quantize_bits=bits),
                make_family(kind, seed=0, vocab_size=vocab, window=window, quantize_bits=8))
    if name == "gemma3_text":  # 8-token windows: wrapped at every save
        return (*family("gemma3_text"), None, TURNS)
    if name == "gpt_oss":
        return (*family("gpt_oss"), None, TURNS)
    if name == "gemma3_text-w32":  # 22 tokens after turn 1: saved before the wrap, wraps in turn 2
        return (*family("gemma3_text", window=32), None, TURNS)
    if name == "gemma3_text-4bit":
        return (*family("gemma3_text", bits=4), None, TURNS)
    if name == "qwen3_5":
        return (*family("qwen3_5"), None, TURNS)
    if name == "llama":
        return llama, llama_draft, None, TURNS
    if name == "llama-keep4":
        # mlx-lm's RotatingKVCache with a kept prefix (as its max_kv_size makes), wrapped in turn
        # 1. Later turns send one token: mlx-lm's own multi-token pass over a wrapped ring with
        # keep > 0 hides part of the kept prefix from its later queries, which plain (one token
        # at a time) decoding, and mlx-spec, do not.
        return llama, llama_draft, _windows(16, 4), SINGLE_TOKEN_TURNS
    raise ValueError(name)


CASES = ["gemma3_text", "gpt_oss", "gemma3_text-w32", "gemma3_text-4bit", "qwen3_5", "llama",
         "llama-keep4"]


def _new_cache(model, maker):
    return maker(model) if maker is not None else make_prompt_cache(model)


def _view(layer):
    """What a layer holds, in time order: (class name, numbers, arrays)."""
    if isinstance(layer, RotatingKVCache):
        if layer.keys is None:
            return "RotatingKVCache", (layer.offset, layer.keep, layer.max_size), []
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        return ("RotatingKVCache", (layer.offset, layer.keep, layer.max_size, keys.shape[2]),
                [keys, values])
    if isinstance(layer, KVCache):
        n = layer.offset
        return ("KVCache", (n,), [] if layer.keys is None else
                [layer.keys[..., :n, :], layer.values[..., :n, :]])
    if isinstance(layer, ArraysCache):
        return "ArraysCache", (len(layer.cache),), list(layer.cache)
    raise AssertionError(f"not one of mlx-lm's classes: {type(layer).__name__}")


def _snapshot(layers):
    views = [_view(layer) for layer in layers]
    mx.eval([arrays for _, _, arrays in views])
    return views


def _assert_same_state(got_layers, want_views, atol):
    """Each layer holds what mlx-lm's holds (verify passes round differently: atol)."""
    got_views = _snapshot(got_layers)
    assert len(got_views) == len(want_views)
    for (kind, numbers, arrays), (want_kind, want_numbers, want_arrays) in zip(got_views,
                                                                               want_views):
        assert (kind, numbers) == (want_kind, want_numbers)
        assert len(arrays) == len(want_arrays)
        for got, want in zip(arrays, want_arrays):
            assert got.shape == want.shape
            assert mx.allclose(got, want, atol=atol, rtol=atol).item()


def _fed_one_at_a_time(model, maker, tokens):
    """mlx-lm's own cache of `model` after plain one-token decoding of `tokens`."""
    cache = _new_cache(model, maker)
    for token in tokens:
        model(mx.array([[token]]), cache=cache)
    return cache


def _mlx_lm_conversation(model, tokenizer, maker, turns):
    """mlx-lm's tokens per turn, and its target cache (time-ordered view) after turn 1."""
    cache = _new_cache(model, maker)
    tokens, after_first = [], None
    for text in turns:
        tokens.append([r.token for r in mlx_lm.stream_generate(
            model, tokenizer, tokenizer.encode(text), max_tokens=MAX_TOKENS, prompt_cache=cache)])
        if after_first is None:
            after_first = _snapshot(cache)
    return tokens, after_first


def _turn(target, draft, tokenizer, text, cache):
    return [r.token for r in mlx_spec.stream_generate(
        target, tokenizer, tokenizer.encode(text), draft_model=draft, max_tokens=MAX_TOKENS,
        num_draft_tokens=K, prompt_lookup=True, prompt_cache=cache)]


def _assert_mlx_lm_classes(cache, target, draft, maker):
    want = _new_cache(target, maker) + ([] if draft is None else _new_cache(draft, maker))
    assert [type(c) for c in cache] == [type(c) for c in want]
    assert all(type(c).__module__ == "mlx_lm.models.cache" for c in cache)


def _save_and_load(cache, path):
    save_prompt_cache(str(path), cache, {"app": "chat"})
    loaded, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata == {"app": "chat"}
    return loaded


@pytest.mark.parametrize("drafting", ["lookup", "draft"])
@pytest.mark.parametrize("name", CASES)
def test_a_saved_and_loaded_cache_continues_the_conversation(pair, name, drafting, tmp_path):
    target, draft, maker, turns = _case(name, pair)
    tokenizer = pair[2]
    draft = draft if drafting == "draft" else None
    if maker is not None:  # the premise of llama-keep4: later turns are one token each
        assert all(len(tokenizer.encode(text)) == 1 for text in turns[1:])
    want, mlx_lm_after_first = _mlx_lm_conversation(target, tokenizer, maker, turns)

    cache = _new_cache(target, maker) + ([] if draft is None else _new_cache(draft, maker))
    n = len(_new_cache(target, maker))
    first = _turn(target, draft, tokenizer, turns[0], cache)
    assert first == want[0]
    _assert_mlx_lm_classes(cache, target, draft, maker)
    # The state mlx-lm itself has after the same turn (offsets, keep, max_size, the ring in
    # time order), and for the draft what mlx-lm's plain decoding of the same tokens leaves.
    atol = 1e-3 if "4bit" in name else 1e-4
    _assert_same_state(cache[:n], mlx_lm_after_first, atol)
    held = tokenizer.encode(turns[0]) + first
    if draft is not None:
        _assert_same_state(cache[n:], _snapshot(_fed_one_at_a_time(draft, maker, held)), atol)

    loaded = _save_and_load(cache, tmp_path / "turn1.safetensors")
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert cache_length(loaded[:n]) == len(held)
    from_file = [_turn(target, draft, tokenizer, turns[1], loaded)]
    loaded = _save_and_load(loaded, tmp_path / "turn2.safetensors")  # again, from the file's
    from_file.append(_turn(target, draft, tokenizer, turns[2], loaded))
    in_memory = [_turn(target, draft, tokenizer, text, cache) for text in turns[1:]]
    assert in_memory == want[1:]
    assert from_file == want[1:]
    _assert_mlx_lm_classes(loaded, target, draft, maker)
    assert cache_length(loaded[:n]) == cache_length(cache[:n])


HOWS = ["exhausted", "break-closed", "break-dropped", "raise", "not-live", "taken-over"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_after_a_call_the_list_holds_mlx_lms_classes(pair, name, how, tmp_path):
    """However the stream stops, the caller's list is mlx-lm's again, holds exactly the prompt
    and the tokens handed out (continuing from the saved file gives the logits of plain
    decoding), and still remembers those tokens for the next call's prompt lookup."""
    target, draft, _, _ = _case(name, pair)
    tokenizer = pair[2]
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    n = len(make_prompt_cache(target))
    prompt = tokenizer.encode(TURNS[0])
    stream = mlx_spec.stream_generate(target, tokenizer, prompt, draft_model=draft,
                                      max_tokens=MAX_TOKENS, num_draft_tokens=K,
                                      prompt_lookup=True, prompt_cache=cache,
                                      prompt_cache_live=how != "not-live")
    got = []
    if how in ("exhausted", "not-live"):
        got = [r.token for r in stream]
    elif how == "raise":
        with pytest.raises(Stop):
            for r in stream:
                got.append(r.token)
                if len(got) == 5:
                    raise Stop
        del stream  # (until then the generator is open: mid-stream)
    else:
        for r in stream:
            got.append(r.token)
            if len(got) == 5:
                break
        if how == "break-closed":
            stream.close()
        elif how == "break-dropped":
            del stream
        else:  # taken-over: the generator stays open; the next call settles it first
            assert any(isinstance(c, WindowKVCache) for c in cache)  # (mid-stream: may be ours)
            follow = tokenizer.encode(TURNS[1])
            got += follow + [r.token for r in mlx_spec.stream_generate(
                target, tokenizer, follow, draft_model=draft, max_tokens=4, num_draft_tokens=K,
                prompt_lookup=True, prompt_cache=cache)]
            stream.close()  # settled already, by the later call: changes nothing
    assert len(got) >= 5
    _assert_mlx_lm_classes(cache, target, draft, None)
    assert any(isinstance(c, RotatingKVCache) for c in cache[:n])
    assert any(isinstance(c, RotatingKVCache) for c in cache[n:])
    held = prompt + got
    assert held_tokens(cache, cache_length(cache[:n])) == held  # marks survive the conversion
    loaded = _save_and_load(cache, tmp_path / "cache.safetensors")
    probe = mx.array([[7, 11]])
    for model, layers in ((target, loaded[:n]), (draft, loaded[n:])):
        assert all(c.offset == len(held) for c in layers if hasattr(c, "offset"))
        plain = _fed_one_at_a_time(model, None, held)
        got_logits = model(probe, cache=layers)[0, -1]
        assert mx.allclose(got_logits, model(probe, cache=plain)[0, -1], atol=1e-4).item()


# --------------------------------------------------------------- to_rotating, on its own


def _kv(i):
    """Distinct keys and values for position i (1 batch, 2 heads, head dims 4 and 3)."""
    return mx.full((1, 2, 1, 4), float(i + 1)), mx.full((1, 2, 1, 3), -float(i + 1))


def _cat(items):
    return (mx.concatenate([k for k, _ in items], axis=2),
            mx.concatenate([v for _, v in items], axis=2))


def _window_fed(tokens, window, keep, reserve=4):
    """A WindowKVCache fed as a call feeds it: rounds of 3 kept and 2 rejected entries."""
    cache = WindowKVCache(window, keep, reserve)
    junk = 1000
    for start in range(0, len(tokens), 3):
        kept = tokens[start: start + 3]
        cache.update_and_fetch(*_cat([_kv(t) for t in kept] + [_kv(junk), _kv(junk + 1)]))
        cache.trim(2)
        junk += 2
    return cache


def _plain_fed(tokens, window, keep):
    """mlx-lm's RotatingKVCache after its own decoding: one token at a time."""
    cache = RotatingKVCache(window, keep)
    for t in tokens:
        cache.update_and_fetch(*_kv(t))
    return cache


def _assert_same_ring(got: RotatingKVCache, want: RotatingKVCache):
    assert (got.offset, got.keep, got.max_size) == (want.offset, want.keep, want.max_size)
    assert got.size() == want.size()
    assert got.is_trimmable() == want.is_trimmable()
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        a, b = got._temporal_order(a), want._temporal_order(b)
        assert a.shape == b.shape
        assert mx.array_equal(a, b).item()


def _continue(cache, start):
    """More updates as mlx-lm makes them (one token, several, one), checked after each."""
    yield cache.update_and_fetch(*_kv(start))
    yield cache.update_and_fetch(*_cat([_kv(start + 1 + i) for i in range(3)]))
    yield cache.update_and_fetch(*_kv(start + 4))


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("fed", [1, 2, 5, 7, 8, 9, 12, 30, 400])  # window 8: before, at, after
def test_to_rotating_is_the_ring_mlx_lms_decoding_leaves(keep, fed):
    window = 8
    tokens = list(range(fed))
    rotating = _window_fed(tokens, window, keep).to_rotating()
    assert type(rotating) is RotatingKVCache
    assert rotating._idx == rotating.keys.shape[2] == min(fed, window)
    plain = _plain_fed(tokens, window, keep)
    _assert_same_ring(rotating, plain)
    if fed < window:  # still trimmable, as mlx-lm's
        assert rotating.trim(1) == plain.trim(1) == 1
        _assert_same_ring(rotating, plain)
        tokens = tokens[:-1]
    for got, want in zip(_continue(rotating, len(tokens)), _continue(plain, len(tokens))):
        _assert_same_ring(rotating, plain)
        # What attention sees: the same entries (mlx-lm's one-token step returns its ring)
        assert sorted(got[0].flatten().tolist()) == sorted(want[0].flatten().tolist())
    # And back (what the next call runs on), and again: the same ring.
    _assert_same_ring(WindowKVCache.from_rotating(rotating).to_rotating(), plain)


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("then", ["one", "several"])
def test_to_rotating_after_a_rewind_to_the_edge_of_the_reserve(keep, then):
    """A rewind by the whole reserve right after a compaction leaves the entry just out of the
    window gone: its slot is the one mlx-lm overwrites or drops before any query reads it."""
    window, reserve = 8, 3
    cache = WindowKVCache(window, keep, reserve)
    t = 0
    while True:  # one-token steps until the buffer compacts
        start = cache.start
        cache.update_and_fetch(*_kv(t))
        t += 1
        if cache.start != start and cache.offset > window:
            break
    cache.trim(1 + reserve)
    tokens = list(range(t - 1 - reserve))
    assert cache.start > cache.offset - (window - keep)  # the case at hand
    rotating, plain = cache.to_rotating(), _plain_fed(tokens, window, keep)
    assert (rotating.offset, rotating._idx) == (plain.offset, window)
    if then == "one":
        got, want = rotating.update_and_fetch(*_kv(t)), plain.update_and_fetch(*_kv(t))
    else:
        new = _cat([_kv(t + i) for i in range(3)])
        got, want = rotating.update_and_fetch(*new), plain.update_and_fetch(*new)
    _assert_same_ring(rotating, plain)
    assert sorted(got[0].flatten().tolist()) == sorted(want[0].flatten().tolist())


def test_to_rotating_is_lazy(tmp_path):
    """No evaluation: the window's entries stay uncomputed, the ring is slices of them."""
    from test_cache import _pending_ops

    cache, plain = WindowKVCache(8, 2, 4), RotatingKVCache(8, 2)
    for t in range(20):
        k, v = _kv(t)
        cache.update_and_fetch(k * 1.5, v * 1.5)  # pending work behind the entries
        plain.update_and_fetch(k * 1.5, v * 1.5)
    assert _pending_ops([cache], tmp_path) > 0
    rotating = cache.to_rotating()
    assert _pending_ops([cache], tmp_path) > 0  # nothing of the window's was computed
    assert _pending_ops([rotating], tmp_path) > 0
    _assert_same_ring(rotating, plain)  # (computed now, by the comparison)


def test_a_cache_list_nesting_a_window_converts_both_ways():
    """mlx-lm's CacheList (a tuple of caches, as baichuan_m1 makes it) nests sliding windows."""
    layers = [CacheList(ArraysCache(size=2), RotatingKVCache(max_size=8)), KVCache()]
    layers[0].caches[1].update_and_fetch(*_cat([_kv(i) for i in range(12)]))
    setattr(layers[0], "_mlx_spec_tokens", [1, 2])
    make_rewindable(layers)
    assert isinstance(layers[0].caches, tuple)
    assert isinstance(layers[0].caches[1], WindowKVCache)
    assert make_plain(layers) == 1
    assert isinstance(layers[0].caches, tuple)
    assert type(layers[0].caches[1]) is RotatingKVCache
    assert layers[0].caches[1].offset == 12
    assert layers[0]._mlx_spec_tokens == [1, 2]


def test_marks_follow_a_replaced_layer():
    layers = [RotatingKVCache(max_size=8)]
    layers[0].update_and_fetch(*_kv(0))
    layers[0]._mlx_spec_tokens = [5]
    make_rewindable(layers)
    assert isinstance(layers[0], WindowKVCache) and layers[0]._mlx_spec_tokens == [5]
    make_plain(layers)
    assert type(layers[0]) is RotatingKVCache and layers[0]._mlx_spec_tokens == [5]
