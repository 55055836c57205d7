"""frugal's chat and instruction examples against transformers (pinned 5.23.0): ids and loss flags.

    python tests/parity/chat_parity.py --frugal build/frugal --work /tmp/chat   (tests/parity/chat_parity_test.sh runs it)

Tokenizers the `tokenizers` library trains here (tests/data/make_tokenizer_fixtures.py's: byte-level
BPE with Llama-3's split regex, GPT-2's, and SentencePiece-style BPE with Prepend or Metaspace), each
given its template's special tokens as added tokens and saved with save_pretrained, the canonical
chat_template in the folder (chat_template.jinja or tokenizer_config.json). For every conversation:
  ids:  tok.apply_chat_template(messages, tokenize=True, chat_template=JINJA) against
        `frugal tokenizer examples FOLDER FILE --format messages` (frugal recognises the folder's template);
  loss: a token has loss when its characters (the fast tokenizer's offsets) overlap an answer, found
        by transformers' own rendering: from the end of apply_chat_template(messages[:i],
        add_generation_prompt=True) to the end of apply_chat_template(messages[:i+1]) (less ChatML's
        newline after <|im_end|>), for each assistant message i.
alpaca and plain: the text rendered here in Python, encoded with tok(text, add_special_tokens=False),
BOS in front when the tokenizer adds one and EOS after; the answer is the output or completion (+ EOS).
Prints PASS/FAIL per tokenizer and template with counts; exits 1 on any difference.
"""
import argparse, json, os, subprocess, sys, warnings

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "data"))

import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

import make_tokenizer_fixtures as fixtures  # noqa: E402

PIN = "5.23.0"

# The canonical texts, as the checkpoints' tokenizer_config.json carry them (written here apart from
# frugal's copies in src/data/chat_template.cpp).
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
          "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = "
          "'<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}"
          "{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif "
          "message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set "
          "content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
JINJA = {"llama2": LLAMA2, "llama3": LLAMA3, "chatml": CHATML}
TOKENS = {"llama2": [], "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "chatml": ["<|im_start|>", "<|im_end|>"]}


def S(c):
    return {"role": "system", "content": c}


def U(c):
    return {"role": "user", "content": c}


def A(c):
    return {"role": "assistant", "content": c}


CONVERSATIONS = [
    [U("Hello"), A("Hi there!")],
    [S("You are a pirate."), U("What is 2+2?"), A("Arr, 4.")],
    [U("one"), A("two"), U("three"), A("four"), U("five"), A("six.")],
    [S("日本語で答えて"), U("こんにちは 😀"), A("はい、わかりました。👍🏽"), U("Ünïcödé café?"), A("Oui — naïve résumé.")],
    [S("  sys with spaces  "), U("  padded question \n"), A("\n  padded answer  \t"), U("\tnext"), A(" last ")],
    [U("def f():\n    return 1\n"), A("```python\nprint('x')\n```\n")],
    [S(""), U("empty system"), A("fine")],
    [U(""), A("Nothing was asked.")],
    [U("unicode spaces\u00a0"), A("\u3000answer\u2003")],
    [U("Say </s>, <s>, <|eot_id|> and <|im_end|> please."), A("</s> <|im_end|> said.")],
    [U("tabs\tand\r\nCRLF"), A("ok\r\n")],
    [S("Be terse."), U("x"), A("y"), U("z"), A("w")],
]

ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n"
                "{input}\n\n### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
                   "### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA = [
    {"instruction": "Add the numbers.", "input": "2 + 2", "output": "4"},
    {"instruction": "Say hello.", "input": "", "output": "Hello!"},
    {"instruction": "Translate to French.", "input": "naïve café 😀", "output": " Café naïf 😀 "},
    {"instruction": "List three colours.", "output": "red\ngreen\nblue", "id": 17},
    {"instruction": "Continue", "input": "The quick brown", "output": " fox jumps over the lazy dog."},
]
PLAIN = [
    {"prompt": "The quick brown", "completion": " fox jumps over the lazy dog."},
    {"prompt": "Numbers: 3.1", "completion": "4159, 2,718"},
    {"prompt": "Q: 日本? A:", "completion": " はい"},
    {"prompt": "", "completion": "no prompt at all"},
]


def make_tokenizer(kind, extra):
    """kind: llama3 / gpt2 (byte-level BPE) or llama2 / mistral (SentencePiece-style); extra: added special tokens."""
    if kind == "llama3":
        tok, bos, eos = fixtures.llama3(), "<|begin_of_text|>", "<|end_of_text|>"
    elif kind == "gpt2":
        tok, bos, eos = fixtures.gpt2(), None, "<|endoftext|>"
    else:
        l2 = fixtures.llama2_json()
        tok = Tokenizer.from_str(json.dumps(l2 if kind == "llama2" else fixtures.mistral_json(l2)))
        bos, eos = "<s>", "</s>"
    if extra:
        tok.add_special_tokens(extra)
    return tok, bos, eos


def save_folder(path, kind, template, jinja_file):
    tok, bos, eos = make_tokenizer(kind, TOKENS.get(template, []))
    if template == "llama3":
        eos = "<|eot_id|>"
    elif template == "chatml":
        eos = "<|im_end|>"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    if template in JINJA:
        hf.chat_template = JINJA[template]
    hf.save_pretrained(path, save_jinja_files=jinja_file)
    return AutoTokenizer.from_pretrained(path)


def frugal_examples(frugal, folder, data_path, fmt, template=None):
    cmd = [frugal, "tokenizer", "examples", folder, data_path, "--format", fmt] + (["--template", template] if template else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
    return [json.loads(line) for line in p.stdout.splitlines()]


def flags_from_spans(hf, text, spans, bos, eos):
    """Loss flags by character overlap with the answer spans, from the fast tokenizer's offsets."""
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, flags = list(enc["input_ids"]), []
    for start, end in enc["offset_mapping"]:
        flags.append(int(any(start < e and end > b for b, e in spans)))
    if bos:
        ids, flags = [hf.bos_token_id] + ids, [0] + flags
    if eos:
        ids, flags = ids + [hf.eos_token_id], flags + [1]
    return ids, flags


def chat_reference(hf, template, messages):
    jinja = JINJA[template]
    ids = hf.apply_chat_template(messages, tokenize=True, chat_template=jinja, return_dict=False)
    text = hf.apply_chat_template(messages, tokenize=False, chat_template=jinja)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        begin = len(hf.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, chat_template=jinja))
        end = len(hf.apply_chat_template(messages[:i + 1], tokenize=False, chat_template=jinja))
        if template == "chatml":
            end -= 1  # the newline after <|im_end|>
        spans.append((begin, end))
    ref_ids, flags = flags_from_spans(hf, text, spans, False, False)
    assert ref_ids == list(ids), "offsets encoding differs from apply_chat_template's"
    return list(ids), flags, text


def compare(name, got, want):
    """got: frugal's lines; want: [(ids, flags, text)]. Returns (ok, message)."""
    bad = []
    if len(got) != len(want):
        return False, f"{len(got)} examples from frugal, {len(want)} expected"
    for k, (g, (ids, flags, text)) in enumerate(zip(got, want)):
        if g["ids"] != ids:
            first = next((i for i, (a, b) in enumerate(zip(g["ids"], ids)) if a != b), min(len(ids), len(g["ids"])))
            bad.append(f"#{k} ids differ at {first} (frugal {g['ids'][first:first + 5]}, transformers {ids[first:first + 5]})")
        elif g["loss"] != flags:
            first = next(i for i, (a, b) in enumerate(zip(g["loss"], flags)) if a != b)
            bad.append(f"#{k} loss flags differ at token {first}")
        elif text is not None and g["text"] != text:
            bad.append(f"#{k} text differs")
    if bad:
        return False, "; ".join(bad)
    return True, f"{len(want)} of {len(want)} equal (ids, loss flags, text)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frugal", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    if transformers.__version__ != PIN:
        print(f"chat parity: transformers {transformers.__version__} is not the pinned {PIN}; references may differ")
    os.makedirs(a.work, exist_ok=True)
    results = []
    chats = os.path.join(a.work, "chats.jsonl")
    with open(chats, "w", encoding="utf-8", newline="\n") as f:
        for c in CONVERSATIONS:
            f.write(json.dumps({"messages": c, "id": len(c)}, ensure_ascii=False) + "\n")
    # (tokenizer kind, template, template saved as chat_template.jinja rather than in tokenizer_config.json)
    for kind, template, jinja_file in [("llama3", "llama3", True), ("llama2", "llama2", False), ("mistral", "llama2", True),
                                       ("gpt2", "chatml", True), ("llama2", "chatml", False), ("gpt2", "llama3", False),
                                       ("mistral", "chatml", True)]:
        name = f"{template} on {kind}"
        folder = os.path.join(a.work, f"{kind}_{template}")
        try:
            hf = save_folder(folder, kind, template, jinja_file)
            if hf.bos_token is None and template in ("llama2", "llama3"):
                # transformers cannot render bos_token either; frugal refuses by name (exit 2).
                p = subprocess.run([a.frugal, "tokenizer", "examples", folder, chats, "--format", "messages"], capture_output=True, text=True)
                ok = p.returncode == 2 and "writes a BOS token" in p.stderr
                results.append((name, ok, "refused: " + p.stderr.strip() if ok else f"exit {p.returncode}: {p.stderr.strip()}"))
                continue
            want = [chat_reference(hf, template, c) for c in CONVERSATIONS]
            results.append((name,) + compare(name, frugal_examples(a.frugal, folder, chats, "messages"), want))
        except Exception as e:  # a failure to run is a failure
            results.append((name, False, f"{type(e).__name__}: {e}"))
    for kind in ("llama2", "gpt2", "llama3"):
        folder = os.path.join(a.work, f"{kind}_plain")
        hf = save_folder(folder, kind, "plain", False)
        # BOS first when transformers adds one to a text (frugal's add_bos).
        add_bos = hf.bos_token_id is not None and hf("a")["input_ids"][:1] == [hf.bos_token_id]
        for fmt, rows in (("alpaca", ALPACA), ("prompt_completion", PLAIN)):
            path = os.path.join(a.work, f"{fmt}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            want = []
            for r in rows:
                if fmt == "alpaca":
                    prompt = (ALPACA_INPUT if r.get("input") else ALPACA_NO_INPUT).format(**{"input": "", **r})
                    answer = r["output"]
                else:
                    prompt, answer = r["prompt"], r["completion"]
                text = prompt + answer
                ids, flags = flags_from_spans(hf, text, [(len(prompt), len(text))], add_bos, True)
                want.append((ids, flags, text))
            name = f"{'alpaca' if fmt == 'alpaca' else 'plain'} on {kind}"
            try:
                results.append((name,) + compare(name, frugal_examples(a.frugal, folder, path, fmt), want))
            except Exception as e:
                results.append((name, False, f"{type(e).__name__}: {e}"))
    width = max(len(r[0]) for r in results)
    for name, ok, msg in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name:<{width}}  {msg}")
    failed = [r for r in results if not r[1]]
    total = sum(int(m.split(" of ")[0]) for _, ok, m in results if ok and " of " in m)
    print(f"chat parity: {len(results) - len(failed)} of {len(results)} cases pass ({total} examples equal)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
