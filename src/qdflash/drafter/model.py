"""The DFlash block-diffusion drafter (docs/recipe.md "drafter").

A few non-causal Qwen3-style layers at the target's hidden size. The target's hidden states of the
layers `target_layer_ids` are concatenated -> `fc` -> RMSNorm: these *context features* are injected
as extra keys / values in every drafter layer (queries come only from the block). The drafter has no
embedding or LM head of its own: it embeds block tokens and reads logits through the target's,
frozen. Mask positions get a learned vector (`mask_token_id: null`) or the embedding of a reserved
token id of the target's vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..distill import lm_head_weight
from ..errors import QdflashError
from ..ops import apply_rope, rms_norm, rope_cos_sin
from .blocks import default_layer_ids


@dataclass
class DrafterConfig:
    hidden_size: int
    vocab_size: int
    target_num_layers: int
    num_layers: int = 1
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 16
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int | None = None  # None: a learned mask vector
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    seed: int = 0

    def validate(self) -> None:
        if self.block_size < 2:
            raise QdflashError(f"drafter block_size={self.block_size}: a block needs the anchor and at least one drafted token (>= 2)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_layers]
        if bad or not self.target_layer_ids:
            raise QdflashError(
                f"drafter target_layer_ids {self.target_layer_ids}: each must be in 0..{self.target_num_layers - 1} "
                f"(the target has {self.target_num_layers} layers)"
            )
        if self.num_heads % self.num_kv_heads:
            raise QdflashError(f"drafter num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise QdflashError(f"drafter mask_token_id={self.mask_token_id} is outside the vocabulary (0..{self.vocab_size - 1})")


def config_for_target(target, **overrides) -> DrafterConfig:
    """Defaults read off the target (hidden size, heads, MLP width, rope), then `overrides`."""
    tc = target.config
    heads = getattr(tc, "num_attention_heads", 8)
    base = dict(
        hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, target_num_layers=tc.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(tc, "num_key_value_heads", heads),
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1_000_000.0)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
    )
    base.update({k: v for k, v in overrides.items() if v is not None})
    if not base.get("target_layer_ids"):
        base["target_layer_ids"] = default_layer_ids(tc.num_hidden_layers)
    cfg = DrafterConfig(**base)
    cfg.validate()
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE; x [..., T, D], positions [..., T] (absolute positions in the sequence)."""
    return apply_rope(x, *rope_cos_sin(positions, x.shape[-1], theta, x.dtype))


@functools.cache
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def _training_backends(q: torch.Tensor, dtype: torch.dtype | None):
    """SDPA's kernels for training's bf16 attention (`dtype` given, CUDA): memory-efficient attention, the
    kernel the fp32 step runs, else the math one. Why: left to SDPA's own choice, the bf16 step was several
    times slower than the fp32 one on the H200, with a mean far above its median (the PROVENANCE of
    results/published/2026-12-03-h200-qwen-repeat). Since torch 2.11, SDPA prefers cuDNN attention for 16-bit
    inputs on Hopper, which plans a kernel per shape (batch lengths change every step here), and whose backward
    with an attn_mask gave NaN query gradients at some lengths (pytorch/pytorch#196678). Not yet timed with this
    choice. Elsewhere (inference, fp32, the CPU): SDPA's choice."""
    if dtype is None or not q.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def attend(q, k, v, mask, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over k, v [B, Hkv, Tk, D] under `mask`: a boolean tensor
    [B, Tq, Tk] (SDPA, dense: correct everywhere) or a flex_attention BlockMask (GPU: skips the
    masked tiles, which are most of them when many blocks share one context). `dtype`: the attention
    kernel runs in it (q, k, v cast; the output cast back to q's dtype), e.g. bf16 for an fp32 drafter
    in training (`Drafter.set_attention_dtype`); None: in q's dtype."""
    out_dtype = q.dtype
    if dtype is not None and dtype != q.dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if isinstance(mask, torch.Tensor):
        rep = q.shape[1] // k.shape[1]  # repeated, not enable_gqa: SDPA's fused kernels then accept the mask
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        with _training_backends(q, dtype):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None]).to(out_dtype)
    return _flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=True).to(out_dtype)


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.attention_dtype: torch.dtype | None = None  # `attend`'s dtype (Drafter.set_attention_dtype); not saved

    def _heads(self, x, n):
        return x.view(*x.shape[:-1], n, self.c.head_dim).transpose(-3, -2)  # [B, heads, T, D]

    def _project(self, x, names: tuple[str, ...], fused: dict | None) -> list[torch.Tensor]:
        """x through the linears `names`: one matmul over their concatenated rows where an inference engine
        holds one for them (`fused[names]`: DrafterEngine's, a projection such as engine.linear.Projection),
        else each linear alone (training, the reference path)."""
        projection = fused.get(names) if fused else None
        if projection is None:
            return [getattr(self, name)(x) for name in names]
        return list(projection(x).split([getattr(self, name).out_features for name in names], dim=-1))

    def _kv_heads(self, k, v, positions):
        """Keys (normed, rotated) and values [B, kv_heads, T, D] from the k / v projections at absolute `positions` [B, T]."""
        c = self.c
        return rotary(self.k_norm(self._heads(k, c.num_kv_heads)), positions[:, None], c.rope_theta), self._heads(v, c.num_kv_heads)

    def _kv(self, x, positions, fused: dict | None = None):
        """Keys (normed, rotated) and values of inputs x [B, T, H] at absolute `positions` [B, T]."""
        return self._kv_heads(*self._project(x, KV, fused), positions)

    def context_kv(self, context, positions, fused: dict | None = None):
        """K/V of context features [B, Tc, H]: they depend on nothing else, so inference caches them."""
        return self._kv(context, positions, fused)

    def block_qkv(self, h, q_pos, fused: dict | None = None):
        """The block's queries [B, heads, T, D] and its own keys and values [B, kv_heads, T, D]."""
        c = self.c
        q, k, v = self._project(self.input_norm(h), QKV, fused)
        return rotary(self.q_norm(self._heads(q, c.num_heads)), q_pos[:, None], c.rope_theta), *self._kv_heads(k, v, q_pos)

    def finish(self, h, attn, fused: dict | None = None):
        """The rest of the layer after its attention output attn [B, heads, T, D]."""
        h = h + self._project(attn.transpose(1, 2).reshape(*h.shape[:-1], -1), ("o_proj",), fused)[0]
        gate, up = self._project(self.post_norm(h), GATE_UP, fused)
        return h + self._project(F.silu(gate) * up, ("down_proj",), fused)[0]

    def _attend_block(self, h, q_pos, ctx_k, ctx_v, mask, fused: dict | None = None):
        q, block_k, block_v = self.block_qkv(h, q_pos, fused)
        return self.finish(h, attend(q, torch.cat([ctx_k, block_k], dim=2), torch.cat([ctx_v, block_v], dim=2), mask,
                                     self.attention_dtype), fused)

    def forward(self, h, context, q_pos, k_pos, mask):
        """h [B, Tq, H] block states; context [B, Tc, H] features (extra keys / values); k_pos [B, Tc + Tq]
        (the context's positions, then the block's); mask [B, Tq, Tc + Tq] bool or a flex BlockMask
        over the same shape (see `attend`)."""
        ctx_k, ctx_v = self._kv(context, k_pos[:, : context.shape[1]])
        return self._attend_block(h, q_pos, ctx_k, ctx_v, mask)

    def forward_cached(self, h, q_pos, ctx_k, ctx_v, mask, fused: dict | None = None):
        """The same layer for one block at inference, over cached context K/V (`context_kv`)."""
        return self._attend_block(h, q_pos, ctx_k, ctx_v, mask, fused)


# the linears a layer runs on one input, which an inference engine may run as one matmul each (`DrafterLayer._project`)
QKV, KV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("k_proj", "v_proj"), ("gate_proj", "up_proj")
PROJECTION_GROUPS = (QKV, KV, ("o_proj",), GATE_UP, ("down_proj",))


class Drafter(nn.Module):
    """DFlash drafter. The target's embedding and LM head are used through `bind(target)` and are
    never part of the drafter's own parameters (nor of its checkpoint)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.context_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(c.hidden_size)) if c.mask_token_id is None else None
        self._target = None

    def bind(self, target) -> "Drafter":
        tc = target.config
        if tc.hidden_size != self.config.hidden_size or tc.vocab_size != self.config.vocab_size:
            raise QdflashError(
                f"drafter was built for hidden size {self.config.hidden_size} / vocab {self.config.vocab_size}, "
                f"but target {getattr(target, 'name', '?')} has {tc.hidden_size} / {tc.vocab_size}"
            )
        if tc.num_hidden_layers != self.config.target_num_layers:
            raise QdflashError(f"drafter expects a target with {self.config.target_num_layers} layers, got {tc.num_hidden_layers}")
        object.__setattr__(self, "_target", target)  # a plain reference, not a submodule
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def set_attention_dtype(self, dtype: torch.dtype | None) -> "Drafter":
        """Run every layer's attention kernel in `dtype` (None: the weights' dtype), the rest as it is.
        Training's option (drafter_train.attention_bf16): the fp32 drafter's attention was the largest
        item of a cached training step on the H200 (results/published/2026-12-03-h200-drafter-copy)."""
        for layer in self.layers:
            layer.attention_dtype = dtype
        return self

    def context_features(self, target_hidden: torch.Tensor, fc=None) -> torch.Tensor:
        """[B, T, len(ids) * H] concatenated target hidden states -> [B, T, H] context features. `fc`: what runs
        the fc matmul (an inference engine's projection of it); None: the layer itself."""
        return self.context_norm((fc or self.fc)(target_hidden))

    def embed_block(self, block_ids: torch.Tensor) -> torch.Tensor:
        embed = self._target.model.get_input_embeddings()
        c = self.config
        with torch.no_grad():  # the target's embedding is frozen: never a gradient into it
            x = embed(block_ids.clamp_min(0))
        if c.mask_token_id is not None:
            return x
        is_mask = block_ids == -1
        return torch.where(is_mask[..., None], self.mask_embedding.to(x.dtype), x)

    @property
    def mask_id(self) -> int:
        """Id written at mask positions of a block (-1 = the learned mask vector)."""
        return -1 if self.config.mask_token_id is None else self.config.mask_token_id

    def head_weight(self) -> torch.Tensor:
        """The target's LM head [V, H], frozen (detached: never a gradient into it)."""
        return lm_head_weight(self._target.model).detach()

    def forward(self, block_ids, context, q_pos, k_pos, mask, target_hidden=None, head: bool = True) -> torch.Tensor:
        """Logits [B, Tq, V] for block tokens `block_ids` [B, Tq] given context features [B, Tc, H],
        or the target's hidden states `target_hidden` (context=None): then `fc` runs inside forward,
        which FSDP needs (it gathers a module's weights only for its forward). With `head=False`, the
        normed states [B, Tq, H] that the LM head would read (training applies the head itself, on
        the trained rows only: drafter.blocks.weighted_linear_block_loss_parts)."""
        if context is None:
            context = self.context_features(target_hidden)
        h = self.embed_block(block_ids).to(self.norm.weight.dtype)
        for layer in self.layers:
            h = layer(h, context, q_pos, k_pos, mask)
        if not head:
            return self.norm(h)
        weight = self.head_weight()
        return F.linear(self.norm(h).to(weight.dtype), weight)

    def forward_block(self, block_ids, q_pos, ctx_keys, ctx_values, ctx_pos, window: int | None = None, head=None) -> torch.Tensor:
        """Inference: logits [1, B, V] of one block over the cached context K/V of every layer.
        With `window`, a query at position q sees context positions k with q - k < window
        (symmetric |q - k| < window, which for context before the block is q - k < window).
        `head`: what computes the logits from the normed states (a packed head's Projection, as
        DrafterEngine's); None: the target's 16-bit LM head weight."""
        h = self.embed_block(block_ids).to(self.norm.weight.dtype)
        b = block_ids.shape[1]
        mask = torch.ones(1, b, ctx_pos.shape[1] + b, dtype=torch.bool, device=h.device)
        if window is not None:
            mask[..., : ctx_pos.shape[1]] = (q_pos[:, :, None] - ctx_pos[:, None, :]) < window
        for layer, k, v in zip(self.layers, ctx_keys, ctx_values):
            h = layer.forward_cached(h, q_pos, k, v, mask)
        if head is not None:
            return head(self.norm(h).to(head.dtype))
        weight = lm_head_weight(self._target.model)
        return F.linear(self.norm(h).to(weight.dtype), weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


QUANT_KEY = "quantization"  # config.json of a compressed drafter: its grid and quantized layers


def _quantized_layers(drafter: Drafter, quant: dict, state: dict, path: Path) -> None:
    """Empty QuantLinear layers where a compressed checkpoint has ints and scales (filled by load_state_dict)."""
    from ..quant.grid import GridSpec
    from ..quant.quantlinear import QuantLinear

    spec = GridSpec(int(quant["bits"]), int(quant["group_size"]), bool(quant["symmetric"]))
    for name in quant["layers"]:
        linear = drafter.get_submodule(name) if name in dict(drafter.named_modules()) else None
        if not isinstance(linear, nn.Linear) or f"{name}.weight_scale" not in state:
            raise QdflashError(f"{path}: quantized layer {name!r} is not a linear of this drafter or has no scales in the checkpoint")
        drafter.set_submodule(name, QuantLinear(linear.in_features, linear.out_features, False, spec,
                                                state[f"{name}.weight_scale"].dtype))


def init_drafter(target, **config_overrides) -> Drafter:
    """An untrained drafter for `target`, seeded (contract in docs/design.md)."""
    cfg = config_for_target(target, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        drafter = Drafter(cfg)
        for module in drafter.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        if drafter.mask_embedding is not None:
            nn.init.normal_(drafter.mask_embedding, std=0.02)
    device = next(target.model.parameters()).device
    return drafter.to(device).bind(target)


def save_drafter(drafter: Drafter, path: str | Path) -> None:
    """config.json + model.safetensors, written into a temporary folder renamed into place. A
    compressed drafter (QuantLinear layers) stores their ints and scales, and its grid under the
    config's "quantization" key, so load_drafter rebuilds the same layers."""
    from safetensors.torch import save_file

    from ..quant.quantlinear import QuantLinear

    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = asdict(drafter.config)
    quantized = {name: m for name, m in drafter.named_modules() if isinstance(m, QuantLinear)}
    if quantized:
        specs = {m.spec for m in quantized.values()}
        if len(specs) > 1:
            raise QdflashError(f"save_drafter: one grid per drafter, found {sorted(s.name for s in specs)}")
        spec = specs.pop()
        config[QUANT_KEY] = {"bits": spec.bits, "group_size": spec.group_size, "symmetric": spec.symmetric,
                             "layers": sorted(quantized)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}, tmp / "model.safetensors")
    if path.exists():
        shutil.rmtree(path)
    os.rename(tmp, path)


def check_drafter_folder(path: str | Path) -> Path:
    """`path` as a Path if it holds a saved drafter, else a QdflashError saying what it lacks (before any model
    loads: a script says so in one line, not after a minute of loading the target)."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise QdflashError(f"{path} is not a drafter checkpoint (expected config.json and model.safetensors; "
                           "scripts/airgap/fetch_drafter.sh says how to join one that came back from the H200)")
    return path


def load_drafter(path: str | Path, target, dtype: torch.dtype | None = None) -> Drafter:
    """Load a drafter saved by save_drafter and bind it to `target` (contract in docs/design.md).
    `dtype`: its floating weights cast to it (None: as saved; training saves fp32). For inference only:
    drafts only propose, so a drafter's dtype can change how many are accepted, never what the target
    emits."""
    from safetensors.torch import load_file

    path = check_drafter_folder(path)
    try:
        config = json.loads((path / "config.json").read_bytes().decode("utf-8"))
        if not isinstance(config, dict):
            raise TypeError(f"a JSON {type(config).__name__}, not an object")
        quant = config.pop(QUANT_KEY, None)
        cfg = DrafterConfig(**config)
    except (ValueError, TypeError) as err:  # not UTF-8 / JSON (ValueErrors), not an object, unknown or missing keys
        raise QdflashError(f"{path / 'config.json'} is not a drafter config written by save_drafter ({type(err).__name__}: {err})") from None
    drafter = Drafter(cfg)
    try:
        state = load_file(path / "model.safetensors")
    except Exception as err:  # safetensors raises several types on a damaged file
        raise QdflashError(f"{path / 'model.safetensors'} cannot be read ({err})") from None
    if quant is not None:
        _quantized_layers(drafter, quant, state, path)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise QdflashError(f"{path}: checkpoint does not match its config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    device = next(target.model.parameters()).device
    return drafter.to(device=device, dtype=dtype).bind(target)
