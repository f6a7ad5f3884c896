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
from vitrim.untrusted import expect_object, read_json


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


MAX_VOCAB = 2**20  # tokens per vocabulary a vocab.json may list (config_limits' bound on the embedding)


def load_vocabs(path: Path) -> tuple[Vocab, Vocab, dict]:
    """(source vocab, target vocab, the other fields) from a run folder's ``vocab.json``."""
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} not found: expected a run folder written by `vitrim demo translate`")
    where = str(path)
    data = expect_object(read_json(path), where)  # a run folder may come from anyone: JSON read as data
    for key in ("source", "target"):
        tokens = data.get(key)
        if not (isinstance(tokens, list) and 0 < len(tokens) <= MAX_VOCAB and all(isinstance(t, str) for t in tokens)):
            raise ValueError(f"{where}: {key} must be a list of 1 to {MAX_VOCAB} token strings, got {tokens!r:.80}")
    languages = data.get("languages", list(LANGUAGES))
    if not (isinstance(languages, list) and languages and all(lang in LANGUAGES for lang in languages)):
        raise ValueError(f"{where}: languages must be a non-empty list of {list(LANGUAGES)}, got {languages!r:.80}")
    layer = data.get("alignment_layer", -1)
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise ValueError(f"{where}: alignment_layer must be an int (a decoder layer), got {layer!r:.80}")
    source = Vocab(data.pop("source"), name="English source")
    tags = [LANGUAGE_TAGS[lang] for lang in languages]
    target = Vocab(data.pop("target"), specials=(PAD, EOS, *tags), name="target")
    return source, target, {**data, "languages": languages}
