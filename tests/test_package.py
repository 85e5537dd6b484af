"""The package facade: every public name resolves, and dir() lists the lazy ones."""

import dataclasses
import inspect
import re
import subprocess
import sys

import pytest

import orchmllm
import orchmllm.data


def test_every_public_name_resolves_and_is_listed_by_dir():
    for module in (orchmllm, orchmllm.data):
        listed = dir(module)
        for name in module.__all__:
            assert name in listed, (module.__name__, name)
            assert getattr(module, name) is not None


@pytest.mark.integration
def test_help_lists_the_lazy_names():
    code = "import orchmllm, pydoc; print(pydoc.render_doc(orchmllm, renderer=pydoc.plaintext))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("BalancedDataLoader", "Orchestrator", "BatchDispatcher", "global_num_items"):
        assert name in out.stdout, name


def _section(doc: str, title: str) -> str | None:
    """The indented body of a Google-style ``Title:`` section, or None."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    return match.group(1) if match else None


def _names(section: str | None, name: str) -> bool:
    return section is not None and re.search(rf"^\s+\**{re.escape(name)}\b[^:\n]*:", section, re.M)


def _init_parameters(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    params = inspect.signature(cls.__init__).parameters.values()
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in plain and p.name != "self"]


def _docstring_gaps(obj: object, qualname: str) -> list[str]:
    """What the docstring of a public function or class leaves out: a parameter or field not
    named under ``Args:``/``Attributes:``, a return value without ``Returns:``, and the same
    for each public method; a public property needs a docstring."""
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return [f"{qualname}: no docstring"]
    if inspect.isclass(obj):
        sections = [_section(doc, "Args"), _section(doc, "Attributes")]
        gaps = [
            f"{qualname}: {p} is not under Args: or Attributes:"
            for p in _init_parameters(obj)
            if not any(_names(s, p) for s in sections)
        ]
        for name, member in vars(obj).items():
            if name.startswith("_"):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property) and not inspect.getdoc(member):
                gaps.append(f"{qualname}.{name}: property without a docstring")
            elif inspect.isfunction(member):
                gaps += _docstring_gaps(member, f"{qualname}.{name}")
        return gaps
    signature = inspect.signature(obj)
    args = _section(doc, "Args")
    gaps = [
        f"{qualname}: argument {p} is not under Args:"
        for p in signature.parameters
        if p not in ("self", "cls") and not _names(args, p)
    ]
    if signature.return_annotation not in (None, "None", inspect.Signature.empty) and (
        _section(doc, "Returns") is None and _section(doc, "Yields") is None
    ):
        gaps.append(f"{qualname}: returns a value but has no Returns:")
    return gaps


def test_every_public_name_documents_its_arguments_and_results():
    gaps = [
        gap
        for module in (orchmllm, orchmllm.data)
        for name in module.__all__
        if inspect.isclass(obj := getattr(module, name)) or inspect.isfunction(obj)
        for gap in _docstring_gaps(obj, f"{module.__name__}.{name}")
    ]
    assert not gaps, "\n".join(gaps)


def test_the_docstring_check_catches_gaps():
    def documented(x: int, *, y: int = 0) -> int:
        """Add.

        Args:
            x: one.
            y: two.

        Returns:
            The sum.
        """
        return x + y

    def undocumented(x: int, y: int) -> int:
        """Add.

        Args:
            x: one.
        """
        return x + y

    assert _docstring_gaps(documented, "documented") == []
    assert _docstring_gaps(undocumented, "undocumented") == [
        "undocumented: argument y is not under Args:",
        "undocumented: returns a value but has no Returns:",
    ]
