import os

import pytest

# Never wait on the network in tests: Hub lookups fail at once instead of retrying for ~25 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_MODE", "offline")
# One torch thread in this process and the processes it starts (Snakemake's nodes get their rule's threads):
# the tiny test models gain nothing from a second thread on 2 cores, and where the machine is shared each op
# waits for the busier core (4 in-process test files back to back at load ~4.5: 414 s on 2 threads, 84 s on 1;
# on a quiet machine 51 s vs 48 s). Read when torch is first imported, which is after this file.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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
def short_qwen(tiny_qwen):
    """tiny-qwen3.5 cut to its first 4 layers: the hybrid's pattern once (3 Gated DeltaNet layers, then full
    attention). For the tests whose subject is the GDN kernels through the engine: Triton's interpreter runs each GDN
    layer's launches for seconds, and the second half of the model adds no path."""
    import copy

    target = copy.copy(tiny_qwen)
    target.model = copy.deepcopy(tiny_qwen.model)
    config = target.model.config
    keep = config.layer_types.index("full_attention") + 1
    target.model.model.layers = target.model.model.layers[:keep]
    config.num_hidden_layers, config.layer_types = keep, config.layer_types[:keep]
    return target


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


@pytest.fixture(scope="session")
def lm_eval_task_index():
    """lm-eval's own task YAMLs parsed once per session: every TaskManager (one per evaluate() call)
    indexes all ~14,000 of them again (~10 s each on 2 cores). The index is built as before, only each
    file of the installed lm_eval package is read once and handed out as a fresh copy (pickled); a
    test's own task files (include_path) are read every time, as they may change between calls."""
    import pickle
    from pathlib import Path

    from lm_eval.tasks import _index

    package = str(Path(_index.__file__).parent) + os.sep
    read = _index.load_yaml
    parsed = {}

    def load_yaml(path, **options):
        if not str(path).startswith(package):
            return read(path, **options)
        key = (str(path), tuple(sorted(options.items())))
        if key not in parsed:
            try:
                parsed[key] = pickle.dumps(read(path, **options))
            except Exception as error:  # the index skips such a file: it is skipped every time
                parsed[key] = error
        if isinstance(parsed[key], Exception):
            raise parsed[key]
        return pickle.loads(parsed[key])

    _index.load_yaml = load_yaml
    yield
    _index.load_yaml = read
