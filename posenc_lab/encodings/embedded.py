"""The encodings added to the token embeddings (the ``embed`` hook): fixed sinusoids and a learned table."""

from __future__ import annotations

from .. import absolute
from ..errors import check_even
from .base import Encoding


class Sinusoidal(Encoding):
    """Fixed sinusoids added to the token embeddings (Vaswani et al. 2017); see :func:`absolute.sinusoidal_encoding`.

    Shapes: ``sinusoidal(x, positions)`` (``embed``): ``x`` ``b n d_model``, ``positions`` ``n`` -> ``b n d_model``.

    >>> import torch; from posenc_lab import Sinusoidal
    >>> pe = Sinusoidal(8, token_scale=1.0)(torch.zeros(1, 3, 8))  # position 1: sin 1, cos 1, ...
    >>> [round(v, 4) for v in pe[0, 1, :2].tolist()]
    [0.8415, 0.5403]

    ``embed(x) = token_scale * x + scale * PE``. The defaults follow the recipe of the papers'
    code: Vaswani et al. (2017, sec. 3.4) multiply the token embeddings by ``sqrt(d_model)`` and add
    the unit-amplitude table (entries in ``[-1, 1]``, RMS ``1/sqrt(2)``), and so does fairseq's
    Transformer language model, which the ALiBi paper (Press et al. 2022) trained its sinusoidal
    baseline with (``embed_scale = sqrt(d)``, ``SinusoidalPositionalEmbedding``). We keep the paper's
    frequencies ``theta_i = b ** (-2i/d)`` and interleaved layout; fairseq's table uses the exponent
    ``i / (d/2 - 1)`` and ``[sin | cos]`` halves, a fixed permutation and a slightly different
    spread of frequencies, not a different amount of position signal. Our token embeddings keep the
    GPT-2 initialisation of every other encoding (std 0.02), so at initialisation the sinusoids are
    about 3x the scaled tokens; fairseq initialises tokens at std ``d ** -0.5``.

    The variant :class:`SinusoidalSmall` (``sinusoidal-small``) is the table scaled to RMS 0.02 with
    unscaled tokens, which this project used before: its position signal shrinks relative to the
    tokens as they grow during training.
    """

    name, hook = "sinusoidal", "embed"
    shape = {"d_model": "d_model"}

    def __init__(self, d_model: int, *, base: float = 10000.0, scale: float = 1.0, token_scale: float | None = None):
        super().__init__()
        check_even("d_model for sinusoidal positions", d_model)
        self.d_model, self.base, self.scale = d_model, base, scale
        self.token_scale = d_model**0.5 if token_scale is None else token_scale

    def embed(self, x, positions):
        pe = (self.scale * absolute.sinusoidal_encoding(positions, self.d_model, self.base)).to(x.dtype)
        return (x * self.token_scale if self.token_scale != 1 else x) + pe

    def extra_repr(self) -> str:
        return f"hook=embed, scale={self.scale:g}, token_scale={self.token_scale:g}"


class SinusoidalSmall(Sinusoidal):
    """Sinusoids scaled to the RMS of a fresh GPT-2 embedding (``0.02 * sqrt(2) * PE``), tokens unscaled.

    The amplitude variant of :class:`Sinusoidal`: both start on equal terms with a learned table
    (std 0.02), but the position signal stays fixed while the trained token embeddings grow.

    Shapes: ``x`` ``b n d_model``, ``positions`` ``n`` -> ``b n d_model``.

    >>> import torch; from posenc_lab import SinusoidalSmall
    >>> round(float(SinusoidalSmall(8)(torch.zeros(1, 3, 8)).pow(2).mean().sqrt()), 4)  # RMS of the table
    0.02
    """

    name, variant_of = "sinusoidal-small", "sinusoidal"

    def __init__(self, d_model: int, *, base: float = 10000.0):
        super().__init__(d_model, base=base, scale=0.02 * 2**0.5, token_scale=1.0)


class Learned(Encoding):
    """A learned vector per position up to the training length (GPT-2); past it, :class:`PositionOutOfRange`.

    Shapes: ``learned(x, positions)`` (``embed``): ``x`` ``b n d_model``, ``positions`` ``n`` -> ``b n d_model``.

    >>> import torch; from posenc_lab import Learned
    >>> learned, x = Learned(8, max_len=4), torch.zeros(1, 3, 8)
    >>> learned(x).shape, torch.equal(learned(x)[0], learned.table.table[:3])
    (torch.Size([1, 3, 8]), True)
    """

    name, hook = "learned", "embed"
    bounded = True
    shape = {"d_model": "d_model", "max_len": "train_len"}

    def __init__(self, d_model: int, *, max_len: int):
        super().__init__()
        self.table = absolute.LearnedPositions(max_len, d_model)

    @property
    def max_positions(self) -> int:
        """The number of positions the table has: positions ``0 .. max_positions - 1``."""
        return self.table.max_len

    def embed(self, x, positions):
        return x + self.table(positions).to(x.dtype)
