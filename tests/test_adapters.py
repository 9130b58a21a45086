"""mlx-lm's fine-tuned adapters (`adapter_path`, `--adapter-path`: the directory mlx_lm.lora
writes): applied to the target as mlx_lm.load applies them, to a GGUF file's model too. The
adapted target's greedy text is mlx-lm's (speculating with the base model as its draft, so
drafts are kept and rejected); a directory without the adapter files, or adapters of another
model's shapes, is one sentence.
"""

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from tiny import write_model_dir

from mlx_spec import load
from mlx_spec.cli import main
from mlx_spec.generate import speculative_generate_step

LORA = {"rank": 4, "scale": 20.0, "dropout": 0.0}
N = 24


def write_adapters(model, path, seed=0, layers=2):
    """Random LoRA adapters for the last `layers` layers of `model` (changed in place to carry
    them), as mlx_lm.lora saves them: adapter_config.json and adapters.safetensors."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    linear_to_lora_layers(model, layers, LORA)
    mx.random.seed(seed)
    adapters = {name: mx.random.normal(w.shape) * 0.2
                for name, w in tree_flatten(model.trainable_parameters())
                if name.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "adapters.safetensors"), adapters)
    (path / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": LORA}))
    return path


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """(a tiny model directory, adapters for it)."""
    root = tmp_path_factory.mktemp("adapters")
    model_dir = write_model_dir(root / "model")
    base, _ = load(str(model_dir))
    return model_dir, write_adapters(base, root / "adapters")


def greedy(model, prompt, n=N):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


def test_the_adapted_target_speculates_to_mlx_lms_text(tuned):
    import mlx_lm

    model_dir, adapters = tuned
    reference, tokenizer = mlx_lm.load(str(model_dir), adapter_path=str(adapters))
    target, _ = load(str(model_dir), adapter_path=str(adapters))
    base, _ = load(str(model_dir))
    prompt = tokenizer.encode("def fibonacci(n):\n")
    expected = greedy(reference, prompt)
    assert expected != greedy(base, prompt)  # the adapters change the text
    for k in (2, 4):
        rounds = list(speculative_generate_step(prompt, target, base, max_tokens=N,
                                                num_draft_tokens=k, prompt_lookup=False,
                                                calibration=None))
        assert [t for r in rounds for t in r.tokens] == expected, k
        assert 0 < sum(r.num_accepted for r in rounds) < sum(r.num_drafted for r in rounds)


def test_the_command_line_takes_mlx_lms_option(tuned):
    from mlx_spec import generate

    model_dir, adapters = tuned
    target, tokenizer = load(str(model_dir), adapter_path=str(adapters))
    expected = generate(target, tokenizer, "def fibonacci(n):", max_tokens=N)
    result = CliRunner().invoke(main, ["generate", "-m", str(model_dir), "--adapter-path",
                                       str(adapters), "-n", str(N), "-q",
                                       "--prompt", "def fibonacci(n):"])
    assert result.exit_code == 0, result.output
    assert result.stdout[:-1] == expected


def test_missing_or_unfitting_adapters_are_one_sentence(tuned, tmp_path, monkeypatch):
    import shutil

    model_dir, adapters = tuned
    with pytest.raises(ValueError, match="holds no adapter_config.json or adapters.safetensors"):
        load(str(model_dir), adapter_path=str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # a path given with ~ is read there
    shutil.copytree(adapters, tmp_path / "mine")
    assert load(str(model_dir), adapter_path="~/mine")[0] is not None
    broken = tmp_path / "broken"
    shutil.copytree(adapters, broken)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json is not JSON"):
        load(str(model_dir), adapter_path=str(broken))
    (broken / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
    with pytest.raises(ValueError, match="adapter_config.json lacks what mlx-lm needs"):
        load(str(model_dir), adapter_path=str(broken))
    other_dir = write_model_dir(tmp_path / "wider", hidden=64)
    other, _ = load(str(other_dir))
    wider = write_adapters(other, tmp_path / "wider-adapters")
    with pytest.raises(ValueError, match="do not fit this model"):
        load(str(model_dir), adapter_path=str(wider))
    result = CliRunner().invoke(main, ["generate", "-m", str(model_dir), "--adapter-path",
                                       str(tmp_path), "-n", "4"])
    assert result.exit_code == 2 and "holds no adapter_config.json" in result.output


@pytest.mark.real_model
def test_a_gguf_target_takes_adapters(tmp_path):
    """SmolLM2 (GGUF, Q4_1) with random LoRA adapters on its last two layers: other text than
    the base model's, and prompt lookup keeps it."""
    from gguf_files import real_model_path

    from mlx_spec import generate

    path = real_model_path("SmolLM2-135M-Instruct.Q4_1.gguf")
    if path is None:
        pytest.skip("SmolLM2 is not downloaded (make real-models)")
    base, tokenizer = load(str(path))
    adapters = write_adapters(load(str(path))[0], tmp_path / "adapters", layers=2)
    target, _ = load(str(path), adapter_path=str(adapters))
    prompt = "Copy: the keeper wrote the wind in his book. Copy: the keeper wrote"
    plain = generate(target, tokenizer, prompt, max_tokens=10, prompt_lookup=False)
    assert plain != generate(base, tokenizer, prompt, max_tokens=10, prompt_lookup=False)
    assert generate(target, tokenizer, prompt, max_tokens=10, prompt_lookup=True) == plain
