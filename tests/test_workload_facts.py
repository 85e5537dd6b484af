"""The workload's numbers: one table, each with its source or an assumption, and no number of
its own in the code that draws the paper mix."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from orchmllm.data import recipe, workloads
from orchmllm.data.workload_facts import FACTS, fact

# The functions that draw the paper mix's lengths.
DRAWS = (
    recipe._draw_paper_mix,
    workloads._llava_image,
    workloads._librispeech,
    workloads._spoken_qa,
    workloads._text,
)
PLAIN = {0, 1, 2}  # counting, indexing, pairs: not quantities of the data


@pytest.mark.parametrize("name", sorted(FACTS))
def test_every_number_names_its_source_or_says_it_is_assumed(name):
    source = FACTS[name].source
    cited = re.search(r"\b(19|20)\d\d\b|paper|a word or phrase|a choice", source)
    assert source.startswith("assumed: ") or cited, f"{name}: {source!r}"


@pytest.mark.parametrize("draw", DRAWS, ids=lambda f: f.__name__)
def test_the_draws_use_no_number_of_their_own(draw):
    tree = ast.parse(inspect.getsource(draw).lstrip())
    own = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
        and node.value not in PLAIN
    ]
    assert not own, f"{draw.__name__} draws with numbers outside FACTS: {own}"


def test_fact_reads_the_table():
    assert fact("asr.words_per_s") == FACTS["asr.words_per_s"].value
    with pytest.raises(KeyError):
        fact("no.such.entry")
