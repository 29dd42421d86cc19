"""Mutation testing of the labs' tests (issue 48): how good a lab's tests are is measured by
the wrong versions they reject, and the wrong versions are made by machine, not imagined.

Each task's reference functions are mutated with cosmic-ray's operators (and a few more of the
same kind, :mod:`.operators`), and each mutant is run through the task's test cells, visible
and hidden, by the judge's ``run_tests`` (:mod:`autograder.judge.cells`), in-process, the way
the grader runs a student's function (:mod:`.worker`). A mutant no test rejects is a survivor:
it becomes a test, or it is listed in ``equivalent.toml`` with why no user could tell it apart.
``docs/mutation-report.md`` and ``.json`` are the result (:mod:`.report`); CI checks that they
describe the current task code and tests, without running a mutant.
"""
