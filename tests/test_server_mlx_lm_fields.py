"""mlx-lm's server request fields: the penalties' context sizes (`repetition_context_size`,
`presence_context_size`, `frequency_context_size`) reach mlx-lm's logits processors; XTC
sampling (`xtc_probability`, `xtc_threshold`) draws each token with mlx-lm's own sampler in
both workers (a draft kept while it equals the sampler's draw: exact for any sampler,
tests/test_batch_custom.py), not with a seed; the fields this server does not take
(per-request adapters and draft models) are refused in one sentence, not ignored.
"""

import mlx.core as mx
import pytest

from mlx_spec.server.requests import RequestError, Settings, parse_request
from mlx_spec.server.worker import _processors

MESSAGES = [{"role": "user", "content": "hi"}]


def test_context_sizes_are_checked_and_kept():
    request = parse_request({"messages": MESSAGES, "repetition_penalty": 1.5,
                             "repetition_context_size": 3, "presence_context_size": 7,
                             "frequency_context_size": 9}, True, "tiny")
    s = request.settings
    assert (s.repetition_context_size, s.presence_context_size, s.frequency_context_size) == \
        (3, 7, 9)
    assert parse_request({"messages": MESSAGES}, True, "tiny").settings.repetition_context_size \
        == 20  # mlx-lm's default
    for bad in (-1, 2.5, "5", True):
        with pytest.raises(RequestError, match="repetition_context_size must be an int"):
            parse_request({"messages": MESSAGES, "repetition_context_size": bad}, True, "tiny")
    whole = parse_request({"messages": MESSAGES, "repetition_context_size": 0}, True, "tiny")
    assert whole.settings.repetition_context_size == 0  # mlx-lm's: the whole context


def test_a_penalty_looks_back_as_far_as_its_context_size():
    """Token 3 appeared 4 tokens back: a repetition penalty with a window of 5 lowers its
    logit, one with a window of 2 does not."""
    tokens = mx.array([3, 1, 1, 1, 1], mx.uint32)

    def penalised(size):
        settings = Settings(repetition_penalty=2.0, repetition_context_size=size)
        out = mx.ones((1, 8))  # (mlx-lm's processor writes into the logits it is given)
        for processor in _processors(settings):
            out = processor(tokens, out)
        return out[0].tolist()
    assert penalised(5)[3] < 1.0 and penalised(2)[3] == 1.0
    assert penalised(5)[1] < 1.0 and penalised(2)[1] < 1.0
    assert penalised(0)[3] < 1.0  # 0: the whole context


def test_mlx_lms_name_for_the_served_draft_is_taken():
    assert parse_request({"messages": MESSAGES, "draft_model": "default_model"}, True, "tiny")


@pytest.mark.parametrize("field,value,says", [
    ("adapters", "my-lora", "start the server with --adapter-path"),
    ("draft_model", "other", "start the server with --draft-model")])
def test_fields_this_server_does_not_take_are_refused(field, value, says):
    with pytest.raises(RequestError, match=says) as error:
        parse_request({"messages": MESSAGES, field: value}, True, "tiny")
    assert error.value.status == 400 and error.value.param == field


def test_xtc_fields_are_checked():
    request = parse_request({"messages": MESSAGES, "xtc_probability": 0.5,
                             "xtc_threshold": 0.1, "temperature": 0.9}, True, "tiny")
    assert (request.settings.xtc_probability, request.settings.xtc_threshold) == (0.5, 0.1)
    for field, bad in (("xtc_probability", 1.5), ("xtc_threshold", 0.7), ("xtc_threshold", "x")):
        with pytest.raises(RequestError, match=f"{field} must be a number in"):
            parse_request({"messages": MESSAGES, field: bad}, True, "tiny")
    with pytest.raises(RequestError, match="seed does not fix XTC"):
        parse_request({"messages": MESSAGES, "xtc_probability": 0.5, "seed": 1,
                       "temperature": 0.7}, True, "tiny")
    # at T = 0 (given, or the server's default) XTC is off: a seed is harmless
    assert parse_request({"messages": MESSAGES, "xtc_probability": 0.5, "seed": 1}, True, "tiny")
    only = parse_request({"messages": MESSAGES, "xtc_probability": 0.5}, True, "tiny")
    assert only.settings.xtc_threshold == 0.1  # mlx-lm's server's default


def test_the_xtc_sampler_is_the_one_mlx_lms_server_makes():
    """Under one seed, on fixed log-probabilities, the worker's sampler draws what mlx-lm's
    server's (`_make_sampler`: the request's temperature, filters, XTC, its special tokens:
    the newline and the EOS ids) draws; the threshold left out is mlx-lm's 0.1."""
    from mlx_lm.sample_utils import make_sampler

    from mlx_spec import load_default_pair
    from mlx_spec.server.worker import xtc_sampler

    _, _, tokenizer = load_default_pair()
    settings = parse_request({"messages": MESSAGES, "temperature": 0.8, "top_k": 40,
                              "min_p": 0.02, "xtc_probability": 1.0}, True, "tiny").settings
    theirs = make_sampler(0.8, top_p=1.0, top_k=40, min_p=0.02, xtc_probability=1.0,
                          xtc_threshold=0.1, xtc_special_tokens=tokenizer.encode("\n")
                          + list(tokenizer.eos_token_ids))
    mx.random.seed(0)
    logits = mx.random.normal((1, 64)) * 3
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    draws = []
    for sampler in (xtc_sampler(settings, tokenizer), theirs):
        mx.random.seed(1)
        draws.append([sampler(logprobs).item() for _ in range(40)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 1


@pytest.mark.parametrize("batching", [True, False])
def test_both_workers_draw_xtc_requests_with_mlx_lms_sampler(batching):
    import httpx

    from mlx_spec import load_default_pair
    from mlx_spec.server.app import create_app, serve_in_background
    from mlx_spec.server.worker import GenerationWorker, SpeculationOptions

    target, draft, tokenizer = load_default_pair()
    worker = GenerationWorker(target, tokenizer, draft, SpeculationOptions(calibration=None),
                              batching=batching)
    server, thread, url = serve_in_background(create_app(worker, "tiny"))
    body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 24,
            "temperature": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.1}
    try:
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        greedy = httpx.post(url + "/v1/completions", timeout=60,
                            json={**body, "temperature": 0}).json()
    finally:
        server.should_exit = True
        thread.join(30)
    assert answer["choices"][0]["text"] and answer["speculation"]["rule"] == "sampler match"
    assert greedy["speculation"]["rule"] == "greedy"  # (mlx-lm's XTC is off at T = 0)


def test_decode_concurrency_bounds_the_rows_decoding_together():
    """mlx-lm's --decode-concurrency (`max_rows`): four requests at once through a batched
    worker holding at most two rows; every answer is the one it gets alone."""
    import threading

    import httpx

    from mlx_spec import generate, load_default_pair
    from mlx_spec.server.app import create_app, serve_in_background
    from mlx_spec.server.worker import GenerationWorker, SpeculationOptions

    target, draft, tokenizer = load_default_pair()
    prompts = ["def fibonacci(n):", "class Stack:", "import os\n\n\ndef", "def parse(text):"]
    expected = [generate(target, tokenizer, p, max_tokens=16, prompt_lookup=False)
                for p in prompts]
    worker = GenerationWorker(target, tokenizer, draft, SpeculationOptions(calibration=None),
                              batching=True, max_rows=2)
    held, step = [], worker.engine.step

    def counting_step():
        held.append(len(worker.engine.rows) + len(worker.engine.joining))
        return step()
    worker.engine.step = counting_step
    server, thread, url = serve_in_background(create_app(worker, "tiny"))
    texts = [None] * len(prompts)

    def ask(i):
        body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 16, "temperature": 0}
        texts[i] = httpx.post(url + "/v1/completions", json=body, timeout=120).json()[
            "choices"][0]["text"]
    try:
        askers = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for asker in askers:
            asker.start()
        for asker in askers:
            asker.join(120)
    finally:
        server.should_exit = True
        thread.join(30)
    assert texts == expected
    assert max(held) == 2  # two at once, never more
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        GenerationWorker(target, tokenizer, draft, batching=True, max_rows=0)
