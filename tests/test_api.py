"""The mlx-lm-shaped Python API: load, stream_generate, generate, errors."""

import pytest

import mlx_spec
from mlx_spec import generate, load, stream_generate


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


def test_stream_generate_counts_and_flags(pair):
    target_model, draft_model, tokenizer = pair
    responses = list(stream_generate(target_model, tokenizer, "def f(x):",
                                     draft_model=draft_model, max_tokens=23,
                                     num_draft_tokens=3))
    last = responses[-1]
    # Greedy, so deterministic: this target does not pick EOS within 23 tokens, the run ends
    # on the length, and every count below is pinned (no case is let off).
    assert last.finish_reason == "length"
    assert all(r.finish_reason is None for r in responses[:-1])
    assert len(responses) == 23 and last.generation_tokens == 23
    stats = last.stats
    assert stats.accepted > 0  # the flags have something to count
    assert stats.accepted == sum(r.from_draft for r in responses)
    assert sum(stats.accepted_histogram) == stats.rounds
    assert 0.0 <= stats.acceptance_rate <= 1.0


def test_generate_equals_plain_greedy(pair):
    target_model, draft_model, tokenizer = pair
    plain = generate(target_model, tokenizer, "def f(x):", max_tokens=30)
    spec = generate(target_model, tokenizer, "def f(x):", draft_model=draft_model,
                    max_tokens=30, num_draft_tokens=4)
    assert plain == spec


def test_generate_matches_mlx_lm_greedy(pair):
    import mlx_lm

    target_model, _, tokenizer = pair
    want = mlx_lm.generate(target_model, tokenizer, "def f(x):", max_tokens=20)
    got = generate(target_model, tokenizer, "def f(x):", max_tokens=20)
    assert got == want


def test_seeded_sampling_is_reproducible(pair):
    target_model, draft_model, tokenizer = pair
    runs = [generate(target_model, tokenizer, "x = ", draft_model=draft_model,
                     max_tokens=20, temp=1.0, seed=3) for _ in range(2)]
    assert runs[0] == runs[1]


def test_token_id_prompt(pair):
    target_model, _, tokenizer = pair
    ids = tokenizer.encode("def f(x):")
    assert generate(target_model, tokenizer, ids, max_tokens=8) == \
        generate(target_model, tokenizer, "def f(x):", max_tokens=8)


@pytest.mark.parametrize("kwargs,message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"temp": -0.5}, "temp"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_arguments_raise_value_error(pair, kwargs, message):
    target_model, draft_model, tokenizer = pair
    call = {"prompt": "def f(x):", "draft_model": draft_model, **kwargs}
    with pytest.raises(ValueError, match=message):
        list(stream_generate(target_model, tokenizer, **call))


def test_mismatched_vocabulary_raises(pair, model_dirs):
    """check_pair refuses another vocabulary; generating with a draft of one needs its
    tokenizer (tests/test_cross_tokenizer.py drafts across it)."""
    import mlx_lm

    target_model, _, tokenizer = pair
    foreign, foreign_tokenizer = load(str(model_dirs["foreign"]))
    with pytest.raises(ValueError, match="vocabular"):
        mlx_spec.check_pair(target_model, foreign, tokenizer, foreign_tokenizer)
    unknown = mlx_lm.load(str(model_dirs["foreign"]))[0]  # no tokenizer kept with it
    with pytest.raises(ValueError, match="vocabular.*draft_tokenizer="):
        list(stream_generate(target_model, tokenizer, "x", draft_model=unknown))


def test_missing_model_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load(str(tmp_path / "nope"))


def _first_tokens(target_model, tokenizer, prompt, n):
    return [r.token for r in stream_generate(target_model, tokenizer, prompt, max_tokens=n)]


@pytest.mark.parametrize("stop", ["eos", "length"])
def test_reused_prompt_cache_holds_what_the_caller_saw(pair, stop):
    """After EOS in the middle of a round (or max_tokens), a reused prompt cache
    holds the prompt and every returned token (the last too, as mlx-lm's), in both
    models, so a second turn continues exactly like a fresh run over the whole text."""
    from mlx_spec.cache import make_cache

    target_model, draft_model, tokenizer = pair
    prompt = "def f(x):"
    plain = _first_tokens(target_model, tokenizer, prompt, 12)
    ids = tokenizer.encode(prompt)
    cache = make_cache(target_model) + make_cache(draft_model)
    n = len(target_model.layers)
    if stop == "eos":  # make the 4th greedy token an EOS: mid-round with k = 6
        saved = set(tokenizer.eos_token_ids)
        tokenizer.eos_token_ids = saved | {plain[3]}
    try:
        out = list(stream_generate(target_model, tokenizer, ids, draft_model=draft_model,
                                   max_tokens=8, num_draft_tokens=6, prompt_cache=cache))
    finally:
        if stop == "eos":
            tokenizer.eos_token_ids = saved
    got = [r.token for r in out]
    seen = plain[:4] if stop == "eos" else plain[:8]
    assert got == seen and out[-1].finish_reason == ("stop" if stop == "eos" else "length")
    assert cache[0].offset == len(ids) + len(seen)
    assert cache[n].offset == cache[0].offset
    follow = list(stream_generate(target_model, tokenizer, plain[len(seen):len(seen) + 2],
                                  draft_model=draft_model, max_tokens=4, num_draft_tokens=3,
                                  prompt_cache=cache))
    fresh = _first_tokens(target_model, tokenizer, ids + seen + plain[len(seen):len(seen) + 2], 4)
    assert [r.token for r in follow] == fresh


def test_token_ids_are_checked(pair):
    from mlx_spec.generate import speculative_generate_step

    target_model, draft_model, _ = pair
    for bad in ([], [1, -2], [1, 10**6]):
        with pytest.raises(ValueError):
            list(speculative_generate_step(bad, target_model, draft_model, max_tokens=3))
    with pytest.raises(ValueError, match="token ids"):
        list(speculative_generate_step("text", target_model, draft_model, max_tokens=3))


def test_mlx_lm_arguments_out_of_range_get_a_sentence(pair):
    target_model, draft_model, tokenizer = pair
    with pytest.raises(ValueError, match="kv_bits must be None or one of 2, 3, 4, 5, 6, 8"):
        list(stream_generate(target_model, tokenizer, "x = 1", draft_model=draft_model, kv_bits=7))
    with pytest.raises(ValueError, match="either sampler or temp"):
        list(stream_generate(target_model, tokenizer, "x = 1", draft_model=draft_model,
                             sampler=lambda x: x, temp=0.5))
    with pytest.raises(ValueError, match="logits_processors must be"):
        list(stream_generate(target_model, tokenizer, "x = 1", draft_model=draft_model,
                             logits_processors=[3]))


def test_logprobs_are_the_models_own_as_in_mlx_lm(pair):
    """Reported logprobs are the target's log-softmax, not the temperature/top-k
    transformed distribution used for sampling."""
    import mlx.core as mx

    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode("def f(x):")
    first = next(iter(stream_generate(target_model, tokenizer, ids, draft_model=draft_model,
                                      max_tokens=4, temp=0.7, top_k=3, seed=1)))
    logits = target_model(mx.array([ids]))[0, -1].astype(mx.float32)
    want = logits - mx.logsumexp(logits)
    assert mx.allclose(first.logprobs, want, atol=1e-4).item()


def test_package_names_stay_the_api_after_submodule_imports():
    """`mlx_spec` imports its API lazily; importing the submodule `mlx_spec.generate`
    must not turn the name `mlx_spec.generate` into that module."""
    import importlib

    module = importlib.import_module("mlx_spec.generate")
    assert mlx_spec.generate is module.generate
    assert set(mlx_spec.__all__) <= set(dir(mlx_spec))
    assert all(callable(getattr(mlx_spec, name)) for name in mlx_spec.__all__)


def test_input_embeddings_without_ids_decode_the_target_alone(pair):
    """No ids to draft from: one warning, drafting off, the target's tokens; wrong shapes and
    an MTP head get one sentence."""
    import mlx.core as mx
    import mlx_lm

    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode("def f(x):\n    return")
    embeddings = target_model.model.embed_tokens(mx.array(ids[::-1]))
    want = [r.token for r in mlx_lm.stream_generate(target_model, tokenizer, ids[::-1], max_tokens=6)]
    with pytest.warns(UserWarning, match="drafting is off"):
        got = [r.token for r in stream_generate(target_model, tokenizer, [], draft_model=draft_model,
                                                max_tokens=6, input_embeddings=embeddings)]
    assert got == want
    with pytest.raises(ValueError, match="as many ids"):
        list(stream_generate(target_model, tokenizer, ids[:3], max_tokens=2,
                             input_embeddings=embeddings))
    with pytest.raises(ValueError, match="shape"):
        list(stream_generate(target_model, tokenizer, ids, max_tokens=2,
                             input_embeddings=embeddings[None]))
    with pytest.raises(ValueError, match="MTP head"):
        list(stream_generate(target_model, tokenizer, ids[::-1], draft_model="mtp", max_tokens=2,
                             input_embeddings=embeddings))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_processors_and_samplers_compose_with_lookup_on_hybrid_and_window_targets(pair, family):
    """mlx-lm's penalties and its greedy sampler, with prompt lookup in front of a draft model,
    on a hybrid (Gated DeltaNet) and a sliding-window target: mlx-lm's own tokens."""
    import mlx_lm
    from families import make_family
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    tokenizer = pair[2]
    vocab = len(tokenizer.vocab)
    target = make_family(family, seed=0, vocab_size=vocab)
    draft = make_family(family, seed=0, vocab_size=vocab, quantize_bits=8)
    ids = tokenizer.encode("def f(x):\n    return x\n\ndef f(x):\n")
    processors = make_logits_processors(repetition_penalty=1.4, logit_bias={5: 1.0})
    want = [r.token for r in mlx_lm.stream_generate(target, tokenizer, ids, max_tokens=24,
                                                    logits_processors=processors)]
    plain = [r.token for r in mlx_lm.stream_generate(target, tokenizer, ids, max_tokens=24)]
    assert want != plain  # the processors change the text
    got = [r.token for r in stream_generate(target, tokenizer, ids, draft_model=draft,
                                            max_tokens=24, num_draft_tokens=3, prompt_lookup=True,
                                            sampler=make_sampler(0.0),
                                            logits_processors=processors)]
    assert got == want
