"""Can the target do MMLU at all, in any prompt format? Letter formats scored by the next token's
logits over A-D (0-shot as the gate, 5-shot from the pool, the chat template, the chat template plus
"Answer:"), then cloze (log-likelihood of each option's text, raw and per character), on the first
N gate items. Asked because Qwen2.5-Coder-0.5B-Instruct's 16-bit gate scored chance.

    python scripts/investigations/mmlu_formats.py letters 50 [--model qwen2.5-coder-0.5b]
    python scripts/investigations/mmlu_formats.py cloze 75
"""

import argparse
import re
import time

import torch
import torch.nn.functional as F

from qdflash.data.sources import load_source
from qdflash.models import load_target


def letters(t, items, shots):
    tok = t.tokenizer
    spaced = [tok.encode(" " + c, add_special_tokens=False)[0] for c in "ABCD"]
    bare = [tok.encode(c, add_special_tokens=False)[0] for c in "ABCD"]

    def chat(q):
        return tok.apply_chat_template([{"role": "user", "content": q + "\nAnswer with the letter of the correct option."}],
                                       tokenize=False, add_generation_prompt=True)

    fewshot = "".join(f"{s.prompt}\nAnswer: {s.reference}\n\n" for s in shots[:5])
    formats = {"0shot": (lambda q: q + "\nAnswer:", spaced), "5shot": (lambda q: fewshot + q + "\nAnswer:", spaced),
               "chat": (chat, bare), "chat_answer": (lambda q: chat(q) + "Answer:", spaced)}
    right = {k: 0 for k in formats}
    for i, it in enumerate(items):
        gold = "ABCD".index(it.reference)
        for k, (f, ids) in formats.items():
            x = torch.tensor([tok.encode(f(it.prompt), add_special_tokens=False)])
            right[k] += int(t.model(input_ids=x, logits_to_keep=1).logits[0, -1][ids].argmax()) == gold
        yield i + 1, {k: round(v / (i + 1), 3) for k, v in right.items()}


def cloze(t, items, shots):
    tok = t.tokenizer
    acc = norm = 0
    for i, it in enumerate(items):
        lines = it.prompt.split("\n")
        options = [line[3:] for line in lines if re.match(r"^[ABCD]\. ", line)][:4]
        stem = "\n".join(line for line in lines if not re.match(r"^[ABCD]\. ", line)).strip()
        ctx = tok.encode(stem + "\nAnswer:", add_special_tokens=False)
        raw, per_char = [], []
        for option in options:
            cont = tok.encode(" " + option, add_special_tokens=False)
            logp = F.log_softmax(t.model(input_ids=torch.tensor([ctx + cont])).logits[0, len(ctx) - 1 : -1].float(), -1)
            score = logp.gather(-1, torch.tensor(cont)[:, None]).sum().item()
            raw.append(score)
            per_char.append(score / len(" " + option))
        gold = "ABCD".index(it.reference)
        acc += int(max(range(4), key=raw.__getitem__) == gold)
        norm += int(max(range(4), key=per_char.__getitem__) == gold)
        yield i + 1, {"cloze": round(acc / (i + 1), 3), "cloze_per_char": round(norm / (i + 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["letters", "cloze"])
    parser.add_argument("n", type=int)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    args = parser.parse_args()
    source = load_source("mmlu")
    target = load_target(args.model, dtype="float32", device="cpu")
    start = time.time()
    with torch.no_grad():
        for done, scores in (letters if args.kind == "letters" else cloze)(target, source.eval_items[: args.n], source.pool):
            if done % 25 == 0 or done == args.n:
                print(done, scores, f"{time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
