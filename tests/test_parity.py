"""Greedy parity: speculative output == the target's own greedy output, token for token."""

import pytest

from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

PROMPTS = {
    "one-token": [5],
    "short": [1, 2, 3, 4, 5],
    "longer-than-prefill-chunk": [(7 * i) % 61 + 2 for i in range(600)],
}


def tokens_of(prompt, target_model, draft_model=None, **kwargs):
    out = []
    for round_ in speculative_generate_step(prompt, target_model, draft_model, **kwargs):
        out += round_.tokens
    return out[: kwargs["max_tokens"]]


@pytest.fixture(scope="module")
def reference(target_model):
    """Target-only greedy decoding, computed once per prompt and length."""
    cache = {}

    def get(prompt_name, max_tokens):
        key = (prompt_name, max_tokens)
        if key not in cache:
            cache[key] = tokens_of(PROMPTS[prompt_name], target_model, max_tokens=max_tokens)
        return cache[key]

    return get


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("max_tokens", [1, 37])
@pytest.mark.parametrize("draft_name", ["identical", "related", "unrelated"])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_draft_model_greedy_parity(target_model, drafts, reference, prompt_name,
                                   max_tokens, draft_name, k):
    got = tokens_of(PROMPTS[prompt_name], target_model, drafts[draft_name],
                    max_tokens=max_tokens, num_draft_tokens=k, prefill_step_size=256,
                    prompt_lookup=False)
    assert got == reference(prompt_name, max_tokens)


@pytest.mark.parametrize("prompt_name", ["short", "longer-than-prefill-chunk"])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("with_draft", [False, True])
def test_prompt_lookup_greedy_parity(target_model, drafts, reference, prompt_name, k,
                                     with_draft):
    draft = drafts["related"] if with_draft else None
    got = tokens_of(PROMPTS[prompt_name], target_model, draft, max_tokens=37,
                    num_draft_tokens=k, prompt_lookup=True)
    assert got == reference(prompt_name, 37)


def test_prompt_lookup_is_on_by_default_except_in_front_of_a_draft_when_sampling(target_model,
                                                                                 drafts):
    prompt = [1, 2, 3, 4, 5] * 6  # the context ends in a repeated 2-gram
    sampled = {"sampling": SamplingConfig(temp=1.0)}

    def sources(draft, **kwargs):
        return {r.source for r in speculative_generate_step(  # k pinned: whether lookup is
            prompt, target_model, draft, max_tokens=30, num_draft_tokens=2, **kwargs)}  # wired

    assert "lookup" in sources(drafts["related"])
    assert "lookup" in sources(None)  # no draft: lookup alone, greedy
    assert "lookup" in sources(None, **sampled)  # and sampling
    assert "lookup" not in sources(drafts["related"], prompt_lookup=False)
    assert "lookup" not in sources(None, prompt_lookup=False)  # the target alone
    assert "lookup" not in sources(drafts["related"], **sampled)  # the draft's q comes first
    assert "lookup" in sources(drafts["related"], prompt_lookup=True, **sampled)


def test_acceptance_tracks_draft_quality(target_model, drafts):
    """The identical draft is always accepted; worse drafts less often."""
    rates = {}
    for name, draft in drafts.items():
        rounds = list(speculative_generate_step([1, 2, 3], target_model, draft,
                                                max_tokens=60, num_draft_tokens=4,
                                                prompt_lookup=False))
        drafted = sum(r.num_drafted for r in rounds)
        rates[name] = sum(r.num_accepted for r in rounds) / drafted
    assert rates["identical"] == 1.0
    assert rates["identical"] > rates["related"] > rates["unrelated"]


def test_target_cache_holds_history_minus_last(target_model, drafts):
    """After every round the target cache holds exactly the accepted prefix."""
    from mlx_spec.cache import make_cache

    prompt = [1, 2, 3, 4]
    target_cache = make_cache(target_model)
    seen = len(prompt)
    for round_ in speculative_generate_step(prompt, target_model, drafts["related"],
                                            max_tokens=30, num_draft_tokens=4,
                                            prompt_cache=target_cache + make_cache(drafts["related"])):
        seen += len(round_.tokens)
        assert target_cache[0].offset == seen - 1


@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("policy", ["fixed-20", "adaptive"])
def test_long_lookup_proposals_keep_greedy_parity(target_model, drafts, reference, with_draft,
                                                  policy):
    """Lookup proposals longer than the draft model's cap (a periodic prompt gives long matches)."""
    draft = drafts["related"] if with_draft else None
    options = ({"num_draft_tokens": 20} if policy == "fixed-20"
               else {"adaptive": True, "calibration": None})
    rounds = list(speculative_generate_step(PROMPTS["longer-than-prefill-chunk"], target_model,
                                            draft, max_tokens=60, prompt_lookup=True, **options))
    got = [t for r in rounds for t in r.tokens][:60]
    assert got == reference("longer-than-prefill-chunk", 60)
    if policy == "fixed-20":
        assert max(r.num_drafted for r in rounds if r.source == "lookup") == 20


def test_lookup_repeats_a_match_that_runs_into_the_end():
    from mlx_spec.drafters import PromptLookupDrafter

    def lookup(history, k):  # a drafter indexes one growing history: a new one per history
        return PromptLookupDrafter(100, greedy=True).lookup(history, k)

    history = [9, 1, 2, 3, 1, 2, 3, 1, 2]  # the latest earlier "1 2" is 3 tokens back
    assert lookup(history, 7) == [3, 1, 2, 3, 1, 2, 3]
    assert lookup([4, 5, 6, 4, 5], 2) == [6, 4]
    assert not PromptLookupDrafter(100, greedy=True).can_propose([4, 5, 6])


def test_plain_blocks_stop_soon_after_lookup_finds_a_match(target_model, reference):
    """Lookup alone: plain steps run in pipelined blocks; once the text has a match the
    block ends one step later (the step already queued), and the next round is lookup's."""
    from mlx_spec.drafters import PromptLookupDrafter

    prompt = PROMPTS["short"]
    rounds = list(speculative_generate_step(prompt, target_model, None, max_tokens=60,
                                            prompt_lookup=True, num_draft_tokens=4))
    assert [t for r in rounds for t in r.tokens][:60] == reference("short", 60)
    offers, history = [], list(prompt)
    for r in rounds:
        history += r.tokens
        offers.append(PromptLookupDrafter(10**6, True).can_propose(history))
    for i in range(len(rounds) - 2):
        plain = [rounds[j].source == "target" for j in (i, i + 1, i + 2)]
        if all(plain) and offers[i] and offers[i + 1]:
            raise AssertionError(f"plain step {i + 2} ran although lookup had a match before it")
    assert {"target", "lookup"} <= {r.source for r in rounds}
