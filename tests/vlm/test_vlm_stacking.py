"""Methods of two stages on one tiny LLaVA-1.5 (float64): each stage equals itself alone where they do not interact,
the stack equals the masked model written here, generate() runs (greedy, beams) and matches each prompt alone,
``remove`` restores the model bit for bit, and stacks that do not compose are refused with the model left as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from llm_reference import masked_layers, top_k_reference
from pre_llm_reference import divprune_reference

import vitrim.vlm
from tiny_vlms.llava import IMAGE_TOKEN, batch, pixels, prompt, tiny_llava

TOL = 1e-12  # SDPA in float64


@pytest.fixture(scope="module")
def shared() -> torch.nn.Module:
    return tiny_llava(seed=4)


@pytest.fixture
def model(shared: torch.nn.Module):
    yield shared
    if hasattr(shared, "_vitrim_vlm"):
        vitrim.vlm.remove(shared)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    prompts = [prompt(2, 3, seed=seed), prompt(5, 1, seed=seed + 1), prompt(1, 4, seed=seed + 2)]
    input_ids, attention_mask = batch(prompts, "left")
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixels(3, seed=seed)}


def _alone(inputs: dict[str, torch.Tensor], row: int) -> dict[str, torch.Tensor]:
    real = inputs["attention_mask"][row].bool()
    return {
        "input_ids": inputs["input_ids"][row, real][None],
        "attention_mask": inputs["attention_mask"][row, real][None],
        "pixel_values": inputs["pixel_values"][row : row + 1],
    }


def _kept_columns(input_ids: torch.Tensor, selection: list[torch.Tensor]) -> torch.Tensor:
    """(B, L) bool: text columns and the kept image tokens (one image per sample), written from the ids alone."""
    keep = input_ids != IMAGE_TOKEN
    for sample, kept in enumerate(selection):
        columns = (input_ids[sample] == IMAGE_TOKEN).nonzero().flatten()
        keep[sample, columns[kept]] = True
    return keep


def _llm_input(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What the unmodified model hands its LLM (inputs_embeds, position_ids) for ``inputs``."""
    seen: dict[str, Any] = {}
    handle = model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(kwargs) if not seen else None, with_kwargs=True
    )
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    return seen


def _fastv_reference(model, ids, embeds, positions, mask, visible, keep: int) -> list[list[int]]:
    """FastV's choice at layer 1, by hand: the last real token's softmax attention at layer 0 (q, k from the
    layer's own projections and rotary at the original positions) over the keys it may see (``visible`` (B, L):
    causal, not padding, not dropped before the LLM), head-averaged, top ``keep`` of each sample's image tokens."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = model.model.language_model
    layer = lm.layers[0]
    attention = layer.self_attn
    batch_size, length, _ = embeds.shape
    positions = torch.arange(length)[None].expand(batch_size, -1) if positions is None else positions
    x = layer.input_layernorm(embeds)
    heads, kv_heads, head_dim = 4, 2, attention.head_dim
    q = attention.q_proj(x).view(batch_size, length, heads, head_dim).transpose(1, 2)
    k = attention.k_proj(x).view(batch_size, length, kv_heads, head_dim).transpose(1, 2)
    cos, sin = lm.rotary_emb(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    chosen = []
    for sample in range(batch_size):
        last = int(mask[sample].nonzero().max())
        logits = (q[sample, :, last, None] @ k[sample].transpose(-1, -2))[:, 0] * attention.scaling  # (H, L)
        allowed = visible[sample] & (torch.arange(length) <= last)
        weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).mean(0)  # (L,)
        image = (visible[sample] & (ids[sample] == IMAGE_TOKEN)).nonzero().flatten()  # the image columns left
        chosen.append(top_k_reference(weights[image], keep))  # indices among them, column (= raster) order
    return chosen


def test_pre_llm_then_in_llm_is_the_in_llm_drop_on_the_shortened_sequence(model: torch.nn.Module) -> None:
    """Against the masked model: the pre-LLM method keeps each token at its own position (positions='original')."""
    inputs = _inputs()
    vitrim.vlm.apply(model, "random", keep=8, seed=5, positions="original")
    alone = model(**inputs).logits
    pre_alone = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)

    vitrim.vlm.apply(model, "fastv", layer=1, keep=4)  # applied first: the stack runs pre-LLM first anyway
    vitrim.vlm.apply(model, "random", keep=8, seed=5, positions="original")
    out = model(**inputs).logits
    pre = vitrim.vlm.last_selection(model, stage="pre_llm")
    final = vitrim.vlm.last_selection(model)
    assert torch.equal(vitrim.vlm.last_selection(model, stage="in_llm")[0], final[0])
    vitrim.vlm.remove(model)

    assert [k.tolist() for k in pre] == [k.tolist() for k in pre_alone]  # the pre-LLM stage as alone
    assert all(len(k) == 4 and set(k.tolist()) <= set(p.tolist()) for k, p in zip(final, pre, strict=True))
    assert out.shape[1] == alone.shape[1]  # the LLM ran on the shortened sequence

    llm = _llm_input(model, inputs)
    mask = inputs["attention_mask"]
    entered = _kept_columns(inputs["input_ids"], pre)
    expected = _fastv_reference(
        model, inputs["input_ids"], llm["inputs_embeds"], llm.get("position_ids"), mask, entered & mask.bool(), 4
    )
    positions_in_image = [p.tolist() for p in pre]
    assert [sorted(positions_in_image[b][i] for i in best) for b, best in enumerate(expected)] == [
        k.tolist() for k in final
    ]

    through = _kept_columns(inputs["input_ids"], final)
    lm = model.model.language_model
    hidden = masked_layers(lm, llm["inputs_embeds"], mask, llm.get("position_ids"), {0: entered, 1: through})
    reference = model.lm_head(hidden)
    for sample in range(3):
        columns = (entered & mask.bool())[sample]
        short = out[sample, -int(columns.sum()) :]  # left padding: the shortened row is right-aligned
        last_layer = through[sample, columns]  # the in-LLM drop's early exits are not the masked model's
        assert (short[last_layer] - reference[sample, columns][last_layer]).abs().max() <= TOL


@pytest.mark.parametrize(
    "options", [{}, pytest.param({"num_beams": 2}, marks=pytest.mark.full)], ids=["greedy", "beams"]
)
def test_pre_llm_then_in_llm_generates_each_prompt_as_alone(model: torch.nn.Module, options: dict) -> None:
    inputs = _inputs(seed=3)
    vitrim.vlm.apply(model, "divprune", keep=6)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=0.5)
    if True:
        together = model.generate(**inputs, max_new_tokens=3, do_sample=False, **options)
        selection = vitrim.vlm.last_selection(model)
        assert [len(k) for k in selection] == [3] * 3  # half of the 6 that reached the LLM
        for row in range(3):
            single = model.generate(**_alone(inputs, row), max_new_tokens=3, do_sample=False, **options)
            assert torch.equal(together[row, -3:], single[0, -3:])
            assert torch.equal(vitrim.vlm.last_selection(model)[0], selection[row])


def test_tower_then_pre_llm_is_the_pre_llm_method_on_the_reduced_tower(model: torch.nn.Module) -> None:
    inputs = _inputs(seed=1)
    projector_input: list[torch.Tensor] = []
    vitrim.vlm.apply(model, "topk", keep=10)  # the tower alone: its tokens in their slots, the rest dropped
    handle = model.model.multi_modal_projector.register_forward_pre_hook(  # after the tower's: it sees the slots
        lambda module, args: projector_input.append(args[0])
    )
    model(**inputs)
    handle.remove()
    tower_alone = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)

    vitrim.vlm.apply(model, "divprune", keep=5)
    vitrim.vlm.apply(model, "topk", keep=10)
    out = model(**inputs).logits
    tower = vitrim.vlm.last_selection(model, stage="tower")
    final = vitrim.vlm.last_selection(model)
    groups = vitrim.vlm.last_selection(model, groups=True)
    vitrim.vlm.remove(model)

    assert [k.tolist() for k in tower] == [k.tolist() for k in tower_alone]  # the tower as alone
    with torch.no_grad():  # DivPrune by hand on the projected tokens of the tower's 10 slots
        projected = model.model.multi_modal_projector(projector_input[0])  # (3, 16, E)
    rows = torch.stack(tower)
    chosen = divprune_reference(projected.gather(1, rows[..., None].expand(-1, -1, projected.shape[-1])), 5)
    assert [k.tolist() for k in final] == [[int(t[i]) for i in c] for t, c in zip(tower, chosen, strict=True)]
    assert [[g.tolist() for g in image] for image in groups] == [[[int(k)] for k in image] for image in final]

    # the reference: the tower alone, fed a mask that hides the tower tokens DivPrune dropped
    real = inputs["attention_mask"].bool()
    by_tower, by_both = _kept_columns(inputs["input_ids"], tower), _kept_columns(inputs["input_ids"], final)
    vitrim.vlm.apply(model, "topk", keep=10)
    masked = model(**{**inputs, "attention_mask": (real & (by_both | ~by_tower)).long()}).logits
    vitrim.vlm.remove(model)
    for sample in range(3):  # one image per prompt: every row keeps as many columns, no re-padding
        reference = masked[sample][(real & by_both)[sample][by_tower[sample]]]
        assert (out[sample][real[sample][by_both[sample]]] - reference).abs().max() <= TOL


def test_tower_then_in_llm_drops_among_the_tower_tokens(model: torch.nn.Module) -> None:
    inputs = _inputs(seed=2)
    vitrim.vlm.apply(model, "topk", keep=10)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=3)
    model(**inputs)
    tower = vitrim.vlm.last_selection(model, stage="tower")
    final = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    assert all(len(k) == 3 and set(k.tolist()) <= set(t.tolist()) for k, t in zip(final, tower, strict=True))


def test_remove_restores_the_model_bit_for_bit(model: torch.nn.Module) -> None:
    inputs = _inputs(seed=6)
    plain = model(**inputs).logits
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    vitrim.vlm.apply(model, "topk", keep=12)
    vitrim.vlm.apply(model, "random", keep=6)
    vitrim.vlm.apply(model, "pdrop", layers=(1,), ratios=(0.5,))
    assert not torch.equal(model(**inputs).logits[:, -1], plain[:, -1])
    vitrim.vlm.remove(model)
    assert not hasattr(model, "_vitrim_vlm")
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert not any(getattr(hook, "__module__", "").startswith("vitrim") for hook in hooks)
    assert not any("forward" in layer.__dict__ for layer in model.model.vision_tower.encoder.layers)
    assert torch.equal(model(**inputs).logits, plain)
    assert torch.equal(model.generate(**inputs, max_new_tokens=3, do_sample=False), generated)


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (("random", {"keep": 8}), ("divprune", {"keep": 4}), "one method per stage"),
        (("fastv", {"layer": 1}), ("pdrop", {"layers": (1,), "ratios": (0.5,)}), "one method per stage"),
        (("tome", {"r": 2}), ("visionzip", {"keep": 6, "dominant": 4, "contextual": 2}), "tower's scoring layer"),
        (("topk", {"keep": 10}), ("downsample", {"keep": 4}), "no longer one"),
        (("topk", {"keep": 10}), ("cdpruner", {"keep": 4}), "to_grid=True"),
        (("topk", {"keep": 10}), ("random", {"keep": 11}), "after tower method 'topk', 10 per image"),
        (("random", {"keep": 8}), ("fastv", {"keep": 9}), "after pre-LLM method 'random', 8 per image"),
        (("topk", {"keep": 10}), ("random", {"keep": 4, "positions": "authors"}), "keeps each token at its own"),
    ],
)
def test_stacks_that_do_not_compose_are_refused_and_leave_the_model_as_it_was(
    model: torch.nn.Module, first: tuple[str, dict], second: tuple[str, dict], message: str
) -> None:
    inputs = _inputs(seed=7)
    vitrim.vlm.apply(model, first[0], **first[1])
    before = model(**inputs).logits
    selection = vitrim.vlm.last_selection(model)
    with pytest.raises(ValueError, match=message):
        vitrim.vlm.apply(model, second[0], **second[1])
    assert torch.equal(model(**inputs).logits, before)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [k.tolist() for k in selection]
    with pytest.raises(ValueError, match="stage='in_llm'" if first[0] != "fastv" else "stage='tower'"):
        vitrim.vlm.last_selection(model, stage="in_llm" if first[0] != "fastv" else "tower")


def test_gemma3_refuses_an_in_llm_method_after_a_shortened_input() -> None:
    from tiny_vlms.gemma3 import tiny_gemma3

    gemma = tiny_gemma3()
    vitrim.vlm.apply(gemma, "random", keep=2)
    with pytest.raises(ValueError, match="masks built per layer type"):
        vitrim.vlm.apply(gemma, "fastv", layer=1)
    vitrim.vlm.remove(gemma)
    assert not hasattr(gemma, "_vitrim_vlm")


def test_qwen2_5_vl_pre_llm_then_in_llm_each_prompt_as_alone() -> None:
    """Qwen's images differ in size (M-RoPE positions, no fixed count): the stack runs in a padded batch of three
    prompts, each generating as alone, its pre-LLM stage as alone and its in-LLM drop among what entered."""
    from tiny_vlms.qwen import batch as qwen_batch
    from tiny_vlms.qwen import qwen2_5_vl

    qwen = qwen2_5_vl(seed=1)
    prompts = [([[1, 5, 6], [7, 8, 9]], [(4, 6)]), ([[1, 5], [7, 8, 9, 10]], [(6, 4)]), ([[1], [7]], [(4, 4)])]
    together = qwen_batch(prompts, seed=2)
    alone = [qwen_batch([p], seed=2) for p in prompts]
    for row, inputs in enumerate(alone):  # each image's own pixels, as in the batch
        inputs["pixel_values"] = together["pixel_values"][sum(h * w for _, g in prompts[:row] for h, w in g) :][
            : sum(h * w for h, w in prompts[row][1])
        ]
    vitrim.vlm.apply(qwen, "random", keep=0.5, seed=1)
    qwen(**together)
    pre_alone = vitrim.vlm.last_selection(qwen)
    vitrim.vlm.apply(qwen, "fastv", layer=1, keep=2)
    generated = qwen.generate(**together, max_new_tokens=3, do_sample=False)
    pre = vitrim.vlm.last_selection(qwen, stage="pre_llm")
    final = vitrim.vlm.last_selection(qwen)
    assert [k.tolist() for k in pre] == [k.tolist() for k in pre_alone]
    assert all(len(k) == 2 and set(k.tolist()) <= set(p.tolist()) for k, p in zip(final, pre, strict=True))
    for row, inputs in enumerate(alone):
        single = qwen.generate(**inputs, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated[row, -3:], single[0, -3:])
        assert torch.equal(vitrim.vlm.last_selection(qwen)[0], final[row])
    vitrim.vlm.remove(qwen)


@pytest.mark.full  # ~10 s: three forwards of the tiny Gemma 3
def test_gemma3_tower_then_pre_llm_or_in_llm_is_that_method_on_the_tower_reduced_by_hand() -> None:
    """Gemma 3's tower puts its tokens back on the patch grid (every pooled image token still enters): the stack is
    the pre-LLM (or in-LLM) method alone on the unmodified model whose projector is handed the tower's refilled
    grid, captured from the tower alone and fed by a hook written here; DivPrune's choice is the reference's on that
    projection."""
    from tiny_vlms.gemma3 import batch as gemma_batch
    from tiny_vlms.gemma3 import pixels as gemma_pixels
    from tiny_vlms.gemma3 import prompt as gemma_prompt
    from tiny_vlms.gemma3 import tiny_gemma3, token_types

    gemma = tiny_gemma3(seed=2)  # 8×8 patches pooled 2×2 to 16 image tokens
    ids, mask = gemma_batch([gemma_prompt(2, 3, seed=1), gemma_prompt(4, 1, seed=2)], "left")
    inputs = {"input_ids": ids, "attention_mask": mask, "token_type_ids": token_types(ids)}
    inputs["pixel_values"] = gemma_pixels(2, seed=3)
    grids: list[torch.Tensor] = []
    vitrim.vlm.apply(gemma, "tome", r=8)
    handle = gemma.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: grids.append(args[0]))
    gemma(
        **inputs
    )  # the tower alone: its 48 tokens back on the 64 patches (merged ones on each of theirs), what the projector pools
    handle.remove()
    vitrim.vlm.remove(gemma)

    vitrim.vlm.apply(gemma, "divprune", keep=5)
    vitrim.vlm.apply(gemma, "tome", r=8)
    stacked = gemma(**inputs).logits
    tower = vitrim.vlm.last_selection(gemma, stage="tower")
    kept = vitrim.vlm.last_selection(gemma)
    vitrim.vlm.remove(gemma)
    assert [len(t) for t in tower] == [48, 48] and [len(k) for k in kept] == [5, 5]

    by_hand = gemma.model.multi_modal_projector.register_forward_pre_hook(lambda m, args: (grids[0], *args[1:]))
    with torch.no_grad():
        projected = gemma.model.multi_modal_projector(torch.zeros_like(grids[0]))  # the hook feeds the grid
    assert [k.tolist() for k in kept] == divprune_reference(projected, 5)
    vitrim.vlm.apply(gemma, "divprune", keep=5)
    reference = gemma(**inputs).logits
    assert [k.tolist() for k in vitrim.vlm.last_selection(gemma)] == [k.tolist() for k in kept]
    vitrim.vlm.remove(gemma)
    vitrim.vlm.apply(gemma, "fastv", layer=1, keep=6)  # the in-LLM method alone on the grid fed by hand
    inside_reference = gemma(**inputs).logits
    inside_kept = vitrim.vlm.last_selection(gemma)
    vitrim.vlm.remove(gemma)
    by_hand.remove()
    assert torch.equal(stacked, reference)

    vitrim.vlm.apply(gemma, "fastv", layer=1, keep=6)  # tower + in-LLM: every pooled token enters, FastV drops
    vitrim.vlm.apply(gemma, "tome", r=8)
    inside = gemma(**inputs).logits
    assert [k.tolist() for k in vitrim.vlm.last_selection(gemma)] == [k.tolist() for k in inside_kept]
    vitrim.vlm.remove(gemma)
    assert torch.equal(inside, inside_reference)


def test_llava_next_pre_llm_then_in_llm_drops_among_what_entered() -> None:
    """LLaVA-NeXT (anyres tiles, newline tokens): the pre-LLM stage as alone (``keep`` per tile), the in-LLM drop
    keeping half of the packed tokens that entered, among them."""
    from tiny_vlms.llava_next import inputs as next_inputs
    from tiny_vlms.llava_next import tiny_llava_next

    model = tiny_llava_next()
    inputs = next_inputs()
    vitrim.vlm.apply(model, "fastervlm", keep=4)
    model(**inputs)
    pre_alone = vitrim.vlm.last_selection(model)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=0.5)
    model.generate(**inputs, max_new_tokens=2, do_sample=False)
    pre = vitrim.vlm.last_selection(model, stage="pre_llm")
    final = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    assert [k.tolist() for k in pre] == [k.tolist() for k in pre_alone]
    assert [len(k) for k in final] == [len(p) // 2 for p in pre]
    assert all(set(k.tolist()) <= set(p.tolist()) for k, p in zip(final, pre, strict=True))


@pytest.mark.full  # ~10 s: the 8B layout's tower and DeepStack
def test_qwen3_vl_deepstack_pre_llm_then_in_llm_each_prompt_as_alone() -> None:
    """Qwen3-VL laid out as the 8B (DeepStack rows added after the LLM's first layers): its rows follow the tokens
    the pre-LLM stage lets in, then those the in-LLM drop keeps; each prompt of the batch generates as alone."""
    from tiny_vlms.qwen import batch as qwen_batch
    from tiny_vlms.qwen import qwen3_vl_8b_layout

    qwen = qwen3_vl_8b_layout(seed=1)
    prompts = [([[1, 5, 6], [7, 8, 9]], [(4, 6)]), ([[1, 5], [7, 8, 9, 10]], [(6, 4)])]
    vitrim.vlm.apply(qwen, "random", keep=4)
    vitrim.vlm.apply(qwen, "fastv", layer=1, keep=2)
    together = qwen.generate(**qwen_batch(prompts, seed=2, temporal=2), max_new_tokens=3, do_sample=False)
    final = vitrim.vlm.last_selection(qwen)
    alone = qwen.generate(**qwen_batch(prompts[:1], seed=2, temporal=2), max_new_tokens=3, do_sample=False)
    assert torch.equal(together[0, -3:], alone[0, -3:])
    assert torch.equal(vitrim.vlm.last_selection(qwen)[0], final[0]) and [len(k) for k in final] == [2, 2]
    vitrim.vlm.remove(qwen)


@pytest.mark.parametrize("through_keep", [3, 5])
def test_visionzip_s_cls_goes_through_a_stacked_in_llm_method_as_text_does(
    model: torch.nn.Module, through_keep: int
) -> None:
    """VisionZip hands the LLM its [CLS] (authors' layout) in a dropped patch's slot: FastV after it ranks and drops
    among the image tokens only (keep 5 of 5: none), the [CLS] stays, and last_selection names no patch for it."""
    inputs = _inputs(seed=3)
    vitrim.vlm.apply(model, "visionzip", keep=6, contextual=2)
    vitrim.vlm.apply(model, "fastv", layer=1, keep=through_keep)
    out = model(**inputs).logits
    entered = vitrim.vlm.last_selection(model, stage="pre_llm", groups=True)
    through = vitrim.vlm.last_selection(model, groups=True)
    kept_entered = vitrim.vlm.last_selection(model, stage="pre_llm")
    kept_through = vitrim.vlm.last_selection(model)
    assert torch.isfinite(out).all()
    for image in range(3):
        assert entered[image][0].numel() == 0 and through[image][0].numel() == 0  # the [CLS], first, no patch
        assert len(entered[image]) == 6 and len(through[image]) == 1 + through_keep  # [CLS] + 5 entered
        assert set(kept_through[image].tolist()) <= set(kept_entered[image].tolist())
        by_token = {int(g.min()): g.tolist() for g in entered[image][1:]}
        assert [g.tolist() for g in through[image][1:]] == [by_token[int(g.min())] for g in through[image][1:]]
