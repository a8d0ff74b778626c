"""A small GPT-style decoder, identical for every encoding except where the encoding enters.

Pre-norm blocks (LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual), GELU MLP of
width ``4 d``, tied input/output embeddings, GPT-2 initialisation (normal(0, 0.02), residual
projections scaled by ``1 / sqrt(2 n_layer)``). One encoding object is shared by all layers:
its ``embed`` hook runs once on the token embeddings, its ``rotate`` and ``bias`` hooks in every
layer's attention (T5 shares its bias across layers the same way).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .backends import attention
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

    def __post_init__(self):
        for name in ("n_layer", "n_head", "d_model", "train_len", "vocab_size", "mlp_ratio"):
            check_positive(name, getattr(self, name))
        if self.d_model % self.n_head:
            raise PosencError(f"d_model {self.d_model} is not divisible by n_head {self.n_head}")

    def to_dict(self) -> dict:
        return asdict(self)


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.backend = cfg.n_head, cfg.backend
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, encoding, positions):
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.n_head)
        y = attention(q, k, v, encoding, backend=self.backend, positions=positions)  # b h n d
        return self.proj(rearrange(y, "b h n d -> b n (h d)"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))

    def forward(self, x, encoding, positions):
        x = x + self.attn(self.ln1(x), encoding, positions)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)
        for block in self.blocks:  # GPT-2: residual projections scaled down with depth
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
        # the encoding is built after the GPT-2 init so that it keeps its own initialisation
        self.encoding = make_encoding(cfg.encoding, d_model=cfg.d_model, num_heads=cfg.n_head,
                                      train_len=cfg.train_len, **cfg.encoding_options)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``b n`` -> next-token logits ``b n vocab``."""
        if idx.dim() != 2:
            raise PosencError(f"token ids must be 2-d (batch, positions), got shape {tuple(idx.shape)}")
        positions = torch.arange(idx.shape[1], device=idx.device)  # one tensor: the encoding's tables are built once
        x = self.encoding.embed(self.tok_emb(idx), positions)
        for block in self.blocks:
            x = block(x, self.encoding, positions)
        return self.head(self.ln_f(x))

    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy in nats of every target token, ``b n``, computed in float32 (0 where the target is ``IGNORE``)."""
        logits = self(idx)
        return F.cross_entropy(rearrange(logits.float(), "b n v -> (b n) v"), rearrange(targets, "b n -> (b n)"),
                               reduction="none", ignore_index=IGNORE).view_as(targets)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the targets that are not ``IGNORE`` (all of them in language modelling)."""
        return self.token_losses(idx, targets).sum() / (targets != IGNORE).sum()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, ``6 N + 6 L n d`` (PaLM's accounting with the causal half of attention).

        ``N`` counts the tied embedding once, as the output projection it also is.
        """
        return 6 * self.num_params() + 6 * self.cfg.n_layer * seq_len * self.cfg.d_model
