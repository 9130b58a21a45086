"""bench.studies.real_models without its models: bad arguments in one sentence, and streamed
responses read as rounds the moment they arrive (the first round untimed), so that
time_after_prefill gives mlx-spec's and mlx-lm's streams the same clock."""

from types import SimpleNamespace

import pytest

from bench.studies.real_models import as_rounds, main
from mlx_spec.bench.timing import time_after_prefill


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--sets", "closed"], ["--temps", "x"],
                                  ["--temps", "-1"], ["--repeats", "0"], ["--tokens", "1"]])
def test_bad_arguments_are_refused_in_one_sentence(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert ": error: " in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_missing_model_file_is_one_sentence(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_SPEC_REAL_MODELS", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        main(["--models", "gemma3"])
    assert exited.value.code == 2
    assert f"gemma-3-270m-q4_k_m.gguf is not in {tmp_path}" in capsys.readouterr().err


def _spec(token, passes):
    """An mlx-spec response: its stats count the target passes so far, its own round's too."""
    return SimpleNamespace(token=token, stats=SimpleNamespace(rounds=passes, plain_steps=0))


def test_the_first_rounds_later_tokens_count_none_and_every_other_token_one():
    spec = [_spec(1, 1), _spec(2, 1), _spec(3, 1), _spec(4, 2), _spec(5, 2), _spec(6, 3)]
    seen, last = [], []
    assert [r.tokens for r in as_rounds(spec, seen, last)] == [[1], [], [], [4], [5], [6]]
    assert seen == [1, 2, 3, 4, 5, 6] and last[0].token == 6
    lm = [SimpleNamespace(token=t) for t in (7, 8, 9)]  # mlx-lm's: no stats, a token a round
    assert [r.tokens for r in as_rounds(lm, [], [])] == [[7], [8], [9]]
    assert time_after_prefill(as_rounds(spec, [], [])).tokens == 3  # tokens 4, 5 and 6


def test_a_round_is_handed_on_the_moment_its_response_arrives():
    """Not when the next one does: a round held back until the next arrived would start the
    clock one round late and give that round's tokens for free."""
    order = []

    def responses():
        for token, passes in ((1, 1), (2, 2), (3, 3)):
            order.append(f"made {token}")
            yield _spec(token, passes)

    for round_ in as_rounds(responses(), [], []):
        order.append(f"timed {round_.tokens}")
    assert order == ["made 1", "timed [1]", "made 2", "timed [2]", "made 3", "timed [3]"]
