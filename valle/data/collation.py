"""Collation helpers: cuts -> padded tensors (text tokens, EnCodec codes)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from valle.codec.constants import NUM_AUDIO_TOKENS
from valle.data.symbols import SymbolTable
from valle.data.text import TextTokenCollater


class MissingTokensError(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def get_text_token_collater(text_tokens_file: str | os.PathLike, add_bos: bool = True,
                            add_eos: bool = True) -> TextTokenCollater:
    """The table's collater. A table without ``<bos>``/``<eos>`` (VALL-E X's, whose text has
    none: valle/data/vallex_text.py) gets none added."""
    from valle.data.symbols import BOS, EOS

    table = SymbolTable.from_file(text_tokens_file)
    return TextTokenCollater(table, add_bos=add_bos and BOS in table, add_eos=add_eos and EOS in table)


def cut_text_symbols(cut) -> list[str]:
    """Phoneme symbols stored by bin/tokenizer.py on supervisions[0].custom["tokens"]["text"]."""
    try:
        return list(cut.supervisions[0].custom["tokens"]["text"])
    except (IndexError, KeyError, TypeError):
        raise MissingTokensError(
            f"cut {cut.id} has no text tokens (supervisions[0].custom['tokens']['text']): "
            "tokenize the manifest with bin/tokenizer.py first"
        ) from None


def num_text_tokens(cut) -> int:
    """Token count without bos/eos (stored at tokenization time; falls back to the list)."""
    sups = cut.supervisions
    custom = sups[0].custom if sups else None
    if custom and "num_text_tokens" in custom:
        return int(custom["num_text_tokens"])
    return len(cut_text_symbols(cut))


def collate_audio_features(
    features: Sequence[np.ndarray | torch.Tensor], pad_value: int = NUM_AUDIO_TOKENS
) -> tuple[torch.Tensor, torch.Tensor]:
    """List of (T_i, Q) codes -> ((B, T_max, Q) LongTensor padded with ``pad_value``, lens)."""
    tensors = [torch.as_tensor(np.asarray(f), dtype=torch.long) for f in features]
    lens = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
    q = tensors[0].shape[1] if tensors else 0
    out = torch.full((len(tensors), int(lens.max()) if tensors else 0, q), pad_value, dtype=torch.long)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out, lens
