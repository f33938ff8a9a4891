"""Hyper-parameter presets. ``demo`` is the real run (one H100/H200, a few minutes); ``smoke`` runs on a CPU in seconds."""
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    # corpus / tokenizer
    max_corpus_bytes: int | None  # cap on the train split (sorted file order); None = whole stdlib
    vocab_size: int
    # target LM (LlamaForCausalLM)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seq_len: int
    target_batch: int
    target_epochs: float
    target_lr: float
    # EAGLE heads (same width as the target)
    head_batch: int
    eagle1_epochs: float
    eagle3_epochs: float
    head_lr: float
    draft_vocab_size: int
    aux_layer_ids: tuple[int, int, int]  # EAGLE-3: hidden states entering these target layers
    ttt_steps: int  # EAGLE-3 training-time-test unroll length
    # evaluation
    eval_prefix_len: int
    eval_prefixes: int
    eval_k: int
    ppl_windows: int  # held-out windows of seq_len tokens used for perplexity
    log_every: int
    warmup_steps: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def to_dict(self) -> dict:
        return asdict(self)


DEMO = Preset(
    name="demo",
    max_corpus_bytes=None,
    vocab_size=8192,
    hidden_size=256,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=1024,
    max_position_embeddings=2048,
    seq_len=512,
    target_batch=64,
    target_epochs=4,  # measured on the H200: more epochs lower perplexity but make the target harder to draft
    target_lr=2e-3,
    head_batch=32,
    eagle1_epochs=40,
    eagle3_epochs=24,
    head_lr=1e-3,
    draft_vocab_size=2048,
    aux_layer_ids=(1, 3, 5),
    ttt_steps=5,
    eval_prefix_len=256,
    eval_prefixes=512,
    eval_k=5,
    ppl_windows=512,
    log_every=25,
    warmup_steps=100,
)

SMOKE = Preset(
    name="smoke",
    max_corpus_bytes=120_000,
    vocab_size=384,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=192,
    max_position_embeddings=256,
    seq_len=128,
    target_batch=8,
    target_epochs=1,
    target_lr=3e-3,
    head_batch=8,
    eagle1_epochs=0.5,
    eagle3_epochs=0.5,
    head_lr=3e-3,
    draft_vocab_size=192,
    aux_layer_ids=(1, 2, 3),
    ttt_steps=3,
    eval_prefix_len=48,
    eval_prefixes=16,
    eval_k=5,
    ppl_windows=8,
    log_every=10,
    warmup_steps=5,
)

PRESETS = {p.name: p for p in (DEMO, SMOKE)}
