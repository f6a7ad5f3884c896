"""Independent re-implementations of the pre-LLM selections, written in the tests from the authors' code (FasterVLM,
VisPruner, VisionZip: their batched tensor formulations) or paper (DivPrune, whose code is CC BY-NC: a plain loop
over the paper's greedy). The one change from the authors' code: where they sort or take top-k, equal values are
ordered by index (``stable=True``), because their order among ties is left to the torch backend.

Inputs are the authors' tensors: ``attentions`` (B, H, 1 + N, 1 + N) of the tower layer −2 as transformers'
``output_attentions`` gives them, ``hidden`` (B, 1 + N, D) that layer's output ([CLS] first), ``keys``
(B, H, 1 + N, hd) that layer's keys, ``projected`` (B, N, E) the projector's output.
"""

from __future__ import annotations

import torch


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def fastervlm_reference(attentions: torch.Tensor, keep: int) -> list[list[int]]:
    """encode_images: head-mean [CLS] row, top-k, an index mask over the tokens (raster order)."""
    image_attentions = attentions[:, :, 0, 1:].mean(dim=1)  # (B, N)
    token_indices = stable_topk(image_attentions, keep)
    index_masks = torch.zeros_like(image_attentions, dtype=torch.bool).scatter_(1, token_indices, True)
    return [mask.nonzero()[:, 0].tolist() for mask in index_masks]


def vispruner_reference(attentions: torch.Tensor, hidden: torch.Tensor, keep: int, ratio: float) -> list[list[int]]:
    """encode_images of VisPruner, batched as the authors wrote it."""
    image_features = hidden[:, 1:]
    features_normalized = image_features / image_features.norm(dim=-1, keepdim=True)
    image_attentions = attentions[:, :, 0, 1:].mean(dim=1)
    batch = image_features.shape[0]
    important_num = int(keep * ratio)
    diverse_num = keep - important_num
    token_indices = torch.sort(image_attentions, dim=-1, descending=True, stable=True).indices
    important_indices = token_indices[:, :important_num]
    residual_indices = token_indices[:, important_num:]
    rows = torch.arange(batch)[:, None]
    while diverse_num > 0:
        residual_tokens = features_normalized[rows, residual_indices]
        r = min(8, residual_tokens.shape[1] - diverse_num)
        if r <= 0:
            break
        a, b = residual_tokens[..., ::2, :], residual_tokens[..., 1::2, :]
        scores = (a @ b.transpose(-1, -2)).max(dim=-1).values
        distinct = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, r:]
        residual_indices = torch.cat([residual_indices[..., ::2][rows, distinct], residual_indices[..., 1::2]], -1)
    if diverse_num == 0:
        residual_indices = residual_indices[:, :0]
    kept = torch.sort(torch.cat([important_indices, residual_indices], -1)).values
    return kept.tolist()


def visionzip_reference(
    attentions: torch.Tensor, hidden: torch.Tensor, keys: torch.Tensor, dominant_num: int, contextual_num: int
) -> tuple[list[list[int]], torch.Tensor]:
    """The authors' CLIPVisionTower forward at ``dominant_num`` (they pass ``dominant − 1``: [CLS] is added), in
    their masked_select / one-hot bmm form. Returns, per image, the patch index (0-based, without [CLS]) each token
    they hand on stands in (dominant patches in raster order, then the contextual tokens' targets) and those
    tokens without [CLS], (B, dominant_num + contextual_num, D), in that order."""
    metric = keys.mean(1)  # raw_key_states.mean(1): (B, 1 + N, hd)
    batch, length, width = hidden.shape
    cls_attention_sum = attentions[:, :, 0, 1:].sum(dim=1)
    topk_indices = stable_topk(cls_attention_sum, dominant_num) + 1
    all_indices = torch.cat([torch.zeros(batch, 1, dtype=torch.long), topk_indices], dim=1)
    mask = torch.ones(batch, length, dtype=torch.bool).scatter_(1, all_indices, False)
    dominant_tokens = hidden.masked_select(~mask[..., None]).view(batch, dominant_num + 1, width)
    metric_filtered = metric[mask].view(batch, length - (dominant_num + 1), metric.shape[2])
    hidden_filtered = hidden.masked_select(mask[..., None]).view(batch, length - (dominant_num + 1), width)
    metric_normalized = metric_filtered / metric_filtered.norm(dim=-1, keepdim=True)
    step = max(1, metric_normalized.shape[1] // contextual_num)
    target_indices = torch.arange(0, metric_normalized.shape[1], step)[:contextual_num]
    target_tokens = metric_normalized[:, target_indices, :]
    others = ~torch.isin(torch.arange(metric_normalized.shape[1]), target_indices)
    similarity = torch.bmm(metric_normalized[:, others, :], target_tokens.transpose(1, 2))
    assign_one_hot = torch.zeros(batch, int(others.sum()), contextual_num, dtype=hidden.dtype)
    assign_one_hot.scatter_(2, similarity.argmax(dim=2)[..., None], 1)
    counts = assign_one_hot.sum(dim=1).clamp(min=1)[..., None]
    aggregated = torch.bmm(assign_one_hot.transpose(1, 2), hidden_filtered[:, others, :]) / counts
    contextual_tokens = hidden_filtered[:, target_indices, :] + aggregated
    tokens = torch.cat([dominant_tokens[:, 1:], contextual_tokens], dim=1)
    slots = []
    for row in range(batch):
        remaining = mask[row].nonzero()[:, 0]  # positions with [CLS] at 0
        dominant_patches = sorted((all_indices[row, 1:] - 1).tolist())  # masked_select keeps raster order
        slots.append(dominant_patches + (remaining[target_indices] - 1).tolist())
    return slots, tokens


def divprune_reference(projected: torch.Tensor, keep: int) -> list[list[int]]:
    """The paper's greedy max-min diversity, as plain loops over Python floats."""
    result = []
    for tokens in projected:
        unit = [t / t.norm() for t in tokens.detach()]
        n = len(unit)
        dist = [[1.0 - float(unit[i] @ unit[j]) for j in range(n)] for i in range(n)]
        first = max(range(n), key=lambda i: (min(dist[i][j] for j in range(n) if j != i), -i))
        chosen = [first]
        while len(chosen) < keep:
            rest = [i for i in range(n) if i not in chosen]
            chosen.append(max(rest, key=lambda i: (min(dist[i][j] for j in chosen), -i)))
        result.append(sorted(chosen))
    return result


def downsample_reference(features: torch.Tensor, rows: int, columns: int, keep: int) -> tuple[list[list[int]], list]:
    """vitrim's documented pooling (vitrim.vlm.method.downsample), as plain loops: every band count r, its cells by
    the floor boundaries, the most even cells, then the most nearly square mean cell, then the fewest bands. Returns
    the cells (raster indices, raster order of their top-left token) and each cell's mean feature."""
    import math

    def cells_of(bands: int) -> list[list[int]]:
        cells = []
        for band in range(bands):
            count = keep // bands + (1 if band < keep % bands else 0)
            band_rows = range(band * rows // bands, (band + 1) * rows // bands)
            for cell in range(count):
                cell_columns = range(cell * columns // count, (cell + 1) * columns // count)
                cells.append([r * columns + c for r in band_rows for c in cell_columns])
        return cells

    candidates = []
    for bands in range(1, min(rows, keep) + 1):
        if keep / bands > columns:
            continue
        sizes = [len(cell) for cell in cells_of(bands)]
        squareness = abs(math.log((rows / bands) / (columns * bands / keep)))
        candidates.append(((max(sizes) - min(sizes), round(squareness, 12), bands), bands))
    cells = cells_of(min(candidates)[1])
    means = [sum(features[i] for i in cell) / len(cell) for cell in cells]
    return cells, means


def cdpruner_reference(
    projected: torch.Tensor, relevance: torch.Tensor, keep: int, theta: float | None = None
) -> list[list[int]]:
    """The authors' encode_images of CDPruner from the kernel on, batched as they wrote it: projected (B, N, D),
    relevance (B, N) already normalised (per image, vitrim's documented departure from their batch-wide min/max);
    the similarity's diagonal set to exactly 1, vitrim's other documented change (theirs is 1 ± rounding)."""
    batch, num_tokens, _ = projected.shape
    image_normalized = projected / projected.norm(dim=-1, keepdim=True)
    similarity = torch.matmul(image_normalized, image_normalized.transpose(1, 2))
    similarity = similarity * (1 - torch.eye(num_tokens)) + torch.eye(num_tokens)  # cos(x, x) = 1 (vitrim's one change)
    if theta is not None:
        relevance = torch.exp(theta / (2 * (1 - theta)) * relevance)
    kernel = relevance.unsqueeze(2) * similarity * relevance.unsqueeze(1)
    cis = torch.zeros((keep, batch, num_tokens), dtype=projected.dtype)
    di2s = torch.diagonal(kernel, dim1=1, dim2=2).clone()
    select_idx = torch.empty((keep, batch), dtype=torch.long)
    rows = torch.arange(batch)
    for i in range(keep):
        j = torch.argmax(di2s, dim=-1)
        select_idx[i] = j
        eis = (kernel[rows, j] - torch.einsum("tb,tbn->bn", cis[:i, rows, j], cis[:i])) / torch.sqrt(
            di2s[rows, j]
        ).unsqueeze(-1)
        cis[i, :, :] = eis
        di2s -= torch.square(eis)
        di2s[rows, j] = -float("inf")
    return torch.sort(select_idx.t()).values.tolist()


def cdpruner_relevance_reference(image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
    """The authors' relevance (B, N) at batch 1 (their min and max run over the whole batch)."""
    image_embeds = image_embeds / image_embeds.norm(dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(dim=-1, keepdim=True)
    relevance = torch.matmul(image_embeds, text_embeds.t())
    relevance = (-relevance).mean(dim=-1)
    return (relevance - relevance.min() + 1e-6) / (relevance.max() - relevance.min())


def scope_reference(features: torch.Tensor, saliency: torch.Tensor, keep: int, alpha: float) -> list[int]:
    """SCOPE from the paper's definitions as plain loops: the set coverage c(S) = Σ_j max(0, max_{i∈S} cos(i, j))
    computed whole for S and S ∪ {i}, the score saliency^α · (c(S ∪ {i}) − c(S)), the largest taken (ties to the
    lower index). Returns the selection in selection order."""
    unit = [f / f.norm() for f in features]
    n = len(unit)
    sim = [[1.0 if i == j else float(unit[i] @ unit[j]) for j in range(n)] for i in range(n)]

    def coverage(chosen: list[int]) -> float:
        return sum(max([0.0] + [sim[i][j] for i in chosen]) for j in range(n))

    chosen: list[int] = []
    for _ in range(keep):
        base = coverage(chosen)
        scores = {
            i: max(float(saliency[i]), 0.0) ** alpha * (coverage([*chosen, i]) - base)
            for i in range(n)
            if i not in chosen
        }
        chosen.append(max(scores, key=lambda i: (scores[i], -i)))
    return chosen


def hiprune_reference(
    object_attentions: torch.Tensor, deep_attentions: torch.Tensor, keep: int, alpha: float, width: int, prefix: int = 1
) -> list[list[int]]:
    """The authors' encode_images of HiPrune (LLaVA): attentions (B, H, prefix + N, prefix + N) of the object layer
    and of the deep layer as transformers returns them; the global attention is their mean over heads and queries,
    [CLS]'s column dropped (``prefix`` 0: a SigLIP tower, every column kept). topk is stable here (ties to the lower
    index)."""
    batch, num_tokens = object_attentions.shape[0], object_attentions.shape[-1] - prefix
    deep_attention = deep_attentions.mean(dim=1).mean(dim=1)[:, prefix:].clone()
    shallow_attention = object_attentions.mean(dim=1).mean(dim=1)[:, prefix:]
    shallow_token_num = round(keep * alpha / 5)
    kept = []
    for i in range(batch):
        shallow = stable_topk(shallow_attention[i].unsqueeze(0), shallow_token_num)
        shallow = torch.cat([shallow, shallow - 1, shallow + 1, shallow - width, shallow + width], dim=1)
        shallow = torch.unique(shallow.clamp(0, num_tokens - 1)).unsqueeze(0)
        deep_token_num = keep - shallow.shape[1]
        available = torch.zeros(1, num_tokens, dtype=torch.bool).scatter_(1, shallow, 1)
        deep_attention[i] -= available.int().squeeze()
        deep = stable_topk(deep_attention[i].unsqueeze(0), deep_token_num)
        kept.append(torch.sort(torch.cat([shallow, deep], dim=1), dim=1)[0][0].tolist())
    return kept
