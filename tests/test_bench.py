"""`mlx-spec bench` runs end to end on tiny models and writes well-formed output.

No speed thresholds: only that every phase runs and every figure is there.
"""

import json

import pytest
from click.testing import CliRunner

from mlx_spec.bench import run_bench, tiny_config
from mlx_spec.cli.bench import bench
from mlx_spec.bench.forward import knee
from mlx_spec.bench.machine import blas_library
from mlx_spec.bench.report import render_markdown, render_text
from mlx_spec.loading import load

EXPECTED_KEYS = {
    "config", "models", "machine", "bandwidth", "target", "draft", "acceptance", "end_to_end",
    "speedup_vs_k", "verdicts", "context_scaling", "size_scaling", "batch_scaling", "elapsed_s",
    "sources", "tree_race",
}


@pytest.fixture(scope="module")
def tiny_result(model_dirs):
    """The target drafting for itself: every acceptance figure is known exactly."""
    target_model, tokenizer = load(str(model_dirs["target"]))
    return run_bench(target_model, target_model, tokenizer, tiny_config())


def test_run_bench_measures_every_phase(tiny_result):
    r, config = tiny_result, tiny_result.config
    assert r.target.verify_cost[1] == 1.0
    assert set(config.verify_lengths) <= set(r.target.verify_cost)
    assert r.bandwidth.read_gbs > 0 and r.bandwidth.copy_gbs > 0
    # Every (k, T) point; at T > 0 also the token-match rule.
    assert len(r.acceptance) == len(config.ks) * (1 + 2 * sum(t > 0 for t in config.temps))
    for p in r.acceptance:
        assert 0 <= p.acceptance_rate <= 1 and sum(p.accepted_histogram) == p.rounds
        assert len(p.accepted_histogram) == p.k + 1
        if p.rule == "exact":  # p == q: the exact rule accepts every draft
            assert p.acceptance_rate == 1.0 and p.accepted_histogram[-1] == p.rounds
    assert [c.temp for c in r.end_to_end] == list(config.e2e_temps)
    for c in r.end_to_end:
        assert all(m.tokens_per_s > 0 for m in c.methods.values())
        assert c.ratios["mlx-spec / target alone"] > 0
        assert c.methods["mlx-spec"].acceptance_rate == 1.0
    assert set(r.speedup_vs_k) == set(config.speedup_ks)
    assert [v.temp for v in r.verdicts] == list(config.temps)
    assert all(v.reason for v in r.verdicts)
    race = r.sources
    methods = {res.method: res for res in race.results}
    assert {"plain", "adaptive", "lookup", "lookup+draft"} <= set(methods)
    assert methods["plain"].speedup["all"] == pytest.approx(1.0)
    assert methods["draft k=2"].acceptance_rate == 1.0  # the target drafts for itself
    assert race.best_fixed in methods and race.adaptive_vs_best_fixed > 0
    assert len(r.context_scaling) == len(config.context_lengths)
    assert len(r.size_scaling) == len(config.target_sizes)
    assert [p.batch for p in r.batch_scaling.points] == sorted(config.batch_sizes)
    k = config.num_draft_tokens  # the chain at k against trees k x 2, k x 3 and the defaults
    shapes = {m.method: m for m in r.tree_race.results}
    assert list(shapes) == [f"chain k={k}", f"tree {k}x2", f"tree {k}x3", "defaults"]
    assert shapes[f"chain k={k}"].tree_share == 0.0
    assert shapes[f"tree {k}x2"].tree_share > 0 and shapes[f"tree {k}x3"].tree_share > 0
    assert all(m.speedup > 0 and m.tokens_per_pass >= 1.0 for m in shapes.values())
    assert all(m.rescued is None for m in shapes.values())  # every spine draft was kept
    assert all(m.predicted > 0 for m in r.tree_race.results[:-1])


def test_result_serialises_and_renders(tiny_result):
    d = json.loads(json.dumps(tiny_result.as_dict()))
    assert EXPECTED_KEYS <= set(d)
    assert "Verdict" in render_text(tiny_result)
    markdown = render_markdown(tiny_result)
    assert markdown.startswith("# mlx-spec bench") and "| k |" in markdown


def test_cli_writes_json_and_markdown(model_dirs, tmp_path):
    out = tmp_path / "out" / "bench.json"
    result = CliRunner().invoke(bench, [
        "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
        "--smoke", "--json", str(out), "--max-tokens", "6", "--repeats", "1", "--seed", "3",
    ])
    assert result.exit_code == 0, result.output
    d = json.loads(out.read_text())
    assert EXPECTED_KEYS <= set(d)
    assert d["config"]["seed"] == 3 and d["config"]["max_tokens"] == 6
    assert out.with_suffix(".md").read_text().startswith("# mlx-spec bench")
    assert "Verdict" in result.stdout


def test_cli_needs_a_draft_model(model_dirs):
    result = CliRunner().invoke(bench, ["--model", str(model_dirs["target"]), "--smoke"])
    assert result.exit_code != 0 and "--draft-model" in result.output


def test_blas_detection_returns_a_string():
    name = blas_library()
    assert isinstance(name, str) and name


def test_knee_finds_where_cost_turns_linear():
    assert knee({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.9}) == 8
    assert knee({1: 1.0, 2: 1.1}) is None


def test_target_sizes_flag_is_validated(model_dirs):
    result = CliRunner().invoke(bench, ["-m", str(model_dirs["target"]), "-d",
                                        str(model_dirs["draft"]), "--smoke",
                                        "--target-sizes", "abc"])
    assert result.exit_code == 2 and "HIDDENxLAYERS" in result.output


def test_saved_json_round_trips_and_rerenders(tiny_result, tmp_path):
    import dataclasses

    from mlx_spec.bench.runner import BenchResult, recompute_predictions
    from mlx_spec.bench.serialize import from_dict

    data = json.loads(json.dumps(tiny_result.as_dict()))
    restored = from_dict(BenchResult, data)
    assert restored == tiny_result
    assert dataclasses.asdict(recompute_predictions(restored)) == tiny_result.as_dict()
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(bench, ["--rerender", str(path), "--no-plots"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "saved.md").read_text().startswith("# mlx-spec bench")


def test_cost_model_acceptance_counts_only_the_timed_prompts():
    """The verdict compares predictions with runs over a few prompts; its acceptance
    must come from those prompts, not the average over every prompt kind."""
    from mlx_spec.bench.acceptance import AcceptancePoint, iid_rate
    from mlx_spec.bench.endtoend import timed_prompts
    from mlx_spec.bench.prompts import PROMPTS

    point = AcceptancePoint(k=2, temp=0.0, rule="exact", rounds=20, drafted=40, accepted=20,
                            acceptance_rate=0.5, mean_accepted=1.0, accepted_histogram=(10, 0, 10),
                            by_prompt={"easy": (10, 20, 10), "hard": (10, 0, 0)})
    assert iid_rate([point], ["easy"]) == pytest.approx(1.0)
    assert iid_rate([point], ["hard"]) == pytest.approx(0.0)
    assert iid_rate([point]) == pytest.approx(20 / 30)
    assert iid_rate([point], ["unrecorded"]) == pytest.approx(20 / 30)  # old results: all prompts
    names = [p.name for p in PROMPTS]
    assert timed_prompts(PROMPTS, repeats=3, warmup=1) == names[1:4]
    assert timed_prompts(PROMPTS, repeats=8, warmup=0) == names + names[:1]


def test_block_verdict_names_the_k_whose_own_acceptance_pays_best():
    """A block drafter's acceptance falls along its block: the verdict predicts each k with
    that k's own rate and the pass it measured, and names the best one (or why none pays)."""
    from mlx_spec.bench.acceptance import AcceptancePoint
    from mlx_spec.bench.forward import ModelCost
    from mlx_spec.bench.recommend import block_verdict

    def point(k, rounds, accepted, full):
        return AcceptancePoint(k=k, temp=0.0, rule="exact", rounds=rounds, drafted=rounds * k,
                               accepted=accepted, acceptance_rate=accepted / (rounds * k),
                               mean_accepted=accepted / rounds,
                               accepted_histogram=tuple([rounds - full] + [0] * (k - 1) + [full]))

    points = [point(3, 10, 27, 7), point(7, 10, 30, 0)]  # a = 0.9 at k=3, 0.75 at k=7
    target = ModelCost("target", 1, 8, 1e-3, 0.5, verify_cost={1: 1.0, 4: 1.1, 8: 1.3})
    v = block_verdict(points, target, {3: 0.2, 7: 0.25}, 0.0, [3, 7])
    assert v.pays and v.best_k == 3 and "k=3" in v.reason and "block drafter" in v.reason
    assert v.predicted_by_k[3] == pytest.approx((1 - 0.9 ** 4) / 0.1 / (0.2 + 1.1))
    assert v.predicted_by_k[7] == pytest.approx((1 - 0.75 ** 8) / 0.25 / (0.25 + 1.3))
    slow = block_verdict(points, target, {3: 3.0, 7: 3.0}, 0.0, [3, 7])
    assert not slow.pays and slow.best_k == 0
    assert "pass is too slow" in slow.reason and "k=3" in slow.reason


def test_the_tree_race_measures_rescues_and_predicts_each_shape():
    """A draft that misses: tree rounds whose spine stopped short, some rescued by a sibling;
    the prediction is the cost model's for each fixed shape (none for the defaults), and a
    wider tree verifies more nodes for the same drafts (a flat verify curve makes it pay)."""
    from mlx_spec import costmodel
    from mlx_spec.bench import trees
    from tiny import make_llama, perturbed

    target = make_llama(seed=0)
    draft = perturbed(target, noise=0.3)
    prompts = [(None, [3, 1, 4, 1, 5, 9, 2, 6]), (None, [2, 7, 1, 8, 2, 8])]
    race = trees.race(target, draft, prompts, 3, max_tokens=24, repeats=2, warmup=0)
    shapes = {m.method: m for m in race.results}
    wide = shapes["tree 3x3"]
    assert wide.tree_share > 0 and wide.rescued is not None and 0 <= wide.rescued <= 1
    flat = {1: 1.0, 16: 1.0}
    predicted = {m.method: m.predicted for m in trees.predict(race, 0.5, 0.1, flat).results}
    assert predicted["defaults"] is None
    assert predicted["chain k=3"] == pytest.approx(
        costmodel.predicted_speedup(0.5, 3, 0.1, flat))
    assert predicted["tree 3x3"] == pytest.approx(costmodel.expected_tree_tokens(
        0.5, 3, wide.rescued) / 1.3)
    assert costmodel.predicted_tree_speedup(0.5, 3, 3, 0.4, 0.1, flat) > predicted["chain k=3"]
    steep = {1: 1.0, 2: 2.0}  # a verified node costs a pass: the tree loses
    assert costmodel.predicted_tree_speedup(0.5, 3, 3, 0.4, 0.1, steep) < \
        costmodel.predicted_speedup(0.5, 3, 0.1, steep)
