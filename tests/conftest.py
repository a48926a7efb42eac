import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one test process per core: no intra-op threads competing
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A fresh seed per test (reported on failure); DSV32REF_SEED=N replays one."""
    s = int(os.environ.get("DSV32REF_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(s)
    request.node.user_properties.append(("seed", s))
    print(f"seed={s}")
    return s
