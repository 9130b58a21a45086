"""The k_choice study: the defaults' rounds per k against fixed k, on the tiny test pair."""

import pytest

from bench.studies.k_choice import DEFAULTS, fixed, main, measure

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]


def test_fixed_k_rounds_draft_k_and_the_realized_acceptance_reads_the_draft(
        target_model, drafts):
    """A fixed k drafts k (fewer only where the reply's room ends); an identical draft's
    rounds realize acceptance 1.0 and an unrelated one's far less, and the policy's estimate
    follows (a tally that mixed up methods or positions would not). The defaults keep their
    drafter on here (auto_off=False): the point is the tally, not the off switch."""
    keep_on = {"auto_off": False}  # a draft as dear as the target would be switched off
    same = measure(target_model, drafts["identical"], PROMPTS, 0.8, (1, 3), 1, 24,
                   defaults_options=keep_on)
    other = measure(target_model, drafts["unrelated"], PROMPTS, 0.8, (1, 3), 1, 24,
                    defaults_options=keep_on)
    for row in (same, other):
        assert set(row["methods"]) == {DEFAULTS, fixed(1), fixed(3)}
        assert set(row["methods"][fixed(1)]["per_k"]) == {1}
        per_k = row["methods"][fixed(3)]["per_k"]
        assert max(per_k, key=lambda k: per_k[k]["rounds"]) == 3 and set(per_k) <= {1, 2, 3}
        assert all(v > 0 for v in row["fixed_over_defaults"].values())
        for method in row["methods"].values():
            emitted = sum(v["rounds"] * v["tokens_per_round"] for v in method["per_k"].values())
            assert emitted <= 24 * len(PROMPTS) + 1e-6
    assert same["realized"] == 1.0 and same["estimate"] > 0.8
    assert other["realized"] is not None and other["realized"] < 0.9
    assert other["estimate"] < same["estimate"]


@pytest.mark.parametrize("argv", [["--ks", "0"], ["--ks", "a,b"], ["--pairs", "nope"],
                                  ["--repeats", "0"]])
def test_bad_arguments_are_refused_in_one_sentence(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv + ["--out", "unused"])
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_realized_acceptance_counts_the_positions_each_round_reached():
    """Kept drafts over reached positions (the kept ones and the first rejected one), after
    the drafter's first SKIPPED_ROUNDS rounds; lookup rounds and plain steps are not the
    drafter's. A tally dividing by the drafted positions would read 4 / 6."""
    from bench.studies.k_choice import SKIPPED_ROUNDS, Tally
    from mlx_spec.loop import Round

    class Policy:
        def source(self, name):
            return type("Estimate", (), {"acceptance": 0.5})()

    def draft(k, n):
        return Round([0] * (n + 1), k, n, "draft", None)

    stream = ([Round([0], 0, 0, "target", None)] + [draft(2, 0)] * SKIPPED_ROUNDS
              + [Round([0, 0], 4, 1, "lookup", None), Round([0], 0, 0, "target", None),
                 draft(3, 1), draft(3, 3)])
    tally = Tally()
    tally.run(iter(stream), Policy())
    assert (tally.kept, tally.reached) == (4, 5)
    assert tally.estimates == [0.5, 0.5]
    assert sorted(tally.round_ms) == [2, 3] and len(tally.round_ms[3]) == 2
    assert len(tally.tokens_per_s) == 1
