"""The DFlash training computation (training/dflash.py) is the drafter mlx-spec runs.

Training fills many blocks per sequence at once under one mask; if that
computation differed from `DFlashDrafter.block_rows` (a position, the mask,
causality inside the block), the drafter would learn something inference
never computes and its acceptance would quietly collapse."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import dflash as training  # noqa: E402

from mlx_spec.dflash import DFlashModel, parse_config  # noqa: E402
from mlx_spec.drafters.dflash import DFlashDrafter  # noqa: E402
from mlx_spec.sampling import SamplingConfig  # noqa: E402

TAPS = [1, 3, 4]
BLOCK = 8
MASK = 4095


@pytest.fixture(scope="module")
def target():
    return training.load_target()


def drafter_for(target, causal):
    config = training.drafter_config(target, TAPS, 2, BLOCK, MASK)
    if causal:
        config["is_causal"] = True
    mx.random.seed(3)
    drafter = DFlashModel(parse_config(config))
    training.init_from_target(drafter, target)
    return drafter


def batched_rows(target, drafter, sequences, anchors, length, causal):
    features, _ = training.target_rows(target, sequences, TAPS)
    blocks, _ = training.blocks_at(sequences, anchors, BLOCK, MASK)
    rows = training.block_rows(drafter, target.model.embed_tokens,
                               mx.array(features).astype(mx.float32),
                               mx.array(blocks[..., :length]), mx.array(anchors),
                               target.args.rope_theta, causal)
    return features, np.array(rows).reshape(*anchors.shape, length, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks_at_once_equal_the_drafter_at_inference(target, causal):
    drafter = drafter_for(target, causal)
    sequences = np.random.default_rng(0).integers(0, 4000, size=(2, 48))
    anchors = np.array([[3, 17, 30], [8, 22, 39]])
    features, rows = batched_rows(target, drafter, sequences, anchors, BLOCK, causal)
    for i in range(2):
        for m, c in enumerate(anchors[i]):
            inference = DFlashDrafter(drafter, target, SamplingConfig())
            inference.follow([], mx.array(features[i, :c]).astype(mx.float32))
            expected = np.array(inference.block_rows([int(t) for t in sequences[i, :c + 1]]))[0]
            np.testing.assert_allclose(rows[i, m], expected, atol=1e-4)


def test_a_causal_block_cut_short_is_the_start_of_the_whole_block(target):
    """What lets training run short blocks: with is_causal, rows 0..b-1 do not depend on the
    rows after them. (Bidirectional blocks do, so a cut changes them: the control.)"""
    sequences = np.random.default_rng(1).integers(0, 4000, size=(1, 40))
    anchors = np.array([[6, 19, 25]])
    for causal in (True, False):
        drafter = drafter_for(target, causal)
        _, whole = batched_rows(target, drafter, sequences, anchors, BLOCK, causal)
        _, short = batched_rows(target, drafter, sequences, anchors, 3, causal)
        same = np.allclose(whole[..., :3, :], short, atol=1e-4)
        assert same == causal


def test_sampled_training_text_is_drawn_from_the_target(target):
    """`--sampled-sequences`: continuations drawn at T = 1 (seeded) follow the target's own
    distribution (the first token's frequency of the target's top token matches its
    probability within 4 standard errors); temp 0 is the greedy continuation."""
    prompt = np.random.default_rng(2).integers(0, 4000, size=(1, 3))  # short: 512 forwards
    prompts = np.repeat(prompt, 512, axis=0)
    p = mx.softmax(target(mx.array(prompt))[0, -1], axis=-1)
    top = int(mx.argmax(p))
    greedy = training.generate(target, prompts[:2], 1)
    assert (greedy[:, -1] == top).all()
    drawn = training.generate(target, prompts, 1, temp=1.0, seed=5)[:, -1]
    again = training.generate(target, prompts[:64], 1, temp=1.0, seed=5)[:, -1]
    assert (again == training.generate(target, prompts[:64], 1, temp=1.0, seed=5)[:, -1]).all()
    rate, chance = float((drawn == top).mean()), float(p[top])
    assert 0.05 < chance < 0.95  # a distribution to sample, not a point mass
    assert abs(rate - chance) < 4 * np.sqrt(chance * (1 - chance) / len(drawn))


def test_grown_layers_start_as_the_identity_and_then_learn(target):
    """`--grow`: the appended layers leave the drafter's rows unchanged at first (o_proj and
    down_proj zero), yet are real layers: once moved off zero the rows change."""
    drafter = drafter_for(target, True)
    drafter.set_dtype(mx.float32)
    config = training.drafter_config(target, TAPS, 2, BLOCK, MASK)
    config["is_causal"] = True
    grown, grown_config = training.grown(drafter, config, 2, target)
    assert len(grown.layers) == 4 and grown_config["num_hidden_layers"] == 4
    sequences = np.random.default_rng(2).integers(0, 4000, size=(1, 40))
    anchors = np.array([[9, 21]])
    _, before = batched_rows(target, drafter, sequences, anchors, BLOCK, True)
    _, after = batched_rows(target, grown, sequences, anchors, BLOCK, True)
    np.testing.assert_allclose(after, before, atol=1e-5)
    grown.layers[3].mlp.down_proj.weight = mx.ones_like(grown.layers[3].mlp.down_proj.weight)
    _, moved = batched_rows(target, grown, sequences, anchors, BLOCK, True)
    assert not np.allclose(moved, before, atol=1e-3)
