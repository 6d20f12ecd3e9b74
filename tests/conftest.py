import os
import sys

# Spawned children import the test modules' helpers (tests/dist/common.py) by name.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
