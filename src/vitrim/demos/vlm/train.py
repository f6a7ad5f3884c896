"""Training the digits VLM from scratch, in LLaVA's order: a vision tower that knows the images first, then the
whole model on conversations.

Stage 1 (``tower_steps``) stands in for CLIP's pre-training, which cannot be downloaded here: the tower alone learns
to label every patch token of its layer −2 output (the features LLaVA hands the LLM) with the digit whose 2×2 box
covers it, or background, and with its quadrant, through linear heads that are thrown away afterwards. Dense labels
(64 per canvas) teach the digits far faster than answers do: trained on answers alone (600 steps of 32
conversations, 589 s) the model answered "which" 9 % right, chance, while "count" reached 92 %. With the digit
labels only (800 tower steps, 94 % of digit patches right) "which" reached 22 % and "where" 41 %: the decoder could
not tell which tokens lie in which quadrant (RoPE gives it the raster distance, not the column); the quadrant labels
put "where" into every token's features, where attention can match it. But that model still named digits that
were not on the canvas (38 of 60 wrong "which" answers): stage 2 at its learning rate had overwritten what the tower
had learned. So stage 2 keeps the tower frozen, as LLaVA-1.5 keeps CLIP frozen. Stage 1 sees every glyph
distorted (``tower_augment``, :func:`~vitrim.demos.vlm.data.distort`): after 500 plain steps its digit head, summed
over a digit's 4 patches, named 99.6 % of training glyphs on new canvases but 95.1 % of never-seen ones; after 1500
distorted steps 100 % and 97.9 % (issue 44).

Stage 2 (``steps``), the projector and the decoder: one training sample is a canvas and a conversation about it,
as LLaVA's own instruction data is multi-turn: ``<bos> <image>×64 Q1 A1 <eos> Q2 A2 <eos> …`` with the loss on the
answers and their ``<eos>`` only. The conversation asks everything the canvas answers
(:meth:`~vitrim.demos.vlm.data.DigitsScenes.drill`), in a random order: "which digit is <q> ?" about all four
quadrants, an empty one answered "none"; "where is the <d> ?" about each digit on it; "how many digits ?"; and
"which digit ?" when it holds one digit (the test asks that too). With one question of each type instead, asked
about occupied quadrants only, the model answered "which" 59–80 % right (800 to 3000 steps) and most of its wrong
answers (70 of 82 in one run) named another digit of the same canvas: naming a digit it saw anywhere was nearly as
good as finding the quadrant, and nothing in the data said otherwise. Asking about every quadrant, empty ones
included, does: at the same 3000 steps "which" reached 97.5 %. (Asking "where" about two absent digits as well,
answered "none", did the opposite: the model answered "none" to nearly every "where".) The later turns cost
little: the 64 image tokens are most of a step. AdamW with linear warm-up and cosine decay; the canvases are
redrawn every epoch from the training digits.

Whether the decoder learns to find a quadrant is decided by seed more than by stage 2's learning rate. At 2e-3 the
loss stalled near 0.17 in 2 of 3 runs at seed 0, at 1e-3 and 5e-4 it fell below 0.07 there ("which" 99 % on
never-seen glyphs), but at seed 2 it stalled at 0.26 (1e-3), 0.21 (5e-4) and 0.26 (2.5e-4), "which" 42.5, 61 and
56 %, nearly every wrong answer "none" or another digit of the canvas, mostly the one *beside* the asked quadrant: the
decoder found the row, which RoPE's positions give, and not the column, which only the features carry. The tower's
features separate left from right at every seed measured, and the freshly built projector passes that on, but stage
2's first 100 steps washed it out of the projector's output at seed 2 (and kept it at seed 0). ``quadrant_weight``
and ``digit_weight`` (:class:`TokenLabels`; 1 each in the recipe) make stage 2 also train a linear head on the
projector's output to name each image token's quadrant and digit, as stage 1's heads did on the tower's: with both,
at 3000 steps, "which" reached 97.0 / 99.0 / 99.5 % at seeds 0 / 1 / 2 (1500 steps left seed 1 at 90.5 %, its loss
still falling; docs/vlm-demo.md, "Across seeds", has every run).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from vitrim.demos.vlm.data import BACKGROUND, CANVAS, PATCH, DigitsScenes
from vitrim.demos.vlm.words import EOS_ID, encode_words, labelled_batch, pixel_values, prompt_ids
from vitrim.seeds import epoch_seed

GRID = CANVAS // PATCH
# the quadrant (0 … 3, raster order) of each patch token (raster order)
QUADRANT_OF = torch.tensor([(i // GRID // (GRID // 2)) * 2 + (i % GRID) // (GRID // 2) for i in range(GRID * GRID)])


@dataclass(frozen=True)
class TrainPlan:
    """Steps and optimiser of one training run (the recipe's values are in :mod:`vitrim.demos.vlm.demo`)."""

    steps: int
    batch_size: int = 32
    lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.05
    canvases_per_epoch: int = 4096
    clip_norm: float = 1.0
    tower_steps: int = 0  # stage 1 (module doc)
    tower_batch_size: int = 64
    tower_lr: float = 3e-3
    freeze_tower: bool = True  # stage 2 trains the projector and the decoder only, as LLaVA-1.5 keeps CLIP frozen
    tower_augment: bool = False  # stage 1 sees distorted training glyphs (data.distort; module doc)
    augment: bool = False  # stage 2 too
    quadrant_weight: float = 0.0  # stage 2: weight of each image token's quadrant label (TokenLabels; module doc)
    digit_weight: float = 0.0  # stage 2: weight of each image token's digit label (TokenLabels)


def conversation_batch(scenes: DigitsScenes, indices: list[int], order_seed: int) -> dict[str, Tensor]:
    """The training batch of canvases ``indices``: inputs of ``LlavaForConditionalGeneration`` plus ``labels``
    (-100 except on answer words and their ``<eos>``) and the ``position_ids`` that ``generate()`` would use."""
    rng = np.random.default_rng([order_seed, 0xC0])
    sequences, labels, pixels = [], [], []
    for index in indices:
        canvas = scenes.canvas(index)
        # every question the canvas answers, and "which digit ?" where questions() asks it so (one digit, half the time)
        questions = [q for q in scenes.questions(index, canvas) if len(q.words) == 3] + scenes.drill(index, canvas)
        order = rng.permutation(len(questions))
        first = questions[order[0]]
        ids = prompt_ids(first.words)
        lab = [-100] * len(ids)
        for turn, k in enumerate(order):
            q = questions[k]
            if turn > 0:
                asked = encode_words(q.words)
                ids, lab = ids + asked, lab + [-100] * len(asked)
            answer = [*encode_words(q.answer), EOS_ID]
            ids, lab = ids + answer, lab + answer
        sequences.append(ids)
        labels.append(lab)
        pixels.append(canvas.pixels)
    return labelled_batch(sequences, labels, np.stack(pixels))


def lr_at(step: int, plan: TrainPlan) -> float:
    """Linear warm-up to ``plan.lr``, then cosine decay to 0 at ``plan.steps``."""
    if step < plan.warmup_steps:
        return plan.lr * (step + 1) / plan.warmup_steps
    progress = (step - plan.warmup_steps) / max(1, plan.steps - plan.warmup_steps)
    return plan.lr * 0.5 * (1 + math.cos(math.pi * progress))


def pretrain_tower(
    model: torch.nn.Module, plan: TrainPlan, *, seed: int = 0, log: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Stage 1 (module doc): ``plan.tower_steps`` steps of per-patch digit labels on the tower alone; returns the
    patch accuracy of the last 20 steps and the seconds it took."""
    tower: Any = model.model.vision_tower  # type: ignore[union-attr]
    layer: int = model.config.vision_feature_layer  # type: ignore[union-attr, assignment]
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(tower.config.hidden_size, BACKGROUND + 1 + 4)  # digit or background; quadrant
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=generator)
        head.bias.zero_()
    params = [*tower.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=plan.tower_lr, weight_decay=plan.weight_decay)
    # stage 2's split, other canvases
    scenes = DigitsScenes("train", plan.canvases_per_epoch, seed=seed, stream=1, augment=plan.tower_augment)
    schedule = TrainPlan(steps=plan.tower_steps, lr=plan.tower_lr, warmup_steps=min(50, plan.tower_steps // 4 + 1))
    per_epoch = plan.canvases_per_epoch // plan.tower_batch_size
    tower.train()
    start, right = time.perf_counter(), list[float]()
    for step in range(plan.tower_steps):
        epoch, within = divmod(step, per_epoch)
        scenes.set_epoch(epoch)
        first = within * plan.tower_batch_size
        canvases = [scenes.canvas(i) for i in range(first, first + plan.tower_batch_size)]
        labels = torch.from_numpy(np.stack([c.patch_digits for c in canvases]))  # (B, 64)
        hidden = tower(pixel_values(np.stack([c.pixels for c in canvases])), output_hidden_states=True)
        both = head(hidden.hidden_states[layer][:, 1:])  # (B, 64, 15): the patch tokens LLaVA reads
        logits, where = both[..., : BACKGROUND + 1], both[..., BACKGROUND + 1 :]  # (B, 64, 11), (B, 64, 4)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = loss + torch.nn.functional.cross_entropy(where.flatten(0, 1), QUADRANT_OF.repeat(len(canvases)))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, plan.clip_norm)
        optimizer.step()
        digit = labels != BACKGROUND
        right = [*right[-19:], float((logits.argmax(-1) == labels)[digit].float().mean())]
        if log is not None and ((step + 1) % 100 == 0 or step + 1 == plan.tower_steps):
            log(f"tower step {step + 1}/{plan.tower_steps}  loss {loss.item():.4f}  digit patches right "
                f"{sum(right) / len(right):.3f}  {time.perf_counter() - start:.0f} s")  # fmt: skip
    tower.eval()
    return {"digit_patch_accuracy": sum(right) / max(1, len(right)), "seconds": time.perf_counter() - start}


def train_model(
    model: torch.nn.Module,
    plan: TrainPlan,
    *,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
) -> dict[str, float]:
    """Train ``model`` in place for ``plan.steps`` steps; returns the last logged loss and the seconds it took."""
    scenes = DigitsScenes("train", plan.canvases_per_epoch, seed=seed, augment=plan.augment)
    tower: Any = model.model.vision_tower  # type: ignore[union-attr]
    return train_on_conversations(
        model,
        tower,
        scenes,
        conversation_batch,
        plan,
        freeze=plan.freeze_tower,
        seed=seed,
        log=log,
        log_every=log_every,
        patch_digits=lambda indices: torch.from_numpy(np.stack([scenes.canvas(i).patch_digits for i in indices])),
    )


class EpochData(Protocol):
    """Training samples redrawn every epoch (:class:`~vitrim.demos.vlm.data.DigitsScenes`, the video demo's clips)."""

    def set_epoch(self, epoch: int) -> None: ...


def train_on_conversations(
    model: torch.nn.Module,
    tower: torch.nn.Module,
    data: EpochData,
    batch_of: Callable[[Any, list[int], int], dict[str, Tensor]],
    plan: TrainPlan,
    *,
    freeze: bool,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    log_every: int = 100,
    patch_digits: Callable[[list[int]], Tensor] | None = None,
) -> dict[str, float]:
    """Stage 2 of both digits demos (this one's and :mod:`vitrim.demos.video.train`'s): ``plan.steps`` AdamW steps
    on ``batch_of(data, indices, order_seed)`` (the model's inputs with ``labels``), ``tower`` frozen and in eval mode
    when ``freeze``; weight decay on matrices but embeddings, :func:`lr_at`'s schedule, gradients clipped at
    ``plan.clip_norm``; the samples of an epoch in a seeded permutation. Returns the mean loss of the last
    ``log_every`` steps (or fewer: those since the last log) and the seconds it took; leaves ``model`` in eval mode.
    ``plan.quadrant_weight`` / ``digit_weight`` (:class:`TokenLabels`) read ``patch_digits(indices)``: (B, P) the
    digit under each image patch of those samples (the digits LLaVA's canvases give it)."""
    if (plan.quadrant_weight or plan.digit_weight) and patch_digits is None:
        raise ValueError("token labels (quadrant_weight, digit_weight) need patch_digits: this demo's data has none")
    if freeze:
        tower.requires_grad_(False)
    labels = TokenLabels(model, seed) if plan.quadrant_weight or plan.digit_weight else None
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if labels is not None:
        trainable += [(f"token_labels.{n}", p) for n, p in labels.head.named_parameters()]
    decay = [p for n, p in trainable if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in trainable if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": plan.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=plan.lr
    )
    per_epoch = plan.canvases_per_epoch // plan.batch_size
    model.train()
    if freeze:
        tower.eval()
    start, running, seen = time.perf_counter(), 0.0, 0
    loss_value = float("nan")
    permutation = np.arange(plan.canvases_per_epoch)
    for step in range(plan.steps):
        epoch, within = divmod(step, per_epoch)
        if within == 0:
            data.set_epoch(epoch)
            permutation = np.random.default_rng([seed, 0xE7, epoch]).permutation(plan.canvases_per_epoch)
        indices = [int(i) for i in permutation[within * plan.batch_size : (within + 1) * plan.batch_size]]
        # each step orders its conversations from a stream of its own: the step plays the epoch's part of epoch_seed
        batch = batch_of(data, indices, epoch_seed(seed, step))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, plan)
        loss = model(**batch).loss
        if labels is not None and patch_digits is not None:
            where, what = labels.losses(patch_digits(indices))
            loss = loss + plan.quadrant_weight * where + plan.digit_weight * what
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], plan.clip_norm)
        optimizer.step()
        running, seen = running + loss.item(), seen + 1
        if (step + 1) % log_every == 0 or step + 1 == plan.steps:
            loss_value, running, seen = running / seen, 0.0, 0
            if log is not None:
                log(f"step {step + 1}/{plan.steps}  loss {loss_value:.4f}  {time.perf_counter() - start:.0f} s")
    if labels is not None:
        labels.remove()
    model.eval()
    tower.requires_grad_(True)
    return {"loss": loss_value, "seconds": time.perf_counter() - start}


class TokenLabels:
    """Stage 1's labels read back from the projector's output: a linear head (thrown away after stage 2, as stage 1's)
    names each image token's quadrant and the digit covering it (or background), so that stage 2 cannot wash out of
    the tokens the decoder reads what the tower put into them (module doc). Built before training, it hooks the
    projector: each forward's output waits in ``features`` for :meth:`losses`; :meth:`remove` unhooks it."""

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        projector: Any = model.model.multi_modal_projector  # type: ignore[union-attr]
        width: int = model.config.text_config.hidden_size  # type: ignore[union-attr, assignment]
        generator = torch.Generator().manual_seed(seed)
        self.head = torch.nn.Linear(width, 4 + BACKGROUND + 1)  # quadrant; digit or background
        with torch.no_grad():
            self.head.weight.normal_(0.0, 0.02, generator=generator)
            self.head.bias.zero_()
        self.features: list[Tensor] = []
        self.hook = projector.register_forward_hook(lambda _m, _i, out: self.features.append(out))

    def losses(self, digits: Tensor) -> tuple[Tensor, Tensor]:
        """Quadrant and digit cross-entropies of the last forward's image tokens (B, 64, D); digits: (B, 64), each
        patch's label (``Canvas.patch_digits``)."""
        features = self.features.pop()
        self.features.clear()
        logits = self.head(features)  # (B, 64, 15)
        where = torch.nn.functional.cross_entropy(logits[..., :4].flatten(0, 1), QUADRANT_OF.repeat(len(features)))
        what = torch.nn.functional.cross_entropy(logits[..., 4:].flatten(0, 1), digits.flatten())
        return where, what

    def remove(self) -> None:
        self.hook.remove()
        self.features.clear()
