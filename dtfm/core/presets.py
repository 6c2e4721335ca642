"""The catalogue of model presets: names people type, mapped to `ModelSpec`s.

Shapes follow GPT-3's table; `gpt-1.3b` is the paper's GPT-3 XL (24 layers, hidden 2048,
16 heads, sequence 2048). `gpt-tiny` and `gpt-mini` use the byte-level vocabulary (256) so
they train on a CPU in seconds. The Llama-family block has `llama-1b` (Llama-3.2-1B's shapes,
Llama 3's scaled rotary embedding), `qwen-0.5b` (Qwen2.5-0.5B's: q/k/v biases) and
`llama-tiny` (byte vocabulary, grouped-query attention) for CPU tests. A preset is a shape,
not weights: `--init-from` takes both from a Hugging Face directory. Pure data: no torch, no
grpc.
"""

from __future__ import annotations

from dataclasses import replace

from dtfm.core.spec import ModelSpec

GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64
LLAMA3_VOCAB = 128256
QWEN2_VOCAB = 151936

PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("gpt-tiny", vocab_size=256, n_layers=4, d_model=64, n_heads=4, seq_len=64),
        ModelSpec("gpt-mini", vocab_size=256, n_layers=6, d_model=128, n_heads=4, seq_len=128),
        ModelSpec("gpt-small", vocab_size=256, n_layers=8, d_model=256, n_heads=8, seq_len=256),
        ModelSpec("gpt-125m", GPT2_VOCAB, n_layers=12, d_model=768, n_heads=12, seq_len=2048),
        ModelSpec("gpt-350m", GPT2_VOCAB, n_layers=24, d_model=1024, n_heads=16, seq_len=2048),
        ModelSpec("gpt-760m", GPT2_VOCAB, n_layers=24, d_model=1536, n_heads=16, seq_len=2048),
        ModelSpec("gpt-1.3b", GPT2_VOCAB, n_layers=24, d_model=2048, n_heads=16, seq_len=2048),
        ModelSpec("gpt-2.7b", GPT2_VOCAB, n_layers=32, d_model=2560, n_heads=32, seq_len=2048),
        ModelSpec("gpt-6.7b", GPT2_VOCAB, n_layers=32, d_model=4096, n_heads=32, seq_len=2048),
        ModelSpec("gpt-13b", GPT2_VOCAB, n_layers=40, d_model=5120, n_heads=40, seq_len=2048),
        ModelSpec("llama-tiny", vocab_size=256, n_layers=4, d_model=64, n_heads=4, seq_len=64,
                  d_ff=176, arch="llama", n_kv_heads=2, norm_eps=1e-5),
        ModelSpec("llama-1b", LLAMA3_VOCAB, n_layers=16, d_model=2048, n_heads=32,
                  seq_len=2048, d_ff=8192, arch="llama", n_kv_heads=8, norm_eps=1e-5,
                  rope_theta=500000.0, rope_type="llama3", rope_factor=32.0,
                  rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                  rope_original_max_positions=8192, max_positions=131072),
        ModelSpec("qwen-0.5b", QWEN2_VOCAB, n_layers=24, d_model=896, n_heads=14, seq_len=2048,
                  d_ff=4864, arch="llama", n_kv_heads=2, norm_eps=1e-6, rope_theta=1e6,
                  qkv_bias=True, max_positions=32768),
    )
}


SEQ_SUFFIX = ":seq="  # `gpt-1.3b:seq=512`: the preset with a shorter (or longer) sequence
MAX_SEQ_LEN = 65536


def get_preset(name: str) -> ModelSpec:
    """The preset called `name`, or a ValueError that lists the known names.

    `NAME:seq=N` is preset NAME trained on sequences of N tokens: the same layers, a position
    embedding of N rows, and activations N/seq_len as large, for a machine that can hold the
    model's parameters but not its full-length activations (docs/benchmarks.md, headline)."""
    base, suffix, seq = name.partition(SEQ_SUFFIX)
    try:
        spec = PRESETS[base]
    except KeyError:
        raise ValueError(
            f"unknown model preset {base!r}; known presets: {', '.join(PRESETS)} (append "
            f"{SEQ_SUFFIX}N for sequences of N tokens)"
        ) from None
    if not suffix:
        return spec
    if not seq.isdigit() or not 1 <= int(seq) <= MAX_SEQ_LEN:
        raise ValueError(f"model {name!r}: the sequence length after {SEQ_SUFFIX!r} must be an "
                         f"integer from 1 to {MAX_SEQ_LEN}, e.g. {base}{SEQ_SUFFIX}512")
    return replace(spec, name=name, seq_len=int(seq))
