"""The base of every encoding: the three hooks (each "do nothing" by default, which is NoPE), the two hooks of
the encodings that read the tokens themselves (a layer's decays, a bias from the queries and keys), and the
tables one forward pass shares among its layers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import PosencError, check_positions


@torch.compiler.disable
def position_span(positions: torch.Tensor) -> int:
    """``max(positions) + 1``, the size of the tables an encoding needs for ``positions``.

    The value of a tensor: under ``torch.compile`` this is a graph break (taking the positions' number instead
    would be right only for the model's ``0 .. n-1``), so a caller that can do without it should not ask.
    """
    return int(positions.max()) + 1 if positions.numel() else 0


class Tables:
    """What the layers of one forward pass share: built once by the model (:meth:`Encoding.tables`), handed to
    every layer's hooks and attention, dropped when the forward pass ends (as Hugging Face's models compute
    ``position_embeddings`` once and pass them to each layer).

    ``rotation`` holds a rotary encoding's spread ``cos, sin`` tables (``n d``, or ``b n d`` for positions
    ``b n``; :func:`rope.spread_tables`); :meth:`shared` holds what the attention backends derive from a bias
    (its mask, in the form the backend consumes), built by the first layer that asks, as Hugging Face's T5
    hands the first layer's ``position_bias`` to the others. Nothing outlives a forward pass unless its caller
    owns it: an evaluation that scores window after window at the same positions with one model hands the same
    ``shared`` dict to every forward pass (``GPT.forward(masks=...)``), so the masks are built once for all its
    windows; every other pass builds its own, so a parameter updated between two training passes is read by the
    next.
    """

    def __init__(self, encoding: "Encoding", positions: torch.Tensor, rotation: tuple | None = None,
                 shared: dict | None = None):
        self.encoding, self.positions, self.rotation = encoding, positions, rotation
        self._shared: dict = {} if shared is None else shared

    def serves(self, encoding: "Encoding", positions: torch.Tensor) -> bool:
        """Whether these are the tables of ``encoding`` at ``positions`` (the very objects they were built for)."""
        return self.encoding is encoding and self.positions is positions

    def shared(self, key: tuple, build: Callable):
        """``build()`` the first time ``key`` is asked for in this forward pass; the same object every later time."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]


class Encoding(nn.Module):
    """Base class of every encoding: each hook defaults to "do nothing" (which is NoPE).

    Shapes: ``embed(x, positions)``: ``x`` ``b n d_model``; ``rotate(q, k, positions)``: ``q, k`` ``b h n d``;
    ``bias(q_pos, k_pos)`` -> ``h i j``; ``positions`` ``n`` (or ``b n``). ``encoding(x, positions)`` calls the one
    hook the encoding has (:meth:`forward`).

    >>> import torch; from posenc_lab import Encoding
    >>> q = torch.randn(1, 2, 5, 8)
    >>> all(torch.equal(t, q) for t in Encoding().rotate(q, q, torch.arange(5)))
    True

    A subclass sets ``name`` and ``hook`` and overrides that hook; the attributes below say what else the
    attention backends, a key/value cache and the experiment may ask of it.
    """

    def __init__(self):
        """Build the encoding: the class's documentation lists the arguments."""
        super().__init__()

    name = "nope"
    hook = "none"
    #: True when the bias depends on the signed distance ``i - j`` only (then ``distance_bias`` is defined)
    distance_only = False
    #: for a variant of another encoding (a different recipe of the same idea), that encoding's name
    variant_of: str | None = None
    #: what :func:`make_encoding` hands the constructor from the model's shape: ``{argument: quantity}``, the
    #: quantities being ``d_model``, ``num_heads``, ``head_dim``, ``train_len`` and ``n_layer``
    shape: dict[str, str] = {}
    #: the keys a query of this layer may attend to besides causality (a local layer of a mix, module ``mixes``):
    #: ``window = W`` keeps the keys less than ``W`` positions away (a sliding window), ``chunk = C`` those of the
    #: query's own chunk of ``C`` positions (``floor(i / C) == floor(j / C)``); None: every key
    window: int | None = None
    chunk: int | None = None
    #: the number of query heads the encoding was built for (one slope, bias column, gate or scale per head), which
    #: :func:`~posenc_lab.backends.attention` checks against the queries; None when it serves any number of heads
    num_heads: int | None = None
    #: True when the ``rotate`` hook reads how many keys each query sees (SSMax's ``log n``): attention then hands
    #: ``rotate`` and ``rotate_one`` the ``reach`` and ``chunk`` it applies, as keywords
    counts_keys = False

    #: whether the ``rotate`` hook transforms queries and keys alike (RoPE, FoPE): then ``encoding(x, positions)``
    #: rotates one tensor; xPos, SSMax and Llama 4's temperature treat the two differently
    rotates_alike = False

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The encoding called as a module: its one hook at ``positions`` (``n`` or ``b n``; default ``0 .. n-1``,
        ``n = x.shape[-2]``).

        * ``embed``: :meth:`embed` of ``x`` (``b n d_model``) -> ``b n d_model``;
        * ``rotate``, when queries and keys are rotated alike (``rotates_alike``: RoPE, FoPE): ``x`` (``... n d``,
          queries or keys) rotated -> ``... n d``, each of the two tensors :meth:`rotate` returns;
        * ``bias``: the bias ``bias(positions, positions)``, ``h n n`` (``b h n n`` for positions ``b n``), to add
          to the scores (:func:`~posenc_lab.backends.bias_tensor` without ``causal``); ``x`` is then the positions
          themselves (``alibi(positions)``) or the queries, of which only ``n`` is read;
        * none (NoPE): ``x`` itself.

        Any other encoding raises :class:`PosencError` naming what to call: ``rotate(q, k, positions)`` for xPos,
        SSMax and Llama 4's temperature, ``decay(x)`` for FoX, ``token_bias`` (through ``attention``) for CoPE.

        >>> import torch; from posenc_lab import ALiBi, RoPE, bias_tensor
        >>> q, pos, rope, alibi = torch.randn(1, 2, 5, 8), torch.arange(5), RoPE(8, train_len=16), ALiBi(2)
        >>> torch.equal(rope(q, pos), rope.rotate(q, q, pos)[0]), torch.allclose(alibi(pos), bias_tensor(alibi, pos))
        (True, True)
        """
        if not x.is_floating_point() and self.hook == "bias":  # alibi(positions)
            if positions is not None:
                raise PosencError(f"{type(self).__name__}(positions) or {type(self).__name__}(q, positions), "
                                  "not two tensors of positions")
            x, positions = None, x
        elif positions is None:
            positions = torch.arange(x.shape[-2], device=x.device)
        check_positions(positions)
        if self.hook == "embed":
            return self.embed(x, positions)
        if self.hook == "rotate" and self.rotates_alike:
            return self.rotate_one(x, positions, "q")
        if self.hook == "bias":
            return self.bias(positions, positions)
        if self.hook == "none":
            return x
        what = _WHAT_TO_CALL.get(self.hook, f"attention(q, k, v, encoding), which applies its {self.hook} hook")
        raise PosencError(f"{type(self).__name__} cannot be called on one tensor: call {what}")

    def embed(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` is ``b n d_model``; returns the embeddings with position information added."""
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               tables: Tables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``q, k`` are ``b h n d``; returns them transformed. ``tables``: this encoding's :meth:`~posenc_lab.encodings.Encoding.tables` at
        ``positions`` (a model's forward pass builds them once for all its layers); computed here without."""
        return q, k

    def rotate_one(self, x: torch.Tensor, positions: torch.Tensor, role: str,
                   tables: Tables | None = None) -> torch.Tensor:
        """Transform queries (``role="q"``) or keys (``role="k"``) alone: a key/value cache rotates each
        key once, when it enters the cache, and each new query at its own position."""
        return x

    def tables(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32, shared: dict | None = None) -> Tables:
        """The :class:`Tables` every layer of a forward pass over ``positions`` shares (``dtype``: the activations'):
        the model asks once per forward pass and hands them to each layer's hooks and attention. ``shared``: the
        masks of earlier passes over the same positions with the same weights, owned by the caller (an
        evaluation); a new dict otherwise."""
        return Tables(self, positions, shared=shared)

    def settings(self) -> tuple:
        """The plain settings of the encoding and of its submodules: every public attribute that is a number, a flag, a
        name or a tuple of them (T5's ``num_buckets``, ``max_distance``, ``bidirectional``, ...), as
        ``(module, attribute, value)``."""
        plain = (bool, int, float, str, type(None))
        return tuple((name, key, value) for name, module in self.named_modules()
                     for key, value in sorted(vars(module).items())
                     if not key.startswith("_") and (isinstance(value, plain) or (
                         isinstance(value, tuple) and all(isinstance(v, plain) for v in value))))

    def for_layer(self, layer: int, n_layer: int) -> "Encoding":
        """The encoding layer ``layer`` (of ``n_layer``) attends with: the same one in every layer, except in
        variants that leave some layers without position (:class:`RoPENoPELayers`)."""
        return self

    def pin_length(self, final_len: int, dynamic: str | None = None) -> Callable[[], None]:
        """Fix, for one generation call that ends at ``final_len`` tokens, whatever the encoding would otherwise
        re-derive from each forward pass's length; returns the function that restores it. Nothing to fix here;
        RoPE with a factor that follows the length fixes that factor (:meth:`RoPE.pin_length`)."""
        return lambda: None

    def forward_positions(self, positions: torch.Tensor, training: bool) -> torch.Tensor:
        """The positions a forward pass without a cache gives its tokens (``training``: in training mode):
        ``positions`` itself, except in the randomized variants (:class:`RandomizedRoPE`,
        :class:`RandomizedLearned`)."""
        return positions

    @property
    def has_bias(self) -> bool:
        """Whether the encoding enters through the ``bias`` hook."""
        return self.hook == "bias"

    @property
    def has_decay(self) -> bool:
        """Whether the encoding enters through the ``decay`` hook (its forget gates read the layer's input)."""
        return self.hook == "decay"

    #: whether a key/value cache can serve the encoding (not when every step re-rotates every key)
    cacheable = True

    #: whether the encoding rotates pairs of a head's coordinates (RoPE, xPos, FoPE and their kin): the head
    #: dimension must then be even
    rotates_pairs = False
    #: whether the encoding gives positions only up to a fixed table (the learned absolute one): a model cannot then
    #: score windows longer than its training length
    bounded = False

    #: whether the encoding has a defined form for non-causal (bidirectional) attention
    noncausal = True
    #: how to build the encoding's non-causal form, where an option gives one (said in the error otherwise)
    noncausal_hint = ""
    #: whether an experiment evaluates RoPE's extrapolation strategies on the trained model (plain RoPE; its variants
    #: are evaluated as trained)
    has_strategies = False

    def score_mod(self, positions: Callable) -> Callable | None:
        """The bias as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)`` of the encoding's own, given
        ``positions(q_idx, kv_idx) -> (i, j)``; None lets the backend build one from :meth:`bias` (a per-distance
        table when ``distance_only``, else the whole bias gathered), which serves any bias encoding."""
        return None

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """``b[h, i, j]`` for every head, query and key position, or None."""
        return None

    def distance_bias(self, distances: torch.Tensor) -> torch.Tensor:
        """``b[h, k]``: the bias at each signed distance ``distances[k] = m - n`` (only when ``distance_only``)."""
        raise NotImplementedError(f"{self.name} has no per-distance bias")

    def distance_only_at(self, q_pos: torch.Tensor) -> bool:
        """Whether, for these query positions, the bias depends on the distance alone."""
        return self.distance_only

    #: whether the attention logits read the tokens themselves, not their positions alone: a decay computed from
    #: the layer's input (:meth:`~posenc_lab.encodings.Encoding.decay`) or a bias computed from the queries and keys
    #: (:meth:`~posenc_lab.encodings.Encoding.token_bias`)
    reads_tokens = False

    def decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """The log forget values ``log f_t <= 0`` (``b h n``) of the layer's input ``x`` (``b n d_model``), or None.

        :func:`~posenc_lab.backends.attention` adds ``sum_{l=j+1}^{i} log f_l = c_i - c_j`` (``c`` the running
        sum of ``log f``) to the logit of query ``i`` and key ``j``: a data-dependent decay (FoX). None, every
        encoding but a decay-gated one: no decay."""
        return None

    def token_bias(self, q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor, q_pos: torch.Tensor | None = None,
                   k_pos: torch.Tensor | None = None) -> torch.Tensor | None:
        """A bias ``b h i j`` computed from the queries ``q`` (``b h i d``) and keys ``k`` (``b h j d``) themselves, or
        None; ``hidden`` (``i j``, True where query ``i`` does not see key ``j``) marks the keys it must leave out
        (CoPE counts only the keys a query sees); ``q_pos``, ``k_pos``: the positions of those queries and keys (DAPE
        reads a position bias beside the logits)."""
        return None

    #: how the attention weights come from the logits: ``"softmax"`` for every encoding but stick-breaking, the one
    #: form the fused kernels (SDPA's, FlexAttention's) compute; any other is the encoding's :meth:`weights`, which
    #: the backends compute explicitly (``reference`` in float64, ``sdpa`` in blocks of queries; ``flex`` refuses it)
    weighting = "softmax"

    def weights(self, logits: torch.Tensor, offset: int | None = None) -> torch.Tensor:
        """The attention weights ``... i j`` of the logits ``... i j`` (``-inf`` on the keys a query does not see;
        query row ``r`` sits at key row ``r + offset``): the softmax over the keys, unless :attr:`weighting` names
        another form (stick-breaking)."""
        return logits.softmax(dim=-1)

    def householder(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """PaTH's transforms ``H_t = I - beta_t w_t w_t^T``, read from the layer's input ``x`` (``b n d_model``): the
        unit vectors ``w`` (``b h n d``) and ``beta`` (``b h n``, in ``(0, 2)``), or None (every other encoding).
        :func:`~posenc_lab.backends.attention` (``householder=``) then scores query ``i`` and key ``j <= i`` with
        ``q_i^T H_i H_{i-1} ... H_{j+1} k_j`` in place of ``q_i . k_j``."""
        return None

    def extra_repr(self) -> str:
        """The settings ``repr(encoding)`` shows after the class's name."""
        return f"hook={self.hook}"

    def needs_grad(self) -> bool:
        """Whether what the encoding computes now takes part in autograd (grad mode and a learned parameter)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())


#: what an encoding that :meth:`Encoding.forward` cannot serve on one tensor asks its caller to call, by hook
_WHAT_TO_CALL = {
    "rotate": ".rotate(q, k, positions) (queries and keys are treated differently), or .rotate_one(x, positions, "
              "'q' or 'k')",
    "decay": ".decay(x) on the layer's input x (b, n, d_model) and pass it to attention(q, k, v, encoding, decay=...)",
    "token_bias": "attention(q, k, v, encoding), which computes the bias from the queries and keys (.token_bias)",
}


class NoPE(Encoding):
    """No position signal at all (Kazemnejad et al. 2023): a causal mask alone still lets a model infer position.

    Shapes: ``nope(x, positions)`` returns ``x`` (any shape, ``b n d_model`` or ``b h n d``) as it is.

    >>> import torch; from posenc_lab import NoPE
    >>> x = torch.randn(1, 2, 5, 8)
    >>> NoPE()(x) is x, NoPE().bias(torch.arange(5), torch.arange(5)) is None
    (True, True)
    """
