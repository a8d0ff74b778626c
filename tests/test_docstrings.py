"""Every name the package exports documents its shapes and shows an example that runs; the examples are doctests,
run here. ``help()`` opens on a class's own documentation, and an encoding called as a module does what its one
hook does (or says, in one line, what to call)."""

import doctest
import inspect
import pydoc
import re
import sys

import pytest
import torch
from torch import nn

import posenc_lab as pl
from posenc_lab import (ENCODINGS, Encoding, KVCache, PosencError, SinkCache, apply_rope, bias_tensor, inv_freq,
                        make_encoding)

#: a ``Shapes:`` line naming at least one shape in the einops-style axes (b batch, h heads, n positions, d head dim)
SHAPES = re.compile(r"^\s*Shapes?:.*``[^`]*\b[bhnd]\b[^`]*``", re.MULTILINE)
HELP_LINES = 40


def is_data(obj) -> bool:
    """A registry (a dict or tuple of names): it cannot carry a docstring of its own."""
    return not (inspect.ismodule(obj) or callable(obj))


def takes_tensors(obj) -> bool:
    """Whether ``obj`` is a callable that takes or returns tensors: a module class, a key/value cache, or a function
    whose signature names ``torch.Tensor``."""
    if inspect.isclass(obj):
        return issubclass(obj, nn.Module) or obj in (KVCache, SinkCache)
    if inspect.isfunction(obj):
        signature = inspect.signature(obj)
        annotations = [p.annotation for p in signature.parameters.values()] + [signature.return_annotation]
        return any("Tensor" in str(a) for a in annotations)
    return False


def documentation(name: str, obj) -> str:
    """The docstring that documents ``name``: the object's own, or for a registry, the docstrings of the package's
    modules that hold that very object (the package and the module that defines it)."""
    if not is_data(obj):
        return inspect.cleandoc(obj.__doc__ or "")
    holders = [module for key, module in sorted(sys.modules.items())
               if key.split(".")[0] == "posenc_lab" and module is not None and vars(module).get(name) is obj]
    return "\n\n".join(inspect.cleandoc(module.__doc__ or "") for module in holders)


def problems(name: str, obj, doc: str) -> list[str]:
    """What the documentation of ``name`` lacks: a ``Shapes:`` line (for a callable that takes tensors), an example
    (for a registry, one that names it), or examples that run as shown (doctest's report)."""
    found = []
    examples = doctest.DocTestParser().get_examples(doc)
    if is_data(obj):
        examples = [e for e in examples if name in e.source]
    if not examples:
        found.append(f"{name}: no example (>>>)" + (" naming it in its module's docstring" if is_data(obj) else ""))
    if takes_tensors(obj) and not SHAPES.search(doc):
        found.append(f"{name}: no 'Shapes:' line naming b, h, n or d")
    test = doctest.DocTestParser().get_doctest(doc, {}, f"posenc_lab.{name}", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=True)
    if runner.failures:
        found.append(f"{name}: {runner.failures} example(s) failed\n" + "".join(report))
    return found


@pytest.mark.parametrize("name", sorted(pl.__all__))
def test_every_exported_name_has_its_shapes_and_an_example_that_runs(name):
    obj = getattr(pl, name)
    found = problems(name, obj, documentation(name, obj))
    assert not found, "\n".join(found)


def test_the_checker_fails_on_a_missing_or_a_wrong_example():
    """The check itself: a docstring without an example, without shapes, or with a wrong output is reported."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        """Shapes: ``x`` ``b h n d`` -> ``b h n d``.

        >>> 1 + 1
        2
        """

    doc = inspect.cleandoc(rotate.__doc__)
    assert problems("rotate", rotate, doc) == []
    assert any("no example" in p for p in problems("rotate", rotate, doc.split(">>>")[0]))
    assert any("Shapes" in p for p in problems("rotate", rotate, doc.replace("Shapes:", "Sizes:")))
    wrong = problems("rotate", rotate, doc.replace("    2", "    3").replace("\n2", "\n3"))
    assert len(wrong) == 1 and "rotate: 1 example(s) failed" in wrong[0]
    registry = problems("ENCODINGS", ENCODINGS, ">>> 1 + 1\n2")  # an example that does not name the registry
    assert any("naming it" in p for p in registry)


# --------------------------------------------------------------------------------------------- help()


HELPED = sorted({cls for name in pl.__all__ if inspect.isclass(cls := getattr(pl, name))
                 and (issubclass(cls, Encoding) or cls in (KVCache, SinkCache))}, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", HELPED, ids=lambda c: c.__name__)
def test_help_opens_on_the_class_summary_its_shapes_and_an_example(cls):
    """``help(cls)`` lists every method torch's ``nn.Module`` gives an encoding (about a thousand lines, kept: hiding
    them would take a metaclass that changes ``dir()``); the class's own summary, its ``Shapes:`` line and an
    example come in the first 40 lines, and no method shows torch's words in place of the package's."""
    page = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    first = [line.removeprefix(" |  ").strip() for line in page.splitlines()[:HELP_LINES]]
    summary = inspect.cleandoc(cls.__doc__).splitlines()[0].strip()
    assert summary in first, f"{cls.__name__}: summary {summary!r} not in the first {HELP_LINES} lines of help()"
    assert any(line.startswith("Shapes:") for line in first), f"{cls.__name__}: no Shapes: line in help()'s first lines"
    assert any(line.startswith(">>>") for line in first), f"{cls.__name__}: no example in help()'s first lines"
    assert "Initialize internal Module state" not in page  # torch's __init__ docstring in place of ours


# --------------------------------------------------------------------------------------------- encoding(x, positions)


def built(name: str) -> Encoding:
    torch.manual_seed(0)
    return make_encoding(name, d_model=16, num_heads=2, head_dim=8, train_len=16, n_layer=2)


@pytest.mark.parametrize("name", sorted(ENCODINGS))
def test_an_encoding_called_as_a_module_does_what_its_hook_does(name):
    """``encoding(x, positions)``: the embeddings for ``embed``, the rotated tensor for a rotation that treats queries
    and keys alike, the ``h n n`` bias (as :func:`bias_tensor` builds it) for ``bias``, ``x`` itself for NoPE;
    otherwise a one-line :class:`PosencError` that names the method to call."""
    enc = built(name)
    torch.manual_seed(1)
    pos = torch.arange(3, 10)
    if enc.hook == "embed":
        x = torch.randn(2, 7, 16)
        assert torch.equal(enc(x, pos), enc.embed(x, pos)) and not torch.equal(enc(x, pos), x)
        assert torch.equal(enc(x), enc.embed(x, torch.arange(7)))
    elif enc.hook == "rotate" and enc.rotates_alike:
        q, k = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
        q_rot, k_rot = enc.rotate(q, k, pos)
        assert torch.equal(enc(q, pos), q_rot) and torch.equal(enc(k, pos), k_rot)
        assert torch.equal(enc(q), enc.rotate(q, k, torch.arange(7))[0])
        rows = torch.stack([pos, pos + 5])  # positions b n, one row per batch entry
        assert torch.equal(enc(q, rows)[1], enc(q[1:], pos + 5)[0])
    elif enc.hook == "bias":
        b = enc(pos)
        assert b.shape == (2, 7, 7) and torch.equal(b, enc.bias(pos, pos))
        assert torch.allclose(b, bias_tensor(enc, pos), atol=1e-6)
        assert torch.equal(enc(torch.randn(1, 2, 7, 8)), enc(torch.arange(7)))  # the queries give n
        rows = torch.stack([pos, pos + 1])
        assert torch.allclose(enc(rows), bias_tensor(enc, rows), atol=1e-6)
    elif enc.hook == "none":
        x = torch.randn(2, 7, 16)
        assert enc(x, pos) is x
    else:
        with pytest.raises(PosencError) as err:
            enc(torch.randn(1, 2, 7, 8), pos)
        message = str(err.value)
        assert "\n" not in message and re.search(r"\.rotate\(q, k, positions\)|\.decay\(x\)|attention\(q, k, v", message)


def test_rope_called_as_a_module_is_apply_rope():
    """An independent formula: ``RoPE(d)(x, positions)`` rotates pair ``i`` at position ``m`` by ``m theta_i``,
    float64 against :func:`apply_rope`."""
    rope = make_encoding("rope", head_dim=8, train_len=16)
    x, pos = torch.randn(1, 2, 9, 8, dtype=torch.float64), torch.arange(100, 109)
    assert torch.allclose(rope(x, pos), apply_rope(x, pos, inv_freq(8)), atol=1e-12)


@pytest.mark.parametrize("name", sorted(n for n in ENCODINGS if ENCODINGS[n].hook == "rotate"))
def test_rotates_alike_says_whether_queries_and_keys_are_rotated_the_same(name):
    """The flag behind ``encoding(x)``: where it is set, the rotation of a tensor as queries equals its rotation as
    keys; where it is not, they differ (xPos scales them apart, SSMax and Llama 4's temperature scale the queries)."""
    enc = built(name)
    x, pos = torch.randn(1, 2, 12, 8), torch.arange(12)
    q, k = enc.rotate(x, x, pos)
    assert torch.equal(q, k) == enc.rotates_alike


def test_an_alibi_bias_called_with_two_position_tensors_is_refused():
    alibi = make_encoding("alibi", num_heads=2)
    with pytest.raises(PosencError, match="not two tensors of positions"):
        alibi(torch.arange(3), torch.arange(3))
