"""Reading back the matrices ``vitrim explain`` prints (shared by the self- and cross-attention walkthrough tests)."""

from __future__ import annotations

import re

import numpy as np


def printed_matrices(text: str) -> dict[str, np.ndarray]:
    """Parse ``[name] … shape (r, c)``, the column header, then r rows of ``label n n n …``."""
    lines = text.splitlines()
    result = {}
    for i, line in enumerate(lines):
        match = re.match(r"\[(\w+)\] .* shape \((\d+), (\d+)\)$", line)
        if match:
            name, rows = match.group(1), int(match.group(2))
            body = [row.split()[1:] for row in lines[i + 2 : i + 2 + rows]]
            result[name] = np.array([[float(v) for v in row] for row in body])
    return result
