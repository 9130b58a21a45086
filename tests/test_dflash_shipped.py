"""The DFlash drafter shipped for the shipped target (mlx_spec/default_models/dflash, trained by
`python -m training.dflash`, then given DFlash2's candidate selector by
`python -m training.dflash_selector`): found by the name "dflash", exact, actually trained, and its
acceptance is what training's held-out simulation says it is."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import dflash as training  # noqa: E402
from training import dflash_selector as selector_stage  # noqa: E402

from mlx_spec import generate, load  # noqa: E402
from mlx_spec.cli import main  # noqa: E402
from mlx_spec.default_models import DEFAULT_DFLASH_PATH  # noqa: E402
from mlx_spec.dflash import check_fits, load_dflash  # noqa: E402
from mlx_spec.generate import speculative_generate_step  # noqa: E402
from mlx_spec.sampling import SamplingConfig  # noqa: E402

PROMPT = "def read_lines(path):\n    "


@pytest.fixture(scope="module")
def shipped():
    target, tokenizer = load()
    return target, tokenizer, load_dflash("dflash")


def test_the_name_dflash_is_the_shipped_drafter_in_the_published_layout(shipped):
    config = shipped[2].dflash_config
    assert (DEFAULT_DFLASH_PATH / "config.json").is_file()
    assert config.target_layer_ids == (1, 3, 4) or list(config.target_layer_ids) == [1, 3, 4]
    assert config.is_causal and config.block_size == 16 and config.mask_token_id == 4095
    # DFlash2DraftModel: one-tap pass-through convolutions and a trained candidate selector
    assert config.dflash2.conv_kernel_size == 1 and config.dflash2.selector_top_k == 16
    assert selector_stage.passes_through(shipped[2])
    assert float(mx.abs(shipped[2].candidate_selector.hidden_projection.weight).max()) > 0


def test_greedy_text_is_the_targets_and_drafts_are_accepted(shipped):
    target, tokenizer, drafter = shipped
    ids = tokenizer.encode(PROMPT)

    def tokens(draft_model, k):
        rounds = list(speculative_generate_step(ids, target, draft_model, max_tokens=40,
                                                num_draft_tokens=k, prompt_lookup=False,
                                                sampling=SamplingConfig(), calibration=None))
        return [t for r in rounds for t in r.tokens], rounds

    plain, _ = tokens(None, None)
    spoken, rounds = tokens("dflash", 3)
    assert spoken == plain
    assert generate(target, tokenizer, PROMPT, max_tokens=40, draft_model="dflash",
                    prompt_lookup=False) == generate(target, tokenizer, PROMPT, max_tokens=40,
                                                     draft_model=None, prompt_lookup=False)
    # a trained drafter: a random one of this vocabulary accepts next to nothing
    accepted = sum(r.num_accepted for r in rounds)
    assert accepted >= 0.3 * sum(r.num_drafted for r in rounds) > 0  # 22 of 52 measured


def test_accepted_lengths_are_trainings_simulation(shipped):
    """Each round at fixed k accepts min(k, leading rows of the block that equal the target's
    greedy tokens), as computed by training's batched block pass at the round's anchor: the
    held-out figures training reports are the rounds mlx-spec runs."""
    target, tokenizer, drafter = shipped
    ids = tokenizer.encode(PROMPT)
    k = 7
    rounds = list(speculative_generate_step(ids, target, drafter, max_tokens=48,
                                            num_draft_tokens=k, prompt_lookup=False,
                                            sampling=SamplingConfig(), calibration=None))
    sequence = np.array([ids + [t for r in rounds for t in r.tokens]])
    config = drafter.dflash_config
    features, _ = training.target_rows(target, sequence, list(config.target_layer_ids))
    position = len(ids) + len(rounds[0].tokens)  # the first round is the prefill's token
    anchors, counts = [], []
    for r in rounds[1:]:
        if r.num_drafted == k and position + k < sequence.shape[1]:
            anchors.append(position - 1)
            counts.append(r.num_accepted)
        position += len(r.tokens)
    anchors = np.array([anchors])
    blocks, labels = training.blocks_at(sequence, anchors, k + 1, config.mask_token_id)
    drafter.set_dtype(mx.float32)
    try:  # the drafter's rows, then its selector's walk (training's)
        data = selector_stage.block_features(drafter, target, sequence, features, anchors, k,
                                             config.dflash2.selector_top_k, config.rope_theta,
                                             config.mask_token_id)
        guess = selector_stage.walk(drafter.candidate_selector, data)
    finally:
        drafter.set_dtype(mx.float16)
    leading = np.cumprod(guess == labels[0, :, 1:], axis=1).sum(axis=1)
    assert len(counts) >= 5
    assert list(leading) == counts


def test_the_command_line_takes_the_name_and_a_foreign_target_is_one_sentence(shipped,
                                                                               target_model):
    result = CliRunner().invoke(main, ["generate", "--draft-model", "dflash", "--prompt", PROMPT,
                                       "--max-tokens", "24", "--temp", "0"])
    plain = CliRunner().invoke(main, ["generate", "--no-draft", "--prompt", PROMPT,
                                      "--max-tokens", "24", "--temp", "0"])
    assert result.exit_code == 0, result.output
    assert plain.output.split("\n")[0] in result.output
    with pytest.raises(ValueError) as error:
        check_fits(shipped[2], target_model)
    assert str(error.value).count(".") <= 2 and "\n" not in str(error.value)
