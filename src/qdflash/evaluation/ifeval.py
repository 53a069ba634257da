"""An offline IFEval gate task: Google's instruction-following prompts, scored by lm-eval's own verifiers.

The prompts come from `ifeval/input_data.jsonl` of the shared data folder (Google's release of the
541 IFEval prompts), and the task is a self-contained local lm-eval task folder, like the other gate
tasks in `qdflash.evaluation.tasks`. Scoring reuses lm-eval's
instruction registry and verifiers (`lm_eval.tasks.ifeval`) unchanged, with one exception: two of
them need NLTK's punkt model, which lm-eval downloads at import time and which an offline machine
does not have. `install_offline_splitter()` swaps in the `nupunkt` sentence splitter (a Punkt
implementation that ships its model inside the PyPI package) at exactly those two places, so that
every instruction type stays verifiable; `SENTENCE_SPLITTER` names it for the node's metrics.json.

The gate reads `inst_level_strict_acc` (RECIPE's IFEval gate; `qdflash.stages.quality_gate.LOCAL_TASKS`):
per prompt, the share of its instructions the response follows strictly (0, 1/3, 1/2, ..., 1).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
import types
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..data.jsonl import read_jsonl_lines
from ..errors import QdflashError, SourceNotFound
from ..paths import shared_data_dir
from .tasks import greedy_generation, scoring_module, write_task

FILE_NAME = "input_data.jsonl"
FIELDS = ("key", "prompt", "instruction_id_list", "kwargs")
_UTIL_MODULE = "lm_eval.tasks.ifeval.instructions_util"


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "(not installed)"


# What counts sentences (and splits them before word tokenization) in the verifiers; read at import
# so the recorded version is the one that actually scored.
SENTENCE_SPLITTER = f"nupunkt {_package_version('nupunkt')}"


# --------------------------------------------------------------------------------------------- items

def ifeval_data_file(path: str | Path | None = None) -> Path:
    """The IFEval prompts file: `path` if given (the file, or a folder holding input_data.jsonl), else
    $QDFLASH_DATA_DIR/ifeval/, else ../shared/data/ifeval/ beside the checkout, the same order as
    every other data source (qdflash.data.sources). Raises SourceNotFound naming what it tried."""
    if path is not None:
        path = Path(path).expanduser()
        file = path / FILE_NAME if path.is_dir() else path
        if not file.is_file():
            raise QdflashError(f"IFEval data: the path given ({path}) does not exist or is a folder without "
                               f"{FILE_NAME}. Point it at Google's IFEval {FILE_NAME} (fields: {', '.join(FIELDS)}) "
                               "or its folder, or leave it unset to use $QDFLASH_DATA_DIR/ifeval or ../shared/data/ifeval.")
        return file
    env_dir = os.environ.get("QDFLASH_DATA_DIR")
    shared = shared_data_dir()
    candidates = [("$QDFLASH_DATA_DIR/ifeval", Path(env_dir) / "ifeval" if env_dir else None),
                  ("../shared/data/ifeval", shared / "ifeval" if shared else None)]
    looked = []
    for label, folder in candidates:
        if folder is None:
            looked.append(f"{label} ({'not set' if label.startswith('$') else 'absent'})")
        elif (folder / FILE_NAME).is_file():
            return folder / FILE_NAME
        else:
            looked.append(f"{label} (no {folder / FILE_NAME})")
    raise SourceNotFound(f"IFEval data not found. Looked at: {'; '.join(looked)}. Expected Google's IFEval "
                       f"{FILE_NAME} (541 prompts; fields: {', '.join(FIELDS)}) in a folder named ifeval: pass its "
                       "path, or set QDFLASH_DATA_DIR to the folder holding ifeval/.")


def load_ifeval_items(path: str | Path | None = None) -> list[dict]:
    """The IFEval prompts as dicts with `key`, `prompt`, `instruction_id_list` and `kwargs` (one dict
    of verifier arguments per instruction), in file order. A malformed row is an error naming the
    file and line: a silently dropped prompt would change what the gate measures."""
    file = ifeval_data_file(path)
    items = []
    for line_no, row in read_jsonl_lines(file):  # not UTF-8 / not a JSON object: an error naming the line
        missing = [field for field in FIELDS if field not in row]
        if missing:
            raise QdflashError(f"{file}, line {line_no}: missing {', '.join(missing)} "
                               f"(each IFEval row needs {', '.join(FIELDS)})")
        if len(row["kwargs"]) != len(row["instruction_id_list"]):
            raise QdflashError(f"{file}, line {line_no}: {len(row['instruction_id_list'])} instructions but "
                               f"{len(row['kwargs'])} kwargs (one dict per instruction is expected)")
        items.append({field: row[field] for field in FIELDS})
    if not items:
        raise QdflashError(f"{file} holds no IFEval prompts")
    return items


# ------------------------------------------------------------------------------------------ the task

def write_ifeval_task(folder: Path, items: list[dict], name: str = "qdflash_ifeval", max_gen_toks: int = 512) -> str:
    """A zero-shot, greedy generation task over IFEval prompts, scored like lm-eval's `ifeval` task
    (strict and loose, per prompt and per instruction). Writes `<name>.jsonl`, `<name>.yaml` and
    `<name>_utils.py` (the scoring functions of this module, where lm-eval can import them) into
    `folder`; returns the task name."""
    folder.mkdir(parents=True, exist_ok=True)
    utils = scoring_module(folder, name, __name__, ["agg_inst_level_acc", "process_results"])
    metrics = []
    for metric in ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc"):
        # per-instruction metrics are lists per prompt: pooled over all instructions, not averaged per prompt
        aggregation = f"!function {utils}.agg_inst_level_acc" if metric.startswith("inst") else "mean"
        metrics += [f"  - metric: {metric}", f"    aggregation: {aggregation}", "    higher_is_better: true"]
    return write_task(folder, name, [{field: item[field] for field in FIELDS} for item in items], [
        *greedy_generation(max_gen_toks),
        "doc_to_text: prompt",
        "doc_to_target: 0",  # unused: the verifiers read the instructions from the document
        f"process_results: !function {utils}.process_results",
        "metric_list:",
        *metrics,
    ])


def process_results(doc: dict, results: list[str]) -> dict:
    """lm-eval's IFEval scoring of one response (`results[0]`), with the offline splitter in place:
    `prompt_level_strict_acc` / `prompt_level_loose_acc` (bool) and `inst_level_strict_acc` /
    `inst_level_loose_acc` (one bool per instruction)."""
    install_offline_splitter()
    from lm_eval.tasks.ifeval import utils

    with _random_seeded_by(doc["key"]):
        return utils.process_results(doc, results)


@contextlib.contextmanager
def _random_seeded_by(key):
    """Python's global `random`, seeded by the prompt's key for the duration, then restored.

    A verifier whose arguments are invalid draws replacements from `random`: two IFEval prompts
    (keys 1122 and 1129) ask for the "letter" "#" or "!", which keywords:letter_frequency swaps for a
    random letter. Seeding by key makes the score a function of the prompt and the response alone,
    as a gate comparing two models item by item needs, whatever else used `random` before."""
    state = random.getstate()
    random.seed(f"qdflash-ifeval-{key}")
    try:
        yield
    finally:
        random.setstate(state)


def agg_inst_level_acc(items: list[list[bool]]) -> float:
    """Instruction-level accuracy: the fraction of all instructions followed (lm-eval's aggregation)."""
    install_offline_splitter()
    from lm_eval.tasks.ifeval import utils

    return utils.agg_inst_level_acc(items)


# ------------------------------------------------------------------------------ the offline splitter

@contextlib.contextmanager
def _punkt_tab_reported_present():
    """While lm-eval's instructions_util is imported, answer its `nltk.data.find("tokenizers/punkt_tab")`
    check as found, so that it does not call `nltk.download` (which, offline, fails after a network
    attempt or hangs on DNS). Nothing ever loads punkt_tab afterwards: install_offline_splitter
    replaces both places that would."""
    import nltk

    real_find = nltk.data.find

    def find(resource_name, *args, **kwargs):
        if resource_name.rstrip("/") == "tokenizers/punkt_tab":
            return resource_name
        return real_find(resource_name, *args, **kwargs)

    nltk.data.find = find
    try:
        yield
    finally:
        nltk.data.find = real_find


def _import_instructions_util() -> types.ModuleType:
    if _UTIL_MODULE not in sys.modules:
        with _punkt_tab_reported_present():
            __import__(_UTIL_MODULE)
    return sys.modules[_UTIL_MODULE]


@functools.cache
def _treebank_tokenizer():
    from nltk.tokenize import NLTKWordTokenizer  # rule-based: needs no NLTK data

    return NLTKWordTokenizer()


def split_sentences(text: str) -> list[str]:
    """Sentences by nupunkt's default Punkt model (shipped in the package: no download)."""
    import nupunkt

    return list(nupunkt.sent_tokenize(text))


def word_tokenize(text: str) -> list[str]:
    """`nltk.word_tokenize` with nupunkt in place of NLTK's punkt model: NLTK's word tokenizer is
    sentence splitting followed by its rule-based Treebank tokenizer on each sentence, so only the
    sentence splitting changes (the capital-word count splits "DON'T" into "DO", "N'T" as before)."""
    tokenizer = _treebank_tokenizer()
    return [token for sentence in split_sentences(text) for token in tokenizer.tokenize(sentence)]


class _NupunktSentenceTokenizer:
    """What instructions_util's `_get_sentence_tokenizer()` is expected to return: `.tokenize(text)`."""

    def tokenize(self, text: str) -> list[str]:
        return split_sentences(text)


class _OfflineNltk(types.ModuleType):
    """The `nltk` module as lm-eval's instructions_util sees it, except for `word_tokenize`.

    instructions.py calls `instructions_util.nltk.word_tokenize` (change_case:capital_word_frequency);
    giving instructions_util this view instead of patching `nltk.word_tokenize` itself keeps the
    change out of every other user of NLTK in the process."""

    def __init__(self, nltk: types.ModuleType):
        super().__init__("nltk", "nltk with an offline word_tokenize, for lm-eval's IFEval verifiers")
        self._nltk = nltk
        self.word_tokenize = word_tokenize

    def __getattr__(self, name: str):
        return getattr(self._nltk, name)


_SENTENCE_TOKENIZER = _NupunktSentenceTokenizer()


def _sentence_tokenizer() -> _NupunktSentenceTokenizer:
    return _SENTENCE_TOKENIZER


def install_offline_splitter() -> None:
    """Make lm-eval's IFEval verifiers run offline, every instruction type included. Idempotent.

    lm-eval needs NLTK's punkt model in two places, both replaced here in instructions_util alone:
    `_get_sentence_tokenizer()` (length_constraints:number_sentences counts sentences with it) now
    returns a nupunkt splitter, and its `nltk` name (change_case:capital_word_frequency calls
    `nltk.word_tokenize`) now resolves `word_tokenize` to the nupunkt-based one above. The rest of
    lm-eval's code, including its regex `split_into_sentences` and `count_words`, runs unchanged.

    langdetect (language:response_language, change_case:english_*) is seeded: its detector samples
    at random, and a gate compares two models' scores item by item, so the same response must get
    the same verdict every time."""
    try:
        import langdetect
        import nupunkt  # noqa: F401
        util = _import_instructions_util()
    except ImportError as err:
        raise QdflashError(f"the IFEval gate needs {err.name!r}, which is not installed: "
                           "pip install nupunkt langdetect immutabledict 'nltk>=3.9.1'") from None
    if util._get_sentence_tokenizer is _sentence_tokenizer:
        return
    langdetect.DetectorFactory.seed = 0
    util.nltk = _OfflineNltk(util.nltk)
    util._get_sentence_tokenizer = _sentence_tokenizer
