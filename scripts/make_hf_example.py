"""Writes a small Hugging Face folder as transformers saves one: a random Llama (GQA, rope theta 500000,
untied head) and a byte-level BPE tokenizer (Llama 3's kind) trained on the fortunes corpus. It stands in
for a downloaded checkpoint in the README's fine-tune round trip (nothing can be downloaded here).

    .venv-torch2/bin/python scripts/make_hf_example.py out/hf-small
"""
import glob
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1] if len(sys.argv) > 1 else "out/hf-small"
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
texts = [open(f, errors="ignore").read() for f in sorted(glob.glob("/usr/share/games/fortunes/*")) if "." not in f.split("/")[-1]]
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False,
                     bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id)
LlamaForCausalLM(config).save_pretrained(out)
hf_tok.save_pretrained(out)
print(f"wrote {out}: a {config.num_hidden_layers}-layer Llama with a {tok.get_vocab_size()}-token byte-level BPE tokenizer")
