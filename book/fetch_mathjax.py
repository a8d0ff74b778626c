"""Put a local MathJax 3 under _mathjax/ so that the book typesets math offline.

MathJax comes from PyPI (the files of django-static-mathjax, a pure packaging of MathJax 3.2.2;
only its files are used, nothing is installed), so a machine with only python3 and pip can build
the book; after this has run once, the build needs no network.
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "django-static-mathjax==3.2.2.1"
ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "_mathjax" / "mathjax"
WANTED = ("es5/tex-chtml.js", "es5/output/chtml/fonts/woff-v2/")


def main() -> int:
    if (TARGET / "tex-chtml.js").exists():
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, PACKAGE],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                _, sep, rel = name.partition("static/mathjax/")
                if sep and any(rel.startswith(w) for w in WANTED):
                    out = TARGET / rel.removeprefix("es5/")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(zf.read(name))
    if not (TARGET / "tex-chtml.js").exists():
        print(f"could not find MathJax in {PACKAGE}", file=sys.stderr)
        return 1
    print(f"MathJax 3.2.2 in {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
