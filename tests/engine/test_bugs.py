"""The bug corpus (tests/engine/bugs.py): docs/bugs.md lists its classes; every class built by mutating a planner's
plan is refuted where it enters, with the report saying what the class is, and its twin is proved. (A1–A14 are
pinned in test_mutants.py, the traced classes in tests/frontend/test_traced.py; bench/bugs.py runs them all.)"""
import dataclasses
import re

import pytest

from tests.engine.bugs import CORPUS, DOCS
from tv_ray import api
from tv_ray.plan_check import check_plan

MUTATIONS = [cls for cls, bug in CORPUS.items() if bug.expressible and not bug.traced and not cls.startswith("A")]
_proved: dict[int, str] = {}


def _verify(plan, timeout=10.0):
    return api.verify(plan, engine="local", progress=False, timeout=timeout)


def test_docs_list_the_classes_of_the_corpus():
    assert re.findall(r"^\| ([ABC]\d+) \|", DOCS.read_text(), re.M) == list(CORPUS) and len(CORPUS) == 51
    assert sum(bug.expressible for bug in CORPUS.values()) >= 45
    assert all(bug.how and not bug.missing if bug.expressible else bug.missing and not bug.how
               for bug in CORPUS.values())


@pytest.mark.parametrize("cls", MUTATIONS)
def test_class_is_refuted_where_it_enters_and_its_twin_proved(cls):
    case = CORPUS[cls].build()
    check_plan(case.faulty)
    result = _verify(case.faulty, case.timeout)
    assert result.status == "refuted", result.report.get("headline")
    assert not case.location_problems(result), (case.location_problems(result), result.report["headline"])
    if id(case.twin) not in _proved:        # twins are shared: each verified once
        _proved[id(case.twin)] = _verify(case.twin).status
    assert _proved[id(case.twin)] == "proved"



def test_a_report_pointing_elsewhere_is_not_located():
    case = CORPUS["B14"].build()
    result = _verify(case.faulty)
    elsewhere = dataclasses.replace(case, phase="fwd", module="layers.1", tensor="t_54~1", says=("3 × logical",))
    assert elsewhere.location_problems(result) == [
        "phase 'bwd', expected 'fwd'", "tensor 't_54~2.times_dp', expected 't_54~1'",
        "module 'layers.0.mlp.up_proj', expected 'layers.1' or under it", "the headline does not say '3 × logical'"]
