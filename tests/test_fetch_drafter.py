import os
import subprocess
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "airgap" / "fetch_drafter.sh"


def test_fetch_drafter_brings_back_bf16_pieces_that_join_into_the_same_drafter(tmp_path, tiny_llama):
    """scripts/airgap/fetch_drafter.sh (run on the H200, here on a results tree like its own): the pieces and
    the config join into a drafter folder that load_drafter reads, its sha256 checks, and its weights are the
    trained ones rounded to bf16; a node without a drafter is an error that names the path."""
    from qdflash.drafter import init_drafter, load_drafter
    from qdflash.drafter.model import save_drafter

    drafter = init_drafter(tiny_llama, block_size=4, num_layers=1, seed=1)
    save_drafter(drafter, tmp_path / "results" / "exp" / "drafter" / "stage2" / "drafter")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, QDFLASH_GPU_ROOT=str(tmp_path), QDFLASH_RESULTS=str(tmp_path / "results"), OUT=str(out))
    done = subprocess.run(["bash", str(SCRIPT), "exp"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    pieces = sorted(out.glob("drafter.safetensors.part-*"))
    assert pieces and all(p.stat().st_size <= 15 << 20 for p in pieces)
    back = tmp_path / "back" / "drafter"
    back.mkdir(parents=True)
    (back / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in pieces))
    (back / "config.json").write_bytes((out / "drafter-config.json").read_bytes())
    assert subprocess.run(["sha256sum", "-c", str(out / "drafter.sha256")], cwd=back.parent).returncode == 0
    loaded = load_drafter(back, tiny_llama)
    for (name, want), got in zip(drafter.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(got, want.to(torch.bfloat16).to(got.dtype)), name

    missing = subprocess.run(["bash", str(SCRIPT), "exp", "stage1"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "no drafter at" in missing.stdout and "exp/drafter/stage1" in missing.stdout


def test_a_drafter_of_more_pieces_than_a_call_returns_comes_back_over_calls(tmp_path, tiny_llama):
    """A call returns 64 MiB together: at most 4 pieces of 15 MiB. FIRST picks each call's pieces, the
    output names the next call, and the pieces of all calls join into the drafter the sha256 names (the
    H200 run of 2026-12-03 lost its fifth piece of five to that limit). Pieces of 8 KiB stand for 15 MiB."""
    from qdflash.drafter import init_drafter
    from qdflash.drafter.model import save_drafter

    save_drafter(init_drafter(tiny_llama, block_size=4, num_layers=1, seed=1), tmp_path / "results" / "exp" / "drafter" / "stage2" / "drafter")
    env = dict(os.environ, QDFLASH_GPU_ROOT=str(tmp_path), QDFLASH_RESULTS=str(tmp_path / "results"), QDFLASH_PIECE_KIB="8")
    pieces, first, calls = [], "0", 0
    while first is not None:
        out = tmp_path / f"out{calls}"
        out.mkdir()
        done = subprocess.run(["bash", str(SCRIPT), "exp", "stage2", first], env=dict(env, OUT=str(out)), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        got = sorted(out.glob("drafter.safetensors.part-*"))
        assert 1 <= len(got) <= 4 and len(list(out.iterdir())) <= 8
        pieces += got
        nxt = [line for line in done.stdout.splitlines() if "the rest in the next call" in line]
        first = nxt[0].split()[-1] if nxt else None
        calls += 1
    assert calls >= 2 and [p.name for p in pieces] == [f"drafter.safetensors.part-{i:02d}" for i in range(len(pieces))]
    back = tmp_path / "back" / "drafter"
    back.mkdir(parents=True)
    (back / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in pieces))
    assert subprocess.run(["sha256sum", "-c", str(out / "drafter.sha256")], cwd=back.parent).returncode == 0

    beyond = subprocess.run(["bash", str(SCRIPT), "exp", "stage2", str(len(pieces))], env=dict(env, OUT=str(tmp_path)),
                            capture_output=True, text=True)
    assert beyond.returncode == 2 and f"the drafter is {len(pieces)} pieces" in beyond.stdout
