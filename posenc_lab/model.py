"""A small GPT-style decoder, identical for every encoding except where the encoding enters.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), GELU MLP of
width ``4 d``, tied input/output embeddings (untied on request: ``tie_embeddings=False``), GPT-2
initialisation (normal(0, 0.02), residual projections scaled by ``1 / sqrt(2 n_layer)``). One
encoding object is shared by all layers: its ``embed`` hook runs once on the token embeddings, its
``rotate`` and ``bias`` hooks in every layer's attention (T5 shares its bias across layers the same
way). Each forward pass asks the encoding once for its tables (:meth:`~posenc_lab.encodings.Encoding.tables`:
RoPE's ``cos, sin``, the bias mask its first layer builds) and hands them to every layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .backends import KVCache, SinkCache, attention
from .encodings import make_encoding
from .errors import PosencError, check_positive


#: a target that carries no loss (cross-entropy's ``ignore_index``): the retrieval task scores its answer only
IGNORE = -100


@dataclass
class GPTConfig:
    encoding: str = "rope"
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    train_len: int = 512
    vocab_size: int = 256
    mlp_ratio: int = 4
    backend: str = "auto"
    encoding_options: dict = field(default_factory=dict)
    #: one matrix for the input embedding and the output head (GPT-2). Untied, a byte that is never a target keeps
    #: its own input embedding: tied, the output's softmax pushes every never-predicted byte the same way, and their
    #: rows drift towards one shared direction (the multikey retrieval task needs the names told apart)
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "train_len", "vocab_size", "mlp_ratio"):
            check_positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise PosencError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    def to_dict(self) -> dict:
        """The configuration as a plain dict (``tie_embeddings`` only when untied, as before it existed)."""
        d = asdict(self)
        if d["tie_embeddings"]:
            del d["tie_embeddings"]
        return d


class SelfAttention(nn.Module):
    """Multi-head causal self-attention through :func:`attention`, with the encoding's ``rotate`` and ``bias`` hooks,
    and the ``decay`` a decay-gated encoding reads from the layer's input."""
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.backend = cfg.n_head, cfg.backend
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, encoding, positions, cache=None, reach=None, tables=None):
        """``x`` is ``b n d_model``; returns the attention output projected back to ``b n d_model``."""
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.n_head)
        decay = encoding.decay(x)  # b h n: a decay-gated layer's log forget values (FoX); None for every other
        householder = encoding.householder(x)  # PaTH's transforms (w: b h n d, beta: b h n); None for every other
        y = attention(q, k, v, encoding, backend=self.backend, positions=positions, cache=cache, reach=reach,
                      tables=tables, decay=decay, householder=householder)  # b h n d
        return self.proj(rearrange(y, "b h n d -> b n (h d)"))


class Block(nn.Module):
    """One pre-norm Transformer block: LayerNorm, attention, residual; LayerNorm, MLP, residual."""
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))

    def forward(self, x, encoding, positions, cache=None, reach=None, tables=None):
        """``x`` is ``b n d_model``; returns the block's output, of the same shape."""
        x = x + self.attn(self.ln1(x), encoding, positions, cache, reach, tables)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The decoder-only byte-level language model: token embeddings, one shared encoding, ``n_layer`` blocks, an
    output head tied to the embedding (unless ``tie_embeddings=False``)."""
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
            # an untied model's weights hold two different matrices; loaded here, the head's would silently replace
            # the embedding: refuse them in one sentence
            self._register_load_state_dict_pre_hook(self._refuse_untied_weights)
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: residual projections scaled down with depth
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # the encoding is built after the GPT-2 init so that it keeps its own initialisation
        self.encoding = make_encoding(cfg.encoding, d_model=cfg.d_model, num_heads=cfg.n_head,
                                      train_len=cfg.train_len, n_layer=cfg.n_layer, **cfg.encoding_options)

    @staticmethod
    def _refuse_untied_weights(state_dict, prefix, *args):
        emb, head = state_dict.get(prefix + "tok_emb.weight"), state_dict.get(prefix + "head.weight")
        if emb is not None and head is not None and not torch.equal(emb, head):
            raise PosencError("these weights have an output head untied from the embedding: build the model with "
                              "GPTConfig(tie_embeddings=False)")

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """The number of parameters (a tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, *, cache: list[KVCache] | None = None, reach: int | None = None,
                masks: dict | None = None) -> torch.Tensor:
        """Token ids ``b n`` -> next-token logits ``b n vocab``.

        With ``cache`` (one :class:`KVCache` per layer, from :meth:`new_cache`), ``idx`` are the next
        tokens after those already cached: their positions continue from the cache, and the caches grow.
        ``reach=W``: every layer attends only to the keys less than ``W`` positions back (a sliding-window
        mask, :func:`attention`); run at ``W = train_len``, the model never looks further back than it was
        trained to. A layer whose encoding (``encoding.for_layer``) has its own ``window`` or ``chunk`` keeps it:
        the smaller window wins, and a chunk and ``reach`` both apply.

        ``masks``: a dict the caller owns, where the attention backends keep the masks they build from a bias
        encoding; handed to every later forward pass over the same positions (the same length, no cache) with the
        same weights, it serves them the masks built once (an evaluation that scores window after window). Only
        in evaluation: ``eval()`` mode, no gradients.
        """
        if masks is not None and (self.training or torch.is_grad_enabled() or cache is not None):
            raise PosencError("masks kept across forward passes are for evaluation without a cache: call "
                              "model.eval() and run under torch.no_grad()")
        if idx.dim() != 2:
            raise PosencError(f"token ids must be 2-d (batch, positions), got shape {tuple(idx.shape)}")
        # a bad id is one sentence here, not a device-side assert (skipped in CUDA training, where it would sync)
        check = not torch.compiler.is_compiling() and idx.numel() and (idx.device.type == "cpu" or not self.training)
        if check and (int(idx.min()) < 0 or int(idx.max()) >= self.cfg.vocab_size):
            raise PosencError(f"token ids must lie in 0 .. {self.cfg.vocab_size - 1}, "
                              f"got {int(idx.min())} .. {int(idx.max())}")
        start = 0 if not cache else len(cache[0])
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        if cache is None:  # randomized positions (a variant's hook; the positions themselves otherwise)
            positions = self.encoding.forward_positions(positions, self.training)
        x = self.encoding.embed(self.tok_emb(idx), positions)
        tables = self.encoding.tables(positions, x.dtype, shared=masks)  # once per forward pass, for every layer
        n_layer = len(self.blocks)
        for i, (block, layer_cache) in enumerate(zip(self.blocks, cache or [None] * n_layer)):
            encoding = self.encoding.for_layer(i, n_layer)
            x = block(x, encoding, positions, layer_cache, reach, tables if encoding is self.encoding else None)
        return self.head(self.ln_f(x))

    def new_cache(self, *, window: int | None = None, sinks: int = 0) -> list[KVCache] | list[SinkCache]:
        """An empty key/value cache, one per layer; with ``window``, a rolling :class:`~posenc_lab.backends.SinkCache` that keeps the
        first ``sinks`` tokens and the last ``window`` (positions within the cache, as StreamingLLM)."""
        if window is None:
            return [KVCache() for _ in self.blocks]
        return [SinkCache(window, sinks) for _ in self.blocks]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, cache: bool | None = None, dynamic: str | None = None,
                 return_logits: bool = False):
        """Continue ``prompt`` (token ids ``b n`` or ``n``) by ``max_new_tokens`` tokens.

        ``temperature=0`` is greedy decoding; otherwise tokens are sampled from
        ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely when given.
        ``cache=True`` (the default) decodes incrementally with a key/value cache (:class:`KVCache`): the
        prompt is run once, then one token at a time, each attending to the cached keys through the
        same :func:`attention`. ``cache=False`` recomputes the whole sequence at every step (the
        reference the cache is tested against).

        RoPE strategies whose factor follows the length (``pi``, ``ntk``, ``yarn`` with ``factor=None``)
        are fixed for the whole call at the final length ``n + max_new_tokens``, as a deployed model
        fixes its scaling factor: a factor that changed from token to token would leave the cached
        keys rotated with an older one. Dynamic NTK changes its base by design; ``dynamic`` chooses
        its form for this call: ``"cache"`` (each key keeps the rotation of the length at which it
        entered the cache: what a cache computes, and what the experiment evaluates) or
        ``"sequence"`` (every key re-rotated with the current base at every step: what a fresh
        forward pass computes); default: the encoding's own (``"cache"`` unless set otherwise). The
        ``"sequence"`` form recomputes the whole sequence at every step: no cache can serve it, since
        every layer's keys depend on the earlier layers' outputs, which change with the base.

        Returns the tokens ``b (n + max_new_tokens)`` (and, with ``return_logits``, the logits that chose
        each new token, ``b max_new_tokens vocab``). A learned position table stops with a clear error
        at its end.
        """
        prompt = _checked_prompt(prompt, max_new_tokens, temperature, top_k)
        was_training = self.training
        self.eval()
        restore = self.encoding.pin_length(prompt.shape[1] + max_new_tokens, dynamic)
        if cache is None:
            cache = self.encoding.cacheable
        elif cache and not self.encoding.cacheable:
            restore()
            raise PosencError("this encoding changes the positions or rotation of keys already seen at every step "
                              "(dynamic NTK in its 'sequence' form, LongRoPE, randomized positions), which no "
                              "key/value cache can serve: generate with cache=False (or leave cache unset)")
        try:
            tokens, chosen = prompt, []
            caches = self.new_cache() if cache else None
            step_input = prompt
            for _ in range(max_new_tokens):
                logits = self(step_input, cache=caches)[:, -1] if cache else self(tokens)[:, -1]
                logits = logits.float()
                chosen.append(logits)
                nxt = self._pick(logits, temperature, top_k, generator)
                tokens = torch.cat([tokens, nxt], dim=1)
                step_input = nxt
        finally:
            restore()
            self.train(was_training)
        if return_logits:
            empty = torch.empty(prompt.shape[0], 0, self.cfg.vocab_size, device=prompt.device)
            return tokens, torch.stack(chosen, dim=1) if chosen else empty
        return tokens

    @staticmethod
    def _pick(logits, temperature, top_k, generator):
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)

    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor, *, reach: int | None = None,
                     masks: dict | None = None) -> torch.Tensor:
        """Cross-entropy in nats of every target token, ``b n``, computed in float32 (0 where the target is ``IGNORE``);
        ``reach`` and ``masks``: as in :meth:`forward`."""
        logits = self(idx, reach=reach, masks=masks)
        return F.cross_entropy(rearrange(logits.float(), "b n v -> (b n) v"), rearrange(targets, "b n -> (b n)"),
                               reduction="none", ignore_index=IGNORE).view_as(targets)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not ``IGNORE`` (all of them in language modelling)."""
        return self.token_losses(idx, targets).sum() / (targets != IGNORE).sum()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, ``6 N + 6 L n d`` (PaLM's accounting with the causal half of attention).

        ``N`` counts the parameters a token is multiplied by: the tied embedding once, as the output projection it
        also is. Parameters that are only looked up are left out: an untied input embedding, and the encoding's
        own (a learned position table, T5's table, KERPLE's and FIRE's few, evaluated per distance, not per token).
        """
        looked_up = sum(p.numel() for p in self.encoding.parameters())
        if self.head.weight is not self.tok_emb.weight:
            looked_up += self.tok_emb.weight.numel()
        return 6 * (self.num_params() - looked_up) + 6 * self.cfg.n_layer * seq_len * self.cfg.d_model


def _checked_prompt(prompt: torch.Tensor, max_new_tokens, temperature, top_k) -> torch.Tensor:
    """:meth:`GPT.generate`'s arguments checked (one sentence each); the prompt as ``b n``."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise PosencError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise PosencError(f"temperature must be a number >= 0, got {temperature!r}")
    prompt = prompt[None] if prompt.dim() == 1 else prompt
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise PosencError(f"the prompt must hold at least one token (shape b x n, n >= 1), got {tuple(prompt.shape)}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise PosencError(f"top_k must be a positive integer, got {top_k!r}")
    return prompt
