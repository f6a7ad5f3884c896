"""torchvision's transforms v2, importable where torchvision's compiled operators do not match torch.

vitrim's image pipelines (the model's eval transform, the DeiT recipe's augmentations, mixup / cutmix) are
torchvision's transforms. A torchvision wheel built for another torch fails at import ("operator torchvision::nms
does not exist") although its transforms need none of those operators: only its two registration modules touch
them. When that import fails, they are replaced by empty modules in ``sys.modules`` (nothing on disk changes) and the
import is tried again; with a matching torchvision nothing is replaced. ``torchvision.ops`` stays unusable then,
and vitrim does not use it.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

from vitrim.extras import require

_REGISTRATIONS = ("torchvision._meta_registrations", "torchvision._autograd_registrations")


@functools.cache
def _import_torchvision() -> None:
    """Import torchvision (see module doc); ModuleNotFoundError naming the extra when it is not installed."""
    require("PIL", feature="reading images")
    try:
        import torchvision
    except ModuleNotFoundError:
        require("torchvision", feature="image transforms")  # raises, naming the extra to install
        raise
    except RuntimeError:  # the wheel's compiled operators do not match this torch
        for name in _REGISTRATIONS:
            sys.modules[name] = types.ModuleType(name)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            if name not in _REGISTRATIONS:
                del sys.modules[name]  # half-imported by the failed attempt
        import torchvision  # noqa: F401


def transforms_v1() -> Any:
    """``torchvision.transforms`` (v1: what timm's eval transform is built on)."""
    _import_torchvision()
    import torchvision.transforms as transforms

    return transforms


def transforms_v2() -> Any:
    """``torchvision.transforms.v2`` (the DeiT recipe's augmentations, mixup / cutmix)."""
    _import_torchvision()
    from torchvision.transforms import v2

    return v2


class BuiltTransform:
    """``factory(*args)``, a torchvision transform, that pickles as its recipe and is rebuilt where it is unpickled.

    DataLoader workers started by ``spawn`` (macOS, Windows, or inside ``torch.multiprocessing.spawn``) unpickle the
    dataset in a fresh interpreter; unpickling torchvision's objects there would import torchvision before
    :func:`transforms_v2` could make it importable. Rebuilding from ``factory`` (a vitrim function) goes through it.
    """

    def __init__(self, factory: Callable[..., Any], *args: Any) -> None:
        self.factory, self.args = factory, args
        self.transform = factory(*args)

    def __call__(self, image: Any) -> Any:
        return self.transform(image)

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self.factory, "args": self.args}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["factory"], *state["args"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return repr(self.transform)
