"""LLaVA-1.5 with a pre-LLM method: the user's forward and generate() run unchanged, and what reaches the LLM is
exactly the full model with the dropped image keys masked out (original positions), at prefill and in decoding,
alone and in padded batches (left and right), on eager and SDPA attention."""

from __future__ import annotations

import pytest
import torch
from hf_cache import cache_kw, cache_of

import vitrim.vlm
from tiny_vlms.llava import GRID_TOKENS, IMAGE_TOKEN, batch, pixels, prompt, tiny_llava

TOL = 1e-12  # SDPA in float64
EAGER_TOL = 1e-5  # transformers' eager attention takes its softmax in float32


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {"sdpa": tiny_llava(attn="sdpa"), "eager": tiny_llava(attn="eager")}


@pytest.fixture
def model(models: dict[str, torch.nn.Module]):
    yield models["sdpa"]
    for each in models.values():
        if hasattr(each, "_vitrim_vlm"):
            vitrim.vlm.remove(each)


def dropped_mask(ids: torch.Tensor, mask: torch.Tensor, kept: list[torch.Tensor]) -> torch.Tensor:
    """The attention mask of the full model with every image token that is not kept masked out (images in reading
    order, GRID_TOKENS each), written independently of vitrim's spans."""
    mask = mask.clone()
    image_columns = (ids == IMAGE_TOKEN).nonzero().tolist()  # reading order
    for number, (row, col) in enumerate(image_columns):
        image, token = divmod(number, GRID_TOKENS)
        if token not in kept[image].tolist():
            mask[row, col] = 0
    return mask


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() makes them from a mask with only padding zeros: cumsum − 1, 0 at padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0) * mask


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.full)])
def test_keeping_every_token_is_the_unmodified_model_bit_for_bit(
    models: dict[str, torch.nn.Module], model: torch.nn.Module, attn: str
) -> None:
    model = models[attn]
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    reference = model(input_ids=ids, pixel_values=pv).logits
    generated = model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=3, do_sample=False)
    vitrim.vlm.apply(model, "random", keep=GRID_TOKENS, positions="original")
    assert torch.equal(model(input_ids=ids, pixel_values=pv).logits, reference)
    assert torch.equal(model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=3, do_sample=False), generated)
    assert [k.tolist() for k in vitrim.vlm.last_selection(model)] == [list(range(GRID_TOKENS))] * 2


@pytest.mark.parametrize(("attn", "tol"), [("sdpa", TOL), ("eager", EAGER_TOL)])
def test_dropping_equals_the_full_model_with_those_keys_masked(
    models: dict[str, torch.nn.Module], model: torch.nn.Module, attn: str, tol: float
) -> None:
    model = models[attn]
    ids, pv = prompt(3, 4, images=2)[None], pixels(2)
    vitrim.vlm.apply(model, "random", keep=5, seed=7, positions="original")
    pruned = model(input_ids=ids, pixel_values=pv).logits  # (1, L', V)
    kept = vitrim.vlm.last_selection(model)
    assert [len(k) for k in kept] == [5, 5] and all(torch.equal(k, k.sort().values) for k in kept)
    vitrim.vlm.remove(model)
    mask = dropped_mask(ids, torch.ones_like(ids), kept)
    full = model(input_ids=ids, pixel_values=pv, attention_mask=mask).logits  # positions 0 … L−1, as unmodified
    assert pruned.shape[1] == int(mask.sum()) == ids.shape[1] - 2 * (GRID_TOKENS - 5)
    assert (full[0, mask[0].bool()] - pruned[0]).abs().max() <= tol


def test_decode_steps_after_a_pruned_prefill_equal_the_masked_full_cache(model: torch.nn.Module) -> None:
    ids, pv = prompt(2, 3)[None], pixels(1)
    steps = torch.tensor([[11], [42]])
    vitrim.vlm.apply(model, "random", keep=4, seed=3, positions="original")
    out = model(input_ids=ids, pixel_values=pv, use_cache=True)
    kept = vitrim.vlm.last_selection(model)
    pruned_steps = []
    cache, length = cache_of(out), ids.shape[1]
    for token in steps:  # no mask, no positions: the caller's plain decode loop
        out = model(input_ids=token[None], **cache_kw(cache), use_cache=True)
        pruned_steps.append(out.logits[0, -1])
    vitrim.vlm.remove(model)
    mask = dropped_mask(ids, torch.ones_like(ids), kept)
    ref = model(input_ids=ids, pixel_values=pv, attention_mask=mask, use_cache=True)
    cache = cache_of(ref)
    for step, token in enumerate(steps):
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
        ref = model(
            input_ids=token[None], **cache_kw(cache), attention_mask=mask, position_ids=torch.tensor([[length + step]])
        )
        assert (ref.logits[0, -1] - pruned_steps[step]).abs().max() <= TOL


def greedy(model: torch.nn.Module, ids: torch.Tensor, pv: torch.Tensor, mask: torch.Tensor, steps: int) -> list:
    """Greedy decoding of the full model under ``mask`` with positions 0 … L−1 (+ steps): the masked reference."""
    positions = torch.arange(ids.shape[1])[None]
    out = model(input_ids=ids, pixel_values=pv, attention_mask=mask, position_ids=positions, use_cache=True)
    tokens, length = [], ids.shape[1]
    for step in range(steps):
        token = out.logits[0, -1].argmax()
        tokens.append(int(token))
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
        position = torch.tensor([[length + step]])
        out = model(input_ids=token.view(1, 1), **cache_kw(cache_of(out)), attention_mask=mask, position_ids=position)
    return tokens


def test_generate_after_apply_equals_greedy_decoding_of_the_masked_model(model: torch.nn.Module) -> None:
    ids, pv = prompt(4, 2, images=2, seed=5)[None], pixels(2, seed=5)
    vitrim.vlm.apply(model, "random", keep=0.25, positions="original")
    generated = model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=5, do_sample=False)
    kept = vitrim.vlm.last_selection(model)
    assert [len(k) for k in kept] == [4, 4]
    vitrim.vlm.remove(model)
    reference = greedy(model, ids, pv, dropped_mask(ids, torch.ones_like(ids), kept), 5)
    assert generated[0, ids.shape[1] :].tolist() == reference


def three_samples() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts of different lengths and image counts (1, 2, 1 images), and each one's pixels."""
    prompts = [prompt(2, 1, images=1, seed=1), prompt(5, 3, images=2, seed=2), prompt(9, 6, images=1, seed=3)]
    images = [pixels(1, seed=1), pixels(2, seed=2), pixels(1, seed=3)]
    return prompts, images


def test_each_sample_of_a_left_padded_batch_generates_as_it_does_alone(model: torch.nn.Module) -> None:
    prompts, images = three_samples()
    vitrim.vlm.apply(model, "random", keep=6, seed=2)
    ids, mask = batch(prompts, "left")
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=torch.cat(images),
        max_new_tokens=3,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    in_batch = vitrim.vlm.last_selection(model)
    alone_kept = []
    for row, (p, pv) in enumerate(zip(prompts, images)):
        alone = model.generate(
            input_ids=p[None],
            pixel_values=pv,
            max_new_tokens=3,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        alone_kept += vitrim.vlm.last_selection(model)
        assert out.sequences[row, ids.shape[1] :].tolist() == alone.sequences[0, len(p) :].tolist()
        for step in range(3):
            assert (out.logits[step][row] - alone.logits[step][0]).abs().max() <= TOL
    assert [k.tolist() for k in in_batch] == [k.tolist() for k in alone_kept]  # same image, same draw


def test_each_sample_of_a_right_padded_batch_equals_it_alone(model: torch.nn.Module) -> None:
    prompts, images = three_samples()
    vitrim.vlm.apply(model, "random", keep=3, seed=4)
    ids, mask = batch(prompts, "right")
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=generate_positions(mask), pixel_values=torch.cat(images)
    ).logits  # (3, L', V), each sample's real columns first
    for row, (p, pv) in enumerate(zip(prompts, images)):
        alone = model(input_ids=p[None], pixel_values=pv).logits[0]
        assert (logits[row, : alone.shape[0]] - alone).abs().max() <= TOL


def test_remove_restores_the_model_exactly(model: torch.nn.Module) -> None:
    ids, pv = prompt(3, 4)[None], pixels(1)
    reference = model(input_ids=ids, pixel_values=pv).logits
    hooks = lambda: sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())  # noqa: E731
    before = hooks()  # transformers' own hooks
    vitrim.vlm.apply(model, "random", keep=2)
    assert hooks() > before and model(input_ids=ids, pixel_values=pv).logits.shape[1] == ids.shape[1] - 14
    vitrim.vlm.remove(model)
    assert hooks() == before and not hasattr(model, "_vitrim_vlm")
    assert torch.equal(model(input_ids=ids, pixel_values=pv).logits, reference)


def test_last_selection_groups_are_one_index_per_kept_token(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="has seen no prefill yet"):
        vitrim.vlm.apply(model, "random", keep=3)
        vitrim.vlm.last_selection(model)
    model(input_ids=prompt(1, 1)[None], pixel_values=pixels(1))
    kept = vitrim.vlm.last_selection(model)[0]
    groups = vitrim.vlm.last_selection(model, groups=True)[0]
    assert [g.tolist() for g in groups] == [[i] for i in kept.tolist()]


@pytest.mark.full
def test_generate_without_a_cache_shortens_every_step_alike(model: torch.nn.Module) -> None:
    ids, pv = prompt(3, 2, images=2, seed=9)[None], pixels(2, seed=9)
    vitrim.vlm.apply(model, "visionzip", keep=6, contextual=2)
    cached = model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=3, do_sample=False)
    uncached = model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=3, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def test_the_random_draw_depends_on_the_seed_and_on_the_image(model: torch.nn.Module) -> None:
    ids, pv = prompt(1, 1, images=2)[None], pixels(2)
    draws = {}
    for seed in (0, 1):
        vitrim.vlm.apply(model, "random", keep=6, seed=seed)
        model(input_ids=ids, pixel_values=pv)
        draws[seed] = [k.tolist() for k in vitrim.vlm.last_selection(model)]
        vitrim.vlm.remove(model)
    assert draws[0][0] != draws[0][1] and draws[0] != draws[1]


@pytest.mark.full  # a fresh interpreter (seconds); the static check below runs by default
def test_importing_vitrim_vlm_does_not_import_transformers() -> None:
    import subprocess
    import sys

    code = "import sys, vitrim.vlm; assert 'transformers' not in sys.modules, 'imported'; print(vitrim.vlm.methods())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "visionzip" in out.stdout


def test_watch_spans_reports_every_prefill_plain_and_under_generate(model: torch.nn.Module) -> None:
    from vitrim.vlm.families import find_family

    seen = []
    unwatch = find_family(model).watch_spans(seen.append)
    ids, pv = prompt(2, 1, images=2)[None], pixels(2)
    model(input_ids=ids, pixel_values=pv)
    model.generate(input_ids=ids, pixel_values=pv, max_new_tokens=3, do_sample=False)  # one prefill, two decodes
    unwatch()
    model(input_ids=ids, pixel_values=pv)
    assert len(seen) == 2
    for spans in seen:
        image_columns = (ids[0] == 3).nonzero()[:, 0]
        assert spans.image_of[0, image_columns].tolist() == [0] * GRID_TOKENS + [1] * GRID_TOKENS
        assert spans.token_of[0, image_columns].tolist() == list(range(GRID_TOKENS)) * 2


@pytest.mark.full
def test_beam_search_equals_beam_search_on_the_masked_model(model: torch.nn.Module) -> None:
    """generate() repeats each prompt and its images per beam; the selection is repeated alike."""
    prompts, images = three_samples()
    ids, mask = batch(prompts[:2], "left")
    pv = torch.cat(images[:2])
    options = dict(max_new_tokens=3, do_sample=False, num_beams=2, num_return_sequences=2)
    vitrim.vlm.apply(model, "fastervlm", keep=5, positions="original")
    pruned = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pv, **options)
    kept = vitrim.vlm.last_selection(model)
    assert len(kept) == 3  # the prompts' images, not the beams'
    vitrim.vlm.remove(model)
    masked = dropped_mask(ids, mask, kept)
    reference = model.generate(
        input_ids=ids, attention_mask=masked, position_ids=generate_positions(mask), pixel_values=pv, **options
    )
    assert torch.equal(pruned, reference)


def test_calling_the_inner_llava_model_directly_prunes_too(model: torch.nn.Module) -> None:
    ids, pv = prompt(2, 2)[None], pixels(1)
    vitrim.vlm.apply(model, "fastervlm", keep=4, positions="original")
    hidden = model.model(input_ids=ids, pixel_values=pv).last_hidden_state
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    mask = dropped_mask(ids, torch.ones_like(ids), kept)
    full = model.model(input_ids=ids, pixel_values=pv, attention_mask=mask).last_hidden_state
    assert hidden.shape[1] == ids.shape[1] - (GRID_TOKENS - 4)
    assert (full[0, mask[0].bool()] - hidden[0]).abs().max() <= TOL


def test_no_vlm_module_imports_transformers_at_its_top() -> None:
    import ast
    from pathlib import Path

    package = Path(vitrim.vlm.__file__).parent
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only: a function may import it when called
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "transformers" for n in names), path.name


def test_labels_give_the_loss_over_the_positions_that_entered_the_llm(model: torch.nn.Module) -> None:
    """Fine-tuning with fewer tokens: the loss is the model's cross-entropy over the kept sequence, each position
    predicting the next KEPT position's label; written here from the masked full model's logits at the kept columns
    (a drop equals masking), and keep = all gives the unmodified model's loss."""
    ids, pv = prompt(3, 4)[None], pixels(1)
    labels = torch.where(ids == IMAGE_TOKEN, torch.full_like(ids, -100), ids)  # as a processor's collator makes them
    plain = model(input_ids=ids, pixel_values=pv, labels=labels).loss
    vitrim.vlm.apply(model, "random", keep=GRID_TOKENS, positions="original")
    assert model(input_ids=ids, pixel_values=pv, labels=labels).loss.item() == plain.item()
    vitrim.vlm.remove(model)
    vitrim.vlm.apply(model, "random", keep=4, positions="original")
    loss = model(input_ids=ids, pixel_values=pv, labels=labels).loss
    kept = vitrim.vlm.last_selection(model)
    vitrim.vlm.remove(model)
    masked = dropped_mask(ids, torch.ones_like(ids), kept)[0].bool()  # (L,) the columns that entered the LLM
    with torch.no_grad():
        full = model(input_ids=ids, pixel_values=pv, attention_mask=masked[None].long(),
                     position_ids=torch.arange(ids.shape[1])[None]).logits[0]  # fmt: skip
    logits, targets = full[masked][:-1], labels[0, masked][1:]
    reference = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    assert (loss - reference).abs().item() <= 1e-5  # transformers' loss runs in float32
    assert (loss - plain).abs().item() > 1e-3  # fewer positions: another loss
