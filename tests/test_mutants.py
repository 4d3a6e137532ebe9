"""The mutants of `tests.mutants`: each applies to exactly one place of the current tree (default
tier, instant), and the tests it names pass without it and fail with it (slow tier: a scratch copy
of the tree and a pytest run or two each)."""

import pytest

from tests import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_exactly_one_place_and_names_tests_that_exist(mutant):
    assert mutants.places(mutant) == 1, f"{mutant.name}: update its snippet in tests/mutants.py"
    assert mutant.new != mutant.old and mutant.tests
    for test in mutant.tests:
        assert (mutants.ROOT / test.split("::")[0]).is_file(), test


def test_mutant_names_are_unique():
    names = [m.name for m in mutants.MUTANTS]
    assert len(set(names)) == len(names)


@pytest.mark.slow
@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_the_suite_catches_the_mutant(mutant):
    out = mutants.run(mutant)
    if out.verdict == "skipped":
        pytest.skip(f"{mutant.name}: its tests skip here\n{out.detail}")
    assert out.verdict == "caught", f"{mutant.name} ({mutant.bug}): {out.verdict}\n{out.detail}"
