"""A target sharded over 2 ranks on 127.0.0.1 (ring backend, `mlx.launch`) against one process.

Each test launches tests/distributed_worker.py on two local ranks, which load
the target sharded (tensor parallel: llama's shard(); pipeline: ministral3's
pipeline()) and the draft whole, and write what each rank generated as JSON. Each launch
also drafts with an MTP layer loaded whole on every rank: a head trained for
the llama target (tensor parallel), a deepseek_v3 target's own (pipeline).
The references are computed here, in one process, from the same directories.
A launch runs in its own process group, killed whole when it fails or times out.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from tiny import make_llama, write_tokenizer

HERE = Path(__file__).parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
LAUNCH_TIMEOUT = 240  # seconds for one launch, start-up included (a loaded 2-core machine: 75 s)

pytestmark = pytest.mark.skipif(not mx.distributed.is_available(),
                                reason="this MLX build has no distributed backend")


def free_port(ranks: int = 2) -> int:
    """A port p with p .. p + ranks - 1 free: the ring backend listens on one per rank.

    Drawn below the ephemeral range (32768 up), which port-0 servers and client sockets take
    from, and from a range of its own per pytest-xdist worker, so that between this check and
    the ranks binding nobody else on the machine's tests takes p + 1."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = 20000 + 2000 * ((int(worker) if worker.isdigit() else 0) % 6)
    while True:
        port = base + random.randrange(2000 - ranks)
        try:
            for offset in range(ranks):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + offset))
        except OSError:
            continue
        return port


def launch(out: Path, target: Path, draft=None, scenarios=(), sharding="auto", ranks=2,
           timeout=LAUNCH_TIMEOUT, extra=(), started=lambda pid: None):
    """Run the worker on `ranks` local ranks; {rank: its JSON}. Kills the whole launch on failure."""
    out.mkdir(parents=True, exist_ok=True)
    worker = ["--target", str(target), "--out", str(out), "--sharding", sharding]
    worker += ["--draft", str(draft)] if draft is not None else []
    worker += list(extra)
    command = [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "-p", str(free_port(ranks)),
               "--python", sys.executable, str(HERE / "distributed_worker.py"), *worker,
               *scenarios]
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    started(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the {ranks}-rank launch did not finish within {timeout} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    results = {}
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing; launch output:\n{output.decode()[-3000:]}"
        results[rank] = json.loads(path.read_text())
        assert "crash" not in results[rank], results[rank]["crash"]
    return results


LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 96,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "max_position_embeddings": 2048, "eos_token_id": 0}
MINISTRAL3_CONFIG = {**LLAMA_CONFIG, "model_type": "ministral3",
                     "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                         "llama_4_scaling_beta": 0.1,
                                         "original_max_position_embeddings": 2048}}
DAMPING = 0.1  # the target's layers after the first add little: the draft (layer 0) is close


def write_pair(root: Path, family: str, layers: int = 3, seed: int = 0):
    """(target dir, draft dir): a tiny random `family` target and a 1-layer llama draft.

    The draft is the target's embeddings, first layer, norm and head, so it
    guesses the target fairly well (the later layers' outputs are damped), and
    it is smaller than each rank's share of the target.
    """
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{family}")
    target_dir, draft_dir = root / f"{family}-target", root / f"{family}-draft"
    vocab = 0
    for path in (target_dir, draft_dir):
        path.mkdir(parents=True, exist_ok=True)
        vocab = write_tokenizer(path)
    config = {**(MINISTRAL3_CONFIG if family == "ministral3" else LLAMA_CONFIG),
              "num_hidden_layers": layers, "vocab_size": vocab}
    mx.random.seed(seed)
    target = module.Model(module.ModelArgs.from_dict(config))
    weights = {}
    for name, w in tree_flatten(target.parameters()):
        w = w * 3.0 if w.ndim == 2 else w
        later = any(f"layers.{i}." in name for i in range(1, layers))
        weights[name] = w * DAMPING if later and name.endswith(("o_proj.weight",
                                                                "down_proj.weight")) else w
    (target_dir / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(target_dir / "model.safetensors"), weights)
    draft_config = {**LLAMA_CONFIG, "num_hidden_layers": 1, "vocab_size": vocab}
    (draft_dir / "config.json").write_text(json.dumps(draft_config))
    mx.save_safetensors(str(draft_dir / "model.safetensors"),
                        {k: w for k, w in weights.items() if "layers." not in k or "layers.0." in k})
    return target_dir, draft_dir


def write_trained_head(head_dir: Path, target_dir: Path) -> Path:
    """An MTP head for the llama target in the DeepSeek layout, as the shipped default's.

    Its decoder layer is the target's first layer and it passes the embedding
    of the token it is given straight through, so it drafts what a one-layer
    target would (the later layers add little): acceptance is partial.
    """
    import mlx_spec
    from mlx_spec.mtp.heads import make_block

    head_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    layer = {"mtp_layout": "deepseek", **{key: config[key] for key in (
        "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "rms_norm_eps")}}
    target, _ = mlx_spec.load(str(target_dir))
    block, _ = make_block(target, layer)
    trunk, size = dict(tree_flatten(target.parameters())), config["hidden_size"]
    params = {name: trunk["model.layers.0." + name.removeprefix("block.")]
              for name, _ in tree_flatten(block.parameters()) if name.startswith("block.")}
    embed = trunk["model.embed_tokens.weight"]
    params.update({"enorm.weight": mx.full((size,), mx.sqrt(mx.mean(embed * embed)).item()),
                   "hnorm.weight": mx.ones((size,)),
                   "eh_proj.weight": mx.concatenate([mx.eye(size), mx.zeros((size, size))], 1),
                   "shared_head.norm.weight": trunk["model.norm.weight"]})
    index = config["num_hidden_layers"]
    mx.save_safetensors(str(head_dir / "model.safetensors"),
                        {f"model.layers.{index}.{name.removeprefix('block.')}": w
                         for name, w in params.items()}, metadata={"format": "pt"})
    (head_dir / "mtp_config.json").write_text(json.dumps(layer))
    return head_dir


def write_deepseek_v3(root: Path):
    """(target dir, MTP checkpoint dir): a tiny deepseek_v3 and its MTP layer (test_mtp's)."""
    from test_mtp import _moe_config, make_target, mtp_params, write_original

    target_dir = root / "deepseek_v3-target"
    target_dir.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(target_dir)
    target = make_target("deepseek_v3", vocab_size=vocab)
    (target_dir / "config.json").write_text(json.dumps(_moe_config("deepseek_v3", vocab)
                                                       | {"eos_token_id": 0}))
    mx.save_safetensors(str(target_dir / "model.safetensors"),
                        dict(tree_flatten(target.parameters())))
    # mlx-lm's deepseek_v3 drops only layer 61 when loading, so the MTP layer lives apart.
    return target_dir, write_original(root / "deepseek_v3-mtp", target, mtp_params(target))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    # Two layers for tensor parallelism (each adds two all-sums per pass), three for the pipeline.
    pairs = {"llama": write_pair(root, "llama", layers=2),
             "ministral3": write_pair(root, "ministral3", layers=3)}
    mtp = {"llama": (pairs["llama"][0], write_trained_head(root / "llama-mtp", pairs["llama"][0])),
           "deepseek_v3": write_deepseek_v3(root)}
    return {**pairs, "mtp": mtp}


def one_process(target_dir, draft_dir, prompt, **kwargs):
    """Tokens and rounds of the same call in this process, the target whole."""
    import mlx_spec
    from mlx_spec.generate import speculative_generate_step

    target, _ = mlx_spec.load(str(target_dir))
    draft = mlx_spec.load(str(draft_dir))[0] if draft_dir is not None else None
    tokens = []
    for round_ in speculative_generate_step(prompt, target, draft, calibration=None, **kwargs):
        tokens += round_.tokens
    return tokens


def assert_ranks_agree(results, scenarios):
    for scenario in scenarios:
        assert results[0][scenario] == results[1][scenario], scenario


def drafted_and_accepted(result):
    return (sum(r[1] for r in result["rounds"]), sum(r[2] for r in result["rounds"]))


SCENARIOS = ["greedy_k3", "greedy_adaptive", "sampled_seeded", "sampled_adaptive"]
CHI_SQUARE = "chi_square:200"


@pytest.fixture(scope="module")
def tensor_parallel(models, tmp_path_factory):
    """One 2-rank launch, llama sharded by its shard(): the scenarios, plain steps and MTP."""
    target_dir, draft_dir = models["llama"]
    return launch(tmp_path_factory.mktemp("tp"), target_dir, draft_dir,
                  SCENARIOS + ["plain", "mtp_greedy"], "tensor",
                  extra=["--mtp-weights", str(models["mtp"]["llama"][1])])


@pytest.fixture(scope="module")
def pipeline(models, tmp_path_factory):
    """One 2-rank launch, ministral3 split by its pipeline(): the scenarios and the chi-square,
    MTP drafting on deepseek_v3, then a load where rank 1 is given the llama target instead."""
    target_dir, draft_dir = models["ministral3"]
    mtp_target, mtp_weights = models["mtp"]["deepseek_v3"]
    return launch(tmp_path_factory.mktemp("pp"), target_dir, draft_dir,
                  SCENARIOS + [CHI_SQUARE, "mtp_greedy"], "pipeline",
                  extra=["--mtp-target", str(mtp_target), "--mtp-weights", str(mtp_weights),
                         "--then-mismatch", str(models["llama"][0])])


@pytest.mark.parametrize("family", ["llama", "ministral3"])
def test_sharded_target_matches_one_process(models, tensor_parallel, pipeline, family):
    """Greedy output of 2 ranks equals one process token for token; every rank takes the same rounds.

    Tensor parallel (llama's shard()) and pipeline (ministral3's pipeline()):
    fixed k, adaptive k with prompt lookup in front (the k sequence is the same
    on both ranks), plain steps, and seeded and differently seeded sampling.
    """
    from distributed_worker import PROMPT

    target_dir, _ = models[family]
    results = tensor_parallel if family == "llama" else pipeline
    assert_ranks_agree(results, SCENARIOS)
    rank0 = results[0]
    assert rank0["greedy_k3"]["tokens"] == one_process(target_dir, None, PROMPT, max_tokens=40)
    drafted, accepted = drafted_and_accepted(rank0["greedy_k3"])
    assert drafted > 0 and 0 < accepted < drafted  # rounds kept part of the drafts: rewinds ran
    assert rank0["greedy_adaptive"]["tokens"] == one_process(target_dir, None, PROMPT * 3,
                                                             max_tokens=48)
    # The policy's timing-driven choices are rank 0's everywhere (assert_ranks_agree: the
    # same rounds on both ranks). Which k it takes is this machine's timings' call: usually
    # speculative rounds and plain steps both, but on a loaded 2-core machine (a parallel test
    # run) it has taken plain steps only; a unit test asserts no timing.
    if "plain" in rank0:
        assert_ranks_agree(results, ["plain"])
        assert rank0["plain"]["tokens"] == one_process(target_dir, None, PROMPT, max_tokens=12)
    # A fixed k's sampled rounds keep drafts (seeded: always the same ones); the adaptive
    # sampled scenario's drafting is its timings' call, as the greedy one's (ranks agree above).
    assert drafted_and_accepted(rank0["sampled_seeded"])[1] > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_mtp_drafting_on_a_sharded_target_matches_one_process(models, tensor_parallel, pipeline,
                                                              family):
    """draft_model="mtp" on 2 ranks: greedy output equals one process token for token.

    Tensor parallel: llama with a head trained for it (the shipped default's
    kind); pipeline: deepseek_v3, whose hidden state every stage receives from
    the last. Every rank runs the MTP layer whole and takes rank 0's drafts.
    """
    from distributed_worker import PROMPT

    results = tensor_parallel if family == "llama" else pipeline
    assert_ranks_agree(results, ["mtp_greedy"])
    target_dir, _ = models["mtp"][family]
    rank0 = results[0]["mtp_greedy"]
    assert rank0["tokens"] == one_process(target_dir, None, PROMPT, max_tokens=40)
    mtp_rounds = [r for r in rank0["rounds"] if r[0] == "mtp"]
    drafted, accepted = sum(r[1] for r in mtp_rounds), sum(r[2] for r in mtp_rounds)
    assert drafted > 0 and 0 < accepted < drafted  # the MTP layer drafted, partly right


def test_sharded_sampler_is_exact(pipeline):
    """Chi-square of the first two tokens at T = 1 with the target sharded (pipeline), as for one process."""
    assert_ranks_agree(pipeline, [CHI_SQUARE])
    result = pipeline[0][CHI_SQUARE]
    assert result["p_value"] > 1e-3, result
    assert 0.2 < result["acceptance"] < 1.0


def test_ranks_with_different_models_stop_with_one_sentence(pipeline):
    for rank in (0, 1):
        assert pipeline[rank]["mismatch"] == (
            "Rank 1 has a different target model than rank 0 (its config or weight files "
            "differ, or it is missing); put the same model at the same path on every machine.")


def test_cli_under_launch_prints_the_one_process_text_once(models):
    """`mlx.launch -n 2 -- mlx-spec generate` prints rank 0's text, which is the one-process text."""
    target_dir, draft_dir = models["ministral3"]  # pipeline: fewer collectives per pass
    args = ["generate", "--model", str(target_dir), "--draft-model", str(draft_dir),
            "--prompt", "def fibonacci(n):", "-n", "24", "--quiet", "--sharding", "pipeline"]
    cli = str(Path(sys.executable).parent / "mlx-spec")
    import mlx_spec

    target, tokenizer = mlx_spec.load(str(target_dir))
    text = mlx_spec.generate(target, tokenizer, "def fibonacci(n):",
                             draft_model=mlx_spec.load(str(draft_dir))[0], max_tokens=24)
    proc = subprocess.Popen([str(LAUNCH), "--backend", "ring", "-n", "2", "-p", str(free_port()),
                             "--", cli, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode() == text + "\n"


class FakeGroup:
    def __init__(self, size, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_a_class_that_cannot_be_sharded_is_one_sentence(tmp_path):
    from mlx_spec.distributed.loading import _check_shardable

    config = {**LLAMA_CONFIG, "model_type": "gemma", "num_hidden_layers": 2, "vocab_size": 64,
              "head_dim": 12}
    tmp_path.joinpath("config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"^mlx-lm's gemma model class cannot be sharded across "
                                         r"machines; run the target on one machine"):
        _check_shardable(tmp_path, FakeGroup(2), "auto")


def test_sharding_that_does_not_fit_is_one_sentence(models):
    from mlx_spec.distributed.loading import _check_shardable

    target_dir = models["llama"][0]
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) does not divide among 3 ranks"):
        _check_shardable(target_dir, FakeGroup(3), "tensor")
    with pytest.raises(ValueError, match=r"cannot be sharded that way \(it supports tensor\)"):
        _check_shardable(target_dir, FakeGroup(2), "pipeline")
    with pytest.raises(ValueError, match=r"3 layers, fewer than the 4 ranks"):  # ministral3
        _check_shardable(models["ministral3"][0], FakeGroup(4), "pipeline")
    assert _check_shardable(target_dir, FakeGroup(2), "auto") == "tensor"
    assert _check_shardable(models["ministral3"][0], FakeGroup(2), "pipeline") == "pipeline"


def test_a_draft_too_large_to_replicate_is_one_sentence():
    from mlx_spec.distributed import check_draft_fits

    small, large = make_llama(layers=1), make_llama(layers=4)
    check_draft_fits(large, small)
    with pytest.raises(ValueError, match=r"^The draft model \(\d+\.\d MB\) is larger than each "
                                         r"rank's share of the sharded target"):
        check_draft_fits(small, large)


def test_fingerprints_tell_models_apart(models):
    from mlx_spec.distributed.loading import disagreement, fingerprint

    llama, ministral3 = models["llama"][0], models["ministral3"][0]
    assert fingerprint(llama) == fingerprint(llama) != fingerprint(ministral3)
    assert disagreement([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5]]).startswith(
        "Rank 2 has a different draft model than rank 0")
    assert disagreement([[1, 2, 0, 0]] * 3) is None


def test_outside_a_launch_and_with_a_confidence_stop_is_one_sentence():
    from mlx_spec.distributed import agree_across_ranks, load_sharded
    from mlx_spec.distributed.group import mark_sharded

    with pytest.raises(ValueError, match="needs a group of two or more ranks; start the program "
                                         "with mlx.launch"):
        load_sharded("/nonexistent", group=FakeGroup(1))
    target = make_llama()
    mark_sharded(target, mx.distributed.init())
    with pytest.raises(ValueError, match="^draft_confidence stops drafting on each rank's own"):
        agree_across_ranks(target, [], None, draft_confidence=0.5)


class ClockedPolicy:
    """Fixed k, plain blocks of 3 every fourth call; records what it was told."""

    def __init__(self):
        self.told = []
        self.calls = 0

    def proposal_length(self, source):
        self.calls += 1
        return 0 if self.calls % 4 == 0 else 2

    def plain_steps(self):
        return 3

    def observe(self, round_, seconds):
        self.told.append((round_.num_drafted, seconds))

    def describe(self):
        return {}


def test_the_policy_is_told_rank0_times_in_order(monkeypatch):
    """Over speculative rounds and pipelined plain blocks, every round reaches the policy, in
    order, with the time rank 0 measured for it (here a one-rank group and a scripted clock)."""
    from mlx_spec import loop as loop_module
    from mlx_spec.distributed.group import mark_sharded
    from mlx_spec.generate import speculative_generate_step

    ticks = iter(i * i * 0.001 for i in range(1, 1000))  # round i lasts (2i + 1) ms
    round_clock = loop_module.RoundClock
    monkeypatch.setattr(loop_module, "RoundClock", lambda: round_clock(lambda: next(ticks)))
    target, draft = make_llama(layers=2), make_llama(layers=1, seed=5)
    mark_sharded(target, mx.distributed.init())  # a group of one: the agreement path, no launch
    policy = ClockedPolicy()
    rounds = [(r.num_drafted, len(r.tokens)) for r in speculative_generate_step(
        [1, 2, 3, 4], target, draft, max_tokens=40, policy=policy)]
    assert any(d == 0 for d, _ in rounds) and any(d > 0 for d, _ in rounds)
    told = policy.told
    assert [d for d, _ in told] == [d for d, _ in rounds][:len(told)]
    assert len(told) >= len(rounds) - 2  # held back one or two rounds, never lost
    seconds = [s for _, s in told]
    assert seconds == pytest.approx([(2 * i + 1) * 1e-3 for i in range(1, len(told) + 1)],
                                    abs=2e-6)


def test_times_taken_before_the_rounds_are_rank0s_on_every_rank():
    """A draft's timed prefill and its one timed step (cold start) set the policy's catch-up
    cost and whether the draft looks at all: on a sharded target they reach every rank's policy
    as rank 0's, through the agreement (whole microseconds; a group of one here)."""
    from mlx_spec.distributed.group import mark_sharded
    from mlx_spec.generate import speculative_generate_step
    from mlx_spec.policy import AdaptivePolicy

    target, draft = make_llama(layers=2), make_llama(layers=1, seed=5)
    mark_sharded(target, mx.distributed.init())
    policy = AdaptivePolicy()
    for _ in speculative_generate_step(list(range(1, 30)), target, draft, max_tokens=4,
                                       policy=policy, prompt_lookup=False):
        pass
    for seconds in (policy.step_seconds["draft"], policy.catch_up_seconds["draft"] * 28):
        assert seconds > 0
        assert seconds * 1e6 == pytest.approx(round(seconds * 1e6), abs=1e-6)


def test_bench_distributed_outside_a_launch_is_one_sentence():
    from click.testing import CliRunner

    from mlx_spec.cli import main

    result = CliRunner().invoke(main, ["bench", "--distributed", "--json", "/tmp/unused.json"])
    assert result.exit_code == 2
    assert "--distributed measures a target sharded across ranks; run it under mlx.launch" in \
        result.output


def test_bench_distributed_measures_on_a_group_of_one(models):
    """The bench's measurements and report, on one rank (the launch itself is the CLI's)."""
    import mlx_spec
    from mlx_spec.bench.distributed import render_markdown, run_distributed_bench

    target_dir, draft_dir = models["llama"]
    target, tokenizer = mlx_spec.load(str(target_dir))
    draft = mlx_spec.load(str(draft_dir))[0]
    result = run_distributed_bench(target, draft, tokenizer, mx.distributed.init(),
                                   {"target": "t", "draft": "d"}, max_tokens=8)
    assert len(result.plain_tps) == len(result.speculative_tps) == 3
    assert set(result.verify_seconds) == set(result.communication_seconds) == {1, 2, 4, 8, 16}
    report = render_markdown(result)
    assert "| T (tokens per pass) | pass, ms |" in report and "Speed-up" in report


def test_the_sharded_mark_leaves_mlx_lm_attributes_alone():
    """qwen3_5's text model gathers its logits when its own `sharding_group` is set: a pipelined
    one must keep None there, so the mark lives in an attribute of mlx-spec's."""
    from families import make_family

    from mlx_spec.distributed import sharding_group
    from mlx_spec.distributed.group import mark_sharded

    target, group = make_family("qwen3_5"), mx.distributed.init()
    mark_sharded(target, group)
    assert sharding_group(target) is group
    assert target.language_model.sharding_group is None


def test_the_mtp_layer_is_built_on_any_pipeline_stage():
    """A stage holds None for the layers of the stages before it, and may hold only linear-
    attention layers (qwen3_5: layers 1 and 3 are full attention); the MTP layer is the same."""
    from families import make_family

    from mlx_spec.mtp.heads import make_block

    def shapes(block):
        return {name: w.shape for name, w in tree_flatten(block.parameters())}

    expected = shapes(make_block(make_family("qwen3_5"))[0])
    for stage in ([None, None, None, 3], [0]):  # the last of 4 stages, the first of 4
        target = make_family("qwen3_5")
        layers = target.language_model.model.layers
        target.language_model.model.layers = [None if i is None else layers[i] for i in stage]
        block, _ = make_block(target)
        assert not block.layers[0].is_linear and shapes(block) == expected


def test_a_launch_that_times_out_is_cleaned_up(models, tmp_path):
    """The launch, its ranks and their children share a process group, killed whole."""
    pids = []
    with pytest.raises(pytest.fail.Exception, match="did not finish within 6 s"):
        launch(tmp_path / "out", models["llama"][0], scenarios=["hang"], timeout=6,
               started=pids.append)
    assert group_members(pids[0]) == []  # no process of the launch's group is left


def group_members(pgid: int, wait: float = 5.0) -> list:
    """Live (not zombie) processes of a process group, after up to `wait` s for them to die."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
                alive.append(int(stat.parent.name))
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def test_the_weight_index_is_never_read_half_written(tmp_path):
    """Every rank on one machine writes the pipeline's weight index while others read it."""
    import threading

    from mlx_spec.distributed.loading import _write_index

    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {f"layers.{i}.weight": mx.zeros((2, 2)) for i in range(200)})
    index, seen, done = tmp_path / "model.safetensors.index.json", [], threading.Event()

    def write():
        for _ in range(300):
            _write_index(tmp_path)
        done.set()
    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        if index.exists():
            seen.append(len(json.loads(index.read_text())["weight_map"]))
    writer.join()
    assert seen and set(seen) == {200}
