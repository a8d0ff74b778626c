"""Drop the per-cell execution timestamps that `jupyter execute` records, so that re-running a
chapter only changes the committed .ipynb where its outputs change."""

import sys

import nbformat

for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
