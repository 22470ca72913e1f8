"""A small decoder-only transformer in the style of nanoGPT: pre-norm blocks, tied embeddings."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tidal.spec.sections import ModelSpec


class Block(nn.Module):
    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model)
        )
        self.dropout = cfg.dropout
        self.apply(_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Embedding):
    """Token embeddings; the output head reuses their weight (tied, as in GPT-2)."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__(cfg.vocab_size, cfg.d_model)
        _init(self)


class PositionEmbedding(nn.Module):
    """Adds a learned embedding of each position to the token embeddings."""

    def __init__(self, cfg: ModelSpec) -> None:
        super().__init__()
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        _init(self.pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


def layers(cfg: ModelSpec) -> list[tuple[type[nn.Module], tuple]]:
    """The model as a sequence of (class, args), shared by `GPT` and its pipeline form.

    Layer i is built right after `torch.manual_seed(seed + i)`, as DeepSpeed's PipelineModule
    does with `seed_layers=True`: a pipeline stage, which builds only its own layers, then gets
    exactly the weights the whole model has. The head is not listed: it is layer 0, tied.
    """
    return [(TokenEmbedding, (cfg,)), (PositionEmbedding, (cfg,)),
            *[(Block, (cfg,))] * cfg.n_layer, (nn.LayerNorm, (cfg.d_model,))]


def lm_head(tok: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, tok.weight)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class GPT(nn.Module):
    """`forward(tokens, targets)` returns the mean next-token cross-entropy."""

    def __init__(self, cfg: ModelSpec, checkpoint_fn: Callable[..., torch.Tensor] | None = None,
                 seed: int | None = None) -> None:
        """`checkpoint_fn(block, x)` recomputes a block in backward instead of storing its
        activations (activation checkpointing); None stores them. `seed` defaults to torch's."""
        super().__init__()
        self.cfg = cfg
        self.checkpoint_fn = checkpoint_fn
        seed = torch.initial_seed() if seed is None else seed
        built = []
        for i, (cls, args) in enumerate(layers(cfg)):
            torch.manual_seed(seed + i)
            built.append(cls(*args))
        self.tok, self.pos, *blocks, self.ln_f = built
        self.blocks = nn.ModuleList(blocks)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.tok(tokens))
        for block in self.blocks:
            if self.checkpoint_fn is not None and self.training:
                x = self.checkpoint_fn(block, x)
            else:
                x = block(x)
        return lm_loss(lm_head(self.tok, self.ln_f(x)), targets)


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
