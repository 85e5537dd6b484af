"""The package facade: every public name resolves, and dir() lists the lazy ones."""

import subprocess
import sys

import orchmllm
import orchmllm.data


def test_every_public_name_resolves_and_is_listed_by_dir():
    for module in (orchmllm, orchmllm.data):
        listed = dir(module)
        for name in module.__all__:
            assert name in listed, (module.__name__, name)
            assert getattr(module, name) is not None


def test_help_lists_the_lazy_names():
    code = "import orchmllm, pydoc; print(pydoc.render_doc(orchmllm, renderer=pydoc.plaintext))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for name in ("BalancedDataLoader", "Orchestrator", "BatchDispatcher", "global_num_items"):
        assert name in out.stdout, name
