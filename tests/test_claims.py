"""The chapters' claims-as-checks helper: a deterministic claim fails loudly, a measured one
prints a verdict either way."""

import numpy as np
import pytest

from minickpt.labkit.claims import ClaimError, claim, verdict


def test_a_claim_that_holds_prints_it(capsys):
    claim(2 + 2 == 4, "four steps are kept")
    assert capsys.readouterr().out.strip() == "claim: four steps are kept  [holds]"
    claim(np.int64(3) == 3, "numpy bools count as bools")


def test_a_claim_that_fails_names_the_sentence_and_what_was_seen():
    with pytest.raises(ClaimError, match=r"'four steps are kept'.*this run: \[2, 4, 6\]"):
        claim(False, "four steps are kept", seen=[2, 4, 6])


def test_a_claim_needs_a_real_bool():
    class Always:
        def __bool__(self):
            return True

    with pytest.raises(TypeError, match="must be a bool"):
        claim(Always(), "anything")


def test_a_verdict_never_fails_and_says_which_way(capsys):
    assert verdict(True, "the save is cheaper than a step", otherwise="x", seen="3 ms")
    assert not verdict(False, "the save is cheaper than a step",
                       otherwise="a busy machine: look at the medians", seen="30 ms")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "verdict: this run agrees: the save is cheaper than a step (3 ms)"
    assert out[1].startswith("verdict: this run differs from 'the save is cheaper than a step' "
                             "(30 ms): a busy machine")
