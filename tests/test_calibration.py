"""`mlx-spec tune`: the per-machine calibration cache (measure, store, load back, refuse)."""

import dataclasses
import json
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from click.testing import CliRunner
from families import make_family
from tiny import make_llama

from mlx_spec.bench.calibrate import VERIFY_LENGTHS, calibrate
from mlx_spec.calibration import (MAX_AGE_DAYS, Calibration, DraftCost, calibration_path,
                                  load_calibration, model_fingerprint, mtp_key,
                                  save_calibration)
from mlx_spec.cli import main
from mlx_spec.loading import load


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SPEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def pair(model_dirs):
    target_model, tokenizer = load(str(model_dirs["target"]))
    draft_model, _ = load(str(model_dirs["draft"]))
    return target_model, draft_model, tokenizer


@pytest.fixture(scope="module")
def measured(pair):
    target_model, draft_model, tokenizer = pair
    stages = []
    return calibrate(target_model, draft_model, tokenizer, progress=stages.append), stages


def test_calibrate_measures_positive_costs_for_every_length(pair, measured):
    cal, stages = measured
    target_model, draft_model, _ = pair
    assert cal.plain_step_s > 0
    assert sorted(cal.verify_s) == list(VERIFY_LENGTHS)
    assert all(s > 0 for s in cal.verify_s.values())
    draft = cal.draft(draft_model)
    assert draft is not None and draft.step_s > 0 and 0 <= draft.acceptance <= 1
    assert 0 <= draft.sampling_acceptance <= 1  # at T = 1, exact rule
    assert draft.sampling_extra_s >= 0
    assert draft.round_s > 0  # a real greedy round, timed between plain runs
    assert cal.draft(target_model) is None
    assert len(stages) == 4
    assert cal.verify_seconds(7) > 0 and cal.verify_seconds(64) > 0  # between and beyond
    with pytest.raises(ValueError):
        cal.verify_seconds(0)


def test_calibrate_a_hybrid_target_alone():
    cal = calibrate(make_family("qwen3_5", seed=0))
    assert cal.drafts == {} and all(s > 0 for s in cal.verify_s.values())


def test_the_target_s_mtp_layer_is_measured_and_used(monkeypatch):
    """`tune --mtp`: the MTP layer's step stored as a draft of its own, and read by generate."""
    import mlx_spec.bench.calibrate as measure
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.loading import default_target_path
    from mlx_spec.mtp import load_mtp

    monkeypatch.setattr(measure, "VERIFY_LENGTHS", (1, 2, 4, 8))
    monkeypatch.setattr(measure, "PLAIN_RUNS", 1)
    target_model, _ = load(str(default_target_path()))  # the shipped target and its MTP head
    cal = calibrate(target_model, mtp=True)
    (key, cost), = cal.drafts.items()
    assert key == mtp_key(load_mtp(target_model)) and cost.step_s > 0
    assert cost.acceptance is None  # no tokenizer, no prompts
    save_calibration(cal)
    rounds = speculative_generate_step([1, 2, 3], target_model, "mtp", max_tokens=12)
    list(rounds)
    assert rounds.policy.describe()["calibrated"] is True
    assert rounds.policy.prior.knows("mtp")  # its cost line starts from the stored step


def test_save_then_load_round_trips(pair, measured):
    cal, _ = measured
    path = save_calibration(cal)
    assert path == calibration_path(pair[0]) and path.parent.name == "calibration"
    assert len(path.stem) == 16
    assert load_calibration(pair[0]) == cal


def test_a_file_from_before_sampling_acceptance_still_loads(pair, measured):
    cal, _ = measured
    path = save_calibration(cal)
    data = json.loads(path.read_text())
    for draft in data["drafts"].values():
        del draft["sampling_acceptance"], draft["sampling_extra_s"], draft["round_s"]
    path.write_text(json.dumps(data))
    loaded = load_calibration(pair[0]).draft(pair[1])
    assert loaded.sampling_acceptance is None and loaded.sampling_extra_s is None
    assert loaded.round_s is None
    assert loaded.acceptance == cal.draft(pair[1]).acceptance


def test_what_sampling_adds_to_a_round_reaches_the_policy_only_when_sampling(pair, measured):
    from mlx_spec.assemble import cost_prior as _cost_prior
    from mlx_spec.sampling import SamplingConfig

    cal, _ = measured
    target_model, draft_model, _ = pair
    fp = model_fingerprint(draft_model)
    cal = dataclasses.replace(cal, drafts={fp: dataclasses.replace(cal.drafts[fp],
                                                                   sampling_extra_s=0.5)})
    greedy = _cost_prior(cal, target_model, draft_model, SamplingConfig())
    sampled = _cost_prior(cal, target_model, draft_model, SamplingConfig(temp=0.7))
    # On the extra per round itself: a round's prediction is floored at its verify pass, which
    # a greedy prediction from a calibration measured under load can fall below (CI saw it).
    assert sampled.extra_seconds.get("draft", 0.0) == \
        pytest.approx(greedy.extra_seconds.get("draft", 0.0) + 0.5)
    assert sampled.round_seconds("draft", 2) > greedy.round_seconds("draft", 2)


def test_the_prior_is_anchored_to_the_real_round(pair, measured):
    """The measured greedy round at k = ROUND_K is what the prior predicts there; other k
    follow the parts' slope (verify curve, draft step)."""
    from mlx_spec.calibration.record import ROUND_K
    from mlx_spec.assemble import cost_prior as _cost_prior
    from mlx_spec.sampling import SamplingConfig

    cal, _ = measured
    target_model, draft_model, _ = pair
    fp = model_fingerprint(draft_model)
    parts = _cost_prior(dataclasses.replace(cal, drafts={fp: dataclasses.replace(
        cal.drafts[fp], round_s=None)}), target_model, draft_model, SamplingConfig())
    for round_s in (0.5, 2.0):  # far above the parts' sum: the offset is what moves it
        anchored = _cost_prior(dataclasses.replace(cal, drafts={fp: dataclasses.replace(
            cal.drafts[fp], round_s=round_s)}), target_model, draft_model, SamplingConfig())
        assert anchored.round_seconds("draft", ROUND_K) == pytest.approx(round_s)
        for k in (1, 4, 8):
            assert anchored.round_seconds("draft", k) - parts.round_seconds("draft", k) == \
                pytest.approx(round_s - parts.round_seconds("draft", ROUND_K))
    tiny = _cost_prior(dataclasses.replace(cal, drafts={fp: dataclasses.replace(
        cal.drafts[fp], round_s=1e-9)}), target_model, draft_model, SamplingConfig())
    assert tiny.round_seconds("draft", 4) >= cal.verify_seconds(5)  # never below its verify


def test_the_acceptance_prior_follows_the_temperature():
    measured = DraftCost(0.001, acceptance=0.9, sampling_acceptance=0.5)
    assert measured.acceptance_at(0.0) == 0.9 and measured.acceptance_at(1.0) == 0.5
    assert measured.acceptance_at(0.5) == pytest.approx(0.7)
    assert measured.acceptance_at(1.5) == 0.5
    assert DraftCost(0.001, 0.9).acceptance_at(0.7) is None  # T = 1 not measured


def test_a_second_draft_merges_into_the_same_file(pair, measured):
    cal, _ = measured
    save_calibration(cal)
    other = make_llama(seed=9, hidden=32, layers=1)
    later = dataclasses.replace(cal, created=time.time(),
                                drafts={model_fingerprint(other): DraftCost(0.001, None)})
    assert save_calibration(later) == calibration_path(pair[0])
    loaded = load_calibration(pair[0])
    assert loaded.draft(pair[1]) == cal.draft(pair[1])
    assert loaded.draft(other) == DraftCost(0.001, None)
    assert loaded.created == later.created


def _stored(model, **changes) -> Calibration:
    """A made-up calibration of `model` on this machine, saved."""
    from mlx_spec.calibration import calibration_key

    cal = Calibration(calibration_key(model), time.time(), 0.01, {1: 0.01, 4: 0.02}, {})
    save_calibration(dataclasses.replace(cal, **changes))
    return cal


def test_load_ignores_other_models_and_dtypes():
    model = make_llama(seed=0)
    _stored(model)
    assert load_calibration(model) is not None
    assert load_calibration(make_llama(seed=1)) is None
    cast = make_llama(seed=0)
    cast.set_dtype(mx.float16)
    assert load_calibration(cast) is None


@pytest.mark.parametrize("edit", ["age", "mlx", "format"])
def test_load_ignores_stale_files(edit):
    model = make_llama(seed=0)
    _stored(model)
    path = calibration_path(model)
    data = json.loads(path.read_text())
    if edit == "age":
        data["created"] = time.time() - (MAX_AGE_DAYS + 10) * 86400
    elif edit == "mlx":
        data["key"]["mlx"] = "0.0.1"
    else:  # a later format may have other fields: ignored, not called corrupt
        data = {"key": {**data["key"], "format": 99}, "something": "else"}
    path.write_text(json.dumps(data))
    assert load_calibration(model) is None


@pytest.mark.parametrize("corrupt", [
    lambda data: "{not json",
    lambda data: json.dumps({k: v for k, v in data.items() if k != "plain_step_s"}),
    lambda data: json.dumps({**data, "plain_step_s": -0.01}),
    lambda data: json.dumps({**data, "verify_s": {"1": 0.0}}),
    lambda data: json.dumps({**data, "verify_s": {"one": 0.1}}),
    lambda data: json.dumps({**data, "verify_s": {"\u00b2": 0.1}}),  # "²": str.isdigit, no int
    lambda data: json.dumps({**data, "drafts": {"x": {"step_s": "fast", "acceptance": None}}}),
    lambda data: json.dumps({**data, "drafts": {"x": {"step_s": 0.1, "acceptance": None,
                                                      "round_s": -1.0}}}),
    lambda data: json.dumps([1, 2]),
], ids=["not-json", "missing-field", "negative-time", "zero-time", "bad-length",
        "superscript-length", "wrong-type", "negative-round", "not-an-object"])
def test_corrupt_files_raise_one_sentence_naming_the_file(corrupt):
    model = make_llama(seed=0)
    _stored(model)
    path = calibration_path(model)
    path.write_text(corrupt(json.loads(path.read_text())))
    with pytest.raises(ValueError) as info:
        load_calibration(model)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "mlx-spec tune" in message


def test_saving_replaces_a_corrupt_file():
    model = make_llama(seed=0)
    calibration_path(model).parent.mkdir(parents=True)
    calibration_path(model).write_text("{not json")
    cal = _stored(model)
    assert load_calibration(model) == cal


def test_fingerprint_tells_quantized_from_float_and_is_stable_across_loads(model_dirs):
    model = make_llama(seed=0, hidden=64, vocab_size=64)
    plain = model_fingerprint(model)
    nn.quantize(model, group_size=32, bits=4)
    assert model_fingerprint(model) != plain
    first, _ = load(str(model_dirs["target"]))
    second, _ = load(str(model_dirs["target"]))
    assert model_fingerprint(first) == model_fingerprint(second)
    assert model_fingerprint(first) != model_fingerprint(load(str(model_dirs["draft"]))[0])


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_tune_writes_prints_and_forgets(model_dirs, pair):
    target = ["--model", str(model_dirs["target"])]
    result = run("tune", *target, "--draft-model", str(model_dirs["draft"]))
    assert result.exit_code == 0, result.output
    path = calibration_path(pair[0])
    assert path.exists() and str(path) in result.stdout
    assert "plain decoding step" in result.stdout and "(this draft)" in result.stdout
    assert "[" in result.stderr and "verify cost" in result.stderr  # timed progress

    shown = run("tune", *target, "--draft-model", str(model_dirs["draft"]), "--print")
    assert shown.exit_code == 0 and "(this draft)" in shown.stdout and str(path) in shown.stdout

    gone = run("tune", *target, "--forget")
    assert gone.exit_code == 0 and not path.exists()
    none = run("tune", *target, "--print")
    assert none.exit_code == 0 and "No calibration stored" in none.stdout


def test_tune_print_refuses_a_corrupt_file_in_one_line(model_dirs, pair):
    path = calibration_path(pair[0])
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    result = run("tune", "--model", str(model_dirs["target"]), "--print")
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(path) in errors[0]  # after click's usage line
    assert run("tune", "--model", str(model_dirs["target"]), "--print", "--forget").exit_code != 0


def test_tune_mtp_on_a_target_without_mtp_weights_is_one_sentence(model_dirs):
    result = run("tune", "--model", str(model_dirs["target"]), "--no-draft", "--mtp")
    assert result.exit_code != 0 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "MTP" in errors[0]
    result = run("tune", "--model", str(model_dirs["target"]), "--mtp-weights", "x")
    assert result.exit_code != 0 and "only used with --mtp" in result.output


@pytest.mark.parametrize("flag", ["--calibration", "--no-calibration"])
def test_generate_takes_the_calibration_flag(model_dirs, measured, flag):
    """With this machine's calibration stored, --calibration starts the policy from it (the
    stats say so) and --no-calibration starts cold; the greedy text is the same either way."""
    save_calibration(measured[0])
    args = ["--model", str(model_dirs["target"]), "-p", "def f(x):", "-n", "8"]
    result = run("generate", *args, "--draft-model", str(model_dirs["draft"]), flag)
    plain = run("generate", *args, "--no-draft", "-q")
    assert result.exit_code == 0 and plain.exit_code == 0, (result.output, plain.output)
    assert result.stdout == plain.stdout
    used = "Calibration: this machine's, from `mlx-spec tune`" in result.stderr
    assert used == (flag == "--calibration"), result.stderr


def test_bench_tune_stores_the_pair(model_dirs, pair, tmp_path):
    from mlx_spec.cli.bench import bench

    result = CliRunner().invoke(bench, [
        "--model", str(model_dirs["target"]), "--draft-model", str(model_dirs["draft"]),
        "--smoke", "--no-plots", "--json", str(tmp_path / "bench.json"), "--tune"])
    assert result.exit_code == 0, result.output
    assert str(calibration_path(pair[0])) in result.stdout
    assert load_calibration(pair[0]).draft(pair[1]) is not None


def _losing(cal: Calibration, draft_model) -> Calibration:
    """The same calibration, but verifying T tokens costs T steps and drafting is dear."""
    one = cal.verify_s[1]
    drafts = {model_fingerprint(draft_model): DraftCost(step_s=one, acceptance=0.3)}
    return dataclasses.replace(cal, plain_step_s=one, drafts=drafts,
                               verify_s={t: one * t for t in cal.verify_s})


def test_the_policy_starts_from_a_calibration(pair, measured, monkeypatch):
    """A calibration that shows the draft losing: the first tokens are decoded plainly."""
    from mlx_spec.drafters.draft_model import DraftModelDrafter
    from mlx_spec.generate import speculative_generate_step, stream_generate

    # the cold run's draft step timed as free: whether it drafts no longer rides on this
    # machine's timings (it once did not, under a loaded CI run); a calibration has no use for it
    monkeypatch.setattr(DraftModelDrafter, "step_seconds", lambda self, token, repeats=2: 1e-6)

    cal, _ = measured
    target_model, draft_model, tokenizer = pair
    rounds = list(speculative_generate_step([1, 2, 3], target_model, draft_model, max_tokens=12,
                                            prompt_lookup=False,
                                            calibration=_losing(cal, draft_model)))
    assert all(r.num_drafted == 0 for r in rounds)
    cold = list(speculative_generate_step([1, 2, 3], target_model, draft_model, max_tokens=12,
                                          prompt_lookup=False, calibration=None))
    assert any(r.num_drafted > 0 for r in cold)  # no calibration: drafts after 4 timed plain steps
    assert [t for r in rounds for t in r.tokens] == [t for r in cold for t in r.tokens]

    def calibrated(**kwargs):
        *_, last = stream_generate(target_model, tokenizer, "def f(x):", draft_model=draft_model,
                                   max_tokens=8, **kwargs)
        return last.stats.calibrated

    assert calibrated() is False  # "auto", nothing stored
    save_calibration(cal)
    assert calibrated() is True
    assert calibrated(calibration=None) is False
    assert calibrated(num_draft_tokens=3) is None  # a pinned k: no policy to calibrate


def test_a_corrupt_calibration_warns_and_generation_goes_on(pair, measured):
    from mlx_spec.generate import stream_generate

    cal, _ = measured
    target_model, draft_model, tokenizer = pair
    path = save_calibration(cal)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="mlx-spec tune"):
        *_, last = stream_generate(target_model, tokenizer, "def f(x):", draft_model=draft_model,
                                   max_tokens=4)
    assert last.stats.calibrated is False and last.stats.generation_tokens == 4


class FakeLibc:
    """sysctlbyname as macOS's C library answers it: the size first, then the bytes."""

    def __init__(self, values):
        self.values = values

    def sysctlbyname(self, name, value, size, new_value, new_size):
        import ctypes
        data = self.values.get(name.decode())
        if data is None:
            return -1
        encoded = data.encode() + b"\0"
        if value is not None:
            ctypes.memmove(value, encoded, len(encoded))
        size._obj.value = len(encoded)
        return 0


def test_the_chip_s_name_is_asked_of_the_c_library_not_a_shell(monkeypatch):
    from mlx_spec.calibration import machine

    libc = FakeLibc({"machdep.cpu.brand_string": "Apple M3 Max"})
    assert machine.sysctl_string("machdep.cpu.brand_string", libc) == "Apple M3 Max"
    assert machine.sysctl_string("no.such.name", libc) == ""
    assert machine.sysctl_string("machdep.cpu.brand_string", object()) == ""  # no sysctlbyname
    monkeypatch.setattr(machine.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(machine, "sysctl_string", lambda name: libc.values.get(name, ""))
    assert machine.chip_name() == "Apple M3 Max"
    monkeypatch.setattr(machine, "sysctl_string", lambda name: "")
    assert machine.chip_name()  # falls back to /proc/cpuinfo or the platform
