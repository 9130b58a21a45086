"""Token trees from the drafters that draft from the target's hidden states (issue 66): an
EAGLE-3 head and an MTP head propose a spine of k chained drafts with siblings from the same q
(their next-best tokens at T = 0, i.i.d. draws at T > 0), as the draft model does, and a DFlash
drafter its block's drafts with siblings from each row's own q; after a tree round the drafter
is handed the target's states at the root and the accepted nodes (each node's state is its
path's decoded alone), so its next proposal continues from the accepted path.

- greedy parity over 100+ tokens with trees of several shapes: the target's own text, tree
  rounds ran, and a sibling (not the spine) was kept at least once;
- chi-square at T = 1 of the first two tokens (check_exactness with `tree=`) and of tokens
  3 and 4 after mid-generation rejections, with trees of width 2-3; the naive rule (each
  candidate accepted with min(1, p/q) on its own) fails each.
"""

import mlx.core as mx
import pytest

from families import plain_greedy
from test_eagle3 import (DEFAULT_IDS, LAYERS, ORIGINAL, SPECULATORS, exact_third_and_fourth,
                         good_head_tensors, head_tensors, near_bigram, write_head)
from test_mtp import make_target, mtp_params, write_original
from dflash_tiny import make_dflash
from tiny import make_llama

from mlx_spec.eagle3 import load_eagle3
from mlx_spec.exactness import check_exactness, chi_square
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

PROMPT = [5, 9, 14, 3, 27, 8, 41, 3, 27]
ALPHA = 1e-3
SMALL_VOCAB = 8
# 300 samples: the naive rule fails at p < 1e-19 on both heads, the exact rule passes at p > 0.1.
SAMPLES = 300
LATER_SAMPLES = 300  # tokens 3-4: the naive rule's p ~ 1e-14 at 500 samples, far past ALPHA at 300


def rounds_of(target, draft, prompt, n, **options):
    return list(speculative_generate_step(prompt, target, draft, max_tokens=n,
                                          calibration=None, prompt_lookup=False, **options))


def check_greedy(target, draft, shape, **options):
    rounds = rounds_of(target, draft, PROMPT, 120, num_draft_tokens=shape[0], tree=shape,
                       **options)
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPT, 120)
    trees = [r for r in rounds if r.tree_nodes]
    assert trees, "no tree round ran"
    rescued = sum(r.num_accepted > r.spine_kept for r in trees)
    print(f"{shape}: {len(trees)} tree rounds, {rescued} kept a sibling")
    assert rescued > 0  # the branches are real


@pytest.fixture(scope="module")
def bigram_head(tmp_path_factory):
    """A near-bigram llama and a hand-made EAGLE-3 head that drafts it well, made a little worse
    (noise), so spines stop short and siblings get their chance."""
    target = near_bigram(make_llama(vocab_size=64, hidden=48, layers=LAYERS, seed=0))
    tensors = good_head_tensors(target, 48, seed=7, noise=0.5)
    path = write_head(tmp_path_factory.mktemp("tree-head") / "head", SPECULATORS, target,
                      tensors, DEFAULT_IDS[SPECULATORS])
    return target, load_eagle3(str(path))


@pytest.mark.parametrize("shape", [(3, 2), (4, 3)])
def test_eagle3_trees_keep_the_target_s_greedy_text(bigram_head, shape):
    check_greedy(*bigram_head, shape)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    target = make_target("deepseek_v3")
    return target, write_original(tmp_path_factory.mktemp("tree-mtp") / "d", target,
                                  mtp_params(target))


@pytest.mark.parametrize("shape", [(3, 2), (2, 3)])
def test_mtp_trees_keep_the_target_s_greedy_text(mtp_target, shape):
    target, weights = mtp_target
    check_greedy(target, "mtp", shape, mtp_weights=str(weights))


# --- T = 1 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A target of 8 tokens and a random head over 6 of them: poor, so trees often reject."""
    target = make_llama(vocab_size=SMALL_VOCAB, hidden=32, layers=LAYERS, seed=0)
    tensors = head_tensors(target, 6, seed=4, scale=4.0)
    path = write_head(tmp_path_factory.mktemp("small-tree") / "head", ORIGINAL, target, tensors)
    return target, load_eagle3(str(path))


def naive(monkeypatch):
    import mlx_spec.tree_acceptance as tree_acceptance
    from test_trees import naive_tree_outcomes
    monkeypatch.setattr(tree_acceptance, "tree_outcomes", naive_tree_outcomes)


@pytest.mark.parametrize("control", [False, True], ids=["exact", "naive-rule"])
def test_eagle3_trees_give_the_first_two_tokens_at_t1(small, control, monkeypatch):
    if control:
        naive(monkeypatch)
    target, head = small
    result = check_exactness(target, head, [3, 1, 4], SamplingConfig(temp=1.0), samples=SAMPLES,
                             num_draft_tokens=2, alpha=ALPHA, seed=0, tree=(2, 3))
    print(f"eagle3 trees t1,t2 control={control}: p={result.p_value:.3g}")
    assert result.passed != control, result


@pytest.mark.parametrize("control", [False, True], ids=["exact", "naive-rule"])
def test_eagle3_trees_give_tokens_3_and_4_after_rejections(small, control, monkeypatch):
    """Tokens 3 and 4 at T = 1 with 2 x 2 trees: most samples rejected part of a tree in a
    round before token 3, so tokens 3 and 4 come from the head fed the accepted path."""
    check_later_pairs(*small, [3, 1, 4], LATER_SAMPLES, (2, 2), control, monkeypatch)


def check_later_pairs(target, draft, prompt, samples, shape, control, monkeypatch, seed=1):
    """Tokens 3 and 4 at T = 1 over `samples` runs of `shape` trees are the target's (the
    chi-square passes), or with `control` (the naive rule) they are not; asserts tree rounds
    ran and over a quarter of the samples rejected part of a tree in a round before token 3."""
    if control:
        naive(monkeypatch)
    statistic, dof, p_value = later_pairs(target, draft, prompt, samples, shape, seed)
    print(f"{draft.__class__.__name__} trees {shape} t3,t4 control={control}: "
          f"chi2={statistic:.1f} dof={dof} p={p_value:.3g}")
    assert (p_value > ALPHA) != control, (statistic, dof, p_value)


def later_pairs(target, draft, prompt, samples, shape, seed=1):
    """Chi-square (statistic, dof, p) of tokens 3 and 4 at T = 1 against the target alone."""
    sampling = SamplingConfig(temp=1.0)
    mx.random.seed(seed)
    counts, rejected, trees = {}, 0, 0
    for _ in range(samples):
        out, early = [], False
        for round_ in speculative_generate_step(prompt, target, draft, max_tokens=4,
                                                num_draft_tokens=shape[0], sampling=sampling,
                                                prompt_lookup=False, calibration=None,
                                                tree=shape):
            trees += round_.tree_nodes > 0
            if round_.num_accepted < round_.num_drafted and len(out) + len(round_.tokens) < 3:
                early = True
            out += round_.tokens
        rejected += early
        counts[(out[2], out[3])] = counts.get((out[2], out[3]), 0) + 1
    assert trees > samples and rejected > samples // 4, (trees, rejected)
    return chi_square(counts, exact_third_and_fourth(target, prompt, sampling))


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    """A random EAGLE-3 head (its drafts depend on the taps) on a random llama."""
    target = make_llama(vocab_size=64, hidden=48, layers=LAYERS, seed=0)
    path = write_head(tmp_path_factory.mktemp("random-tree-head") / "head", ORIGINAL, target,
                      head_tensors(target, 48, seed=1))
    return target, load_eagle3(str(path))


def spied_rounds(target, head, monkeypatch, prompt=PROMPT, n=60, **options):
    """The rounds of a run, and (history, spine) of every proposal the EAGLE-3 head made."""
    from mlx_spec.drafters.eagle3 import Eagle3Drafter

    seen, propose = [], Eagle3Drafter.propose

    def spy(self, history, k):
        proposal = propose(self, history, k)
        if proposal is not None:
            seen.append((list(history), proposal.tokens.tolist()))
        return proposal

    monkeypatch.setattr(Eagle3Drafter, "propose", spy)
    rounds = list(speculative_generate_step(prompt, target, head, max_tokens=n,
                                            calibration=None, **options))
    monkeypatch.undo()
    return rounds, seen


def check_from_scratch(target, head, seen):
    """Each proposal equals a fresh head's after the taps of the whole history at once."""
    from mlx_spec.assemble import eagle3_capture
    from mlx_spec.drafters.eagle3 import Eagle3Drafter

    capture = eagle3_capture(target, head)
    for history, spine in seen[1:]:
        fresh = Eagle3Drafter(head, target, SamplingConfig())
        _, taps = capture(mx.array([history[:-1]], mx.uint32), None)
        fresh.follow(history[1:], taps[0])  # (T, X): the one row
        assert fresh.propose(history, len(spine)).tokens.tolist() == spine, len(history)


def test_after_tree_rounds_the_head_drafts_what_it_drafts_from_scratch(random_head, monkeypatch):
    """Every spine an EAGLE-3 head proposes in a run of 3 x 3 trees equals the chain a fresh
    head proposes after reading the target's taps of the whole history at once: after each
    tree round the head was handed the accepted path's states, not the first rows' (greedy
    parity cannot show this: only what the head drafts does)."""
    target, head = random_head
    rounds, seen = spied_rounds(target, head, monkeypatch, num_draft_tokens=3, tree=(3, 3),
                                prompt_lookup=False)
    off_the_first_rows = [r for r in rounds if r.tree_nodes and (
        r.num_accepted > r.spine_kept or r.num_accepted >= 2)]  # its path is not rows 1, 2, ..
    assert off_the_first_rows, [(r.num_accepted, r.spine_kept) for r in rounds]
    check_from_scratch(target, head, seen)


def test_a_head_behind_lookup_trees_is_handed_their_accepted_paths(random_head, monkeypatch):
    """Prompt lookup in front proposes 3 x 2 trees on a prompt that repeats; the head behind
    it, not asked in those rounds, must still be handed each accepted path's states."""
    target, head = random_head
    prompt = PROMPT * 3
    rounds, seen = spied_rounds(target, head, monkeypatch, prompt=prompt, num_draft_tokens=3,
                                tree=(3, 2), prompt_lookup=True)
    assert any(r.source == "lookup" and r.tree_nodes for r in rounds)
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, prompt, 60)
    check_from_scratch(target, head, seen)


class Alternating:
    """k = 3, and the width of every source that can tree alternating 1, 2, 1, 2, ...: the
    policy's side of tree=None, chain rounds and tree rounds interleaved."""

    def __init__(self):
        self.allowed, self.tree_rounds, self.asked = {}, 0, 0

    def proposal_length(self, source):
        return 3

    def plain_steps(self):
        return 1

    def observe(self, round_, seconds):
        self.tree_rounds += round_.tree_nodes > 0

    def describe(self):
        return {"policy": "alternating"}

    def allow_trees(self, source, max_width):
        self.allowed[source] = max_width

    def tree_width(self, source):
        self.asked += 1
        return 1 + self.asked % 2


def test_with_tree_none_the_policy_s_width_makes_head_trees(random_head, monkeypatch):
    target, head = random_head
    policy = Alternating()
    rounds, seen = spied_rounds(target, head, monkeypatch, num_draft_tokens=None, policy=policy,
                                prompt_lookup=False)
    assert policy.allowed == {"eagle3": 3}
    assert 0 < policy.tree_rounds < len(rounds)  # chains and trees both ran
    assert [t for r in rounds for t in r.tokens] == plain_greedy(target, PROMPT, 60)
    check_from_scratch(target, head, seen)


# --- DFlash --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 2), (4, 3)])
def test_dflash_trees_keep_the_target_s_greedy_text(tmp_path, shape):
    target = make_llama(layers=4, seed=0)
    drafter = make_dflash(tmp_path / "d", 48, [1, 2], block_size=6, seed=5)
    check_greedy(target, drafter, shape)


@pytest.mark.parametrize("control", [False, True], ids=["exact", "naive-rule"])
def test_dflash_trees_give_the_first_two_tokens_at_t1(tmp_path, control, monkeypatch):
    """A target over 8 tokens and a random DFlash drafter, 2 x 3 trees."""
    if control:
        naive(monkeypatch)
    target = make_llama(vocab_size=8, layers=4, seed=0)
    drafter = make_dflash(tmp_path / "d", 48, [1, 2], block_size=6, mask_token_id=7)
    result = check_exactness(target, drafter, [1, 2, 3, 4, 5, 6, 7], SamplingConfig(temp=1.0),
                             samples=SAMPLES, num_draft_tokens=2, alpha=ALPHA, seed=0,
                             tree=(2, 3))
    print(f"dflash trees t1,t2 control={control}: p={result.p_value:.3g}")
    assert result.passed != control, result

