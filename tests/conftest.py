"""Test-wide settings: set before torch/triton are imported anywhere."""
import os

# Triton kernels run on CPU through the interpreter when no GPU is present.
try:
    import torch
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Several torch processes share 2 cores in tests: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
