"""Tiny decoder language models: the float64 Llama and GPT-2 of tests/golden/llm_lxt_reference.pt (`build`, with
their weights' checksum), and a tiny random model saved as a user would (save_pretrained), with a byte-level BPE
tokenizer trained here on a few sentences: both load offline, in a second."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

GOLDEN = torch.load(Path(__file__).parent / "golden" / "llm_lxt_reference.pt", weights_only=False)
END = "<|endoftext|>"


def build(arch: str, dtype: torch.dtype = torch.float64, implementation: str = "sdpa") -> torch.nn.Module:
    """The golden file's model of `arch` ("llama", "gpt2"), with the given attention implementation."""
    entry = GOLDEN["models"][arch]
    config_class, model_class = ((transformers.LlamaConfig, transformers.LlamaForCausalLM) if arch == "llama"
                                 else (transformers.GPT2Config, transformers.GPT2LMHeadModel))
    config = config_class.from_dict(entry["config"])
    config._attn_implementation = implementation
    model = model_class(config).to(dtype).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in entry["state_dict"].items()}, strict=False)
    model.tie_weights()
    return model


def weights_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (names and float64 bytes, in name order): the same model."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().double().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
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
