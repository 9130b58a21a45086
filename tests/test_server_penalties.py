"""Penalties in a conversation's next turn: the same answer whatever the cache hits, either worker.

The repetition, presence and frequency penalties look at the tokens before each position
(mlx-lm's: the last 20). A follow-up turn whose new tokens are fewer than that shows whether a
worker penalises over the whole conversation (prompt + generated so far, as on a cache miss)
or over the uncached part only. Both workers, on a tiny random target with a draft of the
same tokenizer, greedy: the second turn with a stored prompt cache equals the same turn
without one, equals `mlx_spec.generate` over the whole prompt, and the workers agree.
"""

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors  # noqa: E402
from tiny import perturbed  # noqa: E402

from mlx_spec import generate, load, stream_generate  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.worker import GenerationWorker, SpeculationOptions  # noqa: E402

MAX_TOKENS = 16
PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 1.0, "frequency_penalty": 0.5}


def complete(url, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "num_draft_tokens": 3, **PENALTIES}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert "choices" in answer, answer
    return answer["choices"][0]["text"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_second_turn_with_penalties_does_not_depend_on_cache_hits_or_worker(model_dirs):
    target, tokenizer = load(str(model_dirs["target"]))
    draft = perturbed(target, 0.05, 1)

    def reference(ids):  # what a cache miss gives: every token of the prompt penalised
        return [r.token for r in stream_generate(
            target, tokenizer, ids, draft_model=draft, max_tokens=MAX_TOKENS,
            logits_processors=make_logits_processors(**PENALTIES))]

    first_ids = tokenizer.encode("def add(a, b):\n    return a + b\n")
    handed = reference(first_ids)
    # The new turn is shorter than the penalties' window: the earlier turn is inside it
    second_ids = first_ids + handed + tokenizer.encode(" x")
    expected = generate(target, tokenizer, second_ids, draft_model=draft, max_tokens=MAX_TOKENS,
                        logits_processors=make_logits_processors(**PENALTIES))
    # The library's contract with a reused prompt cache (mlx-lm's): the processors see the
    # tokens passed only; that answer differs here, so the test can tell the two apart.
    held = first_ids + handed
    target_cache, draft_cache = make_prompt_cache(target), make_prompt_cache(draft)
    target(mx.array(held)[None], cache=target_cache)
    draft(mx.array(held)[None], cache=draft_cache)
    cache = target_cache + draft_cache
    assert expected != generate(target, tokenizer, second_ids[len(held):],
                                draft_model=draft, max_tokens=MAX_TOKENS, prompt_cache=cache,
                                logits_processors=make_logits_processors(**PENALTIES))
    answers = {}
    for worker_class in (GenerationWorker, batched_worker):
        worker = worker_class(target, tokenizer, draft, SpeculationOptions(calibration=None),
                              store=PromptCacheStore(2**28))
        server, thread, url = serve_in_background(create_app(worker, "tiny"))
        try:
            complete(url, first_ids)
            hit = complete(url, second_ids)
            worker.store = PromptCacheStore(2**28)  # (idle between requests) a fresh store
            miss = complete(url, second_ids)
        finally:
            server.should_exit = True
            thread.join(30)
        assert not thread.is_alive() and not worker._thread.is_alive()
        assert hit[1] == len(first_ids) + len(handed) and miss[1] == 0
        answers[worker_class.__name__] = (hit[0], miss[0])
    assert answers == {"GenerationWorker": (expected, expected),
                       "batched_worker": (expected, expected)}


def test_both_workers_start_each_request_from_the_calibration(model_dirs):
    """`--calibration` (a calibration file, or "auto") steers both workers: the batch engine's
    rows start from it as the one-request-at-a-time worker's calls do, and `speculation`
    says so (`calibrated`); without one, neither does. A pinned k: None (no policy)."""
    import time

    from mlx_spec.calibration import Calibration, calibration_key

    target, tokenizer = load(str(model_dirs["target"]))
    draft = perturbed(target, 0.05, 1)
    calibration = Calibration(calibration_key(target), time.time(), 0.01, {1: 0.01, 8: 0.02}, {})
    said = {}
    for worker_class in (GenerationWorker, batched_worker):
        for given in (calibration, None):
            worker = worker_class(target, tokenizer, draft, SpeculationOptions(calibration=given))
            server, thread, url = serve_in_background(create_app(worker, "tiny"))
            try:
                for pinned in (None, 3):
                    body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 4,
                            "temperature": 0.7, **({"num_draft_tokens": pinned} if pinned else {})}
                    answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
                    said[worker_class.__name__, given is not None, pinned] = \
                        answer["speculation"]["calibrated"]
            finally:
                server.should_exit = True
                thread.join(30)
            if worker_class is batched_worker:
                assert worker.engine.calibration is given
    for (_, calibrated, pinned), value in said.items():
        assert value == (None if pinned else calibrated)
