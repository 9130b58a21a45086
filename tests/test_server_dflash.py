"""`mlx-spec serve` with a DFlash block drafter: the real server on a free local port.

A tiny target with a chat template and a tiny drafter written in the published
layout, served one request at a time (`GenerationWorker`, `mlx-spec serve
--no-batching`; the batched worker: test_batch_dflash.py). Greedy answers equal
`mlx_spec.generate`, streamed or not; the speculation summary names the drafter
("dflash"); a second turn reuses the stored prompt cache with the drafter's
context of the first.
References are computed in this process only while the server is idle.
"""

import signal

import pytest

for _name in ("starlette", "uvicorn", "openai", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402
import openai  # noqa: E402

from dflash_tiny import dflash_config, write_dflash_dir  # noqa: E402

from serve_process import serving, stop  # noqa: E402

from mlx_spec import generate, load, stream_generate  # noqa: E402
from mlx_spec.dflash import load_dflash  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.prompts import chat_prompt_ids, completion_prompt_ids  # noqa: E402
from mlx_spec.server.worker import GenerationWorker  # noqa: E402
from mlx_spec.session import CONTEXT  # noqa: E402

MODEL_ID = "tiny"
MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "def f(x):"}]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def drafter_dir(model_dirs, tmp_path_factory):
    vocab = load(str(model_dirs["chat"]))[0].args.vocab_size
    return write_dflash_dir(tmp_path_factory.mktemp("dflash") / "d",
                            dflash_config(48, [0, 1], block_size=6, mask_token_id=vocab - 1))


@pytest.fixture(scope="module")
def served(model_dirs, drafter_dir):
    target, tokenizer = load(str(model_dirs["chat"]))
    drafter = load_dflash(drafter_dir)
    worker = GenerationWorker(target, tokenizer, drafter, store=PromptCacheStore(2**28),
                              max_concurrency=4)
    server, thread, url = serve_in_background(create_app(worker, MODEL_ID))
    yield url, worker, target, tokenizer, drafter
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not worker._thread.is_alive()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def test_answers_equal_generate_streamed_or_not(served):
    url, _, target, tokenizer, drafter = served
    api = client(url)
    chat = api.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0)
    chat_stream = list(api.chat.completions.create(model=MODEL_ID, messages=CHAT, stream=True,
                                                   max_tokens=MAX_TOKENS, temperature=0))
    text = api.completions.create(model=MODEL_ID, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                  temperature=0)
    text_stream = list(api.completions.create(model=MODEL_ID, prompt=PROMPT, stream=True,
                                              max_tokens=MAX_TOKENS, temperature=0))

    def reference(ids):
        return generate(target, tokenizer, list(ids), draft_model=drafter, max_tokens=MAX_TOKENS)

    expected_chat = reference(chat_prompt_ids(tokenizer, CHAT))
    expected_text = reference(completion_prompt_ids(tokenizer, PROMPT, target.args.vocab_size))
    assert expected_chat == generate(target, tokenizer, chat_prompt_ids(tokenizer, CHAT),
                                     max_tokens=MAX_TOKENS)  # (the target's own)
    assert chat.choices[0].message.content == expected_chat
    assert "".join(c.choices[0].delta.content or "" for c in chat_stream) == expected_chat
    assert text.choices[0].text == expected_text
    assert "".join(c.choices[0].text for c in text_stream) == expected_text
    for answer in (chat, text):
        spec = answer.model_extra["speculation"]
        assert spec["rounds"] > 0 and spec["drafted"] > 0
        assert "dflash" in spec["accepted_by_source"]


def test_a_second_turn_reuses_the_cache_and_the_drafters_context(served):
    """Turns as token ids (no re-tokenizing of the answer): the second turn's prompt is the
    first's, its answer's tokens and more."""
    url, worker, target, tokenizer, drafter = served
    first_ids = tokenizer.encode("def f(x):\n")
    body = {"model": MODEL_ID, "max_tokens": MAX_TOKENS, "temperature": 0, "num_draft_tokens": 3}
    first = httpx.post(url + "/v1/completions", json={**body, "prompt": first_ids},
                       timeout=120).json()
    answer_ids = [r.token for r in stream_generate(target, tokenizer, first_ids,
                                                   max_tokens=MAX_TOKENS)]
    ids = first_ids + answer_ids + tokenizer.encode("\ndef g(y):")
    second = httpx.post(url + "/v1/completions", json={**body, "prompt": ids},
                        timeout=120).json()
    assert first["choices"][0]["text"] == tokenizer.decode(answer_ids)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first_ids) + MAX_TOKENS
    assert second["choices"][0]["text"] == generate(target, tokenizer, ids, max_tokens=MAX_TOKENS)
    assert "dflash" in second["speculation"]["accepted_by_source"]
    # The stored cache keeps the drafter's context of everything it holds, from position 0:
    # the second turn's drafter read the first turn's taps instead of starting blind.
    held = [(key, cache) for key, (cache, _) in worker.store._entries.items()
            if list(key[:len(ids)]) == ids]
    assert len(held) == 1
    key, cache = held[0]
    context = getattr(cache[0], CONTEXT)
    assert context.drafter is drafter and context.start == 0 and context.end == len(key)


def test_the_serve_command_takes_a_dflash_directory(model_dirs, drafter_dir):
    """`mlx-spec serve --draft-model DIR --no-batching` loads the drafter, serves one request
    at a time and answers as generate does."""
    with serving("--model", model_dirs["chat"], "--draft-model", drafter_dir,
                 "--no-batching") as (proc, line, url):
        assert "one request at a time" in line, line
        body = {"model": "default", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(url + "/completions", json=body, timeout=120).json()
        assert "dflash" in answer["speculation"]["accepted_by_source"], answer
        stop(proc, signal.SIGINT, 130)
    target, tokenizer = load(str(model_dirs["chat"]))
    ids = completion_prompt_ids(tokenizer, PROMPT, target.args.vocab_size)
    assert answer["choices"][0]["text"] == generate(target, tokenizer, ids, max_tokens=MAX_TOKENS)
