"""mlx-lm's own generation, prompt-cache and sampler cases, run against mlx-lm and mlx-spec.

An independent port of the cases in mlx-lm's tests/test_generate.py,
tests/test_sample_utils.py and tests/test_prompt_cache.py (on tiny random
models instead of a Hub checkpoint). Each case is parametrized by `lib`:

- ``mlx_lm``: mlx-lm itself (``mlx_lm.stream_generate`` / ``mlx_lm.generate``):
  the control. mlx-lm's behaviour is the specification, so these must pass.
- ``mlx_spec``: ``mlx_spec.stream_generate`` / ``mlx_spec.generate``, no draft.
- ``mlx_spec+draft``: the same with a draft model (k pinned, so runs are
  deterministic); a reused prompt cache is then
  ``make_prompt_cache(target) + make_prompt_cache(draft)``.

Expected values come from mlx-lm: its ``generate_step`` (greedy, or with the
same logits processors) for tokens and log-probabilities, its filter
functions (``apply_top_p``, ``apply_min_p``, ``apply_top_k``, then
``softmax(x / temp)``) for the distribution a sampler draws from.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from families import write_family_dir
from mlx_lm.generate import does_model_support_input_embeddings, generate_step
from mlx_lm.models.cache import (
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

import mlx_spec

LIBS = ["mlx_lm", "mlx_spec", "mlx_spec+draft"]
K = 3  # the draft length pinned for mlx_spec+draft (a fixed policy: deterministic)
PROMPT = "def fibonacci(n):"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = mlx_spec.load(str(model_dirs["target"]))
    draft_model, _ = mlx_spec.load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


def stream(lib, model, tokenizer, prompt, draft_model=None, **kwargs):
    """`lib`'s stream_generate; mlx_spec+draft speculates with `draft_model`, k = K."""
    if lib == "mlx_lm":
        return mlx_lm.stream_generate(model, tokenizer, prompt, **kwargs)
    if lib == "mlx_spec":
        return mlx_spec.stream_generate(model, tokenizer, prompt, **kwargs)
    assert draft_model is not None
    kwargs.setdefault("num_draft_tokens", K)
    return mlx_spec.stream_generate(model, tokenizer, prompt, draft_model=draft_model, **kwargs)


def generate(lib, model, tokenizer, prompt, draft_model=None, **kwargs):
    """`lib`'s generate (the whole text)."""
    if lib == "mlx_lm":
        return mlx_lm.generate(model, tokenizer, prompt, **kwargs)
    if lib == "mlx_spec":
        return mlx_spec.generate(model, tokenizer, prompt, **kwargs)
    kwargs.setdefault("num_draft_tokens", K)
    return mlx_spec.generate(model, tokenizer, prompt, draft_model=draft_model, **kwargs)


def tokens_of(responses, limit=None):
    out = []
    for r in responses:
        out.append(r.token)
        if limit is not None and len(out) == limit:
            break
    return out


def new_cache(lib, model, draft_model=None):
    """A prompt cache as each library takes it (the draft's layers after the target's)."""
    cache = make_prompt_cache(model)
    if lib == "mlx_spec+draft":
        cache += make_prompt_cache(draft_model)
    return cache


_GREEDY = {}  # (model id, prompt, n) -> mlx-lm's greedy (tokens, log-probs), shared by the cases


def reference(model, prompt_ids, n, **kwargs):
    """mlx-lm's generate_step (greedy unless a sampler or processors are given):
    (tokens, log-probs)."""
    key = (id(model), tuple(prompt_ids), n)
    if not kwargs and key in _GREEDY:
        return _GREEDY[key]
    toks, lps = [], []
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=n, **kwargs):
        toks.append(int(token))
        lps.append(logprobs)
    mx.eval(lps)
    if not kwargs:
        _GREEDY[key] = (toks, lps)
    return toks, lps


def fresh_tokenizer(model_dirs, eos_ids):
    """The target's tokenizer with `eos_ids` as its EOS tokens (a copy: the shared one stays)."""
    _, tokenizer = mlx_spec.load(str(model_dirs["target"]))
    tokenizer.eos_token_ids = set(eos_ids)
    return tokenizer


# ------------------------------------------------- 1. sampler= (make_sampler) arguments


@pytest.mark.parametrize("lib", LIBS)
def test_greedy_sampler_gives_mlx_lm_tokens(lib, pair):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    want, _ = reference(target_model, ids, 10)
    got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=10,
                           sampler=make_sampler(temp=0.0)))
    assert got == want
    text = generate(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=10,
                    sampler=make_sampler(temp=0.0))
    assert text == mlx_lm.generate(target_model, tokenizer, PROMPT, max_tokens=10)


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=0.01),
                                     dict(top_p=0.01, min_p=0.05, top_k=5)],
                         ids=["top_k=1", "top_p=0.01", "all-three"])
@pytest.mark.parametrize("lib", LIBS)
def test_sampler_whose_filters_keep_one_token_samples_the_argmax(lib, pair, filters):
    """temp > 0 with filters that leave only the most likely token: greedy's tokens."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    want, _ = reference(target_model, ids, 8)
    mx.random.seed(0)
    got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=8,
                           sampler=make_sampler(temp=0.8, **filters)))
    assert got == want


@pytest.mark.parametrize("lib", LIBS)
def test_seeded_sampled_run_is_reproducible(lib, pair):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    sampler = make_sampler(temp=1.0, top_p=0.95, min_p=0.02, top_k=50)

    def run(seed):
        mx.random.seed(seed)
        return tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=12,
                                sampler=sampler))

    first = run(1)
    assert len(first) == 12
    assert run(1) == first
    assert any(run(seed) != first for seed in (2, 3))  # it samples: other seeds, other tokens
    greedy, _ = reference(target_model, ids, 12)
    assert first != greedy
    mx.random.seed(4)
    text = generate(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=12,
                    sampler=sampler)
    mx.random.seed(4)
    assert generate(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=12,
                    sampler=sampler) == text


# --------------------------------------------------- 2. logits_processors= arguments


@pytest.mark.parametrize("lib", LIBS)
def test_logit_bias_forces_the_token_every_step(lib, pair):
    target_model, draft_model, tokenizer = pair
    forced = 42
    processors = make_logits_processors(logit_bias={forced: 100.0})
    got = tokens_of(stream(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=6,
                           logits_processors=processors))
    assert got == [forced] * 6
    text = generate(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=6,
                    logits_processors=processors)
    assert text == tokenizer.decode([forced] * 6)


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=2.0, repetition_context_size=16),
    dict(presence_penalty=2.0, frequency_penalty=1.0),
], ids=["repetition", "presence+frequency"])
@pytest.mark.parametrize("lib", LIBS)
def test_penalties_give_mlx_lm_tokens(lib, pair, penalties):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    n = 24
    want, _ = reference(target_model, ids, n, logits_processors=make_logits_processors(**penalties))
    plain, _ = reference(target_model, ids, n)
    assert want != plain  # the penalty matters on this prompt
    got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=n,
                           logits_processors=make_logits_processors(**penalties)))
    assert got == want


@pytest.mark.parametrize("lib", LIBS)
def test_logits_processor_sees_the_history(lib, pair):
    """mlx-lm's test_generate_with_processor: a processor is handed the tokens so far."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    seen = []

    def record(tokens, logits):
        seen.append([int(t) for t in tokens.tolist()])
        return logits

    got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=5,
                           logits_processors=[record]))
    want, _ = reference(target_model, ids, 5)
    assert got == want
    # each generated token was chosen from logits processed with exactly the history before it
    for i in range(5):
        assert ids + got[:i] in seen, f"no call saw the prompt + {i} generated tokens"


# -------------------------------------------------------------- 3. sampling order


def mlx_lm_distribution(logits, temp, top_p=1.0, min_p=0.0, top_k=0):
    """The distribution mlx-lm's make_sampler(temp, top_p, min_p, top_k) samples from:
    its filters in its order on the log-probabilities, then softmax(x / temp)."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p != 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return mx.softmax(logprobs / temp, axis=-1)


def sampler_args(top_p=1.0, min_p=0.0, top_k=0):
    """make_sampler's spelling of 'filter disabled' differs only for top_p (0 or 1 both off)."""
    return dict(top_p=top_p if top_p < 1.0 else 0.0, min_p=min_p, top_k=top_k)


def empirical(logits, n, temp, **filters):
    """Frequencies of n draws of mlx-lm's own make_sampler on these logits (one batched call)."""
    sampler = make_sampler(temp=temp, **sampler_args(**filters))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draws = sampler(mx.broadcast_to(logprobs[None], (n, logits.shape[-1])))
    counts = mx.zeros((logits.shape[-1],)).at[draws].add(1.0)
    return counts / n


def transformed(lib, logits, temp, **filters):
    """The distribution `lib` samples from for these logits."""
    if lib == "mlx_lm":
        mx.random.seed(0)
        return empirical(logits, 40_000, temp, **filters)
    from mlx_spec.sampling import SamplingConfig, logprobs_from_logits

    config = SamplingConfig(temp=temp, **filters)
    return mx.exp(logprobs_from_logits(logits, config))


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_spec"])  # one transform, target and draft alike
def test_sampling_order_of_the_mlx_lm_example(lib):
    """logprobs log([.5, .3, .2]), temp 0.25, top_p 0.6: mlx-lm keeps {0, 1} (top-p on the
    model's probabilities), then sharpens: token 1 is drawn .3^4 / (.5^4 + .3^4) = 11.5%."""
    logits = mx.log(mx.array([0.5, 0.3, 0.2]))
    want = [0.5**4 / (0.5**4 + 0.3**4), 0.3**4 / (0.5**4 + 0.3**4), 0.0]
    assert mx.allclose(mlx_lm_distribution(logits, 0.25, top_p=0.6), mx.array(want), atol=1e-6)
    got = transformed(lib, logits, 0.25, top_p=0.6)
    assert got.tolist() == pytest.approx(want, abs=0.01)


COMBOS = [  # (temp, top_p, min_p, top_k)
    (0.25, 0.6, 0.0, 0),
    (0.5, 0.9, 0.0, 0),
    (2.0, 0.5, 0.0, 0),
    (0.5, 1.0, 0.1, 0),
    (1.5, 1.0, 0.3, 0),
    (0.7, 1.0, 0.0, 5),
    (0.5, 0.8, 0.05, 10),
    (1.3, 0.7, 0.1, 8),
    (1.0, 0.9, 0.05, 20),  # temp 1: only the filters' own order (top-k last) matters
]


@pytest.mark.parametrize("combo", COMBOS, ids=[f"T{t}-p{p}-m{m}-k{k}" for t, p, m, k in COMBOS])
@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_spec"])
def test_sampling_distribution_matches_mlx_lm_filters(lib, combo):
    temp, top_p, min_p, top_k = combo
    vocab = 32 if lib == "mlx_lm" else 64  # mlx-lm's side is measured by sampling: fewer cells
    for seed in range(4):
        logits = 1.5 * mx.random.normal((vocab,), key=mx.random.key(seed))
        want = mlx_lm_distribution(logits, temp, top_p=top_p, min_p=min_p, top_k=top_k)
        got = transformed(lib, logits, temp, top_p=top_p, min_p=min_p, top_k=top_k)
        tolerance = 0.01 if lib == "mlx_lm" else 1e-5
        assert mx.abs(got - want).max().item() < tolerance, f"logits seed {seed}"
        assert mx.all((got > 0) == (want > 0)).item() or lib == "mlx_lm", \
            f"logits seed {seed}: a different set of tokens can be drawn"


def sampling_kwargs(lib, temp, **filters):
    """How each library is asked for this sampling: mlx-lm takes a sampler, mlx-spec the
    parameters (its own API), so this case checks the order alone, not sampler= support."""
    if lib == "mlx_lm":
        return dict(sampler=make_sampler(temp=temp, **sampler_args(**filters)))
    return dict(temp=temp, **filters)


@pytest.mark.parametrize("lib", LIBS)
def test_first_token_is_drawn_from_mlx_lm_distribution(lib, pair):
    """End to end (through a speculative round with the draft): the first generated token's
    frequencies over seeded runs against the exact distribution of mlx-lm's sampler."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    temp, top_p = 0.25, 0.2
    logits = target_model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    want = mlx_lm_distribution(logits, temp, top_p=top_p)
    support = [i for i, p in enumerate(want.tolist()) if p > 0]
    assert len(support) >= 2 and min(want[i].item() for i in support) > 0.2  # a real choice
    runs = 120
    counts = {}
    for seed in range(runs):
        mx.random.seed(seed)
        first = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=3,
                                 **sampling_kwargs(lib, temp, top_p=top_p)), limit=1)[0]
        counts[first] = counts.get(first, 0) + 1
    assert set(counts) <= set(support)
    for i in support:  # 120 draws: the standard deviation of a frequency is <= 0.046
        assert abs(counts.get(i, 0) / runs - want[i].item()) < 0.15, (i, counts)


# ---------------------------------------------------- 4. GenerationResponse counters


@pytest.mark.parametrize("lib", LIBS)
def test_counters_when_generation_runs_to_max_tokens(lib, pair):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    responses = list(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=5))
    want, _ = reference(target_model, ids, 5)
    assert [r.token for r in responses] == want
    assert [r.generation_tokens for r in responses] == [1, 2, 3, 4, 5]
    assert [r.prompt_tokens for r in responses] == [len(ids)] * 5
    assert [r.finish_reason for r in responses] == [None] * 4 + ["length"]
    assert all(r.logprobs.shape == (target_model.args.vocab_size,) for r in responses)


@pytest.mark.parametrize("at", [0, 3])
@pytest.mark.parametrize("lib", LIBS)
def test_counters_when_generation_stops_on_eos(lib, pair, model_dirs, at):
    """mlx-lm hands out the EOS in a last response, counted: generation_tokens at + 1,
    finish_reason "stop", no text for it."""
    target_model, draft_model, plain_tokenizer = pair
    ids = plain_tokenizer.encode(PROMPT)
    greedy, _ = reference(target_model, ids, at + 1)
    eos = greedy[at]
    assert eos not in greedy[:at]
    tokenizer = fresh_tokenizer(model_dirs, [eos])
    responses = list(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=10))
    assert [r.token for r in responses] == greedy[: at + 1]
    assert [r.generation_tokens for r in responses] == list(range(1, at + 2))
    assert [r.prompt_tokens for r in responses] == [len(ids)] * (at + 1)
    assert [r.finish_reason for r in responses] == [None] * at + ["stop"]
    assert responses[-1].text == ""
    text = "".join(r.text for r in responses)
    assert text == plain_tokenizer.decode(greedy[:at])
    assert generate(lib, target_model, tokenizer, ids, draft_model, max_tokens=10) == text


@pytest.mark.parametrize("lib", LIBS)
def test_logit_bias_on_eos_stops_at_the_first_token(lib, pair):
    target_model, draft_model, tokenizer = pair
    (eos,) = tokenizer.eos_token_ids
    responses = list(stream(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=8,
                            logits_processors=make_logits_processors(logit_bias={eos: 100.0})))
    assert [(r.token, r.generation_tokens, r.finish_reason, r.text) for r in responses] == \
        [(eos, 1, "stop", "")]


# ---------------------------------------------------------------- 5. max_tokens


@pytest.mark.parametrize("lib", LIBS)
def test_max_tokens_minus_one_has_no_limit(lib, pair):
    """More tokens than mlx-lm's default limit (256), then the caller breaks out."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    n = 260
    want, _ = reference(target_model, ids, n)
    assert not set(want) & tokenizer.eos_token_ids  # no EOS ends it earlier
    responses = []
    for r in stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=-1):
        responses.append(r)
        if len(responses) == n:
            break
    assert [r.token for r in responses] == want
    assert all(r.finish_reason is None for r in responses)
    assert responses[-1].generation_tokens == n


@pytest.mark.parametrize("lib", LIBS)
def test_max_tokens_zero_is_refused(lib, pair):
    target_model, draft_model, tokenizer = pair
    with pytest.raises(ValueError):
        next(iter(stream(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=0)))


# ---------------------------------------------------------- 6. prompt progress


PROGRESS = {  # prompt length -> mlx-lm's calls with prefill_step_size=5
    1: [(0, 1), (1, 1)],
    5: [(0, 5), (4, 5), (5, 5)],
    11: [(0, 11), (5, 11), (10, 11), (11, 11)],
}


@pytest.mark.parametrize("length", sorted(PROGRESS))
@pytest.mark.parametrize("lib", LIBS)
def test_prompt_progress_callback(lib, pair, length):
    target_model, draft_model, tokenizer = pair
    ids = list(range(20, 20 + length))
    calls = []
    got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=4,
                           prefill_step_size=5,
                           prompt_progress_callback=lambda *call: calls.append(call)))
    assert calls == PROGRESS[length]
    want, _ = reference(target_model, ids, 4)
    assert got == want


# ------------------------------------------------------------ 7. prompt cache files


KINDS = ["llama", "llama-window", "llama-max_kv_size", "gemma3_text", "qwen3_5"]


def window_cache(model):
    """A plain sliding window of 8 per layer (as gemma3_text's sliding layers)."""
    return [RotatingKVCache(max_size=8) for _ in model.layers]


def max_kv_size_cache(model):
    """What make_prompt_cache(model, max_kv_size=8) gives a model without make_cache: a
    RotatingKVCache of 8 keeping the first 4 tokens. (llama has make_cache, which ignores
    max_kv_size, so the list is built here.)"""
    return [RotatingKVCache(max_size=8, keep=4) for _ in model.layers]


@pytest.fixture(scope="module")
def kinds(pair, tmp_path_factory):
    """kind -> (target, draft, tokenizer, the target's cache maker): the draft is the llama
    draft (the family directories are written with the same tokenizer)."""
    target_model, draft_model, tokenizer = pair
    root = tmp_path_factory.mktemp("compat-families")
    out = {"llama": (target_model, draft_model, tokenizer, make_prompt_cache),
           "llama-window": (target_model, draft_model, tokenizer, window_cache),
           "llama-max_kv_size": (target_model, draft_model, tokenizer, max_kv_size_cache)}
    for name in ("gemma3_text", "qwen3_5"):
        model, _ = mlx_spec.load(str(write_family_dir(root / name, name, seed=0, window=8)))
        out[name] = (model, draft_model, tokenizer, make_prompt_cache)
    return out


TURNS = ["def f(x):\n    return x", "\ndef fibonacci(n):"]
TURN_TOKENS = 6


def mlx_lm_turns(model, tokenizer, cache, prompts, counts, **kwargs):
    """mlx-lm's tokens for each turn of a conversation through one prompt cache."""
    return [tokens_of(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n,
                                             prompt_cache=cache, **kwargs))
            for prompt, n in zip(prompts, counts)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lib", LIBS)
def test_prompt_cache_saved_and_loaded_continues_the_conversation(lib, kinds, kind, tmp_path):
    model, draft_model, tokenizer, make_cache = kinds[kind]
    if kind in ("llama-window", "llama-max_kv_size", "gemma3_text"):  # turns outgrow 8 tokens
        assert any(isinstance(c, RotatingKVCache) for c in make_cache(model))
    first, second = (tokenizer.encode(text) for text in TURNS)
    # With keep > 0 mlx-lm's multi-token pass over a wrapped ring masks part of the kept prefix
    # from its later queries, so its chunked prompt and its own one-token decoding disagree;
    # mlx-spec gives its chunked prompt's tokens, as mlx-lm's own generation (a prompt chunk
    # masked by mlx-lm's rule: cache/window.py, tests/test_max_kv_size.py).
    want = mlx_lm_turns(model, tokenizer, make_cache(model), [first, second], [TURN_TOKENS] * 2)
    assert len(first) + TURN_TOKENS > 8

    cache = make_cache(model)
    if lib == "mlx_spec+draft":
        cache += make_prompt_cache(draft_model)
    turn1 = tokens_of(stream(lib, model, tokenizer, first, draft_model, max_tokens=TURN_TOKENS,
                             prompt_cache=cache))
    assert turn1 == want[0]
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"turns": "1"})
    loaded, metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == {"turns": "1"}
    assert len(loaded) == len(cache)
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in cache]
    from_file = tokens_of(stream(lib, model, tokenizer, second, draft_model,
                                 max_tokens=TURN_TOKENS, prompt_cache=loaded))
    in_memory = tokens_of(stream(lib, model, tokenizer, second, draft_model,
                                 max_tokens=TURN_TOKENS, prompt_cache=cache))
    assert from_file == in_memory
    assert in_memory == want[1]


@pytest.mark.parametrize("lib", LIBS)
def test_prompt_cache_holds_what_was_generated(lib, pair):
    """mlx-lm's test_cache_with_generate: two tokens with a prompt cache, then a one-token
    prompt continues as if the whole text had been given at once (tokens and log-probs)."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    toks, lps = reference(target_model, ids, 5)
    cache = new_cache(lib, target_model, draft_model)
    first = list(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=2,
                        prompt_cache=cache))
    assert [r.token for r in first] == toks[:2]
    assert cache[0].offset == len(ids) + 2
    second = list(stream(lib, target_model, tokenizer, [toks[2]], draft_model, max_tokens=2,
                         prompt_cache=cache))
    assert [r.token for r in second] == toks[3:5]
    for r, lp in zip(first + second, lps[:2] + lps[3:5]):
        assert mx.allclose(r.logprobs, lp, atol=1e-4).item()


@pytest.mark.parametrize("lib", LIBS)
def test_trim_prompt_cache_then_generate_again(lib, pair):
    """mlx-lm's test_trim_cache_with_generate: trimming a turn off the cache and asking
    again gives the same tokens."""
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    more = tokenizer.encode("\n    if n < 2:")
    cache = new_cache(lib, target_model, draft_model)
    tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=1,
                     prompt_cache=cache))
    held = len(ids) + 1
    assert [c.offset for c in cache] == [held] * len(cache)
    first = list(stream(lib, target_model, tokenizer, more, draft_model, max_tokens=4,
                        prompt_cache=cache))
    assert can_trim_prompt_cache(cache)
    assert trim_prompt_cache(cache, len(more) + 4) == len(more) + 4
    assert [c.offset for c in cache] == [held] * len(cache)
    again = list(stream(lib, target_model, tokenizer, more, draft_model, max_tokens=4,
                        prompt_cache=cache))
    assert [r.token for r in again] == [r.token for r in first]
    for a, b in zip(first, again):
        assert mx.allclose(a.logprobs, b.logprobs, atol=1e-4).item()
    want = mlx_lm_turns(target_model, tokenizer, make_prompt_cache(target_model), [ids, more],
                        [1, 4])
    assert [r.token for r in first] == want[1]


# -------------------------------------------------------------- 8. input_embeddings


@pytest.mark.parametrize("lib", LIBS)
def test_input_embeddings_replace_the_prompt(lib, pair):
    """Embeddings of one prompt passed with another prompt's ids: the output follows the
    embeddings (mlx-lm's test_stream_generate_input_embeddings[_prefill])."""
    target_model, draft_model, tokenizer = pair
    assert does_model_support_input_embeddings(target_model)
    ids = tokenizer.encode(PROMPT)
    other = ids[::-1]
    embeddings = target_model.model.embed_tokens(mx.array(other))
    want, _ = reference(target_model, other, 5)
    assert want != reference(target_model, ids, 5)[0]
    if lib == "mlx_spec+draft":
        # mlx-lm refuses ("Speculative decoding does not support input embeddings."); mlx-spec
        # prefills the target from the embeddings and drafts from the ids: the target's tokens.
        with pytest.raises(ValueError):
            list(mlx_lm.stream_generate(target_model, tokenizer, ids, max_tokens=5,
                                        draft_model=draft_model, input_embeddings=embeddings))
        got = tokens_of(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=5,
                               input_embeddings=embeddings))
        assert got == want
        return
    got = tokens_of(stream(lib, target_model, tokenizer, ids, max_tokens=5,
                           input_embeddings=embeddings))
    assert got == want
    calls = []
    got = tokens_of(stream(lib, target_model, tokenizer, ids, max_tokens=5,
                           input_embeddings=embeddings, prefill_step_size=2,
                           prompt_progress_callback=lambda done, total: calls.append(done)))
    assert got == want
    assert len(calls) > len(other) / 2 and calls[-1] == len(other)


# ------------------------------------------------------------------------ 9. other


@pytest.mark.parametrize("lib", LIBS)
def test_generate_verbose_prints_the_text_and_counts(lib, pair, capsys):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    text = generate(lib, target_model, tokenizer, PROMPT, draft_model, max_tokens=8,
                    verbose=True)
    out = capsys.readouterr().out
    assert text == mlx_lm.generate(target_model, tokenizer, PROMPT, max_tokens=8)
    assert out.startswith("=" * 10 + "\n" + text + "\n" + "=" * 10 + "\n")
    assert f"Prompt: {len(ids)} tokens" in out
    assert "Generation: 8 tokens" in out
    assert "Peak memory:" in out


@pytest.mark.parametrize("lib", LIBS)
def test_prompt_as_text_ids_or_array(lib, pair):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    want, _ = reference(target_model, ids, 6)
    for prompt in (PROMPT, ids, mx.array(ids)):
        got = tokens_of(stream(lib, target_model, tokenizer, prompt, draft_model, max_tokens=6))
        assert got == want, type(prompt).__name__


@pytest.mark.parametrize("lib", LIBS)
def test_response_logprobs_are_the_models(lib, pair):
    target_model, draft_model, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    _, want = reference(target_model, ids, 8)
    responses = list(stream(lib, target_model, tokenizer, ids, draft_model, max_tokens=8))
    assert len(responses) == 8
    for r, lp in zip(responses, want):
        assert r.logprobs.shape == lp.shape
        assert mx.allclose(r.logprobs, lp, atol=1e-4).item()


@pytest.mark.parametrize("lib", LIBS)
def test_from_draft_flags(lib, pair):
    """mlx-lm's test_stream_generate_speculative: the target as its own draft with k = 2
    accepts both drafts every round: [True, True, False, True, True]. Without a draft,
    from_draft is always False."""
    target_model, _, tokenizer = pair
    ids = tokenizer.encode(PROMPT)
    want, _ = reference(target_model, ids, 5)
    if lib == "mlx_spec+draft":
        control = list(mlx_lm.stream_generate(target_model, tokenizer, ids, max_tokens=5,
                                              draft_model=target_model, num_draft_tokens=2,
                                              sampler=make_sampler(temp=0.0)))
        assert [r.from_draft for r in control] == [True, True, False, True, True]
        responses = list(stream(lib, target_model, tokenizer, ids, target_model,
                                max_tokens=5, num_draft_tokens=2))
        assert [r.token for r in responses] == want
        assert [r.from_draft for r in responses] == [True, True, False, True, True]
    else:
        responses = list(stream(lib, target_model, tokenizer, ids, max_tokens=5))
        assert [r.token for r in responses] == want
        assert [r.from_draft for r in responses] == [False] * 5
