"""`import vitrim` hands out its subpackages on first use and imports no optional library."""

from __future__ import annotations

import json
import subprocess
import sys

from vitrim.extras import OPTIONAL

PROBE = """
import json, sys
import vitrim
loaded = sorted(m for m in {optional} if m in sys.modules)
lazy = sorted(name for name in vitrim.SUBPACKAGES if "vitrim." + name not in sys.modules)
transform = vitrim.data.eval_transform  # the user's line of issue 35, without `import vitrim.data`
subpackages = {{type(getattr(vitrim, name)).__name__ for name in vitrim.SUBPACKAGES}}
print(json.dumps({{"loaded": loaded, "lazy": lazy, "subpackages": sorted(subpackages), "dir": "viz" in dir(vitrim)}}))
"""


def test_import_vitrim_is_lean_and_its_subpackages_come_on_first_use() -> None:
    optional = sorted({*OPTIONAL, "transformers", "timm"})
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(optional=optional)], capture_output=True, text=True, check=True
    ).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    # tqdm comes with torch itself (torch imports it), not with vitrim
    assert [m for m in seen["loaded"] if m != "tqdm"] == [], seen["loaded"]
    assert "data" in seen["lazy"] and "viz" in seen["lazy"] and "train" in seen["lazy"]
    assert seen["subpackages"] == ["module"] and seen["dir"]  # each name a module, none an AttributeError


def test_an_unknown_attribute_is_still_an_attribute_error() -> None:
    import pytest

    import vitrim

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        vitrim.nope  # noqa: B018
