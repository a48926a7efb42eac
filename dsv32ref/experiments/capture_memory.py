"""Start-up memory of each eager boundary under FULL_AND_PIECEWISE capture (issue 5's measurement).

For each variant and each gpu_memory_utilization: build the engine on the shared model (profile run,
KV cache sized to the budget, as the serving engine does), capture every default size (PIECEWISE largest
first, then FULL), and record the memory ledger after each phase and each captured size, whether and
where the capture failed, and a compact summary of the allocator's segments (which memory pool holds what).
With `snapshot_dir`, the allocator history (`torch.cuda.memory._record_memory_history`) is dumped per run.

    python -m dsv32ref.experiments.capture_memory OUT.json [SNAPSHOT_DIR]
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import torch

from dsv32ref.experiments.ttft import REDUCTION, reduced_config


def _segments_summary() -> list[dict]:
    """Allocator segments grouped by pool: how many bytes each pool reserves and how much is in use."""
    pools: dict = {}
    for seg in torch.cuda.memory._snapshot().get("segments", []):
        key = str(seg.get("segment_pool_id", "default"))
        p = pools.setdefault(key, {"pool": key, "segments": 0, "reserved": 0, "allocated": 0})
        p["segments"] += 1
        p["reserved"] += seg.get("total_size", 0)
        p["allocated"] += seg.get("allocated_size", 0)
    return sorted(pools.values(), key=lambda p: -p["reserved"])


def run(preset: str = "glm-5.2", variants=("narrow", "narrow_copy", "narrow_out"), utilizations=(0.9,),
        max_num_seqs: int = 256, max_model_len: int = 8192, max_num_batched_tokens: int = 512,
        device: str = "cuda", config=None, capture_sizes=None, out: str | None = None,
        snapshot_dir: str | None = None) -> dict:
    from dsv32ref.engine import EngineConfig, LLMEngine, build_model
    from dsv32ref.graphs import CaptureError, CUDAGraphMode
    from dsv32ref.provenance import provenance

    cuda = device == "cuda"
    config = config or reduced_config(preset)
    model = build_model(config, variants[0], device, torch.bfloat16 if cuda else torch.float32, seed=0)
    result = {"provenance": provenance(), "preset": preset, "reduction": REDUCTION,
              "settings": {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
                           "max_num_batched_tokens": max_num_batched_tokens, "mode": "full_and_piecewise"},
              "runs": []}
    for util in utilizations:
        for v in variants:
            if cuda and snapshot_dir:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            entry = {"variant": v, "gpu_memory_utilization": util, "failed": None}
            eng = None
            t0 = time.time()
            try:
                ec = EngineConfig(boundary=v, mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                                  gpu_memory_utilization=util, capture_sizes=capture_sizes)
                eng = LLMEngine(config, ec, device=device, dtype=model.lm_head.dtype, model=model)
                entry["startup"] = dict(eng.memory)
                try:
                    entry["capture_s"] = eng.capture()
                except CaptureError as e:
                    entry["failed"] = str(e)
                entry["capture_log"] = eng.capture_log
                entry["after"] = eng.memory_ledger()
                if cuda:
                    entry["pools"] = _segments_summary()
            except Exception as e:  # noqa: BLE001 - a failure before capture (KV cache sizing) is a result too
                entry["failed"] = f"{type(e).__name__}: {e}"
            finally:
                if cuda and snapshot_dir:
                    os.makedirs(snapshot_dir, exist_ok=True)
                    torch.cuda.memory._dump_snapshot(os.path.join(snapshot_dir, f"{v}_{util}.pickle"))
                    torch.cuda.memory._record_memory_history(enabled=None)
                if eng is not None:
                    eng.release_graphs()
                    del eng
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            entry["wall_s"] = time.time() - t0
            result["runs"].append(entry)
            status = "FAILED " + entry["failed"].splitlines()[0] if entry["failed"] else "ok"
            print(f"  {v:<12} util {util:.2f}: {status} ({entry['wall_s']:.0f} s)", flush=True)
            if out:
                os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
                with open(out, "w") as f:
                    json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    run(out=sys.argv[1] if len(sys.argv) > 1 else None, snapshot_dir=sys.argv[2] if len(sys.argv) > 2 else None)
