"""A tiny random decoder language model saved as a user would (save_pretrained), with a byte-level BPE tokenizer
trained here on a few sentences: both load offline, in a second."""
from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

END = "<|endoftext|>"
CORPUS = ["the cat sat on the mat", "the dog ran to the park", "a red ball and a blue box", "where does the cat live?"]


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of about 300 tokens (any text tokenises), `END` its end-of-text token."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=[END],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=END)


def save_tiny_llama(path: Path) -> Path:
    """A tiny random LlamaForCausalLM (grouped-query attention) and its tokenizer, saved into `path`."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
