"""Train the encoder–decoder on number words, and score it: exact match, chrF, and the alignment of cross-attention.

Scores (all on the held-out numbers, none used for any choice except where said):

* ``exact_match``: share of test sentences whose greedy translation equals num2words' text token for token.
* ``chrf``: sacrebleu's corpus chrF (character n-gram F-score, 0-100) of the detokenized greedy translations.
* ``alignment_accuracy``: teacher-forced on the reference translation, share of scored target tokens (every token
  but ``<eos>`` and French hyphens, see :mod:`vitrim.data.numbers`) whose cross-attention row, averaged over the
  heads of decoder layer L, is largest at the aligned source token. L is the layer that aligns best on (a sample
  of) the *training* pairs; every layer's test score is reported too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vitrim.data.numbers import LANGUAGES, Vocab, detokenize
from vitrim.demos.translate.task import Batch, strip
from vitrim.models.seq2seq import Seq2SeqConfig, Seq2SeqTransformer
from vitrim.models.seq2seq_decode import beam_search, greedy_decode
from vitrim.train.optim import build_optimizer


@dataclass(frozen=True)
class TrainPlan:
    """Optimisation settings; the defaults are the demo's."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    label_smoothing: float = 0.0
    max_seconds: float = 0.0  # stop early after this long (0: never); the summary says whether it did


def train_model(
    config: Seq2SeqConfig,
    train: Batch,
    plan: TrainPlan,
    *,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> tuple[Seq2SeqTransformer, dict[str, Any]]:
    """Teacher-forced cross-entropy with AdamW and warm-up + cosine; returns the model (eval mode) and a log."""
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config)
    optimizer, scheduler = build_optimizer(
        model, lr=plan.lr, weight_decay=plan.weight_decay, warmup_steps=plan.warmup_steps, total_steps=plan.steps
    )
    generator = torch.Generator().manual_seed(seed)
    start, losses, step = time.perf_counter(), [], 0
    order = torch.randperm(len(train), generator=generator)
    cursor, stopped_early = 0, False
    model.train()
    for step in range(1, plan.steps + 1):
        if cursor + plan.batch_size > len(order):
            order, cursor = torch.randperm(len(train), generator=generator), 0
        src, tgt = train.select(order[cursor : cursor + plan.batch_size])
        cursor += plan.batch_size
        logits = model(src, tgt[:, :-1])  # (b, Lt, V)
        loss = F.cross_entropy(
            logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=config.pad_id, label_smoothing=plan.label_smoothing
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log is not None and (step % 250 == 0 or step == plan.steps):
            log(f"step {step}/{plan.steps}  loss {sum(losses[-250:]) / len(losses[-250:]):.4f}"
                f"  {time.perf_counter() - start:.0f} s")  # fmt: skip
        if plan.max_seconds and time.perf_counter() - start > plan.max_seconds:
            stopped_early = step < plan.steps
            break
    history = {"steps": step, "final_loss": sum(losses[-100:]) / len(losses[-100:]), "stopped_early": stopped_early,
               "train_seconds": time.perf_counter() - start}  # fmt: skip
    return model.eval(), history


@torch.no_grad()
def translate_batch(
    model: Seq2SeqTransformer, data: Batch, target_vocab: Vocab, *, beam_size: int = 1, chunk: int = 512
) -> list[list[str]]:
    """Translate every source row of ``data`` into its tag's language; greedy when ``beam_size`` is 1."""
    out: list[list[str]] = []
    for begin in range(0, len(data), chunk):
        index = torch.arange(begin, min(begin + chunk, len(data)))
        src, tgt = data.select(index)
        if beam_size == 1:
            ids = greedy_decode(model, src, tgt[:, 0])
        else:
            ids = beam_search(model, src, tgt[:, 0], beam_size=beam_size)
        out.extend(strip(row, target_vocab) for row in ids.tolist())
    return out


def translation_scores(data: Batch, hypotheses: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Exact match and chrF, overall and per language."""
    import sacrebleu

    scores: dict[str, Any] = {}
    langs = sorted({p.lang for p in data.pairs})
    for key in (None, *langs):
        rows = [(p, h) for p, h in zip(data.pairs, hypotheses) if key is None or p.lang == key]
        exact = sum(list(p.target) == list(h) for p, h in rows) / len(rows)
        hyp = [detokenize(h, p.lang) for p, h in rows]
        ref = [detokenize(p.target, p.lang) for p, _ in rows]
        chrf = sacrebleu.corpus_chrf(hyp, [ref]).score
        if key is None:
            scores.update(exact_match=exact, chrf=chrf, sentences=len(rows))
        else:
            scores[key] = {"exact_match": exact, "chrf": chrf, "sentences": len(rows)}
    return scores


@torch.no_grad()
def cross_attention(model: Seq2SeqTransformer, data: Batch, *, chunk: int = 512) -> list[list[Tensor]]:
    """Teacher-forced cross-attention on the reference: per sentence, per layer, (H, Lt, Ls) without padding.

    Row i is the attention of decoder position i, which predicts target token i (the last row predicts <eos>).
    """
    per_sentence: list[list[Tensor]] = [[] for _ in range(len(data))]
    for begin in range(0, len(data), chunk):
        index = torch.arange(begin, min(begin + chunk, len(data)))
        src, tgt = data.select(index)
        maps = model.forward_detailed(src, tgt[:, :-1], need_weights=True).cross_attentions  # L × (b, H, Lt, Ls)
        for row, i in enumerate(index.tolist()):
            pair = data.pairs[i]
            ls, lt = len(pair.source), len(pair.target) + 1  # + the <eos> row
            per_sentence[i] = [m[row, :, :lt, :ls] for m in maps]
    return per_sentence


def alignment_hits(maps: Sequence[list[Tensor]], data: Batch, layer: int) -> tuple[int, int]:
    """(hits, scored tokens) of layer ``layer``'s head-mean cross-attention argmax against the known alignment."""
    hits = total = 0
    for pair, layers in zip(data.pairs, maps):
        looked = layers[layer].mean(0).argmax(-1).tolist()  # (Lt + 1,) source position per target row
        for i, aligned in enumerate(pair.alignment):
            if aligned is not None:
                total += 1
                hits += looked[i] == aligned
    return hits, total


def alignment_scores(model: Seq2SeqTransformer, train: Batch, test: Batch, train_sample: int = 2000) -> dict[str, Any]:
    """Pick the layer on (the first ``train_sample`` of a shuffled) train split, report test accuracy (module doc)."""
    depth = model.config.decoder_depth
    sample = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:train_sample]
    subset = Batch(train.src[sample], train.tgt[sample], [train.pairs[i] for i in sample.tolist()])
    train_maps, test_maps = cross_attention(model, subset), cross_attention(model, test)
    train_acc = [_ratio(alignment_hits(train_maps, subset, layer)) for layer in range(depth)]
    test_hits = [alignment_hits(test_maps, test, layer) for layer in range(depth)]
    layer = max(range(depth), key=lambda i: train_acc[i])
    per_lang = {}
    for lang in sorted({p.lang for p in test.pairs}):
        keep = [i for i, p in enumerate(test.pairs) if p.lang == lang]
        lang_batch = Batch(test.src[keep], test.tgt[keep], [test.pairs[i] for i in keep])
        per_lang[lang] = _ratio(alignment_hits([test_maps[i] for i in keep], lang_batch, layer))
    return {
        "alignment_accuracy": _ratio(test_hits[layer]),
        "alignment_layer": layer,
        "alignment_tokens": test_hits[layer][1],
        "alignment_by_language": per_lang,
        "alignment_train_by_layer": train_acc,
        "alignment_test_by_layer": [_ratio(h) for h in test_hits],
    }


def _ratio(hits_total: tuple[int, int]) -> float:
    hits, total = hits_total
    return hits / total if total else float("nan")


def languages_of(data: Batch) -> list[str]:
    return [lang for lang in LANGUAGES if any(p.lang == lang for p in data.pairs)]
