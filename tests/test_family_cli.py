"""Hybrid and sliding-window models through the user's paths: directories loaded by
mlx_lm.load, `mlx-spec generate`, `mlx-spec check` and the benchmark."""

import pytest
from click.testing import CliRunner
from families import write_family_dir

from mlx_spec.cli import main


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: (write_family_dir(root / f"{name}-target", name, seed=0),
                   write_family_dir(root / f"{name}-draft", name, seed=5))
            for name in ("qwen3_5", "nemotron_h", "gpt_oss")}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h", "gpt_oss"])
def test_generate_on_a_hybrid_or_sliding_pair_equals_the_target_alone(family_dirs, name):
    target, draft = family_dirs[name]
    common = ["generate", "--model", target, "-p", "def f(x):", "-n", "40", "-q"]
    plain = run(*common, "--no-draft")
    spec = run(*common, "--draft-model", draft, "-k", "3")
    lookup = run(*common, "--no-draft", "--prompt-lookup")
    assert plain.exit_code == spec.exit_code == lookup.exit_code == 0, spec.output
    assert plain.stdout == spec.stdout == lookup.stdout


def test_check_command_on_a_hybrid_pair(family_dirs):
    target, draft = family_dirs["qwen3_5"]
    result = run("check", "--model", target, "--draft-model", draft, "--samples", "300",
                 "--temp", "1.0")
    assert result.exit_code == 0, result.output


def test_bench_reports_cache_kinds_and_rewind_path(family_dirs):
    from mlx_spec import load
    from mlx_spec.bench import run_bench
    from mlx_spec.bench.report import render_markdown
    from mlx_spec.bench.runner import tiny_config

    target, draft = family_dirs["qwen3_5"]
    target_model, tokenizer = load(str(target))
    draft_model, _ = load(str(draft))
    result = run_bench(target_model, draft_model, tokenizer, tiny_config())
    report = render_markdown(result)
    assert "ArraysCache" in report and "mixers replayed" in report
    assert "n/a" in report  # mlx-lm refuses to speculate on this pair
