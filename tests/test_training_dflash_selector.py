"""The candidate-selector stage (training/dflash_selector.py) writes a DFlash2 drafter that
mlx-spec runs as trained.

- Written with a zero hidden projection, the DFlash2 drafter drafts exactly what the DFlash
  drafter it came from drafts (its convolutions pass their input through).
- The walk training measures acceptance with equals `CandidateSelector.walk` on the written
  drafter at the same anchors (a predecessor or a row off by one fails).
- Training lowers the loss on rows whose next token depends on the token before them.
"""

import mlx.core as mx
import numpy as np
import pytest
from test_training_dflash import BLOCK, MASK, TAPS, drafter_for

from training import dflash as training
from training import dflash_selector as stage

from mlx_spec.dflash import load_dflash
from mlx_spec.drafters.dflash2 import DFlash2Drafter
from mlx_spec.generate import speculative_generate_step
from mlx_spec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def target():
    return training.load_target()


@pytest.fixture(scope="module")
def drafter(target):
    config = training.drafter_config(target, TAPS, 2, BLOCK, MASK)
    config["is_causal"] = True
    return drafter_for(target, True), config


def written(tmp_path, drafter, selector, top_k):
    model, config = drafter
    out = tmp_path / "dflash2"
    stage.save(out, stage.dflash2_config(config, selector, top_k),
               stage.dflash2_weights(model, selector))
    loaded = load_dflash(str(out))
    loaded.set_dtype(mx.float32)
    return loaded


def test_a_zero_projection_drafts_what_the_dflash_drafter_drafts(tmp_path, target, drafter):
    mx.random.seed(0)
    selector = stage.Selector(256, 4096, 8)  # projection zero: scores are the logits
    dflash2 = written(tmp_path, drafter, selector, 4)
    assert dflash2.dflash_config.dflash2 is not None and stage.passes_through(dflash2)
    assert all(conv.skipped for conv in dflash2.convolutions())  # loading noticed: not run
    model, _ = drafter
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 4000, size=24)]

    def rounds(d):
        return [(r.num_drafted, r.num_accepted, r.tokens) for r in speculative_generate_step(
            prompt, target, d, max_tokens=40, num_draft_tokens=5, prompt_lookup=False,
            sampling=SamplingConfig(), calibration=None)]

    ours, theirs = rounds(dflash2), rounds(model)
    assert ours == theirs
    assert any(n for n, _, _ in ours)  # it drafted


def test_trainings_walk_is_the_selector_mlx_spec_runs(tmp_path, target, drafter):
    mx.random.seed(1)
    selector = stage.Selector(256, 4096, 8)
    selector.hidden_projection.weight = mx.random.normal((8, 256)) * 0.5  # a strong selector
    dflash2 = written(tmp_path, drafter, selector, 4)
    model, config = drafter
    sequences = np.random.default_rng(1).integers(0, 4000, size=(2, 40))
    anchors = np.array([[6, 19, 25], [9, 14, 30]])
    features, _ = training.target_rows(target, sequences, TAPS)
    data = stage.block_features(model, target, sequences, features, anchors, BLOCK - 1, 4,
                                config["rope_theta"], MASK)
    drafts = stage.walk(selector, data).reshape(*anchors.shape, BLOCK - 1)
    plain = stage.walk(None, data).reshape(*anchors.shape, BLOCK - 1)
    assert (drafts != plain).any()  # the selector changed some drafts
    for i in range(len(sequences)):
        for m, c in enumerate(anchors[i]):
            inference = DFlash2Drafter(dflash2, target, SamplingConfig())
            inference.follow([], mx.array(features[i, :c]).astype(mx.float32))
            proposal = inference.propose([int(t) for t in sequences[i, :c + 1]], BLOCK - 1)
            assert np.array(proposal.tokens).tolist() == drafts[i, m].tolist(), (i, c)


def test_training_the_selector_lowers_its_loss():
    """Rows whose label is a fixed function of the token before them, hidden among 4
    candidates with equal logits: only the codebooks can tell them apart."""
    rng = np.random.default_rng(0)
    n, rows, K, H = 512, 3, 4, 16
    previous = rng.integers(0, 32, size=(n, rows))
    candidates = (np.arange(K)[None, None, :] + 4 * (previous % 8)[..., None]) % 32
    labels = candidates[np.arange(n)[:, None], np.arange(rows)[None, :], previous // 8 % K]
    data = {"candidates": candidates, "unary": np.zeros((n, rows, K), np.float32),
            "hidden": np.ones((n, rows, H), np.float16), "previous": previous, "labels": labels}
    mx.random.seed(0)
    selector = stage.Selector(H, 32, 8)
    before = stage.walk(selector, data)
    curve = stage.train(selector, data, 300, 128, 3e-2, 0.0, 3.0, rng, say=lambda m: None)
    after = stage.walk(selector, data)
    assert curve[-1] < 0.5 * curve[0]
    assert (after[:, 0] == labels[:, 0]).mean() > (before[:, 0] == labels[:, 0]).mean() + 0.3


def test_the_kl_term_moves_q_to_the_targets_distribution():
    """With `kl`, softmax(score) over the candidates (what a draft at T = 1 is drawn from)
    approaches the target's distribution there, which depends on the token before."""
    rng = np.random.default_rng(1)
    n, rows, K, H = 512, 2, 4, 8
    previous = rng.integers(0, 16, size=(n, rows))
    candidates = np.broadcast_to(np.arange(K), (n, rows, K)).copy()
    table = rng.normal(0, 1.5, size=(16, K)).astype(np.float32)  # log p by previous token
    target_log_p = table[previous] - np.log(np.exp(table[previous]).sum(-1, keepdims=True))
    data = {"candidates": candidates, "unary": np.zeros((n, rows, K), np.float32),
            "hidden": np.ones((n, rows, H), np.float16), "previous": previous,
            "labels": target_log_p.argmax(-1), "target": target_log_p}

    def divergence(selector):
        log_q = np.array(nn_log_softmax(stage.scores(
            selector, mx.array(candidates), mx.array(data["unary"]),
            mx.array(data["hidden"]).astype(mx.float32), mx.array(previous))))
        return float((np.exp(target_log_p) * (target_log_p - log_q)).sum(-1).mean())

    mx.random.seed(1)
    selector = stage.Selector(H, 16, 8)
    before = divergence(selector)
    stage.train(selector, data, 300, 128, 3e-2, 0.0, 3.0, rng, say=lambda m: None, kl=1.0)
    assert divergence(selector) < 0.5 * before


def nn_log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
