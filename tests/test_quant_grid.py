import pytest
import torch

from qdflash.errors import QdflashError
from qdflash.quant.grid import (
    GridSpec, compute_scale, dequantize, fake_quantize, in_range_mask, mse_clip_search, quantize, ste_fake_quantize,
)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [32, 64, -1])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_trip_and_range(bits, group, symmetric):
    torch.manual_seed(0)
    spec = GridSpec(bits, group, symmetric)
    w = torch.randn(16, 128)
    scale, zero = compute_scale(w, spec)
    q = quantize(w, scale, zero, spec)
    assert q.dtype == torch.int8 and q.min() >= spec.qmin and q.max() <= spec.qmax
    err = (dequantize(q, scale, zero, spec) - w).abs()
    step = scale.repeat_interleave(128 // scale.shape[1], dim=1)
    assert (err <= step / 2 + 1e-6).all()  # full range, no clipping: error at most half a step
    # dequantize -> quantize is the identity on grid values
    assert torch.equal(quantize(dequantize(q, scale, zero, spec), scale, zero, spec), q)


def test_symmetric_4bit_convention():
    spec = GridSpec(4, 32, True)
    assert (spec.qmin, spec.qmax) == (-8, 7)
    w = torch.zeros(1, 32)
    w[0, 3] = -3.5
    w[0, 5] = 1.0
    scale, zero = compute_scale(w, spec)
    assert zero is None and scale.item() == pytest.approx(3.5 / 7)
    assert quantize(w, scale, zero, spec)[0, 3].item() == -7


def test_scale_is_rounded_to_storage_dtype_first():
    w = torch.randn(4, 64)
    spec = GridSpec(4, 32, True)
    scale, _ = compute_scale(w, spec, scale_dtype=torch.bfloat16)
    assert torch.equal(scale, scale.to(torch.bfloat16).float())


def test_bad_bits_and_group():
    with pytest.raises(QdflashError, match="bits=5"):
        GridSpec(5, 32)
    with pytest.raises(QdflashError, match="group_size=48"):
        GridSpec(4, 48)
    with pytest.raises(QdflashError, match="does not divide in_features=576") as err:
        GridSpec(4, 128).groups(576, where="model.layers.0.mlp.up_proj")
    assert "model.layers.0.mlp.up_proj" in str(err.value) and "[32, 64]" in str(err.value)


def test_ste_passes_gradient_inside_and_blocks_it_outside_the_range():
    spec = GridSpec(4, 32, True)
    w = torch.randn(2, 32)
    scale, zero = compute_scale(w, spec, clip=0.5)  # half the range: the largest weights are clipped
    latent = w.clone().requires_grad_(True)
    out = ste_fake_quantize(latent, scale, zero, spec)
    assert torch.equal(out.detach(), fake_quantize(w, scale, zero, spec))
    out.sum().backward()
    inside = in_range_mask(w, scale, zero, spec)
    assert (~inside).any() and inside.any()
    assert torch.equal(latent.grad, inside.float())


def test_mse_clip_search_never_worse_than_full_range():
    torch.manual_seed(1)
    spec = GridSpec(3, 32, True)
    w = torch.randn(32, 256) * torch.rand(32, 256).pow(4)  # heavy-tailed, where clipping helps
    full = (fake_quantize(w, *compute_scale(w, spec), spec) - w).pow(2).sum()
    clip = mse_clip_search(w, spec)
    searched = (fake_quantize(w, *compute_scale(w, spec, clip), spec) - w).pow(2).sum()
    assert searched <= full and (clip < 1).any()


@pytest.mark.parametrize("symmetric", [True, False])
def test_latent_in_cell_rounds_back_to_the_same_ints(symmetric):
    from qdflash.quant.grid import latent_in_cell

    torch.manual_seed(3)
    spec = GridSpec(3, 32, symmetric)
    w = torch.randn(8, 64)
    scale, zero = compute_scale(w, spec)
    q = quantize(w, scale, zero, spec)
    shifted = (q.int() + torch.randint(-1, 2, q.shape)).clamp(spec.qmin, spec.qmax).to(torch.int8)  # GPTQ-like neighbours
    for ints in (q, shifted):
        latent = latent_in_cell(ints, scale, zero, spec, reference=w)
        assert torch.equal(quantize(latent, scale, zero, spec), ints)
        assert in_range_mask(latent, scale, zero, spec).all()  # never stuck outside (zero STE gradient)
    # RTN ints + reference: the latent keeps the original weight where it is representable
    inside = in_range_mask(w, scale, zero, spec)
    torch.testing.assert_close(latent_in_cell(q, scale, zero, spec, reference=w)[inside], w[inside], atol=1e-3 * scale.max().item(), rtol=0)
