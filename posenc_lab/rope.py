"""Rotary position embedding (RoPE) and its extrapolation strategies (xPos, RoPE with a decay, is :mod:`~posenc_lab.xpos`).

Conventions (the book's chapter 3 derives them):

* A head vector of even size ``d`` is split into ``d/2`` pairs; pair ``i`` is rotated by the
  angle ``m * theta_i`` at position ``m``, with ``theta_i = base ** (-2 i / d)`` (Su et al. 2021).
* Two layouts say which coordinates form a pair:
  ``"half"``: pair ``i`` is ``(x[i], x[i + d/2])`` (GPT-NeoX, Hugging Face Llama ``rotate_half``);
  ``"interleaved"``: pair ``i`` is ``(x[2i], x[2i+1])`` (RoFormer, GPT-J, Meta's original LLaMA).
  Both give the same scores once the head dimensions are permuted accordingly.
* Angles, cosines and sines are computed in float64 and the rotation in float32 or better,
  whatever the input dtype: at position 32,768 a float16 angle would be off by whole radians.
* Every scaling strategy is a pure function returning ``(inv_freq, attention_factor)``, registered by name in
  ``ROPE_SCALINGS``; the attention factor multiplies both the rotated query and the rotated key.

>>> import torch; from posenc_lab import rope
>>> {"pi", "ntk", "yarn"} <= set(rope.ROPE_SCALINGS)
True
>>> freqs, factor = rope.scaled_inv_freq("pi", 8, train_len=16, factor=2.0)  # PI: every frequency halved
>>> (freqs / rope.inv_freq(8)).tolist(), factor
([0.5, 0.5, 0.5, 0.5], 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from einops import einsum, rearrange

from .errors import PosencError, check_even, check_positive, unknown_name

#: the two ways of pairing a head's coordinates (see the conventions above)
LAYOUTS = ("half", "interleaved")
# einops pattern that splits the last axis into (pair member r, pair index f) for each layout
_PAIR_PATTERN = {"half": "... (r f) -> r ... f", "interleaved": "... (f r) -> r ... f"}
_UNPAIR_PATTERN = {"half": "r ... f -> ... (r f)", "interleaved": "r ... f -> ... (f r)"}


def inv_freq(dim: int, base: float = 10000.0, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rotation frequencies ``theta_i = base ** (-2 i / dim)`` for ``i = 0 .. dim/2 - 1`` (Su et al. 2021).

    Pair ``i`` turns by ``theta_i`` radians per position: its wavelength is ``2 pi / theta_i``
    positions, from ``2 pi`` (i = 0) up to almost ``2 pi * base`` (the last pair).

    Shapes: returns ``d/2`` (``d = dim``), float64.

    >>> from posenc_lab import inv_freq
    >>> [round(f, 6) for f in inv_freq(8).tolist()]
    [1.0, 0.1, 0.01, 0.001]
    """
    check_even("RoPE head dimension", dim)
    check_base(base)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return (float(base) ** -exponents).to(dtype)


def check_base(base) -> None:
    """Raise :class:`PosencError` unless ``base`` is a number above 1: at ``base = 1`` every pair turns at one radian
    per position, and below it the frequencies ``base ** (-2 i / d)`` *rise* from pair to pair (a bool is no base)."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise PosencError(f"the RoPE base must be a number above 1 (the frequencies base ** (-2i/d) must fall from "
                          f"pair to pair), got {base!r}")


def wavelengths(freqs: torch.Tensor) -> torch.Tensor:
    """Wavelength ``2 pi / theta_i`` of each pair, in positions."""
    return 2 * math.pi / freqs


# ---------------------------------------------------------------------------------------------
# Extrapolation strategies: (dim, base, factor, train_len, seq_len, **options) -> (inv_freq, attention_factor)

RopeScaling = Callable[..., tuple[torch.Tensor, float]]
#: the RoPE extrapolation strategies by name, each a pure function returning ``(inv_freq, attention_factor)``
ROPE_SCALINGS: dict[str, RopeScaling] = {}
#: the strategies the experiments evaluate unless told otherwise: those of the article and of chapter 4
#: (a strategy registered later, such as ``llama3``, is evaluated where a preset or ``--strategies`` names it,
#: so that adding one never changes the configuration of a run already made)
ARTICLE_STRATEGIES = ("none", "pi", "ntk", "dynamic-ntk", "yarn")


def _register(name: str):
    def add(fn: RopeScaling) -> RopeScaling:
        ROPE_SCALINGS[name] = fn
        return fn

    return add


@_register("none")
def _no_scaling(dim, base, factor, train_len, seq_len):
    """Plain RoPE: the frequencies are used as trained, at every length."""
    return inv_freq(dim, base), 1.0


@_register("pi")
def _position_interpolation(dim, base, factor, train_len, seq_len):
    """Position interpolation (Chen et al. 2023): position ``m`` is read as ``m / s``.

    Dividing every position by ``s`` is the same as dividing every frequency by ``s``:
    ``theta_i' = theta_i / s``. A sequence of ``s L`` positions then reads its last position as
    ``(s L - 1) / s = L - 1/s``: at most ``1 - 1/s`` of a position past the last one seen in training,
    so every angle stays below ``L theta_i`` (chapter 4 checks the exact bound).
    """
    return inv_freq(dim, base) / factor, 1.0


def ntk_base(base: float, factor: float, dim: int) -> float:
    """NTK-aware base ``base' = base * s ** (d / (d - 2))`` (bloc97, 2023).

    The exponent is chosen so that the lowest frequency ``theta_{d/2-1}`` is divided by exactly ``s``
    (interpolated like PI) while the highest, ``theta_0 = 1``, is unchanged (extrapolated).

    >>> from posenc_lab import inv_freq, ntk_base
    >>> (inv_freq(8, ntk_base(10000.0, 4.0, 8)) / inv_freq(8))[[0, -1]].tolist()  # the fastest kept, the slowest / 4
    [1.0, 0.25]
    """
    if dim <= 2:
        raise PosencError(f"NTK scaling needs a head dimension above 2 (its exponent is d/(d-2)), got {dim}")
    check_base(base)  # the base as given, before it is raised
    return base * factor ** (dim / (dim - 2))


@_register("ntk")
def _ntk(dim, base, factor, train_len, seq_len):
    """Static NTK-aware scaling: plain RoPE with the base raised to ``base * s ** (d/(d-2))``."""
    return inv_freq(dim, ntk_base(base, factor, dim)), 1.0


def dynamic_ntk_factor(length, train_len: int, slope: float = 1.0):
    """Dynamic NTK's factor at ``length``: ``s = 1 + k (max(length, L) / L - 1)``, ``L = train_len``, slope ``k``.

    ``k = 1`` (the default) is ``s = max(1, length / L)``, emozilla's rule; Hugging Face's ``dynamic`` RoPE writes
    ``s = k max(length, L) / L - (k - 1)`` with its ``factor`` as ``k``, the same line through ``s = 1`` at ``L``
    with slope ``k``. ``length`` may be a tensor (one factor per position).
    """
    if isinstance(slope, bool) or not isinstance(slope, (int, float)) or not slope > 0:
        raise PosencError(f"dynamic NTK's slope (Hugging Face's factor) must be a positive number, got {slope!r}")
    ratio = length / train_len
    ratio = ratio.clamp(min=1.0) if isinstance(ratio, torch.Tensor) else max(1.0, ratio)
    return 1.0 + slope * (ratio - 1.0)


@_register("dynamic-ntk")
def _dynamic_ntk(dim, base, factor, train_len, seq_len, slope=1.0):
    """Dynamic NTK: NTK-aware scaling with ``s = max(1, seq_len / train_len)`` for the current length.

    At or below the training length it is exactly plain RoPE. (The rule of emozilla's dynamic
    scaling and of Hugging Face's ``dynamic`` RoPE with ``factor = 1``; Hugging Face's ``factor = k``
    is ``slope=k``, ``s = 1 + k (seq_len / train_len - 1)`` past the training length,
    :func:`dynamic_ntk_factor`; Qwen's variant instead sets
    ``alpha = 2 ** ceil(log2(s) + 1) - 1``, one less than a power of two, and fixes it at the
    prompt.) The factor is always derived from ``seq_len``; a position-wise variant, where the
    token at position ``p`` uses the base for length ``p + 1`` as in generation with a key/value
    cache, is :func:`dynamic_ntk_angles`.
    """
    s = dynamic_ntk_factor(seq_len, train_len, slope)
    return inv_freq(dim, ntk_base(base, s, dim)), 1.0


def yarn_attention_factor(factor: float) -> float:
    """YaRN's temperature: ``sqrt(1/t) = 0.1 ln(s) + 1`` (Peng et al. 2023, eq. 22), 1 for ``s <= 1``.

    >>> from posenc_lab import yarn_attention_factor
    >>> round(yarn_attention_factor(4.0), 4), yarn_attention_factor(0.5)
    (1.1386, 1.0)
    """
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_mscale_ratio(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """DeepSeek's YaRN attention factor ``(0.1 m ln s + 1) / (0.1 m_all ln s + 1)`` (1 for ``s <= 1``), with
    ``m = mscale`` and ``m_all = mscale_all_dim`` (DeepSeek-V2/V3, as Hugging Face computes it when both are set).

    The numerator is the paper's ``sqrt(1/t)`` with ``ln s`` weighted by ``m``; dividing by the same form in
    ``m_all`` undoes the part that those models apply to every dimension of the logits instead (their softmax scale
    is multiplied by ``(0.1 m_all ln s + 1)^2``, a step of the model, not of the rotation). ``m = m_all`` gives 1.
    """
    if factor <= 1:
        return 1.0
    return (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0)


def yarn_ramp(
    dim: int,
    base: float,
    train_len: int,
    *,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ramp: str = "index",
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN's per-pair extrapolation weight ``gamma_i`` in [0, 1] (Peng et al. 2023, "NTK-by-parts").

    ``rho_i = train_len / wavelength_i`` (the book's notation; the paper's ``r``) is how many full turns
    pair ``i`` makes within the training length. Pairs with ``rho_i > beta_fast`` are kept as trained
    (``gamma = 1``, extrapolate), pairs with ``rho_i < beta_slow`` are interpolated like PI (``gamma = 0``).
    In between, two ramps exist:

    * ``ramp="index"`` (the default: the YaRN authors' code, Hugging Face ``transformers`` and the
      released YaRN / Qwen / DeepSeek checkpoints): ``gamma`` falls linearly in the pair *index*,
      ``gamma_i = 1 - clamp((i - lo) / (hi - lo), 0, 1)``, between ``lo = max(floor(i(beta_fast)), 0)``
      and ``hi = min(ceil(i(beta_slow)), d - 1)``, where ``i(r) = d ln(L / (2 pi r)) / (2 ln base)`` is
      the fractional pair making exactly ``rho`` turns in ``L`` positions (``hi`` is capped at ``d - 1``
      as in that code, not at the last pair ``d/2 - 1``; a zero-width ramp gets ``hi = lo + 0.001``).
      Because ``lo`` is clamped at 0, pair 0 is always kept, even when it makes fewer than ``beta_fast`` turns.
      ``truncate=False`` keeps ``lo`` and ``hi`` fractional (no floor, no ceil: Hugging Face's ``truncate: false``,
      gpt-oss's setting);
    * ``ramp="rotations"`` (the paper's equation): ``gamma = clamp((rho - beta_slow) / (beta_fast - beta_slow), 0, 1)``,
      linear in the number of turns.

    Both agree outside the transition band; inside it, the index ramp is what a model trained or
    fine-tuned with YaRN expects.
    """
    freqs = inv_freq(dim, base)
    if ramp == "rotations":
        turns = train_len / wavelengths(freqs)
        return ((turns - beta_slow) / (beta_fast - beta_slow)).clamp(0.0, 1.0)
    if ramp == "index":
        low, high = yarn_pair_making(beta_fast, dim, base, train_len), yarn_pair_making(beta_slow, dim, base, train_len)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if high == low:
            high = low + 0.001
        index = torch.arange(dim // 2, dtype=torch.float64)
        return 1.0 - ((index - low) / (high - low)).clamp(0.0, 1.0)
    raise unknown_name("YaRN ramp", ramp, ("index", "rotations"))


def critical_dimension(dim: int, base: float, train_len: int) -> int:
    """Liu et al. (2023)'s critical dimension ``2 ceil((d/2) log_base(L / 2 pi))`` (at least 0, at most ``d``).

    Pair ``i`` has the wavelength ``2 pi base ** (2 i / d)``; it is at most ``L`` -- the pair turns through
    a whole period within the training length, so training shows it every angle it will meet -- exactly
    when ``i <= (d/2) log_base(L / 2 pi)``. The critical dimension counts the coordinates of those pairs;
    the pairs past it never complete a turn in training, and their angles past ``L`` are new.
    """
    check_even("RoPE head dimension", dim)
    check_positive("train_len", train_len)
    check_base(base)
    pairs = math.ceil(dim / 2 * math.log(train_len / (2 * math.pi)) / math.log(base))
    return 2 * min(max(pairs, 0), dim // 2)


def yarn_pair_making(turns: float, dim: int, base: float, train_len: int) -> float:
    """The fractional pair index ``i`` whose pair makes exactly ``turns`` full turns in ``train_len`` positions:
    solving ``train_len * base ** (-2 i / d) = 2 pi turns`` gives ``i = d ln(L / (2 pi turns)) / (2 ln base)``."""
    return dim * math.log(train_len / (turns * 2 * math.pi)) / (2 * math.log(base))


@_register("yarn")
def _yarn(dim, base, factor, train_len, seq_len, beta_fast=32.0, beta_slow=1.0, ramp="index", mscale=None,
          truncate=True):
    """YaRN (Peng et al. 2023): ``theta_i' = (1 - gamma_i) theta_i / s + gamma_i theta_i``, attention factor ``0.1 ln s + 1``.

    ``gamma_i`` is :func:`yarn_ramp` (default: the ramp of the released models; ``truncate=False``: its
    fractional bounds); ``mscale`` overrides the attention factor (DeepSeek's ratio:
    :func:`yarn_mscale_ratio`). The factor multiplies both the rotated query and the rotated key, so the
    logits scale by its square, ``(0.1 ln s + 1)^2``: the paper's ``1 / t``.
    """
    if not (isinstance(beta_fast, (int, float)) and isinstance(beta_slow, (int, float)) and 0 < beta_slow < beta_fast):
        raise PosencError(f"YaRN needs 0 < beta_slow < beta_fast, got beta_slow={beta_slow!r}, beta_fast={beta_fast!r}")
    if mscale is not None and (not isinstance(mscale, (int, float)) or not mscale > 0):
        raise PosencError(f"YaRN's mscale must be a positive number, got {mscale!r}")
    gamma = yarn_ramp(dim, base, train_len, beta_fast=beta_fast, beta_slow=beta_slow, ramp=ramp, truncate=truncate)
    freqs = inv_freq(dim, base)
    scaled = (1 - gamma) * freqs / factor + gamma * freqs
    return scaled, yarn_attention_factor(factor) if mscale is None else float(mscale)


@_register("llama3")
def _llama3(dim, base, factor, train_len, seq_len, low_freq_factor=1.0, high_freq_factor=4.0, original_len=None):
    """Llama 3.1's scaling (Meta 2024; Hugging Face's ``rope_type="llama3"``): thresholds on the wavelength.

    With ``lambda_i = 2 pi / theta_i`` and ``L_o = original_len`` (default: the training length),
    ``lo = L_o / low_freq_factor`` and ``hi = L_o / high_freq_factor`` (so ``hi <= lo``):

    * ``lambda_i < hi`` (fast pairs, many turns within ``L_o``): ``theta_i`` unchanged;
    * ``lambda_i > lo`` (slow pairs): ``theta_i / s``, position interpolation;
    * otherwise ``theta_i' = (1 - g_i) theta_i / s + g_i theta_i`` with
      ``g_i = (L_o / lambda_i - low_freq_factor) / (high_freq_factor - low_freq_factor)``, linear in
      the pair's turns ``L_o / lambda_i``, as the YaRN paper's ramp is (the released YaRN code, the
      package's default ``ramp="index"``, ramps linearly in the pair index instead).

    Attention factor 1. Meta's released values are ``s = 8``, ``low_freq_factor = 1``,
    ``high_freq_factor = 4``, ``L_o = 8192``; here ``s`` follows the length like every other strategy.
    """
    check_positive("Llama 3 scaling's low_freq_factor", low_freq_factor)
    check_positive("Llama 3 scaling's high_freq_factor", high_freq_factor)
    if not high_freq_factor > low_freq_factor:
        raise PosencError(f"Llama 3 scaling needs high_freq_factor > low_freq_factor, got {high_freq_factor} "
                          f"and {low_freq_factor}")
    original = float(train_len if original_len is None else original_len)
    check_positive("Llama 3 scaling's original_len", original)
    freqs = inv_freq(dim, base)
    turns = original * freqs / (2 * math.pi)  # L_o / lambda_i
    g = ((turns - low_freq_factor) / (high_freq_factor - low_freq_factor)).clamp(0.0, 1.0)
    return (1 - g) * freqs / factor + g * freqs, 1.0


def longrope_attention_factor(factor: float, original_len: int) -> float:
    """LongRoPE's attention factor ``sqrt(1 + ln s / ln L_o)`` (1 for ``s <= 1``; Ding et al. 2024, Phi-3)."""
    return math.sqrt(1.0 + math.log(factor) / math.log(original_len)) if factor > 1 else 1.0


@_register("longrope")
def _longrope(dim, base, factor, train_len, seq_len, short_factor=None, long_factor=None, mscale=None):
    """LongRoPE (Ding et al. 2024; Phi-3, Hugging Face's ``rope_type="longrope"``): a searched rescale per pair.

    ``theta_i' = theta_i / lambda_i``, with ``lambda`` the ``d/2`` numbers of ``long_factor`` when the current length
    ``seq_len`` exceeds the training length ``L_o = train_len`` (the original context), ``short_factor`` otherwise
    (and when no length is given). The choice is made for the whole sequence: a length-following rotation, which a
    key/value cache cannot serve. Attention factor :func:`longrope_attention_factor` of ``s`` (Hugging Face's
    ``factor``, by default ``max_position_embeddings / original_max_position_embeddings``); ``mscale`` overrides it.
    """
    pairs = dim // 2
    for name, values in (("short_factor", short_factor), ("long_factor", long_factor)):
        if (not isinstance(values, (list, tuple)) or len(values) != pairs
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in values)):
            shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)
            raise PosencError(f"LongRoPE needs {name}: a list of {pairs} positive numbers (one per pair of the "
                              f"rotary dimension {dim}), got {shown}")
    if mscale is not None and (isinstance(mscale, bool) or not isinstance(mscale, (int, float)) or not mscale > 0):
        raise PosencError(f"LongRoPE's mscale must be a positive number, got {mscale!r}")
    rescale = long_factor if seq_len is not None and seq_len > train_len else short_factor
    freqs = inv_freq(dim, base) / torch.tensor(rescale, dtype=torch.float64)
    return freqs, longrope_attention_factor(factor, train_len) if mscale is None else float(mscale)


def resolve_factor(train_len: int, seq_len: int | None, factor: float | None) -> float:
    """The scale factor ``s``: as given, else ``max(1, seq_len / train_len)``, else 1.

    A factor below 1 would *shrink* the rotation range below what was trained (a bug in the
    article's code for sequences shorter than the training length), so it is an error.
    """
    if factor is not None:
        if not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
            raise PosencError(f"RoPE scaling factor must be a number >= 1, got {factor!r}")
        return float(factor)
    if seq_len is None:
        return 1.0
    return max(1.0, seq_len / train_len)


def scaled_inv_freq(
    method: str,
    dim: int,
    *,
    base: float = 10000.0,
    train_len: int,
    seq_len: int | None = None,
    factor: float | None = None,
    **options,
) -> tuple[torch.Tensor, float]:
    """Frequencies and attention factor of RoPE extrapolation strategy ``method`` (see ``ROPE_SCALINGS``).

    ``factor`` defaults to ``max(1, seq_len / train_len)``; every strategy but ``none`` needs one of the
    two (``dynamic-ntk`` needs ``seq_len``). ``options`` are the strategy's own: ``beta_fast``,
    ``beta_slow``, ``ramp``, ``mscale``, ``truncate`` for YaRN; ``low_freq_factor``, ``high_freq_factor``,
    ``original_len`` for Llama 3; ``slope`` for dynamic NTK; ``short_factor``, ``long_factor``, ``mscale`` for
    LongRoPE (which reads ``seq_len`` even with a fixed ``factor``: it chooses its factors by the length).

    Shapes: returns ``(inv_freq, attention_factor)``, ``inv_freq`` ``d/2`` (``d = dim``) in float64.

    >>> from posenc_lab import inv_freq, scaled_inv_freq
    >>> freqs, factor = scaled_inv_freq("yarn", 8, train_len=16, factor=4.0)
    >>> freqs.shape, round(factor, 4), round(float(freqs[-1] / inv_freq(8)[-1]), 4)  # the slowest pair: as PI
    (torch.Size([4]), 1.1386, 0.25)
    """
    if method not in ROPE_SCALINGS:
        raise unknown_name("RoPE scaling", method, ROPE_SCALINGS)
    check_even("RoPE head dimension", dim)
    check_base(base)  # the base as given: NTK's derived base would hide it
    check_positive("train_len", train_len)
    if seq_len is not None:
        check_positive("seq_len", seq_len)
    if method == "dynamic-ntk":
        if seq_len is None:
            raise PosencError("dynamic-ntk derives its factor from the sequence length: pass seq_len")
        if factor is not None:
            raise PosencError("dynamic-ntk derives its factor from seq_len; use 'ntk' for a fixed factor")
    elif method != "none" and factor is None and seq_len is None:
        raise PosencError(f"RoPE scaling {method!r} needs factor=... or seq_len=... (then the factor is "
                          "max(1, seq_len / train_len))")
    s = resolve_factor(train_len, seq_len, factor)
    try:
        return ROPE_SCALINGS[method](dim, float(base), s, train_len, seq_len, **options)
    except TypeError as err:  # an option the strategy does not take
        raise PosencError(f"RoPE scaling {method!r} got an unexpected option: {err}") from None


def dynamic_ntk_angles(positions: torch.Tensor, dim: int, *, base: float = 10000.0, train_len: int,
                       slope: float = 1.0) -> torch.Tensor:
    """Angles of position-wise dynamic NTK: position ``p`` uses the NTK base for length ``max(p + 1, train_len)``.

    This is what a model generating one token at a time with a key/value cache sees under
    dynamic NTK: each key keeps the rotation it got when it was appended (a prompt counts as if it
    had been fed one token at a time). ``slope``: :func:`dynamic_ntk_factor`'s. Shape ``... n d/2``.
    """
    check_even("RoPE head dimension", dim)
    check_base(base)
    p = positions.to(torch.float64)
    s = dynamic_ntk_factor(p + 1, train_len, slope)  # ... n
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=p.device) / dim  # f
    bases = ntk_base(base, s[..., None], dim)  # ... n 1: the NTK base of each position's own length
    return p[..., None] * bases ** -exponents


# ---------------------------------------------------------------------------------------------
# Applying the rotation


def rope_angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``m * theta_i`` in float64 for positions ``... n`` and frequencies ``f``: shape ``... n f`` (on the positions' device)."""
    freqs = freqs.to(device=positions.device, dtype=torch.float64)
    return einsum(positions.to(torch.float64), freqs, "... n, f -> ... n f")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate each pair ``(a, b)`` of ``x`` (``... n d``) to ``(a cos - b sin, a sin + b cos)``.

    ``cos`` and ``sin`` are ``... n d/2`` and broadcast against ``x`` from the right, except that tables
    of one row per batch entry (``b n d/2``, from positions ``b n``) meet ``x`` of shape ``b h n d`` row by
    row (:func:`batch_tables`). The pairs are read *and written back* in the same layout. The arithmetic
    runs in float32 or better.
    """
    if layout not in LAYOUTS:
        raise unknown_name("RoPE layout", layout, LAYOUTS)
    if x.shape[-1] % 2:
        raise PosencError(f"RoPE needs an even head dimension, got {x.shape[-1]}")
    if cos.shape[-1] != x.shape[-1] // 2:
        raise PosencError(f"RoPE tables have {cos.shape[-1]} pairs but the head dimension {x.shape[-1]} has {x.shape[-1] // 2}")
    compute = torch.promote_types(x.dtype, torch.float32)
    cos, sin = batch_tables(cos, x), batch_tables(sin, x)
    return rotate_with(x, *spread_tables(cos.to(compute), sin.to(compute), layout), layout)


def batch_tables(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A table of positions ``b n`` (``b n f``) laid out for ``x`` of shape ``b h n d``: ``b 1 n f``, so that batch
    row ``i`` is rotated with the positions of row ``i`` in every head (Hugging Face's ``position_ids``); a table of
    one row (positions ``1 n``, as Hugging Face passes them) serves every row of the batch. Any other table is
    returned as it is."""
    if table.dim() == 3 and x.dim() == 4:
        if table.shape[0] not in (1, x.shape[0]):
            raise PosencError(f"positions of shape (b, n) need b = 1 or the batch of q and k ({x.shape[0]}), got b = "
                              f"{table.shape[0]}")
        return rearrange(table, "b n f -> b 1 n f")
    return table


def spread_tables(cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` (``... d/2``) laid out over the ``d`` coordinates: ``(cos, cos)`` and ``(-sin, sin)`` in
    the places of each pair's ``(a, b)``, so that :func:`rotate_with` is two products and a sum."""
    return (rearrange([cos, cos], _UNPAIR_PATTERN[layout]), rearrange([-sin, sin], _UNPAIR_PATTERN[layout]))


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """``x * cos + swap(x) * sin`` with the spread tables of :func:`spread_tables`, where ``swap`` exchanges
    the two members of every pair: ``(a cos - b sin, b cos + a sin)``, the rotation, in one pass."""
    x_ = x.to(cos.dtype)
    if layout == "half":  # pairs (x[i], x[i + d/2]): swap the two halves (one copy)
        first, second = x_.chunk(2, dim=-1)
        swapped = torch.cat([second, first], dim=-1)
    else:  # pairs (x[2i], x[2i+1]): swap within each pair
        swapped = rearrange(rearrange(x_, "... (f r) -> ... f r", r=2).flip(-1), "... f r -> ... (f r)")
    return (x_ * cos + swapped * sin).to(x.dtype)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    layout: str = "half",
    attention_factor: float = 1.0,
) -> torch.Tensor:
    """RoPE: rotate pair ``i`` of the vector at position ``m`` by ``m * theta_i`` and scale by ``attention_factor``.

    Shapes: ``x`` ``... n d`` (``b h n d``), ``positions`` ``n`` (or anything broadcasting to ``... n``),
    ``inv_freq`` ``d/2`` -> ``... n d``.

    With this, ``<R_m q, R_n k> = Re[sum_i q_i conj(k_i) e^{i (m - n) theta_i}]`` depends on ``m - n`` only:

    >>> import torch; from posenc_lab import apply_rope, inv_freq
    >>> q, k = torch.randn(2, 1, 8, dtype=torch.float64)  # one position (n = 1), head dimension 8
    >>> def at(x, m): return apply_rope(x, torch.tensor([m]), inv_freq(8))
    >>> torch.allclose(at(q, 7) @ at(k, 3).T, at(q, 1004) @ at(k, 1000).T)  # the score at distance 4
    True
    """
    angles = rope_angles(positions, inv_freq)
    return rotate(x, angles.cos() * attention_factor, angles.sin() * attention_factor, layout)
