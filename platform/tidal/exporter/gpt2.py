"""The built-in GPT as a Hugging Face GPT-2, which it maps onto exactly.

Both are pre-norm decoders with learned position embeddings, a fused q|k|v projection split
in that order, a 4x MLP, a final LayerNorm (eps 1e-5) and an output head tied to the token
embedding. Two settings make GPT-2 compute what the built-in GPT does: the exact (erf) GELU
(`activation_function="gelu"`; GPT-2's default is the tanh approximation) and dropout only on
attention weights. GPT-2's `Conv1D` stores weights as (in, out): the transpose of `nn.Linear`.
tests/test_export.py checks that both give the same loss.
"""

from __future__ import annotations

import torch
from torch import nn


def to_gpt2(gpt: nn.Module) -> nn.Module:
    """A `transformers.GPT2LMHeadModel` holding the weights of `gpt` (a tidal GPT)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = gpt.cfg
    config = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * cfg.d_model, activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=cfg.dropout, tie_word_embeddings=True,
        # GPT-2's defaults (50256) lie outside a small vocabulary; the job had no special tokens.
        bos_token_id=None, eos_token_id=None,
    )
    hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(gpt.state_dict(), cfg.n_layer), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to transformer.wte.weight
    if missing or unexpected:
        raise RuntimeError(f"GPT-2 mapping incomplete: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    return hf.eval()


def gpt2_state_dict(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": sd["tok.weight"], "transformer.wpe.weight": sd["pos.pos.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"], "transformer.ln_f.bias": sd["ln_f.bias"]}
    names = {"ln1": "ln_1", "ln2": "ln_2", "qkv": "attn.c_attn", "proj": "attn.c_proj", "mlp.0": "mlp.c_fc",
             "mlp.2": "mlp.c_proj"}
    for i in range(n_layer):
        for ours, theirs in names.items():
            w, b = sd[f"blocks.{i}.{ours}.weight"], sd[f"blocks.{i}.{ours}.bias"]
            conv1d = not ours.startswith("ln")
            out[f"transformer.h.{i}.{theirs}.weight"] = w.t().contiguous() if conv1d else w
            out[f"transformer.h.{i}.{theirs}.bias"] = b
    return out
