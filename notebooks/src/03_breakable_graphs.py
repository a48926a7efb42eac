# %% [markdown]
# # Breakable CUDA graphs and where the eager boundary goes
#
# A CUDA graph replays a recorded list of kernel launches with one launch call, so the host's per-kernel
# cost disappears. It can only hold work whose launches and arguments never change. DeepSeek-V3.2's
# sparse indexer and attention branch on the host (how many requests, where each one's tokens start,
# buffers sized by each sequence's length), so a serving engine captures the model in *pieces*: an
# `@eager_break` function ends the current graph during capture, runs eagerly, and a new graph starts
# after it. Replay = graph, eager call, graph, eager call, ...
#
# This notebook runs on the CPU with `dsv32ref.graphs.emulated.RecordingBackend`, a stand-in that records
# the launches of each segment with the tensors they were called on and relaunches them on replay: the
# same bookkeeping as CUDA graphs, visible step by step. (On a GPU the same code captures real CUDA
# graphs: `tests/test_engine.py` checks replay against eager there.)

# %%
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors, on every machine

import matplotlib.pyplot as plt
import torch

from dsv32ref.graphs import BreakableCapture, CaptureError, eager_break, eager_breaks_enabled
from dsv32ref.graphs.emulated import RecordingBackend

torch.manual_seed(0)
_ = torch.set_grad_enabled(False)

# %% [markdown]
# ## 1. A toy: three layers, each with an eager region
# The eager region writes into a buffer its caller allocated (`out`): a tensor it allocated itself
# would live at a new address on every replay, which the next graph segment could never read.

# %%
@eager_break
def sparse_part(x, out):
    out.copy_(torch.softmax(x, dim=-1))  # stands in for host-dependent work
    return out


def toy_model(x, out):
    for _ in range(3):
        x = torch.tanh(x @ torch.ones(4, 4) * 0.1 + 1)
        sparse_part(x, out)
        x = out * 2
    return x


x_static, out_static = torch.randn(2, 4), torch.zeros(2, 4)
with BreakableCapture(RecordingBackend(), name="toy") as cap:
    y_static = toy_model(x_static, out_static)
print("segments:", cap.graph.pattern)
print("kernel launches recorded per graph segment:",
      [g.num_ops for kind, g in cap.graph.entries if kind == "graph"])

# %% [markdown]
# Replay after changing the *contents* of the static input: the graphs relaunch their recorded ops on the
# same tensors, the eager calls run again in between, and the static output holds the new result.

# %%
x_static.copy_(torch.randn(2, 4))
expected = toy_model(x_static.clone(), torch.zeros(2, 4))
cap.graph.replay()
print("replay == eager on new inputs:", torch.allclose(y_static, expected, atol=1e-6))

# %% [markdown]
# ## 2. The rules, enforced
# Returning a freshly allocated tensor from an eager region, or nesting captures, fails at capture time
# with a message that says what to do, and leaves no half-captured graph behind.

# %%
@eager_break
def bad_region(x):
    return x * 2  # allocates its result


try:
    with BreakableCapture(RecordingBackend(), name="bad"):
        bad_region(torch.ones(3))
except CaptureError as e:
    print("CaptureError:", str(e)[:150], "...")
try:
    with BreakableCapture(RecordingBackend(), name="outer"):
        with BreakableCapture(RecordingBackend(), name="inner"):
            pass
except CaptureError as e:
    print("CaptureError:", e)

# %% [markdown]
# In FULL mode the breaks are switched off: the eager regions are captured like any op, one graph.

# %%
with eager_breaks_enabled(False):
    with BreakableCapture(RecordingBackend(), name="full") as full:
        toy_model(x_static, out_static)
print("FULL segments:", full.graph.pattern)

# %% [markdown]
# ## 3. One DSA layer per eager boundary
# `dsv32ref.engine.EngineDSAAttention` offers six boundaries, all computing the same function:
#
# | boundary | eager region | UV BMM |
# |---|---|---|
# | `wide` | everything after the A-projections | eager |
# | `narrow` | indexer + attention + UV BMM (the change) | eager, on the backend-owned output |
# | `narrow_copy` | indexer + attention + a copy into a static buffer per layer and size | captured |
# | `narrow_copy_shared` | the same copy into one buffer shared by every layer | captured |
# | `narrow_out` | indexer + attention writing into the graph-owned buffer | captured |
# | `none` | nothing: the graph-safe sparse path (device-side lengths, a static score workspace) | captured |
#
# Two layers with the GLM-5.2 structure at tiny widths (layer 0 runs its indexer, layer 1 shares its
# top-k), an 8-token prefill, PIECEWISE capture, replay against eager.

# %%
from dsv32ref import ModelConfig, init_dummy_weights
from dsv32ref.engine import BOUNDARIES, EngineConfig, EngineModel, LLMEngine, StepInput
from dsv32ref.graphs import CUDAGraphMode
from dsv32ref.reference.model import DeepseekV32ForCausalLM

cfg = ModelConfig.preset("tiny-glm-5.2").replace(num_hidden_layers=2, first_k_dense_replace=1,
                                                 indexer_types=("full", "shared"))
ref = init_dummy_weights(DeepseekV32ForCausalLM(cfg), seed=0).eval()
prompt = list(range(5, 13))
rows = []
for boundary in BOUNDARIES:
    logits = {}
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        ec = EngineConfig(boundary=boundary, mode=mode, max_model_len=32, max_num_seqs=2,
                          max_num_batched_tokens=8, block_size=4, capture_sizes=[8])
        eng = LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, model=EngineModel.from_reference(ref, boundary))
        eng.capture()
        _, how = eng.step(StepInput([(0, prompt, 0)]))
        logits[mode] = eng.last_logits.clone()
        if mode is CUDAGraphMode.PIECEWISE:
            graph = eng.runner.piecewise[8].graph
            in_graphs = sum(g.num_ops for kind, g in graph.entries if kind == "graph")
            rows.append((boundary, graph.pattern, in_graphs, how))
    same = torch.allclose(logits[CUDAGraphMode.NONE], logits[CUDAGraphMode.PIECEWISE], atol=1e-5)
    rows[-1] += (same,)
print(f"{'boundary':<12} {'segments':<12} {'launches in graphs':>19}  step ran as  replay == eager")
for b, pattern, n, how, same in rows:
    print(f"{b:<12} {pattern:<12} {n:>19}  {how:<11}  {same}")

# %% [markdown]
# The segment pattern is the same for every boundary (one eager region per layer, so layers + 1
# graphs); what changes is how much work sits *inside* the graphs. The timeline below lists the
# launches of one layer that runs its indexer, in order, coloured by where they run, from the launch
# ledger's prediction (`dsv32ref.experiments.ledger.predict`, which records launches without running kernels).

# %%
from dsv32ref.experiments.ledger import ASSUMED_SMS, predict

COLORS = {True: "#e07b39", False: "#3b75af"}  # direct (eager) / in a graph
fig, axes = plt.subplots(len(BOUNDARIES), 1, figsize=(11, 5.2), sharex=True)
for ax, boundary in zip(axes, BOUNDARIES):
    eng = LLMEngine(cfg.replace(num_hidden_layers=1, indexer_types=None, first_k_dense_replace=1),
                    EngineConfig(boundary=boundary, mode=CUDAGraphMode.NONE, max_model_len=32, max_num_seqs=2,
                                 max_num_batched_tokens=8, block_size=4, capture_sizes=[8], num_sms=ASSUMED_SMS),
                    device="cpu", dtype=torch.bfloat16)
    L = predict(eng, StepInput([(0, prompt, 0)]))
    events = [e for e in L.events if e[0] not in ("embed", "other")]
    for i, (_, _, direct) in enumerate(events):
        ax.barh(0, 1, left=i, color=COLORS[direct], edgecolor="white")
    starts = {}
    for i, (region, _, _) in enumerate(events):
        starts.setdefault(region, i)
    for region, i in starts.items():
        ax.text(i + 0.1, 0.45, region, fontsize=7, rotation=35, va="bottom")
    n_direct = sum(d for _, _, d in events)
    eager_regions = sorted({r for r, _, d in events if d})
    ax.set_yticks([])
    ax.set_ylabel(boundary, rotation=0, ha="right", va="center")
    ax.set_ylim(-0.6, 1.6)
    print(f"{boundary:<12} launches in the layer: {len(events)}, eager (direct): {n_direct} {eager_regions}")
axes[-1].set_xlabel("launches of one layer, in order (blue: inside a graph, orange: eager)")
fig.suptitle("What each eager boundary leaves outside the graphs (one layer, 8-token prefill)")
plt.tight_layout()
plt.show()

# %% [markdown]
# `wide` leaves the norm/RoPE kernel, the q_b GEMM, the W_UK BMM, the indexer's wq_b GEMM and the fused-Q
# kernel eager in every layer: with GLM-5.2's 78 layers (21 with an indexer) that is
# 78 + 78 + 78 + 99 = 333 more direct launches per forward than `narrow`, the seeds' number.
# `narrow_copy` and `narrow_out` take the UV BMM into the graphs as well; the copy variant pays one
# device-to-device copy per layer for it. `notebooks/04_launches_and_ttft.ipynb` measures all of this on
# an H200.
