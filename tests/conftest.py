"""Test-wide settings, made before torch or triton is imported anywhere."""
import os

# Several torch processes share 2 cores in tests: one thread each (inherited by children).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
# Triton kernels run on CPU through the interpreter when no GPU is present.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
