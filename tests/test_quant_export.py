"""compressed-tensors pack-quantized export (docs/design.md "Contracts"): round trips, the library's own
decompressor, the dense twin, tied embeddings, Gated DeltaNet layers kept 16-bit, and clear errors."""

import copy
import json
import shutil

import pytest
import torch

from safetensors.torch import load_file, save_file
from torch import nn

from qdflash.errors import QdflashError
from qdflash.quant.export import (
    _from_library_ints,
    _to_library_ints,
    load_quantized,
    quantization_scheme,
    read_extra,
    round_like_export,
    save_quantized,
)
from qdflash.quant.apply import quant_linears, quantize_weights, replace_linears, select_linears
from qdflash.quant.grid import GridSpec
from qdflash.quant.quantlinear import QuantLinear

IDS = torch.tensor([[1, 5, 42, 7, 99, 3, 250, 11]])


def quantize_model(model: nn.Module, spec: GridSpec, scale_dtype=torch.bfloat16) -> nn.Module:
    """A quantized copy (RTN): every nn.Linear except lm_head / GDN in_proj_a, in_proj_b becomes a
    QuantLinear; its 16-bit tensors rounded to bf16 as an export stores them (as quantize_target does),
    so that a round trip can be exact."""
    model = copy.deepcopy(model)
    weights = quantize_weights(model, select_linears(model), spec, method="rtn", scale_dtype=scale_dtype)
    model = replace_linears(model, weights).eval()
    round_like_export(model)
    return model


quant_modules = quant_linears


@torch.no_grad()
def logits(model):
    return model(input_ids=IDS).logits


def assert_same_quant(a, b):
    qa, qb = quant_modules(a), quant_modules(b)
    assert qa.keys() == qb.keys() and qa
    for name in qa:
        x, y = qa[name], qb[name]
        assert x.spec == y.spec
        assert torch.equal(x.weight_int, y.weight_int), name
        assert x.weight_scale.dtype == y.weight_scale.dtype, name
        assert torch.equal(x.weight_scale, y.weight_scale), name  # bit-identical: bf16 -> bf16
        if x.weight_zero_point is None:
            assert y.weight_zero_point is None
        else:
            assert torch.equal(x.weight_zero_point, y.weight_zero_point), name


@pytest.fixture(scope="module")
def llama_w4(tiny_llama, tmp_path_factory):
    model = quantize_model(tiny_llama.model, GridSpec(4, 32, True))
    path = tmp_path_factory.mktemp("export") / "w4g32"
    save_quantized(model, tiny_llama.tokenizer, path, extra={"variant": "w4g32", "bits": 4})
    return model, path


def export_roundtrip(target, spec, tmp_path):
    model = quantize_model(target.model, spec)
    save_quantized(model, None, tmp_path / spec.name)  # no tokenizer: faster, and covered elsewhere
    loaded, tok, loaded_spec = load_quantized(tmp_path / spec.name)
    assert loaded_spec == spec and tok is None
    return model, loaded, tmp_path / spec.name


# -- (1) round trip --------------------------------------------------------------------------------
def test_roundtrip_ints_scales_logits(llama_w4, tokenizer):
    model, path = llama_w4
    loaded, tok, spec = load_quantized(path)
    assert spec == GridSpec(4, 32, True)
    assert_same_quant(model, loaded)
    assert torch.equal(logits(model), logits(loaded))
    assert tok("hello world").input_ids == tokenizer("hello world").input_ids
    assert not list(path.parent.glob(".*tmp*"))  # the temporary folder was renamed away


def test_config_and_tensor_layout(llama_w4):
    model, path = llama_w4
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    assert group["input_activations"] is None  # W4A16
    assert qc["ignore"] == ["lm_head"]
    assert read_extra(path) == {"variant": "w4g32", "bits": 4, "vllm_servable": True, "vllm_note": read_extra(path)["vllm_note"]}
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"

    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{name}.weight_packed"].dtype == torch.int32
    assert tensors[f"{name}.weight_packed"].shape == (64, 64 * 4 // 32)
    assert tensors[f"{name}.weight_scale"].dtype == torch.bfloat16
    assert tensors[f"{name}.weight_shape"].tolist() == [64, 64]
    assert f"{name}.weight_zero_point" not in tensors and f"{name}.weight" not in tensors
    assert not any(k.endswith(("weight_int", "latent")) for k in tensors)


# -- (2) the library's own decompressor / quantizer agree with ours ---------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
def test_library_decompress_and_compress_match(tiny_llama, tmp_path, symmetric):
    from compressed_tensors.compressors import PackedQuantizationCompressor

    spec = GridSpec(4, 32, symmetric)
    model = quantize_model(tiny_llama.model, spec)
    save_quantized(model, None, tmp_path / "q")
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    scheme = quantization_scheme(spec)
    keys = ["weight_packed", "weight_scale", "weight_shape"] + ([] if symmetric else ["weight_zero_point"])
    for name, m in quant_modules(model).items():
        saved = {k: tensors[f"{name}.{k}"] for k in keys}
        # decompress dequantizes in the scale's dtype (bf16); ours is exact in fp32, then rounded once
        weight = PackedQuantizationCompressor.decompress(dict(saved), scheme)["weight"]
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, m.dequantized_weight(torch.bfloat16)), name
        # the library's quantizer (round(w / s) + z, clamped) gives back our exact ints from our weights
        zero = None if symmetric else _to_library_ints(m.weight_zero_point, spec)
        sd = {"weight": m.dequantized_weight(torch.float32), "weight_scale": m.weight_scale, "weight_zero_point": zero}
        packed = PackedQuantizationCompressor.compress(sd, scheme)
        assert torch.equal(packed["weight_packed"], saved["weight_packed"]), name
        if not symmetric:
            assert torch.equal(packed["weight_zero_point"], saved["weight_zero_point"]), name


def test_transformers_compressed_tensors_integration_loads_it(llama_w4):
    # transformers' own compressed-tensors loader (ModelCompressor -> PackedQuantizationCompressor) reads
    # the folder as-is and computes our logits. (Symmetric only: for asymmetric grids compressed-tensors
    # 0.20 sizes its zero-point placeholder unpacked on load, so transformers rejects the packed one that
    # its own compressor writes and vLLM reads.)
    from transformers import AutoModelForCausalLM

    model, path = llama_w4
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.testing.assert_close(logits(hf), logits(model), rtol=1e-5, atol=1e-5)


def test_library_int_conventions():
    # whatever range the grid uses, the library sees its signed range [-2^(b-1), 2^(b-1) - 1] and
    # pack_to_int32 writes q + 2^(b-1): the unsigned ints vLLM's kernels read
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    for spec in (GridSpec(4, 32, True), GridSpec(4, 32, False)):
        q = torch.arange(spec.qmin, spec.qmax + 1, dtype=torch.int8).repeat(2, 2)
        lib = _to_library_ints(q, spec)
        assert (int(lib.min()), int(lib.max())) == (-8, 7)
        assert torch.equal(_from_library_ints(lib, spec), q)
        word = pack_to_int32(lib, 4)[0, 0].item() & 0xFFFFFFFF
        assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(range(8))


def test_an_fp32_model_exports_its_16_bit_tensors_in_bf16_and_names_its_architecture(tiny_qwen, tmp_path):
    """A node that ran in fp32 still writes a 16-bit artifact: unquantized tensors (embeddings, norms,
    the 16-bit linears) in bf16, scales in their storage dtype; `architectures` even for a model built
    from a config (tiny-qwen3.5 had none: vLLM refuses such a config)."""
    model = copy.deepcopy(tiny_qwen.model)
    weights = quantize_weights(model, select_linears(model), GridSpec(4, 32, True), method="rtn", scale_dtype=torch.float32)
    model = replace_linears(model, weights).eval()
    assert model.dtype == torch.float32 and not model.config.architectures
    save_quantized(model, None, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__] and config["dtype"] == "bfloat16"
    assert "qdflash" not in config["qdflash"]  # one level of our own notes, not two
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    floats = {k: t.dtype for k, t in tensors.items() if t.is_floating_point()}
    assert {d for k, d in floats.items() if k.endswith("weight_scale")} == {torch.float32}
    assert {d for k, d in floats.items() if not k.endswith("weight_scale")} == {torch.bfloat16}
    assert "model.embed_tokens.weight" in floats
    # what round_like_export does in memory is what the artifact holds
    round_like_export(model)
    loaded, _, _ = load_quantized(tmp_path / "q")
    assert torch.equal(logits(model), logits(loaded))


@pytest.mark.parametrize("bits, servable", [(2, False), (3, False), (4, True), (8, True)])
def test_every_export_says_whether_vllm_can_serve_it(tiny_llama, tmp_path, bits, servable):
    """vLLM's compressed-tensors W{N}A16 path takes 4 or 8 bits: other widths carry the marker."""
    save_quantized(quantize_model(tiny_llama.model, GridSpec(bits, 32, True)), None, tmp_path / "q")
    extra = read_extra(tmp_path / "q")
    assert extra["vllm_servable"] is servable
    assert ("vLLM" in extra["vllm_note"]) and (servable or f"{bits}-bit" in extra["vllm_note"])


# -- (3) asymmetric, (4) other bit widths and per-channel -------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [GridSpec(4, 32, False), GridSpec(2, 32, True), GridSpec(3, 32, True), GridSpec(8, 32, True),
     GridSpec(8, 32, False), GridSpec(4, -1, True), GridSpec(3, -1, False)],
    ids=lambda s: s.name,
)
def test_roundtrip_grids(tiny_llama, tmp_path, spec):
    model, loaded, path = export_roundtrip(tiny_llama, spec, tmp_path)
    assert_same_quant(model, loaded)
    assert torch.equal(logits(model), logits(loaded))
    w = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert w["strategy"] == ("channel" if spec.group_size == -1 else "group")
    assert w["symmetric"] == spec.symmetric and w["num_bits"] == spec.bits
    if not spec.symmetric:
        tensors = load_file(path / "model.safetensors")
        assert tensors["model.layers.0.mlp.up_proj.weight_zero_point"].dtype == torch.int32


def test_load_dtype_and_device(llama_w4):
    model, path = llama_w4
    loaded, _, _ = load_quantized(path, dtype=torch.bfloat16, device="cpu")
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    assert loaded.model.layers[0].mlp.up_proj.weight_scale.dtype == torch.bfloat16  # stored dtype, not `dtype`
    assert_same_quant(model, loaded)


# -- (5) dense twin ---------------------------------------------------------------------------------
def test_dense_twin_loads_with_plain_transformers(llama_w4):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, path = llama_w4
    dense = AutoModelForCausalLM.from_pretrained(path / "dense").eval()
    assert "quantization_config" not in json.loads((path / "dense" / "config.json").read_text())
    assert dense.dtype == torch.bfloat16
    assert not quant_modules(dense)
    AutoTokenizer.from_pretrained(path / "dense")
    for name, m in quant_modules(model).items():
        assert torch.equal(dense.get_submodule(name).weight, m.dequantized_weight(torch.bfloat16)), name
    ref = logits(model)
    got = logits(dense).float()
    # bf16 weights (q * s rounded once) and bf16 activations: close, not equal (random tiny model, so
    # near-tied logits make an argmax comparison meaningless)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()


# -- (6) tied embeddings ----------------------------------------------------------------------------
def test_tied_embeddings_stay_tied(llama_w4):
    model, path = llama_w4
    assert "lm_head.weight" not in load_file(path / "model.safetensors")  # stored once, as embed_tokens
    loaded, _, _ = load_quantized(path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_quantized_tied_head_is_untied_and_round_trips(tiny_llama, tmp_path):
    """`lm_head` not in quant.exclude: the tied head becomes its own QuantLinear, the embedding stays
    16-bit; the export says tie_word_embeddings false (else a loader would tie the head back to the
    embedding), and both our loader and plain transformers (the dense twin) get the quantized head."""
    from transformers import AutoModelForCausalLM

    model = copy.deepcopy(tiny_llama.model)
    assert model.config.tie_word_embeddings
    names = select_linears(model, ["*"], ["*embed*"])
    assert "lm_head" in names
    model = replace_linears(model, quantize_weights(model, names, GridSpec(4, 32, True), method="rtn")).eval()
    round_like_export(model)
    assert isinstance(model.lm_head, QuantLinear) and model.model.embed_tokens.weight.shape == (model.lm_head.out_features, model.lm_head.in_features)
    save_quantized(model, None, tmp_path / "q")
    for folder in (tmp_path / "q", tmp_path / "q" / "dense"):
        assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is False
    loaded, _, _ = load_quantized(tmp_path / "q")
    assert isinstance(loaded.lm_head, QuantLinear) and "lm_head" in quant_modules(loaded)
    assert_same_quant(model, loaded)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert torch.equal(logits(loaded), logits(model))
    dense = AutoModelForCausalLM.from_pretrained(tmp_path / "q" / "dense").eval()
    assert dense.lm_head.weight.data_ptr() != dense.model.embed_tokens.weight.data_ptr()
    assert torch.equal(dense.lm_head.weight, model.lm_head.dequantized_weight(torch.bfloat16))


# -- (7) Qwen3.5: Gated DeltaNet in_proj_a / in_proj_b stay 16-bit -----------------------------------
def test_qwen35_keeps_in_proj_a_b_dense(tiny_qwen, tmp_path):
    model, loaded, path = export_roundtrip(tiny_qwen, GridSpec(4, 32, True), tmp_path)
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    kept = [n for n, m in loaded.named_modules() if n.endswith(("in_proj_a", "in_proj_b"))]
    assert kept and all(type(loaded.get_submodule(n)) is nn.Linear for n in kept)
    assert set(ignore) == set(kept) | {"lm_head"}
    assert any(n.endswith("in_proj_qkv") for n in quant_modules(loaded))
    assert_same_quant(model, loaded)
    assert torch.equal(logits(model), logits(loaded))


# -- (8) errors -------------------------------------------------------------------------------------
@pytest.fixture
def copy_of(llama_w4, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(llama_w4[1], dst)
    return dst


def test_error_truncated_safetensors(copy_of):
    file = copy_of / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(QdflashError, match=r"model\.safetensors.*truncated or corrupted"):
        load_quantized(copy_of)


def test_error_missing_tensor(copy_of):
    file = copy_of / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(file))
    with pytest.raises(QdflashError, match=r"model\.safetensors has no tensor 'model\.layers\.1\.mlp\.down_proj\.weight_scale'"):
        load_quantized(copy_of)


def test_error_missing_dense_tensor(copy_of):
    file = copy_of / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.norm.weight"]
    save_file(tensors, str(file))
    with pytest.raises(QdflashError, match=r"no tensor 'model\.norm\.weight'"):
        load_quantized(copy_of)


def test_error_wrong_shape(copy_of):
    file = copy_of / "model.safetensors"
    tensors = load_file(file)
    key = "model.layers.0.mlp.up_proj.weight_packed"
    tensors[key] = tensors[key][:, :4].contiguous()
    save_file(tensors, str(file))
    with pytest.raises(QdflashError, match=r"up_proj\.weight_packed' is \[128, 4\].*expected \[128, 8\]"):
        load_quantized(copy_of)


def test_error_int_out_of_range_on_save(tiny_llama, tmp_path):
    model = quantize_model(tiny_llama.model, GridSpec(4, 32, True))
    model.model.layers[0].mlp.up_proj.weight_int[0, 0] = 8  # 4-bit symmetric grid is [-8, 7]
    with pytest.raises(QdflashError, match=r"up_proj\.weight_int has values in \[-?\d+, 8\], outside .* \[-8, 7\]"):
        save_quantized(model, None, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not list(tmp_path.iterdir())


def test_error_int_out_of_range_on_load(copy_of, monkeypatch):
    # unpack_from_int32 cannot yield out-of-range ints from any int32 words (b bits per int), so the
    # check guards against a misbehaving unpack: simulate one that shifts the ints up by 2
    import compressed_tensors.compressors.pack_quantized.helpers as helpers

    real = helpers.unpack_from_int32
    monkeypatch.setattr(helpers, "unpack_from_int32", lambda *a, **k: real(*a, **k).clamp(max=6) + 2)
    with pytest.raises(QdflashError, match=r"model\.safetensors: .*weight_packed has ints in \[-?\d+, 8\], outside the w4g32 grid \[-8, 7\]"):
        load_quantized(copy_of)


def test_error_missing_folder_and_config(copy_of, tmp_path):
    with pytest.raises(QdflashError, match="is not a folder"):
        load_quantized(tmp_path / "nope")
    (copy_of / "config.json").unlink()
    with pytest.raises(QdflashError, match=r"config\.json not found"):
        load_quantized(copy_of)


def test_error_missing_safetensors(copy_of):
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(QdflashError, match=r"model\.safetensors not found"):
        load_quantized(copy_of)


def test_error_config_without_quantization(copy_of):
    file = copy_of / "config.json"
    config = json.loads(file.read_text())
    del config["quantization_config"]
    file.write_text(json.dumps(config))
    with pytest.raises(QdflashError, match=r"config\.json has no compressed-tensors pack-quantized quantization_config"):
        load_quantized(copy_of)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    file.write_text(json.dumps(config))
    with pytest.raises(QdflashError, match="int-quantized"):
        load_quantized(copy_of)


def test_error_out_dir_not_empty(llama_w4, tokenizer):
    model, path = llama_w4
    with pytest.raises(QdflashError, match="already exists and is not empty"):
        save_quantized(model, tokenizer, path)


def test_error_fake_quant_mode(tiny_llama, tmp_path):
    model = quantize_model(tiny_llama.model, GridSpec(4, 32, True))
    model.model.layers[0].mlp.up_proj.enable_fake_quant()
    with pytest.raises(QdflashError, match="freeze"):
        save_quantized(model, None, tmp_path / "fq")


def test_load_target_reads_a_packed_export_as_quantlinear(llama_w4):
    """load_target on an export folder gives the packed model (QuantLinear, exact ints), so the
    engine and the benchmark run the quantized weights themselves, not a 16-bit twin."""
    from qdflash.engine import build_engine
    from qdflash.models import load_target

    model, path = llama_w4
    target = load_target(str(path), device="cpu", dtype=torch.float32)
    assert_same_quant(model, target.model)
    assert "packed" in target.source
    torch.testing.assert_close(logits(target.model), logits(model))
    engine = build_engine(target, max_len=32)  # on the CPU: the exact dequantized weights
    torch.testing.assert_close(engine.forward(IDS[0], 0)[0], logits(model)[0], atol=1e-5, rtol=1e-5)
