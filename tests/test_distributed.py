"""Data-parallel training (qdflash.distributed): the drafter node under torchrun on 2 CPU processes
(gloo) follows the 1-process run's loss trajectory with the same global batch; only rank 0 writes."""

import json
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def tiny_data(folder, vocab: int, n_train: int = 8, n_heldout: int = 4, length: int = 48, prompt: int = 12):
    """A prepare_data-shaped folder of random token sequences (the loss on the response part)."""
    rng = random.Random(0)
    folder.mkdir(parents=True)
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        rows = [{"id": f"{split}{i}", "input_ids": [rng.randrange(10, vocab) for _ in range(length)],
                 "loss_mask": [0] * prompt + [1] * (length - prompt)} for i in range(n)]
        (folder / f"{split}.tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"id": r["id"], "category": "chat"}) + "\n" for r in rows))
    return folder


def print_table(title, one, two):
    """The two trajectories side by side (visible with pytest -s): the issue's loss table."""
    print(f"\n{title}\n| step | 1 process | 2 processes | relative difference |\n|---|---|---|---|")
    for step, (a, b) in enumerate(zip(one, two), start=1):
        print(f"| {step} | {a:.7f} | {b:.7f} | {abs(a - b) / max(abs(a), 1e-12):.1e} |")


def free_port() -> int:
    """A port no other run holds (a fixed one per name collided when two 2-process runs overlapped)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_node(module, args, processes, folder, name):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                str(free_port())] if processes > 1 else [sys.executable]
    out = folder / name
    cmd = [*launcher, "-m", module, *args, f"out_dir={out}", "tracking.wandb.mode=offline"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text()), out


# The 1-process reference runs once per node and serves both parametrizations: at world size 1 the
# `parallel` key is not read (train_drafter: parallel "none" unless distributed; qad: fsdp only when
# distributed), so the ddp and the fsdp 1-process runs were the same computation.
DRAFTER_ARGS = ["model=tiny-llama", "device=cpu", "dtype=float32", "stage=1", "drafter.num_layers=1",
                "drafter_train.steps=4", "drafter_train.batch_size=4", "drafter_train.anchors_per_seq=4",
                "drafter_train.eval_every=100", "drafter_train.heldout_samples=4", "drafter_train.cache_features=false"]
QAD_ARGS = ["qad.steps=4", "qad.batch_size=4", "qad.seq_len=32", "qad.eval_every=100", "qad.checkpoint_every=100", "qad.lr=1e-3"]


def run_drafter_one_process(root, vocab):
    data = tiny_data(root / "data", vocab)
    one, _ = run_node("qdflash.stages.train_drafter", [*DRAFTER_ARGS, f"data_dir={data}"], 1, root, "one")
    assert one["train.world_size"] == 1 and one["train.parallel"] == "none"
    # tau-hat by where blocks start in their answers, in metrics.json beside tau-hat
    assert sum(one["final.blocks_by_answer_offset"]) == one["final.blocks"] and len(one["final.tau_by_answer_offset"]) == 3
    return data, one


def run_qad_one_process(root, vocab):
    data = tiny_data(root / "data", vocab, n_train=12, length=64)
    common = ["model=tiny-llama", "device=cpu", "dtype=float32", f"data_dir={data}", "eval.heldout_samples=4"]
    _, ptq = run_node("qdflash.stages.quantize_target", [*common, "quant.method=rtn", "quant.bits=4", "quant.group_size=32"],
                      1, root, "ptq")
    args = [*common, f"ptq_dir={ptq}", *QAD_ARGS]
    one, _ = run_node("qdflash.stages.qad", args, 1, root, "one")
    assert one["qad.world_size"] == 1 and one["qad.parallel"] == "none"
    return args, one


@pytest.fixture(scope="module")
def one_process_references(tiny_llama, tmp_path_factory):
    """The drafter's and QAD's 1-process references are independent 1-thread runs: side by side on 2 cores."""
    from concurrent.futures import ThreadPoolExecutor

    vocab = tiny_llama.config.vocab_size
    with ThreadPoolExecutor(2) as pool:
        drafter = pool.submit(run_drafter_one_process, tmp_path_factory.mktemp("drafter-1p"), vocab)
        qad = pool.submit(run_qad_one_process, tmp_path_factory.mktemp("qad-1p"), vocab)
        return {"drafter": drafter.result(), "qad": qad.result()}


@pytest.fixture(scope="module")
def drafter_one_process(one_process_references):
    return one_process_references["drafter"]


@pytest.fixture(scope="module")
def qad_one_process(one_process_references):
    return one_process_references["qad"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_drafter_training_on_two_processes_follows_one_process(parallel, drafter_one_process, tmp_path):
    data, one = drafter_one_process
    args = [*DRAFTER_ARGS, f"data_dir={data}", f"drafter_train.parallel={parallel}"]
    two, out = run_node("qdflash.stages.train_drafter", args, 2, tmp_path, "two")
    assert one["train.world_size"] == 1 and two["train.world_size"] == 2 and two["train.parallel"] == parallel
    assert one["train.sequences_per_process"] == 16 and two["train.sequences_per_process"] == 8  # each rank half a batch
    assert len(one["train.loss_curve"]) == len(two["train.loss_curve"]) == 4
    print_table(f"drafter stage 1 ({parallel.upper()}), training loss", one["train.loss_curve"], two["train.loss_curve"])
    assert two["train.loss_curve"] == pytest.approx(one["train.loss_curve"], rel=1e-4)
    assert two["final.tau"] == pytest.approx(one["final.tau"], rel=1e-4)
    # rank 0 alone wrote the node's folder; nothing of rank 1 is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two"]
    assert len(list((out / "wandb").glob("offline-run-*"))) == 1


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_qad_on_two_processes_follows_one_process(parallel, qad_one_process, tmp_path):
    args, one = qad_one_process
    two, _ = run_node("qdflash.stages.qad", [*args, f"qad.parallel={parallel}"], 2, tmp_path, "two")
    assert one["qad.world_size"] == 1 and two["qad.world_size"] == 2 and two["qad.parallel"] == parallel
    print_table(f"QAD ({parallel.upper()}), training KL", one["qad.train_kl_curve"], two["qad.train_kl_curve"])
    assert two["qad.train_kl_curve"] == pytest.approx(one["qad.train_kl_curve"], rel=1e-4)
    assert two["quant.kl"] == pytest.approx(one["quant.kl"], rel=1e-4)  # the final held-out KL
    assert len(one["qad.train_kl_curve"]) == 4
    assert one["qad.rows_per_process"] == 16 and two["qad.rows_per_process"] == 8  # each rank half of every batch
