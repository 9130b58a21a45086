"""mlx-lm's `max_kv_size` (sliding windows that keep the first 4 tokens, for models with no
`make_cache` of their own) against mlx-lm's own decoding, on a prompt longer than the window.

mlx-lm's RotatingKVCache shows a prompt chunk a window of max_size over its buffer (the kept
prefix, then the last max_size - 1 - keep older tokens, then the chunk), and a decoding step
the kept prefix and the last max_size - keep tokens; the rewindable window (cache/window.py)
masks a prefill chunk by the first rule (`prefilling`) and every other pass by the second, and
prefills in mlx-lm's chunks. So each token's log-probabilities are mlx-lm's at every position:
through a call (chains, the policy's k, trees), through the batch engine holding one row on
its own cache (batch/solo.py), with chunks of 4, and over two turns on one prompt cache. The
control (a chunk masked by the decoding rule, as before December 7) moves the first tokens'.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from families import settled

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.cache.window import WindowKVCache, visible
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

PROMPT = [5, 17, 3, 40, 9, 5, 17, 3, 11, 2, 8, 30, 7, 7, 30, 2, 41, 9, 1, 60]
N = 24


def gemma(noise=0.0):
    from mlx_lm.models import gemma

    mx.random.seed(0)
    return settled(gemma.Model(gemma.ModelArgs(
        model_type="gemma", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, head_dim=32, rms_norm_eps=1e-6, vocab_size=64,
        num_key_value_heads=1)), noise=noise)


@pytest.fixture(scope="module")
def pair():
    return gemma(), gemma(0.05)


def mlx_lm(target, prompt, size, step=2048, cache=None):
    """(greedy tokens, their log-probabilities (n, V)) of mlx-lm's generate_step."""
    out = list(generate_step(mx.array(prompt), target, max_tokens=N, max_kv_size=size,
                             prefill_step_size=step, prompt_cache=cache,
                             sampler=lambda lp: mx.argmax(lp, axis=-1)))
    return [int(t) for t, _ in out], mx.stack([lp for _, lp in out])


def call(target, draft, prompt, size, step=None, **options):
    rounds = list(speculative_generate_step(prompt, target, draft, max_tokens=N,
                                            max_kv_size=size, prefill_step_size=step,
                                            prompt_lookup=False, calibration=None, **options))
    return [t for r in rounds for t in r.tokens], mx.concatenate([r.logprobs for r in rounds])


def alone(target, draft, prompt, size, step=None, **options):
    engine = BatchEngine(target, draft, max_rows=1, calibration=None, max_kv_size=size,
                         prefill_step_size=step, **options)
    engine.insert(RowRequest(prompt, N, SamplingConfig(temp=0.0), prompt_lookup=False,
                             logprobs=True))
    tokens, logprobs = [], []
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
            logprobs.append(out.logprobs)
    return tokens, mx.concatenate(logprobs)


def same(ours, theirs):
    return ours[0] == theirs[0] and mx.allclose(ours[1], theirs[1], atol=1e-4).item()


@pytest.mark.parametrize("size", [8, 16])
@pytest.mark.parametrize("step", [None, 4])  # mlx-lm's chunks (2048), or chunks of 4
def test_each_tokens_log_probabilities_are_mlx_lms(pair, size, step):
    target, draft = pair
    expected = mlx_lm(target, PROMPT, size, step or 2048)
    assert not same(expected, mlx_lm(target, PROMPT, None))  # the window shows
    for options in (dict(num_draft_tokens=3), {}, dict(num_draft_tokens=3, tree=(3, 2))):
        assert same(call(target, draft, PROMPT, size, step, **options), expected), options
        assert same(alone(target, draft, PROMPT, size, step, **options), expected), options


def test_a_batch_of_several_rows_refuses_it_in_one_sentence(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="max_kv_size.*pass max_rows=1"):
        BatchEngine(target, draft, max_kv_size=8)


def test_two_turns_on_one_prompt_cache_are_mlx_lms(pair):
    target, draft = pair
    reference = make_prompt_cache(target, 8)
    expected = [mlx_lm(target, prompt, 8, cache=reference) for prompt in (PROMPT, PROMPT[:9])]
    cache = make_prompt_cache(target, 8) + make_prompt_cache(draft, 8)
    got = [call(target, draft, prompt, 8, prompt_cache=cache, num_draft_tokens=3)
           for prompt in (PROMPT, PROMPT[:9])]
    assert all(same(g, e) for g, e in zip(got, expected))


def test_the_control_a_chunk_masked_as_a_step_moves_the_first_tokens(pair, monkeypatch):
    target, draft = pair
    expected = mlx_lm(target, PROMPT, 8)
    monkeypatch.setattr(WindowKVCache, "_chunk_mask", lambda self, q, k: visible(
        q, k, self.window(), self.keep))
    got = call(target, draft, PROMPT, 8, num_draft_tokens=3)
    assert not mx.allclose(got[1][:1], expected[1][:1], atol=1e-2).item()
