# %% [markdown]
# # Breakable CUDA graphs and where the eager boundary goes
#
# A CUDA graph replays a recorded list of kernel launches with one launch call, so the host's per-kernel
# cost disappears. It can only hold work whose launches and arguments never change. DeepSeek-V3.2's
# sparse indexer and attention branch on the host (how many requests, where each one's tokens start,
# buffers sized by each sequence's length), so a serving engine captures the model in *pieces*: an
# `@eager_break` function ends the current graph during capture, runs eagerly, and a new graph starts
# after it. Replay = graph, eager call, graph, eager call, ... Where that break goes is what vLLM's pull request
# "[Perf] Narrow DeepSeek V3.2 eager CUDA graph region" changed: it narrowed the eager region of each layer to
# the sparse indexer and the sparse attention. This notebook shows the mechanism and each boundary's pieces.
#
# This notebook runs on the CPU with `dsv32ref.graphs.emulated.RecordingBackend`, a stand-in that records
# the launches of each segment with the tensors they were called on and relaunches them on replay: the
# same bookkeeping as CUDA graphs, visible step by step. (On a GPU the same code captures real CUDA
# graphs: `tests/test_engine.py` checks replay against eager there.)

# %%
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors, on every machine

import json
import textwrap

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

from dsv32ref.graphs import BreakableCapture, CaptureError, eager_break, eager_breaks_enabled
from dsv32ref.graphs.emulated import RecordingBackend
from dsv32ref.report import GREY, OKABE_ITO, show, table

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
    print(textwrap.fill(f"CaptureError: {e}", 98, subsequent_indent="  "))
try:
    with BreakableCapture(RecordingBackend(), name="outer"):
        with BreakableCapture(RecordingBackend(), name="inner"):
            pass
except CaptureError as e:
    print(textwrap.fill(f"CaptureError: {e}", 98, subsequent_indent="  "))

# %% [markdown]
# In FULL mode the breaks are switched off: the eager regions are captured like any op, one graph.

# %%
with eager_breaks_enabled(False):
    with BreakableCapture(RecordingBackend(), name="full") as full:
        toy_model(x_static, out_static)
print("FULL segments:", full.graph.pattern)

# %% [markdown]
# ## 3. One DSA layer per eager boundary
# `dsv32ref.engine.boundary` describes six boundaries, all computing the same function; the attention's forward
# reads the description (vLLM's region names: `_fused_attention`, `_sparse_indexer_and_attn`):
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
from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput, from_reference
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
        eng = LLMEngine(cfg, ec, device="cpu", dtype=torch.float32, model=from_reference(ref, boundary))
        eng.capture()
        _, how = eng.step(StepInput([(0, prompt, 0)]))
        logits[mode] = eng.last_logits.clone()
        if mode is CUDAGraphMode.PIECEWISE:
            graph = eng.runner.graphs.piecewise[8].graph
            in_graphs = sum(g.num_ops for kind, g in graph.entries if kind == "graph")
            rows.append((boundary, graph.pattern, in_graphs, how))
    same = torch.allclose(logits[CUDAGraphMode.NONE], logits[CUDAGraphMode.PIECEWISE], atol=1e-5)
    rows[-1] += (same,)
table(["boundary", "segments", "launches in graphs", "step ran as", "replay == eager"], [list(r) for r in rows])

# %% [markdown]
# The segment pattern is the same for every boundary (one eager region per layer, so layers + 1
# graphs); what changes is how much work sits *inside* the graphs. The timeline below lists the
# launches of one layer that runs its indexer, in order, coloured by where they run, from the launch
# ledger's prediction (`dsv32ref.experiments.ledger.predict`, which records launches without running kernels).

# %%
from dsv32ref.experiments.ledger import ASSUMED_SMS, predict

COLORS = {True: OKABE_ITO[5], False: OKABE_ITO[0]}  # direct (eager) / in a graph
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
    print(f"{boundary:<19} launches in the layer: {len(events):>2}, eager (direct): {n_direct:>2}")
    if eager_regions:
        print(f"{'':<19} eager: {', '.join(eager_regions)}")
axes[-1].set_xlabel("launches of one layer, in order (blue: inside a graph, vermilion: eager)")
fig.suptitle("What each eager boundary leaves outside the graphs (one layer, 8-token prefill)")
show(fig)

# %% [markdown]
# ## 4. The whole forward, GLM-5.2 at full depth
# The launch ledger predicted on a CPU for the real layer count (`dsv32ref ledger --predict`,
# `data/ledger_predicted_glm-5.2.json`): per layer, the kernels inside its graph segment (blue) and the
# launches of its eager region (vermilion), widths to scale, one strip per boundary.

# %%
with open("../data/ledger_predicted_glm-5.2.json") as fh:
    pred = json.load(fh)
with open("../data/seeds.json") as fh:
    seeds = json.load(fh)
shown = [b for b in BOUNDARIES if b in pred["variants"]]
fig, axes = plt.subplots(len(shown), 1, figsize=(12, 0.55 * len(shown) + 1.4), sharex=True)
for ax, b in zip(axes, shown):
    x = 0
    for layer in pred["variants"][b]["layers"]:
        g, e = layer["graph"], sum(layer["direct"].values())
        ax.barh(0, g, left=x, color=OKABE_ITO[0], height=0.8)
        ax.barh(0, e, left=x + g, color=OKABE_ITO[5], height=0.8)
        x += g + e
    v = pred["variants"][b]
    ax.set_yticks([])
    ax.set_ylabel(f"{b}\n{v['graph_launches']} G, {sum(v['direct'].values())} E", rotation=0, ha="right",
                  va="center", fontsize=8)
axes[-1].set_xlabel("launches of one forward in order (blue: inside graph segments, vermilion: eager)")
fig.suptitle(f"GLM-5.2, {len(pred['variants']['narrow']['layers'])} layers, 8-token prefill: the G E G E ... "
             f"strip of one forward per boundary (predicted ledger)")
show(fig)

# %% [markdown]
# ## Conclusion

# %%
w, n = pred["variants"]["wide"], pred["variants"]["narrow"]
moved = sum(w["direct"].values()) - sum(n["direct"].values())
tr = seeds["launch_trace"]
display(Markdown(
    f"- A breakable graph is an ordinary capture cut at each `@eager_break`: replay runs the segments and the "
    f"eager calls in order, and the rules (no tensor allocated inside an eager region, no nested captures) "
    f"are checked at capture time.\n"
    f"- `wide` leaves the norm/RoPE kernel, the q_b GEMM, the W_UK BMM, the indexer's wq_b GEMM and the fused-Q "
    f"kernel eager in every layer: on GLM-5.2's {len(w['layers'])} layers that is {moved} more direct launches "
    f"per forward than `narrow`. The PR's trace counted {tr['fewer_direct_launches']} fewer, with "
    f"{tr['graph_launches_kept']} graph launches kept; our ledger predicts {n['graph_launches']}.\n"
    f"- `narrow_copy` and `narrow_out` take the UV BMM into the graphs as well (the copy variant pays one "
    f"device-to-device copy per layer for it), and `none` has no eager region at all: one graph. Notebook 04 "
    f"measures these launches and what they cost on an H200; notebook 06 what `none` gains."))
