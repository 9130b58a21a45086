"""`mlx-spec serve --kv-bits`: mlx-lm's server option. Requests are decoded one at a time (as
mlx-lm's server decodes them: it has no batched quantized cache), each on the target's own
cache kinds (batch/solo.py), quantized where mlx-lm quantizes it (cache/quantize.py): a greedy answer is
the text `generate` gives with the same kv_bits, a second turn reuses the stored (quantized)
prompt cache. Asking the worker to batch them, or a group size that does not divide the
keys, is one sentence before anything is served.
"""

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402
from mlx_lm.models.cache import QuantizedKVCache  # noqa: E402

from mlx_spec import generate, load_default_pair  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.worker import GenerationWorker, SpeculationOptions  # noqa: E402

MAX_TOKENS = 24
QUANTIZED = dict(kv_bits=2, kv_group_size=64, quantized_kv_start=12)


@pytest.fixture(scope="module")
def pair():
    return load_default_pair()


def complete(url, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert "choices" in answer, answer
    return answer


def test_answers_are_generates_with_kv_bits_and_a_second_turn_reuses_the_cache(pair):
    """Turn 2's reference continues turn 1's prompt cache, quantized in turn 1 (as mlx-lm's
    generate_step on one shared cache: tests/test_kv_bits.py), at 2 bits, where a cache
    quantized at another token would give other text."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec import stream_generate

    target, draft, tokenizer = pair
    first_ids = tokenizer.encode("import os\n\n\ndef main():")
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    answer_ids = [r.token for r in stream_generate(target, tokenizer, first_ids, draft_model=draft,
                                                   max_tokens=MAX_TOKENS, prompt_cache=cache,
                                                   **QUANTIZED)]
    more = tokenizer.encode("\n\n\ndef parse(")
    second_ids = first_ids + answer_ids + more
    expected = [tokenizer.decode(answer_ids), tokenizer.decode(
        [r.token for r in stream_generate(target, tokenizer, more, draft_model=draft,
                                          max_tokens=MAX_TOKENS, prompt_cache=cache,
                                          **QUANTIZED)])]
    assert expected[0] != generate(target, tokenizer, first_ids, max_tokens=MAX_TOKENS)
    assert expected[1] != generate(target, tokenizer, second_ids, max_tokens=MAX_TOKENS,
                                   **QUANTIZED)  # (quantized at token 12, not in one prefill)
    store = PromptCacheStore(2**28)
    worker = GenerationWorker(target, tokenizer, draft,
                              SpeculationOptions(calibration=None, **QUANTIZED), store=store)
    assert worker.engine.solo and worker.engine.max_rows == 1
    server, thread, url = serve_in_background(create_app(worker, "tiny"))
    try:
        first = complete(url, first_ids)
        second = complete(url, second_ids)
    finally:
        server.should_exit = True
        thread.join(30)
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == expected
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > len(first_ids)
    assert first["speculation"]["drafted"] > 0
    stored = [layer for cache, _ in store._entries.values() for layer in cache]
    assert any(type(layer) is QuantizedKVCache for layer in stored)


def test_batching_them_or_a_group_that_does_not_divide_the_keys_is_one_sentence(pair):
    target, draft, tokenizer = pair
    with pytest.raises(ValueError, match="decoded one request at a time"):
        GenerationWorker(target, tokenizer, draft, SpeculationOptions(**QUANTIZED),
                         batching=True)
    with pytest.raises(ValueError, match="which kv_group_size 128 does not divide"):
        GenerationWorker(target, tokenizer, draft,
                         SpeculationOptions(kv_bits=4, kv_group_size=128))
    with pytest.raises(ValueError, match="kv_bits must be None or one of"):
        GenerationWorker(target, tokenizer, draft, SpeculationOptions(kv_bits=7))


def test_the_serve_command_takes_mlx_lms_options():
    from serve_process import serving, stop

    with serving("--kv-bits", "4", "--quantized-kv-start", "12") as (proc, line, url):
        assert "one request at a time, KV cache quantized to 4 bits from 12 tokens" in line
        body = {"model": "default", "prompt": "import os\n\n\ndef main():",
                "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(url + "/completions", json=body, timeout=120).json()
        stop(proc, 2, 130)  # SIGINT
    assert answer["choices"][0]["text"]
