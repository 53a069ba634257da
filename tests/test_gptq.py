import pytest
import torch

from qdflash.errors import QdflashError
from qdflash.quant.apply import quantize_weights, replace_linears, select_linears
from qdflash.quant.gptq import HessianAccumulator, gptq_quantize, rtn_quantize
from qdflash.quant.grid import GridSpec
from qdflash.quant.quantlinear import QuantLinear


def correlated_layer(seed=0, n=2048, d_in=128, d_out=64):
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d_in, d_in, generator=g) * torch.linspace(0.05, 2.0, d_in)  # correlated, uneven scale
    x = torch.randn(n, d_in, generator=g) @ mixing
    w = torch.randn(d_out, d_in, generator=g)
    return x, w


def output_error(x, w, qw):
    return ((x @ w.T - x @ qw.dequantize().T) ** 2).mean().item()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("spec", [GridSpec(4, 32, True), GridSpec(3, 64, False), GridSpec(2, -1, True)])
def test_gptq_beats_rtn_on_correlated_inputs(spec, act_order):
    x, w = correlated_layer()
    acc = HessianAccumulator(w.shape[1])
    acc.add(x)
    gptq = gptq_quantize(w, acc.hessian(), spec, act_order=act_order)
    rtn = rtn_quantize(w, spec)
    assert output_error(x, w, gptq) < output_error(x, w, rtn)
    # same grid and format as RTN: scales from the original weights, ints in range
    assert torch.equal(gptq.scale, rtn.scale) and gptq.q.dtype == torch.int8
    assert gptq.q.min() >= spec.qmin and gptq.q.max() <= spec.qmax


def test_select_linears_defaults_keep_gdn_projections_16bit(tiny_qwen):
    names = select_linears(tiny_qwen.model)
    assert not any(n.endswith(("in_proj_a", "in_proj_b")) or n == "lm_head" for n in names)
    assert any(n.endswith("in_proj_qkv") for n in names) and any(n.endswith("in_proj_z") for n in names)
    assert any(n.endswith("linear_attn.out_proj") for n in names) and any(n.endswith("self_attn.q_proj") for n in names)


def test_pattern_matching_nothing_is_an_error(tiny_llama):
    with pytest.raises(QdflashError, match="'\\*.mlp.gate_projj' matches no linear"):
        select_linears(tiny_llama.model, include=["*.mlp.gate_projj"])


def test_group_size_must_divide(tiny_llama):
    names = select_linears(tiny_llama.model)
    with pytest.raises(QdflashError, match="does not divide in_features=64"):
        quantize_weights(tiny_llama.model, names, GridSpec(4, 128), method="rtn")


def test_quantized_model_runs_and_freeze_is_identity(tiny_llama):
    from qdflash.models import load_target

    target = load_target("tiny-llama", device="cpu")
    names = select_linears(target.model)
    weights = quantize_weights(target.model, names, GridSpec(4, 32), method="rtn")
    model = replace_linears(target.model, weights)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(input_ids=ids).logits
    module = next(m for m in model.modules() if isinstance(m, QuantLinear))
    ints = module.weight_int.clone()
    module.enable_fake_quant()
    torch.testing.assert_close(model(input_ids=ids).logits, before)
    module.freeze()
    assert torch.equal(module.weight_int, ints)
