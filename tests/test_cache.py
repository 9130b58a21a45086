"""Rewinding caches, and refusing caches that cannot be rewound."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from mlx_spec.cache import check_rewindable, make_cache, rewind
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


def test_sliding_window_that_can_wrap_is_refused(target_model, drafts):
    cache = [RotatingKVCache(max_size=16) for _ in target_model.layers]
    cache += make_cache(drafts["related"])
    with pytest.raises(ValueError, match="RotatingKVCache"):
        list(speculative_generate_step([1, 2, 3], target_model, drafts["related"],
                                       max_tokens=50, prompt_cache=cache))


def test_sliding_window_that_never_wraps_is_allowed(target_model, drafts):
    cache = [RotatingKVCache(max_size=4096) for _ in target_model.layers]
    cache += make_cache(drafts["related"])
    rounds = list(speculative_generate_step([1, 2, 3], target_model, drafts["related"],
                                            max_tokens=10, prompt_cache=cache))
    assert sum(len(r.tokens) for r in rounds) >= 10


def test_recurrent_state_is_refused():
    with pytest.raises(ValueError, match="ArraysCache"):
        check_rewindable([ArraysCache(size=2)], "target", needed_tokens=10)


def test_draft_cache_is_checked_too(target_model, drafts):
    n = len(target_model.layers)
    cache = make_cache(target_model) + [RotatingKVCache(max_size=8)
                                        for _ in drafts["unrelated"].layers]
    assert len(cache) > n
    with pytest.raises(ValueError, match="draft model's cache"):
        list(speculative_generate_step([1, 2, 3], target_model, drafts["unrelated"],
                                       max_tokens=50, prompt_cache=cache))


def test_target_only_prompt_cache_with_a_draft_is_refused(target_model, drafts):
    with pytest.raises(ValueError, match="make_cache"):
        list(speculative_generate_step([1, 2, 3], target_model, drafts["related"],
                                       max_tokens=5, prompt_cache=make_cache(target_model)))
