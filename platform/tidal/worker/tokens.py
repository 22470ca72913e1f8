"""Text to token ids: bytes by default (vocabulary 256, nothing to download), or a Hugging Face
tokenizer from a local directory (`data.tokenizer`). Both data paths use these functions."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tidal.errors import SpecError

BYTE_VOCAB = 256


@functools.lru_cache(maxsize=2)
def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory (`save_pretrained` output); no download."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SpecError([("data.tokenizer", "needs transformers: pip install 'tidal[hf]'")]) from e
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SpecError([("data.tokenizer", f"no Hugging Face tokenizer could be loaded from {path!r}: {e}")]) from e


def vocab_size(tokenizer: str | None) -> int:
    return BYTE_VOCAB if tokenizer is None else len(load_tokenizer(tokenizer))


def encode(docs: list[str], tokenizer: str | None) -> np.ndarray:
    """The documents as one int32 token sequence, each ending in a separator (newline, or the
    tokenizer's end-of-sequence token) so that windows cut across documents still mark where
    one ends."""
    if tokenizer is None:
        return np.frombuffer(b"".join(d.encode() + b"\n" for d in docs), dtype=np.uint8).astype(np.int32)
    tok = load_tokenizer(tokenizer)
    end = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    ids = tok(list(docs), add_special_tokens=False)["input_ids"]
    return np.fromiter((t for seq in ids for t in (*seq, *([end] if end is not None else []))), dtype=np.int32)
