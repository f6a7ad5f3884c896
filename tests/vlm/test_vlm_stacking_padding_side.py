"""A pre-LLM method stacked under FastV gives each prompt of a batch what it gets alone, padded on either side
(docs/vlm.md promises left or right): the tokens each stage keeps and the last real token's logits.

What broke it (issue 53): after the pre-LLM stage shortened a batch whose samples kept different counts, the LLM
got a 4-D mask, and the in-LLM stage read the real columns from its last row, which sees every real column only
under left padding; under right padding a row's last column is a filler that sees itself only, so FastV ranked the
2-image prompt with its real tokens taken for padding.
"""

from __future__ import annotations

import pytest
import torch

import vitrim.vlm
from tiny_vlms.llava import batch, pixels, prompt, tiny_llava


@pytest.mark.parametrize("side", ["right", "left"])
def test_visionzip_under_fastv_batch_equals_each_prompt_alone(side: str) -> None:
    model = tiny_llava(seed=0, text={"num_hidden_layers": 3})
    vitrim.vlm.apply(model, "visionzip", keep=8, contextual=2)
    vitrim.vlm.apply(model, "fastv", keep=0.5, layer=1)
    prompts = [prompt(2, 3, images=2, seed=0), prompt(5, 1, seed=1), prompt(1, 4, seed=2)]
    images = [2, 1, 1]
    picture = pixels(4)
    input_ids, attention_mask = batch(prompts, side)
    together = model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=picture).logits
    kept = {stage: vitrim.vlm.last_selection(model, stage=stage) for stage in ("pre_llm", "in_llm")}
    first = 0
    for sample, (ids, count) in enumerate(zip(prompts, images, strict=True)):
        alone = model(input_ids=ids[None], pixel_values=picture[first : first + count]).logits[0]
        for stage, together_kept in kept.items():
            alone_kept = vitrim.vlm.last_selection(model, stage=stage)
            assert [k.tolist() for k in together_kept[first : first + count]] == [k.tolist() for k in alone_kept]
        # the shortened sequence keeps the padding side: right-padded, a row's real tokens come first
        last = -1 if side == "left" else alone.shape[0] - 1
        # LLaVA numbers a left-padded row's positions from the padding: rotary tables in float32, ~1e-7 apart
        torch.testing.assert_close(together[sample, last], alone[-1], rtol=0, atol=1e-5)
        first += count
