import copy

import pytest
import torch
import torch.nn.functional as F

from qdflash.distill import chunked_kl
from qdflash.qad import cosine_lr, kl_loss, make_student_trainable, pack_sequences
from qdflash.quant.apply import quant_linears, quantize_weights, replace_linears, select_linears
from qdflash.quant.grid import GridSpec


def direct_kl(h_s, h_t, w_s, w_t):
    log_s = F.log_softmax(h_s @ w_s.T, -1)
    log_t = F.log_softmax(h_t @ w_t.T, -1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def test_chunked_kl_equals_direct_kl_and_its_gradient():
    torch.manual_seed(0)
    h_s = torch.randn(37, 16, requires_grad=True)
    h_t, w = torch.randn(37, 16), torch.randn(100, 16)
    chunked = chunked_kl(h_s, h_t, w, w, chunk_tokens=8)
    direct = direct_kl(h_s, h_t, w, w)
    torch.testing.assert_close(chunked, direct)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), h_s)
    (g_direct,) = torch.autograd.grad(direct.sum(), h_s)
    torch.testing.assert_close(g_chunked, g_direct)
    assert chunked_kl(h_t, h_t, w, w).abs().max() < 1e-5


def test_pack_sequences():
    examples = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5, 6, 7], "loss_mask": [0, 0, 1, 1]}]
    rows = pack_sequences(examples, 3, "assistant")
    assert [r[0].tolist() for r in rows] == [[1, 2, 3], [4, 5, 6]] and rows[1][1].tolist() == [0, 0, 1]
    assert all(r[1].tolist() == [1, 1, 1] for r in pack_sequences(examples, 3, "all"))


def test_cosine_schedule():
    lrs = [cosine_lr(s, 100, 3, 1.0) for s in range(100)]
    assert lrs[0] < lrs[1] < lrs[2] == 1.0 and lrs[-1] < 0.01 and all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_a_few_qad_steps_keep_the_grid_and_reduce_kl(tiny_llama):
    from qdflash.models import load_target

    # a frozen copy, as the qad stage freezes its teacher: backward must not leave gradients on the
    # session fixture's weights (test_drafter checks that a target's parameters get none)
    teacher = copy.deepcopy(tiny_llama.model).requires_grad_(False)
    student = load_target("tiny-llama", device="cpu").model
    spec = GridSpec(2, 32, True)  # coarse, so there is KL to recover
    replace_linears(student, quantize_weights(student, select_linears(student), spec, method="rtn"))
    scales = {n: m.weight_scale.clone() for n, m in quant_linears(student).items()}
    ints = {n: m.weight_int.clone() for n, m in quant_linears(student).items()}
    latents = make_student_trainable(student)
    assert all(not p.requires_grad for p in student.parameters() if not any(p is l for l in latents))
    opt = torch.optim.Adam(latents, lr=2e-3)
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (2, 32))
    mask = torch.ones_like(ids)
    losses = []
    for _ in range(8):
        loss = kl_loss(teacher, student, ids, mask, temperature=1.0, chunk_tokens=16)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, module in quant_linears(student).items():
        module.freeze()
        assert torch.equal(module.weight_scale, scales[name]) and module.weight_scale.dtype == scales[name].dtype
        assert module.weight_int.min() >= spec.qmin and module.weight_int.max() <= spec.qmax
    assert any(not torch.equal(m.weight_int, ints[n]) for n, m in quant_linears(student).items())


def test_checkpoint_resume_round_trip(tmp_path):
    from qdflash.qad import load_checkpoint, save_checkpoint

    latents = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    opt = torch.optim.AdamW(latents, lr=1e-3)
    latents[0].sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "state.pt", 7, latents, opt, "fp-a")
    fresh = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    opt2 = torch.optim.AdamW(fresh, lr=1e-3)
    assert load_checkpoint(tmp_path / "state.pt", fresh, opt2, "fp-a") == 7
    assert all(torch.equal(a, b) for a, b in zip(latents, fresh))
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert load_checkpoint(tmp_path / "state.pt", fresh, opt2, "another-config") == 0  # never resume a different run
    assert load_checkpoint(tmp_path / "missing.pt", fresh, opt2, "fp-a") == 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen"])
def test_heldout_comparison_is_the_same_in_batches(fixture, request):
    """compare_to_teacher in right-padded length batches gives what one example at a time gives
    (fp32; llama and the hybrid), and its KL / agreement / perplexity match a direct computation."""
    from qdflash.distill import compare_to_teacher, length_batches

    teacher = request.getfixturevalue(fixture).model
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.02 * torch.randn_like(p))
    g = torch.Generator().manual_seed(0)
    examples = []
    for length, prompt in [(12, 4), (30, 10), (21, 3), (9, 9), (17, 5)]:  # (9, 9): no response token
        ids = torch.randint(5, 500, (length,), generator=g).tolist()
        examples.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    assert [len(b) for b in length_batches(examples, 40)] == [2, 1, 1, 1]  # 9, 12 | 17 (3 x 17 > 40) | 21 | 30
    alone = compare_to_teacher(teacher, student, examples, batch_tokens=1)
    batched = compare_to_teacher(teacher, student, examples, batch_tokens=64, chunk_tokens=7)
    for key in ("kl", "top1_agreement", "ppl"):
        assert batched[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
    assert batched["tokens"] == alone["tokens"] == sum(len(e["input_ids"]) - max(p, 1) for e, p in
                                                       zip(examples, [4, 10, 3, 9, 5]))
    kl = agree = nll = 0.0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex["input_ids"]])
            lt = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].double(), -1)
            ls = torch.log_softmax(student(input_ids=ids).logits[0, :-1].double(), -1)
            keep = torch.tensor(ex["loss_mask"][1:], dtype=torch.bool)
            kl += (lt.exp() * (lt - ls)).sum(-1)[keep].sum().item()
            agree += (lt.argmax(-1) == ls.argmax(-1))[keep].sum().item()
            nll -= ls[keep].gather(-1, ids[0, 1:][keep][:, None]).sum().item()
    n = batched["tokens"]
    assert batched["kl"] == pytest.approx(kl / n, rel=1e-4) and batched["top1_agreement"] == pytest.approx(agree / n)
    assert batched["ppl"] == pytest.approx(float(torch.exp(torch.tensor(nll / n))), rel=1e-4)
