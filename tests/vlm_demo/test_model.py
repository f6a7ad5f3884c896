"""The digits VLM as transformers' own class: files round trip, the answer-token attention equals eager attention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from vitrim.demos.vlm.attention import last_token_attention
from vitrim.demos.vlm.demo import QUICK
from vitrim.demos.vlm.model import MODEL_FILE, build_model, digits_vlm_config, save_model
from vitrim.demos.vlm.run_folder import load_digits_vlm
from vitrim.demos.vlm.words import IMAGE_ID, processor


def _tiny(seed: int = 0) -> torch.nn.Module:
    return build_model(digits_vlm_config(QUICK.vision, QUICK.text), seed=seed)


def _inputs() -> dict[str, torch.Tensor]:
    pixels = np.random.default_rng(0).random((3, 64, 64)).astype(np.float32)
    return processor(pixels, ["which digit is top left ?", "how many digits ?", "where is the seven ?"])


def test_the_model_is_llava_and_reads_one_token_per_patch() -> None:
    from transformers import LlavaForConditionalGeneration

    model = _tiny()
    assert type(model) is LlavaForConditionalGeneration
    features = model.model.get_image_features(pixel_values=_inputs()["pixel_values"]).pooler_output
    assert len(features) == 3 and all(f.shape[0] == 64 for f in features)
    assert model.config.image_token_id == IMAGE_ID and model.config.vision_feature_layer == -2


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    model = _tiny(seed=3)
    save_model(model, tmp_path)
    loaded = load_digits_vlm(tmp_path)
    inputs = _inputs()
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)
    save_model(model, tmp_path / "half", float16=True)
    halved = load_digits_vlm(tmp_path / "half")
    assert all(p.dtype == torch.float32 for p in halved.parameters())
    for (name, a), b in zip(model.state_dict().items(), halved.state_dict().values()):
        assert torch.equal(a.half().float(), b), name


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no model\.safetensors"):
        load_digits_vlm(tmp_path)
    save_model(_tiny(), tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / MODEL_FILE))
    state.pop(next(iter(state)))
    save_file(state, str(tmp_path / MODEL_FILE))
    with pytest.raises(ValueError, match="does not fit the digits VLM: missing"):
        load_digits_vlm(tmp_path)


@pytest.mark.parametrize("layer", [0, 2])
def test_last_token_attention_equals_eager_attention_weights(layer: int) -> None:
    model = _tiny(seed=1)
    inputs = _inputs()
    ours = last_token_attention(model, inputs, layer)  # SDPA model: computed from q/k
    model.set_attn_implementation("eager")  # the reference: transformers' own attention weights
    with torch.no_grad():
        weights = model(**inputs, output_attentions=True).attentions[layer]  # (B, H, L, L)
    reference = weights[:, :, -1].mean(1)[inputs["input_ids"] == IMAGE_ID].view(3, 64)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 4\)"):
        last_token_attention(model, inputs, 4)
