"""The tests' own helpers import as modules (``from test_trainer import ...``) under pytest's
``--import-mode=importlib``, as they do in the scripts the tests start."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
