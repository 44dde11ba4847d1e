"""A tiny random-weight llama model in GGUF, made on the spot so tests never download one.

The tokenizer is GPT-2 style byte-level BPE: the 256 byte tokens, a few merges and the
ChatML control tokens. The output projection is zero for every token but printable ASCII
and large for those, so sampling never picks a control token: generations always run to
``max_tokens`` (finish_reason "length") and the text is readable ASCII noise.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

EMBEDDING_LENGTH = 64
FEED_FORWARD_LENGTH = 128
BLOCK_COUNT = 2
HEAD_COUNT = 4
CONTEXT_LENGTH = 512

BEGIN_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CONTROL_TOKENS = (BEGIN_OF_TEXT, IM_START, IM_END)
MERGES = ("Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "a n", "o r")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which llama.cpp expects."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def tiny_vocabulary() -> tuple[list[str], list[int], set[int]]:
    """Returns tokens, their GGUF token types and the ids that sampling may produce."""
    byte_tokens = byte_to_unicode()
    tokens = [byte_tokens[b] for b in range(256)]
    tokens += ["".join(merge.split(" ")) for merge in MERGES]
    token_types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += CONTROL_TOKENS
    token_types += [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS)
    printable_ascii = {byte_tokens[b] for b in range(ord(" "), ord("~") + 1)}
    sampleable = {i for i, t in enumerate(tokens[: 256 + len(MERGES)]) if all(c in printable_ascii for c in t)}
    return tokens, [int(t) for t in token_types], sampleable


def write_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """Writes a deterministic ~0.5 MB llama GGUF with a ChatML chat template to ``path``."""
    rng = np.random.default_rng(seed)
    tokens, token_types, sampleable = tiny_vocabulary()
    vocab_size = len(tokens)
    head_dim = EMBEDDING_LENGTH // HEAD_COUNT

    def weights(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("paralon-tiny-test")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(EMBEDDING_LENGTH)
    writer.add_feed_forward_length(FEED_FORWARD_LENGTH)
    writer.add_block_count(BLOCK_COUNT)
    writer.add_head_count(HEAD_COUNT)
    writer.add_head_count_kv(HEAD_COUNT)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(tokens.index(BEGIN_OF_TEXT))
    writer.add_eos_token_id(tokens.index(IM_END))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    # ggml lists dimensions innermost first, numpy outermost first: shapes here are (out, in).
    writer.add_tensor("token_embd.weight", weights(vocab_size, EMBEDDING_LENGTH, scale=1.0))
    for block in range(BLOCK_COUNT):
        prefix = f"blk.{block}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(EMBEDDING_LENGTH, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", weights(EMBEDDING_LENGTH, EMBEDDING_LENGTH))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(EMBEDDING_LENGTH, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(FEED_FORWARD_LENGTH, EMBEDDING_LENGTH))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(FEED_FORWARD_LENGTH, EMBEDDING_LENGTH))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(EMBEDDING_LENGTH, FEED_FORWARD_LENGTH))
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING_LENGTH, dtype=np.float32))
    output = weights(vocab_size, EMBEDDING_LENGTH, scale=1.0)
    output[[i for i in range(vocab_size) if i not in sampleable]] = 0.0
    writer.add_tensor("output.weight", output)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
