"""Drafting across tokenizers: a draft whose vocabulary differs from the target's.

Tiny pairs with deliberately different tokenizers, built here from vocabulary lists
(mlx_spec.gguf.tokenizer reads them as a GGUF file's metadata): byte-level BPEs with
different merges, the same vocabulary in a shifted id space, a SentencePiece beside a
byte-level BPE, and SentencePiece vocabularies of 8 and 9 tokens, small enough for exact
enumeration. The models are tiny random llamas (tests/tiny.py); the "copy" draft is the
target itself with its rows moved to the shifted ids, so it agrees with the target where the
two readings of the text do.

Greedy output equals the target's own over 100+ tokens for several k, each rule; at T = 1
the first two tokens, and tokens 3 and 4 after a mid-generation rejection, pass a
chi-square against the target's exact distribution for each rule, and a broken variant of
each rule (the draft's unrestricted distribution as the intersection's q; the draft's
distributions in place of the string rule's one-hot q) fails the same test.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf_files import byte_level_tokens, sentencepiece_tokens
from mlx_lm.models import llama
from tiny import make_llama

from mlx_spec.cache import ModelCache, make_cache
from mlx_spec.drafters.cross_text import DraftText, target_continuation
from mlx_spec.drafters.cross_tokenizer import CrossTokenizerDrafter
from mlx_spec.drafters.vocab_bridge import (encode_bytes, joined, make_bridge,
                                            vocabularies_differ)
from mlx_spec.gguf.tokenizer import load_tokenizer
from mlx_spec.loop import generate_rounds
from mlx_spec.policy import FixedPolicy
from mlx_spec.sampling import SamplingConfig

NORMAL, UNKNOWN = 1, 2  # GGUF's token types
CONTROLS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TARGET_MERGES = ["h e", "l l", "ll o", "he llo", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld",
                 "Ġ t", "Ġt he", "e f", "Ġ d", "Ġd ef", "i n", "Ġ f"]
DRAFT_MERGES = ["e l", "l o", "Ġ h", "Ġh el", "w o", "r l", "wo rl", "t h", "th e", "Ġ the",
                "d e", "de f", "Ġ i", "Ġi n", "o r", "Ġ Ġ"]
SPM_PIECES = ["▁t", "he", "▁the", "ll", "▁he", "llo", "▁hello", "hello", "or", "▁w", "▁wor",
              "ld", "▁world", "▁▁", "ab", "bc", "▁", "a", "b", "c", "d", "e", "h", "l", "o", "r",
              "t", "w", "1", "2"]


def byte_bpe(merges=TARGET_MERGES, control=CONTROLS, **fields):
    tokens, types = byte_level_tokens(merges, control=control)
    return load_tokenizer({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": control.index("<|im_end|>"), **fields})


def sentencepiece(pieces=SPM_PIECES, space_prefix=False, control=("<s>", "</s>")):
    tokens, types, scores = sentencepiece_tokens(pieces, control=control)
    return load_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_space_prefix": space_prefix})


def tiny_sentencepiece(pieces):
    """A SentencePiece vocabulary with no byte pieces: <unk>, then `pieces` best-first."""
    tokens = ["<unk>", *pieces]
    return load_tokenizer({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [UNKNOWN] + [NORMAL] * len(pieces),
        "tokenizer.ggml.scores": [0.0] + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_space_prefix": False})


def vocab_len(tokenizer) -> int:
    return len(tokenizer._tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True))


def shifted_copy(target_model, shift: int):
    """The target with every row moved `shift` ids up (rows below: random): what it says
    about target id i, the copy says about id i + shift."""
    args = dict(vars(target_model.args))
    args["vocab_size"] = target_model.args.vocab_size + shift
    copy = llama.Model(llama.ModelArgs(**args))
    copy.update(target_model.parameters())
    inner = copy.model
    embed = target_model.model.embed_tokens.weight
    head = target_model.lm_head.weight
    inner.embed_tokens.weight = mx.concatenate([mx.random.normal((shift, embed.shape[1])), embed])
    copy.lm_head.weight = mx.concatenate([mx.random.normal((shift, head.shape[1])) * 0.1, head])
    mx.eval(copy.parameters())
    return copy


# --- the two vocabularies and the text between them ----------------------------------------


def test_vocabularies_differ_by_contents_not_name():
    assert not vocabularies_differ(byte_bpe(), byte_bpe())
    assert vocabularies_differ(byte_bpe(), byte_bpe(DRAFT_MERGES))  # other merges, other pieces
    assert vocabularies_differ(byte_bpe(), byte_bpe(control=("<pad>",) + CONTROLS))  # shifted
    assert vocabularies_differ(byte_bpe(), sentencepiece())


def test_twins_are_tokens_of_the_same_bytes():
    target, draft = byte_bpe(), sentencepiece()
    bridge = make_bridge(target, draft)

    def twin(piece):
        return int(bridge.target_to_draft[target.convert_tokens_to_ids(piece)])

    assert twin("Ġthe") == draft.convert_tokens_to_ids("▁the")
    assert twin("hello") == draft.convert_tokens_to_ids("hello")
    assert twin("Ġwor") == draft.convert_tokens_to_ids("▁wor")
    # a byte has a normal piece and a <0xXX> piece in SentencePiece: the normal one is its twin
    assert twin("a") == draft.convert_tokens_to_ids("a")
    assert twin("Ã") == draft.convert_tokens_to_ids("<0xC3>")  # (no normal piece for it)
    assert twin("<|im_end|>") == -1  # special tokens pair only with a special of that string
    assert twin("Ġworld") == draft.convert_tokens_to_ids("▁world")
    assert 0 < bridge.overlap < 1 and bridge.shared == int((bridge.draft_to_target >= 0).sum())


@pytest.mark.parametrize("space_prefix", [False, True])
def test_encode_bytes_spells_exactly_the_bytes(space_prefix):
    """No SentencePiece space prefix in front, bytes that are not UTF-8 as byte pieces."""
    vocab = make_bridge(sentencepiece(space_prefix=space_prefix), byte_bpe()).target
    assert vocab.prefix == (b" " if space_prefix else b"")
    for data in [b"the world", b" the world", b"hello", b"ab\xffcd", b"  he"]:
        ids, exact = encode_bytes(vocab, data)
        assert exact and joined(vocab, ids) == data, data


def draft_bytes(bridge, ids):
    """The draft's text, its special tokens left out."""
    return b"".join(b"" if bridge.draft.special[t] else bridge.draft.pieces[t] for t in ids)


def history_bytes(bridge, ids):
    """The target's text as the draft is to read it (a special token as the draft's ids
    for it: a twin, its BOS or EOS, or the string as text)."""
    return b"".join(draft_bytes(bridge, bridge.special_for_draft(t)) if bridge.target.special[t]
                    else bridge.target.pieces[t] for t in ids)


@pytest.mark.parametrize("target,draft", [("bpe", "spm"), ("spm", "bpe"), ("bpe", "merges")])
def test_draft_text_keeps_in_step_with_any_history(target, draft):
    """Random target ids (byte pieces that split characters, bytes that are not UTF-8,
    special tokens) read into the draft's vocabulary one token at a time: the draft's text
    is always the history's, up to a character the history has only begun."""
    makers = {"bpe": byte_bpe, "spm": sentencepiece, "merges": lambda: byte_bpe(DRAFT_MERGES)}
    bridge = make_bridge(makers[target](), makers[draft]())
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(0, bridge.target.size, 400)]
    text = DraftText(bridge)
    for n in range(1, len(history) + 1):
        ids = text.update(history[:n])
        assert draft_bytes(bridge, ids) == history_bytes(bridge, history[:text.covered])
        held = history_bytes(bridge, history[text.covered:n])
        assert text.covered == n or 0 < len(held) <= 4  # only a character begun waits
    assert text.covered >= len(history) - 4


def test_draft_text_waits_for_a_whole_character_and_maps_special_tokens():
    target, draft = sentencepiece(control=("<s>", "</s>", "<|im_start|>")), byte_bpe()
    bridge = make_bridge(target, draft)
    ids = target.convert_tokens_to_ids
    history = [ids("<s>"), ids("<|im_start|>"), ids("▁the"), ids("<0xE6>"), ids("<0x97>"),
               ids("<0xA5>"), ids("</s>"), ids("<s>")]
    text = DraftText(bridge)
    assert text.update(history[:3]) == [draft.convert_tokens_to_ids(p)
                                        for p in ("<|im_start|>", "Ġthe")]  # no BOS in it
    for n in (4, 5):  # "日" is three byte pieces: the draft waits for the third
        text.update(history[:n])
        assert text.covered == 3 and text.lagging(history[:n])
    got = text.update(history[:6])
    assert text.covered == 6 and draft.decode(got) == "<|im_start|> the日"
    got = text.update(history)  # the target's EOS is the draft's EOS; the BOS again nothing
    assert got[-1] == draft.convert_tokens_to_ids("<|im_end|>") and text.covered == 8


def test_target_continuation_reads_the_draft_text_after_the_history():
    target, draft = byte_bpe(), byte_bpe(DRAFT_MERGES)
    bridge = make_bridge(target, draft)
    pieces = lambda tok, ids: tok.convert_ids_to_tokens(ids)  # noqa: E731
    history = target.encode("hello wor")
    # the history ends inside a word: "ld" continues it (not " world" in place of " wor")
    got = target_continuation(bridge, history, draft.encode("ld the"))
    assert pieces(target, got) == ["ld", "Ġthe"]
    got = target_continuation(bridge, target.encode("hello"), draft.encode(" world"))
    assert pieces(target, got) == ["Ġworld"]
    # text stops before a special token without a target twin, after one with one
    assert target_continuation(bridge, history, [draft.convert_tokens_to_ids("<|im_end|>")]) \
        == [target.convert_tokens_to_ids("<|im_end|>")]
    spm = sentencepiece()
    other = make_bridge(target, spm)
    drafted = spm.encode("d", add_special_tokens=False) + [spm.convert_tokens_to_ids("</s>")]
    assert pieces(target, target_continuation(other, history, drafted)) == ["d"]
    # half a character at the end is left for the next round
    half = [draft.convert_tokens_to_ids("Ġ"), draft.convert_tokens_to_ids("æ")]  # " " + 0xE6
    assert pieces(target, target_continuation(bridge, history, half)) == ["Ġ"]


# --- greedy parity -----------------------------------------------------------------------


def target_alone(target_model, prompt, max_tokens, sampling=SamplingConfig()):
    cache = ModelCache(target_model, make_cache(target_model))
    out = []
    for round_ in generate_rounds(prompt, cache, [], FixedPolicy(1), sampling=sampling,
                                  max_tokens=max_tokens):
        out += round_.tokens
    return out


def crossed(target_model, draft_model, bridge, prompt, max_tokens, k, rule,
            sampling=SamplingConfig(), drafter_class=CrossTokenizerDrafter):
    """(tokens, rounds) of speculative decoding with a cross-tokenizer draft at a fixed k."""
    from mlx_spec.loading import vocab_size

    drafter = drafter_class(draft_model, bridge, sampling, vocab_size(target_model),
                            vocab_size(draft_model), rule=rule)
    cache = ModelCache(target_model, make_cache(target_model))
    out, rounds = [], []
    for round_ in generate_rounds(prompt, cache, [drafter], FixedPolicy(k), sampling=sampling,
                                  max_tokens=max_tokens):
        out += round_.tokens
        rounds.append(round_)
    return out, rounds


@pytest.fixture(scope="module")
def pairs():
    """name -> (target tokenizer, draft tokenizer, target model, draft model)."""
    target_tok = byte_bpe()
    merges_tok = byte_bpe(DRAFT_MERGES)
    extra = ("<pad>", "<a>", "<b>", "<c>", "<d>")
    shifted_tok = byte_bpe(control=extra + CONTROLS)
    spm_tok = sentencepiece()
    target = make_llama(vocab_size=vocab_len(target_tok), seed=0)
    return {
        "merges": (target_tok, merges_tok, target,
                   make_llama(vocab_size=vocab_len(merges_tok), seed=7, hidden=32, layers=1)),
        "shifted": (target_tok, shifted_tok, target, shifted_copy(target, len(extra))),
        "spm-draft": (target_tok, spm_tok, target,
                      make_llama(vocab_size=vocab_len(spm_tok), seed=5, hidden=32, layers=1)),
        "spm-target": (spm_tok, target_tok, make_llama(vocab_size=vocab_len(spm_tok), seed=2),
                       make_llama(vocab_size=vocab_len(target_tok), seed=9, hidden=32,
                                  layers=1)),
    }


@pytest.mark.parametrize("rule", ["string", "intersection", "auto"])
@pytest.mark.parametrize("name", ["merges", "shifted", "spm-draft", "spm-target"])
def test_greedy_parity(pairs, name, rule):
    target_tok, draft_tok, target_model, draft_model = pairs[name]
    bridge = make_bridge(target_tok, draft_tok)
    prompt = target_tok.encode("hello world, def the")
    reference = target_alone(target_model, prompt, 120)
    for k in (1, 3, 6):
        out, rounds = crossed(target_model, draft_model, bridge, prompt, 120, k, rule)
        assert out == reference, (name, rule, k)
        drafted = [r for r in rounds if r.num_drafted]
        used = {r.cross_rule for r in drafted}
        assert used == ({"string", "intersection"} if rule == "auto" else {rule})  # auto tries both


# --- exactness at T = 1 ------------------------------------------------------------------
#
# Two SentencePiece vocabularies of a few pieces each, no byte pieces: the target's 8 tokens
# make the exact distribution of tokens 3 and 4 a sum over 8^3 prefixes. Each shares "a",
# "b", "▁" and <unk> with the other and has pieces of its own, so the draft's distribution
# puts real mass on tokens the target has not got (what the intersection's control ignores).

TINY_TARGET = ["a", "b", "▁", "ab", "▁a", "ba", "▁b"]
TINY_DRAFT = ["▁", "b", "a", "bb", "a▁", "aa", "b▁", "▁▁"]
TINY_PROMPT = [1, 5, 2]  # "a", "ba", "b"
# Tokens 3 and 4 at 500 samples: both controls fail at p < 1e-11, the exact runs pass (p > 0.02).
SAMPLES = 500
ALPHA = 1e-3


class UnrestrictedQ(CrossTokenizerDrafter):
    """BROKEN, the negative control: the intersection rule judged with the draft's
    unrestricted distribution (mass on tokens the target has not got is lost) as q."""

    def _intersection_q(self, logprobs, raw):
        from mlx_spec.sampling import logprobs_from_logits
        return mx.exp(logprobs_from_logits(mx.stack(raw), self.sampling))


class DraftQForText(CrossTokenizerDrafter):
    """BROKEN, the negative control: the string rule judged with the draft's own
    distributions (mapped to target ids) instead of a one-hot q."""

    def _string_q(self, proposal, logprobs):
        q = mx.exp(mx.stack(logprobs))  # (steps, V_d)
        q = mx.concatenate([q, mx.zeros((q.shape[0], 1), q.dtype)], axis=1)
        q = mx.take(q, self._q_index, axis=1)  # (steps, V_t)
        k = proposal.num_tokens
        rows = [q[min(i, q.shape[0] - 1)] for i in range(k)]
        return mx.stack(rows)


@pytest.fixture(scope="module")
def tiny_pair():
    target_tok, draft_tok = tiny_sentencepiece(TINY_TARGET), tiny_sentencepiece(TINY_DRAFT)
    return (target_tok, draft_tok, make_llama(vocab_size=vocab_len(target_tok), seed=0),
            make_llama(vocab_size=vocab_len(draft_tok), seed=7, hidden=32, layers=1))


def sample_tokens(target_model, draft_model, bridge, prompt, rule, samples, drafter_class,
                  k=2, positions=(2, 3)):
    """Counts of the tokens at `positions` over `samples` generations at T = 1; how many
    rejected a draft before the first of them; drafted and accepted."""
    sampling = SamplingConfig(temp=1.0)
    counts, rewound, drafted, accepted = {}, 0, 0, 0
    for _ in range(samples):
        out, rounds = crossed(target_model, draft_model, bridge, prompt, max(positions) + 1, k,
                              rule, sampling, drafter_class)
        before, early = 0, False
        for r in rounds:
            if r.num_accepted < r.num_drafted and before + len(r.tokens) <= positions[0]:
                early = True
            before += len(r.tokens)
        rewound += early
        drafted += sum(r.num_drafted for r in rounds)
        accepted += sum(r.num_accepted for r in rounds)
        key = tuple(out[p] for p in positions)
        counts[key] = counts.get(key, 0) + 1
    return counts, rewound, drafted, accepted


RULES = [("intersection", CrossTokenizerDrafter, True), ("intersection", UnrestrictedQ, False),
         ("string", CrossTokenizerDrafter, True), ("string", DraftQForText, False)]
RULE_IDS = ["intersection", "intersection-control", "string", "string-control"]


@pytest.mark.parametrize("rule,drafter_class,exact", RULES, ids=RULE_IDS)
def test_first_two_tokens(tiny_pair, rule, drafter_class, exact):
    """Chi-square of tokens 1 and 2 at T = 1, k = 2, from the prompt."""
    from mlx_spec.exactness import chi_square, exact_distribution

    target_tok, draft_tok, target_model, draft_model = tiny_pair
    mx.random.seed(1)
    counts, _, drafted, accepted = sample_tokens(
        target_model, draft_model, make_bridge(target_tok, draft_tok), TINY_PROMPT, rule,
        SAMPLES, drafter_class, positions=(0, 1))
    assert 0 < accepted < drafted, (accepted, drafted)
    statistic, dof, p_value = chi_square(counts, exact_distribution(
        target_model, TINY_PROMPT, SamplingConfig(temp=1.0)))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)


@pytest.mark.parametrize("rule,drafter_class,exact", RULES, ids=RULE_IDS)
def test_tokens_after_a_mid_generation_rejection(tiny_pair, rule, drafter_class, exact):
    """Chi-square of tokens 3 and 4 at T = 1, k = 2: most samples rejected a draft and
    rewound both caches (the draft's by re-reading the text) before token 3."""
    from test_exactness import exact_third_and_fourth

    from mlx_spec.exactness import chi_square

    target_tok, draft_tok, target_model, draft_model = tiny_pair
    mx.random.seed(0)
    counts, rewound, drafted, accepted = sample_tokens(
        target_model, draft_model, make_bridge(target_tok, draft_tok), TINY_PROMPT, rule,
        SAMPLES, drafter_class)
    assert 0 < accepted < drafted, (accepted, drafted)
    if exact:  # (a broken rule keeps nearly everything)
        assert rewound > SAMPLES // 3, rewound  # the rewind really is mid-generation
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(
        target_model, TINY_PROMPT, SamplingConfig(temp=1.0)))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)


# --- through the API and the command line ------------------------------------------------


def test_api_greedy_parity_and_stats(pairs):
    """stream_generate with draft_model= and draft_tokenizer=: the target's own text, and the
    stats say which rule each round used and how much of the vocabulary has a twin."""
    from mlx_spec import generate, stream_generate

    target_tok, draft_tok, target_model, draft_model = pairs["spm-draft"]
    prompt = "hello world, def the"
    alone = generate(target_model, target_tok, prompt, max_tokens=100, prompt_lookup=False)
    responses = list(stream_generate(target_model, target_tok, prompt, draft_model=draft_model,
                                     draft_tokenizer=draft_tok, max_tokens=100,
                                     num_draft_tokens=3, prompt_lookup=False))
    assert "".join(r.text for r in responses) == alone
    stats = responses[-1].stats
    assert stats.vocab_overlap == pytest.approx(make_bridge(target_tok, draft_tok).overlap)
    assert sum(r for r, _, _ in stats.cross_rules.values()) == stats.rounds > 0
    assert "Draft of another tokenizer" in stats.summary()


def test_api_lookup_in_front_and_the_adaptive_policy(pairs):
    """Prompt lookup in front of a draft of another tokenizer, the adaptive policy choosing k
    (the draft is its "draft" source): still the target's text."""
    from mlx_spec import generate

    target_tok, draft_tok, target_model, draft_model = pairs["shifted"]
    prompt = "hello world hello world, def the hello"
    alone = generate(target_model, target_tok, prompt, max_tokens=120, prompt_lookup=False)
    both = generate(target_model, target_tok, prompt, draft_model=draft_model,
                    draft_tokenizer=draft_tok, max_tokens=120, prompt_lookup=True,
                    calibration=None)
    assert both == alone


def test_a_draft_without_its_tokenizer_is_one_sentence(pairs):
    from mlx_spec import generate

    target_tok, draft_tok, target_model, draft_model = pairs["spm-draft"]  # 289 > 275 tokens
    with pytest.raises(ValueError, match="pass the draft's tokenizer as draft_tokenizer="):
        generate(target_model, target_tok, "hello", draft_model=draft_model, max_tokens=4)
    from mlx_spec.generate import speculative_generate_step
    with pytest.raises(ValueError, match="needs the target's tokenizer too"):
        speculative_generate_step([5, 6], target_model, draft_model, draft_tokenizer=draft_tok)


def test_a_kept_draft_tokenizer_alone_asks_nothing(model_dirs):
    """A draft `load` read (its tokenizer kept) beside a target whose tokenizer is unknown
    (mlx_lm.load, a sharded load): judged by sizes as before, no sentence about tokenizers."""
    import mlx_lm

    from mlx_spec import load
    from mlx_spec.generate import speculative_generate_step

    target_model = mlx_lm.load(str(model_dirs["target"]))[0]
    draft_model = load(str(model_dirs["draft"]))[0]
    rounds = list(speculative_generate_step([5, 6, 7], target_model, draft_model, max_tokens=8,
                                            num_draft_tokens=2, calibration=None))
    assert sum(len(r.tokens) for r in rounds) == 8 and all(r.cross_rule is None for r in rounds)


def test_a_pair_that_shares_too_little_warns_and_decodes_alone():
    from mlx_spec import generate

    """Only <unk> in common (1 token of the smaller vocabulary's 11, under 10%)."""
    target_tok = tiny_sentencepiece(TINY_TARGET + ["aa", "bb", "aaa", "bbb", "▁▁"])
    draft_tok = tiny_sentencepiece(["xx", "yy", "xy", "yx", "xxy", "yyx", "xyx", "yxy", "x", "y"])
    target_model = make_llama(vocab_size=vocab_len(target_tok), seed=0)
    draft_model = make_llama(vocab_size=vocab_len(draft_tok), seed=1, hidden=32, layers=1)
    alone = generate(target_model, target_tok, "ab", max_tokens=30, prompt_lookup=False)
    with pytest.warns(UserWarning, match="too few for its drafts to help, so the draft is off"):
        text = generate(target_model, target_tok, "ab", draft_model=draft_model,
                        draft_tokenizer=draft_tok, max_tokens=30, prompt_lookup=False)
    assert text == alone


def test_exactness_check_takes_a_draft_of_another_tokenizer(tiny_pair):
    from mlx_spec.exactness import check_exactness

    target_tok, draft_tok, target_model, draft_model = tiny_pair
    result = check_exactness(target_model, draft_model, TINY_PROMPT, SamplingConfig(temp=1.0),
                             samples=400, draft_tokenizer=draft_tok, target_tokenizer=target_tok)
    assert result.drafted > 0 and result.passed, result


def test_cli_generate_and_check_draft_across_tokenizers(model_dirs):
    """A draft directory with another tokenizer: `generate` prints the target's own text,
    `check` passes; both say on stderr that they draft across tokenizers."""
    from click.testing import CliRunner

    from mlx_spec.cli import main

    target, foreign = str(model_dirs["target"]), str(model_dirs["foreign"])
    runner = CliRunner()
    base = ["generate", "--model", target, "--prompt", "def fibonacci(n):", "-n", "40",
            "--ignore-chat-template", "--quiet"]
    alone = runner.invoke(main, base + ["--no-draft"])
    crossed_run = runner.invoke(main, base + ["--draft-model", foreign, "-k", "3"])
    assert alone.exit_code == 0 and crossed_run.exit_code == 0, crossed_run.output
    assert crossed_run.stdout == alone.stdout
    assert "another tokenizer than the target's: drafting across it" in crossed_run.stderr
    checked = runner.invoke(main, ["check", "--model", target, "--draft-model", foreign,
                                   "--samples", "300"])
    assert checked.exit_code == 0, checked.output


# --- the real pair: Gemma 3 270M drafted for by SmolLM2 135M -----------------------------


@pytest.mark.real_model
def test_real_pair_greedy_parity():
    """Gemma 3's 262,144-token SentencePiece vocabulary and SmolLM2's 49,152-token
    byte-level BPE: SmolLM2 drafts for Gemma, the text is Gemma's own (16 tokens)."""
    from gguf_files import real_model_path

    from mlx_spec import generate, load, stream_generate

    paths = [real_model_path(n) for n in ("gemma-3-270m-q4_k_m.gguf",
                                          "SmolLM2-135M-Instruct.Q4_1.gguf")]
    if None in paths:
        pytest.skip("the real GGUF files are not downloaded (make real-models)")
    (target_model, target_tok), (draft_model, _) = load(str(paths[0])), load(str(paths[1]))
    prompt = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"
    alone = generate(target_model, target_tok, prompt, max_tokens=16, prompt_lookup=False)
    responses = list(stream_generate(target_model, target_tok, prompt, draft_model=draft_model,
                                     max_tokens=16, num_draft_tokens=3, prompt_lookup=False))
    assert "".join(r.text for r in responses) == alone
    stats = responses[-1].stats
    assert 0.1 < stats.vocab_overlap < 0.25 and stats.rounds > 0


def test_batched_generation_drafts_with_the_tokenizer_load_kept(pairs):
    """batch_generate reads the draft's tokenizer where `load` kept it, as generate does
    (tests/test_batch_cross_tokenizer.py has the batch's own tests)."""
    from mlx_spec import batch_generate
    from mlx_spec.loading import TOKENIZER_ATTR

    target_tok, draft_tok, target_model, _ = pairs["merges"]
    draft_model = make_llama(vocab_size=vocab_len(draft_tok), seed=7, hidden=32, layers=1)
    object.__setattr__(draft_model, TOKENIZER_ATTR, draft_tok)  # as mlx_spec.load keeps it
    prompts = [target_tok.encode(p) for p in ("hello", "world")]
    result = batch_generate(target_model, target_tok, prompts, draft_model=draft_model,
                            max_tokens=8, num_draft_tokens=2, prompt_lookup=False)
    assert result.token_ids == [target_alone(target_model, p, 8) for p in prompts]
    assert result.stats["cross_rules"] and result.stats["vocab_overlap"] < 1
    object.__setattr__(draft_model, TOKENIZER_ATTR, target_tok)  # the same vocabulary: drafts
    result = batch_generate(target_model, target_tok, ["hello"], draft_model=draft_model,
                            max_tokens=4)
    assert len(result.texts) == 1 and "cross_rules" not in result.stats
