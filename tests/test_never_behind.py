"""The never-behind table: ratios from given numbers, the zoo's names, a smoke run on tiny models.

No speed thresholds: only that every row and column is there and every
figure is positive.
"""

import json
import math
import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

from bench.studies.never_behind import (BEST_FIXED, DEFAULTS, DEFAULTS_CAL, LM_AT_K, LOOKUP, PLAIN,
                                        NeverBehind, NeverBehindConfig, Row, aa_control_line,
                                        best_of, lm_at, main, measure, mlx_lm_runs, paired_ratio,
                                        plain_twice, render_markdown, row_ratios, spec_at)
from bench.zoo import (HELD_OUT_NAMES, NOISY_F32_NOISE, SKIP_LAYERS, TUNED_NAMES, ZOO_NAMES, Pair,
                       build_zoo)
from mlx_spec.bench.endtoend import MethodResult, RunResult, interleave
from mlx_spec.bench.serialize import from_dict
from mlx_spec.bench.timing import median_interval
from mlx_spec.cache import make_cache
from mlx_spec.loading import default_draft_path, load


def _method(*runs):
    return MethodResult(sorted(runs)[len(runs) // 2], tuple(runs), None)


def test_paired_ratio_is_the_median_of_per_repeat_ratios_with_its_interval():
    r = paired_ratio(_method(10.0, 12.0, 30.0), _method(10.0, 10.0, 20.0))
    assert r.value == pytest.approx(1.2)  # of 10/10, 12/10, 30/20
    assert (r.low, r.high) == pytest.approx((1.0, 1.5))  # 3 repeats: min..max, 75%
    assert r.coverage == pytest.approx(0.75)
    # Paired, not a ratio of medians: a fast repeat speeds both of its runs.
    r = paired_ratio(_method(20.0, 10.0, 10.0, 10.0, 10.0), _method(19.0, 11.0, 11.0, 11.0, 11.0))
    assert r.value == pytest.approx(10.0 / 11.0)
    assert paired_ratio(_method(10.0), None) is None
    assert paired_ratio(_method(10.0), MethodResult(0.0, (), None)) is None


def test_median_interval_is_the_order_statistic_one():
    values = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0]  # 8 values: 2nd smallest .. 2nd largest
    low, high, coverage = median_interval(values)
    assert (low, high) == (2.0, 8.0)
    assert coverage == pytest.approx(1 - 2 * 9 / 256)  # 1 - 2 P(Bin(8, 1/2) <= 1)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, 0.75)
    assert median_interval([5.0])[2] == 0.0  # one value: no confidence at all
    # Coverage is what it says: draws of n = 8 from a skewed law bracket its median ~93%.
    rng = random.Random(0)
    hits = sum(low <= math.log(2) <= high for low, high, _ in
               (median_interval([rng.expovariate(1.0) for _ in range(8)]) for _ in range(4000)))
    assert 0.91 < hits / 4000 < 0.95


def test_interleave_reverses_the_order_every_other_repeat():
    order = []
    methods = {name: (lambda ids, name=name: order.append(name) or RunResult(1.0, 1))
               for name in "abc"}
    interleave(methods, [("p", [1, 2])], repeats=3, warmup=1)
    assert "".join(order) == "abccbaabccba"


def test_the_best_fixed_setting_is_never_mlx_lm():
    sweep = {PLAIN: 10.0, LOOKUP: 11.0, spec_at(1): 9.0, spec_at(2): 12.0, lm_at(2): 30.0}
    candidates = [PLAIN, LOOKUP, spec_at(1), spec_at(2), spec_at(4)]  # k = 4 not swept
    assert best_of(sweep, candidates) == spec_at(2)
    assert best_of({PLAIN: 10.0, spec_at(1): 9.0}, candidates) == PLAIN  # plain can be the bar
    assert best_of(sweep, [lm_at(1), lm_at(2)]) == lm_at(2)
    assert best_of(sweep, [lm_at(3)]) is None  # mlx-lm not run: no column


def test_row_ratios_against_the_best_fixed_setting():
    methods = {PLAIN: _method(10.0, 10.0, 10.0), LM_AT_K: _method(12.0, 12.0, 12.0),
               BEST_FIXED: _method(15.0, 14.0, 16.0), DEFAULTS: _method(18.0, 14.0, 21.0)}
    ratios = row_ratios(methods)
    assert ratios["best fixed / mlx-lm@k"].value == pytest.approx(15.0 / 12.0)
    assert ratios["defaults / plain"].value == pytest.approx(1.8)
    assert (ratios["defaults / plain"].low, ratios["defaults / plain"].high) == \
        pytest.approx((1.4, 2.1))
    assert ratios["defaults / best fixed"].value == pytest.approx(18.0 / 15.0)
    assert ratios["defaults / best fixed"].low == pytest.approx(1.0)  # 14 / 14
    assert ratios["defaults+cal / plain"] is None  # no calibration: n/a, not a number
    assert ratios["defaults+cal / best fixed"] is None
    del methods[LM_AT_K]  # a pair mlx-lm cannot run
    assert row_ratios(methods)["best fixed / mlx-lm@k"] is None


def _row(best_fixed, plain_runs, best_runs):
    methods = {PLAIN: _method(*plain_runs), BEST_FIXED: _method(*best_runs),
               DEFAULTS: _method(*plain_runs)}
    return Row("p", 0.7, {}, best_fixed, None, methods, row_ratios(methods))


def test_the_a_a_control_reads_only_rows_whose_best_fixed_setting_is_plain():
    """Best fixed / plain is the table's own noise only where both columns are plain decoding."""
    rows = [_row(PLAIN, (10.0, 10.0, 10.0), (10.5, 9.0, 10.0)),
            _row(LOOKUP, (10.0, 10.0, 10.0), (30.0, 30.0, 30.0)),  # a real win, not noise
            _row(PLAIN, (20.0, 20.0, 20.0), (19.0, 19.4, 21.0))]
    control = plain_twice(rows)
    assert [r.value for r in control] == pytest.approx([1.0, 0.97])
    line = aa_control_line(rows)[0]
    assert "the 2 rows" in line and "0.97x to 1.00x" in line


def test_zoo_rejects_unknown_names():
    with pytest.raises(ValueError, match="shipped-f16, shipped-f32, weak, strong"):
        build_zoo(["shipped-f16", "nope"])


def test_zoo_builds_every_pair_and_splits_tuned_from_held_out():
    pairs = build_zoo()
    assert [p.name for p in pairs] == list(ZOO_NAMES)
    assert set(TUNED_NAMES) | set(HELD_OUT_NAMES) == set(ZOO_NAMES)
    assert not set(TUNED_NAMES) & set(HELD_OUT_NAMES)
    by_name = {p.name: p for p in pairs}
    assert [p.name for p in pairs if p.held_out] == list(HELD_OUT_NAMES)
    assert by_name["shipped-f32"].target_model.model.norm.weight.dtype.size == 4
    assert hasattr(by_name["strong"].draft_model.lm_head, "scales")  # quantized
    assert by_name["weak"].target_model.model.norm.weight.dtype.size == 2  # float16 target
    # The held-out half is unlike the shipped pair: a hybrid, a sliding window, an MTP head.
    kinds = {type(c).__name__ for c in make_cache(by_name["hybrid-f32"].target_model)}
    assert {"ArraysCache", "KVCache"} <= kinds
    assert "RotatingKVCache" in {type(c).__name__
                                 for c in make_cache(by_name["sliding-f32"].target_model)}
    assert by_name["mtp-f32"].draft_model == "mtp"
    assert len(by_name["skip-f32"].draft_model.layers) == SKIP_LAYERS
    assert by_name["skip-f16"].draft_model.model.norm.weight.dtype.size == 2
    hybrid_draft = {type(c).__name__ for c in make_cache(by_name["hybrid-skip-f32"].draft_model)}
    assert {"ArraysCache", "KVCache"} <= hybrid_draft
    sliding_draft = [type(c).__name__ for c in make_cache(by_name["sliding-skip-f32"].draft_model)]
    assert sliding_draft == ["RotatingKVCache", "RotatingKVCache", "KVCache"]
    # mlx-lm runs only what it can trim: a sliding window fills up, an MTP head is not a model
    assert [name for name in ZOO_NAMES if mlx_lm_runs(by_name[name])] == [
        "shipped-f16", "shipped-f32", "weak", "strong", "noisy-f32", "skip-f32", "noisy-f16",
        "skip-f16"]


def test_the_early_exit_draft_is_the_target_cut_short():
    pair, = build_zoo(["skip-f32"])
    target, draft = pair.target_model, pair.draft_model
    x = mx.array([[5, 17, 300, 42]])
    h = target.model.embed_tokens(x)
    mask = "causal"
    for layer in target.model.layers[:SKIP_LAYERS]:
        h = layer(h, mask, None)
    expected = target.lm_head(target.model.norm(h))
    assert mx.allclose(draft(x), expected, atol=1e-4).item()


def test_the_hybrid_early_exit_is_the_hybrid_target_cut_short():
    """The shallow copy holds the target's own first layers (recurrent ones included): its
    logits are the target's hidden state after them, through the target's norm and head."""
    pair, = build_zoo(["hybrid-skip-f32"])
    target, draft = pair.target_model, pair.draft_model
    x = mx.array([[5, 17, 300, 42]])
    inner = target.language_model.model
    h = inner.embed_tokens(x)
    for layer, cache in zip(inner.layers[:len(draft.layers)], make_cache(target)):
        mask = "causal" if not layer.is_linear else None
        h = layer(h, mask, cache)
    expected = target.language_model.lm_head(inner.norm(h))
    assert mx.allclose(draft(x), expected, atol=1e-3).item()


def test_the_sliding_early_exit_is_the_sliding_target_cut_short():
    """The shallow copy holds the target's first sliding-window and global layers: its logits
    are the target's hidden state after them, through the target's norm and head (a prompt
    longer than the window, so the sliding mask matters)."""
    pair, = build_zoo(["sliding-skip-f32"])
    target, draft = pair.target_model, pair.draft_model
    x = mx.array([[(7 * i + 3) % 4000 for i in range(40)]])
    inner = target.model
    h = inner.embed_tokens(x)
    h = h * mx.array(inner.args.hidden_size ** 0.5, mx.bfloat16).astype(h.dtype)
    sliding = create_attention_mask(h, None, window_size=inner.window_size)  # (the model's own)
    for i, layer in enumerate(inner.layers[:len(draft.layers)]):
        h = layer(h, "causal" if i % 3 == 2 else sliding, None)
    expected = target.lm_head(inner.norm(h))
    assert mx.allclose(draft(x), expected, atol=1e-3).item()
    assert not mx.allclose(draft(x), target(x), atol=1e-1).item()


def test_a_noisy_copy_moves_every_matrix_by_its_noise():
    pair, = build_zoo(["noisy-f32"])
    shipped, _ = load(str(default_draft_path()))
    shipped.set_dtype(mx.float32)
    before = dict(tree_flatten(shipped.parameters()))
    for name, w in tree_flatten(pair.draft_model.parameters()):
        if w.size > 1:
            moved = (mx.std(w - before[name]) / mx.std(before[name])).item()
            assert moved == pytest.approx(NOISY_F32_NOISE, rel=0.2), name


@pytest.fixture(scope="module")
def tiny_table(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    pair = Pair("tiny", target_model, draft_model, tokenizer, "random tiny llamas")
    config = NeverBehindConfig(temps=(0.0, 1.0), ks=(1, 2), lm_ks=(1, 2), max_tokens=12, repeats=2,
                               sweep_repeats=1, prompts=("fibonacci", "rename"))
    return measure([pair], config), config


def test_measure_gives_a_row_per_pair_and_temperature(tiny_table):
    result, config = tiny_table
    assert [(row.pair, row.temp) for row in result.rows] == [("tiny", 0.0), ("tiny", 1.0)]
    with_cal = result.calibration == "used"
    fixed = [PLAIN, LOOKUP] + [spec_at(k) for k in config.ks]
    for row in result.rows:
        assert set(row.sweep) == set(fixed + [lm_at(k) for k in config.lm_ks])
        assert row.best_fixed in fixed
        assert row.sweep[row.best_fixed] == max(row.sweep[name] for name in fixed)
        assert row.best_k in config.lm_ks
        assert row.sweep[lm_at(row.best_k)] == max(row.sweep[lm_at(k)] for k in config.lm_ks)
        assert (DEFAULTS_CAL in row.methods) == with_cal
        for m in row.methods.values():
            assert m.tokens_per_s > 0 and len(m.runs_tokens_per_s) == config.repeats
        for name, r in row.ratios.items():
            if r is None:
                assert name.startswith(DEFAULTS_CAL) and not with_cal
            else:
                assert 0 < r.low <= r.value <= r.high
    (copy,) = result.copy_rows
    assert copy.methods[LOOKUP].tokens_per_s > 0 and copy.tokens_per_round[LOOKUP] >= 1
    assert result.machine.blas


def test_table_renders_and_survives_json(tiny_table):
    result, _ = tiny_table
    markdown = render_markdown(result)
    header = next(line for line in markdown.splitlines() if line.startswith("| pair | T |"))
    for column in ("plain tok/s", "best fixed: tok/s", "mlx-lm best k: tok/s",
                   "best fixed ÷ mlx-lm", "defaults tok/s (no cal / cal)", "defaults ÷ plain",
                   "defaults ÷ best fixed", "acceptance"):
        assert column in header
    rows = [line for line in markdown.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 4  # the pair, 2 T, the copy task
    again = from_dict(NeverBehind, json.loads(json.dumps(result.as_dict())))
    assert render_markdown(again) == markdown


def test_rerender_of_a_file_it_cannot_read_is_one_sentence(tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"config": {}, "rows": []}))  # an older schema
    for path in (old, tmp_path / "missing.json"):
        assert main(["--rerender", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot rerender") and "Traceback" not in err
        assert not path.with_suffix(".md").exists()


def test_the_copy_ceiling_tells_the_target_its_own_reply_and_keeps_every_block(target_model):
    from bench.studies.copy_ceiling import run_told
    from bench.studies.lookup_track_record import greedy
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.sampling import SamplingConfig
    ids = [5, 9, 17, 3, 22, 41, 8, 5, 9, 17]
    reply = greedy(target_model, ids, 20)
    plain = [t for r in speculative_generate_step(ids, target_model, None, max_tokens=20,
                                                  sampling=SamplingConfig(temp=0.0))
             for t in r.tokens]
    assert reply == plain  # the target's own greedy reply
    for block in (1, 4, 32):
        log = []
        result = run_told(target_model, ids, reply, block, log)
        assert result.tokens == 20 and result.accepted == result.drafted > 0
        assert log == [(20, -(-20 // (block + 1)), 0)]  # every round a whole block and its token
    wrong = reply[:5] + [(reply[5] + 1) % 64] + reply[6:]  # negative control: a told mistake
    with pytest.raises(RuntimeError, match="differs"):
        run_told(target_model, ids, wrong, 4, [])
