"""Token trees in a batch (mlx_spec/batch/trees.py): every row verifies its own tree.

- Greedy: ragged batches drafting trees of several shapes, on a plain and a sliding-window
  target (Gemma-3's), with prompt lookup's chains beside them: every row equals the target's
  own greedy decoding, token for token, and the rounds really verified trees that kept
  siblings (so the test fails if trees fall back to chains).
- After a tree round each row's cache holds exactly its accepted path: the next round's
  logits equal the target's over the row's text decoded alone.
- T = 1: chi-square of tokens 3 and 4 of one prompt's rows in a refilled batch drafting 2x3
  trees, most rows having rewound a rejection before token 3; the naive tree rule (each
  candidate accepted on its own with min(1, p/q)) must fail the same test.
"""

import mlx.core as mx
import pytest

from batch_exactness import check_rows_after_a_rejection
from families import make_family, plain_greedy
from test_batch import ragged_prompts, run
from tiny import make_llama, perturbed

from mlx_spec.batch import BatchEngine, RowRequest

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0)
    return target, perturbed(target, 0.3, 1)  # a poor draft: rejections, so siblings matter


def _tree_outputs(engine, requests):
    """Every row's tokens, the draft model's rounds' (tree nodes, drafted depth, accepted)
    per output, and how many of its trees' accepted paths went through a sibling (left the
    spine: a gathered cache)."""
    uids = [engine.insert(r) for r in requests]
    out, rounds, siblings = {u: [] for u in uids}, [], 0
    while engine.busy:
        for o in engine.step():
            out[o.uid] += o.tokens
            if o.source == "draft":  # (prompt lookup's rows propose tries of other shapes)
                rounds.append((o.tree_nodes, o.num_drafted, o.num_accepted))
                siblings += o.spine_kept is not None and o.num_accepted > o.spine_kept
    return [out[u] for u in uids], rounds, siblings


@pytest.mark.parametrize("shape,k", [((3, 2), 3), ((4, 3), 4), ((2, 2), None)])
def test_greedy_tree_rows_keep_the_target_s_text(pair, shape, k):
    target, draft = pair
    prompts = ragged_prompts(5, seed=3)
    engine = BatchEngine(target, draft, num_draft_tokens=k, tree=shape)
    requests = [RowRequest(p, MAX_TOKENS, prompt_lookup=i % 2 == 0)
                for i, p in enumerate(prompts)]
    got, rounds, through_siblings = _tree_outputs(engine, requests)
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, MAX_TOKENS)
    trees = [r for r in rounds if r[0]]
    assert len(trees) > (20 if k else 5)  # (the batch policy may sit the draft out)
    assert all(nodes == depth * shape[1] for nodes, depth, _ in trees)
    assert through_siblings >= (3 if k else 1)  # kept paths through a sibling: a gathered cache


def test_a_sliding_window_target_verifies_trees_in_a_batch():
    target = make_family("gemma3_text", window=4)
    draft = perturbed(make_llama(seed=0), 0.3, 1)  # any draft of the same 64-token vocabulary
    prompts = ragged_prompts(4, seed=5)
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 2))
    got, rounds, _ = _tree_outputs(engine, [RowRequest(p, 24) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, 24)
    assert sum(1 for r in rounds if r[0]) > 10


def test_a_tree_round_leaves_each_row_s_cache_as_its_text_decoded_alone(pair):
    target, draft = pair
    prompts = ragged_prompts(3, seed=7)
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 3))
    for p in prompts:
        engine.insert(RowRequest(p, 100))
    texts = {}
    for _ in range(6):
        for o in engine.step():
            texts.setdefault(o.uid, []).extend(o.tokens)
    rows = engine.rows
    logits = engine.target.forward(mx.array([[row.history[-1]] for row in rows]))[:, -1]
    for i, row in enumerate(rows):
        alone = target(mx.array(row.history)[None])[0, -1]
        assert mx.allclose(logits[i], alone, atol=1e-4).item()


def test_rows_with_trees_and_chains_mix_and_other_sources_keep_chains(pair):
    target, draft = pair
    prompts = ragged_prompts(3, seed=9)
    engine = BatchEngine(target, draft, num_draft_tokens=2, tree=(2, 2))
    requests = [RowRequest(p, 30, num_draft_tokens=0 if i == 1 else None)
                for i, p in enumerate(prompts)]
    got = run(engine, requests)
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, 30)


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)])
def test_sampled_tree_rows_keep_the_target_s_distribution_after_rejections(residual, exact,
                                                                           monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes

    if not residual:  # the naive rule: each candidate on its own against an unchanged p
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    target = make_llama(vocab_size=8, hidden=64, heads=2, kv_heads=1, seed=3)
    draft = perturbed(target, 0.5, 4)
    # 600 rows, 2x3 trees: exact p = 0.81, the naive rule p = 2e-12 (2x2: 0.53 and 7e-4)
    check_rows_after_a_rejection(target, draft, True, exact, min_rewound=300, tree=(2, 3))


@pytest.fixture(scope="module")
def small_mtp(tmp_path_factory):
    """A tiny deepseek_v3 target over 8 tokens and a random MTP head for it."""
    from test_mtp import make_target, mtp_params, write_original

    target = make_target("deepseek_v3", vocab_size=8)
    return target, write_original(tmp_path_factory.mktemp("mtp-trees") / "d", target,
                                  mtp_params(target, seed=5))


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)])
def test_sampled_mtp_tree_rows_keep_the_target_s_distribution(residual, exact, small_mtp,
                                                             monkeypatch):
    """The target's MTP head drafting 2x3 trees for a refilled batch's rows (its siblings from
    the head's own per-step q, its pairs along each accepted path): tokens 3 and 4 at T = 1,
    mostly after a rewind. 600 rows: the exact rule p = 0.05, the naive one p = 1e-7."""
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes

    if not residual:
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    target, weights = small_mtp
    check_rows_after_a_rejection(target, "mtp", True, exact, min_rewound=100, tree=(2, 3),
                                 mtp_weights=str(weights))


def test_lookup_and_suffix_rows_propose_tries_and_keep_their_greedy_text():
    """With no model drafter, a row's prompt lookup (and suffix drafting) under tree=(4, 3)
    proposes the trie of the earlier text's continuations of its last n-gram, verified in the
    round's one pass: every row equals its own greedy decoding, through kept siblings too."""
    import random

    from mlx_spec.drafters.suffix_index import SuffixIndex

    rng = random.Random(0)
    target = make_llama(vocab_size=64, seed=0)
    prompts = [[rng.randrange(8) for _ in range(n)] * 3 for n in [5, 3, 7, 4]]
    engine = BatchEngine(target, None, num_draft_tokens=4, tree=(4, 3))
    index = SuffixIndex()
    requests = [RowRequest(p, 30, suffix=index if i == 3 else None)
                for i, p in enumerate(prompts)]
    uids = [engine.insert(r) for r in requests]
    out, trees, off_spine = {u: [] for u in uids}, 0, 0
    while engine.busy:
        for o in engine.step():
            out[o.uid] += o.tokens
            trees += o.tree_nodes > 0
            off_spine += o.spine_kept is not None and o.num_accepted > o.spine_kept
    for uid, prompt in zip(uids, prompts):
        assert out[uid] == plain_greedy(target, prompt, 30)
    assert trees > 10 and off_spine > 0


# "3 1" is followed by 4, 5 and 6 before the prompt's end: lookup's first proposal is a tree
QUOTING = [3, 1, 4, 3, 1, 5, 3, 1, 6, 2, 3, 1]


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)])
def test_sampled_lookup_tree_rows_keep_the_target_s_distribution(residual, exact, monkeypatch):
    """Point-mass tries from prompt lookup for a refilled batch's rows (no draft model):
    tokens 3 and 4 at T = 1 (600 rows: exact p = 0.91; the naive rule 3e-5)."""
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes

    if not residual:
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    check_rows_after_a_rejection(make_llama(vocab_size=8, seed=0), None, True, exact,
                                 min_rewound=300, prompt=QUOTING, tree=(2, 3))


def test_a_tree_shape_is_checked_and_recurrent_targets_keep_chains(pair):
    target, draft = pair
    for bad in [(0, 2), (2, 0), "2x2", (2,)]:
        with pytest.raises(ValueError, match="tree"):
            BatchEngine(target, draft, tree=bad)
    hybrid = make_family("qwen3_5")
    engine = BatchEngine(hybrid, None, tree=(2, 2))  # lookup only; its recurrent state: chains
    got = run(engine, [RowRequest([1, 2, 1, 2, 1, 2], 12)])
    assert got[0] == plain_greedy(hybrid, [1, 2, 1, 2, 1, 2], 12)


def test_batch_generate_takes_a_tree_and_reports_its_rounds(model_dirs):
    """The API on loaded models: batch_generate(tree=(3, 2)) gives each prompt the text
    generate gives it alone, and its stats count the tree rounds and nodes."""
    from mlx_spec import batch_generate, generate, load

    target, tokenizer = load(str(model_dirs["target"]))
    draft, _ = load(str(model_dirs["draft"]))
    prompts = ["def fibonacci(n):", "    return", "if n < 2:"]
    result = batch_generate(target, tokenizer, prompts, draft_model=draft, max_tokens=24,
                            num_draft_tokens=3, tree=(3, 2))
    assert result.texts == [generate(target, tokenizer, p, max_tokens=24) for p in prompts]
    assert result.stats["tree_rounds"] > 0
    assert result.stats["tree_nodes"] > result.stats["tree_rounds"]
    with pytest.raises(ValueError, match="tree must be"):
        batch_generate(target, tokenizer, prompts, draft_model=draft, tree=(0, 2))


def test_greedy_and_sampled_rows_mix_and_a_seeded_row_ignores_its_neighbours(pair):
    """Greedy rows, sampled rows drafting trees and sampled rows with lookup chains (or
    logits processors: chains) in the same rounds: the greedy rows keep the target's text,
    and a seeded sampled row's text is the same alone and in that crowd."""
    from mlx_lm.sample_utils import make_logits_processors

    from mlx_spec.sampling import SamplingConfig

    target, draft = pair
    sampled = SamplingConfig(temp=1.0)
    prompts = ragged_prompts(5, seed=11)
    seeded = RowRequest([5, 9, 2, 5, 9], 24, sampled, seed=11)
    alone = run(BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 2)), [seeded])[0]
    crowd = [RowRequest(prompts[0], MAX_TOKENS), RowRequest(prompts[1], MAX_TOKENS),
             RowRequest(prompts[2], 24, sampled, prompt_lookup=True),
             RowRequest(prompts[3], 24, sampled, logits_processors=make_logits_processors(
                 repetition_penalty=1.3)),
             RowRequest(prompts[4], 24, sampled), seeded]
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 2))
    got, rounds, _ = _tree_outputs(engine, crowd)
    for i in (0, 1):
        assert got[i] == plain_greedy(target, prompts[i], MAX_TOKENS)
    assert got[-1] == alone
    assert all(len(g) == 24 for g in got[2:])
    assert sum(1 for r in rounds if r[0]) > 10


def test_a_draft_with_a_smaller_vocabulary_drafts_trees(pair):
    """A draft whose output layer is narrower than the target's (q padded): greedy parity."""
    target, _ = pair
    draft = make_llama(vocab_size=48, seed=4, hidden=32, layers=1)
    prompts = [[p % 48 for p in prompt] for prompt in ragged_prompts(3, seed=13)]
    engine = BatchEngine(target, draft, num_draft_tokens=3, tree=(3, 3))
    got, rounds, _ = _tree_outputs(engine, [RowRequest(p, 30) for p in prompts])
    for prompt, tokens in zip(prompts, got):
        assert tokens == plain_greedy(target, prompt, 30)
    assert sum(1 for r in rounds if r[0]) > 10


# --- a row alone: its trees as wide as its policy chooses (tree=None), as a call's ---

@pytest.fixture
def two_by_two(monkeypatch):
    """The call's policy asking the model drafter for 2 drafts, 2 wide, every round."""
    from mlx_spec.policy import AdaptivePolicy

    monkeypatch.setattr(AdaptivePolicy, "proposal_length",
                        lambda self, source: 2 if source in ("draft", "mtp") else 0)
    monkeypatch.setattr(AdaptivePolicy, "tree_width", lambda self, source: 2)


def _alone(engine, prompt, max_tokens, sampling=None):
    """A row decoded alone: its tokens and its outputs."""
    from mlx_spec.sampling import SamplingConfig

    engine.insert(RowRequest(prompt, max_tokens, sampling or SamplingConfig(),
                             prompt_lookup=False))
    outputs = []
    while engine.busy:
        outputs += engine.step()
    return [t for o in outputs for t in o.tokens], outputs


def test_a_row_alone_drafts_trees_as_wide_as_its_policy_chooses(pair, two_by_two):
    target, draft = pair
    prompt = [2, 7, 1, 8]
    tokens, outputs = _alone(BatchEngine(target, draft, calibration=None), prompt, 30)
    assert tokens == plain_greedy(target, prompt, 30)
    drafted = [o for o in outputs if o.num_drafted]
    assert drafted and all(o.tree_nodes == 2 * o.num_drafted and o.tree_width == 2
                           for o in drafted)
    assert any(o.num_accepted > o.spine_kept for o in drafted)  # a sibling was kept
    _, chains = _alone(BatchEngine(target, draft, calibration=None, tree=False), prompt, 30)
    assert not any(o.tree_nodes for o in chains)
    beside = BatchEngine(target, draft, calibration=None)  # two rows: the batch policy's chains
    uids = [beside.insert(RowRequest(prompt, 30, prompt_lookup=False)) for _ in range(2)]
    got, together = {u: [] for u in uids}, []
    while beside.busy:
        two = len(beside.rows) == 2
        for o in beside.step():
            got[o.uid] += o.tokens
            together += [o] if two else []
    assert [got[u] for u in uids] == [plain_greedy(target, prompt, 30)] * 2
    assert any(o.num_drafted for o in together) and not any(o.tree_nodes for o in together)


@pytest.mark.parametrize("residual,exact", [(True, True), (False, False)])
def test_sampled_rows_alone_with_their_policy_s_trees_keep_the_distribution(
        residual, exact, two_by_two, monkeypatch):
    """600 rows, each alone, T = 1, drafting 2x2 trees the policy chose: tokens 3 and 4
    against the target's exact distribution; the naive tree rule must fail the same test."""
    import mlx_spec.tree_acceptance as tree_acceptance
    from batch_exactness import ALPHA, PROMPT, SAMPLES
    from test_exactness import exact_third_and_fourth
    from test_trees import naive_tree_outcomes

    from mlx_spec.exactness import chi_square
    from mlx_spec.sampling import SamplingConfig

    if not residual:
        monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)
    target = make_llama(vocab_size=8, hidden=64, heads=2, kv_heads=1, seed=3)
    engine = BatchEngine(target, perturbed(target, 0.5, 4), calibration=None)
    mx.random.seed(0)
    sampling, counts, rewound = SamplingConfig(temp=1.0), {}, 0
    for _ in range(SAMPLES):
        tokens, outputs = _alone(engine, PROMPT, 4, sampling)
        counts[tuple(tokens[2:4])] = counts.get(tuple(tokens[2:4]), 0) + 1
        first = outputs[0]
        rewound += first.tree_nodes > 0 and len(first.tokens) < 3  # a rejection before token 3
    assert rewound > SAMPLES // 2, rewound
    statistic, dof, p_value = chi_square(counts, exact_third_and_fourth(target, PROMPT, sampling))
    assert (p_value > ALPHA) == exact, (statistic, dof, p_value)
