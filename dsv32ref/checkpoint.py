"""HF-format checkpoints: load (fp8 128x128-block weights dequantised, MTP layers skipped), save, dummy init.

A released checkpoint stores most linear weights as float8_e4m3fn [out, in] with a `weight_scale_inv`
fp32 [ceil(out/128), ceil(in/128)]: W = fp8 * scale_inv, block by block. The embedding, lm_head, norms,
the router (`mlp.gate`) and `indexer.weights_proj` stay in bf16/fp32.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
import zlib

import torch

from dsv32ref.checks import (MAX_SEED, check_bool, check_device, check_fits, check_int, check_readable,
                             check_replaceable, check_tensor, is_int, module_bytes)
from dsv32ref.config import ModelConfig
from dsv32ref.hf_config import to_hf
from dsv32ref.reference.model import DeepseekV32ForCausalLM

__all__ = ["load_pretrained", "save_pretrained", "init_dummy_weights", "quantize_fp8_blocks",
           "dequantize_fp8_blocks"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_BF16_LINEARS = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "indexer.weights_proj.weight")


def _is_fp8_weight(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and not name.endswith(_BF16_LINEARS) and "norm" not in name


def _block(block) -> tuple[int, int]:
    if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(is_int(b) and b >= 1 for b in block)):
        raise ValueError(f"block: expected two ints >= 1 (rows, columns of a scale block), got {block!r}")
    return int(block[0]), int(block[1])


def _within(block: tuple[int, int], out_f: int, in_f: int) -> tuple[int, int]:
    """A block no larger than the weight: one past a dim's size covers it once, as one of that size does (the same
    scales), and pads or repeats nothing past it (a block of 2^28 rows asked for gigabytes)."""
    return min(block[0], max(out_f, 1)), min(block[1], max(in_f, 1))


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn [out, in], weight_scale_inv fp32 [ceil(out/bo), ceil(in/bi)])."""
    out_f, in_f = check_tensor("w", w, shape=(None, None), dtype=_FLOATS).shape
    bo, bi = _within(_block(block), out_f, in_f)
    bad = _nonfinite("w", w)  # a NaN would set its block's scale, an inf (or a float64 past fp32's range) too
    if bad:
        raise ValueError(f"w: expected finite values in float32's range, got {bad}")
    nbo, nbi = -(-out_f // bo), -(-in_f // bi)
    padded = torch.zeros(nbo * bo, nbi * bi, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(nbo, bo, nbi, bi)  # (row blocks, bo, col blocks, bi)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # (nbo, nbi)
    q = (blocks / scale_inv[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(nbo * bo, nbi * bi)[:out_f, :in_f].contiguous(), scale_inv


def dequantize_fp8_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float8 [out, in] * scale_inv [ceil(out/bo), ceil(in/bi)] broadcast over each block -> fp32 [out, in]. The
    scales must be floats, finite and > 0 (a NaN poisons its block, a zero zeroes it, a negative one flips it),
    and every product finite (q holding NaN, or a scale that takes a value past fp32's range, is refused)."""
    check_tensor("q", q, shape=(None, None), dtype=torch.float8_e4m3fn)
    check_tensor("weight_scale_inv", scale_inv, dtype=_FLOATS, device=q.device)
    as_used = scale_inv.float()  # what multiplies the weights: a float64 scale below fp32's range becomes 0
    bad = ~(torch.isfinite(as_used) & (as_used > 0))
    if bad.any():
        raise ValueError(f"weight_scale_inv: expected finite scales > 0 in fp32, got {int(bad.sum())} others, e.g. "
                         f"{scale_inv[bad][:4].tolist()}")
    out = _dequantize(q, scale_inv, block)
    if problem := _nonfinite("q * weight_scale_inv", out):
        raise ValueError(f"dequantize_fp8_blocks: {problem} (q holds NaN, or a scale takes a value past fp32's "
                         f"range)")
    return out


def _dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """dequantize_fp8_blocks without the scales' value checks (the loader reports those its own way)."""
    out_f, in_f = check_tensor("q", q, shape=(None, None), dtype=torch.float8_e4m3fn).shape
    check_tensor("weight_scale_inv", scale_inv, device=q.device)
    bo, bi = _within(_block(block), out_f, in_f)
    expected = (-(-out_f // bo), -(-in_f // bi))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv: expected shape {list(expected)} for a weight of {[out_f, in_f]}, "
                         f"got {list(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]
    return q.float() * s


# ---- loading ---------------------------------------------------------------------------------------

def _open_shards(path: str) -> dict[str, str]:
    """tensor name -> shard file, from the index json or the single file."""
    index = os.path.join(path, INDEX_FILE)
    check_readable(INDEX_FILE, index)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{INDEX_FILE}: no readable weight_map in {index!r} ({type(e).__name__}: {e})"[:300]
                             ) from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v and os.path.basename(v) == v
                for k, v in weight_map.items()):
            raise ValueError(f"{INDEX_FILE}: weight_map must map tensor names to shard file names in the same "
                             f"folder, got {str(weight_map)[:200]}")
        missing_files = sorted({fn for fn in weight_map.values() if not os.path.exists(os.path.join(path, fn))})
        if missing_files:
            raise ValueError(f"{INDEX_FILE}: shards listed but absent: {missing_files}")
        _check_index(path, weight_map)
        return {name: os.path.join(path, fn) for name, fn in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.exists(single):
        raise ValueError(f"checkpoint {path!r}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    return {name: single for name in _safe_keys(single)}


def _check_index(path: str, weight_map: dict[str, str]) -> None:
    """Each shard holds exactly the tensors the index maps to it (their headers only): a tensor the index does not
    list would be ignored, one it lists in the wrong shard not found."""
    problems = []
    for fn in sorted(set(weight_map.values())):
        keys, listed = set(_safe_keys(os.path.join(path, fn))), {k for k, v in weight_map.items() if v == fn}
        problems += [f"{fn} holds {k}, which {INDEX_FILE} does not map to it" for k in sorted(keys - listed)[:4]]
        problems += [f"{INDEX_FILE} maps {k} to {fn}, which does not hold it" for k in sorted(listed - keys)[:4]]
    if problems:
        raise ValueError(f"checkpoint {path!r}: its shards and {INDEX_FILE} disagree:\n  " + "\n  ".join(problems))


def _safe_keys(file: str) -> list[str]:
    from safetensors import safe_open

    check_readable(os.path.basename(file), file)
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{os.path.basename(file)}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _weight_block(config: ModelConfig) -> tuple[int, int]:
    block = (config.extra.get("quantization_config") or {}).get("weight_block_size", (128, 128))
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(is_int(b) and 0 < b < 2 ** 31 for b in block):
        raise ValueError(f"config.json: quantization_config.weight_block_size must be two ints in [1, 2^31), got "
                         f"{block!r}")
    return tuple(block)


def _inventory(where: dict, config: ModelConfig, expected: dict) -> tuple[set, list[str]]:
    """(the weights to load, the problems of the checkpoint's names): MTP layers skipped, scales beside their
    weights, every missing and unexpected name."""
    names, problems, skipped = set(), [], {}  # skipped: MTP layer -> whether it holds an eh_proj
    mtp = range(config.num_hidden_layers, config.num_hidden_layers + config.num_nextn_predict_layers)
    for name in where:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= config.num_hidden_layers:
            i = int(m.group(1))
            if i in mtp:  # MTP (next-token prediction) layers: not part of the causal LM
                skipped[i] = skipped.get(i, False) or ".eh_proj." in name
            else:
                problems.append(f"unexpected: {name} (layer {i}: the config has {config.num_hidden_layers} "
                                f"layers and {config.num_nextn_predict_layers} MTP layers)")
        elif name.endswith("_scale_inv"):
            if name[: -len("_scale_inv")] not in where:
                problems.append(f"unexpected: {name} (no weight {name[: -len('_scale_inv')]} beside it)")
        else:
            names.add(name)
    problems += [f"not an MTP layer: layer {i} (the config counts it as one, but it has no eh_proj: a decoder "
                 f"layer that num_hidden_layers leaves out?)" for i, has in sorted(skipped.items()) if not has]
    problems += [f"missing: {n}" for n in sorted(set(expected) - names)]
    problems += [f"unexpected: {n}" for n in sorted(names - set(expected))]
    return names & set(expected), problems


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _nonfinite(name: str, t: torch.Tensor) -> str | None:
    """'non-finite: name (n NaN, m inf)', or None where every value is finite."""
    f = t.float()
    nan, inf = int(f.isnan().sum()), int(f.isinf().sum())
    return f"non-finite: {name} ({nan} NaN, {inf} inf of {t.numel()})" if nan or inf else None


def _load_one(name: str, read, where: dict, block, want: torch.Size, dtype: torch.dtype,
              nonfinite: str) -> torch.Tensor | str:
    """One weight in the model's layout (fp8 blocks dequantised), or the problem with it."""
    t, scale_name = read(name), name + "_scale_inv"
    if t.dtype not in _FLOATS + (torch.float8_e4m3fn,):
        return f"wrong dtype: {name}: {t.dtype} (expected a float type or float8_e4m3fn)"
    if t.dtype != torch.float8_e4m3fn and scale_name in where:
        return f"unexpected: {scale_name} beside a {t.dtype} weight (scales belong to fp8 weights)"
    if tuple(t.shape) != tuple(want):  # before an fp8 weight is dequantised (to fp32: 4 bytes an element)
        return f"mis-shaped: {name}: expected {list(want)}, got {list(t.shape)}"
    if t.dtype == torch.float8_e4m3fn:
        if t.dim() != 2:
            return (f"mis-shaped: {name}: fp8 weights are 2-D (their scales cover blocks of rows and columns), got "
                    f"{list(t.shape)}")
        if scale_name not in where:
            return f"missing: {scale_name} (for fp8 tensor {name})"
        scale = read(scale_name)
        if scale.dtype not in _FLOATS:
            return f"wrong dtype: {scale_name}: {scale.dtype} (expected a float type)"
        bad = _nonfinite(scale_name, scale)
        problems = [bad] if bad and nonfinite == "raise" else []
        low = int((scale.float() <= 0).sum())  # zero zeroes its block, a negative one flips it: refused either way
        if low:
            problems.append(f"non-positive: {scale_name} ({low} of {scale.numel()} scales <= 0)")
        if problems:
            return "; ".join(problems)
        if bad:
            warnings.warn(f"load_pretrained: {bad}", stacklevel=3)
        try:
            t = _dequantize(t, scale, block)
        except ValueError as e:
            return f"mis-shaped: {scale_name}: {e}"
    bad = _nonfinite(name, t) or _nonfinite(f"{name} (in {dtype})", t.to(dtype))  # as loaded, then as held
    if bad and nonfinite == "raise":
        return bad
    if bad:
        warnings.warn(f"load_pretrained: {bad}", stacklevel=3)
    return t


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cpu", form: str = "absorbed",
                    deployed_numerics: bool = False, nonfinite: str = "raise") -> DeepseekV32ForCausalLM:
    """Build the model from an HF-format directory (config.json + safetensors, single or sharded).

    Raises ValueError naming every missing, unexpected, mis-shaped or non-finite tensor at once. A weight or
    fp8 scale (`weight_scale_inv`) holding NaN or inf is refused by default; `nonfinite="warn"` loads it with
    a warning naming the tensor and the count (to inspect a damaged checkpoint).
    """
    from safetensors import safe_open

    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"path: expected a checkpoint directory (config.json and safetensors), got {path!r}")
    path = os.fspath(path)
    if dtype not in _FLOATS:
        raise ValueError(f"dtype: expected a float dtype for the model, got {dtype}")
    device = check_device("load_pretrained: device", device)  # cpu or cuda (on meta: a model with no weights)
    if nonfinite not in ("raise", "warn"):
        raise ValueError(f"nonfinite: expected 'raise' or 'warn', got {nonfinite!r}")
    config = ModelConfig.from_hf(path)
    block = _weight_block(config)
    where = _open_shards(path)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, form, deployed_numerics)
    model = model.to(dtype)
    check_fits(f"load_pretrained: the model of {os.path.join(path, 'config.json')} in {dtype}",
               module_bytes(model), device)
    model = model.to_empty(device=device)  # RotaryEmbedding recomputes its frequencies here
    expected = model.state_dict()
    names, problems = _inventory(where, config, expected)
    handles: dict[str, object] = {}

    def read(name: str) -> torch.Tensor:
        file = where[name]
        try:
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            return handles[file].get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"{os.path.basename(file)}: cannot read tensor {name} ({type(e).__name__}: {e})") from None

    loaded = {name: _load_one(name, read, where, block, expected[name].shape, dtype, nonfinite)
              for name in sorted(names)}
    problems += [t for t in loaded.values() if isinstance(t, str)]
    if problems:
        raise ValueError(f"checkpoint {path!r} does not match config ({config.model_type}, "
                         f"{config.num_hidden_layers} layers):\n  " + "\n  ".join(problems))
    with torch.no_grad():
        for name, t in loaded.items():
            expected[name].copy_(t)
    return model.eval()


# ---- saving ----------------------------------------------------------------------------------------

def _shards(tensors: dict, max_shard_bytes: int | None) -> list[dict]:
    """The tensors in order, cut into shards of at most max_shard_bytes (a larger tensor alone in its shard)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_files(stage: str, shards: list[dict], config_json: dict) -> list[str]:
    """The shards (with their index when there are several), then config.json, into `stage`; returns the file
    names in the order they are to be moved into place."""
    from safetensors.torch import save_file

    if len(shards) == 1:
        save_file(shards[0], os.path.join(stage, SINGLE_FILE))
        order = [SINGLE_FILE]
    else:
        order, weight_map = [], {}
        for i, shard in enumerate(shards):
            fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(stage, fn))
            weight_map.update({name: fn for name in shard})
            order.append(fn)
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        with open(os.path.join(stage, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        order.append(INDEX_FILE)
    with open(os.path.join(stage, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    return order + ["config.json"]


def _check_against_config(model: DeepseekV32ForCausalLM) -> None:
    """The model's tensors are those its config describes (a resized or added one would be written into a
    checkpoint that load_pretrained refuses), and hold values (not on the meta device)."""
    have = model.state_dict()
    meta = [name for name, t in have.items() if t.is_meta]
    if meta:
        raise ValueError(f"save_pretrained: model: {len(meta)} tensors on the meta device hold no values, e.g. "
                         f"{meta[0]}")
    with torch.device("meta"):
        want = {k: v.shape for k, v in DeepseekV32ForCausalLM(model.config).state_dict().items()}
    wrong = [f"{k}: shape {list(t.shape)}, its config gives {list(want[k])}" for k, t in have.items()
             if k in want and t.shape != want[k]]
    wrong += [f"unexpected: {k}" for k in have if k not in want] + [f"missing: {k}" for k in want if k not in have]
    if wrong:
        raise ValueError("save_pretrained: the model's tensors are not those of its config:\n  "
                         + "\n  ".join(wrong[:8]))


def _check_untied(model: torch.nn.Module) -> None:
    """No two weights share memory (tied weights: safetensors refuses them, and the released checkpoints untie
    the embedding and the head): else a ValueError naming both, before anything is written."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in model.state_dict().items() if t.numel())
    for (_, end, first), (start, _, name) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"save_pretrained: {first} and {name} share memory (tied weights); the checkpoint "
                             f"holds each weight on its own: untie them (e.g. {name} = a clone) before saving")


def save_pretrained(model: DeepseekV32ForCausalLM, path: str | os.PathLike, *, fp8: bool = False,
                    max_shard_bytes: int | None = None, config_form: str = "released") -> None:
    """Write config.json and safetensors (fp8 128x128 blocks if fp8; several shards past max_shard_bytes).

    Every file is written into a staging folder beside `path` first and moved in only once all are written
    (shards, then the index, then config.json), so an interrupted save leaves an earlier checkpoint at
    `path` as it was."""
    if not isinstance(model, DeepseekV32ForCausalLM):
        raise ValueError(f"model: expected a DeepseekV32ForCausalLM, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path: expected a directory path, got {type(path).__name__}")
    path = os.fspath(path)
    if "\0" in str(path):
        raise ValueError(f"path: a path cannot hold a NUL character, got {path!r}")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"path: expected a directory to write the checkpoint into, got the file {path!r}")
    check_bool("fp8", fp8)
    if max_shard_bytes is not None and (not is_int(max_shard_bytes) or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes: expected None or an int >= 1, got {max_shard_bytes!r}")
    config_json = to_hf(model.config, form=config_form, who="save_pretrained: config_form")
    _check_against_config(model)
    _check_untied(model)
    bad = [b for name, t in model.state_dict().items() if (b := _nonfinite(name, t))]
    if bad:  # load_pretrained would refuse the checkpoint
        raise ValueError("save_pretrained: the model holds non-finite weights:\n  " + "\n  ".join(bad))
    if fp8:
        config_json["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                              "quant_method": "fp8", "weight_block_size": [128, 128]}
    tensors: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if fp8 and _is_fp8_weight(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(t)
        else:
            tensors[name] = t.contiguous()
    shards = _shards(tensors, max_shard_bytes)
    try:
        os.makedirs(path, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".save_pretrained.", dir=path)
    except OSError as e:
        raise ValueError(f"path: cannot create a checkpoint directory at {path!r} ({type(e).__name__}: {e})") from None
    try:
        order = _write_files(stage, shards, config_json)
        for fn in order + [INDEX_FILE]:  # before anything at `path` changes
            check_replaceable("path", os.path.join(path, fn))
        if len(shards) == 1 and os.path.exists(os.path.join(path, INDEX_FILE)):
            os.unlink(os.path.join(path, INDEX_FILE))  # an earlier sharded save's index would take precedence
        for fn in order:
            os.replace(os.path.join(stage, fn), os.path.join(path, fn))
    finally:
        shutil.rmtree(stage, ignore_errors=True)

# ---- dummy weights ---------------------------------------------------------------------------------

def tensor_generator(seed: int, name: str, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator of parameter `name`'s dummy values under `seed` (a bijection of the seeds in [0, 2^63): the
    multiplier is odd), so that a tensor's values depend on neither the order nor the other tensors."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 63)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Reproducible weights whose attention and top-k selection are not degenerate.

    Each tensor draws from its own generator seeded by (seed, name), on the CPU, so a tensor's values
    do not depend on the order or the device. Linear weights ~ N(0, 1/fan_in) keep every activation
    O(1); norm weights ~ 1 + N(0, 0.05^2), biases ~ N(0, 0.05^2), embeddings ~ N(0, 1). With these, the
    attention logits have a spread of order 1 (softmax neither uniform nor one-hot) and indexer scores
    differ between queries; `tests/test_checkpoint.py` checks both.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"init_dummy_weights: model: expected a torch.nn.Module, got {type(model).__name__}")
    check_int("init_dummy_weights: seed", seed, 0, MAX_SEED)
    for name, p in model.named_parameters():
        g = tensor_generator(seed, name)
        x = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("e_score_correction_bias"):
            x = 0.01 * x
        elif name.endswith("bias"):
            x = 0.05 * x
        elif "norm" in name:
            x = 1.0 + 0.05 * x
        elif name.endswith("embed_tokens.weight"):
            pass
        else:  # a linear [out, in]
            x = x / p.shape[-1] ** 0.5
        p.copy_(x.to(device=p.device, dtype=p.dtype))
    return model
