import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through the interpreter (set before triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # one test process per core: no intra-op threads competing
    torch.set_num_threads(1)


# The slowest scopes first (interpreted engines, spawned ranks, executed notebooks), so that pytest-xdist's two
# processes end together (with --no-loadscope-reorder; its default sends the scopes with the most tests first).
SLOWEST_FIRST = ("tests/test_engine.py", "tests/test_parallel.py", "tests/test_graph_hazards.py", "tests/test_no_break.py",
                 "tests/test_fp8_engine.py", "notebooks/03_breakable_graphs.ipynb", "notebooks/02_kernels.ipynb")


def _rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return SLOWEST_FIRST.index(path) if path in SLOWEST_FIRST else len(SLOWEST_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: a module's (and a notebook's) items keep their order
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


@pytest.fixture
def poisoned_partials():
    """sparse_mla_paged's top-k split partials (the fp32 out and lse that the combine merges) filled with NaN before
    the kernel runs: a partial that the combine reads and no kernel wrote turns its token's output NaN. A patch of
    its own, so that a test's monkeypatch.undo() leaves it in place."""
    from dsv32ref.kernels import sparse_mla as module

    plain = module._kernel_outputs

    def poisoned(out, lse_arg, splits):
        outputs = plain(out, lse_arg, splits)
        if splits > 1:
            outputs[0].fill_(float("nan"))
            outputs[3].fill_(float("nan"))
        return outputs

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_kernel_outputs", poisoned)
        yield
