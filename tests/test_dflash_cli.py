"""`mlx-spec tune` and `mlx-spec bench` given a DFlash drafter's directory (tiny models
written by the tests; the drafter in the published layout).

tune measures it (real rounds and acceptance; a block drafter has no per-token
step) and stores it under `dflash_key`, and generate's adaptive policy then
starts from it; bench, whose cost model is per-token draft steps, refuses it in
one sentence.
"""

import pytest
from click.testing import CliRunner

from dflash_tiny import dflash_config, write_dflash_dir

from mlx_spec.calibration import dflash_key, load_calibration
from mlx_spec.cli import main
from mlx_spec.dflash import load_dflash
from mlx_spec.generate import speculative_generate_step
from mlx_spec.loading import load


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def target(model_dirs):
    return load(str(model_dirs["target"]))


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    vocab = target[0].args.vocab_size
    return write_dflash_dir(tmp_path_factory.mktemp("dflash") / "d",
                            dflash_config(48, [0, 1], block_size=6, mask_token_id=vocab - 1))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_tune_measures_the_drafter_and_generate_starts_from_it(model_dirs, target, drafter_dir,
                                                               monkeypatch):
    import mlx_spec.bench.calibrate as measure

    monkeypatch.setattr(measure, "VERIFY_LENGTHS", (1, 2, 4, 8))
    monkeypatch.setattr(measure, "PLAIN_RUNS", 1)
    args = ["tune", "--model", model_dirs["target"], "--draft-model", drafter_dir]
    result = run(*args)
    assert result.exit_code == 0, result.output
    assert "DFlash drafter" in result.stdout and "(this draft)" in result.stdout
    target_model = target[0]
    drafter = load_dflash(drafter_dir)
    cost = load_calibration(target_model).drafts[dflash_key(drafter)]
    assert cost.step_s == 0.0  # one block pass per round, timed inside the round
    assert cost.round_s > 0 and cost.acceptance is not None
    shown = run(*args, "--print")
    assert shown.exit_code == 0 and "(this draft)" in shown.stdout

    rounds = speculative_generate_step([1, 2, 3, 4], target_model, drafter, max_tokens=12,
                                       prompt_lookup=False)
    list(rounds)
    assert rounds.policy.describe()["calibrated"] is True
    assert rounds.policy.source("dflash").warm  # its round-cost fit started from the calibration


@pytest.mark.parametrize("extra", [["--quick"], ["--smoke", "--tune"]])
def test_bench_refuses_the_drafter_in_one_sentence(model_dirs, drafter_dir, tmp_path, extra):
    result = run("bench", "--model", model_dirs["target"], "--draft-model", drafter_dir,
                 "--no-plots", "--json", tmp_path / "bench.json", *extra)
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "DFlash drafter" in errors[0] and "mlx-spec tune" in errors[0]
    assert not (tmp_path / "bench.json").exists()
