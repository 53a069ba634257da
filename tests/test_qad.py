import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from qdflash.distill import chunked_kl
from qdflash.errors import QdflashError
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
    floored = [cosine_lr(s, 100, 3, 2.0, floor=0.25) for s in range(101)]  # the drafter's min_lr_ratio
    assert floored[:3] == [2 * x for x in lrs[:3]] and floored[-1] == 0.5 and min(floored[3:]) == 0.5
    assert all(a >= b for a, b in zip(floored[2:], floored[3:]))
    assert {cosine_lr(s, 100, 3, 1.0, floor=1.0) for s in range(2, 100)} == {1.0}  # constant after the warm-up


@pytest.mark.parametrize("head", [False, True])
def test_a_few_qad_steps_keep_the_grid_and_reduce_kl(tiny_llama, head):
    """`head`: the LM head quantized too (lm_head out of quant.exclude): the KL reads it through its STE
    weight, so its latent trains like every other layer's and stays on its grid."""
    from qdflash.models import load_target

    # a frozen copy, as the qad stage freezes its teacher: backward must not leave gradients on the
    # session fixture's weights (test_drafter checks that a target's parameters get none)
    teacher = copy.deepcopy(tiny_llama.model).requires_grad_(False)
    student = load_target("tiny-llama", device="cpu").model
    spec = GridSpec(2, 32, True)  # coarse, so there is KL to recover
    names = select_linears(student, exclude=["*embed*"]) if head else select_linears(student)
    assert ("lm_head" in names) == head
    replace_linears(student, quantize_weights(student, names, spec, method="rtn"))
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
    if head:
        assert student.lm_head.latent.grad is not None and student.lm_head.latent.grad.abs().sum() > 0
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
    order = random.Random(3)
    order.random()
    save_checkpoint(tmp_path / "state.pt", 7, latents, opt, "fp-a", {"order": order.getstate(), "curve": [0.5]})
    fresh = [torch.nn.Parameter(torch.zeros(4, 4)) for _ in range(2)]
    opt2 = torch.optim.AdamW(fresh, lr=1e-3)
    step, progress = load_checkpoint(tmp_path / "state.pt", fresh, opt2, "fp-a")
    assert step == 7 and progress["curve"] == [0.5]
    again = random.Random()
    again.setstate(progress["order"])
    assert again.random() == order.random()  # the batch order continues where it stopped
    assert all(torch.equal(a, b) for a, b in zip(latents, fresh))
    assert opt2.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    assert load_checkpoint(tmp_path / "state.pt", fresh, opt2, "another-config") == (0, {})  # never resume a different run
    assert load_checkpoint(tmp_path / "missing.pt", fresh, opt2, "fp-a") == (0, {})


class Payload:
    """Pickled, it calls os.system when loaded: what a planted 'checkpoint' would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_payload_in_a_checkpoint_does_not_run(tmp_path):
    from qdflash.qad import load_checkpoint

    marker = tmp_path / "payload-ran"
    torch.save({"step": 3, "fingerprint": "fp", "latents": [], "payload": Payload(marker)}, tmp_path / "state.pt")
    latent = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(QdflashError, match=r"state\.pt: not a QAD checkpoint of tensors and plain data"):
        load_checkpoint(tmp_path / "state.pt", [latent], torch.optim.AdamW([latent]), "fp")
    assert not marker.exists()


def test_the_resume_key_covers_every_input(tmp_path):
    from qdflash.stages.qad import resume_key

    (tmp_path / "ptq" / "model").mkdir(parents=True)
    (tmp_path / "ptq" / "model" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "ptq" / "metrics.json").write_text("{}")
    (tmp_path / "data").mkdir()
    for split in ("train", "heldout"):
        (tmp_path / "data" / f"{split}.tokens.jsonl").write_text(f'{{"{split}": 1}}\n')
    cfg = OmegaConf.create({"qad": {"steps": 4, "lr": 1e-3}, "model": {"name": "tiny-llama"}, "data_dir": str(tmp_path / "data")})

    def key(**changes):
        return resume_key(OmegaConf.merge(cfg, changes), tmp_path / "ptq", 1, torch.float32)

    first = key()
    assert key() == first
    assert key(qad={"lr": 2e-3}) != first and key(model={"name": "tiny-qwen3.5"}) != first
    assert resume_key(cfg, tmp_path / "ptq", 2, torch.float32) != first and resume_key(cfg, tmp_path / "ptq", 1, torch.bfloat16) != first
    (tmp_path / "ptq" / "model" / "model.safetensors").write_bytes(b"other weights")  # a re-run PTQ, same folder
    assert key() != first
    second = key()
    (tmp_path / "data" / "train.tokens.jsonl").write_text('{"train": 2}\n')  # regenerated data, same folder
    assert key() != second


# --- the qad node itself, killed and resumed (tiny-llama, CPU, synthetic token data) ----------------

NODE_ARGS = ["model=tiny-llama", "device=cpu", "dtype=float32", "tracking.wandb.mode=disabled", "eval.heldout_samples=4"]
QAD_ARGS = ["qad.steps=4", "qad.batch_size=2", "qad.seq_len=32", "qad.lr=1e-3", "qad.eval_every=2", "qad.checkpoint_every=2"]


def node(module, *args, env=None):
    return subprocess.run([sys.executable, "-m", f"qdflash.stages.{module}", *NODE_ARGS, *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def quantize(data, out, *args, env=None):
    done = node("quantize_target", f"data_dir={data}", f"out_dir={out}", "quant.method=rtn", "quant.bits=4",
                "quant.group_size=32", "quant.calibration.samples=4", *args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def qad_inputs(tmp_path_factory):
    """A data folder of random token rows (all the qad node reads) and an RTN PTQ artifact of it."""
    from qdflash.data.jsonl import write_jsonl

    root = tmp_path_factory.mktemp("qad-node")
    data = root / "data"
    data.mkdir()
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 8), ("heldout", 4)):
        write_jsonl(data / f"{split}.tokens.jsonl", ({"id": f"{split}-{i}", "input_ids": torch.randint(100, 5000, (48,), generator=gen).tolist(),
                                                      "loss_mask": [0] * 8 + [1] * 40} for i in range(n)))
    return data, quantize(data, root / "ptq")


def qad(data, ptq, out, env=None):
    return node("qad", f"data_dir={data}", f"ptq_dir={ptq}", f"out_dir={out}", *QAD_ARGS, env=env)


def outcome(out):
    from safetensors.torch import load_file

    return json.loads((out / "metrics.json").read_text()), load_file(out / "model" / "model.safetensors")


def another_ptq_artifact_in_the_same_folder(data, ptq, folder):
    """A QAD killed after step 2's checkpoint, then PTQ re-run with another setting into the same folder,
    then QAD again (its checks: test_a_checkpoint_of_another_ptq_artifact_in_the_same_folder_is_not_resumed).
    One thread per node: it runs beside the other node test's runs."""
    from qdflash.stages.qad import KILL_AFTER_STEP

    one = {"OMP_NUM_THREADS": "1"}
    ptq = Path(shutil.copytree(ptq, folder / "ptq"))
    killed = qad(data, ptq, folder / "qad", env={**one, KILL_AFTER_STEP: "2"})
    quantize(data, ptq, "quant.group_size=64", "overwrite=true", env=one)  # PTQ re-ran with another setting: same path
    return ptq, killed, qad(data, ptq, folder / "qad", env=one)


@pytest.fixture(scope="module")
def another_ptq_run(qad_inputs, tmp_path_factory):
    """another_ptq_artifact_in_the_same_folder, started in the background (a future): its three nodes run one
    after another, so the killed-and-resumed test's nodes run beside them on the second core."""
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(another_ptq_artifact_in_the_same_folder, *qad_inputs, tmp_path_factory.mktemp("another-ptq"))


def test_a_qad_killed_after_a_checkpoint_resumes_to_the_uninterrupted_run(qad_inputs, another_ptq_run, tmp_path):
    from qdflash.stages.qad import KILL_AFTER_STEP

    data, ptq = qad_inputs  # (another_ptq_run: only started here, checked by its own test below)
    # the uninterrupted run and the one that gets killed are independent: side by side, one thread each
    # (and the resumed run on one thread too, so all three compute alike)
    one = {"OMP_NUM_THREADS": "1"}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(qad, data, ptq, tmp_path / "whole", env=one)
        killed = pool.submit(qad, data, ptq, tmp_path / "resumed", env={**one, KILL_AFTER_STEP: "2"})
        whole, killed = whole.result(), killed.result()
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]  # kill -9 after step 2's checkpoint
    assert (tmp_path / "resumed.ckpt" / "state.pt").is_file() and not (tmp_path / "resumed").exists()
    done = qad(data, ptq, tmp_path / "resumed", env=one)
    assert done.returncode == 0, done.stderr[-3000:]
    (whole, whole_weights), (resumed, resumed_weights) = outcome(tmp_path / "whole"), outcome(tmp_path / "resumed")
    for key in ("quant.kl", "quant.top1_agreement", "quant.ppl", "qad.rows_per_process"):
        assert resumed[key] == whole[key], key
    assert len(resumed["qad.train_kl_curve"]) == 4 and resumed["qad.train_kl_curve"] == whole["qad.train_kl_curve"]
    assert whole["qad.resumed_from_step"] == 0 and resumed["qad.resumed_from_step"] == 2
    # the timing covers this run's steps only; the CPU has no TF32
    assert whole["qad.steps_timed"] == 4 and resumed["qad.steps_timed"] == 2 and whole["qad.train_s"] > 0
    assert whole["qad.tf32"] == 0 and whole["qad.tokens_per_s"] > 0
    assert whole_weights.keys() == resumed_weights.keys()
    assert all(torch.equal(whole_weights[k], resumed_weights[k]) for k in whole_weights)
    assert not (tmp_path / "resumed.ckpt").exists()  # finished: the checkpoint is gone


def test_a_checkpoint_of_another_ptq_artifact_in_the_same_folder_is_not_resumed(another_ptq_run):
    ptq, killed, done = another_ptq_run.result()
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((ptq.parent / "qad" / "metrics.json").read_text())
    assert len(metrics["qad.train_kl_curve"]) == 4 and metrics["qad.resumed_from_step"] == 0
    assert metrics["ptq.kl"] == json.loads((ptq / "metrics.json").read_text())["quant.kl"]


def test_tf32_is_scoped_to_the_block():
    from qdflash.distill import tf32_matmuls

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with tf32_matmuls(True):
            assert torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cuda.matmul.allow_tf32
        with pytest.raises(RuntimeError), tf32_matmuls(True):  # restored when the block raises, too
            raise RuntimeError
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


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
