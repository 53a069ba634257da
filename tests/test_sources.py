import gzip
import json

import pytest

from qdflash.data import sources
from qdflash.data.sources import iter_json_array, load_source
from qdflash.errors import QdflashError


def write_gsm8k(folder, train_questions, test_questions):
    folder.mkdir(parents=True, exist_ok=True)
    for name, questions in (("train.jsonl", train_questions), ("test.jsonl", test_questions)):
        with open(folder / name, "w") as f:
            for q in questions:
                f.write(json.dumps({"question": q, "answer": "steps\n#### 7"}) + "\n")


@pytest.fixture
def no_shared(monkeypatch):
    """A fresh machine: no ../shared/data, no QDFLASH_DATA_DIR, Hub offline."""
    monkeypatch.setattr(sources, "shared_data_dir", lambda: None)
    monkeypatch.delenv("QDFLASH_DATA_DIR", raising=False)


def test_explicit_path_wins(tmp_path, monkeypatch):
    write_gsm8k(tmp_path / "explicit", ["explicit q"], ["explicit test"])
    write_gsm8k(tmp_path / "env" / "gsm8k", ["env q"], ["env test"])
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "env"))
    src = load_source("gsm8k", tmp_path / "explicit")
    assert [i.prompt for i in src.pool] == ["explicit q"]
    assert [i.prompt for i in src.eval_items] == ["explicit test"]
    assert all(i.eval_item for i in src.eval_items) and not any(i.eval_item for i in src.pool)
    assert src.pool[0].reference == "7"


def test_env_dir_before_shared(tmp_path, monkeypatch):
    write_gsm8k(tmp_path / "env" / "gsm8k", ["env q"], ["env test"])
    write_gsm8k(tmp_path / "shared" / "gsm8k", ["shared q"], ["shared test"])
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setattr(sources, "shared_data_dir", lambda: tmp_path / "shared")
    assert load_source("gsm8k").location == str(tmp_path / "env" / "gsm8k")
    monkeypatch.delenv("QDFLASH_DATA_DIR")
    assert load_source("gsm8k").location == str(tmp_path / "shared" / "gsm8k")


def test_missing_source_says_where_it_looked(no_shared):
    with pytest.raises(QdflashError) as err:
        load_source("gsm8k")
    message = str(err.value)
    for place in ("$QDFLASH_DATA_DIR/gsm8k", "../shared/data/gsm8k", "openai/gsm8k", "data.sources.gsm8k.path"):
        assert place in message


def test_explicit_path_that_does_not_exist(tmp_path):
    with pytest.raises(QdflashError, match="does not exist"):
        load_source("gsm8k", tmp_path / "nope")


def test_malformed_file_is_an_error_not_a_fallthrough(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"q": 1}\n')
    (tmp_path / "gsm8k" / "test.jsonl").write_text("")
    with pytest.raises(QdflashError, match="lacks 'question'"):
        load_source("gsm8k", tmp_path / "gsm8k")


def test_unknown_source():
    with pytest.raises(QdflashError, match="known sources"):
        load_source("nope")


def test_truncated_json_array_is_read_as_a_stream():
    text = '[\n {"a": 1},\n {"a": 2},\n {"a": [3, '
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": 2}]
    assert list(iter_json_array('[{"a": 1}, {"a": 2}]')) == [{"a": 1}, {"a": 2}]


def test_sharegpt_first_human_turn(tmp_path):
    data = [
        {"id": "1", "conversations": [{"from": "human", "value": " Hi there "}, {"from": "gpt", "value": "x"}]},
        {"id": "2", "conversations": [{"from": "gpt", "value": "starts with gpt"}]},
        {"id": "3", "conversations": []},
    ]
    file = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    file.write_text(json.dumps(data)[:-1])  # truncated like the shipped file
    src = load_source("sharegpt", tmp_path)
    assert [i.prompt for i in src.pool] == ["Hi there"]
    assert src.pool[0].category == "chat"


def test_mmlu_headers_dropped_and_gate_items_reserved(tmp_path):
    rows = [{"question": "question", "answer_a": "answer_a", "answer_b": "b", "answer_c": "c", "answer_d": "d", "correct_answer": "answer", "topic": "t"}]
    rows += [
        {"question": f"What is {i}?", "answer_a": "1", "answer_b": "2", "answer_c": "3", "answer_d": "4", "correct_answer": "B", "topic": "math"}
        for i in range(200)
    ]
    (tmp_path / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = load_source("mmlu", tmp_path, mmlu_gate_fraction=0.5)
    assert len(src.pool) + len(src.eval_items) == 200
    assert 60 < len(src.eval_items) < 140
    assert "A. 1\nB. 2" in src.pool[0].prompt and src.pool[0].reference == "B"
    again = load_source("mmlu", tmp_path, mmlu_gate_fraction=0.5)
    assert [i.id for i in again.eval_items] == [i.id for i in src.eval_items]


def test_humaneval_is_evaluation_only(tmp_path):
    with gzip.open(tmp_path / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    "}) + "\n")
    src = load_source("humaneval", tmp_path)
    assert src.pool == [] and len(src.eval_items) == 1 and src.eval_items[0].category == "code"


def test_shipped_packages_resolve_offline(no_shared):
    """The default profile's required sources come from PyPI packages (fresh machine, no Hub)."""
    assert len(load_source("humaneval").eval_items) == 164
    mmlu = load_source("mmlu")
    assert len(mmlu.pool) + len(mmlu.eval_items) == 14042
    assert len(load_source("sharegpt").pool) > 10000


def test_copy_prompts_wrap_sharegpt_texts_and_split_with_them(tmp_path, monkeypatch):
    """copy: each ShareGPT opening turn of 200-3000 characters inside one of the repeat instructions (the same
    one for the same text), read from ShareGPT's own files; its train / held-out side is its text's, so a
    held-out chat prompt's text is never trained on as a copy prompt."""
    from qdflash.data.split import is_heldout

    texts = [f"Paragraph {i}: " + "the quick brown fox jumps over the lazy dog. " * (5 + i % 40) for i in range(300)]
    texts += ["too short", "x" * 4000]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]}
            for i, t in enumerate(texts)]
    (tmp_path / "sharegpt").mkdir()
    (tmp_path / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(data))
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path))  # copy reads $QDFLASH_DATA_DIR/sharegpt
    copy, chat = load_source("copy"), load_source("sharegpt")
    assert copy.location == chat.location and len(copy.pool) == 300  # the short and the long text are left out
    by_text = {item.split_text: item for item in copy.pool}
    assert set(by_text) == {t.strip() for t in texts[:300]}  # the turns as the ShareGPT reader gives them
    for text, item in by_text.items():
        assert item.category == "copy" and item.source == "copy" and item.id.startswith("copy-") and not item.eval_item
        assert text in item.prompt and item.prompt != text
        assert any(item.prompt == t.format(text=text) for t in sources.COPY_TEMPLATES)
    assert len({item.prompt.replace(text, "") for text, item in by_text.items()}) == len(sources.COPY_TEMPLATES)
    assert [i.prompt for i in load_source("copy").pool] == [i.prompt for i in copy.pool]  # deterministic

    from omegaconf import OmegaConf

    from qdflash.stages.prepare_data import choose_prompts

    class Run:
        metrics = {}
    data_cfg = OmegaConf.create({"heldout_fraction": 0.3, "sources": {"sharegpt": {"n_train": 1000, "n_heldout": 1000},
                                                                        "copy": {"n_train": 1000, "n_heldout": 1000}}})
    train, heldout = choose_prompts({"sharegpt": chat, "copy": copy}, data_cfg, lambda item: True, Run())
    held_texts = {i.prompt for i in heldout if i.source == "sharegpt"} | {i.split_text for i in heldout if i.source == "copy"}
    train_texts = {i.prompt for i in train if i.source == "sharegpt"} | {i.split_text for i in train if i.source == "copy"}
    assert held_texts and train_texts and not held_texts & train_texts
    assert all(is_heldout(i.split_text, 0.3) for i in heldout if i.source == "copy")
    # data.stage2_prompts: fresh (regenerate_data): the next n_train prompts of each source, none of stage 1's,
    # the same held-out prompts
    few = OmegaConf.create({"heldout_fraction": 0.3, "sources": {"sharegpt": {"n_train": 3, "n_heldout": 2},
                                                                 "copy": {"n_train": 2, "n_heldout": 2}}})
    first, held = choose_prompts({"sharegpt": chat, "copy": copy}, few, lambda item: True, Run())
    second, held2 = choose_prompts({"sharegpt": chat, "copy": copy}, few, lambda item: True, Run(), fresh=True)
    assert [i.source for i in second] == [i.source for i in first] == ["sharegpt"] * 3 + ["copy"] * 2
    assert not {i.id for i in first} & {i.id for i in second} and [i.id for i in held2] == [i.id for i in held]
    both = OmegaConf.create({"heldout_fraction": 0.3, "sources": {"sharegpt": {"n_train": 6, "n_heldout": 2},
                                                                  "copy": {"n_train": 4, "n_heldout": 2}}})
    assert {i.id for i in choose_prompts({"sharegpt": chat, "copy": copy}, both, lambda item: True, Run())[0]} == \
        {i.id for i in first + second}  # the same order: the next ones, not another draw


def test_repeat_prompts_ask_for_a_short_sentence_many_times_and_never_the_benchmarks_filler(tmp_path, monkeypatch):
    """repeat: the first sentence (15-160 characters) of each ShareGPT opening turn inside one of the repeat
    instructions, chosen by the sentence's hash; split with its chat prompt's text; a sentence holding the
    benchmark's filler (its row measures a cycle no drafter was trained on) or none of that length is left out."""
    from qdflash.bench import FILLER

    texts = [f"Question number {i} is about foxes. Then more text follows here." for i in range(200)]
    texts += ["ok. fine", "A" * 300 + ".", f"{FILLER.strip().capitalize()} {FILLER.strip()}", "no sentence end at all"]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok"}]}
            for i, t in enumerate(texts)]
    (tmp_path / "sharegpt").mkdir()
    (tmp_path / "sharegpt" / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(data))
    monkeypatch.setenv("QDFLASH_DATA_DIR", str(tmp_path))
    repeat = load_source("repeat")
    assert len(repeat.pool) == 200 and all("fox" in i.prompt for i in repeat.pool)
    assert not any(FILLER.strip().lower().rstrip(".") in i.prompt.lower() for i in repeat.pool)
    forms = set()
    for item, text in zip(repeat.pool, texts):
        sentence = f"Question number {text.split()[2]} is about foxes."
        assert item.category == "repeat" and item.id.startswith("repeat-") and not item.eval_item
        assert item.split_text == text and sentence in item.prompt and "Then more" not in item.prompt
        forms |= {(t, n) for t in sources.REPEAT_TEMPLATES for n in sources.REPEAT_TIMES
                  if item.prompt == t.format(sentence=sentence, n=n)}
    assert len({t for t, _ in forms}) == len(sources.REPEAT_TEMPLATES) and len({n for _, n in forms}) == len(sources.REPEAT_TIMES)
    assert [i.prompt for i in load_source("repeat").pool] == [i.prompt for i in repeat.pool]  # deterministic
