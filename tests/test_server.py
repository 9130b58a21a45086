"""`mlx-spec serve` end to end: the real server on a free local port, the shipped pair.

Clients are the official `openai` package and raw HTTP (httpx). Greedy answers
must equal `mlx_spec.generate` on the same token ids, whether streamed or not,
one client or several at once, fresh or continuing a conversation from a
stored prompt cache. Bad requests get OpenAI's error body and leave the
server healthy; a client that leaves mid-stream frees its slot at once.
References are computed in this process only while the server is idle (MLX
generation is not thread-safe).
"""

import importlib.util
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

for _name in ("starlette", "uvicorn", "openai", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402
import openai  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from serve_process import serving, stop  # noqa: E402
from tiny import once  # noqa: E402

from mlx_spec import generate, load_default_pair  # noqa: E402
from mlx_spec.cli import main  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.prompts import chat_prompt_ids, completion_prompt_ids  # noqa: E402
from mlx_spec.server.stop_strings import StopMatcher  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.worker import GenerationWorker  # noqa: E402

MODEL_ID = "mlx-spec-default"
MAX_TOKENS = 16
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n\ndef main():",
           "def quicksort(xs):"]
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that adds two numbers."}]


class Served:
    def __init__(self, url, worker, tokenizer, target, draft):
        self.url, self.worker, self.tokenizer = url, worker, tokenizer
        self.target, self.draft = target, draft

    def client(self, **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, **kwargs)

    def http(self):
        return httpx.Client(base_url=self.url, timeout=60)

    def reference(self, ids, max_tokens=MAX_TOKENS):
        """What mlx_spec.generate gives for these ids, greedy (call it while the server is idle);
        computed once for both workers (they serve the same module-scoped pair)."""
        return once(("generate", tuple(ids), max_tokens), lambda: generate(
            self.target, self.tokenizer, list(ids), draft_model=self.draft,
            max_tokens=max_tokens), holds=(self.target, self.draft, self.tokenizer))


@pytest.fixture(scope="module")
def pair():
    return load_default_pair()


@pytest.fixture(scope="module", params=[GenerationWorker, batched_worker], ids=["serial", "batched"])
def served(pair, request):
    """The server with each worker: one request at a time, and all of them in one batch."""
    target, draft, tokenizer = pair
    worker = request.param(target, tokenizer, draft, store=PromptCacheStore(2**30),
                           max_concurrency=8)
    server, thread, url = serve_in_background(create_app(worker, MODEL_ID))
    yield Served(url, worker, tokenizer, target, draft)
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not worker._thread.is_alive()


def completion_ids(served, prompt):
    return completion_prompt_ids(served.tokenizer, prompt, 4096)


def test_chat_and_completion_equal_generate_streamed_or_not(served):
    client = served.client()
    chat = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=MAX_TOKENS,
                                          temperature=0)
    chat_stream = client.chat.completions.create(model="default", messages=CHAT, temperature=0,
                                                 max_completion_tokens=MAX_TOKENS, stream=True)
    chunks = list(chat_stream)
    text = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                     temperature=0)
    text_stream = list(client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], stream=True,
                                                 max_tokens=MAX_TOKENS, temperature=0))
    chat_ids = chat_prompt_ids(served.tokenizer, CHAT)
    expected_chat = served.reference(chat_ids)
    expected_text = served.reference(completion_ids(served, PROMPTS[0]))

    assert chat.choices[0].message.content == expected_chat
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert chat.usage.completion_tokens == MAX_TOKENS
    assert chat.usage.total_tokens == len(chat_ids) + MAX_TOKENS
    spec = chat.model_extra["speculation"]
    assert spec["rounds"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["tokens_per_round"] >= 1
    assert "draft" in spec["accepted_by_source"] and "calibrated" in spec
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_chat
    assert chunks[-1].choices[0].finish_reason == "length"
    assert text.choices[0].text == expected_text and text.object == "text_completion"
    assert "".join(c.choices[0].text for c in text_stream) == expected_text
    assert text_stream[-1].choices[0].finish_reason == "length"


def test_stream_is_openai_sse_with_usage_last(served):
    body = {"model": MODEL_ID, "prompt": PROMPTS[1], "max_tokens": 8, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with served.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    usage_chunk, finish_chunk = json.loads(events[-2][6:]), json.loads(events[-3][6:])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert finish_chunk["choices"][0]["finish_reason"] == "length"
    assert finish_chunk["speculation"]["drafted"] >= finish_chunk["speculation"]["accepted"]


def test_seeded_sampling_repeats(served):
    client = served.client()
    answers = [client.completions.create(model=MODEL_ID, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                         temperature=0.7, top_p=0.95, seed=3).choices[0].text
               for _ in range(2)]
    assert answers[0] == answers[1] and answers[0]


def test_a_seeded_request_gets_the_same_text_batched_or_one_at_a_time(pair):
    """Both modes decode a request alone with the batch engine (one row at a time, or all
    admitted at once): a seeded sampled request's text does not depend on the mode."""
    target, draft, tokenizer = pair
    body = {"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0.7, "top_p": 0.95,
            "seed": 5}
    texts = []
    for worker in (GenerationWorker(target, tokenizer, draft),
                   batched_worker(target, tokenizer, draft)):
        with TestClient(create_app(worker, MODEL_ID)) as http:
            texts.append(http.post("/v1/completions", json=body).json()["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]


def test_stop_string_cuts_the_text(served):
    ids = completion_ids(served, PROMPTS[0])
    full = served.reference(ids, 24)
    stop = full[6:9]
    client = served.client()
    whole = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=24,
                                      temperature=0, stop=[stop, "never appears"])
    streamed = list(client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=24,
                                              temperature=0, stop=stop, stream=True))
    assert whole.choices[0].text == full[:full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 24
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own_answer(served):
    """4 clients x 2 requests at once: every answer complete and equal to its one-client answer."""
    alone = {p: served.reference(completion_ids(served, p)) for p in PROMPTS}

    def client_run(prompt):
        client = served.client(timeout=120)
        out = []
        for i in range(2):
            if i % 2 == 0:
                r = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0,
                                              max_tokens=MAX_TOKENS)
                out.append(r.choices[0].text)
            else:
                chunks = client.completions.create(model=MODEL_ID, prompt=prompt, temperature=0,
                                                   max_tokens=MAX_TOKENS, stream=True)
                out.append("".join(c.choices[0].text for c in chunks))
        return prompt, out

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(client_run, PROMPTS))
    for prompt, answers in results:
        assert answers == [alone[prompt]] * 2


def test_second_turn_reuses_the_prompt_cache(served):
    client = served.client()
    first = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=MAX_TOKENS,
                                           temperature=0)
    turn = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "Now one that multiplies them."}]
    second = client.chat.completions.create(model=MODEL_ID, messages=turn, max_tokens=MAX_TOKENS,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens
    fresh = served.reference(chat_prompt_ids(served.tokenizer, turn))
    assert second.choices[0].message.content == fresh
    assert second.usage.prompt_tokens == len(chat_prompt_ids(served.tokenizer, turn))


def test_client_leaving_mid_answer_frees_its_slot(served):
    """A streamed answer left after one chunk, a whole one left after a second: both stop."""
    body = {"model": MODEL_ID, "prompt": PROMPTS[3], "max_tokens": 1500, "temperature": 0}
    with served.http() as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            next(response.iter_lines())
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=1)
        start = time.monotonic()  # 1500 tokens would take tens of seconds here
        answer = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert time.monotonic() - start < 10
        assert http.get("/health").json()["requests"]["admitted"] == 0


def test_full_server_answers_429(served):
    served.worker.max_concurrency = 1
    try:
        with served.http() as http:
            body = {"prompt": PROMPTS[3], "max_tokens": 1500, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()  # held: a dropped iterator closes the connection
                next(lines)
                refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                with pytest.raises(openai.RateLimitError):
                    served.client().completions.create(model=MODEL_ID, prompt="x", max_tokens=2)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        served.worker.max_concurrency = 8


LONG = list(range(5, 2100))  # token ids: more than the shipped model's 2048-token context
BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": CHAT}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 2.5}, 400,
     "max_completion_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "num_draft_tokens": 0}, 400, "num_draft_tokens",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 9}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias",
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias",  # "²"
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"\u0663": 1}}, 400, "logit_bias",  # "٣"
     "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages[0]",
     "invalid_value"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
]


def test_bad_requests_get_openai_errors_and_leave_the_server_healthy(served):
    with served.http() as http:
        for path, body, status, param, code in BAD_REQUESTS:
            if isinstance(body, bytes):
                response = http.post(path, content=body,
                                     headers={"content-type": "application/json"})
            else:
                response = http.post(path, json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["message"].endswith(".") and error["type"] == "invalid_request_error"
            assert (error["param"], error["code"]) == (param, code), (body, error)
        assert http.get("/v1/nothing").status_code == 404
        assert http.get("/v1/completions").status_code == 405
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert health.json()["requests"]["admitted"] == 0
    with pytest.raises(openai.NotFoundError):
        served.client().chat.completions.create(model="gpt-4o", messages=CHAT)


def test_a_content_length_in_unicode_digits_is_no_length():
    """'²' passes str.isdigit but is no int: the body is read and measured as it comes (the
    HTTP servers refuse such a header before the app; the app does not count on it)."""
    import asyncio
    from mlx_spec.server.app import _json

    class Request:
        headers = {"content-length": "\u00b2"}

        async def stream(self):
            yield b'{"prompt": "x"}'

    assert asyncio.run(_json(Request(), max_bytes=100)) == {"prompt": "x"}


def test_models_and_health(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    with served.http() as http:
        assert http.get(f"/v1/models/{MODEL_ID}").json()["id"] == MODEL_ID
        health = http.get("/health").json()
        assert health["prompt_cache"]["max_bytes"] == 2**30


def test_api_key_is_required_when_set(pair):
    target, draft, tokenizer = pair
    worker = GenerationWorker(target, tokenizer, draft)  # never started: no generation here
    http = TestClient(create_app(worker, MODEL_ID, api_key="secret"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret"}):
        for response in (http.get("/health", headers=headers),
                         http.get("/v1/models", headers=headers),
                         http.post("/v1/completions", json={"prompt": "x"}, headers=headers)):
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
    good = http.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert good.status_code == 200 and good.json()["data"][0]["id"] == MODEL_ID


def test_stop_matcher_holds_back_what_may_begin_a_stop_string():
    matcher = StopMatcher(["END", "\n\n"])
    assert matcher.feed("abc E") == ("abc ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("Dx") == ("", True)
    matcher = StopMatcher(["END"])
    assert matcher.feed("aEN") == ("a", False)
    assert matcher.feed("Y") == ("ENY", False)
    assert matcher.feed("E") == ("", False) and matcher.flush() == "E"
    assert StopMatcher().feed("END") == ("END", False)


class FakeLayer:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_cache_store_matches_exact_prefixes_and_evicts_least_recent():
    store = PromptCacheStore(max_bytes=250)
    a, b = [FakeLayer(100)], [FakeLayer(100)]
    store.put([1, 2, 3], a)
    store.put([1, 2, 3, 4, 5], b)
    assert store.take([1, 2, 3]) == (None, 0)  # a key equal to the prompt leaves nothing to send
    assert store.take([1, 2, 9]) == (None, 0)
    assert store.take([1, 2, 3, 4, 5, 6]) == (b, 5)  # the longest prefix, taken out
    assert store.take([1, 2, 3, 4, 5, 6]) == (a, 3)
    assert len(store) == 0 and store.nbytes == 0
    store.put([1], a)
    store.put([2], b)
    store.put([3], [FakeLayer(100)])  # over 250 bytes: [1] goes
    assert store.take([1, 0]) == (None, 0) and store.take([2, 0]) == (b, 1)
    store.put([4], [FakeLayer(300)])  # larger than the budget: not kept
    assert len(store) == 1 and store.nbytes == 100


def test_cache_store_holds_at_most_max_entries():
    """mlx-lm's --prompt-cache-size: the least recently stored go first beyond it, whatever
    the bytes allow."""
    store = PromptCacheStore(max_bytes=10**6, max_entries=2)
    a, b, c = [FakeLayer(10)], [FakeLayer(10)], [FakeLayer(10)]
    store.put([1], a)
    store.put([2], b)
    store.put([3], c)
    assert len(store) == 2 and store.nbytes == 20
    assert store.take([1, 0]) == (None, 0) and store.take([3, 0]) == (c, 1)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        PromptCacheStore(100, max_entries=0)


def test_cache_store_counts_real_bytes_and_refuses_what_cannot_say(pair):
    """Real caches after a generation (the shipped pair, target + draft): the store counts the
    bytes of every key and value array; a layer that cannot say its size is not kept."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec.server.cache_store import cache_nbytes

    target, draft, tokenizer = pair
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    assert cache_nbytes(cache) == 0  # empty layers hold nothing
    generate(target, tokenizer, "def f(x):", draft_model=draft, max_tokens=8, prompt_cache=cache)
    mx.eval([c.state for c in cache])
    want = sum(c.keys.nbytes + c.values.nbytes for c in cache)
    assert want > 0 and cache_nbytes(cache) == want
    store = PromptCacheStore(max_bytes=10 * want)
    store.put([1, 2], cache)
    assert store.nbytes == want

    class Opaque:  # neither nbytes nor a readable state
        @property
        def state(self):
            raise RuntimeError("no")
    store.put([3, 4], cache + [Opaque()])
    assert len(store) == 1 and store.nbytes == want


def test_serve_cli_help_bad_flag_and_missing_extra(monkeypatch):
    runner = CliRunner()
    assert runner.invoke(main, ["serve", "--help"]).exit_code == 0
    bad = runner.invoke(main, ["serve", "--port", "99999"])
    assert bad.exit_code == 2
    assert [line for line in bad.output.splitlines() if line.startswith("Error:")] == [
        bad.output.strip().splitlines()[-1]]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real_find_spec(name, *a))
    missing = runner.invoke(main, ["serve"])
    assert missing.exit_code == 1
    assert missing.output.strip() == ("Error: mlx-spec serve needs its HTTP libraries; install "
                                      "them with pip install 'mlx-spec[serve]'.")


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_signal_shuts_the_server_down_cleanly(sig, status):
    with serving() as (proc, _, url):
        assert httpx.get(url.replace("/v1", "/health"), timeout=30).status_code == 200
        stop(proc, sig, status)


def test_oversized_bodies_get_413_before_they_are_read(served):
    with served.http() as http:
        big = b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}'
        response = http.post("/v1/completions", content=big,
                             headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: refused as the stream passes the limit
            yield b'{"prompt": "'
            for _ in range(80):
                yield b"y" * 2**16
            yield b'"}'
        response = http.post("/v1/completions", content=chunks(),
                             headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert http.get("/health").json()["requests"]["admitted"] == 0


def test_penalties_and_logit_bias_follow_mlx_lm(served):
    """The same processors as mlx-lm's make_logits_processors, with speculation on: greedy
    answers equal mlx_spec.generate with those processors; a huge k is clamped, not refused."""
    from mlx_lm.sample_utils import make_logits_processors

    ids = completion_ids(served, PROMPTS[0])
    forced = served.tokenizer.encode(" x")[-1]
    cases = [({"logit_bias": {str(forced): 100}}, dict(logit_bias={forced: 100.0})),
             ({"presence_penalty": 1.5, "frequency_penalty": 0.5, "num_draft_tokens": 10**6},
              dict(presence_penalty=1.5, frequency_penalty=0.5)),
             ({"repetition_penalty": 1.3}, dict(repetition_penalty=1.3))]
    want = [generate(served.target, served.tokenizer, ids, draft_model=served.draft,
                     max_tokens=MAX_TOKENS, logits_processors=make_logits_processors(**kwargs))
            for _, kwargs in cases]
    assert want[0].split() == ["x"] * MAX_TOKENS  # the bias forces the token every time
    plain = served.reference(ids)
    assert plain not in want
    with served.http() as http:
        for (fields, _), text in zip(cases, want):
            body = {"prompt": ids, "max_tokens": MAX_TOKENS, **fields}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text, fields


def test_a_cancelled_queued_request_leaves_the_queue_at_once(pair):
    """Submit-and-disconnect cannot pile up: the queue and the slots empty as clients leave."""
    import asyncio as _asyncio

    from mlx_spec.server.requests import GenerationRequest
    from mlx_spec.server.worker import Job

    target, draft, tokenizer = pair
    worker = GenerationWorker(target, tokenizer, draft, max_concurrency=4)  # not started
    events = []
    jobs = [Job(GenerationRequest(chat=False, prompt="x"), [1, 2], 4, events.append)
            for _ in range(4)]
    for job in jobs:
        worker.submit(job)
    assert (worker.queued, worker.admitted) == (4, 4)
    for job in jobs[:3]:
        worker.cancel(job)
    assert (worker.queued, worker.admitted) == (1, 1)
    assert len(events) == 3 and all(e.status == 503 for e in events)
    assert _asyncio  # (the worker needs no event loop for this)


def test_a_server_error_does_not_echo_the_exception(pair, monkeypatch):
    target, draft, tokenizer = pair
    worker = GenerationWorker(target, tokenizer, draft)

    def fail(*args, **kwargs):
        raise RuntimeError("/home/secret/path in the exception")
    monkeypatch.setattr("mlx_spec.batch.engine.BatchEngine.step", fail)  # (one at a time too)
    with TestClient(create_app(worker, MODEL_ID)) as http:
        response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 500
    assert "secret" not in response.text and "RuntimeError" not in response.text


def test_a_target_the_batch_cannot_take_is_served_one_request_at_a_time():
    """Quantized KV caches (mlx-lm has no batched kind of them): the batch engine serves them
    one request at a time, each row on the target's own cache kinds (batch/solo.py;
    `batching` asks for the batch in vain, in one sentence); two clients at once get
    generate's answers."""
    from mlx_lm.models.cache import QuantizedKVCache

    target, draft, tokenizer = load_default_pair()  # (its own: its caches are changed here)
    target.make_cache = lambda: [QuantizedKVCache() for _ in target.layers]
    with pytest.raises(ValueError, match="one request at a time"):
        batched_worker(target, tokenizer, draft)
    worker = GenerationWorker(target, tokenizer, draft, max_concurrency=4)
    assert worker.engine.solo and worker.engine.max_rows == 1
    ids = [completion_prompt_ids(tokenizer, p, 4096) for p in PROMPTS[:2]]
    expected = [generate(target, tokenizer, i, draft_model=draft, max_tokens=MAX_TOKENS)
                for i in ids]
    server, thread, url = serve_in_background(create_app(worker, MODEL_ID))
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: httpx.post(url + "/v1/completions", json={
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=120).json(),
                PROMPTS[:2]))
    finally:
        server.should_exit = True
        thread.join(30)
    assert [a["choices"][0]["text"] for a in answers] == expected


def test_binding_beyond_loopback_is_recognised():
    from mlx_spec.cli.serve import _loopback
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.168.1.5") and not _loopback("::")


def test_logprobs_are_the_targets_own_with_speculation_on(served):
    """Chat (openai client) and a streamed completion: per token, the log-probability the
    target gives it (what mlx_spec.stream_generate reports), and the top alternatives, sorted;
    greedy, so the chosen token is the likeliest."""
    from mlx_spec import stream_generate

    ids = completion_ids(served, PROMPTS[1])
    want = [(r.token, r.logprobs) for r in stream_generate(
        served.target, served.tokenizer, ids, draft_model=served.draft, max_tokens=MAX_TOKENS)]
    want = [(t, lp) for t, lp in want if t not in served.tokenizer.eos_token_ids]
    with served.http() as http:
        body = http.post("/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS,
                                                  "logprobs": 3}).json()
        got = body["choices"][0]["logprobs"]
        assert "".join(got["tokens"]) == body["choices"][0]["text"]
        assert got["text_offset"][0] == 0 and len(got["token_logprobs"]) == len(want)
        for (token, logprobs), value, top in zip(want, got["token_logprobs"], got["top_logprobs"]):
            assert value == pytest.approx(logprobs[token].item(), abs=1e-4)
            assert len(top) == 3 and max(top.values()) == pytest.approx(value, abs=1e-4)
        lines = [json.loads(line[6:]) for line in http.post(
            "/v1/completions", json={"prompt": ids, "max_tokens": MAX_TOKENS, "logprobs": 0,
                                     "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        streamed = [v for c in lines if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"]["token_logprobs"]]
        assert streamed == pytest.approx(got["token_logprobs"], abs=1e-5)
    chat = served.client().chat.completions.create(model=MODEL_ID, messages=CHAT,
                                                   max_tokens=8, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert content and "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4)


@pytest.mark.parametrize("family,with_draft", [("qwen3_5", False), ("lfm2", False),
                                               ("nemotron_h", False), ("qwen3_5", True)])
def test_a_recurrent_hybrid_target_is_served_batched(tmp_path, family, with_draft):
    """A hybrid target (attention and Gated DeltaNet, short-conv or Mamba-2 layers) batches,
    with a draft of its own family too: three clients at once, with prompt lookup drafting,
    each get what mlx_spec.generate gives for their prompt alone."""
    from families import write_family_dir

    from mlx_spec import load
    from mlx_spec.server.worker import can_batch

    target, tokenizer = load(str(write_family_dir(tmp_path / family, family, seed=0)))
    draft = load(str(write_family_dir(tmp_path / "draft", family, seed=5)))[0] \
        if with_draft else None
    assert can_batch(target, draft, tokenizer)
    worker = batched_worker(target, tokenizer, draft, store=PromptCacheStore(2**28),
                            max_concurrency=4)
    server, thread, url = serve_in_background(create_app(worker, MODEL_ID))
    prompts = ["def f(x):", "class A:\n", "return f(x) + f(x)"]

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "prompt_lookup": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=120).json()

    try:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        server.should_exit = True
        thread.join(30)
    from mlx_spec.loading import vocab_size

    for prompt, answer in zip(prompts, answers):
        ids = completion_prompt_ids(tokenizer, prompt, vocab_size(target))
        assert answer["choices"][0]["text"] == generate(target, tokenizer, ids, max_tokens=24)
