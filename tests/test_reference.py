"""What an open package is expected to carry: every public name documented and on a reference page, the
licences, a valid citation file, and ``--version``."""

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

import posenc_lab

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "book" / "reference"
#: the core's modules (``rope``, ``encodings``, ...) and the lab's, each under its room (``lab.measure.accuracy``)
MODULES = sorted([m.name for m in pkgutil.iter_modules(posenc_lab.__path__) if not m.name.startswith("_")
                  and m.name != "lab"]
                 + [m.name.removeprefix("posenc_lab.") for m in pkgutil.walk_packages(
                     importlib.import_module("posenc_lab.lab").__path__, "posenc_lab.lab.") if not m.ispkg])
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def public_names(module):
    """``(qualified name, object)`` of the module's own public functions and classes, and of those classes'
    public methods and properties."""
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        package = getattr(module, "__path__", None) is not None  # a package's page documents its submodules' names
        if obj.__module__ != module.__name__ and not (package and obj.__module__.startswith(module.__name__ + ".")):
            continue  # imported from elsewhere: checked where it is defined
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, property):
                    yield f"{module.__name__}.{name}.{attr}", member.fget
                elif isinstance(member, (staticmethod, classmethod)):
                    yield f"{module.__name__}.{name}.{attr}", member.__func__
                elif inspect.isfunction(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def docstring(qualname: str, obj) -> str | None:
    """The object's own docstring, or the one of the method it overrides: a subclass's ``bias`` is documented by
    ``Encoding.bias``. ``None`` for an override of a torch method (``extra_repr``): its contract is torch's, and
    the reference leaves it out unless it has a docstring of its own."""
    if inspect.isclass(obj):
        return obj.__doc__ or ""
    if obj.__doc__:
        return obj.__doc__
    *owner, attr = qualname.split(".")
    cls = getattr(importlib.import_module(".".join(owner[:-1])), owner[-1], None) if len(owner) > 2 else None
    bases = [base for base in (inspect.getmro(cls)[1:] if inspect.isclass(cls) else ()) if attr in vars(base)]
    for base in bases:
        if base.__module__.startswith("posenc_lab") and getattr(vars(base)[attr], "__doc__", None):
            return vars(base)[attr].__doc__
    return None if any(not base.__module__.startswith("posenc_lab") for base in bases) else ""


def test_the_public_names_are_found():
    """The lister itself: it sees the modules, the registry, the formulas and the model's methods."""
    names = {q for m in MODULES for q, _ in public_names(importlib.import_module(f"posenc_lab.{m}"))}
    assert {"encodings", "rope", "bias", "absolute", "backends", "model", "lab.experiments.language_model",
            "lab.experiments.retrieval", "lab.measure.perplexity"} <= set(MODULES)
    assert {"posenc_lab.encodings.make_encoding", "posenc_lab.rope.apply_rope", "posenc_lab.model.GPT.generate",
            "posenc_lab.backends.KVCache.append", "posenc_lab.encodings.Encoding.has_bias"} <= names


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_has_a_docstring(module):
    mod = importlib.import_module(f"posenc_lab.{module}")
    assert (mod.__doc__ or "").strip(), f"posenc_lab.{module} has no module docstring"
    missing = [q for q, obj in public_names(mod) if docstring(q, obj) is not None and not docstring(q, obj).strip()]
    assert not missing, f"public names without a docstring: {missing}"


def test_the_package_exports_are_documented():
    assert (posenc_lab.__doc__ or "").strip()
    for name in posenc_lab.__all__:
        obj = getattr(posenc_lab, name)
        if inspect.ismodule(obj):
            assert obj.__name__.removeprefix("posenc_lab.") in MODULES
        elif callable(obj):
            assert (obj.__doc__ or "").strip(), f"posenc_lab.{name} has no docstring"


# --------------------------------------------------------------------------------------------- the reference pages


@pytest.mark.parametrize("module", MODULES)
def test_every_module_has_a_reference_page_in_the_toc(module):
    """A page documents the module with its members (a lab module's page is named after its last part)."""
    directive = f".. automodule:: posenc_lab.{module}\n   :members:"
    pages = [page for page in sorted(REFERENCE.glob("*.md")) if directive in page.read_text()]
    assert pages, f"no page of book/reference documents posenc_lab.{module}"
    assert f"file: book/reference/{pages[0].stem}\n" in (ROOT / "_toc.yml").read_text()


def test_every_rope_scaling_has_its_reference_entry():
    """The strategies are private functions reached through the registry: the RoPE page lists each one."""
    from posenc_lab.rope import ROPE_SCALINGS

    page = (REFERENCE / "rope.md").read_text()
    for name, fn in ROPE_SCALINGS.items():
        assert f".. autofunction:: posenc_lab.rope.{fn.__name__}\n" in page, f"{name!r} ({fn.__name__}) not on rope.md"
        assert f"| `{name}` |" in page, f"{name!r} missing from the table of scalings"


def resolve(dotted: str):
    """The object a cross-reference names, e.g. ``posenc_lab.model.GPT.generate``."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(dotted)


def test_every_chapter_that_prints_source_links_to_its_reference_entry():
    """A chapter that shows a function's source (``inspect.getsource``) links, in its prose, to the function's
    entry in the package reference; the link names a real object."""
    for md in sorted((ROOT / "notebooks").glob("*.md")):
        text = md.read_text()
        links = re.findall(r"\{py:(?:func|class|meth|data|mod)\}`(?:[^`<]*<)?~?(posenc_lab[\w.]*)>?`", text)
        if "inspect.getsource(" in text:
            assert links, f"{md.name} prints source but links to no reference entry"
        for target in links:
            resolve(target)


# --------------------------------------------------------------------------------------------- licences, citation


def test_licence_file_is_the_mit_licence_pyproject_declares():
    assert PYPROJECT["license"] == {"text": "MIT"}
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Permission is hereby granted, free of charge" in text
    assert "CC BY 4.0" in text  # and it says what it does not cover


def test_content_licence_is_named_in_the_readme_and_the_book_footer():
    readme = (ROOT / "README.md").read_text()
    assert "## Licence" in readme and "CC BY 4.0" in readme and "MIT" in readme and "CITATION.cff" in readme
    footer = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["extra_footer"]
    assert "creativecommons.org/licenses/by/4.0" in footer and "CC BY 4.0" in footer and "MIT" in footer


# The part of the Citation File Format 1.2.0 schema (https://citation-file-format.github.io) that this file uses,
# written from the specification: the schema itself cannot be downloaded at test time. Every top-level key the
# format knows is listed, so a misspelt key fails, as it does against the full schema.
CFF_KEYS = ["abstract", "authors", "cff-version", "commit", "contact", "date-released", "doi", "identifiers",
            "keywords", "license", "license-url", "message", "preferred-citation", "references", "repository",
            "repository-artifact", "repository-code", "title", "type", "url", "version"]
NONEMPTY = {"type": "string", "minLength": 1}
URL = {"type": "string", "pattern": r"^(https|http|ftp|sftp)://.+"}
CFF_SCHEMA = {
    "type": "object",
    "required": ["authors", "cff-version", "message", "title"],
    "additionalProperties": False,
    "properties": {
        **{key: {} for key in CFF_KEYS},
        "cff-version": {"type": "string", "pattern": r"^1\.2\.0$"},
        "message": NONEMPTY,
        "title": NONEMPTY,
        "abstract": NONEMPTY,
        "type": {"enum": ["dataset", "software"]},
        "version": {"type": ["string", "number"]},
        "license": {"type": "string", "pattern": r"^[A-Za-z0-9.+-]+$"},
        "repository-code": URL,
        "url": URL,
        "keywords": {"type": "array", "minItems": 1, "items": NONEMPTY},
        "authors": {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"anyOf": [
            {"type": "object", "required": ["name"], "properties": {"name": NONEMPTY}},  # an entity
            {"type": "object", "anyOf": [{"required": ["family-names"]}, {"required": ["given-names"]}],  # a person
             "properties": {"family-names": NONEMPTY, "given-names": NONEMPTY}},
        ]}},
    },
}


def test_citation_file_is_valid_cff_and_agrees_with_pyproject():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    jsonschema.validate(cff, CFF_SCHEMA)
    assert cff["version"] == PYPROJECT["version"] == posenc_lab.__version__
    assert cff["license"] == PYPROJECT["license"]["text"]
    assert cff["repository-code"] == yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def test_the_citation_schema_subset_rejects_what_the_format_rejects():
    good = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    for bad in ({k: v for k, v in good.items() if k != "authors"}, {**good, "cff-version": "1.1.0"},
                {**good, "authors": []}, {**good, "licence": "MIT"}, {**good, "authors": [{"affiliation": "x"}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, CFF_SCHEMA)


# --------------------------------------------------------------------------------------------- --version


def test_version_prints_the_package_version_and_the_commits_of_the_shipped_results():
    from posenc_lab.lab import results

    out = subprocess.run([sys.executable, "-m", "posenc_lab", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"posenc-lab {posenc_lab.__version__} ")
    for name in results.RUNS:
        commits = {row["git_commit"] for row in results.rows(name)}
        line = next(line for line in lines if line.strip().startswith(f"{name}:"))
        for commit in commits:
            assert commit[:12] in line, f"{name}: commit {commit[:12]} not printed"
