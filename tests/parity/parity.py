"""frugal against transformers (pinned 5.23.0) on tiny random checkpoints transformers writes itself.

    python tests/parity/parity.py --frugal build/frugal --work /tmp/parity   (tests/parity/parity_test.sh runs it)

For each config below: transformers makes a random checkpoint (fp32 or bf16 files, one sharded) and
computes, in fp32, the mean loss on a fixed 64-id sequence (labels = input ids) and the greedy
20-token continuation of a fixed 8-id prompt. frugal eval (loss, 1e-4 relative) and frugal generate
--temperature 0 (the same 20 ids; both stop at the config's eos_token_id) must agree. Then a round
trip: frugal train fine-tunes a transformers Llama (model.init_from), transformers loads the saved
step folder and its logits must equal frugal eval --logits-out's within 1e-5 (relative to the
largest logit), and AutoTokenizer on that folder (the SentencePiece tokenizer frugal trained and
the tokenizer.json it writes beside it) gives `frugal tokenizer encode --json`'s ids on hard strings;
so does a byte-level BPE tokenizer.json the tokenizers library trains. And instruction examples: frugal
eval --examples' loss on the answers (prompts masked) equals transformers' with labels of -100 (1e-4).
Prints PASS/FAIL per case with the numbers; exits 1 on any failure.
"""
import argparse, json, os, shutil, subprocess, sys, warnings

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
import torch
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

PIN = "5.23.0"
VOCAB, SEQ, PROMPT_LEN, NEW = 300, 64, 8, 20
EOS = 2


def llama(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOS,
                tie_word_embeddings=False)
    base.update(kw)
    return LlamaForCausalLM(LlamaConfig(**base))


def gpt2(**kw):
    base = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=EOS)
    base.update(kw)
    return GPT2LMHeadModel(GPT2Config(**base))


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
# name -> (model maker, save options, hand edit of config.json or None)
CASES = {
    "llama_tied": (lambda: llama(tie_word_embeddings=True), {}, None),
    "llama_untied": (lambda: llama(), {}, None),
    "llama_gqa": (lambda: llama(num_key_value_heads=2), {}, None),
    "llama_mqa": (lambda: llama(num_key_value_heads=1), {}, None),
    "llama_rope_linear": (lambda: llama(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)), {}, None),
    "llama_rope_llama3": (lambda: llama(rope_parameters=dict(LLAMA3, rope_theta=500000.0)), {}, None),
    "llama_theta500k": (lambda: llama(rope_parameters=dict(rope_type="default", rope_theta=500000.0)), {}, None),
    # transformers 4's layout, written by hand: top-level rope_theta and rope_scaling.
    "llama_theta500k_v4_layout": (lambda: llama(rope_parameters=dict(LLAMA3, rope_theta=500000.0)), {}, "v4"),
    "llama_bias": (lambda: llama(attention_bias=True, mlp_bias=True), {}, None),
    "llama_head_dim": (lambda: llama(head_dim=32), {}, None),
    "llama_bf16": (lambda: llama(num_key_value_heads=2).to(torch.bfloat16), {}, None),
    "llama_sharded": (lambda: llama(num_key_value_heads=2), {"max_shard_size": "100KB"}, None),
    "gpt2_tied_gelu_new": (lambda: gpt2(activation_function="gelu_new"), {}, None),
    "gpt2_untied_gelu": (lambda: gpt2(activation_function="gelu", tie_word_embeddings=False), {}, None),
    "gpt2_gelu_pytorch_tanh": (lambda: gpt2(activation_function="gelu_pytorch_tanh"), {}, None),
    "gpt2_bf16": (lambda: gpt2().to(torch.bfloat16), {}, None),
}


def randomize(model, scale):
    # Far from the default init, so every weight (norms and biases too) shows in the numbers and
    # greedy choices are not near-ties.
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.dim() == 1 and ("norm" in name or ".ln_" in name):
                p.copy_(1 + 0.2 * r)
            elif p.dim() == 1:
                p.copy_(0.1 * scale * r)
            else:
                p.copy_(r * scale / min(p.shape) ** 0.5)


def to_v4_layout(path):
    cfg = json.load(open(path))
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    json.dump(cfg, open(path, "w"), indent=2)


def fixed_ids():
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    return ids, ids[:, :PROMPT_LEN].clone()


def hf_reference(folder, ids, prompt):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=EOS, pad_token_id=0)
    new = out[0, prompt.shape[1]:].tolist()
    return {"loss": loss, "greedy": new[:new.index(EOS)] if EOS in new else new, "config": model.config.to_dict().get("rope_parameters")}


def make_references(work):
    ids, prompt = fixed_ids()
    open(os.path.join(work, "ids.txt"), "w").write(" ".join(map(str, ids[0].tolist())))
    refs = {}
    for name, (make, save, edit) in CASES.items():
        folder = os.path.join(work, name)
        shutil.rmtree(folder, ignore_errors=True)
        torch.manual_seed(0)
        model = make()
        randomize(model, 1.5 if name.startswith("llama") else 0.2)
        model.save_pretrained(folder, **save)
        if edit == "v4":
            to_v4_layout(os.path.join(folder, "config.json"))
        refs[name] = hf_reference(folder, ids, prompt)
    refs["_prompt"] = prompt[0].tolist()
    json.dump(refs, open(os.path.join(work, "references.json"), "w"), indent=1)
    return refs


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.returncode, (p.stderr.strip().splitlines() or [""])[-1]


def check_config(frugal, work, name, ref, prompt):
    folder, out = os.path.join(work, name), os.path.join(work, name + ".frugal")
    os.makedirs(out, exist_ok=True)
    rc, err = run([frugal, "eval", "--checkpoint", folder, "--tokens", os.path.join(work, "ids.txt"), "--seq-len", str(SEQ),
                   "--json-out", out + "/eval.json"])
    if rc != 0:
        return False, f"frugal eval failed (exit {rc}): {err}"
    loss = json.load(open(out + "/eval.json"))["loss"]
    rel = abs(loss - ref["loss"]) / abs(ref["loss"])
    rc, err = run([frugal, "generate", "--checkpoint", folder, "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0", "--dtype", "fp32",
                   "--max-new-tokens", str(NEW), "--json-out", out + "/gen.json"])
    if rc != 0:
        return False, f"loss {loss:.6f} vs {ref['loss']:.6f} (rel {rel:.1e}); frugal generate failed (exit {rc}): {err}"
    got = json.load(open(out + "/gen.json"))["tokens"]
    same = next((i for i, (a, b) in enumerate(zip(got, ref["greedy"])) if a != b), min(len(got), len(ref["greedy"])))
    ok = rel <= 1e-4 and got == ref["greedy"]
    return ok, f"loss {loss:.6f} vs {ref['loss']:.6f} (rel {rel:.1e}, tol 1e-4); greedy {same}/{len(ref['greedy'])} ids agree" + (
        "" if got == ref["greedy"] else f" (frugal {got[same:same + 3]}.. vs transformers {ref['greedy'][same:same + 3]}..)")


def check_round_trip(frugal, work):
    out, source = os.path.join(work, "round_trip"), os.path.join(work, "round_trip_source")
    shutil.rmtree(out, ignore_errors=True)
    # A Llama unlike recipes/tiny.yaml's (untied, 4 KV heads, ffn 128) with 512 ids, so SentencePiece can
    # train a tokenizer of that size on the corpus. The file defines the model: the recipe is tiny.yaml
    # without its architecture keys (an architecture key the recipe sets must agree with the file).
    torch.manual_seed(0)
    model = llama(vocab_size=512)
    randomize(model, 1.5)
    model.save_pretrained(source)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    recipe, section = os.path.join(work, "round_trip.yaml"), None
    with open(os.path.join(repo, "recipes", "tiny.yaml")) as src, open(recipe, "w") as dst:
        for line in src:
            if line and not line[0].isspace():
                section = line.split(":")[0]
            if section != "model" or not line[0].isspace() or line.strip().startswith("dtype:"):
                dst.write(line)
    # The random folder has no tokenizer of its own: data.train_tokenizer asks frugal to train one.
    rc, err = run([frugal, "train", recipe, f"model.init_from={source}", "data.train_tokenizer=true", f"train.out_dir={out}",
                   "train.steps=3", "train.checkpoint_interval=3", "train.eval_interval=0", "schedule.warmup_steps=1",
                   "train.sample_tokens=0", "train.seq_len=32"])
    if rc != 0:
        return False, f"frugal train failed (exit {rc}): {err}"
    step = os.path.join(out, sorted(d for d in os.listdir(out) if d.startswith("step-"))[-1])
    rc, err = run([frugal, "eval", "--checkpoint", step, "--tokens", os.path.join(work, "ids.txt"), "--seq-len", str(SEQ),
                   "--logits-out", out + "/logits.safetensors"])
    if rc != 0:
        return False, f"frugal eval --logits-out failed (exit {rc}): {err}"
    from safetensors.torch import load_file
    f = load_file(out + "/logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(f["input_ids"]).logits
    diff = (ref - f["logits"]).abs().max().item() / max(1.0, ref.abs().max().item())
    ok = diff <= 1e-5
    msg = f"logits max |diff| / max(1, max|logit|) = {diff:.1e} (tol 1e-5) over {tuple(ref.shape)}"
    # The step folder's tokenizer (the SentencePiece model frugal trained, with the tokenizer.json and
    # tokenizer_config.json it writes beside it) read back by AutoTokenizer: the same ids.
    tok_ok, tok_msg = compare_tokenizer(frugal, work, step, add_special=True)
    return ok and tok_ok, f"{msg}; its tokenizer in AutoTokenizer: {tok_msg}"


HARD_STRINGS = {
    "spaces": "a  b   c    d", "tabs": "a\tb\t\tc", "newlines": "one\ntwo\n\nthree\n", "crlf": "one\r\ntwo\r\n",
    "emoji": "smile 😀 and 👍🏽 ok", "cjk": "漢字かなカナ 한국어", "combining": "e\u0301 a\u0308 n\u0303", "empty": "",
    "leading_space": " hello  world ", "one_space": " ", "nbsp": "a\u00a0b\u3000c", "code": "def f(x):\n\treturn x**2  # sq\n",
    "long_line": ("the quick brown fox " * 52429)[:1 << 20],
}


def compare_tokenizer(frugal, work, folder, add_special=False):
    """AutoTokenizer(folder) against frugal tokenizer encode FOLDER --json on HARD_STRINGS, and invalid UTF-8 refused."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(folder)
    failures = []
    flags = ["--add-special-tokens"] if add_special else []
    for name, text in HARD_STRINGS.items():
        path = os.path.join(work, f"text_{name}.txt")
        open(path, "w", encoding="utf-8", newline="").write(text)
        p = subprocess.run([frugal, "tokenizer", "encode", folder, "--text-file", path, "--json"] + flags, capture_output=True, text=True)
        want = hf.encode(text, add_special_tokens=add_special)
        got = json.loads(p.stdout).get("ids") if p.returncode == 0 else None
        if got != want:
            failures.append(f"{name} (exit {p.returncode})")
    bad = os.path.join(work, "text_invalid_utf8.txt")
    open(bad, "wb").write(b"ok \xff\xfe bad")
    if subprocess.run([frugal, "tokenizer", "encode", folder, "--text-file", bad, "--json"], capture_output=True).returncode != 2:
        failures.append("invalid UTF-8 not refused with exit 2")
    n = len(HARD_STRINGS)
    return not failures, f"{n} of {n} strings agree, invalid UTF-8 refused" if not failures else "differ: " + ", ".join(failures)


def make_bpe_tokenizer(folder):
    """A byte-level BPE tokenizer.json folder (GPT-2's kind) the tokenizers library trains on the fortunes."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [open(os.path.join("/usr/share/games/fortunes", f), errors="ignore").read()
              for f in ("art", "computers", "science") if os.path.exists(os.path.join("/usr/share/games/fortunes", f))]
    tok.train_from_iterator(corpus or ["hello world"] * 10, trainers.BpeTrainer(vocab_size=500, special_tokens=["<s>", "</s>"],
                                                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def check_tokenizer(frugal, work):
    """A byte-level BPE tokenizer.json folder the tokenizers library trains, in AutoTokenizer and frugal."""
    folder = os.path.join(work, "tokenizer_bpe")
    make_bpe_tokenizer(folder)
    return compare_tokenizer(frugal, work, folder)


ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
                "### Response:\n")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
                   "### Instruction:\n{instruction}\n\n### Response:\n")


def check_examples(frugal, work):
    """Instruction examples' loss on the answers: frugal eval --examples against transformers with labels of -100.

    The reference renders Alpaca's prompt, encodes prompt + answer + EOS as one text with AutoTokenizer,
    sets the labels of the prompt's tokens to -100 (the prompt's own encoding, as long as it is a prefix
    of the whole one), and sums the model's mean loss times its counted tokens over the examples."""
    from transformers import AutoTokenizer
    folder = os.path.join(work, "examples_model")
    shutil.rmtree(folder, ignore_errors=True)
    make_bpe_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = llama(vocab_size=512, max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    randomize(model, 1.5)
    model.save_pretrained(folder)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(repo, "recipes", "data", "alpaca-tiny.val.jsonl")) as f:
        examples = [json.loads(line) for line in f][:12]
    examples.append({"instruction": "Say hello.", "input": "", "output": "Hello! ünïcödé 😀"})
    path = os.path.join(work, "examples.jsonl")
    with open(path, "w") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, counted = 0.0, 0
    for e in examples:
        prompt = (ALPACA_INPUT if e["input"] else ALPACA_NO_INPUT).format(**e)
        ids = tok(prompt + e["output"] + tok.eos_token).input_ids
        prompt_ids = tok(prompt).input_ids
        n = 0
        while n < min(len(ids), len(prompt_ids)) and ids[n] == prompt_ids[n]:
            n += 1
        labels = [-100] * n + ids[n:]
        with torch.no_grad():
            loss = model(torch.tensor([ids]), labels=torch.tensor([labels])).loss.item()
        k = len(ids) - n  # predicted tokens: every label after the first position
        total += loss * k
        counted += k
    ref = total / counted
    out = os.path.join(work, "examples_eval.json")
    rc, err = run([frugal, "eval", "--checkpoint", folder, "--examples", path, "--format", "alpaca", "--template", "alpaca",
                   "--seq-len", "1024", "--batch-size", "4", "--json-out", out])
    if rc != 0:
        return False, f"frugal eval --examples failed (exit {rc}): {err}"
    got = json.load(open(out))
    rel = abs(got["loss"] - ref) / abs(ref)
    ok = rel <= 1e-4 and got["tokens"] == counted and got["truncated"] == 0
    return ok, (f"{len(examples)} Alpaca examples: loss on the answers {got['loss']:.6f} vs {ref:.6f} (rel {rel:.1e}, tol 1e-4); "
                f"answer tokens {got['tokens']} vs {counted}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frugal", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", default="", help="comma-separated case names")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if transformers.__version__ != PIN:
        print(f"parity: transformers {transformers.__version__} is not the pinned {PIN}; references may differ")
    os.makedirs(a.work, exist_ok=True)
    refs = make_references(a.work)
    results = []
    for name in CASES:
        if a.only and name not in a.only.split(","):
            continue
        results.append((name,) + check_config(a.frugal, a.work, name, refs[name], refs["_prompt"]))
    if not a.only or "round_trip" in a.only:
        results.append(("round_trip_train",) + check_round_trip(a.frugal, a.work))
    if not a.only or "tokenizer" in a.only:
        results.append(("tokenizer_json",) + check_tokenizer(a.frugal, a.work))
    if not a.only or "examples" in a.only:
        results.append(("examples_loss",) + check_examples(a.frugal, a.work))
    width = max(len(r[0]) for r in results)
    for name, ok, msg in results:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  {name:<{width}}  {msg}")
    failed = [r[0] for r in results if r[1] is False]
    print(f"parity: {len(results) - len(failed)} of {len(results)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
