"""Translate one English phrase with a trained run folder, and get the cross-attention it used."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from vitrim.data.numbers import EOS, LANGUAGE_TAGS, SOURCE_LANGUAGE, Vocab, detokenize, tokenize, words
from vitrim.demos.translate.task import load_vocabs, strip
from vitrim.models.seq2seq import Seq2SeqTransformer
from vitrim.models.seq2seq_decode import beam_search, greedy_decode

MODEL_FILE, VOCAB_FILE = "model.safetensors", "vocab.json"


@dataclass
class TrainedRun:
    model: Seq2SeqTransformer
    source_vocab: Vocab
    target_vocab: Vocab
    languages: list[str]
    alignment_layer: int  # the decoder layer whose cross-attention aligns best on the training split


@dataclass
class Translation:
    source: list[str]  # English tokens
    target: list[str]  # generated tokens, without <eos>
    text: str  # the detokenized translation
    cross_attention: Tensor  # (layers, H, len(target) + 1, len(source)); the last row predicted <eos>


def load_run(folder: str | Path) -> TrainedRun:
    """The model and vocabularies that ``vitrim demo translate`` wrote to ``folder``."""
    from vitrim.weights.checkpoint import build_saved_model

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"--run {str(folder)!r} is not a folder; train one with `vitrim demo translate`")
    source, target, info = load_vocabs(folder / VOCAB_FILE)
    model = build_saved_model(folder / MODEL_FILE)
    if not isinstance(model, Seq2SeqTransformer):
        raise ValueError(f"{str(folder / MODEL_FILE)!r} holds a {type(model).__name__}, not a Seq2SeqTransformer")
    config = model.config
    for name, vocab, size in (("source", source, config.src_vocab_size), ("target", target, config.tgt_vocab_size)):
        if len(vocab) != size:  # an id past the list would be decoded as Python's IndexError
            raise ValueError(
                f"{str(folder / VOCAB_FILE)!r}: the {name} vocabulary has {len(vocab)} tokens (specials included), "
                f"but {str(folder / MODEL_FILE)!r} embeds {size}; the two files are not from one run"
            )
    layer = info.get("alignment_layer", -1)
    if not -config.decoder_depth <= layer < config.decoder_depth:
        raise ValueError(
            f"{str(folder / VOCAB_FILE)!r}: alignment_layer {layer} is not a decoder layer of the model "
            f"(expected 0 to {config.decoder_depth - 1})"
        )
    return TrainedRun(model.eval(), source, target, list(info["languages"]), layer % config.decoder_depth)


def english_tokens(text: str, source_vocab: Vocab) -> list[str]:
    """Lower-cased English tokens of ``text``; a number in digits is first written out by num2words."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text must be English number words such as 'twenty-one', got {text!r}")
    cleaned = text.strip().lower()
    if cleaned.isdigit():
        cleaned = words(int(cleaned), SOURCE_LANGUAGE)
    tokens = tokenize(cleaned, SOURCE_LANGUAGE)
    for token in tokens:
        if token not in source_vocab:
            known = " ".join(repr(tok) for tok in source_vocab.tokens[source_vocab.num_specials :])
            raise ValueError(f"word {token!r} in {text!r} is out of vocabulary (the model knows: {known})")
    return tokens


@torch.no_grad()
def translate_text(run: TrainedRun, text: str, lang: str, beam_size: int = 1) -> Translation:
    """Translate ``text`` into ``lang``; the cross-attention is recomputed teacher-forced on the output."""
    if lang not in run.languages:
        raise ValueError(f"--to must be one of {run.languages} (the languages this run learned), got {lang!r}")
    source = english_tokens(text, run.source_vocab)
    limit = run.model.config.max_len
    if len(source) > limit:
        raise ValueError(f"text has {len(source)} tokens, more than this model's max_len={limit}")
    src = torch.tensor([run.source_vocab.encode(source)])  # (1, Ls)
    start = torch.tensor([run.target_vocab.id(LANGUAGE_TAGS[lang])])  # (1,)
    if beam_size == 1:
        ids = greedy_decode(run.model, src, start)
    else:
        ids = beam_search(run.model, src, start, beam_size=beam_size)
    target = strip(ids[0].tolist(), run.target_vocab)
    tgt = torch.tensor([[int(start), *run.target_vocab.encode(target)]])  # (1, Lt + 1): start + output
    maps = run.model.forward_detailed(src, tgt, need_weights=True).cross_attentions  # layers × (1, H, Lt+1, Ls)
    return Translation(source, target, detokenize(target, lang), torch.stack([m[0] for m in maps]))


def row_labels(target: list[str]) -> list[str]:
    """Labels of the cross-attention rows: each output token, and <eos> for the last row."""
    return [*target, EOS]
