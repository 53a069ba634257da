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
