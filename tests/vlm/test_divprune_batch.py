"""DivPrune keeps the same tokens for an image in a batch as alone, and breaks its first step's exact tie (two
mutual nearest neighbours: each one's nearest-other distance is the distance between them) to the lower index.

What broke it: the cosine-distance matrix from one matmul was not bitwise symmetric (entries (i, j) and (j, i)
rounded in different places of the kernel's tiles), so such a pair's tie went to whichever rounded up, and that
rounding moved with the rest of the batch (the tower's and the matmul's own rounding): on the tiny Qwen2-VL and
LLaVA below the batch kept other tokens than the image alone, and the logits followed.
"""

from __future__ import annotations

import torch
from pre_llm_reference import divprune_reference

import vitrim.vlm
from tiny_vlms import qwen
from tiny_vlms.llava import batch, pixels, prompt, tiny_llava
from vitrim.vlm.method.divprune import cosine_distance, divprune_keep


def _kept(model: torch.nn.Module) -> list[list[int]]:
    return [kept.tolist() for kept in vitrim.vlm.last_selection(model)]


def _isolated_pair_at(low: int, high: int) -> torch.Tensor:
    """(6, 64) float64 tokens: four in a tight cluster, and a pair (rows ``low`` and ``high``) far from it and
    farther apart than any cluster token from its nearest: the pair's two scores in the first step are the maxima,
    and equal."""
    g = torch.Generator().manual_seed(0)
    centre = torch.randn(64, generator=g, dtype=torch.float64)
    cluster = centre + 0.01 * torch.randn(4, 64, generator=g, dtype=torch.float64)
    first = torch.randn(64, generator=g, dtype=torch.float64)
    pair = torch.stack([first, first + 0.3 * torch.randn(64, generator=g, dtype=torch.float64)])
    others = [row for row in range(6) if row not in (low, high)]
    tokens = torch.empty(6, 64, dtype=torch.float64)
    tokens[[low, high]] = pair
    tokens[others] = cluster
    return tokens


def test_the_distance_matrix_is_bitwise_symmetric() -> None:
    tokens = torch.randn(64, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    distance = cosine_distance(tokens)
    assert torch.equal(distance, distance.T)
    normalized = tokens / tokens.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(distance, 1.0 - normalized @ normalized.T, rtol=0, atol=1e-15)


def test_an_exact_tie_of_mutual_nearest_neighbours_goes_to_the_lower_index_at_any_rounding() -> None:
    """The rounding a batch brings (features a few ulp apart) never moves the first pick off the lower index."""
    tokens = _isolated_pair_at(1, 4)
    generator = torch.Generator().manual_seed(2)
    picks = set()
    for _ in range(50):
        rounding = 1 + 1e-15 * torch.randn(tokens.shape, generator=generator, dtype=torch.float64)
        picks.add(int(divprune_keep(tokens * rounding, 1)[0]))
    assert picks == {1}
    assert divprune_reference(tokens[None], 1) == [[1]]  # the paper's greedy, ties to the lower index


def test_qwen2_vl_batch_keeps_what_each_prompt_alone_keeps() -> None:
    model = qwen.qwen2_vl(seed=0)
    vitrim.vlm.apply(model, "divprune", keep=1)
    prompts = [
        ([[1, 5, 6], [7, 8, 9]], [(8, 8)]),
        ([[1, 5], [7, 8, 9, 10, 11], [3]], [(4, 8), (6, 4)]),
        ([[1], [7]], [(8, 6)]),
    ]
    inputs = qwen.batch(prompts, seed=5)
    qwen.assert_batch_is_each_alone(model, prompts, inputs)


def test_llava_left_padded_batch_keeps_what_each_prompt_alone_keeps() -> None:
    model = tiny_llava(seed=0)
    vitrim.vlm.apply(model, "divprune", keep=1)
    prompts = [prompt(2, 3, images=2, seed=6), prompt(5, 1, seed=7), prompt(1, 4, seed=8)]
    images = [2, 1, 1]
    picture = pixels(4, seed=6)
    input_ids, attention_mask = batch(prompts, "left")
    model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=picture)
    kept_together = _kept(model)
    first = 0
    for ids, count in zip(prompts, images, strict=True):
        model(input_ids=ids[None], pixel_values=picture[first : first + count])
        assert kept_together[first : first + count] == _kept(model)
        first += count
