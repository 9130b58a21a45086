"""A custom sampler and a custom acceptance rule in the batch (issue 62: what only the loop
took). A sampler mlx-spec cannot read draws each row's tokens itself and a draft is kept while
it equals the sampler's draw at its position (acceptance.sampler_match), as a call's; mlx-lm's
own `make_sampler` is read back into temp/top_p/top_k/min_p. Greedy parity through an argmax
the batch cannot read; the chi-square of tokens 3 and 4 after rejections against the target's
exact distribution at the sampler's temperature, with a negative control (every position drawn
from the first's). An `accept` rule of the loop's kind (no key: MLX's global random state)
judges every sampled row's chain: the residual rule and mlx-lm's token match pass the same
chi-square, resampling from p fails it."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from batch_exactness import PROMPT, SAMPLES, ALPHA, sample_rows
from test_batch import pair, ragged_prompts, run, small_pair  # noqa: F401 (fixtures)
from test_exactness import exact_third_and_fourth

from mlx_spec import batch_generate
from mlx_spec.acceptance import keyed_rule
from mlx_spec.batch import BatchEngine, RowRequest
from mlx_spec.exactness import chi_square
from mlx_spec.sampling import SamplingConfig


def opaque_argmax(logprobs):
    """The target's argmax, as a callable the batch cannot read (not make_sampler's)."""
    return mx.argmax(logprobs, axis=-1)


def plain_greedy(target, prompt, max_tokens, processors=None):
    return [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=max_tokens,
                                             sampler=opaque_argmax,
                                             logits_processors=processors)]


@pytest.mark.parametrize("k", [None, 1, 3])
def test_rows_with_an_opaque_sampler_give_the_targets_own_tokens(pair, k):  # noqa: F811
    """Rows of an argmax the batch cannot read, beside greedy rows, then one alone (the
    single-stream policy at k=None), with drafts partly kept: each row's text is the target's
    own, and the rows drafted."""
    target, draft = pair
    prompts = ragged_prompts(4)
    opaque = SamplingConfig(temp=1.0, sampler=opaque_argmax)
    engine = BatchEngine(target, draft, num_draft_tokens=k)
    requests = [RowRequest(p, 20, opaque if i % 2 == 0 else SamplingConfig(), prompt_lookup=False)
                for i, p in enumerate(prompts)]
    for prompt, tokens in zip(prompts, run(engine, requests)):
        assert tokens == plain_greedy(target, prompt, 20)
    accepted = []
    # a row alone (auto_off=False: the single-stream policy drafts whatever this CPU's timings)
    engine = BatchEngine(target, draft, num_draft_tokens=k, auto_off=False)
    uid = engine.insert(RowRequest(prompts[2], 32, opaque, prompt_lookup=False))
    tokens = []
    while engine.busy:
        for out in engine.step():
            tokens += out.tokens
            accepted.append(out.num_accepted)
    assert tokens == plain_greedy(target, prompts[2], 32) and uid == 0
    assert sum(accepted) > 0


def test_opaque_sampler_rows_draft_chains_where_the_batch_asks_for_trees(pair):  # noqa: F811
    """Trees need the residual rule's q: a row with an opaque sampler drafts chains beside
    rows that draft trees, and with logits processors its text is mlx-lm's."""
    target, draft = pair
    prompts = ragged_prompts(3)
    bias = make_logits_processors(logit_bias={5: 3.0}, repetition_penalty=1.3)
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 2))
    requests = [RowRequest(prompts[0], 16, SamplingConfig(temp=1.0, sampler=opaque_argmax),
                           logits_processors=bias, prompt_lookup=False),
                RowRequest(prompts[1], 16, prompt_lookup=False),
                RowRequest(prompts[2], 16, SamplingConfig(temp=1.0, sampler=opaque_argmax))]
    uids = [engine.insert(r) for r in requests]
    tokens, widths = {u: [] for u in uids}, {u: set() for u in uids}
    while engine.busy:
        for out in engine.step():
            tokens[out.uid] += out.tokens
            widths[out.uid].add(out.tree_width)
    assert tokens[uids[0]] == plain_greedy(target, prompts[0], 16, bias)
    assert tokens[uids[2]] == plain_greedy(target, prompts[2], 16)
    assert widths[uids[0]] == widths[uids[2]] == {1} and max(widths[uids[1]]) > 1


def _opaque_rows(target, draft, broken=False, monkeypatch=None):
    """The p-value of SAMPLES rows' tokens 3 and 4 under a sampler drawing at T = 0.8 (one the
    batch cannot read), against the target's exact distribution at T = 0.8."""
    if broken:  # every position drawn from the first position's log-probabilities
        import mlx_spec.batch.verify as verify
        from mlx_spec.acceptance import sampler_match

        def wrong_position(sampler):
            rule = sampler_match(sampler)

            def broken_rule(tokens, probs, logprobs):
                return rule(tokens, probs, mx.broadcast_to(logprobs[:1], logprobs.shape))
            broken_rule.sampler = sampler
            return broken_rule
        monkeypatch.setattr(verify, "sampler_match", wrong_position)
    sampling = SamplingConfig(temp=1.0, sampler=lambda lp: mx.random.categorical(lp / 0.8))
    mx.random.seed(0)
    counts, rewound = sample_rows(target, draft, keyed_rule(True), SAMPLES, sampling=sampling)
    assert sum(counts.values()) == SAMPLES and rewound > SAMPLES // 3, rewound
    exact = exact_third_and_fourth(target, PROMPT, SamplingConfig(temp=0.8))
    return chi_square(counts, exact)[2]


def test_opaque_sampler_rows_after_a_rejection_are_distributed_as_the_target(
        small_pair):  # noqa: F811
    assert _opaque_rows(*small_pair) > ALPHA


def test_negative_control_drawing_every_position_from_the_first_is_caught(
        small_pair, monkeypatch):  # noqa: F811
    assert _opaque_rows(*small_pair, broken=True, monkeypatch=monkeypatch) < ALPHA


def test_batch_generate_takes_mlx_lms_sampler_and_processors(model_dirs):
    """`sampler=` from make_sampler is read back into its temperature (the same seeded texts as
    temp=); an opaque one draws itself (an argmax: generate's greedy texts, processors for
    every row, as mlx-lm's batch_generate takes them); bad combinations are one sentence."""
    from mlx_spec import generate, load

    target, tokenizer = load(str(model_dirs["target"]))
    draft, _ = load(str(model_dirs["draft"]))
    prompts = ["def fibonacci(n):", "    return"]
    made = batch_generate(target, tokenizer, prompts, draft, max_tokens=12, seed=4,
                          sampler=make_sampler(temp=0.7))
    assert made.token_ids == batch_generate(target, tokenizer, prompts, draft, max_tokens=12,
                                            seed=4, temp=0.7).token_ids
    bias = make_logits_processors(logit_bias={5: 3.0}, repetition_penalty=1.3)
    opaque = batch_generate(target, tokenizer, prompts, draft, max_tokens=12,
                            sampler=opaque_argmax, logits_processors=bias)
    assert opaque.texts == [generate(target, tokenizer, p, draft_model=draft, max_tokens=12,
                                     logits_processors=bias) for p in prompts]
    with pytest.raises(ValueError, match="either sampler or temp"):
        batch_generate(target, tokenizer, prompts, sampler=opaque_argmax, temp=0.5)
    with pytest.raises(ValueError, match="global random state"):
        batch_generate(target, tokenizer, prompts, sampler=opaque_argmax, seed=1)
    with pytest.raises(ValueError, match="global random state"):
        BatchEngine(target).insert(RowRequest([1, 2], 4, SamplingConfig(
            temp=1.0, sampler=opaque_argmax), seed=3))


@pytest.mark.parametrize("rule,exact", [("speculative_accept", True),
                                        ("token_match_accept", True),
                                        ("resample_from_target_accept", False)])
def test_an_accept_rule_with_no_key_judges_the_rows(small_pair, rule, exact):  # noqa: F811
    """A call's `accept` (draft_tokens, draft_probs, target_logprobs), with no key of a row's,
    in a batch kept 6 rows wide: tokens 3 and 4 of 600 rows, most after a rejection."""
    import mlx_spec.acceptance as acceptance

    target, draft = small_pair
    mx.random.seed(0)
    counts, rewound = sample_rows(target, draft, getattr(acceptance, rule), SAMPLES)
    assert sum(counts.values()) == SAMPLES and rewound > SAMPLES // 3, rewound
    p_value = chi_square(counts, exact_third_and_fourth(target, PROMPT,
                                                        SamplingConfig(temp=1.0)))[2]
    assert (p_value > ALPHA) == exact, p_value


def test_a_seed_under_a_rule_with_no_key_is_one_sentence(small_pair):  # noqa: F811
    """A row's seed fixes its draws only through its key: under an accept rule with no key it
    is refused, as with an opaque sampler (greedy rows draw nothing: their seed is harmless)."""
    from mlx_spec.acceptance import speculative_accept

    engine = BatchEngine(small_pair[0], accept=speculative_accept)
    with pytest.raises(ValueError, match="global random state"):
        engine.insert(RowRequest([1, 2], 4, SamplingConfig(temp=1.0), seed=3))
    engine.insert(RowRequest([1, 2], 4, seed=3))


@pytest.mark.parametrize("drafter", ["mtp", "lookup"])
def test_opaque_sampler_rows_with_the_mtp_head_or_lookup_alone(drafter, tmp_path):
    """The other drafters an opaque sampler's rows meet: the target's MTP head (its draws from
    the head's logits through the sampler) and prompt lookup with no draft model; each row's
    text is the target's own greedy text."""
    from test_mtp import make_target, mtp_params, write_original

    target = make_target("qwen3_5")
    prompts = [p * 2 for p in ragged_prompts(3)]  # (lookup has matches)
    opaque = SamplingConfig(temp=1.0, sampler=opaque_argmax)
    if drafter == "mtp":
        weights = write_original(tmp_path / "mtp", target, mtp_params(target))
        engine = BatchEngine(target, "mtp", num_draft_tokens=2, mtp_weights=str(weights))
    else:
        engine = BatchEngine(target, num_draft_tokens=2)
    requests = [RowRequest(p, 16, opaque) for p in prompts]
    uids = [engine.insert(r) for r in requests]
    got, sources = {u: [] for u in uids}, set()
    while engine.busy:
        for out in engine.step():
            got[out.uid] += out.tokens
            sources.add(out.source)
    assert [got[u] for u in uids] == [plain_greedy(target, p, 16) for p in prompts]
    assert drafter in sources
