"""`mlx-spec tune` and `mlx-spec bench` given a DFlash drafter's directory (tiny models
written by the tests; the drafter in the published layout).

tune measures it (real rounds and acceptance; a block drafter has no per-token
step) and stores it under `dflash_key`, and generate's adaptive policy then
starts from it; bench measures its pass per round instead of a draft step and
writes the block drafter's figures.
"""

import json

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
    assert rounds.policy.prior.knows("dflash")  # its cost line starts from the calibration


def test_bench_measures_the_drafter_as_a_block_drafter(model_dirs, drafter_dir, tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--model", model_dirs["target"], "--draft-model", drafter_dir,
                 "--smoke", "--no-plots", "--json", out)
    assert result.exit_code == 0, result.output
    d = json.loads(out.read_text())
    assert d["draft"] is None  # no per-token draft step: the drafter's pass instead
    block = d["block_drafter"]
    assert block["kind"] == "DFlash block drafter" and block["block_size"] == 6
    ks = sorted(int(k) for k in block["pass_cost"])
    assert ks == sorted({1, 2, 5})  # the smoke k's and the whole block (k + 1 = 6)
    assert all(v > 0 for v in block["pass_s"].values())
    assert all(v > 0 for v in block["pass_cost"].values())
    assert block["rows_by_k"]["5"] == 6
    assert {p["k"] for p in d["acceptance"]} == set(ks)
    for p in d["acceptance"]:
        assert 0 <= p["acceptance_rate"] <= 1 and sum(p["accepted_histogram"]) == p["rounds"]
    assert all(p["rounds"] > 0 for p in d["acceptance"] if p["rule"] == "exact")
    for c in d["end_to_end"]:
        methods = c["methods"]
        assert methods["mlx-spec"]["tokens_per_s"] > 0
        assert methods["mlx-spec defaults"]["tokens_per_s"] > 0
        assert methods["mlx-lm speculative"]["tokens_per_s"] == 0  # n/a, said in `skipped`
        assert c["ratios"]["mlx-spec defaults / target alone"] > 0
    for v in d["verdicts"]:
        assert v["best_k"] in (0, *ks) and v["reason"]
        assert set(int(k) for k in v["predicted_by_k"]) == set(ks)
        if v["pays"]:
            assert f"k={v['best_k']}" in v["reason"] and "DFlash block drafter" in v["reason"]
    assert d["size_scaling"] == [] and "size scaling" in d["skipped"]
    assert "mlx-lm speculative" in d["skipped"]
    assert [p["context_length"] for p in d["context_scaling"]] == d["config"]["context_lengths"]
    assert all(p["draft_cost"] > 0 for p in d["context_scaling"])
    assert "draft k=5" in {r["method"] for r in d["sources"]["results"]}
    report = out.with_suffix(".md").read_text()
    assert "DFlash block drafter: one pass per round" in report
    assert "size scaling: not run:" in report
    rerendered = run("bench", "--rerender", out, "--no-plots")
    assert rerendered.exit_code == 0, rerendered.output
    assert json.loads(out.read_text())["verdicts"] == d["verdicts"]
