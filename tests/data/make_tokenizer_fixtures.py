#!/usr/bin/env python3
"""Makes the tokenizer.json fixtures of tests/data/hf_tokenizer_test.cpp and the ids the
`tokenizers` library gives for a set of hard strings, so the C++ tests need no Python.

    python tests/data/make_tokenizer_fixtures.py      # needs `tokenizers` (tested with 0.23)

Writes tests/data/fixtures/{gpt2,llama3,llama2,mistral}.json and expected_ids.json. Each tokenizer is
trained here on text made here (no downloads): a GPT-2-style byte-level BPE, a Llama-3-style one
(its split regex, ignore_merges, a BOS template), a Llama-2-style SentencePiece-like BPE (Prepend +
Replace normalizer, byte fallback, <s> template) and a Mistral-style variant of it (Metaspace
pre-tokenizer with prepend_scheme "first").
"""
import hashlib
import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers, Regex

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we've got 12345 reasons.",
    "def main():\n    print('hello world')\n\treturn 0\n",
    "Tokenizers split text into pieces; the pieces become ids.  Two spaces.   Three spaces.",
    "Ünïcödé tëxt wïth äccents, naïve café, résumé.\r\nWindows line\r\n",
    "日本語のテキスト。中文文本。한국어 텍스트.",
    "Emoji: 😀 🎉 👍🏽 and symbols ∑ ∫ √ ≠ ≤.",
    "Numbers: 3.14159, 2,718, 1e-9, 0x1F, 42nd, 1st.",
    "I'll say they're here, you'd think it's theirs, we'll see.",
] * 20

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

HARD = [
    "",
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing spaces   ",
    "runs     of      spaces",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand more\n",
    "crlf\r\nline\r\n\r\n",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "CJK 日本語 中文 한국어",
    "combining e\u0301 a\u0308 o\u0303 and precomposed é",
    "numbers 1234567890 3.14 1,000,000",
    "it's they're we've I'm you'll he'd IT'S",
    "code: if (x == 1) { return y; }",
    "mixed ∑∫√ symbols ≠ ≤ and ⟨brackets⟩",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
    "unseen chars: ʘ ѯ ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "▁already▁has▁metaspace",
    "\n",
    " ",
    "   ",
]
SPECIAL_TEXT = {
    "gpt2": ["a<|endoftext|>b", "<|endoftext|><|endoftext|> x"],
    "llama3": ["<|begin_of_text|>Hi<|end_of_text|>", "x <|end_of_text|> y"],
    "llama2": ["<s>Hi</s>", "a </s> b", "</s>"],
    "mistral": ["<s>Hi</s>", "a </s> b"],
}


def long_line():
    unit = "lorem ipsum dolor 42 sit amet, ünïcödé 日本 "
    n = (1 << 20) // len(unit.encode("utf-8")) + 1
    return unit * n  # the C++ test builds the same line


def train_bpe(pre_tokenizer, vocab_size, alphabet, ignore_merges=False, byte_fallback=False, normalizer=None):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges, byte_fallback=byte_fallback))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def gpt2():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = train_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), 420, alphabet)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(["<|endoftext|>"])
    return tok


def llama3():
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok = train_bpe(pre, 440, alphabet, ignore_merges=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)]),
    ])
    return tok


def llama2_json():
    """A SentencePiece-like BPE: <unk> <s> </s>, the 256 byte pieces, then pieces learned on "▁"-joined text."""
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    learned = train_bpe(meta, 460, [])
    data = json.loads(learned.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = len(vocab)
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    added = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
             for c, i in (("<unk>", 0), ("<s>", 1), ("</s>", 2))]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                                    {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": data["model"]["merges"]},
    }


def mistral_json(llama2):
    d = json.loads(json.dumps(llama2))
    d["normalizer"] = None
    d["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    d["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False},
        {"type": "ByteFallback"}, {"type": "Fuse"}]}
    # merges as "a b" strings here (the pair form elsewhere), so both spellings are tested
    d["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in d["model"]["merges"]]
    return d


def ids_hash(ids):
    h = 0xcbf29ce484222325  # FNV-1a 64 over the ids' little-endian int32 bytes
    for i in ids:
        for b in int(i).to_bytes(4, "little", signed=True):
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def main():
    os.makedirs(OUT, exist_ok=True)
    l2 = llama2_json()
    texts = {
        "gpt2": gpt2().to_str(),
        "llama3": llama3().to_str(),
        "llama2": json.dumps(l2, ensure_ascii=False),
        "mistral": json.dumps(mistral_json(l2), ensure_ascii=False),
    }
    expected = {}
    line = long_line()
    for name, text in texts.items():
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            f.write(text)
        tok = Tokenizer.from_str(text)
        cases = []
        for s in HARD + SPECIAL_TEXT[name]:
            plain = tok.encode(s, add_special_tokens=False).ids
            cases.append({"text": s, "ids": plain, "ids_with_special": tok.encode(s).ids,
                          "decoded": tok.decode(plain, skip_special_tokens=False)})
        big = tok.encode(line, add_special_tokens=False).ids
        expected[name] = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "cases": cases,
                          "long_line": {"count": len(big), "fnv1a64": ids_hash(big)}}
    with open(os.path.join(OUT, "expected_ids.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
    print("wrote", ", ".join(sorted(texts)), "and expected_ids.json to", OUT)


if __name__ == "__main__":
    main()
