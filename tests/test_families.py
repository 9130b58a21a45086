"""Hybrid recurrent and sliding-window models: greedy parity against mlx-lm's own decoding.

For each family (tiny random models built from mlx-lm's classes, windows of
8 tokens so they wrap many times) mlx-spec's greedy tokens over 96 generated
tokens must equal mlx-lm's `generate_step` greedy tokens: for k in {1, 5},
the adaptive policy, the target drafting for itself (everything accepted),
a different random model of the family (many rejections), prompt lookup alone,
mixed pairs with a plain transformer, and 4-bit / 8-bit quantized models.
"""

import mlx.core as mx
import pytest
from families import FAMILIES, plain_greedy, shared_family, shared_plain_greedy
from tiny import make_llama

from mlx_spec.generate import speculative_generate_step

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3]  # a repeat, so lookup finds something
NUM_TOKENS = 96  # 13 windows of context; each drafter drafts (all but self rewind) dozens of times


def spec_tokens(target_model, draft_model=None, n=NUM_TOKENS, **kwargs):
    out = []
    for round_ in speculative_generate_step(PROMPT, target_model, draft_model, max_tokens=n,
                                            **kwargs):
        out += round_.tokens
    return out


@pytest.fixture(scope="module")
def family(request):
    return request.param


def model_of(name, seed=0, bits=None):
    return shared_family(name, seed=seed, quantize_bits=bits)


def plain_of(name, bits=None):
    return shared_plain_greedy(model_of(name, bits=bits), PROMPT, NUM_TOKENS)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("drafter", ["k1-other", "k5-other", "k5-self", "adaptive-other",
                                     "lookup"])
def test_family_greedy_parity(name, drafter):
    target_model = model_of(name)
    if drafter == "lookup":
        got = spec_tokens(target_model, prompt_lookup=True)
    else:
        policy, which = drafter.split("-")
        draft_model = target_model if which == "self" else model_of(name, seed=5)
        k = None if policy == "adaptive" else int(policy[1:])
        got = spec_tokens(target_model, draft_model, num_draft_tokens=k,
                          adaptive=policy == "adaptive", prompt_lookup=False)
    assert got == plain_of(name)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_text", "nemotron_h"])
def test_mixed_pairs_with_a_plain_transformer(name):
    hybrid = model_of(name)
    llama = make_llama(vocab_size=64, seed=11)
    # a hybrid target with a plain-transformer draft
    assert spec_tokens(hybrid, llama, num_draft_tokens=3) == plain_of(name)
    # a plain target with a hybrid draft
    want = plain_greedy(llama, PROMPT, 60)
    assert spec_tokens(llama, hybrid, n=60, num_draft_tokens=3, prompt_lookup=False) == want


@pytest.mark.parametrize("name,bits", [("qwen3_5", 4), ("lfm2", 8), ("gemma3_text", 8),
                                       ("gpt_oss", 4)])
def test_quantized_models_keep_parity(name, bits):
    """Each family once, 4-bit and 8-bit both covered: the quantized layers are mlx's, the
    same classes at either width; what differs per family is the cache and its rewind."""
    target_model = model_of(name, bits=bits)
    draft_model = model_of(name, seed=5, bits=bits)
    got = spec_tokens(target_model, draft_model, n=80, num_draft_tokens=3, prompt_lookup=True)
    assert got == plain_greedy(target_model, PROMPT, 80)


@pytest.mark.parametrize("name", FAMILIES)
def test_rewind_leaves_the_next_logits_of_a_cache_that_never_saw_the_rejected(name):
    """The rewind itself, per cache kind: feed 5 tokens, keep 2, then the next logits
    equal those of plain decoding (one token at a time through mlx-lm's own caches)
    of only the kept tokens (float32, atol 1e-4: passes of different lengths round
    differently)."""
    from mlx_spec.cache import ModelCache, make_cache

    model = model_of(name)
    history = [(3 * i) % 60 + 1 for i in range(20)]  # past the 8-token window
    rewound = ModelCache(model, make_cache(model))  # sliding windows made rewindable
    clean = ModelCache(model, make_cache(model), rewindable=False)
    rewound.forward(mx.array(history, mx.uint32))
    for t in history:
        clean.forward(mx.array([t], mx.uint32))
    fed = [7, 8, 9, 10, 11]
    rewound.anchor()
    rewound.forward(mx.array(fed, mx.uint32))
    rewound.fed(fed)
    rewound.keep(2)
    for t in fed[:2]:
        clean.forward(mx.array([t], mx.uint32))
    got = rewound.forward(mx.array([12], mx.uint32))[-1]
    want = clean.forward(mx.array([12], mx.uint32))[-1]
    assert rewound.length == clean.length
    assert mx.allclose(got, want, atol=1e-4).item()


@pytest.mark.parametrize("name,path", [("qwen3_5", "recurrence"), ("qwen3_next", "recurrence"),
                                       ("nemotron_h", "mixers"), ("lfm2", "mixers")])
def test_recurrent_targets_rewind_by_the_fast_path(name, path):
    """After rejections Gated DeltaNet layers re-ran their recurrence alone; other
    recurrent layers re-ran their mixer only."""
    rounds = speculative_generate_step(PROMPT, model_of(name), model_of(name, seed=5),
                                       max_tokens=30, num_draft_tokens=3, prompt_lookup=False)
    list(rounds)
    target = rounds.session.target
    assert target.rewind_path == path and target.replayed_tokens > 0


@pytest.mark.parametrize("path", ["mixers", "model"])
def test_slower_rewind_paths_keep_parity(monkeypatch, path):
    """Without the recurrence-only replay the Gated DeltaNet mixers replay; without
    recorded mixers the whole model replays the kept tokens: the same tokens."""
    from mlx_spec.cache.replay import MixerReplay

    monkeypatch.setattr(MixerReplay, "_replay_recurrence", lambda *args: False)
    if path == "model":
        monkeypatch.setattr(MixerReplay, "complete", property(lambda self: False))
    rounds = speculative_generate_step(PROMPT, model_of("qwen3_5"), model_of("qwen3_5", seed=5),
                                       max_tokens=NUM_TOKENS, num_draft_tokens=3,
                                       prompt_lookup=False)
    got = [t for r in rounds for t in r.tokens]
    assert rounds.session.target.rewind_path == path
    assert got == plain_of("qwen3_5")


# --- statistical exactness on a hybrid and a sliding-window target ---

EXACT_SAMPLES = 500  # the exact rule passes at p > 0.5 (seed 3)
# The negative control is missed at 500 samples (p = 0.06 at seed 3): it keeps 1,000.
CONTROL_SAMPLES = 1000


@pytest.mark.parametrize("name,prompt", [
    ("qwen3_5", [3, 1, 4]),
    ("gemma3_text", [(5 * i) % 60 + 1 for i in range(12)]),  # longer than the 8-token window
])
def test_family_sampling_matches_target(name, prompt):
    from mlx_spec.exactness import check_exactness
    from mlx_spec.sampling import SamplingConfig

    result = check_exactness(model_of(name), model_of(name, seed=5), prompt,
                             SamplingConfig(temp=1.0), samples=EXACT_SAMPLES,
                             num_draft_tokens=2, seed=3)
    assert result.acceptance_rate < 0.6  # a poor draft: many rejections and rewinds
    assert result.passed, result


def test_family_negative_control_is_caught():
    from mlx_spec.acceptance import resample_from_target_accept
    from mlx_spec.exactness import check_exactness
    from mlx_spec.sampling import SamplingConfig

    result = check_exactness(model_of("qwen3_5"), model_of("qwen3_5", seed=5), [3, 1, 4],
                             SamplingConfig(temp=1.0), samples=CONTROL_SAMPLES,
                             num_draft_tokens=2, seed=3, accept=resample_from_target_accept)
    assert not result.passed, result


def test_max_kv_size_matches_mlx_lm_plain_decoding():
    """mlx-lm's max_kv_size (a 16-token window on a plain llama), speculated."""
    from mlx_lm.generate import generate_step

    target_model = make_llama(vocab_size=64, seed=0)
    draft_model = make_llama(vocab_size=64, seed=3, hidden=32, layers=1)
    want = [t for t, _ in generate_step(mx.array(PROMPT), target_model, max_tokens=80,
                                        max_kv_size=16,
                                        sampler=lambda lp: mx.argmax(lp, axis=-1))]
    got = spec_tokens(target_model, draft_model, n=80, num_draft_tokens=4, max_kv_size=16)
    assert got == want


def test_quantized_kv_cache_prompt_cache_keeps_parity():
    """A prompt cache of mlx-lm's QuantizedKVCache (8-bit keys and values) works,
    equal to mlx-lm's plain decoding through the same kind of cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import QuantizedKVCache

    target_model = make_llama(vocab_size=64, seed=0, hidden=128, heads=4)  # head_dim 32
    draft_model = make_llama(vocab_size=64, seed=3, hidden=64, heads=2, layers=1)

    def quantized(model):
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    want = [t for t, _ in generate_step(mx.array(PROMPT), target_model, max_tokens=60,
                                        prompt_cache=quantized(target_model),
                                        sampler=lambda lp: mx.argmax(lp, axis=-1))]
    got = spec_tokens(target_model, draft_model, n=60, num_draft_tokens=3,
                      prompt_cache=quantized(target_model) + quantized(draft_model))
    assert got == want
