"""The tower stage on the layouts of the real checkpoints where they differ from the tiny test configs.

Checked (config of each real checkpoint against the tiny one):
- LLaVA-1.5 (llava-hf/llava-1.5-7b-hf): CLIP ViT-L/14 at 336 px, ``vision_feature_layer`` −2, strategy "default",
  [CLS] dropped: the tiny LLaVA has the same layout (feature layer −2 of a deeper tower, [CLS] dropped); only depth
  and sizes differ, which the stage reads from the instance.
- PaliGemma (google/paligemma-3b-pt-224): SigLIP at 224 px / 14, every patch an image token, the last layer: the
  tiny PaliGemma has the same layout.
- Gemma 3 (google/gemma-3-4b-it): SigLIP at 896 px / 14 = 64×64 patches, average-pooled 4×4 by the projector to
  16×16 = 256 image tokens. The tiny Gemma 3 pools 2×2 (8×8 patches to 4×4); the real 4×4 pooling is this file's
  case: 32-px images of 2-px patches, 16×16 patches pooled 4×4 to the same 16 tokens.

The reference: the unmodified model whose projector is fed the reducer's tokens put back on the patch grid by hand
(``tower_reference``: ToMe from vitrim's own ViT of the tower's weights, EViT re-implemented on transformers' layers).
"""

from __future__ import annotations

import pytest
import torch
from tower_reference import fed_the_grid, on_grid, received_ranking, vitrim_tome

import vitrim.vlm
from tiny_vlms.gemma3 import batch, pixels, prompt, tiny_gemma3, token_types

SIZE = 32  # px: 16×16 patches of 2 px, pooled 4×4 to 16 image tokens
OPTIONS = {"tome": {"r": 24}, "evit": {"keep_rate": 0.5}}


@pytest.mark.parametrize("name", ["tome", pytest.param("evit", marks=pytest.mark.full)])
def test_gemma3_with_the_real_checkpoints_pooling_equals_the_unmodified_model_fed_the_grid(name: str) -> None:
    model = tiny_gemma3(image_size=SIZE)
    with torch.no_grad():  # from_transformers builds float32: weights that float32 holds exactly, so both are equal
        for param in model.model.vision_tower.parameters():
            param.copy_(param.float().double())
    ids, mask = batch([prompt(3, 4, seed=0), prompt(6, 1, seed=1)], "left")
    inputs = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels(2, size=SIZE)}
    inputs["token_type_ids"] = token_types(ids)
    tower = model.model.vision_tower
    assert tower.config.image_size // tower.config.patch_size == 4 * int(model.config.mm_tokens_per_image**0.5)
    with torch.no_grad():
        if name == "tome":
            tokens, _, patch_to_token = vitrim_tome(tower, inputs["pixel_values"], r=OPTIONS[name]["r"])
        else:
            tokens, _, patch_to_token = received_ranking(tower, inputs["pixel_values"], keep_rate=0.5, fuse=True)
    reference, unmodified = fed_the_grid(model, inputs, on_grid(tower, tokens, patch_to_token))
    with torch.no_grad():
        vitrim.vlm.apply(model, name, **OPTIONS[name])
        logits = model(**inputs).logits
        kept = vitrim.vlm.last_selection(model)
        vitrim.vlm.remove(model)
    assert all(int(k.max()) < (SIZE // 2) ** 2 for k in kept)  # patches of the 16×16 grid
    assert (logits - unmodified).abs().max() > 1e-3  # the reduction reaches the logits
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-12)
