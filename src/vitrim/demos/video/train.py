"""Training the digits video model from scratch, in two stages as the digits LLaVA's (:mod:`vitrim.demos.vlm.train`).

Stage 1 (``tower_steps``) stands in for Qwen2-VL's vision pre-training, which cannot be downloaded here: the tower
alone (patch embedding, blocks and merger) learns to label every merged token it hands the LLM with the digit whose
2×2 box covers it, or background, through a linear head thrown away afterwards. Dense labels (64 per clip) teach
the digits far faster than answers do (the digits LLaVA's record: trained on answers alone "which" stayed at
chance). Training glyphs are distorted (``tower_augment``), anew at every temporal patch.

Stage 2 (``steps``): the decoder on conversations, the tower frozen (as LLaVA-1.5 keeps CLIP frozen; here the
merger, which stage 1 trained, too). One sample is a clip and all three questions about it in a random order,
``<bos> <vision_start> <video>×64 <vision_end> Q1 A1 <eos> Q2 A2 <eos> Q3 A3 <eos>``, the loss on the answers and
their ``<eos>`` only; positions are the model's own M-RoPE (it numbers the video tokens by temporal patch, row and
column), so the decoder sees when each token was. AdamW with linear warm-up and cosine decay
(:func:`vitrim.demos.vlm.train.lr_at`); clips are redrawn every epoch from the training glyphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vitrim.demos.video.data import BACKGROUND, DigitClips
from vitrim.demos.video.words import EOS_ID, encode_words, labelled_batch, prompt_ids, video_patches
from vitrim.demos.vlm.train import TrainPlan, lr_at, train_on_conversations


def conversation_batch(clips: DigitClips, indices: list[int], order_seed: int) -> dict[str, Tensor]:
    """The training batch of clips ``indices``: the model's inputs plus ``labels`` (-100 except on answer words and
    their ``<eos>``), every clip's three questions asked in an order drawn from ``order_seed``."""
    rng = np.random.default_rng([order_seed, 0xC0])
    sequences, labels, frames = [], [], []
    for index in indices:
        clip = clips.clip(index)
        questions = clips.questions(index, clip)
        ids: list[int] = []
        lab: list[int] = []
        for turn, k in enumerate(rng.permutation(len(questions))):
            q = questions[int(k)]
            asked = prompt_ids(q.words) if turn == 0 else encode_words(q.words)
            answer = [*encode_words(q.answer), EOS_ID]
            ids, lab = ids + asked + answer, lab + [-100] * len(asked) + answer
        sequences.append(ids)
        labels.append(lab)
        frames.append(clip.frames)
    return labelled_batch(sequences, labels, np.stack(frames))


def pretrain_tower(
    model: torch.nn.Module, plan: TrainPlan, *, seed: int = 0, log: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Stage 1 (module doc): ``plan.tower_steps`` steps of per-token digit labels on the tower alone; returns the
    accuracy on digit tokens over the last 20 steps and the seconds it took."""
    tower: Any = model.model.visual  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(tower.merger.mlp[-1].out_features, BACKGROUND + 1)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=generator)
        head.bias.zero_()
    params = [*tower.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=plan.tower_lr, weight_decay=plan.weight_decay)
    clips = DigitClips("train", plan.canvases_per_epoch, seed=seed, stream=1, augment=plan.tower_augment)
    schedule = TrainPlan(steps=plan.tower_steps, lr=plan.tower_lr, warmup_steps=min(50, plan.tower_steps // 4 + 1))
    per_epoch = plan.canvases_per_epoch // plan.tower_batch_size
    tower.train()
    start, right = time.perf_counter(), list[float]()
    for step in range(plan.tower_steps):
        epoch, within = divmod(step, per_epoch)
        clips.set_epoch(epoch)
        first = within * plan.tower_batch_size
        drawn = [clips.clip(i) for i in range(first, first + plan.tower_batch_size)]
        labels = torch.from_numpy(np.concatenate([c.token_digits for c in drawn]))  # (B·64,)
        grid = torch.tensor([[4, 8, 8]] * len(drawn))
        merged = tower(video_patches(np.stack([c.frames for c in drawn])), grid_thw=grid)
        merged = getattr(merged, "pooler_output", merged)  # (B·64, D): the merger's output, the LLM's tokens
        logits = head(merged)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, plan.clip_norm)
        optimizer.step()
        digit = labels != BACKGROUND
        right = [*right[-19:], float((logits.argmax(-1) == labels)[digit].float().mean())]
        if log is not None and ((step + 1) % 50 == 0 or step + 1 == plan.tower_steps):
            log(f"tower step {step + 1}/{plan.tower_steps}  loss {loss.item():.4f}  digit tokens right "
                f"{sum(right) / len(right):.3f}  {time.perf_counter() - start:.0f} s")  # fmt: skip
    tower.eval()
    return {"digit_token_accuracy": sum(right) / max(1, len(right)), "seconds": time.perf_counter() - start}


def train_model(
    model: torch.nn.Module, plan: TrainPlan, *, seed: int = 0, log: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Stage 2 (module doc): train the decoder in place for ``plan.steps`` steps (the digits LLaVA's loop,
    :func:`vitrim.demos.vlm.train.train_on_conversations`, the tower always frozen); returns the last logged loss
    (the mean over 50 steps) and the seconds it took."""
    clips = DigitClips("train", plan.canvases_per_epoch, seed=seed, augment=plan.augment)
    tower: Any = model.model.visual  # type: ignore[union-attr]
    return train_on_conversations(
        model, tower, clips, conversation_batch, plan, freeze=True, seed=seed, log=log, log_every=50
    )
