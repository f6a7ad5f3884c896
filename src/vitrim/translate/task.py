"""The number-translation task as tensors: vocabularies, padded id batches, and a run folder's saved vocabularies.

Source rows are English token ids; a target row for teacher forcing is ``[<lang>, y_0 … y_n, <eos>]``: the decoder
reads ``row[:-1]`` and learns to predict ``row[1:]``. Everything is padded with id 0 (``<pad>``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vitrim.data.numbers import EOS, LANGUAGE_TAGS, LANGUAGES, PAD, Pair, Vocab


@dataclass
class Batch:
    """Padded ids of a list of pairs: ``src`` (N, Ls), ``tgt`` (N, Lt + 2) = [<lang>, tokens…, <eos>, pads]."""

    src: Tensor
    tgt: Tensor
    pairs: list[Pair]

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def start_ids(self) -> Tensor:
        return self.tgt[:, 0]  # (N,) the language tags

    def select(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Rows ``index``, trimmed to their longest source and target: (src (b, Ls'), tgt (b, Lt'))."""
        src, tgt = self.src[index], self.tgt[index]
        return src[:, : int((src != 0).sum(1).max())], tgt[:, : int((tgt != 0).sum(1).max())]


def build_vocabs(pairs: Sequence[Pair], languages: Sequence[str] = LANGUAGES) -> tuple[Vocab, Vocab]:
    """English vocabulary (``<pad>`` + words), and one target vocabulary for all languages (``<pad>``, ``<eos>``,
    the language tags, the words)."""
    source = Vocab((tok for p in pairs for tok in p.source), name="English source")
    tags = [LANGUAGE_TAGS[lang] for lang in languages]
    target = Vocab((tok for p in pairs for tok in p.target), specials=(PAD, EOS, *tags), name="target")
    return source, target


def encode_pairs(pairs: Sequence[Pair], source_vocab: Vocab, target_vocab: Vocab) -> Batch:
    """All pairs as one padded :class:`Batch`."""
    if not pairs:
        raise ValueError("pairs must not be empty")
    src_rows = [source_vocab.encode(p.source) for p in pairs]
    tgt_rows = [[target_vocab.id(LANGUAGE_TAGS[p.lang]), *target_vocab.encode(p.target), target_vocab.id(EOS)]
                for p in pairs]  # fmt: skip
    return Batch(pad_rows(src_rows), pad_rows(tgt_rows), list(pairs))


def pad_rows(rows: Sequence[Sequence[int]]) -> Tensor:
    """(N, max length) long, padded with 0."""
    out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def strip(ids: Sequence[int], target_vocab: Vocab) -> list[str]:
    """Generated ids -> tokens, up to (not including) the first ``<eos>``; padding dropped."""
    tokens = []
    for tok in target_vocab.decode(ids):
        if tok == EOS:
            break
        if tok != PAD:
            tokens.append(tok)
    return tokens


def save_vocabs(path: Path, source: Vocab, target: Vocab, extra: dict) -> None:
    path.write_text(json.dumps({"source": source.tokens, "target": target.tokens, **extra}, indent=1) + "\n")


def load_vocabs(path: Path) -> tuple[Vocab, Vocab, dict]:
    """(source vocab, target vocab, the other fields) from a run folder's ``vocab.json``."""
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: expected a run folder written by `vitrim demo translate`")
    data = json.loads(path.read_text())
    source = Vocab(data.pop("source"), name="English source")
    tags = [LANGUAGE_TAGS[lang] for lang in data.get("languages", LANGUAGES)]
    target = Vocab(data.pop("target"), specials=(PAD, EOS, *tags), name="target")
    return source, target, data
