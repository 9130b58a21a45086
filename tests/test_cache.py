"""Rewinding caches: attention trims, sliding windows after they wrap, recurrent state."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache

from mlx_spec.cache import ModelCache, WindowKVCache, make_cache, rewind
from mlx_spec.generate import speculative_generate_step


def last_logits(model, cache, tokens):
    return model(mx.array([tokens]), cache=cache)[0, -1]


@pytest.mark.parametrize("rejected", [1, 3, 6])
def test_continuing_after_rewind_matches_a_clean_cache(target_model, rejected):
    prompt, drafts, follow = [4, 8, 15, 16], [23, 42, 7, 9, 11, 13][:rejected], [30, 31]
    rewound = make_cache(target_model)
    last_logits(target_model, rewound, prompt + drafts)
    rewind(rewound, rejected)
    clean = make_cache(target_model)
    last_logits(target_model, clean, prompt)
    got = last_logits(target_model, rewound, follow)
    want = last_logits(target_model, clean, follow)
    assert rewound[0].offset == clean[0].offset
    assert mx.allclose(got, want, atol=1e-4).item()


def _window_model_cache(model, window, keep=0):
    layers = [RotatingKVCache(max_size=window, keep=keep) for _ in model.layers]
    return ModelCache(model, layers, reserve=8)


def _plain_window_logits(model, tokens, window, keep=0):
    """Reference: mlx-lm's own rotating cache fed one token at a time (plain decoding)."""
    cache = [RotatingKVCache(max_size=window, keep=keep) for _ in model.layers]
    out = None
    for t in tokens:
        out = model(mx.array([[t]]), cache=cache)[0, -1]
    return out


@pytest.mark.parametrize("keep", [0, 2])
def test_window_cache_rewinds_after_it_wraps(target_model, keep):
    """Rounds of 5 fed tokens of which 2 are kept, far past an 8-token window: the
    next logits equal plain one-token decoding through mlx-lm's RotatingKVCache."""
    window = 8
    cache = _window_model_cache(target_model, window, keep)
    history = [3, 1, 4]
    cache.forward(mx.array(history, mx.uint32))
    for step in range(12):
        fed = [(7 * step + i) % 60 + 1 for i in range(5)]
        cache.anchor()
        cache.forward(mx.array(fed, mx.uint32))
        cache.fed(fed)
        cache.keep(2)
        history += fed[:2]
        assert cache.length == len(history)
    got = cache.forward(mx.array([9], mx.uint32))[-1]
    want = _plain_window_logits(target_model, history + [9], window, keep)
    assert mx.allclose(got, want, atol=1e-4).item()
    assert all(isinstance(c, WindowKVCache) for c in cache.layers)


def test_window_mask_for_a_multi_token_pass_matches_plain_decoding(target_model):
    """Each row of a verify pass over a wrapped window equals the plain one-token logits."""
    window = 6
    cache = _window_model_cache(target_model, window)
    history = list(range(1, 20))
    cache.forward(mx.array(history, mx.uint32))
    block = [21, 22, 23, 24]
    got = cache.forward(mx.array(block, mx.uint32))
    for i in range(len(block)):
        want = _plain_window_logits(target_model, history + block[:i + 1], window)
        assert mx.allclose(got[i], want, atol=1e-4).item()


def test_a_one_token_step_over_a_wrapped_window_sees_only_the_window(target_model):
    """After the window wraps, a one-token step (plain decoding, a draft step) is shown the
    last max_size entries, as from mlx-lm's ring, with no mask: attending over the reserve
    behind the window made a plain step over a window of 16 ~5% slower. Its logits stay
    plain decoding's, also right after a rewind into the reserve."""
    window = 6
    cache = _window_model_cache(target_model, window)
    history = list(range(1, 20))
    cache.forward(mx.array(history + [30, 31, 32], mx.uint32))
    cache.restore_length(len(history))  # three rejected drafts
    for t in [21, 22, 23]:
        assert cache.layers[0].make_mask(1) is None
        got = cache.forward(mx.array([t], mx.uint32))[-1]
        history.append(t)
        assert mx.allclose(got, _plain_window_logits(target_model, history, window),
                           atol=1e-4).item()
    layer = WindowKVCache(max_size=window, reserve=8)
    layer.update_and_fetch(mx.zeros((1, 1, 20, 4)), mx.zeros((1, 1, 20, 4)))
    keys, _ = layer.update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    assert keys.shape[2] == window
    keys, _ = layer.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    assert keys.shape[2] > window  # a verify pass also sees the reserve, through its mask


def test_window_cache_refuses_a_rewind_beyond_its_reserve(target_model):
    cache = _window_model_cache(target_model, window=4)
    for start in range(0, 400, 4):  # compacts whenever the buffer fills
        cache.forward(mx.array([(start + i) % 60 + 1 for i in range(4)], mx.uint32))
    cache.restore_length(cache.length - 8)  # within the reserve
    with pytest.raises(ValueError, match="reserve"):
        cache.restore_length(cache.length - 200)


def test_a_prompt_cache_of_the_wrong_size_gets_a_sentence(target_model, drafts):
    short = make_cache(target_model)[:1]
    with pytest.raises(ValueError, match="holds 1 layers for the target model, which makes 2"):
        list(speculative_generate_step([1, 2, 3], target_model, max_tokens=3, prompt_cache=short))
    with pytest.raises(ValueError, match="for the draft model"):
        list(speculative_generate_step([1, 2, 3], target_model, drafts["related"], max_tokens=3,
                                       prompt_cache=make_cache(target_model) + short))
    with pytest.raises(ValueError, match="holds 0 layers"):
        list(speculative_generate_step([1, 2, 3], target_model, max_tokens=3, prompt_cache=[]))


def test_a_prompt_cache_of_the_wrong_kind_gets_a_sentence(target_model):
    from mlx_lm.models.cache import ArraysCache

    wrong = [ArraysCache(size=2) for _ in target_model.layers]
    with pytest.raises(ValueError, match="layer 0 of the target model is a ArraysCache"):
        list(speculative_generate_step([1, 2, 3], target_model, max_tokens=3, prompt_cache=wrong))


def test_a_reused_sliding_window_prompt_cache_is_converted_in_place(target_model, drafts):
    cache = [RotatingKVCache(max_size=16) for _ in target_model.layers]
    cache += make_cache(drafts["related"])
    rounds = list(speculative_generate_step([1, 2, 3], target_model, drafts["related"],
                                            max_tokens=50, prompt_cache=cache))
    assert sum(len(r.tokens) for r in rounds) == 50
    assert isinstance(cache[0], WindowKVCache)


def test_target_only_prompt_cache_with_a_draft_is_refused(target_model, drafts):
    with pytest.raises(ValueError, match="make_cache"):
        list(speculative_generate_step([1, 2, 3], target_model, drafts["related"],
                                       max_tokens=5, prompt_cache=make_cache(target_model)))


def test_a_cache_kind_no_rewind_path_handles_gets_one_sentence():
    from mlx_spec.cache import check_rewindable

    class CompressedCache:  # neither trimmable nor ArraysCache (as deepseek_v41's LayerCache)
        offset = 0

    with pytest.raises(ValueError, match=r"cannot rewind \(CompressedCache: neither trimmable"):
        check_rewindable([CompressedCache()], "target")


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_model_whose_own_cache_cannot_rewind_is_refused_before_speculating(role):
    """No prompt cache given: the caches the call makes itself are checked too."""
    from tiny import make_llama

    class CompressedCache:  # as deepseek_v41's LayerCache
        offset = 0

    target, draft = make_llama(layers=2), make_llama(layers=1, seed=5)
    odd = target if role == "target" else draft
    odd.make_cache = lambda: [CompressedCache() for _ in odd.layers]
    with pytest.raises(ValueError, match=f"^The {role} model's cache has layers of a kind "
                                         "mlx-spec cannot rewind \\(CompressedCache"):
        speculative_generate_step([1, 2, 3], target, draft, max_tokens=5)
    if role == "target":  # decoding it alone needs no rewind: no refusal up front
        speculative_generate_step([1, 2, 3], target, None, max_tokens=5, prompt_lookup=False)


def _pending_ops(layers, tmp_path) -> int:
    """Operations not yet computed behind the arrays the layers hold (0: all evaluated)."""
    arrays = [v for layer in layers for value in vars(layer).values()
              for v in (value if isinstance(value, (list, tuple)) else [value])
              if isinstance(v, mx.array)]
    mx.export_to_dot(str(tmp_path / "graph.dot"), *arrays)
    return (tmp_path / "graph.dot").read_text().count("shape=rectangle")


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_look_ahead_shows_the_tokens_and_its_undo_leaves_no_trace(target_model, family, tmp_path):
    """What `look_ahead` shows equals feeding for real; after the undo the cache is as before
    and nothing of the look-ahead is left to compute, although the layers wrote into their
    buffers in place (mlx-lm's `keys[..., a:b, :] = k`)."""
    from families import make_family
    model = target_model if family == "llama" else make_family("qwen3_5", seed=0)
    prompt, ahead, follow = [4, 8, 15, 16], [23, 42, 7], [30, 31]
    shown = ModelCache(model, make_cache(model))
    shown.forward(mx.array(prompt, mx.uint32))
    mx.eval([c.state for c in shown.layers])
    undo = shown.look_ahead(mx.array(ahead, mx.uint32))
    assert shown.length == len(prompt + ahead)
    assert _pending_ops(shown.layers, tmp_path) > 0  # shown lazily
    undo()
    assert shown.length == len(prompt)
    assert _pending_ops(shown.layers, tmp_path) == 0  # dropped, never to be computed
    undo = shown.look_ahead(mx.array(ahead, mx.uint32))  # again, read this time
    fed = make_cache(model)
    last_logits(model, fed, prompt + ahead)
    assert mx.allclose(last_logits(model, shown.layers, follow), last_logits(model, fed, follow),
                       atol=1e-4).item()  # what the caller reads is the real thing
    undo()
    assert shown.length == len(prompt)
    clean = make_cache(model)
    last_logits(model, clean, prompt)
    assert mx.allclose(last_logits(model, shown.layers, follow), last_logits(model, clean, follow),
                       atol=1e-4).item()
