"""``python -m vitrim.cli`` (what ``torchrun -m vitrim.cli train …`` runs)."""

import sys

from vitrim.cli import main

sys.exit(main())
