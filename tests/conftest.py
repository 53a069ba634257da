import os

import pytest

# Never wait on the network in tests: Hub lookups fail at once instead of retrying for ~25 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
# Triton kernels run on the CPU through Triton's interpreter (read when triton is first imported).
# Engines only use them when asked (kernels=True) or on CUDA, so this changes nothing else here.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_llama():
    from qdflash.models import load_target

    return load_target("tiny-llama", device="cpu")


@pytest.fixture(scope="session")
def tiny_qwen():
    from qdflash.models import load_target

    return load_target("tiny-qwen3.5", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    return tiny_llama.tokenizer


@pytest.fixture(scope="session")
def tiny_qwen2():
    from qdflash.models import load_target

    return load_target("tiny-qwen2", device="cpu")


@pytest.fixture(scope="session")
def varied_llama(tiny_llama):
    """tiny-llama with its matrices (not the tied embedding) x4: the random tiny target repeats one
    token after most prompts; this one continues them with varied tokens, which a test of exact
    tokens needs (a served or exported stack's output compared with the target's)."""
    import copy

    import torch

    target = copy.copy(tiny_llama)
    target.model = copy.deepcopy(tiny_llama.model)
    with torch.no_grad():
        for name, p in target.model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    return target
