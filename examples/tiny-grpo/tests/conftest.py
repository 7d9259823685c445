import sys
from pathlib import Path

# The example's modules (task, model, grpo, columns) sit one directory up, as its scripts see them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
