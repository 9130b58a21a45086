"""Suffix drafting (issue 31): the index against brute force, its budget and files, and the
drafter's exactness (greedy parity, chi-square with negative controls) alone and in front
of the other drafters."""

import random
import tracemalloc

import mlx.core as mx
import pytest

from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.drafters.suffix_index import (ANCHOR, MAX_MATCH, SHORT_OCCURRENCES, SuffixIndex,
                                            load_indexes, save_indexes)
from mlx_spec.exactness import check_exactness, chi_square
from mlx_spec.generate import speculative_generate_step
from mlx_spec.policy import AdaptivePolicy
from mlx_spec.sampling import SamplingConfig

# --- the index against brute force -------------------------------------------------------


def brute_longest(sequences, context):
    """(m, [(sequence number, index just past the occurrence)]) by scanning everything: a
    match of ANCHOR tokens or more among all occurrences; a shorter one among the latest
    SHORT_OCCURRENCES occurrences of the last token (in the order they were filed)."""
    for m in range(min(MAX_MATCH, len(context)), ANCHOR - 1, -1):
        found = [(i, e) for i, s in enumerate(sequences) for e in range(m, len(s))
                 if s[e - m:e] == context[-m:]]
        if found:
            return m, found
    latest = [(i, e) for i, s in enumerate(sequences) for e in range(1, len(s))
              if s[e - 1] == context[-1]][-SHORT_OCCURRENCES:]
    best, found = 0, []
    for i, e in latest:
        s, same = sequences[i], 0
        while same < min(e, len(context), ANCHOR - 1) and s[e - 1 - same] == context[-1 - same]:
            same += 1
        if same > best:
            best, found = same, [(i, e)]
        elif same == best:
            found.append((i, e))
    return best, found


def brute_follow(sequences, found, context, own, k, min_share):
    """The most frequent continuation, token by token (ties: the latest occurrence), kept while
    at least min_share of the occurrences agree with the whole path; the context's own
    sequence (`own`) continues with the proposal past its end."""
    proposal, alive = [], list(found)

    def token_at(i, pos):
        s = sequences[i]
        if pos < len(s):
            return s[pos]
        if i == own and pos - len(s) < len(proposal):
            return proposal[pos - len(s)]
        return None

    for j in range(k):
        nexts = [token_at(i, e + j) for i, e in alive]
        counts = {}
        for t in nexts:
            if t is not None:
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best = max(counts.values())
        latest = max(n for n, t in enumerate(nexts) if t is not None and counts[t] == best)
        token = nexts[latest]
        if best < min_share * len(found):
            break
        proposal.append(token)
        alive = [a for a, t in zip(alive, nexts) if t == token]
    return proposal


def positions(match):
    """The match's occurrences as (sequence number, end): ids count the sequences added."""
    return [(p >> 32, p & 0xFFFFFFFF) for p in match.positions]


@pytest.mark.parametrize("seed", range(12))
def test_longest_match_and_continuation_equal_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 8])
    # Repetition of several kinds: random text, copies with edits, loops.
    base = [rng.randrange(vocab) for _ in range(30)]
    sequences = []
    for _ in range(rng.randrange(2, 6)):
        kind = rng.random()
        if kind < 0.4:
            s = [rng.randrange(vocab) for _ in range(rng.randrange(1, 50))]
        elif kind < 0.8:
            s = [t if rng.random() > 0.1 else rng.randrange(vocab) for t in base]
        else:
            period = base[:rng.randrange(1, 6)]
            s = (period * 20)[:rng.randrange(5, 60)]
        sequences.append(s)
    index = SuffixIndex()
    for s in sequences:
        index.add(s)
    for _ in range(25):
        context = rng.choice(sequences)[: rng.randrange(1, 40)] + \
            [rng.randrange(vocab) for _ in range(rng.randrange(0, 3))]
        m, found = brute_longest(sequences, context)
        match = index.longest(context)
        assert match.length == m, (context, sequences)
        assert sorted(positions(match)) == sorted(found)
        for k, share in ((1, 0.1), (6, 0.1), (20, 0.1), (12, 0.5), (12, 0.0)):
            assert index.follow(match, context, k, share) == \
                brute_follow(sequences, found, context, None, k, share), (context, k, share)


@pytest.mark.parametrize("seed", range(6))
def test_a_live_context_continues_with_its_period_as_brute_force_does(seed):
    """The context is a sequence of the index itself (a request's history): an occurrence
    running into its end continues with the proposal (a loop repeats)."""
    rng = random.Random(100 + seed)
    vocab = 4
    earlier = [rng.randrange(vocab) for _ in range(40)]
    history = [rng.randrange(vocab) for _ in range(8)]
    history = history + history[:5] + history  # a loop, and a copy
    index = SuffixIndex()
    index.add(earlier)
    index.add(history, live=True)
    for grow in range(6):
        m, found = brute_longest([earlier, history], history)
        match = index.longest(history)
        assert match.length == m
        assert sorted(positions(match)) == sorted(found)
        for k in (1, 5, 30):
            assert index.follow(match, history, k) == \
                brute_follow([earlier, history], found, history, 1, k, 0.1)
        history.append(rng.randrange(vocab))  # the live list grows; the index reads it


def test_lookups_find_long_matches_through_the_anchor():
    rng = random.Random(0)
    text = [rng.randrange(1000) for _ in range(500)]
    index = SuffixIndex()
    index.add(text)
    context = [999, 998] + text[100:180]
    match = index.longest(context)
    assert match.length == MAX_MATCH and len(match.positions) == 1
    assert index.follow(match, context, 10) == text[180:190]
    assert index.longest([5000]).length == 0  # never seen
    assert ANCHOR <= MAX_MATCH


# --- the budget ---------------------------------------------------------------------------


def held_positions(index):
    return [p for table in (index._short, index._long) for ps in table.values() for p in ps]  # noqa: SLF001


def test_eviction_keeps_the_budget_and_forgets_evicted_positions():
    rng = random.Random(1)
    index = SuffixIndex(max_tokens=1000)
    for _ in range(100):
        index.add([rng.randrange(50) for _ in range(50)])
    assert len(index) <= 1000 and index.num_sequences == 20
    live = set(index._sequences)  # noqa: SLF001
    assert all(p >> 32 in live for p in held_positions(index))


def test_memory_stays_bounded_when_ten_times_the_budget_passes_through():
    rng = random.Random(2)

    def fill(n_sequences):
        tracemalloc.start()
        index = SuffixIndex(max_tokens=20_000)
        for _ in range(n_sequences):
            index.add([rng.randrange(5000) for _ in range(200)])
        size, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return index, size

    small, one = fill(100)  # the budget, once
    big, ten = fill(1000)  # ten times through it
    assert len(small) == len(big) == 20_000
    assert ten < 1.5 * one, (one, ten)


def test_least_recently_used_goes_first_and_live_sequences_stay():
    index = SuffixIndex(max_tokens=30)
    first = index.add(list(range(100, 110)))
    index.add(list(range(200, 210)))
    index.follow(index.longest([103, 104, 105]), [103, 104, 105], 3)  # drafts from the first
    history = list(range(300, 340))  # longer than the whole budget
    own = index.add(history, live=True)
    assert own in index._sequences  # noqa: SLF001 (never evicted while live)
    assert first not in index._sequences  # noqa: SLF001
    index.add(list(range(400, 405)))
    index.release(own)
    assert own not in index._sequences and len(index) <= 30  # noqa: SLF001


def test_a_released_sequence_is_the_callers_list_no_more():
    history = [1, 2, 3, 1, 2]
    index = SuffixIndex()
    own = index.add(history, live=True)
    index.release(own)
    history.append(99)
    assert index.sequences() == [[1, 2, 3, 1, 2]]


def test_a_live_list_that_lost_its_last_token_leaves_nothing_behind_when_evicted():
    """The loop drops the target's own token after a round filled by drafts: the index must
    neither propose past the shorter list nor keep its filed position after eviction."""
    history = [1, 2, 3, 4, 5, 6, 7, 8]
    index = SuffixIndex(max_tokens=10)
    own = index.add(history, live=True)
    assert index.longest([6, 7]).length == 2  # files positions up to the last token
    history.pop()
    assert index.follow(index.longest([5, 6, 7]), [5, 6, 7], 4) == []  # 8 is gone
    index.release(own)
    index.add(list(range(20, 30)))  # over the budget: the released sequence goes
    assert all(p >> 32 != own for p in held_positions(index))


# --- files --------------------------------------------------------------------------------


def test_files_round_trip(tmp_path):
    index = SuffixIndex(max_tokens=500, vocab_size=64)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 8, 9])
    path = tmp_path / "suffix.npz"
    index.save(path)
    back = SuffixIndex.load(path)
    assert back.sequences() == index.sequences()
    assert (back.max_tokens, back.vocab_size) == (500, 64)
    assert back.longest([1, 2, 3, 4]).length == 4
    save_indexes(path, {"a": index, "b": SuffixIndex()})
    assert sorted(load_indexes(path)) == ["a", "b"]
    with pytest.raises(ValueError, match="partitioned"):
        SuffixIndex.load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-npz", "version", "missing",
                                    "vocab"])
def test_a_damaged_file_is_refused_in_one_sentence(tmp_path, damage):
    import numpy as np

    path = tmp_path / "suffix.npz"
    index = SuffixIndex(vocab_size=10)
    index.add([1, 2, 3])
    index.save(path)
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:60])
    elif damage == "other-npz":
        with open(path, "wb") as f:
            np.savez(f, weights=np.zeros(3))
    elif damage == "version":
        data = dict(np.load(path))
        data["version"] = np.array(99)
        with open(path, "wb") as f:
            np.savez(f, **data)
    elif damage == "missing":
        path = tmp_path / "nothing-here.npz"
    elif damage == "vocab":
        data = dict(np.load(path))
        data["tokens"] = np.array([1, 2, 30])  # beyond the recorded vocabulary of 10
        with open(path, "wb") as f:
            np.savez(f, **data)
    with pytest.raises(ValueError) as info:
        SuffixIndex.load(path)
    message = str(info.value)
    assert str(path) in message and message.count(". ") == 0 and "\n" not in message


# --- greedy parity --------------------------------------------------------------------------


def tokens_of(prompt, target_model, draft_model=None, **kwargs):
    out = []
    for round_ in speculative_generate_step(prompt, target_model, draft_model, **kwargs):
        out += round_.tokens
    return out[: kwargs["max_tokens"]]


PROMPT = [1, 2, 3, 4, 5]
LONG_PROMPT = [(7 * i) % 61 + 2 for i in range(600)]


@pytest.fixture(scope="module")
def reference(target_model):
    return {name: tokens_of(p, target_model, max_tokens=40)
            for name, p in (("short", PROMPT), ("long", LONG_PROMPT))}


def seeded_index(kind, prompt, answer):
    """An index holding: the answer itself (perfect drafts), the answer with edits, or junk."""
    rng = random.Random(3)
    index = SuffixIndex()
    if kind == "perfect":
        index.add(prompt + answer)
    elif kind == "edited":
        index.add(prompt + [t if rng.random() > 0.15 else rng.randrange(64) for t in answer])
        index.add(prompt[-3:] + answer[5:20])
    elif kind == "junk":
        for _ in range(5):
            index.add(prompt[-2:] + [rng.randrange(64) for _ in range(30)])
    return index


@pytest.mark.parametrize("prompt_name", ["short", "long"])
@pytest.mark.parametrize("kind", ["perfect", "edited", "junk", "empty"])
@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_suffix_greedy_parity(target_model, reference, prompt_name, kind, k):
    prompt = PROMPT if prompt_name == "short" else LONG_PROMPT
    index = seeded_index(kind, prompt, reference[prompt_name])
    got = tokens_of(prompt, target_model, max_tokens=40, num_draft_tokens=k, suffix=index)
    assert got == reference[prompt_name]


@pytest.mark.parametrize("kind", ["perfect", "edited", "junk"])
@pytest.mark.parametrize("draft_name", ["related", "unrelated"])
@pytest.mark.parametrize("lookup", [None, True])
def test_suffix_in_front_of_a_draft_model_keeps_parity(target_model, drafts, reference, kind,
                                                       draft_name, lookup):
    index = seeded_index(kind, PROMPT, reference["short"])
    got = tokens_of(PROMPT, target_model, drafts[draft_name], max_tokens=40, suffix=index,
                    prompt_lookup=lookup)
    assert got == reference["short"]


def test_calls_sharing_an_index_keep_parity_and_the_second_drafts_from_the_first(
        target_model, reference):
    index = SuffixIndex()
    sources = []
    for _ in range(3):
        out, accepted = [], {}
        for round_ in speculative_generate_step(PROMPT, target_model, max_tokens=40,
                                                suffix=index, num_draft_tokens=8):  # (not timed)
            out += round_.tokens
            accepted[round_.source] = accepted.get(round_.source, 0) + round_.num_accepted
        assert out[:40] == reference["short"]
        sources.append(accepted.get("suffix", 0))
    assert sources[1] >= 30 and sources[2] >= 30, sources  # the earlier answers are drafted


def test_a_repeated_answer_is_drafted_by_suffix_and_not_by_prompt_lookup(target_model,
                                                                          reference):
    """The issue's test: the answer repeats an earlier request's answer, not in its own prompt."""
    index = SuffixIndex()
    tokens_of(PROMPT, target_model, max_tokens=40, suffix=index)  # the earlier request

    def accepted_by(**kwargs):
        total, drafted = 0, 0
        for round_ in speculative_generate_step(PROMPT, target_model, max_tokens=40,
                                                num_draft_tokens=8, **kwargs):  # (not timed)
            total += round_.num_accepted
            drafted += round_.num_drafted
        return total, drafted

    suffix_accepted, suffix_drafted = accepted_by(suffix=index)
    lookup_accepted, _ = accepted_by(prompt_lookup=True)
    assert suffix_accepted >= 0.75 * 40 and suffix_accepted >= 0.9 * suffix_drafted
    assert lookup_accepted <= 0.15 * 40, lookup_accepted


def test_suffix_with_a_reused_prompt_cache_gives_mlx_lms_turns(model_dirs):
    """Multi-turn on a reused cache (mlx-lm's pattern): every turn's tokens are mlx-lm's, while
    suffix drafting proposes from the index, which ends up holding every turn's text."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_spec import load, stream_generate

    model, tokenizer = load(str(model_dirs["target"]))
    turns = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]
    expected, ours, drafted = [], [], 0
    mlx_cache, our_cache, index = make_prompt_cache(model), make_prompt_cache(model), SuffixIndex()
    for ids in turns:
        expected.append([r.token for r in mlx_lm.stream_generate(
            model, tokenizer, ids, max_tokens=16, prompt_cache=mlx_cache)])
        responses = list(stream_generate(model, tokenizer, ids, max_tokens=16,
                                         prompt_cache=our_cache, suffix=index))
        ours.append([r.token for r in responses])
        drafted += responses[-1].stats.drafted
    assert ours == expected
    assert drafted > 0
    assert sorted(index.sequences()) == sorted(ids + out for ids, out in zip(turns, ours))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text"])
def test_suffix_lookup_and_a_draft_model_on_hybrid_and_sliding_window_targets(family):
    """Suffix drafting in front of prompt lookup and a draft model, on a Gated-DeltaNet hybrid
    and on a sliding-window target, gives mlx-lm's own greedy tokens."""
    from families import make_family, plain_greedy

    target = make_family(family, seed=0)
    draft = make_family(family, seed=1)
    prompt = [3, 9, 4, 1, 5, 9, 2, 6] * 2
    expected = plain_greedy(target, prompt, 30)
    index = SuffixIndex()
    index.add(prompt + expected[:12] + [0, 0] + expected[14:])  # right, with two edits
    for k in (2, None):
        got = tokens_of(prompt, target, draft, max_tokens=30, num_draft_tokens=k,
                        suffix=index, prompt_lookup=True)
        assert got == expected, (family, k)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_suffix_and_lookup_in_front_of_a_dflash_drafter_keep_parity(tmp_path, family):
    """Suffix drafting, then prompt lookup, then a DFlash block drafter (on a hybrid target
    too): mlx-lm's greedy tokens, and both the index and the block drafter propose."""
    from dflash_tiny import make_dflash
    from families import make_family, plain_greedy
    from tiny import make_llama

    if family == "llama":
        target, hidden = make_llama(layers=4, seed=2), 48
    else:
        target, hidden = make_family(family, seed=2), 32
    drafter = make_dflash(tmp_path / "d", hidden, [0, 2], block_size=6, seed=5)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    expected = plain_greedy(target, prompt, 60)
    index = SuffixIndex()
    index.add(prompt + expected[:30])  # an earlier request that stopped halfway
    rounds = list(speculative_generate_step(prompt, target, drafter, max_tokens=60,
                                            suffix=index, prompt_lookup=True,
                                            calibration=None))
    assert [t for r in rounds for t in r.tokens][:60] == expected
    assert {"suffix", "dflash"} <= {r.source for r in rounds}


# --- exactness at T > 0 -----------------------------------------------------------------------

# 500 samples: the broken rule's chi-square has noncentrality ~258 on 13 dof here (from a
# 2,000-sample run): missed with probability ~1e-27; the exact rule fails falsely with
# probability ALPHA whatever the count.
SAMPLES = 500
ALPHA = 1e-3
REPEATING_PROMPT = [3, 1, 4, 7, 29, 3, 1, 4]


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)],
                         ids=["exact-rule", "negative-control"])
def test_suffix_sampling_matches_target(target_model, accept, exact):
    """Each sample drafts from the prompt and every earlier sample's text (a point-mass q);
    the first two tokens keep the target's distribution. Resampling from p must fail."""
    result = check_exactness(target_model, None, REPEATING_PROMPT, SamplingConfig(temp=1.0),
                             samples=SAMPLES, num_draft_tokens=3, alpha=ALPHA, seed=5,
                             suffix=SuffixIndex(), accept=accept)
    assert result.drafted >= SAMPLES, result
    assert 0.1 < result.acceptance_rate < 0.9, result
    assert result.passed == exact, result


SMALL_VOCAB = 8
MID_SAMPLES = 800


@pytest.mark.parametrize("accept,exact", [(None, True), (resample_from_target_accept, False)],
                         ids=["exact-rule", "negative-control"])
def test_tokens_after_a_rejected_suffix_draft_match_target(accept, exact):
    """(t3, t4) at T = 1 after a first round whose suffix draft was rejected: the target's
    exact distribution (enumerated over every t1 t2), or not with the broken rule."""
    from test_exactness import exact_third_and_fourth
    from tiny import make_llama

    target = make_llama(vocab_size=SMALL_VOCAB, seed=0)
    prompt = [3, 1, 4, 1, 5, 3, 1, 4]
    sampling = SamplingConfig(temp=1.0)
    index = SuffixIndex()
    mx.random.seed(0)
    counts, rewound, drafted, accepted = {}, 0, 0, 0
    for _ in range(MID_SAMPLES):
        out, early = [], False
        for round_ in speculative_generate_step(prompt, target, max_tokens=4,
                                                num_draft_tokens=2, sampling=sampling,
                                                suffix=index, accept=accept, calibration=None):
            early |= round_.num_accepted < round_.num_drafted and len(out) + len(round_.tokens) < 3
            drafted += round_.num_drafted
            accepted += round_.num_accepted
            out += round_.tokens
        rewound += early
        counts[(out[2], out[3])] = counts.get((out[2], out[3]), 0) + 1
    assert rewound > MID_SAMPLES // 3, rewound
    assert 0 < accepted < drafted, (accepted, drafted)
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(target, prompt, sampling))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)


# --- how it composes, and bad input ---------------------------------------------------------------


def test_the_policy_gives_suffix_lookups_caps():
    policy = AdaptivePolicy(max_draft_tokens=8, max_lookup_tokens=32)
    assert policy.source("suffix").k_max == 32 and policy.source("draft").k_max == 8


def test_suffix_true_uses_the_process_index(target_model):
    from mlx_spec import default_suffix_index

    before = default_suffix_index().num_sequences
    tokens_of([9, 9, 8], target_model, max_tokens=5, suffix=True)
    assert default_suffix_index().num_sequences == before + 1


@pytest.mark.parametrize("value,message", [("yes", "suffix must be"), (3, "suffix must be")])
def test_bad_suffix_arguments_are_one_sentence(target_model, value, message):
    with pytest.raises(ValueError, match=message):
        tokens_of(PROMPT, target_model, max_tokens=3, suffix=value)


def test_an_index_of_another_vocabulary_is_refused(target_model):
    with pytest.raises(ValueError, match="vocabulary of 1000"):
        tokens_of(PROMPT, target_model, max_tokens=3, suffix=SuffixIndex(vocab_size=1000))


@pytest.mark.parametrize("budget", [0, -5, 2.5, True])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(ValueError, match="max_tokens of a suffix index"):
        SuffixIndex(max_tokens=budget)


def test_cli_generate_suffix_file_round_trip_and_corrupt_file(tmp_path, model_dirs):
    from click.testing import CliRunner

    from mlx_spec.cli import main

    path = tmp_path / "index.npz"
    args = ["generate", "-m", str(model_dirs["target"]), "--no-draft", "-n", "12",
            "--ignore-chat-template", "-p", "hello world", "--suffix-file", str(path)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert SuffixIndex.load(path).num_sequences == 1
    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0 and "suffix" in second.output  # drafted from the first run
    assert SuffixIndex.load(path).num_sequences == 2
    path.write_bytes(b"garbage")
    bad = CliRunner().invoke(main, args)
    assert bad.exit_code != 0 and "is not a suffix index" in bad.output
    assert "Traceback" not in bad.output
