"""Batched decoding with a DFlash block drafter (mlx_spec.batch.dflash): every row as if alone.

- Greedy: batches of 1, 2 and 5 ragged rows (a one-token prompt among them), k = 1, 3 and
  the block's 5, a bidirectional and a causal drafter: every row equals mlx-lm's own greedy
  decoding of its prompt, token for token.
- The drafts are the drafter's: each row's q (sampled rows) and drafts (greedy rows) equal a
  dense from-scratch forward over that row's kept context (test_dflash's reference), in
  full, sliding-window and causal layouts, over rounds with rejections.
- Hybrid (Gated DeltaNet, Mamba-2) and sliding-window targets stay exact too.
- Rows joining and cancelled mid-batch change nobody else; the caches drain; a kept cache
  reused for a second turn (the drafter starts blind from it) stays exact.
- A seeded sampled row gives the same text alone and in a crowd.
- T = 1: test_batch's chi-square of tokens 3 and 4 in a continuously refilled batch, with a
  DFlash drafter; the broken rule (resampling from p) must fail it.
- DFlash2 drafters (a candidate selector walks each row's block): greedy parity, each row's
  drafts and q against test_dflash2's dense forward and walk, and the chi-square with its
  negative control (q zero outside the candidates).
- Served: batch_generate, the batching worker to 4 clients at once then a second turn from its
  store, and `mlx-spec serve --draft-model DIR` (batched by itself): the target's own text.
"""

import numpy as np
import pytest

from batch_exactness import SAMPLES, SMALL_VOCAB, check_rows_after_a_rejection
from dflash_tiny import dflash_config, make_dflash, make_dflash2, write_dflash_dir
from families import make_family, plain_greedy, shared_plain_greedy
from test_batch import ragged_prompts, run
from test_dflash import from_scratch_block_logits
from test_dflash2 import EXTRAS, from_scratch_drafts
from tiny import make_llama

from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.dflash import load_dflash
from mlx_spec.sampling import SamplingConfig

MAX_TOKENS = 24
LAYOUTS = {"full": {}, "sliding": dict(layer_types=["sliding_attention", "full_attention"],
                                       sliding_window=3),
           "causal": dict(is_causal=True)}


@pytest.fixture(scope="module")
def target():
    return make_llama(layers=4, seed=2)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    return {name: make_dflash(root / name, 48, [0, 2], block_size=6, seed=5, **kwargs)
            for name, kwargs in LAYOUTS.items()}


@pytest.mark.parametrize("layout", ["sliding", "causal"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_every_row_equals_its_own_greedy_decoding(target, drafters, layout, k, rows):
    prompts = ragged_prompts(rows)
    engine = BatchEngine(target, drafters[layout], num_draft_tokens=k)
    got = run(engine, [RowRequest(p, MAX_TOKENS, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert engine.rounds.get(k, 0) > 0  # it really drafted
    assert engine.target.layers is None and engine.dflash.cache.layers is None  # drained


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text", "nemotron_h"])
def test_hybrid_and_sliding_window_rows_equal_their_own_greedy_decoding(tmp_path, family):
    """Taps from a Gated DeltaNet or Mamba-2 hybrid's verify pass (its recurrent state
    replayed per row after it) and a sliding-window target's (Gemma: scaled embeddings)."""
    target = make_family(family, seed=2)
    drafter = make_dflash(tmp_path / "d", 32, [0, 1], block_size=6, seed=5, is_causal=True)
    prompts = ragged_prompts(3)
    engine = BatchEngine(target, drafter, num_draft_tokens=3)
    got = run(engine, [RowRequest(p, 20, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, 20)


def record_proposals(engine):
    """Wrap the engine's drafter: each call's (histories, drawn, drafts, q) noted."""
    calls, propose = [], engine.dflash.propose

    def recording(rows, k, drawn):
        tokens, probs = propose(rows, k, drawn)
        calls.append(([list(r.history) for r in rows], list(drawn), tokens, probs))
        return tokens, probs
    engine.dflash.propose = recording
    return calls


@pytest.mark.parametrize("layout,tree", [(name, None) for name in LAYOUTS] + [("full", (3, 2))])
def test_each_rows_block_equals_a_from_scratch_forward(target, drafters, layout, tree):
    """Mixed greedy and sampled rows of ragged lengths, prompts prefilled in chunks of 4,
    with rejections: row by row, every q equals softmax of the dense forward's logits over
    the row's kept context, and every greedy draft is their argmax (a tap, position,
    padding or mask off by one fails). With token trees (3x2, siblings from each block
    position's q) the spine is checked so, the context then the target's taps along each
    accepted path, through siblings too."""
    drafter = drafters[layout]
    checked = {"greedy": 0, "sampled": 0}
    off_spine = []
    for i, history, drafted, q in mixed_rows_proposals(target, drafter, tree, off_spine):
        logits = from_scratch_block_logits(target, drafter, history, len(drafted))  # (n, V)
        if q is None:
            assert drafted == logits.argmax(-1).tolist()
            checked["greedy"] += 1
        else:
            expected = np.exp(logits - logits.max(-1, keepdims=True))
            expected /= expected.sum(-1, keepdims=True)
            assert np.allclose(q, expected, atol=2e-4), (layout, i)
            checked["sampled"] += 1
    assert min(checked.values()) >= 10, checked
    assert tree is None or sum(off_spine) > 0  # a kept sibling: a path off the spine


def mixed_rows_proposals(target, drafter, tree=None, off_spine=None):
    """Five ragged rows, greedy and sampled (T = 1) in turn, prompts prefilled in chunks of
    4, 16 tokens each: every row's proposal as (row, its history, its drafts, q or None).
    `off_spine` (a list) gets each round's count of rows whose kept path left the spine."""
    engine = BatchEngine(target, drafter, num_draft_tokens=3, prefill_step_size=4, tree=tree)
    calls = record_proposals(engine)
    step = engine.step

    def counting():
        out = step()
        if off_spine is not None:
            off_spine.append(sum(o.spine_kept is not None and o.num_accepted > o.spine_kept
                                 for o in out))
        return out
    engine.step = counting
    run(engine, [RowRequest(p, 16, SamplingConfig(temp=1.0) if i % 2 else SamplingConfig(),
                            seed=i, prompt_lookup=False)
                 for i, p in enumerate(ragged_prompts(5))])
    for histories, drawn, tokens, probs in calls:
        for i, (history, n) in enumerate(zip(histories, drawn)):
            if n:
                yield i, history, np.array(tokens[i, :n]).tolist(), \
                    None if probs[i] is None else np.array(probs[i])


def test_rows_joining_and_cancelled_mid_batch_change_nobody_else(target, drafters):
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, drafters["full"], num_draft_tokens=3)
    late = RowRequest([7, 7, 1, 2], MAX_TOKENS, prompt_lookup=False)
    got = run(engine, [RowRequest(p, MAX_TOKENS, prompt_lookup=False) for p in prompts],
              joins=[(4, late)], cancels=[(6, 1), (2, 3)])
    for i, prompt in enumerate(prompts):
        if i not in (1, 3):
            assert got[i] == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert 0 < len(got[1]) < MAX_TOKENS and 0 < len(got[3]) < MAX_TOKENS  # cancelled mid-way
    assert got[5] == shared_plain_greedy(target, late.prompt, MAX_TOKENS)
    assert engine.target.layers is None and engine.dflash.cache.layers is None  # drained


@pytest.mark.parametrize("context", ["kept", "blind"])
def test_a_kept_cache_serves_a_second_turn(target, drafters, context):
    """The first turn's cache comes back for the second with the drafter's context of all it
    holds (from position 0): the second turn's drafts equal the from-scratch forward's over
    the whole history. Without it (`blind`: a cache from elsewhere) the drafter starts from
    what the cache holds. Either way every row stays exact."""
    from mlx_spec.session import CONTEXT

    drafter = drafters["causal"]
    engine = BatchEngine(target, drafter, num_draft_tokens=3)
    prompts = ragged_prompts(3)
    firsts = [engine.insert(RowRequest(p, 8, prompt_lookup=False, keep_cache=True))
              for p in prompts]
    tokens, caches = {u: [] for u in firsts}, {}
    while engine.busy:
        for o in engine.step():
            tokens[o.uid] += o.tokens
            if o.finish_reason:
                caches[o.uid] = o.cache
    for uid, prompt in zip(firsts, prompts):
        held = getattr(caches[uid][0], CONTEXT)
        assert held.drafter is drafter and (held.start, held.end) == (0, len(prompt) + 8)
        if context == "blind":
            setattr(caches[uid][0], CONTEXT, None)
    calls = record_proposals(engine)
    turns = [p + tokens[u] + [5, 6] for u, p in zip(firsts, prompts)]
    seconds = [engine.insert(RowRequest(t, 12, prompt_lookup=False), caches[u],
                             len(t) - 2) for u, t in zip(firsts, turns)]
    got = {u: [] for u in seconds}
    while engine.busy:
        for o in engine.step():
            got[o.uid] += o.tokens
    for uid, turn in zip(seconds, turns):
        assert got[uid] == plain_greedy(target, turn, 12)
    matches = [np.array(tokens[i, :n]).tolist()
               == from_scratch_block_logits(target, drafter, history, n).argmax(-1).tolist()
               for histories, drawn, tokens, _ in calls
               for i, (history, n) in enumerate(zip(histories, drawn)) if n]
    assert len(matches) >= 10 and all(matches) == (context == "kept"), matches


def test_a_seeded_row_is_the_same_whatever_else_is_in_the_batch(target, drafters):
    """Its drafts are drawn with its own key: the other rows change nothing of its text."""
    sampling = SamplingConfig(temp=1.0)
    prompt = [5, 9, 2]
    alone = run(BatchEngine(target, drafters["causal"]),
                [RowRequest(prompt, 16, sampling, seed=11)])[0]
    crowd = run(BatchEngine(target, drafters["causal"]),
                [RowRequest(p, 16, sampling, seed=i) for i, p in enumerate(ragged_prompts(4))]
                + [RowRequest(prompt, 16, sampling, seed=11)])[-1]
    assert alone == crowd


@pytest.fixture(scope="module")
def small_target_and_drafter(tmp_path_factory):
    target = make_llama(vocab_size=SMALL_VOCAB, seed=0)
    drafter = make_dflash(tmp_path_factory.mktemp("dflash8") / "d", 48, [0, 1], block_size=4,
                          mask_token_id=SMALL_VOCAB - 1)
    return target, drafter


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_rows_after_a_rejection_are_distributed_as_the_target(small_target_and_drafter,
                                                              residual, exact):
    # tokens 3 and 4 often came after a rewind
    check_rows_after_a_rejection(*small_target_and_drafter, residual, exact,
                                 min_rewound=SAMPLES // 4)


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "naive-tree-rule"])
def test_tree_rows_after_a_rejection_are_distributed_as_the_target(small_target_and_drafter,
                                                                   residual, exact,
                                                                   monkeypatch):
    """2x3 trees from the block (siblings from each position's q), the drafter's context then
    the target's taps along each accepted path: tokens 3 and 4 at T = 1 of 600 refilled rows
    (exact p = 0.06; the naive rule, each candidate against an unchanged p, 4e-40)."""
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes

    if not residual:
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    check_rows_after_a_rejection(*small_target_and_drafter, True, exact,
                                 min_rewound=SAMPLES // 4, tree=(2, 3))


def test_a_dflash2_drafter_is_served_batched(chat_drafter, tmp_path):
    """`mlx-spec serve` batches a DFlash2 drafter too (can_batch is what it decides by): two
    clients at once get the target's own text, both rows drafted by the selector's walk."""
    needs_the_server()
    from concurrent.futures import ThreadPoolExecutor

    from mlx_spec.dflash.dflash2 import DFlash2Model
    from mlx_spec.server.app import create_app, serve_in_background
    from mlx_spec.server.worker import can_batch
    from workers import batched_worker
    from mlx_spec.server.cache_store import PromptCacheStore

    target, tokenizer, _, dflash = chat_drafter
    vocab = target.args.vocab_size
    drafter = make_dflash2(tmp_path / "d2", 48, [0, 1], block_size=6, seed=5, is_causal=True,
                           mask_token_id=vocab - 1, vocab_size=vocab)
    assert isinstance(drafter, DFlash2Model) and can_batch(target, drafter)
    assert can_batch(target, dflash, tokenizer)  # (trees too: batch/trees.py)
    worker = batched_worker(target, tokenizer, drafter, store=PromptCacheStore(2**28),
                         max_concurrency=4)
    server, thread, url = serve_in_background(create_app(worker, "default"))
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda prompt: ask(url + "/v1", prompt, num_draft_tokens=3,
                                                       prompt_lookup=False), SERVED_PROMPTS[:2]))
    finally:
        server.should_exit = True
        thread.join(30)
    for prompt, answer in zip(SERVED_PROMPTS, answers):
        assert answer["choices"][0]["text"] == reference(target, tokenizer, prompt)
        assert answer["speculation"]["drafted"] > 0, answer["speculation"]


# --- DFlash2: the candidate selector walks every row's block ------------------------------

@pytest.fixture(scope="module")
def dflash2_drafters(tmp_path_factory):
    """A bidirectional one as published and a causal one (its rounds cut to k + 1 rows), both
    with scaled embeddings, a logit multiplier and a soft cap."""
    root = tmp_path_factory.mktemp("dflash2")
    return {name: make_dflash2(root / name, 48, [0, 2], block_size=6, seed=5,
                               conv_kernel_size=3, extra=EXTRAS, is_causal=causal)
            for name, causal in (("bidirectional", False), ("causal", True))}


@pytest.mark.parametrize("layout", ["bidirectional", "causal"])
@pytest.mark.parametrize("rows", [1, 5])
def test_dflash2_rows_equal_their_own_greedy_decoding(target, dflash2_drafters, layout, rows):
    prompts = ragged_prompts(rows)
    engine = BatchEngine(target, dflash2_drafters[layout], num_draft_tokens=3)
    got = run(engine, [RowRequest(p, MAX_TOKENS, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert engine.rounds.get(3, 0) > 0


def test_dflash2_tree_rows_equal_their_own_greedy_decoding(target, dflash2_drafters):
    """`tree=(3, 2)`: each row's walk is its tree's spine, beside each spine draft the next-best
    candidate by the selector's scores given the spine's draft before it: five ragged rows
    keep their greedy text, some keeping a sibling; a row alone's rounds are a call's, round
    for round (its tokens, kept drafts and nodes: the same siblings)."""
    from mlx_spec.generate import speculative_generate_step

    drafter = dflash2_drafters["bidirectional"]
    prompts = ragged_prompts(5)
    engine = BatchEngine(target, drafter, num_draft_tokens=3, tree=(3, 2))
    got, off_spine = {}, 0
    for uid, prompt in [(engine.insert(RowRequest(p, MAX_TOKENS, prompt_lookup=False)), p)
                        for p in prompts]:
        got[uid] = []
    while engine.busy:
        for out in engine.step():
            got[out.uid] += out.tokens
            assert out.tree_nodes % 2 == 0  # two nodes a level (0: no drafts)
            off_spine += out.spine_kept is not None and out.num_accepted > out.spine_kept
    for prompt, tokens in zip(prompts, got.values()):
        assert tokens == shared_plain_greedy(target, prompt, MAX_TOKENS)
    assert off_spine > 0
    alone = BatchEngine(target, drafter, num_draft_tokens=3, tree=(3, 2))
    alone.insert(RowRequest(prompts[0], MAX_TOKENS, prompt_lookup=False))
    batched = [(o.tokens, o.num_accepted, o.tree_nodes) for _ in iter(lambda: alone.busy, False)
               for o in alone.step()]
    call = [(r.tokens, r.num_accepted, r.tree_nodes) for r in speculative_generate_step(
        prompts[0], target, drafter, max_tokens=MAX_TOKENS, num_draft_tokens=3, tree=(3, 2),
        prompt_lookup=False)]
    assert batched == call


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "naive-tree-rule"])
def test_dflash2_tree_rows_after_a_rejection_are_distributed_as_the_target(tmp_path_factory,
                                                                           residual, exact,
                                                                           monkeypatch):
    """2x3 trees from the selector's walk, siblings drawn from each spine row's q (zero outside
    its candidates): tokens 3 and 4 at T = 1 of refilled rows; the naive tree rule (each
    candidate against an unchanged p) fails."""
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes

    if not residual:
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    target = make_llama(vocab_size=SMALL_VOCAB, seed=0)
    drafter = make_dflash2(tmp_path_factory.mktemp("dflash2_tree") / "d", 48, [0, 1],
                           block_size=4, mask_token_id=SMALL_VOCAB - 1, vocab_size=SMALL_VOCAB,
                           is_causal=True)
    check_rows_after_a_rejection(target, drafter, True, exact, min_rewound=SAMPLES // 4,
                                 tree=(2, 3))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_dflash2_rows_of_hybrid_and_sliding_window_targets_equal_their_greedy_decoding(
        tmp_path, family):
    target = make_family(family, seed=2)
    drafter = make_dflash2(tmp_path / "d2", 32, [0, 1], block_size=6, seed=5,
                           conv_kernel_size=2, conv_group_size=8, is_causal=True)
    prompts = ragged_prompts(3)
    engine = BatchEngine(target, drafter, num_draft_tokens=3)
    got = run(engine, [RowRequest(p, 20, prompt_lookup=False) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, 20)
    assert engine.rounds.get(3, 0) > 0


@pytest.mark.parametrize("layout", ["bidirectional", "causal"])
def test_dflash2_rows_walk_as_a_from_scratch_forward(target, dflash2_drafters, layout):
    """Mixed greedy and sampled rows with rejections: each row's greedy drafts, or the q of
    its sampled drafts given the drafts before them, equal test_dflash2's dense forward and
    walk over that row's kept context (a predecessor, a scale or a row's key mixed up
    between rows fails)."""
    drafter = dflash2_drafters[layout]
    checked = {"greedy": 0, "sampled": 0}
    for i, history, drafted, q in mixed_rows_proposals(target, drafter):
        if q is None:
            assert drafted == from_scratch_drafts(target, drafter, history, len(drafted),
                                                  drafted, 0)
            checked["greedy"] += 1
        else:
            expected = from_scratch_drafts(target, drafter, history, len(drafted), drafted, 1.0)
            assert np.allclose(q, expected, atol=2e-4), (layout, i)
            checked["sampled"] += 1
    assert min(checked.values()) >= 10, checked


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)],
                         ids=["exact-rule", "negative-control"])
def test_dflash2_rows_after_a_rejection_are_distributed_as_the_target(tmp_path_factory,
                                                                       residual, exact):
    """q is zero outside a row's candidates (4 of 8 tokens): the residual must cover them."""
    target = make_llama(vocab_size=SMALL_VOCAB, seed=0)
    drafter = make_dflash2(tmp_path_factory.mktemp("dflash2_8") / "d", 48, [0, 1],
                           block_size=4, mask_token_id=SMALL_VOCAB - 1, vocab_size=SMALL_VOCAB,
                           is_causal=True)
    check_rows_after_a_rejection(target, drafter, residual, exact, min_rewound=SAMPLES // 4)


# --- the server: `mlx-spec serve --draft-model DIR` batches a DFlash drafter ---------------

SERVED_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):",
                  "import os\n\ndef main():", "x"]


def needs_the_server():
    for name in ("starlette", "uvicorn", "httpx"):
        pytest.importorskip(name, reason="the server tests need the 'dev' extra")


@pytest.fixture(scope="module")
def chat_drafter(model_dirs, tmp_path_factory):
    """The chat target of conftest and a causal drafter for it (its directory, loaded)."""
    from mlx_spec import load

    target, tokenizer = load(str(model_dirs["chat"]))
    path = write_dflash_dir(tmp_path_factory.mktemp("served") / "d", dflash_config(
        48, [0, 1], block_size=6, mask_token_id=target.args.vocab_size - 1, is_causal=True))
    return target, tokenizer, path, load_dflash(path)


def ask(url, prompt, max_tokens=16, **fields):
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    return httpx.post(url + "/completions", json=body, timeout=120).json()


def reference(target, tokenizer, prompt, max_tokens=16):
    from mlx_spec import generate
    from mlx_spec.server.prompts import completion_prompt_ids

    ids = completion_prompt_ids(tokenizer, prompt, target.args.vocab_size)
    return generate(target, tokenizer, ids, max_tokens=max_tokens)  # the target alone


def test_batch_generate_takes_a_dflash_drafter(chat_drafter):
    from mlx_spec import batch_generate, generate

    target, tokenizer, _, drafter = chat_drafter
    result = batch_generate(target, tokenizer, SERVED_PROMPTS, draft_model=drafter,
                            max_tokens=16, num_draft_tokens=3, prompt_lookup=False)
    for prompt, text in zip(SERVED_PROMPTS, result.texts):
        assert text == generate(target, tokenizer, prompt, max_tokens=16)


def test_concurrent_clients_of_the_batched_worker_get_the_targets_own_text(chat_drafter):
    """4 clients at once (pinned k, policy's k, a one-token prompt), then a second turn from
    the prompt-cache store: each answer is the target's greedy text, the drafter drafted."""
    needs_the_server()
    from concurrent.futures import ThreadPoolExecutor

    from mlx_spec import generate, stream_generate
    from mlx_spec.server.app import create_app, serve_in_background
    from mlx_spec.server.worker import can_batch
    from workers import batched_worker
    from mlx_spec.server.cache_store import PromptCacheStore

    target, tokenizer, _, drafter = chat_drafter
    assert can_batch(target, drafter)
    worker = batched_worker(target, tokenizer, drafter, store=PromptCacheStore(2**28),
                         max_concurrency=8)
    server, thread, url = serve_in_background(create_app(worker, "default"))
    try:
        fields = [{"num_draft_tokens": 3, "prompt_lookup": False}, {},
                  {"num_draft_tokens": 5, "prompt_lookup": False}, {"num_draft_tokens": 2}]
        with ThreadPoolExecutor(len(SERVED_PROMPTS)) as pool:
            answers = list(pool.map(lambda pf: ask(url + "/v1", pf[0], **pf[1]),
                                    zip(SERVED_PROMPTS, fields)))
        first_ids = tokenizer.encode("def f(x):\n")
        ask(url + "/v1", first_ids, num_draft_tokens=3)
        answer_ids = [r.token for r in stream_generate(target, tokenizer, first_ids,
                                                       max_tokens=16)]
        second_ids = first_ids + answer_ids + tokenizer.encode("\ndef g(y):")  # token ids: no
        second = ask(url + "/v1", second_ids, num_draft_tokens=3)  # re-tokenizing of the answer
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive() and not worker._thread.is_alive()
    for prompt, answer in zip(SERVED_PROMPTS, answers):
        assert answer["choices"][0]["text"] == reference(target, tokenizer, prompt)
    pinned = [answers[0]["speculation"], answers[2]["speculation"]]
    assert all(s["drafted"] > 0 and set(s["accepted_by_source"]) <= {"dflash"} for s in pinned)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first_ids) + 16
    assert second["choices"][0]["text"] == generate(target, tokenizer, second_ids, max_tokens=16)
    assert second["speculation"]["drafted"] > 0


def test_the_serve_command_batches_a_dflash_directory(model_dirs, chat_drafter):
    needs_the_server()
    import signal

    from serve_process import serving, stop

    target, tokenizer, path, _ = chat_drafter
    with serving("--model", model_dirs["chat"], "--draft-model", path) as (proc, line, url):
        assert "batched" in line, line
        answer = ask(url, SERVED_PROMPTS[1], num_draft_tokens=3)
        stop(proc, signal.SIGTERM, 0)
    assert answer["choices"][0]["text"] == reference(target, tokenizer, SERVED_PROMPTS[1])
    assert "dflash" in answer["speculation"]["accepted_by_source"], answer
