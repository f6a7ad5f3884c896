"""vitrim.optimize: one graph per input shape, captured once, computing what eager computes; clear refusals.

Compiled with ``aot_eager`` (dynamo and AOTAutograd, no C++ build, which takes minutes on 2 cores); one reducer in
the default run, every model kind and Inductor itself under ``full``.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from deploy_models import KINDS, build, images
from torch._dynamo.testing import CompileCounterWithBackend

import vitrim
from vitrim.reduce import Reducer, TokenState

EVAL_KINDS = [kind for kind in KINDS if kind != "dynamicvit_train"]


def check_one_compilation(kind: str, backend: str = "aot_eager") -> None:
    model = build(kind)
    with torch.no_grad():
        expected = [model(images(3, seed=s)) for s in range(3)]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    fast = vitrim.optimize(model, batch_size=3, backend=counter)
    got = [fast(images(3, seed=s)) for s in range(3)]  # three calls, three inputs, one shape
    assert counter.frame_count == 1, f"{kind}: compiled {counter.frame_count} times"
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-4)


def test_one_compilation_for_three_calls_computes_what_eager_computes() -> None:
    check_one_compilation("tome")


@pytest.mark.full
@pytest.mark.parametrize("kind", EVAL_KINDS)
def test_every_model_kind_compiles_once(kind: str) -> None:
    check_one_compilation(kind)


@pytest.mark.full
def test_inductor_on_the_cpu() -> None:
    check_one_compilation("evit", backend="inductor")


def test_refuses_other_shapes_and_bad_arguments() -> None:
    model = build("dense")
    fast = vitrim.optimize(model, batch_size=2, backend="aot_eager")
    assert not model.training and fast.input_shape == (2, 3, 32, 32)
    with pytest.raises(ValueError, match=r"images of shape \(3, 3, 32, 32\), but the model was optimized for"):
        fast(images(3))
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        vitrim.optimize(model, batch_size=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        vitrim.optimize(model, batch_size=1, mode="fast")
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N, got 'tpu'"):
        vitrim.optimize(model, batch_size=1, device="tpu")
    with pytest.raises(ValueError, match=r"dtype must be None, torch\.bfloat16 or torch\.float16"):
        vitrim.optimize(model, batch_size=1, dtype=torch.float64)
    with pytest.raises(TypeError, match="must be a vitrim ViT"):
        vitrim.optimize(torch.nn.Linear(2, 2), batch_size=1)


class DataDependent(Reducer):
    static_counts: ClassVar[bool] = False

    def after_attention(self, state: TokenState, attention: object) -> TokenState:
        return state


def test_refuses_a_reducer_whose_counts_depend_on_the_data() -> None:
    model = build("dense")
    model.blocks[1].reducer = DataDependent()
    with pytest.raises(ValueError, match=r"block 1.s reducer DataDependent.*data-dependent number of tokens"):
        vitrim.optimize(model, batch_size=1)


def test_bench_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from vitrim.cli import main

    base = ["bench", "models", "vit_tiny_patch16_224", "--set", "embed_dim=32,depth=2,num_heads=2,img_size=32"]
    assert main([*base, "--optimize", "--compile"]) == 2
    assert "pass --compile or --optimize, not both" in capsys.readouterr().err
    assert main([*base, "--optimize", "--warmup", "0"]) == 2
    assert "--optimize needs --warmup >= 1" in capsys.readouterr().err


@pytest.mark.full
def test_bench_models_and_reducers_time_the_optimized_rows(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from vitrim.cli import main

    tiny = "embed_dim=32,depth=2,num_heads=2,img_size=32,patch_size=8"
    args = ["bench", "models", "vit_tiny_patch16_224", "--set", tiny, "--reducer", "none", "--reducer", "tome:r=2"]
    assert (
        main([*args, "--optimize", "--batch-size", "2", "--repeats", "2", "--latency-repeats", "2", "--no-memory"]) == 0
    )
    assert "vitrim.optimize" in capsys.readouterr().out
    args = ["bench", "reducers", "--models", "vit_tiny_patch16_224", "--set", tiny, "--targets", "80%"]
    assert main([*args, "--optimize", "--batch-sizes", "2", "--repeats", "2", "--warmup", "1"]) == 0
