"""Batching with a draft of another tokenizer: each row drafts with a drafter of its own.

The tiny pairs are test_cross_tokenizer's (vocabularies built from lists, tiny random llamas):
the target beside a noisy copy of itself in a shifted id space (it agrees often, not always),
and beside a SentencePiece draft. Every row of a batch of three prompts of different lengths
equals the target alone token for token over 48 tokens, for several k; at T = 1 the first two
tokens of batched rows, and tokens 3 and 4 of rows in a refilled batch (most rewound a rejected
draft first), pass a chi-square against the target's exact distribution, and the intersection
rule judged with the draft's unrestricted distribution fails both; `mlx-spec serve` with
batching on serves two clients at once through the batch engine, then a second turn on the
stored prompt cache, all with the target's own text.
"""

from __future__ import annotations

import batch_exactness
import mlx.core as mx
import pytest
from batch_exactness import check_rows_after_a_rejection
from test_cross_tokenizer import (CONTROLS, TINY_DRAFT, TINY_PROMPT, TINY_TARGET, UnrestrictedQ,
                                  byte_bpe, sentencepiece, shifted_copy, target_alone,
                                  tiny_sentencepiece, vocab_len)
from tiny import make_llama, perturbed

from mlx_spec import batch_generate
from mlx_spec.batch.cross import BatchCross
from mlx_spec.exactness import chi_square, exact_distribution
from mlx_spec.sampling import SamplingConfig

MAX_TOKENS = 48
PROMPTS = ["hello world, def the", "the", "def hello world the world in the"]
FIRST_SAMPLES = 300
LATER_SAMPLES = 300  # rows of batch_exactness's prompt (its 600 take 9 s with a drafter a row)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def pairs():
    """name -> (target tokenizer, draft tokenizer, target model, draft model)."""
    target_tok = byte_bpe()
    extra = ("<pad>", "<a>", "<b>", "<c>", "<d>")
    shifted_tok, spm_tok = byte_bpe(control=extra + CONTROLS), sentencepiece()
    target = make_llama(vocab_size=vocab_len(target_tok), seed=0)
    return {
        "shifted": (target_tok, shifted_tok, target,
                    perturbed(shifted_copy(target, len(extra)), 0.08, 1)),
        "spm-draft": (target_tok, spm_tok, target,
                      make_llama(vocab_size=vocab_len(spm_tok), seed=5, hidden=32, layers=1)),
    }


@pytest.mark.parametrize("name", ["shifted", "spm-draft"])
def test_every_row_equals_the_target_alone(pairs, name):
    target_tok, draft_tok, target_model, draft_model = pairs[name]
    prompts = [target_tok.encode(p) for p in PROMPTS]
    reference = [target_alone(target_model, p, MAX_TOKENS) for p in prompts]
    for k in (1, 3, 6):
        result = batch_generate(target_model, target_tok, prompts, draft_model=draft_model,
                                draft_tokenizer=draft_tok, max_tokens=MAX_TOKENS,
                                num_draft_tokens=k, prompt_lookup=False)
        assert result.token_ids == reference, (name, k)
        rules = result.stats["cross_rules"]  # rule -> (rounds, drafted, accepted)
        assert set(rules) == {"string", "intersection"}  # greedy "auto" tries both
        assert 0 < result.stats["vocab_overlap"] <= 1
        if name == "shifted":  # a draft that agrees often, not always: rows accept and rewind
            drafted, accepted = (sum(c[i] for c in rules.values()) for i in (1, 2))
            assert 0 < accepted < drafted, rules


def test_prompt_lookup_in_front_and_the_batch_policy(pairs):
    """Lookup first, the draft of another tokenizer for the rows it finds nothing for, k chosen
    by the batch policy: still the target's tokens."""
    target_tok, draft_tok, target_model, draft_model = pairs["shifted"]
    prompts = [target_tok.encode(p) for p in ["hello world hello world, def the hello", "the"]]
    reference = [target_alone(target_model, p, MAX_TOKENS) for p in prompts]
    result = batch_generate(target_model, target_tok, prompts, draft_model=draft_model,
                            draft_tokenizer=draft_tok, max_tokens=MAX_TOKENS, prompt_lookup=True)
    assert result.token_ids == reference


def test_forced_trees_beside_a_draft_of_another_tokenizer(pairs):
    """`tree=(3, 2)` with a draft of another tokenizer, as a call takes it: prompt lookup
    proposes tries of the earlier text, the row's own drafter its chains, both in one round's
    tree pass beside each other: still the target's tokens, row for row."""
    target_tok, draft_tok, target_model, draft_model = pairs["shifted"]
    prompts = [target_tok.encode(p) for p in ["hello world hello world, def hello world the",
                                              "the", "def the def the def"]]
    reference = [target_alone(target_model, p, MAX_TOKENS) for p in prompts]
    result = batch_generate(target_model, target_tok, prompts, draft_model=draft_model,
                            draft_tokenizer=draft_tok, max_tokens=MAX_TOKENS, prompt_lookup=True,
                            num_draft_tokens=3, tree=(3, 2))
    assert result.token_ids == reference
    assert result.stats["tree_rounds"] > 0  # rounds where some row proposed a trie
    assert set(result.stats["cross_rules"])  # ... and rows that drafted across tokenizers


def test_a_draft_without_its_tokenizer_is_one_sentence(pairs):
    target_tok, draft_tok, target_model, draft_model = pairs["spm-draft"]  # 289 > 275 tokens
    with pytest.raises(ValueError, match="pass the draft's tokenizer as draft_tokenizer="):
        batch_generate(target_model, target_tok, ["hello"], draft_model=draft_model,
                       max_tokens=4)


# --- exactness at T = 1 ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    """test_cross_tokenizer's SentencePiece vocabularies of 8 and 9 tokens, small enough to
    enumerate the target's distribution of tokens 3 and 4."""
    target_tok, draft_tok = tiny_sentencepiece(TINY_TARGET), tiny_sentencepiece(TINY_DRAFT)
    return (target_tok, draft_tok, make_llama(vocab_size=vocab_len(target_tok), seed=0),
            make_llama(vocab_size=vocab_len(draft_tok), seed=7, hidden=32, layers=1))


def use_the_broken_rule(monkeypatch):
    """Every row's drafter the negative control: the intersection rule with the draft's
    unrestricted distribution as q (test_cross_tokenizer's)."""
    monkeypatch.setattr(BatchCross, "drafter_class", UnrestrictedQ)
    monkeypatch.setattr(BatchCross, "rule", "intersection")


@pytest.mark.parametrize("rule,exact", [(None, True), ("string", True), (None, False)],
                         ids=["auto", "string", "negative-control"])
def test_first_two_tokens_of_batched_rows(tiny_pair, monkeypatch, rule, exact):
    """FIRST_SAMPLES rows of one prompt in batches of 32 at T = 1, k = 2: tokens 1 and 2 (a
    row lives a round or two: "auto" keeps to its opening rule, the intersection)."""
    monkeypatch.setattr(BatchCross, "rule", rule)
    if not exact:
        use_the_broken_rule(monkeypatch)
    target_tok, draft_tok, target_model, draft_model = tiny_pair
    mx.random.seed(1)
    result = batch_generate(target_model, target_tok, [TINY_PROMPT] * FIRST_SAMPLES,
                            draft_model=draft_model, draft_tokenizer=draft_tok, max_tokens=2,
                            num_draft_tokens=2, temp=1.0, prompt_lookup=False,
                            max_batch_size=32)
    counts = {}
    for tokens in result.token_ids:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    drafted, accepted = (sum(c[i] for c in result.stats["cross_rules"].values())
                         for i in (1, 2))
    assert 0 < accepted < drafted, result.stats["cross_rules"]
    statistic, dof, p_value = chi_square(counts, exact_distribution(
        target_model, TINY_PROMPT, SamplingConfig(temp=1.0)))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "negative-control"])
def test_tokens_after_a_rejection_in_a_refilled_batch(tiny_pair, monkeypatch, exact):
    """LATER_SAMPLES rows' tokens 3 and 4 at T = 1, k = 2, beside rows of other prompts coming
    and going (batch_exactness); most rows rewound a rejected draft before token 3."""
    if not exact:
        use_the_broken_rule(monkeypatch)
    monkeypatch.setattr(batch_exactness, "SAMPLES", LATER_SAMPLES)
    target_tok, draft_tok, target_model, draft_model = tiny_pair
    check_rows_after_a_rejection(target_model, draft_model, True, exact, LATER_SAMPLES // 2,
                                 tokenizer=target_tok, draft_tokenizer=draft_tok)


# --- the batched server ------------------------------------------------------------------


def test_the_batched_server_drafts_across_tokenizers(model_dirs):
    """Two clients at once, both rows in the batch engine with the foreign draft, then a second
    turn that reuses the stored prompt cache (the target's layers and the draft's): every
    answer is the target's own text."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server_drafts import complete, serve
    from workers import batched_worker

    from mlx_spec import generate, load, stream_generate
    from mlx_spec.batch import BatchEngine
    from mlx_spec.server.cache_store import PromptCacheStore
    from mlx_spec.server.worker import SpeculationOptions, can_batch

    target, tokenizer = load(str(model_dirs["chat"]))
    foreign, _ = load(str(model_dirs["foreign"]))  # its own tokenizer, kept by load
    assert can_batch(target, foreign, tokenizer)
    firsts = [tokenizer.encode(p) for p in ("def f(x):\n", "class Stack:\n    def push(self, x):")]
    answer = [r.token for r in stream_generate(target, tokenizer, firsts[0], max_tokens=16)]
    second = firsts[0] + answer + tokenizer.encode("\ndef g(y):")
    expected = [generate(target, tokenizer, ids, max_tokens=16) for ids in firsts + [second]]
    worker = batched_worker(target, tokenizer, foreign, SpeculationOptions(calibration=None),
                            store=PromptCacheStore(2**28))
    assert isinstance(worker.engine, BatchEngine) and worker.engine.cross is not None
    url, stop = serve(worker)
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda ids: complete(url, ids, num_draft_tokens=3,
                                                         prompt_lookup=False), firsts))
        answers.append(complete(url, second, num_draft_tokens=3, prompt_lookup=False))
    finally:
        stop()
    assert [a["choices"][0]["text"] for a in answers] == expected
    assert answers[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > len(firsts[0])
    for a in answers:
        spec = a["speculation"]
        assert spec["drafted"] > 0 and 0 < spec["vocab_overlap"] < 1 and spec["cross_rules"]


def test_a_sliding_window_draft_s_kept_cache_is_taken_back(pairs):
    """A draft of another tokenizer with sliding-window layers (a Gemma-3 draft): a row's
    kept cache (target layers, then the drafter's own, its windows made rewindable) is taken
    back by the next row that reuses it, whose text equals the target alone's."""
    from families import make_family
    from mlx_spec.batch import BatchEngine, RowRequest

    target_tok, spm_tok, target_model, _ = pairs["spm-draft"]
    draft = make_family("gemma3_text", seed=5, vocab_size=vocab_len(spm_tok), window=4)
    engine = BatchEngine(target_model, draft, num_draft_tokens=3, tokenizer=target_tok,
                         draft_tokenizer=spm_tok)
    first = target_tok.encode(PROMPTS[2])
    uid = engine.insert(RowRequest(first, 12, keep_cache=True, prompt_lookup=False))
    tokens, cache = [], None
    while engine.busy:
        for o in engine.step():
            tokens += o.tokens
            cache = o.cache if o.finish_reason else cache
    assert o.uid == uid and cache is not None
    second = first + tokens + target_tok.encode(" the world")
    engine.insert(RowRequest(second, 12, prompt_lookup=False), cache=cache,
                  cached=len(first) + len(tokens))
    more = []
    while engine.busy:
        for o in engine.step():
            more += o.tokens
    assert more == target_alone(target_model, second, 12)


@pytest.mark.parametrize("seconds,drafts", [(1.0, False), (1e-6, True)],
                         ids=["costly-step", "free-step"])
def test_a_row_alone_times_its_drafts_step_before_its_first_round(pairs, monkeypatch, seconds,
                                                                  drafts):
    """As a call's policy times a draft of another tokenizer (its drafter's step_seconds), a
    row alone's knows what one draft step costs before it drafts: one said to cost a second is
    never tried, one said to cost nothing is (no calibration); the step its drafter really
    times is positive, and the text is the target's either way."""
    from mlx_spec.batch import BatchEngine, RowRequest
    from mlx_spec.batch.cross import RowCross

    target_tok, draft_tok, target_model, draft_model = pairs["shifted"]
    timed, real = [], RowCross.step_seconds
    monkeypatch.setattr(RowCross, "step_seconds",
                        lambda self, row: timed.append(real(self, row)) or seconds)
    engine = BatchEngine(target_model, draft_model, tokenizer=target_tok,
                         draft_tokenizer=draft_tok, calibration=None)
    prompt = target_tok.encode(PROMPTS[2])
    engine.insert(RowRequest(prompt, MAX_TOKENS, prompt_lookup=False))
    tokens, drafted = [], []
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
            drafted.append(out.num_drafted)
    assert (max(drafted) > 0) == drafts, drafted
    assert tokens == target_alone(target_model, prompt, MAX_TOKENS)
    assert len(timed) == 1 and timed[0] > 0
