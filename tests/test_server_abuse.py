"""`mlx-spec serve` under abuse: a small run of bench.studies.serve_abuse as a test.

The real server on a free local port (the shipped pair, an API key, the
default limits) gets about 50 requests from 6 threads at once: every
well-formed one of the study's plan (greedy, 8-12 tokens, streamed or not,
with logit_bias, penalties, logprobs, num_draft_tokens 10**9) and every
abusive kind (64 MiB bodies with and without Content-Length, max_tokens
10**9, refused fields, bad and missing keys, malformed JSON, values out of
range, floods of clients that leave at once or mid-body). Each abusive
request gets its 4xx with OpenAI's code, nothing gets a 5xx or makes the
server log an error, the valid answers equal the ones sent alone before,
nothing stays admitted, resident memory grows little and a 64 MiB body is
refused in under 2 s.
"""

import gc

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name,
                        reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

from bench.studies import serve_abuse  # noqa: E402
from mlx_spec import load_default_pair  # noqa: E402
from mlx_spec.server.app import Limits, create_app, serve_in_background  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.worker import GenerationWorker  # noqa: E402

MODEL_ID = serve_abuse.MODEL_ID
KEY = "test-abuse-key"
REQUESTS = 48
THREADS = 6
CODES = {413: {"request_too_large"}, 401: {"invalid_api_key"},
         400: {"invalid_json", "invalid_value", "unsupported_parameter", None}}
UNSUPPORTED = {"tools", "response_format json"}


class Served:
    def __init__(self, url, worker, tokenizer):
        self.url, self.worker, self.tokenizer = url, worker, tokenizer


@pytest.fixture(scope="module", params=[GenerationWorker, batched_worker], ids=["serial", "batched"])
def served(request):
    """The server with each worker: one request at a time, and all of them in one batch."""
    target, draft, tokenizer = load_default_pair()
    worker = request.param(target, tokenizer, draft, store=PromptCacheStore(2**30),
                           max_concurrency=16)
    server, thread, url = serve_in_background(create_app(worker, MODEL_ID, api_key=KEY,
                                                          limits=Limits()))
    yield Served(url, worker, tokenizer)
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not worker._thread.is_alive()


def test_abuse_gets_4xx_and_leaves_good_answers_unchanged(served):
    refs = serve_abuse.references(served.url, KEY, served.tokenizer)
    cases = serve_abuse.plan(served.tokenizer, REQUESTS, seed=1)
    kinds = {c.category for c in cases}
    assert {c.category for c in serve_abuse.abusive_cases()} <= kinds
    assert {f"valid: {name}" for name in refs} <= kinds
    with serve_abuse.ErrorLog() as errors:
        gc.collect()
        before = serve_abuse.rss_bytes()
        results = serve_abuse.run_abuse(served.url, KEY, cases, THREADS)
        health = serve_abuse.health(served.url, KEY)
        gc.collect()
        grown = serve_abuse.rss_bytes() - before

    for case, outcome in results:
        if outcome.status is not None:
            assert outcome.status < 500, (case.category, outcome)
        assert outcome.error is None, (case.category, outcome.error)
        assert outcome.status == case.expect, (case.category, outcome)
        if case.expect == 200:
            assert outcome.text == refs[case.reference], case.category
        elif case.expect is not None:
            assert outcome.code in CODES[case.expect], (case.category, outcome.code)
            if case.category in UNSUPPORTED:
                assert outcome.code == "unsupported_parameter"
        if "64 MiB" in case.category:
            # (a minute before the cap; 5 s leaves room for the other test worker's load)
            assert outcome.seconds < 5, (case.category, outcome.seconds)
    assert sum(o.extra.get("disconnects", 0) for _, o in results) >= 3 * serve_abuse.FLOOD_SIZE
    assert errors.messages == []  # no 500 that the client never saw (one that left mid-body)
    assert health["status"] == "ok" and health["requests"]["admitted"] == 0
    assert not health["requests"]["running"]
    assert grown < 300 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"
