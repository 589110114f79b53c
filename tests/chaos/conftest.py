"""Lets the chaos tests import the suite module that sits beside them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
