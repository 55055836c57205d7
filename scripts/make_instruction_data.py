#!/usr/bin/env python3
"""Writes the small instruction data set of recipes/alpaca-tiny.yaml (Debian's packages hold none).

Every example is an Alpaca-style {"instruction", "input", "output"} whose input is a short fortune
from Debian's `fortunes` package and whose output follows from it by a rule a small model can
learn (repeat it, capitalise it, its first or last word, its word count, its words reversed), so a
fine-tune's validation loss on the answers says whether the model learned to follow instructions.
Deterministic: the same fortunes give the same files.

    python3 scripts/make_instruction_data.py [FORTUNES_DIR] [OUT_DIR]
      -> OUT_DIR/alpaca-tiny.jsonl (train), alpaca-tiny.val.jsonl, chat-tiny.jsonl (the same as chats)
"""
import json
import os
import random
import re
import sys

FORTUNES = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/games/fortunes"
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "recipes", "data")
N_TRAIN, N_VAL = 800, 80


def fortunes():
    texts = []
    for name in sorted(os.listdir(FORTUNES)):
        path = os.path.join(FORTUNES, name)
        if "." in name or not os.path.isfile(path):
            continue  # the .dat indexes and .u8 links
        with open(path, encoding="utf-8", errors="replace") as f:
            for doc in f.read().split("\n%\n"):
                text = " ".join(doc.split())
                # short, one-sentence-ish, plain ASCII: answers a 10M model can learn in minutes
                if 20 <= len(text) <= 120 and text.isascii() and "--" not in text and "\t" not in text:
                    texts.append(text)
    return sorted(set(texts))


def words(text):
    return re.findall(r"[A-Za-z0-9']+", text)


TASKS = [
    ("Repeat the text exactly.", lambda t: t),
    ("Write the text in capital letters.", lambda t: t.upper()),
    ("What is the first word of the text?", lambda t: words(t)[0]),
    ("What is the last word of the text?", lambda t: words(t)[-1]),
    ("How many words does the text have?", lambda t: str(len(words(t)))),
    ("Write the words of the text in reverse order.", lambda t: " ".join(reversed(words(t)))),
]


def main():
    texts = [t for t in fortunes() if words(t)]
    rng = random.Random(0)
    rng.shuffle(texts)
    need = N_TRAIN + N_VAL
    if len(texts) < need:
        sys.exit(f"make_instruction_data: only {len(texts)} usable fortunes in {FORTUNES}, {need} needed")
    examples = []
    for i, text in enumerate(texts[:need]):
        instruction, rule = TASKS[i % len(TASKS)]
        examples.append({"instruction": instruction, "input": text, "output": rule(text)})
    os.makedirs(OUT, exist_ok=True)

    def write(name, items):
        with open(os.path.join(OUT, name), "w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps(item, ensure_ascii=False) + "\n")

    write("alpaca-tiny.jsonl", examples[:N_TRAIN])
    write("alpaca-tiny.val.jsonl", examples[N_TRAIN:])
    chats = []
    for i, e in enumerate(examples[:200]):
        messages = [] if i % 2 else [{"role": "system", "content": "You follow instructions about a text."}]
        messages += [{"role": "user", "content": e["instruction"] + "\n\n" + e["input"]},
                     {"role": "assistant", "content": e["output"]}]
        if i % 3 == 0:  # a second turn on the same text
            nxt = examples[(i + 1) % len(examples)]
            messages += [{"role": "user", "content": nxt["instruction"]},
                         {"role": "assistant", "content": TASKS[(i + 1) % len(TASKS)][1](e["input"])}]
        chats.append({"messages": messages})
    write("chat-tiny.jsonl", chats)


if __name__ == "__main__":
    main()
