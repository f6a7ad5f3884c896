"""Prompts with videos (and images) for the tiny Qwen models of :mod:`tiny_vlms.qwen`, built by hand in the layout
the Qwen processors write (the tests run offline; the processors need a tokenizer and video decoding).

- Qwen2-VL / Qwen2.5-VL: a video is ``vision_start``, its t·(h/m)·(w/m) ``video`` tokens, ``vision_end``;
- Qwen3-VL: each temporal patch is its timestamp text (here one token, :data:`TIMESTAMP` + its index), then
  ``vision_start``, its (h/m)·(w/m) ``video`` tokens, ``vision_end``.

``pixel_values_videos`` holds every video's patches (t·h·w rows of C·temporal·P² values) in reading order, as
``pixel_values`` holds the images'; ``mm_token_type_ids`` marks image tokens 1, video tokens 2.
"""

from __future__ import annotations

import torch

from tiny_vlms.qwen import CHANNELS, IMAGE, MERGE, PAD, PATCH, VIDEO, VISION_END, VISION_START

TIMESTAMP = 40  # a Qwen3-VL temporal patch's timestamp text, one token per temporal patch here

Item = list[int] | tuple[str, tuple[int, ...]]  # text ids, ("image", (h, w)) or ("video", (t, h, w))


def media_ids(kind: str, size: tuple[int, ...], timestamps: bool) -> list[int]:
    """The ids of one image or video in the prompt (see the module docstring)."""
    if kind == "image":
        h, w = size
        return [VISION_START] + [IMAGE] * ((h // MERGE) * (w // MERGE)) + [VISION_END]
    t, h, w = size
    per_frame = (h // MERGE) * (w // MERGE)
    if timestamps:
        return [i for frame in range(t) for i in [TIMESTAMP + frame, VISION_START, *[VIDEO] * per_frame, VISION_END]]
    return [VISION_START] + [VIDEO] * (t * per_frame) + [VISION_END]


def video_batch(prompts: list[list[Item]], *, qwen3: bool = False, seed: int = 0, temporal: int = 1) -> dict:
    """Processor-like inputs for several prompts of text, images and videos, left-padded. Each image's and video's
    pixels are drawn from ``seed``, its prompt's ids and its place in the prompt, so a prompt gets the same pixels
    alone or in any batch. ``qwen3``: Qwen3-VL's timestamp layout; ``temporal``: the tower's temporal patch."""
    rows, images, videos = [], [], []
    width = CHANNELS * temporal * PATCH * PATCH
    for items in prompts:
        row: list[int] = []
        drawn = []
        for item in items:
            if isinstance(item, tuple):
                row += media_ids(item[0], item[1], qwen3)
                drawn.append(item)
            else:
                row += item
        prompt_seed = hash(tuple(row)) % (1 << 31)
        for place, (kind, size) in enumerate(drawn):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + prompt_seed * 101 + place)
            count = size[0] * size[1] * (size[2] if kind == "video" else 1)
            pixels = torch.randn(count, width, generator=generator, dtype=torch.float64)
            (images if kind == "image" else videos).append((size, pixels))
        rows.append(row)
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), PAD)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, length - len(row) :] = torch.tensor(row)
        mask[b, length - len(row) :] = 1
    inputs = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == VIDEO)}
    if images:
        inputs["pixel_values"] = torch.cat([pixels for _, pixels in images])
        inputs["image_grid_thw"] = torch.tensor([[1, *size] for size, _ in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([pixels for _, pixels in videos])
        inputs["video_grid_thw"] = torch.tensor([list(size) for size, _ in videos])
    return inputs


def media_tokens(inputs: dict) -> list[int]:
    """LLM tokens of each image and video of ``inputs`` in reading order."""
    sizes = {
        "image": iter((inputs["image_grid_thw"].prod(-1) // MERGE**2).tolist() if "image_grid_thw" in inputs else []),
        "video": iter((inputs["video_grid_thw"].prod(-1) // MERGE**2).tolist() if "video_grid_thw" in inputs else []),
    }
    counts = []
    for row in inputs["input_ids"]:
        media = row[(row == IMAGE) | (row == VIDEO)].tolist()
        at = 0
        while at < len(media):
            counts.append(next(sizes["image" if media[at] == IMAGE else "video"]))
            at += counts[-1]
    return counts


def dropped_media(inputs: dict, kept: list[torch.Tensor]) -> torch.Tensor:
    """(B, L) bool: the image and video positions whose raster index is not in ``kept`` (one per item, reading
    order); a video's raster index counts its tokens in prompt order (timestamps between temporal patches skipped)."""
    counts = media_tokens(inputs)
    dropped = torch.zeros_like(inputs["input_ids"], dtype=torch.bool)
    item = 0
    for b, row in enumerate(inputs["input_ids"]):
        where = ((row == IMAGE) | (row == VIDEO)).nonzero().flatten().tolist()
        while where:
            mine, where = where[: counts[item]], where[counts[item] :]
            keep = set(kept[item].tolist())
            for index, column in enumerate(mine):
                dropped[b, column] = index not in keep
            item += 1
    return dropped


def full_positions(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """(3, B, L): the unmodified model's M-RoPE positions (its own ``get_rope_index``, images and videos)."""
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        attention_mask=inputs["attention_mask"],
    )
    return positions


def masked_logits(model: torch.nn.Module, inputs: dict, dropped: torch.Tensor) -> torch.Tensor:
    """(B, L, V) the unmodified model's logits with the ``dropped`` keys masked out, every position at its full
    sequence M-RoPE position."""
    mask = inputs["attention_mask"] * (~dropped).long()
    return model(**{**inputs, "attention_mask": mask, "position_ids": full_positions(model, inputs)}).logits


def masked_decode_logits(model: torch.nn.Module, inputs: dict, dropped: torch.Tensor, next_tokens: torch.Tensor):
    """(B, 1, V): one decode step of ``next_tokens`` (B, 1) after the masked full prefill (left-padded), the new token
    at the position ``generate()`` gives it on the unmodified model: the last column's position + 1. (Not the
    largest position + 1, which ``rope_deltas`` holds: a Qwen2.5-VL video's temporal positions, spaced by
    ``tokens_per_second``, run past the text after it, and transformers 5.24's generate counts on from the text.)"""
    from hf_cache import cache_kw, cache_of  # tests/vlm's helper for the cache's name

    positions = full_positions(model, inputs)
    mask = inputs["attention_mask"] * (~dropped).long()
    prefill = model(**{**inputs, "attention_mask": mask, "position_ids": positions}, use_cache=True)
    step = positions[:, :, -1:] + 1  # (3, B, 1)
    mask = torch.cat([mask, torch.ones_like(next_tokens)], dim=1)
    out = model(input_ids=next_tokens, attention_mask=mask, position_ids=step, **cache_kw(cache_of(prefill)))
    return out.logits


def assert_batch_equals_each_alone(model: torch.nn.Module, prompts: list[list[Item]], *, qwen3: bool) -> None:
    """A trimmed ``model`` on a padded batch of ``prompts`` equals each prompt alone: the same selections (reading
    order), greedy tokens (pad after EOS) and last logits (≤ 1e-10)."""
    import vitrim.vlm

    inputs = video_batch(prompts, qwen3=qwen3)
    with torch.no_grad():
        together = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        kept = vitrim.vlm.last_selection(model)
        logits = model(**inputs).logits[:, -1]
    item = 0
    for b, prompt in enumerate(prompts):
        alone = video_batch([prompt], qwen3=qwen3)
        count = len(media_tokens(alone))
        with torch.no_grad():
            tokens = model.generate(**alone, max_new_tokens=4, do_sample=False)
            alone_logits = model(**alone).logits[:, -1]
        assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [k.tolist() for k in kept[item : item + count]]
        mine, theirs = tokens[0, alone["input_ids"].shape[1] :], together[b, inputs["input_ids"].shape[1] :]
        assert torch.equal(theirs[: len(mine)], mine) and bool((theirs[len(mine) :] == PAD).all())  # after EOS: pad
        torch.testing.assert_close(alone_logits[0], logits[b], rtol=0, atol=1e-10)
        item += count


def deepstack_group_means(
    features: list[torch.Tensor], kept: list[torch.Tensor], groups: list[list[torch.Tensor]], counts: list[int]
) -> list[torch.Tensor]:
    """Qwen3-VL's DeepStack rows of a tower call (each (ΣN, D)) with every kept slot's rows the mean of its group's
    (vitrim's convention for a merged token): ``kept``, ``groups`` per item (``last_selection``'s), ``counts`` each
    item's N, in the tower call's order."""
    rows, start = [f.clone() for f in features], 0
    for item, count in enumerate(counts):
        for slot, group in zip(kept[item].tolist(), groups[item], strict=True):
            for out, source in zip(rows, features, strict=True):
                out[start + slot] = source[start + group].mean(0)
        start += count
    return rows
