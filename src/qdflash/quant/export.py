"""Export / import of quantized targets in the compressed-tensors `pack-quantized` format.

docs/design.md "Contracts": a quantized target is a folder that vLLM and SGLang load as W{bits}A16:

    out_dir/
      config.json          model config (`architectures` always set) + `quantization_config`
                           (compressed-tensors, pack-quantized) + our own notes under "qdflash"
                           (node, grid, source model, and `vllm_servable`: see `vllm_servable`)
      model.safetensors    per quantized linear: weight_packed (int32), weight_scale, weight_shape
                           (+ weight_zero_point when asymmetric); every other tensor in the target's
                           16-bit dtype (bf16 by default), also when the node ran in fp32
      tokenizer files
      dense/               the same model, dequantized to 16-bit, as a plain transformers folder

The compressed-tensors library does the packing (`pack_to_int32` / `unpack_from_int32`) and writes the
quantization config (`ModelCompressor.update_config`), so the bytes are exactly what its loaders expect.

Integer conventions. compressed-tensors always quantizes INT weights onto the *signed* range
[-2^(b-1), 2^(b-1) - 1], also for asymmetric grids (the zero point then lives in that range too), and
`pack_to_int32` adds 2^(b-1) before packing (so the bits on disk are unsigned, as vLLM's kernels read
them). grid.py uses the same signed range for both grids; should a grid ever use another range (e.g.
unsigned [0, 2^b - 1] for asymmetric), `_offset` shifts it onto the library's range, which leaves the
dequantized values (q - z) * s unchanged.

We pack our own ints rather than letting the library re-quantize a dequantized weight: the library's
quantizer (round-half-even of w / s + z, clamped to the signed range) gives the same ints for our
dequantized weights (tests/test_quant_export.py checks it), but packing the ints directly makes the
file equal QuantLinear.weight_int by construction.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from ..errors import QdflashError
from .apply import quant_linears as _quant_linears
from .grid import GridSpec
from .quantlinear import QuantizedWeight, QuantLinear

QUANT_METHOD = "compressed-tensors"
QUANT_FORMAT = "pack-quantized"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DENSE_DIR = "dense"
EXTRA_KEY = "qdflash"  # our own metadata inside config.json (ignored by transformers / vLLM)
TARGETS = ["Linear"]  # the llm-compressor convention: every Linear, minus `ignore`
# vLLM's compressed-tensors W{N}A16 path (CompressedTensorsWNA16) takes these bit widths only; other
# widths load in transformers / compressed-tensors but are refused by vLLM (and SGLang) at start-up.
VLLM_WNA16_BITS = (4, 8)


def vllm_servable(spec: GridSpec) -> tuple[bool, str]:
    """Whether vLLM can serve this grid, and why not: written into every export's config.json
    ("qdflash": {"vllm_servable", "vllm_note"}) so a user learns it before starting a server."""
    if spec.bits not in VLLM_WNA16_BITS:
        return False, (f"{spec.bits}-bit weights: vLLM's compressed-tensors W{{N}}A16 kernels take only "
                       f"{' or '.join(map(str, VLLM_WNA16_BITS))} bits; serve this target with qdflash or transformers")
    return True, f"vLLM loads {spec.bits}-bit pack-quantized weights (compressed-tensors W{spec.bits}A16)"


def export_tensor(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an export stores for one state-dict tensor: scales in their storage dtype (bit-exact, the
    grid QAD must keep), ints as they are, every other float in the 16-bit `dtype`."""
    if t.is_floating_point() and not name.endswith("weight_scale"):
        return t.to(dtype)
    return t


def sixteen_bit_dtype(model: nn.Module) -> torch.dtype:
    """The target's 16-bit dtype: the model's own where it runs in 16 bits, else bf16 (a node on the
    CPU runs in fp32, but the target it quantizes is a 16-bit model: the export stays one)."""
    dtype = next(model.parameters()).dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def round_like_export(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Round, in place, every tensor an export stores in 16 bits to `dtype` (default
    `sixteen_bit_dtype`), keeping the model's own dtype, so that what a node measures on the model in
    memory is what its export holds: the QAD node's step-0 check compares the reloaded artifact's KL
    with the PTQ node's."""
    dtype = dtype or sixteen_bit_dtype(model)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if t.is_floating_point():
                t.data.copy_(export_tensor(name, t.data, dtype).to(t.dtype))


# ----------------------------------------------------------------------------------------------
# grid <-> compressed-tensors conventions


def _offset(spec: GridSpec) -> int:
    """What to subtract from our ints to land on the library's signed range (0 when the ranges agree)."""
    return spec.qmin + 2 ** (spec.bits - 1)


def _to_library_ints(q: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    return (q.to(torch.int16) - _offset(spec)).to(torch.int8)


def _from_library_ints(q: torch.Tensor, spec: GridSpec) -> torch.Tensor:
    return (q.to(torch.int16) + _offset(spec)).to(torch.int8)


def quantization_scheme(spec: GridSpec, targets=TARGETS):
    """The compressed-tensors scheme for a weight-only grid (activations stay 16-bit: W{bits}A16)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    per_channel = spec.group_size == -1
    weights = QuantizationArgs(
        num_bits=spec.bits,
        type="int",
        symmetric=spec.symmetric,
        strategy="channel" if per_channel else "group",
        group_size=None if per_channel else spec.group_size,
        dynamic=False,
    )
    return QuantizationScheme(targets=list(targets), weights=weights)


def _spec_from_scheme(weights, where: str) -> GridSpec:
    """GridSpec from a compressed-tensors QuantizationArgs; only the grids QuantLinear can hold."""
    strategy = str(getattr(weights.strategy, "value", weights.strategy))
    kind = str(getattr(weights.type, "value", weights.type))
    if kind != "int" or strategy not in ("group", "channel"):
        raise QdflashError(f"{where}: expected int weights with strategy group or channel, got type={kind}, strategy={strategy}")
    try:
        return GridSpec(weights.num_bits, weights.group_size if strategy == "group" else -1, weights.symmetric)
    except QdflashError as e:
        raise QdflashError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------
# save


def _shared_spec(qlinears: dict[str, QuantLinear]) -> GridSpec:
    if not qlinears:
        raise QdflashError("save_quantized: the model has no QuantLinear modules; quantize it first")
    specs = {m.spec for m in qlinears.values()}
    if len(specs) > 1:
        raise QdflashError(f"save_quantized: all QuantLinear modules must share one grid, found {sorted(s.name for s in specs)}")
    spec = specs.pop()
    if spec.qmin < -128 or spec.qmax > 127:
        # QuantLinear keeps ints in int8: a grid beyond [-128, 127] cannot have been stored faithfully
        raise QdflashError(f"save_quantized: grid {spec.name} has ints in [{spec.qmin}, {spec.qmax}], which int8 cannot hold")
    return spec


def _check_linear(name: str, m: QuantLinear) -> None:
    spec = m.spec
    if m.latent is not None:
        raise QdflashError(f"save_quantized: {name} is in fake-quant (QAD) mode; call freeze() before exporting")
    q = m.weight_int
    lo, hi = int(q.min()), int(q.max())
    if lo < spec.qmin or hi > spec.qmax:
        # pack_to_int32 would silently spill such values into the neighbouring ints' bits
        raise QdflashError(f"save_quantized: {name}.weight_int has values in [{lo}, {hi}], outside the {spec.name} grid [{spec.qmin}, {spec.qmax}]")
    z = m.weight_zero_point
    if not spec.symmetric and (z is None or int(z.min()) < spec.qmin or int(z.max()) > spec.qmax):
        raise QdflashError(f"save_quantized: {name}.weight_zero_point is missing or outside [{spec.qmin}, {spec.qmax}]")


def _compress_linear(m: QuantLinear) -> dict[str, torch.Tensor]:
    """The pack-quantized tensors of one layer (local names), packed by the library."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    spec = m.spec
    tensors = {
        "weight_packed": pack_to_int32(_to_library_ints(m.weight_int.cpu(), spec), spec.bits),
        "weight_scale": m.weight_scale.detach().cpu(),  # storage dtype, bit-exact
        "weight_shape": torch.tensor(m.weight_int.shape),
    }
    if not spec.symmetric:
        # the library packs zero points along the output dim (dim 0), one int per group
        zero = _to_library_ints(m.weight_zero_point.cpu(), spec)
        tensors["weight_zero_point"] = pack_to_int32(zero, spec.bits, packed_dim=0)
    return tensors


def _drop_shared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory: keep the first name of each tied tensor (for a tied
    lm_head that is model.embed_tokens.weight, as transformers does); the loader re-ties them."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _packed_state_dict(model: nn.Module, qlinears: dict[str, QuantLinear], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = _drop_shared(model.state_dict())
    for name, m in qlinears.items():
        for local in ("weight_int", "weight_scale", "weight_zero_point"):
            state.pop(f"{name}.{local}", None)
        state.update({f"{name}.{k}": v for k, v in _compress_linear(m).items()})
    return {k: export_tensor(k, v.detach().cpu(), dtype).contiguous() for k, v in state.items()}


def _ignored_linears(model: nn.Module) -> list[str]:
    """Every plain nn.Linear stays 16-bit and must be named in `ignore`, since targets = all Linears."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def add_quantization_config(folder: Path, spec: GridSpec, ignore: list[str]) -> None:
    """Add the compressed-tensors `quantization_config` (pack-quantized, every Linear but `ignore`) to
    folder/config.json, written by the library itself (also used by the drafter's DFlash export)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    qconfig = QuantizationConfig(
        config_groups={"group_0": quantization_scheme(spec)},
        format=QUANT_FORMAT,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
    )
    ModelCompressor(quantization_config=qconfig).update_config(str(folder))


def _write_config(model: nn.Module, spec: GridSpec, ignore: list[str], folder: Path, extra: dict | None,
                  dtype: torch.dtype) -> None:
    config = copy.deepcopy(model.config)
    for key in ("quantization_config", EXTRA_KEY):
        if hasattr(config, key):
            delattr(config, key)
    # vLLM picks the model class from `architectures` and refuses a config without it; a model built
    # from a config (the tiny presets) has none until save_pretrained of the model itself sets it.
    config.architectures = [type(model).__name__]
    config.dtype = dtype  # what the unquantized tensors are stored in (from_pretrained's dtype="auto")
    untie_quantized_head(model, config)
    config.save_pretrained(folder)
    add_quantization_config(folder, spec, ignore)
    servable, note = vllm_servable(spec)
    path = folder / CONFIG_FILE
    data = json.loads(path.read_text())
    data[EXTRA_KEY] = {**(extra or {}), "vllm_servable": servable, "vllm_note": note}
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def dense_copy(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A plain transformers model: every QuantLinear replaced by an nn.Linear holding its dequantized weight."""
    dense = copy.deepcopy(model)
    for name, m in list(_quant_linears(dense).items()):
        linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device=m.weight_int.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(m.dequantized_weight(dtype))
            if m.bias is not None:
                linear.bias.copy_(m.bias)
        dense.set_submodule(name, linear)
    for key in ("quantization_config", EXTRA_KEY):
        if hasattr(dense.config, key):
            delattr(dense.config, key)
    untie_quantized_head(model, dense.config)
    return dense.to(dtype)


def untie_quantized_head(model: nn.Module, config) -> None:
    """A quantized LM head (`lm_head` not in quant.exclude) is no longer the input embedding: a config
    that still said tie_word_embeddings would make a loader tie the head back to the 16-bit embedding
    (transformers warns and keeps both only because the values differ)."""
    if isinstance(model.get_output_embeddings(), QuantLinear) and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False


def _new_folder(out_dir: Path) -> Path:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise QdflashError(f"save_quantized: {out_dir} already exists and is not empty; choose a new folder or delete it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def save_quantized(model, tokenizer, out_dir, *, dtype: torch.dtype | None = None, extra: dict | None = None) -> None:
    """Write `model` (QuantLinear modules in packed mode, one shared GridSpec) as a compressed-tensors
    pack-quantized folder plus a dense twin in out_dir/dense; `dtype` (default `sixteen_bit_dtype`):
    of the unquantized tensors and of the twin. `extra`: notes stored under config.json's "qdflash" key
    (beside `vllm_servable`). Atomic: everything is written into a temporary sibling folder that is
    renamed into place at the end."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    dtype = dtype or sixteen_bit_dtype(model)
    qlinears = _quant_linears(model)
    spec = _shared_spec(qlinears)
    for name, m in qlinears.items():
        _check_linear(name, m)

    tmp = _new_folder(out_dir)
    try:
        _write_config(model, spec, _ignored_linears(model), tmp, extra, dtype)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_file(_packed_state_dict(model, qlinears, dtype), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        dense = dense_copy(model, dtype)
        dense.save_pretrained(tmp / DENSE_DIR)
        del dense
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / DENSE_DIR)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------------------------
# load


def _read_config(path: Path) -> tuple[dict, GridSpec, list[str], list[str]]:
    """config.json -> (model config without quantization keys, grid, targets, ignore)."""
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise QdflashError(f"load_quantized: {path} is not a folder (expected a folder written by save_quantized)")
    if not file.is_file():
        raise QdflashError(f"load_quantized: {file} not found (expected a transformers config.json with a quantization_config)")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise QdflashError(f"load_quantized: {file} is not valid JSON ({e})") from None
    qc = data.pop("quantization_config", None)
    data.pop(EXTRA_KEY, None)
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD or qc.get("format") != QUANT_FORMAT:
        found = None if not isinstance(qc, dict) else {k: qc.get(k) for k in ("quant_method", "format")}
        raise QdflashError(
            f"load_quantized: {file} has no compressed-tensors pack-quantized quantization_config "
            f"(expected quant_method={QUANT_METHOD!r}, format={QUANT_FORMAT!r}; found {found})"
        )
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise QdflashError(f"load_quantized: {file}: expected exactly one config group, found {len(groups)}")
    from compressed_tensors.quantization import QuantizationScheme

    try:
        scheme = QuantizationScheme.model_validate(next(iter(groups.values())))
    except ValueError as e:
        raise QdflashError(f"load_quantized: {file}: invalid quantization scheme ({e})") from None
    if scheme.weights is None or scheme.input_activations is not None or scheme.output_activations is not None:
        raise QdflashError(f"load_quantized: {file}: expected a weight-only scheme (W{{bits}}A16)")
    spec = _spec_from_scheme(scheme.weights, str(file))
    return data, spec, list(scheme.targets), list(qc.get("ignore") or [])


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not file.is_file():
        raise QdflashError(f"load_quantized: {file} not found (expected the packed weights written by save_quantized)")
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own SafetensorError, OSError, ...
        raise QdflashError(f"load_quantized: cannot read {file}: {e} (the file is truncated or corrupted; re-export it)") from None


def _take(tensors: dict, key: str, shape: tuple, file: Path, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = tensors.pop(key, None)
    if t is None:
        raise QdflashError(f"load_quantized: {file} has no tensor {key!r} (expected shape {list(shape)})")
    if tuple(t.shape) != tuple(shape) or (dtype is not None and t.dtype != dtype):
        want = f"{list(shape)}" + (f" {dtype}" if dtype is not None else "")
        raise QdflashError(f"load_quantized: {file}: tensor {key!r} is {list(t.shape)} {t.dtype}, expected {want}")
    return t


def _check_range(name: str, q: torch.Tensor, spec: GridSpec, file: Path) -> None:
    lo, hi = int(q.min()), int(q.max())
    if lo < spec.qmin or hi > spec.qmax:
        raise QdflashError(f"load_quantized: {file}: {name} has ints in [{lo}, {hi}], outside the {spec.name} grid [{spec.qmin}, {spec.qmax}]")


def _load_linear(name: str, linear: nn.Linear, tensors: dict, spec: GridSpec, file: Path) -> QuantLinear:
    """Pop the pack-quantized tensors of one layer and build its QuantLinear (ints unpacked by the library)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out, inp = linear.out_features, linear.in_features
    groups = spec.groups(inp, name)
    packed = _take(tensors, f"{name}.weight_packed", (out, math.ceil(inp * spec.bits / 32)), file, torch.int32)
    shape = _take(tensors, f"{name}.weight_shape", (2,), file)
    if shape.tolist() != [out, inp]:
        raise QdflashError(f"load_quantized: {file}: {name}.weight_shape is {shape.tolist()}, expected {[out, inp]}")
    scale = _take(tensors, f"{name}.weight_scale", (out, groups), file)
    q = _from_library_ints(unpack_from_int32(packed, spec.bits, torch.Size((out, inp))), spec)
    _check_range(f"{name}.weight_packed", q, spec, file)
    zero = None
    if not spec.symmetric:
        zp = _take(tensors, f"{name}.weight_zero_point", (math.ceil(out * spec.bits / 32), groups), file, torch.int32)
        zero = _from_library_ints(unpack_from_int32(zp, spec.bits, torch.Size((out, groups)), packed_dim=0), spec)
        _check_range(f"{name}.weight_zero_point", zero, spec, file)
    return QuantLinear.from_quantized(linear, QuantizedWeight(q, scale, zero, spec))


def _load_rest(model: nn.Module, tensors: dict, dtype: torch.dtype, file: Path) -> None:
    """Every non-quantized tensor; names missing from the file are fine only when tied to one present."""
    expected = model.state_dict()
    quant_buffers = {f"{n}.{b}" for n in _quant_linears(model) for b in ("weight_int", "weight_scale", "weight_zero_point")}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise QdflashError(f"load_quantized: {file} has tensors the model does not have: {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    loaded = {}
    for key, t in tensors.items():
        if tuple(t.shape) != tuple(expected[key].shape):
            raise QdflashError(f"load_quantized: {file}: tensor {key!r} is {list(t.shape)}, expected {list(expected[key].shape)}")
        loaded[key] = t.to(dtype) if t.is_floating_point() else t
    present = {expected[k].data_ptr() for k in loaded}
    for key, t in expected.items():
        if key not in loaded and key not in quant_buffers and t.data_ptr() not in present:
            raise QdflashError(f"load_quantized: {file} has no tensor {key!r} (expected shape {list(t.shape)})")
    model.load_state_dict(loaded, strict=False)


def _skip_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older/newer transformers: just pay for the random init
        return contextlib.nullcontext()
    return no_init_weights()


def load_quantized(path, *, device=None, dtype=None):
    """Rebuild a model saved by save_quantized -> (model, tokenizer, GridSpec). Quantized linears come back
    as QuantLinear with the exact ints and the scales in their stored dtype; `dtype` (default float32)
    applies to every other parameter, `device` defaults to cpu."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from compressed_tensors.utils import match_named_modules

    path = Path(path)
    dtype = dtype or torch.float32
    config_dict, spec, targets, ignore = _read_config(path)
    tensors = _read_tensors(path / WEIGHTS_FILE)

    # Build from our config dict without quantization_config, so transformers does not apply its own
    # compressed-tensors integration (which would expect to own the quantized modules).
    model_type = config_dict.pop("model_type", None)
    config = AutoConfig.for_model(model_type, **config_dict)
    with _skip_init():  # every weight is loaded below; random init would only cost time
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # part of the skipped init in transformers 5: tie lm_head to embed_tokens again
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)

    file = path / WEIGHTS_FILE
    chosen = [(n, m) for n, m in match_named_modules(model, targets, ignore) if type(m) is nn.Linear]
    for name, linear in chosen:
        model.set_submodule(name, _load_linear(name, linear, tensors, spec, file))
    _load_rest(model, tensors, dtype, file)
    model.eval()

    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    return model.to(device or "cpu"), tokenizer, spec


def read_extra(path) -> dict | None:
    """The notes stored under config.json's "qdflash" key (save_quantized's `extra` and
    `vllm_servable` / `vllm_note`), or None."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise QdflashError(f"read_extra: {file} not found")
    return json.loads(file.read_text()).get(EXTRA_KEY)
