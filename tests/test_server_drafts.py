"""`mlx-spec serve` with a draft of another tokenizer, an EAGLE-3 head and token trees.

Both workers on a tiny chat target (conftest's "chat" directory): the one-at-a-time worker
serves all three kinds, a second turn reusing the stored prompt cache; the batched worker
serves an EAGLE-3 head (and a draft of another tokenizer: test_batch_cross_tokenizer.py) and
a draft model's token trees (each row its own), and sends trees from other sources to the
one-at-a-time worker (`can_batch`), refusing them in one sentence if built for them anyway. Greedy answers equal the target alone's text. References are computed
while the servers are idle.
"""

import pytest

for _name in ("starlette", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="the server tests need the 'dev' extra (pip install -e '.[dev]')")

import httpx  # noqa: E402
from test_eagle3 import SPECFORGE, head_tensors, write_head  # noqa: E402
from tiny import perturbed  # noqa: E402

from mlx_spec import generate, load, stream_generate  # noqa: E402
from mlx_spec.eagle3 import load_eagle3  # noqa: E402
from mlx_spec.server.app import create_app, serve_in_background  # noqa: E402
from mlx_spec.server.worker import can_batch  # noqa: E402
from workers import batched_worker  # noqa: E402
from mlx_spec.server.cache_store import PromptCacheStore  # noqa: E402
from mlx_spec.server.worker import GenerationWorker, SpeculationOptions  # noqa: E402

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def models(model_dirs, tmp_path_factory):
    """The chat target, and its drafts of each kind: {kind: (draft, options)}."""
    target, tokenizer = load(str(model_dirs["chat"]))
    head_dir = write_head(tmp_path_factory.mktemp("head") / "head", SPECFORGE, target,
                          head_tensors(target, 200, seed=6), [0, 1, 1])
    foreign, _ = load(str(model_dirs["foreign"]))  # its own tokenizer, kept by load
    return target, tokenizer, {
        "eagle3": (load_eagle3(str(head_dir)), SpeculationOptions(calibration=None)),
        "cross": (foreign, SpeculationOptions(calibration=None)),
        "tree": (perturbed(target, 0.05, 1), SpeculationOptions(calibration=None, tree=(3, 2))),
    }


def serve(worker):
    server, thread, url = serve_in_background(create_app(worker, "tiny"))

    def stop():
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive() and not worker._thread.is_alive()
    return url, stop


def complete(url, prompt, **fields):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            **fields}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    assert "choices" in answer, answer
    return answer


@pytest.mark.parametrize("kind", ["eagle3", "cross", "tree"])
def test_one_at_a_time_answers_equal_the_target_and_a_second_turn_reuses_the_cache(models,
                                                                                    kind):
    target, tokenizer, drafts = models
    draft, options = drafts[kind]
    first_ids = tokenizer.encode("def f(x):\n")
    answer_ids = [r.token for r in stream_generate(target, tokenizer, first_ids,
                                                   max_tokens=MAX_TOKENS)]
    second_ids = first_ids + answer_ids + tokenizer.encode("\ndef g(y):")
    expected = [generate(target, tokenizer, ids, max_tokens=MAX_TOKENS)
                for ids in (first_ids, second_ids)]
    worker = GenerationWorker(target, tokenizer, draft, options, store=PromptCacheStore(2**28))
    url, stop = serve(worker)
    try:
        first = complete(url, first_ids, num_draft_tokens=3)
        second = complete(url, second_ids, num_draft_tokens=3)
    finally:
        stop()
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == expected
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > len(first_ids)
    spec = first["speculation"]
    assert spec["drafted"] > 0
    if kind == "eagle3":
        assert "eagle3" in spec["accepted_by_source"] or spec["accepted"] == 0
    elif kind == "cross":
        assert 0 < spec["vocab_overlap"] < 1 and spec["cross_rules"]
    else:
        assert spec["tree_rounds"] > 0 and spec["tree_nodes"] > spec["tree_rounds"]


def test_the_batched_worker_serves_an_eagle3_head(models):
    target, tokenizer, drafts = models
    head, options = drafts["eagle3"]
    assert can_batch(target, head, tokenizer)
    prompts = ["def fibonacci(n):", "return", "    if n < 2:\n"]
    expected = [generate(target, tokenizer, p, max_tokens=MAX_TOKENS) for p in prompts]
    worker = batched_worker(target, tokenizer, head, options, store=PromptCacheStore(2**28))
    url, stop = serve(worker)
    try:
        answers = [complete(url, p, num_draft_tokens=2) for p in prompts]
    finally:
        stop()
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert sum(a["speculation"]["drafted"] for a in answers) > 0


@pytest.mark.parametrize("kind", ["tree", "eagle3"])
def test_the_batched_worker_serves_trees(models, kind):
    """Trees batch from a draft model of the target's tokenizer, a head (an EAGLE-3 head here;
    the MTP head in tests/test_mtp.py) and prompt lookup: each row its own tree; beside a draft
    of another tokenizer, whose rows draft chains, prompt lookup's tries batch too."""
    target, tokenizer, drafts = models
    foreign, _ = drafts["cross"]
    draft, tree_options = drafts["tree"] if kind == "tree" else (drafts["eagle3"][0],
                                                                 drafts["tree"][1])
    assert can_batch(target, foreign, tokenizer)  # a draft of another tokenizer batches
    assert can_batch(target, draft, tokenizer)  # each row its own tree
    assert can_batch(target, None, tokenizer)  # prompt lookup's tries
    prompts = ["def fibonacci(n):", "return", "    if n < 2:\n"]
    expected = [generate(target, tokenizer, p, max_tokens=MAX_TOKENS) for p in prompts]
    worker = batched_worker(target, tokenizer, draft, tree_options)
    url, stop = serve(worker)
    try:
        answers = [complete(url, p, num_draft_tokens=3) for p in prompts]
    finally:
        stop()
    assert [a["choices"][0]["text"] for a in answers] == expected
    spec = [a["speculation"] for a in answers]
    assert sum(s.get("tree_rounds", 0) for s in spec) > 0
    assert all(s["tree_nodes"] % 2 == 0 and s["tree_nodes"] > s["tree_rounds"]  # width 2
               for s in spec if s.get("tree_rounds"))


def test_the_serve_command_takes_a_head_and_a_tree(model_dirs, models, tmp_path):
    """`mlx-spec serve --draft-model HEAD --tree 3x2` batches (each row its tree); with
    `--no-batching` one request at a time."""
    from serve_process import serving, stop

    target, tokenizer, _ = models
    head_dir = write_head(tmp_path / "head", SPECFORGE, target,
                          head_tensors(target, 200, seed=6), [0, 1, 1])
    expected = generate(target, tokenizer, "def f(x):", max_tokens=MAX_TOKENS)
    for flags, how in ((["--draft-model", head_dir, "--tree", "3x2"], "batched"),
                       (["--tree", "3x2", "--no-batching"], "one request at a time")):
        with serving("--model", model_dirs["chat"], *flags) as (proc, line, url):
            assert how in line, line
            body = {"model": "default", "prompt": "def f(x):", "max_tokens": MAX_TOKENS,
                    "temperature": 0}
            answer = httpx.post(url + "/completions", json=body, timeout=120).json()
            stop(proc, 2, 130)  # SIGINT
        assert answer["choices"][0]["text"] == expected
