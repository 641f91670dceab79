import os
import sys
from pathlib import Path

# cuBLAS reads this when its first handle is made; deterministic tests need it on CUDA
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).parent))
