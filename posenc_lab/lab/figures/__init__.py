"""The figures (the ``[figures]`` extra): seaborn figures on a given axes (``plots``), plotly figures with a slider
(``interactive``), and the PNG files of a run (``files``)."""
