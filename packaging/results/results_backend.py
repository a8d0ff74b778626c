"""A PEP 517 build backend that packs the repository's ``results/`` as the package ``posenc_lab_results``.

Standard library only, so pip builds it offline and without build isolation. The wheel holds
``posenc_lab_results/__init__.py`` and every file of ``results/`` whose suffix is in ``SUFFIXES``,
under the same relative paths; the sdist holds this folder and a copy of ``results/``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "posenc_lab_results"
SUFFIXES = {".json", ".csv", ".pt", ".md"}
INIT = '"""The committed results of posenc-lab: ``posenc_lab.lab.results`` reads this folder."""\n'


def _source() -> Path:
    """``results/`` beside this file (in an sdist), else the repository's, two folders up."""
    for candidate in (HERE / "results", HERE.parents[1] / "results"):
        if (candidate / "POSENC_RESULTS.md").is_file():
            return candidate
    raise FileNotFoundError("no results/POSENC_RESULTS.md beside packaging/results or in the repository")


def _project() -> dict:
    return tomllib.loads((HERE / "pyproject.toml").read_text())["project"]


def _files() -> list[tuple[str, Path]]:
    source = _source()
    return sorted((f"{PACKAGE}/{p.relative_to(source).as_posix()}", p) for p in source.rglob("*")
                  if p.is_file() and p.suffix in SUFFIXES)


def _metadata() -> str:
    project = _project()
    return (f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
            f"Summary: {project['description']}\nRequires-Python: {project['requires-python']}\n")


def _dist_info() -> str:
    project = _project()
    return f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = Path(metadata_directory) / _dist_info()
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(_metadata())
    return info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = _project()
    name = f"{project['name'].replace('-', '_')}-{project['version']}-py3-none-any.whl"
    info = _dist_info()
    entries = [(f"{PACKAGE}/__init__.py", INIT.encode())]
    entries += [(arcname, path.read_bytes()) for arcname, path in _files()]
    entries += [(f"{info}/METADATA", _metadata().encode()),
                (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: results_backend\nRoot-Is-Purelib: true\n"
                                  b"Tag: py3-none-any\n")]
    record = [_record_line(arcname, data) for arcname, data in entries] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(Path(wheel_directory) / name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for arcname, data in entries:
            wheel.writestr(arcname, data)
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return name


def build_sdist(sdist_directory, config_settings=None):
    project = _project()
    stem = f"{project['name'].replace('-', '_')}-{project['version']}"
    with tarfile.open(Path(sdist_directory) / f"{stem}.tar.gz", "w:gz") as sdist:
        for own in ("pyproject.toml", "results_backend.py"):
            sdist.add(HERE / own, arcname=f"{stem}/{own}")
        source = _source()
        sdist.add(source / "POSENC_RESULTS.md", arcname=f"{stem}/results/POSENC_RESULTS.md")
        for arcname, path in _files():
            sdist.add(path, arcname=f"{stem}/results/{arcname.removeprefix(PACKAGE + '/')}")
        info = tarfile.TarInfo(f"{stem}/PKG-INFO")
        data = _metadata().encode()
        info.size = len(data)
        sdist.addfile(info, io.BytesIO(data))
    return f"{stem}.tar.gz"
