"""`mlx-spec serve --mtp`: the shipped target drafting with its own trained MTP head.

The server runs with each worker (one request at a time, and batched): clients
at once, streamed or not, each get the target's own greedy text (what
`mlx_spec.generate` gives with no draft) while the head drafts; a second turn
reuses the stored prompt cache. The command refuses flags that exclude each
other in one sentence, and starts with the head (`serve --mtp --port 0`).
References are computed in this process only while the server is idle.
"""

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from click.testing import CliRunner

for _name in ("starlette", "uvicorn", "openai", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402

from serve_process import serving, stop  # noqa: E402
from tiny import once  # noqa: E402

from mlx_spec import generate, load  # noqa: E402
from mlx_spec.cli import main  # noqa: E402
from mlx_spec.loading import default_target_path, vocab_size  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.worker import can_batch  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.prompts import completion_prompt_ids  # noqa: E402
from mlx_spec.server.worker import GenerationWorker, SpeculationOptions  # noqa: E402

MAX_TOKENS = 16
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):", "import os\n\ndef main():",
           "def quicksort(xs):"]


@pytest.fixture(scope="module")
def target():
    return load(str(default_target_path()))


@pytest.fixture(scope="module", params=[GenerationWorker, batched_worker], ids=["serial", "batched"])
def served(target, request):
    model, tokenizer = target
    worker = request.param(model, tokenizer, "mtp", store=PromptCacheStore(2**28),
                           max_concurrency=8)
    server, thread, url = serve_in_background(create_app(worker, "default"))
    yield url, model, tokenizer
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not worker._thread.is_alive()


def ask(url, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    with httpx.Client(timeout=120) as http:
        if not fields.get("stream"):
            return http.post(url + "/v1/completions", json=body).json()
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line) for line in lines]
    return {"choices": [{"text": "".join(c["choices"][0]["text"] for c in chunks)}],
            "speculation": chunks[-1]["speculation"]}


def reference(model, tokenizer, prompt, max_tokens=MAX_TOKENS):
    """The target alone's text, computed once per prompt and length."""
    ids = completion_prompt_ids(tokenizer, prompt, vocab_size(model))
    return once(("generate", tuple(ids), max_tokens),
                lambda: generate(model, tokenizer, ids, max_tokens=max_tokens),
                holds=(model, tokenizer))


def test_the_mtp_head_is_served_batched(target):
    assert can_batch(target[0], "mtp")


def test_concurrent_clients_get_the_targets_own_text(served):
    """4 clients at once (two pin k with the head alone drafting, two leave it to the policy
    and prompt lookup; two stream): each answer is the target's greedy text, and the head
    drafted and had drafts accepted."""
    url, model, tokenizer = served
    alone = {"prompt_lookup": False}
    fields = [{"num_draft_tokens": 3, **alone}, {"stream": True},
              {"num_draft_tokens": 2, "stream": True, **alone}, {}]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda pf: ask(url, pf[0], **pf[1]), zip(PROMPTS, fields)))
    for prompt, answer in zip(PROMPTS, answers):
        assert answer["choices"][0]["text"] == reference(model, tokenizer, prompt)
    pinned = [answers[0]["speculation"], answers[2]["speculation"]]
    assert all(set(s["accepted_by_source"]) <= {"mtp"} for s in pinned)
    assert all(s["drafted"] > 0 for s in pinned)
    assert sum(s["accepted_by_source"].get("mtp", 0) for s in pinned) > 0


def test_a_second_turn_reuses_the_prompt_cache(served):
    url, model, tokenizer = served
    first = ask(url, PROMPTS[0], num_draft_tokens=3)
    prompt = PROMPTS[0] + first["choices"][0]["text"] + "\n\ndef g(y):"
    second = ask(url, prompt, num_draft_tokens=3)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == reference(model, tokenizer, prompt)


def test_mtp_weights_need_the_mtp_head(target):
    with pytest.raises(ValueError, match="mtp_weights is only used"):
        GenerationWorker(*target, None, SpeculationOptions(mtp_weights="somewhere"))


@pytest.mark.parametrize("flags,message", [
    (["--mtp", "--draft-model", "x"], "--mtp drafts with the target itself"),
    (["--mtp", "--no-draft"], "--mtp drafts with the target itself"),
    (["--mtp-weights", "x"], "--mtp-weights is only used with --mtp"),
])
def test_flags_that_exclude_each_other_are_one_sentence(flags, message):
    result = CliRunner().invoke(main, ["serve", "--port", "0", *flags])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in result.output


def test_mtp_weights_without_a_head_are_one_sentence(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--mtp",
                                       "--mtp-weights", str(tmp_path)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "MTP" in errors[0] and "Traceback" not in result.output


@pytest.mark.parametrize("batching", ["--batching", "--no-batching"])
def test_the_command_serves_with_the_head(target, batching):
    with serving("--mtp", batching) as (proc, line, url):
        kind = "batched" if batching == "--batching" else "one request at a time"
        assert line.startswith("Serving mlx-spec-default (the target's MTP head, " + kind), line
        answer = ask(url.removesuffix("/v1"), PROMPTS[1], num_draft_tokens=3)
        assert answer["choices"][0]["text"] == reference(*target, PROMPTS[1])
        assert answer["speculation"]["drafted"] > 0
        stop(proc, signal.SIGTERM, 0)
