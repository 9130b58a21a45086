"""The prompt look: a drafter's acceptance measured on the prompt's last tokens after the prefill.

Each value the loop hands the policy is checked against an independent
computation: the target and the draft (or the MTP layer over the target's
hidden states) run from scratch over the whole prompt, the rows that predict
the prompt's last tokens picked by hand, and sum_x min(p, q) taken in numpy.
An off-by-one in which rows are compared fails these tests.
"""

import mlx.core as mx
import numpy as np
import pytest

from test_mtp import PROMPT as MTP_PROMPT, make_target, mtp_params, write_original
from tiny import make_llama, perturbed

from mlx_spec import policy as policy_module
from mlx_spec import prompt_look
from mlx_spec.cache.prefill import chunks
from mlx_spec.generate import speculative_generate_step
from mlx_spec.mtp import load_mtp, split_target
from mlx_spec.policy import AdaptivePolicy
from mlx_spec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def pair():
    target = make_llama(seed=0)
    return target, perturbed(target, noise=0.3, seed=2)


def looked(monkeypatch):
    """Every (source, acceptance, rows) the loop hands the policy. The tiny draft's timed step
    can read as dear as the tiny target's under load, and a draft the model finds hopeless is
    not looked at: here every source still looks (a test below keeps the policy's answer). The
    tests' replies are short: the look's budget is lifted here (tests below keep it)."""
    monkeypatch.setattr(AdaptivePolicy, "still_looks", lambda self, source: True)
    monkeypatch.setattr(AdaptivePolicy, "look_rows", lambda self, per_token, tokens, most: most)
    seen = []
    original = AdaptivePolicy.observe_prompt_look

    def record(self, source, acceptance, rows, **options):
        seen.append((source, acceptance, rows))
        return original(self, source, acceptance, rows, **options)
    monkeypatch.setattr(AdaptivePolicy, "observe_prompt_look", record)
    return seen


def decode(target, draft, prompt, temp=0.7, **kwargs):
    options = dict(max_tokens=8, sampling=SamplingConfig(temp=temp), calibration=None,
                   prompt_lookup=False)
    options.update(kwargs)
    return [t for r in speculative_generate_step(prompt, target, draft, **options) for t in r.tokens]


def numpy_chances(target_logits, draft_logits, temp):
    def softmax(x):
        x = np.asarray(x, np.float64) / temp
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    return np.minimum(softmax(target_logits), softmax(draft_logits)).sum(axis=-1)


def prompt_of(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(1, 60, n)]


@pytest.mark.parametrize("length,step,rows", [(20, 512, 19), (50, 512, prompt_look.ROWS),
                                              (40, 16, 7)])  # (chunks 16, 16, 7: the last one's)
def test_a_draft_models_look_equals_its_chances_on_the_prompt(pair, monkeypatch, length, step, rows):
    target, draft = pair
    prompt = prompt_of(length)
    seen = looked(monkeypatch)
    decode(target, draft, prompt, prefill_step_size=step)
    assert [(s, r) for s, _, r in seen] == [("draft", rows)]
    x = mx.array([prompt[:-1]])  # row i predicts prompt[i + 1]: the last rows, the last tokens
    expected = numpy_chances(target(x)[0, -rows:], draft(x)[0, -rows:], 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
    shifted = numpy_chances(target(x)[0, 1 - rows:], draft(x)[0, -rows:-1], 0.7).mean()
    assert abs(shifted - expected) > 1e-3  # (the check can tell an off-by-one)


def test_an_mtp_heads_look_pairs_each_hidden_state_with_the_token_after_it(tmp_path, monkeypatch):
    target = make_target("qwen3_5")
    weights = write_original(tmp_path / "mtp", target, mtp_params(target))
    prompt = MTP_PROMPT + prompt_of(12, seed=3)
    seen = looked(monkeypatch)
    decode(target, "mtp", prompt, mtp_weights=str(weights))
    n = len(prompt)
    assert [(s, r) for s, _, r in seen] == [("mtp", n - 2)]
    trunk, head = split_target(target)
    hidden = trunk(mx.array([prompt[:-1]]))[0]  # h_0 .. h_{n-2}
    mtp = load_mtp(target, str(weights)).drafting()
    g = mtp(mx.array(prompt[1:]), hidden, mtp.make_cache()[0])  # pairs (h_i, x_{i+1})
    draft_logits = mtp.logits(g[:-1])  # g_i predicts x_{i+2}: x_2 .. x_{n-1}
    target_logits = head(hidden[1:])  # h_i predicts x_{i+1}: x_2 .. x_{n-1}
    expected = numpy_chances(target_logits, draft_logits, 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("layout", ["full", "sliding", "causal"])
def test_a_block_drafters_look_is_its_first_row_anchored_at_each_prompt_position(
        tmp_path, monkeypatch, layout):
    """A DFlash drafter's look: at each of the prompt's last positions a, the first draft row
    of a block anchored at a over the target's taps before a (what a round there would draft;
    from_scratch_block_logits, a dense numpy forward), against the target's own row at a. The
    target keeps its taps and its final hidden states in the same prefill."""
    from dflash_tiny import make_dflash
    from test_dflash import from_scratch_block_logits

    kwargs = {"full": {}, "sliding": dict(layer_types=["sliding_attention", "full_attention"],
                                          sliding_window=4),
              "causal": dict(is_causal=True)}[layout]
    target = make_llama(layers=4, seed=0)
    drafter = make_dflash(tmp_path / layout, 48, [1, 3], block_size=5, **kwargs)
    prompt = prompt_of(14, seed=4)
    seen = looked(monkeypatch)
    decode(target, drafter, prompt)
    n, rows = len(prompt), len(prompt) - 2  # anchors 1 .. n - 2: each has a context row before it
    assert [(s, r) for s, _, r in seen] == [("dflash", rows)]
    target_logits = target(mx.array([prompt[:-1]]))[0]  # row a predicts prompt[a + 1]
    draft_logits = np.stack([from_scratch_block_logits(target, drafter, prompt[:a + 1], 1)[0]
                             for a in range(1, n - 1)])  # anchored at a: predicts prompt[a + 1]
    expected = numpy_chances(target_logits[1:], draft_logits, 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
    shifted = numpy_chances(target_logits[2:], draft_logits[:-1], 0.7).mean()
    assert abs(shifted - expected) > 1e-3  # (the check can tell an off-by-one)


@pytest.mark.parametrize("layout", ["bidirectional", "causal"])
def test_a_dflash2_drafters_look_is_its_selectors_first_draft_distribution(
        tmp_path, monkeypatch, layout):
    """DFlash2's q is not a transform of logits: its look compares p with the selector's
    distribution over the first row's candidates after the anchor's token (from_scratch_drafts:
    dense convolutions, scales, soft cap and selector), at each of the prompt's last positions."""
    from dflash_tiny import make_dflash2
    from test_dflash2 import EXTRAS, from_scratch_drafts

    kwargs = {"bidirectional": {}, "causal": dict(is_causal=True)}[layout]
    drafter = make_dflash2(tmp_path / layout, 48, [1, 3], block_size=5, conv_kernel_size=3,
                           extra=EXTRAS, **kwargs)
    target = make_llama(layers=4, seed=0)
    prompt = prompt_of(14, seed=4)
    seen = looked(monkeypatch)
    decode(target, drafter, prompt)
    n, rows = len(prompt), len(prompt) - 2
    assert [(s, r) for s, _, r in seen] == [("dflash", rows)]
    target_logits = np.asarray(target(mx.array([prompt[:-1]]))[0], np.float64) / 0.7
    p = np.exp(target_logits - target_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.concatenate([from_scratch_drafts(target, drafter, prompt[:a + 1], 1, None, 0.7)
                        for a in range(1, n - 1)])  # anchored at a: predicts prompt[a + 1]
    expected = np.minimum(p[1:], q).sum(-1).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
    assert abs(np.minimum(p[2:], q[:-1]).sum(-1).mean() - expected) > 1e-3  # (off by one)


@pytest.mark.parametrize("case", ["greedy", "fixed k", "processors", "short prompt",
                                  "calibrated"])
def test_no_look_where_it_is_not_wanted(pair, monkeypatch, case):
    """Greedy (the prompt is no guide to a greedy reply), a pinned k (no policy reads it), logits
    processors (they change p), a prompt too short, a calibration (it measured acceptance)."""
    target, draft = pair
    seen = looked(monkeypatch)
    prompt, options = prompt_of(30), {}
    if case == "greedy":
        options["temp"] = 0.0
    elif case == "fixed k":
        options["num_draft_tokens"] = 2
    elif case == "processors":
        options["logits_processors"] = [lambda tokens, logits: logits]
    elif case == "short prompt":
        prompt = prompt[:prompt_look.MIN_ROWS]
    else:
        monkeypatch.setattr(AdaptivePolicy, "wants_prompt_look", lambda self, greedy=False: False)
    assert len(decode(target, draft, prompt, **options)) == 8
    assert seen == []


def test_the_look_replaces_the_guess_and_keeps_its_weight():
    policy = AdaptivePolicy(acceptance_prior=0.5)
    before = policy.source("draft")
    weight = before.accepted + before.rejected
    policy.observe_prompt_look("draft", 0.2, 32)
    after = policy.source("draft")
    assert after.acceptance == pytest.approx(0.2) and after.looked
    assert after.accepted + after.rejected == pytest.approx(weight)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text", "qwen3_5-q4", "nemotron_h"])
def test_a_block_drafters_look_on_hybrid_sliding_and_quantized_targets(tmp_path, monkeypatch,
                                                                       family):
    """A Gated-DeltaNet hybrid, a sliding-window target, a quantized one: the look equals,
    anchor by anchor, a drafter fed the taps of the target's own whole-prompt forward up to
    the anchor and asked for one block (block_rows: the rounds' path, not the batched one),
    against the target's own logits; a Mamba hybrid too (nemotron_h: its trunk is
    `backbone`)."""
    from dflash_tiny import make_dflash
    from families import shared_family

    from mlx_spec.dflash import tapped
    from mlx_spec.dflash.taps import concatenated
    from mlx_spec.drafters import DFlashDrafter

    name, _, quant = family.partition("-q")
    target = shared_family(name, seed=2, quantize_bits=int(quant) if quant else None)
    drafter = make_dflash(tmp_path / "d", 32, [0, 2], block_size=6, seed=5,
                          layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    prompt = prompt_of(14, seed=4)
    seen = looked(monkeypatch)
    assert len(decode(target, drafter, prompt)) == 8
    n = len(prompt)
    assert [(s, r) for s, _, r in seen] == [("dflash", n - 2)]
    ids = drafter.dflash_config.target_layer_ids
    with tapped(target, ids) as outputs:
        target_logits = target(mx.array([prompt[:-1]]))[0]
    taps = concatenated(outputs, ids)
    draft_logits = []
    for a in range(1, n - 1):  # anchored at a: the context is the taps before a
        one = DFlashDrafter(drafter, target, SamplingConfig(temp=0.7))
        one.follow(prompt[1:a + 1], taps[:a])
        draft_logits.append(one.head(one.block_rows(prompt[:a + 1])[0, 1]))
    expected = numpy_chances(target_logits[1:], mx.stack(draft_logits), 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("n,step,tail,expected", [
    (31, 512, 16, [(0, 31)]), (127, 512, 16, [(0, 127)]), (128, 512, 16, [(0, 112), (112, 128)]),
    (10, 512, 16, [(0, 10)]), (5, 512, 0, [(0, 5)]), (600, 512, 32, [(0, 512), (512, 600)]),
    (1100, 512, 16, [(0, 512), (512, 1024), (1024, 1100)]),
    (1200, 512, 16, [(0, 512), (512, 1024), (1024, 1184), (1184, 1200)]),
    (700, 512, 600, [(0, 188), (188, 700)]), (0, 512, 16, [])])
def test_the_looks_rows_are_the_prefills_last_chunk(n, step, tail, expected):
    """With a look the prompt's last rows are a chunk of their own (at most a step) when the
    chunk they would end is long (TAIL_CHUNK_FROM), so only they run past the caches' keys and
    values; a short one stays whole (a forward costs more); chunks tile the prompt in order."""
    bounds = chunks(n, step, tail)
    assert bounds == expected
    assert all(end - start <= step for start, end in bounds)


def test_the_look_comes_after_the_first_token(pair, monkeypatch):
    """The first token does not wait for the look: it is handed to the policy after the first
    token, before the first drafted round."""
    target, draft = pair
    seen = looked(monkeypatch)
    steps = speculative_generate_step(prompt_of(30), target, draft, max_tokens=12,
                                      sampling=SamplingConfig(temp=0.7), calibration=None,
                                      prompt_lookup=False)
    next(steps)
    assert seen == []
    for round_ in steps:
        assert round_.num_drafted == 0 or seen, "a drafted round before the look"
    assert [s for s, _, _ in seen] == ["draft"]


def test_a_draft_the_model_finds_hopeless_is_not_looked_at(pair, monkeypatch):
    """A draft whose timed step costs more than a target step loses even with every draft kept:
    it is off at its first question, and its look is never computed. Negative control: a cheap
    step, and it is."""
    target, draft = pair
    seen = []  # (the policy's own still_looks: not `looked`)
    original = AdaptivePolicy.observe_prompt_look
    monkeypatch.setattr(AdaptivePolicy, "observe_prompt_look", lambda self, source, a, rows, **o: (
        seen.append((source, a, rows)), original(self, source, a, rows, **o)))
    monkeypatch.setattr(AdaptivePolicy, "look_rows", lambda self, per_token, tokens, most: most)
    monkeypatch.setattr(AdaptivePolicy, "observe_draft_step",
                        lambda self, source, seconds: self.step_seconds.update({source: 10.0}))
    decode(target, draft, prompt_of(30))
    assert seen == []
    monkeypatch.setattr(AdaptivePolicy, "observe_draft_step",
                        lambda self, source, seconds: self.step_seconds.update({source: 1e-6}))
    decode(target, draft, prompt_of(30))
    assert [s for s, _, _ in seen] == ["draft"]


@pytest.mark.parametrize("per_token,step,tokens,rows", [
    (0.001, 0.01, 96, 28),  # a budget of 0.02 * 96 * 10 = 19.2 prompt tokens: (19.2 - 8) / 0.4
    (0.003, 0.01, 96, 0),  # 6.4 tokens: not even the fixed part
    (0.002, 0.01, 96, 4),  # 9.6 tokens: 4 rows (the look's least)
    (0.0021, 0.01, 96, 2),  # ... 2 rows: below MIN_ROWS, the loop takes no look
    (0.003, 0.01, 512, 32),  # a long reply buys them all
    (None, 0.01, 96, 32), (0.001, None, 96, 32)])  # nothing timed: every row gathered
def test_the_looks_rows_are_what_its_share_of_the_reply_buys(monkeypatch, per_token, step,
                                                             tokens, rows):
    policy = AdaptivePolicy()
    monkeypatch.setattr(AdaptivePolicy, "plain_seconds", step)
    assert policy.look_rows(per_token, tokens, 32) == rows


def test_the_loop_looks_over_the_rows_its_budget_buys(pair, monkeypatch):
    """The loop hands policy.look_rows the target's prefill time per token and max_tokens (the
    policy knows its plain step), and the look compares that many of the prompt's last rows (their
    chances checked against numpy over the last 5); no look when it buys fewer than
    MIN_ROWS."""
    target, draft = pair
    prompt = prompt_of(40)
    seen = looked(monkeypatch)
    asked = []

    def affordable(self, per_token, tokens, most):
        asked.append((per_token, self.plain_seconds, tokens, most))
        return budget
    monkeypatch.setattr(AdaptivePolicy, "look_rows", affordable)
    budget = 5
    decode(target, draft, prompt, max_tokens=12)
    (per_token, step, tokens, most), = asked
    assert per_token > 0 and step > 0 and (tokens, most) == (12, prompt_look.ROWS)
    assert [(s, r) for s, _, r in seen] == [("draft", 5)]
    x = mx.array([prompt[:-1]])
    expected = numpy_chances(target(x)[0, -5:], draft(x)[0, -5:], 0.7).mean()
    assert seen[0][1] == pytest.approx(expected, abs=1e-4)
    budget = prompt_look.MIN_ROWS - 1
    decode(target, draft, prompt, max_tokens=12)
    assert len(seen) == 1  # (no second look)


def test_a_tail_runs_its_output_layer_over_the_rows_asked_for_only(pair, monkeypatch):
    """A draft model's prompt rows (prompt_look.Tail): the last r rows of its logits, computed
    from its kept hidden states when asked for, its output layer run over those r rows only
    (the shapes it was handed are recorded), at most the rows it kept."""
    from mlx_spec.drafters.draft_model import DraftModelDrafter
    target, draft = pair
    handed = []

    def recording_split(model):
        trunk, head = split_target(model)

        def recorded(hidden):
            handed.append(hidden.shape[0])
            return head(hidden)
        return trunk, recorded
    monkeypatch.setattr(prompt_look, "split_target", recording_split)
    prompt = prompt_of(30)
    drafter = DraftModelDrafter(draft, SamplingConfig(temp=0.7), draft.args.vocab_size)
    drafter.prefill(prompt, 512, look_rows=16)
    tail = drafter.prompt_logits(8)
    assert tail.count == 8 and drafter.prompt_logits(8) is None  # (once)
    full = draft(mx.array([prompt[:-1]]))[0]
    for r, expected in ((3, 3), (8, 8), (20, 8)):
        rows = tail.rows(r)
        assert rows.shape[0] == expected
        np.testing.assert_allclose(np.array(rows), np.array(full[-expected:]), atol=1e-4)
    assert handed[-3:] == [3, 8, 8]  # (before them: the prefill forward's own last row)


def test_the_budget_decides_the_look_in_the_loop(pair, monkeypatch):
    """The policy's own budget, as shipped: a share of the reply that buys every row gives a look
    over all of them; one that buys fewer than MIN_ROWS gives none."""
    target, draft = pair
    prompt = prompt_of(40)
    budgeted = AdaptivePolicy.look_rows
    seen = looked(monkeypatch)
    monkeypatch.setattr(AdaptivePolicy, "look_rows", budgeted)
    monkeypatch.setattr(policy_module, "LOOK_SHARE", 1e6)
    decode(target, draft, prompt, max_tokens=12)
    assert [(s, r) for s, _, r in seen] == [("draft", prompt_look.ROWS)]
    monkeypatch.setattr(policy_module, "LOOK_SHARE", 1e-6)
    decode(target, draft, prompt, max_tokens=12)
    assert len(seen) == 1
