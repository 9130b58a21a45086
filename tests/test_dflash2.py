"""DFlash2 block drafters: the published layout loads, the convolutions and the candidate
selector compute what the format says (checked against a from-scratch forward), output is
exact at every temperature, bad input is one sentence."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_tiny import dflash2_config, make_dflash2, write_dflash_dir
from families import shared_family, shared_plain_greedy
from test_dflash import (check_the_api_and_the_command_line_take, from_scratch_block_rows,
                         sampled_exactness, target_vocab)
from tiny import make_llama, shared_llama

from mlx_spec.acceptance import resample_from_target_accept
from mlx_spec.dflash import DFlash2Model, check_fits, load_dflash, parse_config
from mlx_spec.drafters import DFlash2Drafter
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig

PROMPT = [1, 2, 3, 4, 5, 6, 7]
EXTRAS = {"output_multiplier": 0.7, "final_logit_softcapping": 4.0,
          "input_embedding_scale": 1.5}


@pytest.fixture(scope="module")
def llama_target():
    return make_llama(layers=4, seed=0)


def tokens_of(rounds):
    return [t for r in rounds for t in r.tokens]


# --- the published layout -------------------------------------------------------------

def test_the_published_layout_loads_into_every_parameter(tmp_path):
    config = dflash2_config(48, [1, 2], block_size=6, extra=EXTRAS)
    drafter = load_dflash(write_dflash_dir(tmp_path / "d", config, seed=4))
    assert isinstance(drafter, DFlash2Model)
    parts = drafter.dflash_config.dflash2
    assert (parts.conv_kernel_size, parts.conv_group_size, parts.selector_rank,
            parts.selector_top_k, parts.vocab_size) == (2, 8, 8, 4, 64)
    assert (parts.output_multiplier, parts.final_logit_softcapping,
            parts.input_embedding_scale) == (0.7, 4.0, 1.5)
    assert drafter.dflash_config.causal(0) is False  # top-level is_causal false, as published
    written = mx.load(str(tmp_path / "d" / "model.safetensors"))
    loaded = dict(tree_flatten(drafter.parameters()))
    assert loaded.keys() == written.keys()  # the codebooks without `.weight`, as published
    for name in ("candidate_selector.predecessor_codebook", "layers.1.mlp_conv.base_kernel",
                 "layers.0.attention_conv.kernel_projection.weight"):
        assert mx.array_equal(loaded[name], written[name]), name


@pytest.mark.parametrize("edit, sentence", [
    (lambda c: c["dflash_config"].pop("conv_kernel_size"), "needs dflash_config.conv_kernel_size"),
    (lambda c: c["dflash_config"].pop("selector_top_k"), "needs dflash_config.selector_top_k"),
    (lambda c: c.pop("vocab_size"), "needs vocab_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=7), "conv_group_size 7 does not divide"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=9), "conv_kernel_size 9 is longer than"),
    (lambda c: c["dflash_config"].update(selector_top_k=65), "selector_top_k 65 exceeds"),
    (lambda c: c["dflash_config"].update(output_multiplier=-1), "output_multiplier must be a pos"),
])
def test_a_config_it_cannot_use_is_one_sentence(edit, sentence):
    config = dflash2_config(48, [1, 2])
    edit(config)
    with pytest.raises(ValueError, match=sentence):
        parse_config(config)


@pytest.mark.parametrize("case, sentence", [
    ("missing", "lacks candidate_selector.successor_codebook; it is not in the DFlash2DraftModel"),
    ("kernel", "layers.0.attention_conv.base_kernel has shape \\(2, 3, 48\\), the config says "
               "\\(2, 2, 48\\)"),
    ("projection", "layers.1.mlp_conv.kernel_projection.weight has shape \\(12, 48\\), the "
                   "config says \\(24, 48\\)"),
    ("dflash1", "holds an unexpected weight candidate_selector"),
])
def test_weights_not_in_the_layout_are_one_sentence(tmp_path, case, sentence):
    config = dflash2_config(48, [1, 2])
    kwargs = {"missing": {"drop": ["candidate_selector.successor_codebook"]},
              "kernel": {"extra": {"layers.0.attention_conv.base_kernel": mx.zeros((2, 3, 48))}},
              "projection": {"extra": {"layers.1.mlp_conv.kernel_projection.weight":
                                       mx.zeros((12, 48))}},
              "dflash1": {}}[case]
    path = write_dflash_dir(tmp_path / case, config, **kwargs)
    if case == "dflash1":  # DFlash2 weights under a DFlashDraftModel config
        config["architectures"] = ["DFlashDraftModel"]
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=sentence):
        load_dflash(path)


def test_a_selector_for_another_vocabulary_is_refused(tmp_path, llama_target):
    drafter = make_dflash2(tmp_path / "d", 48, [1], vocab_size=60, mask_token_id=59)
    sentence = "candidate selector covers 60 tokens and the target's vocabulary has 64"
    with pytest.raises(ValueError, match=sentence):
        check_fits(drafter, llama_target)


def test_a_drafter_left_at_the_default_scale_takes_the_targets(tmp_path):
    """As the reference's `bind`: multiplier 1 and no cap in the config mean the target's own
    output_multiplier and soft cap, when its args have them (their head's output is unscaled)."""
    scaled = make_llama(layers=4, seed=0)
    scaled.args.output_multiplier, scaled.args.final_logit_softcapping = 0.5, 3.0
    plain = make_llama(layers=4, seed=0)
    default = make_dflash2(tmp_path / "a", 48, [1])
    own = make_dflash2(tmp_path / "b", 48, [1], extra=EXTRAS)
    scale = {(name, target_name): DFlash2Drafter(drafter, target, SamplingConfig()).logit_scale
             for name, drafter in (("default", default), ("own", own))
             for target_name, target in (("scaled", scaled), ("plain", plain))}
    assert scale == {("default", "scaled"): (0.5, 3.0), ("default", "plain"): (1.0, None),
                     ("own", "scaled"): (0.7, 4.0), ("own", "plain"): (0.7, 4.0)}


# --- the drafter against a from-scratch forward -----------------------------------------

def dense_conv(W, name, h, x, side, group):
    """Layer conv `name` applied to x (B, H), its dynamic taps projected from h (B, H):
    out[t] = sum_o (base[side, o] + dynamic[t, side, o, group]) * x[t - o], nothing before t=0."""
    base = W[name + ".base_kernel"][side]  # (K, H)
    taps = base.shape[0]
    dynamic = (h @ W[name + ".kernel_projection.weight"].T).reshape(len(h), 2, taps, -1)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for o in range(min(taps, t + 1)):
            out[t] += (base[o] + np.repeat(dynamic[t, side, o], group)) * x[t - o]
    return out


def from_scratch_drafts(target, drafter, history, k, tokens, temp):
    """The selector's walk over the block after `history`, densely: the greedy tokens (temp 0)
    or q (k, V) given the drafted `tokens` (temp > 0)."""
    config = drafter.dflash_config
    parts = config.dflash2
    W = {n: np.array(v, dtype=np.float64) for n, v in tree_flatten(drafter.parameters())}

    def around(i, kind, sublayer, h):
        name = f"layers.{i}.{'attention' if kind == 'attention' else 'mlp'}_conv"
        inner = dense_conv(W, name, h, h, 0, parts.conv_group_size)
        return dense_conv(W, name, h, sublayer(inner), 1, parts.conv_group_size)

    rows = from_scratch_block_rows(target, drafter, history, around,
                                   embed_scale=parts.input_embedding_scale)[1:k + 1]
    logits = rows @ np.array(target.lm_head.weight, dtype=np.float64).T * parts.output_multiplier
    logits = np.tanh(logits / parts.final_logit_softcapping) * parts.final_logit_softcapping
    projected = rows @ W["candidate_selector.hidden_projection.weight"].T  # (k, rank)
    previous, greedy, q = history[-1], [], np.zeros_like(logits)
    for i in range(k):
        candidates = np.argsort(-logits[i])[:parts.selector_top_k]
        scores = logits[i, candidates] + W["candidate_selector.successor_codebook"][candidates] @ (
            W["candidate_selector.predecessor_codebook"][previous] * projected[i])
        if temp == 0:
            previous = int(candidates[np.argmax(scores)])
            greedy.append(previous)
        else:
            q[i, candidates] = np.exp(scores / temp - (scores / temp).max())
            q[i] /= q[i].sum()
            if tokens is not None:  # (None: q of the first row alone, after history[-1])
                assert tokens[i] in candidates
                previous = tokens[i]
    return greedy if temp == 0 else q


class Recording(DFlash2Drafter):
    """The drafter, noting each proposal's history, tokens and q."""

    proposals = []

    def propose(self, history, k):
        proposal = super().propose(history, k)
        if proposal is not None:
            Recording.proposals.append((list(history), k, np.array(proposal.tokens).tolist(),
                                        proposal.probs))
        return proposal


@pytest.mark.parametrize("layout, temp", [("bidirectional", 1.0), ("sliding", 0.8),
                                          ("sliding", 0.0), ("causal", 0.0), ("causal", 1.0)])
def test_each_block_equals_a_from_scratch_forward(tmp_path, llama_target, monkeypatch, layout,
                                                  temp):
    """Over real rounds with rejections: every proposal's drafts (greedy) or q (sampling)
    equal a dense forward with explicit convolution loops, the context at every kept position,
    the scales and the soft cap, and the selector's walk from the last known token (a
    convolution, position, tap or predecessor off by one fails). A causal drafter runs only
    the block's first k + 1 rows; the forward here runs the whole block."""
    from mlx_spec import assemble

    kwargs = {"bidirectional": {}, "sliding": dict(layer_types=["sliding_attention",
                                                                "full_attention"],
                                                   sliding_window=4, is_causal=None),
              "causal": dict(is_causal=True)}[layout]
    drafter = make_dflash2(tmp_path / layout, 48, [1, 3], block_size=5, conv_kernel_size=3,
                           extra=EXTRAS, **kwargs)
    monkeypatch.setattr(assemble, "DFlash2Drafter", Recording)
    Recording.proposals = []
    mx.random.seed(3)
    rounds = list(speculative_generate_step(PROMPT, llama_target, drafter, max_tokens=24,
                                            num_draft_tokens=3, sampling=SamplingConfig(temp=temp),
                                            prompt_lookup=False, calibration=None))
    assert any(r.num_drafted > r.num_accepted for r in rounds[:-1])  # rejections happened
    assert len(Recording.proposals) >= 4
    for history, k, tokens, probs in Recording.proposals:
        expected = from_scratch_drafts(llama_target, drafter, history, k, tokens, temp)
        if temp == 0:
            assert tokens == expected and probs is None, len(history)
        else:
            assert np.allclose(np.array(probs), expected, atol=2e-4), len(history)


# --- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("family, k", [("llama", None), ("llama", 1), ("llama", 4),
                                       ("qwen3_5", 3), ("gemma3_text", 2)])
def test_greedy_output_is_the_targets_own(tmp_path, family, k):
    """Plain, hybrid (Gated DeltaNet) and sliding-window targets, adaptive and fixed k."""
    if family == "llama":
        target, hidden = shared_llama(layers=4, seed=2), 48
    else:
        target, hidden = shared_family(family, seed=2), 32
    drafter = make_dflash2(tmp_path / "d", hidden, [0, 2], block_size=6, seed=5, extra=EXTRAS,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    expected = shared_plain_greedy(target, PROMPT, 100)
    rounds = list(speculative_generate_step(PROMPT, target, drafter, max_tokens=100,
                                            num_draft_tokens=k, calibration=None))
    assert tokens_of(rounds) == expected
    assert any(r.source == "dflash" for r in rounds), "the drafter proposed nothing"
    if k is not None:  # exactly k wherever max_tokens leaves room
        emitted = 0
        for r in rounds:
            if r.source == "dflash":
                assert r.num_drafted == min(k, 100 - emitted)
            emitted += len(r.tokens)


class FullSoftmaxQ(DFlash2Drafter):
    """BROKEN on purpose: the selector's drafts, but q as if they were drawn from the whole
    softmax of the logits (the negative control for q over the candidates only)."""

    def draw(self, rows, anchor):
        tokens, _ = super().draw(rows, anchor)
        return tokens, mx.softmax(self.logits(rows) / self.sampling.temp, axis=-1)


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    """A target over 8 tokens and a drafter choosing among 3 of them per position."""
    target = make_llama(vocab_size=8, layers=4, seed=0)
    drafter = make_dflash2(tmp_path_factory.mktemp("dflash2_8") / "d", 48, [1, 2], block_size=6,
                           vocab_size=8, mask_token_id=7, selector_top_k=3, extra=EXTRAS)
    return target, drafter


# 400 samples (a DFlash2 sample costs ~4x a DFlash one): at 400 the broken rule's chi-square
# has noncentrality ~89 on 12 dof and is missed with probability ~5e-6, the full-softmax q's
# ~415 (missed ~1e-51); from 800-sample runs. Each exact test fails falsely with probability
# 1e-3 (alpha) whatever the count.
SAMPLES = 400
# The full-softmax q's control needs far fewer: at 100 samples it fails at p < 1e-16 for each
# of seeds 0-4 (statistic 84-105 on 4 dof); a test that catches it at 100 catches it at 400.
Q_CONTROL_SAMPLES = 100


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_matches_the_targets_distribution(small_vocab_pair, k):
    """k = 1: the second token comes from the second round, after the first one's rejection
    or acceptance (q restricted to 3 of 8 tokens, so the residual outside them matters);
    k = 3: from inside the first block, its q rows each given the draft before."""
    result = sampled_exactness(small_vocab_pair, k, samples=SAMPLES)
    assert result.acceptance_rate > 0.2 and result.passed, result


@pytest.mark.parametrize("broken", ["rule", "q"])
def test_the_chi_square_catches_a_broken_rule_or_q(small_vocab_pair, monkeypatch, broken):
    from mlx_spec import assemble

    if broken == "q":
        monkeypatch.setattr(assemble, "DFlash2Drafter", FullSoftmaxQ)
    result = sampled_exactness(small_vocab_pair, 1, accept=resample_from_target_accept
                               if broken == "rule" else None,
                               samples=SAMPLES if broken == "rule" else Q_CONTROL_SAMPLES)
    assert not result.passed, result


# --- where a draft is accepted, a DFlash2 drafter works ------------------------------------

def test_the_api_and_the_command_line_take_the_drafters_directory(model_dirs, tmp_path):
    vocab = target_vocab(model_dirs)
    config = dflash2_config(48, [0, 1], vocab_size=vocab, mask_token_id=vocab - 1)
    check_the_api_and_the_command_line_take(model_dirs, write_dflash_dir(tmp_path / "d", config))
