import sys
from pathlib import Path

# Determinism (and CUBLAS_WORKSPACE_CONFIG with it) is set up by the repository's conftest.py.
sys.path.insert(0, str(Path(__file__).parent))
