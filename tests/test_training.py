"""Tests of the demo training tool (CPU only). The smoke preset runs once per session into a tmp dir."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from drafter_service.training import train_demo
from drafter_service.training.corpus import is_heldout, load_corpus
from drafter_service.training.data import batches, to_windows
from drafter_service.training.eagle1 import eagle1_loss
from drafter_service.training.eagle3 import draft_vocab_from_counts, ttt_unroll
from drafter_service.training.evaluate import acceptance_stats, draft_greedy
from drafter_service.training.export import SIZE_BUDGET_BYTES, check_size_budget, estimate_bytes
from drafter_service.training.features import target_features
from drafter_service.training.loop import train
from drafter_service.training.presets import DEMO, SMOKE
from drafter_service.training.target import build_target, lm_loss, target_config

P = SMOKE
H, HEAD_DIM, KV = P.hidden_size, P.hidden_size // P.num_heads, P.num_kv_heads * (P.hidden_size // P.num_heads)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "models"
    assert train_demo.main(["--out", str(out), "--device", "cpu", "--preset", "smoke", "--seed", "0"]) == 0
    return out


def _vocab(smoke):
    return json.loads((smoke / "target" / "config.json").read_text())["vocab_size"]


# ---- the smoke run and its artifacts ----

def test_target_and_tokenizer_load(smoke):
    from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    model = LlamaForCausalLM.from_pretrained(smoke / "target")
    cfg = json.loads((smoke / "target" / "config.json").read_text())
    assert cfg["rope_theta"] == P.rope_theta and cfg["tie_word_embeddings"] is False
    assert model.config.num_hidden_layers == P.num_layers and model.config.hidden_size == H
    st = load_file(smoke / "target" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in st.values())
    assert "lm_head.weight" in st and "model.embed_tokens.weight" in st
    text = "def add(a, b):\n    return a + b\n"
    for cls in (PreTrainedTokenizerFast, AutoTokenizer):
        tok = cls.from_pretrained(smoke / "target")
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
        assert max(ids) < cfg["vocab_size"] and tok.eos_token_id == 0
    out = model.generate(torch.tensor([tok(text).input_ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == len(tok(text).input_ids) + 4


def test_eagle1_layout(smoke):
    st = load_file(smoke / "eagle1" / "model.safetensors")
    inter = P.intermediate_size
    expected = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (H, H),
        "layers.0.self_attn.k_proj.weight": (KV, H),
        "layers.0.self_attn.v_proj.weight": (KV, H),
        "layers.0.self_attn.o_proj.weight": (H, H),
        "layers.0.mlp.gate_proj.weight": (inter, H),
        "layers.0.mlp.up_proj.weight": (inter, H),
        "layers.0.mlp.down_proj.weight": (H, inter),
        "layers.0.post_attention_layernorm.weight": (H,),
    }
    assert {k: tuple(v.shape) for k, v in st.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in st.values())
    cfg = json.loads((smoke / "eagle1" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == _vocab(smoke)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "rope_theta", "max_position_embeddings"):
        assert key in cfg, key


def test_eagle3_layout(smoke):
    st = load_file(smoke / "eagle3" / "model.safetensors")
    inter, vd, vocab = P.intermediate_size, P.draft_vocab_size, _vocab(smoke)
    expected = {
        "fc.weight": (H, 3 * H),
        "midlayer.self_attn.q_proj.weight": (H, 2 * H),
        "midlayer.self_attn.k_proj.weight": (KV, 2 * H),
        "midlayer.self_attn.v_proj.weight": (KV, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, H),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (vd, H),
        "d2t": (vd,),
        "t2d": (vocab,),
    }
    assert {k: tuple(v.shape) for k, v in st.items()} == expected
    assert st["d2t"].dtype == torch.int64 and st["t2d"].dtype == torch.bool
    target_ids = torch.arange(vd) + st["d2t"]
    assert st["t2d"].sum().item() == vd and st["t2d"][target_ids].all()
    assert (target_ids[1:] > target_ids[:-1]).all()  # sorted, distinct
    cfg = json.loads((smoke / "eagle3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == vd and cfg["vocab_size"] == vocab and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(P.aux_layer_ids)


def test_report_and_size_budget(smoke):
    r = json.loads((smoke / "training_report.json").read_text())
    assert math.isfinite(r["eval"]["target"]["perplexity"]) and r["eval"]["target"]["perplexity"] < P.vocab_size
    for name in ("eagle1", "eagle3"):
        by_k = r["eval"]["acceptance"][name]["by_k"]
        assert sorted(by_k, key=int) == ["1", "2", "3", "4", "5"]
        means = [by_k[str(k)]["mean_accepted"] for k in range(1, 6)]
        assert all(0 <= m <= k for k, m in zip(range(1, 6), means)) and means == sorted(means)
        assert (smoke / name / "README.md").read_text().count("mean accepted") == 1
    assert r["corpus"]["python_version"] and r["corpus"]["eligible_files"] > 0
    for stage in ("target", "eagle1", "eagle3"):
        assert r["training"][stage]["history"][-1]["loss"] < r["training"][stage]["history"][0]["loss"]
    files = [smoke / d for d in ("target", "eagle1", "eagle3")]
    assert check_size_budget(files) == r["artifacts"]["total_bytes"] <= SIZE_BUDGET_BYTES
    (smoke / "target" / "big.bin").write_bytes(b"\0" * (SIZE_BUDGET_BYTES + 1))
    try:
        with pytest.raises(RuntimeError, match="budget"):
            check_size_budget(files)
    finally:
        (smoke / "target" / "big.bin").unlink()


def test_refuses_to_overwrite_without_flag(smoke):
    with pytest.raises(SystemExit, match="--overwrite"):
        train_demo.main(["--out", str(smoke), "--device", "cpu", "--preset", "smoke"])


def test_demo_preset_fits_size_budget():
    vocab = DEMO.vocab_size
    target = build_target(target_config(DEMO, vocab, 0), seed=0)
    draft = torch.arange(DEMO.draft_vocab_size)
    head1, head3 = train_demo.build_heads(DEMO, vocab, draft, seed=0)
    n = [sum(p.numel() for p in m.parameters()) for m in (target, head1, head3)]
    # weights plus ~0.6 MB of tokenizer.json and small json/markdown files
    assert estimate_bytes(n) + 1_000_000 < SIZE_BUDGET_BYTES


# ---- units ----

def test_heldout_split_is_deterministic_and_disjoint():
    c = load_corpus(60_000)
    assert c.heldout_paths and c.train_paths and not set(c.train_paths) & set(c.heldout_paths)
    assert all(is_heldout(p) for p in c.heldout_paths) and not any(is_heldout(p) for p in c.train_paths)
    assert load_corpus(60_000).train_paths == c.train_paths


def _tiny_target(vocab=64):
    return build_target(target_config(P, vocab, 0), seed=0)


def test_aux_features_are_layer_inputs():
    model = _tiny_target().eval()
    ids = torch.randint(0, 64, (2, 12))
    feats = target_features(model, ids, list(P.aux_layer_ids))
    hs = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    expected = torch.cat([hs[i] for i in P.aux_layer_ids], dim=-1)
    assert torch.allclose(feats.aux, expected, atol=1e-5)
    assert torch.allclose(feats.logits, model(input_ids=ids).logits, atol=1e-4)


def _heads(vocab=64):
    torch.manual_seed(0)
    draft = torch.arange(0, vocab, 2)
    head1, head3 = train_demo.build_heads(P, vocab, draft, seed=0)
    return head1.eval(), head3.eval()


@torch.no_grad()
def test_cached_draft_chain_equals_full_recompute():
    """draft_greedy (step keys cached) == recomputing the whole head sequence causally at every step."""
    vocab, plen, k = 64, 10, 4
    embed = torch.nn.Embedding(vocab, H)
    lm_head = torch.nn.Linear(H, vocab, bias=False)
    head1, head3 = _heads(vocab)
    prefix = torch.randint(0, vocab, (3, plen))
    y1 = torch.randint(0, vocab, (3,))
    for head, first, to_ids in (
        (head1, torch.randn(3, plen, H), lambda h: lm_head(h).argmax(-1)),
        (head3, head3.combine(torch.randn(3, plen, 3 * H)), lambda h: head3.to_target_ids(head3.logits(h).argmax(-1))),
    ):
        drafts = draft_greedy(head, embed, to_ids, prefix, first, y1, k)
        tokens = torch.cat([prefix[:, 1:], y1[:, None]], dim=1)
        hidden = first
        naive = []
        for j in range(k):
            out, _ = head.step(embed(tokens), hidden, torch.arange(tokens.size(1)), causal=True)
            tok = to_ids(out[:, -1:])
            naive.append(tok)
            tokens = torch.cat([tokens, tok], dim=1)
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        assert torch.equal(drafts, torch.cat(naive, dim=1))


@torch.no_grad()
def test_training_time_test_matches_the_inference_chain():
    """TTT step j at pair t == the chain a drafter runs from context x[0..t+1] with teacher-forced tokens."""
    vocab, t_len, steps = 64, 14, 3
    embed = torch.nn.Embedding(vocab, H)
    _, head3 = _heads(vocab)
    ids = torch.randint(0, vocab, (2, t_len))
    aux = torch.randn(2, t_len, 3 * H)
    outs = ttt_unroll(head3, embed, ids, aux, steps)
    for t in (0, 5, t_len - 1 - steps):
        tokens = ids[:, 1 : t + 2]
        hidden = head3.combine(aux[:, : t + 1])
        for j in range(steps):
            out, _ = head3.step(embed(tokens), hidden, torch.arange(tokens.size(1)), causal=True)
            assert torch.allclose(out[:, -1], outs[j][:, t], atol=1e-5), (t, j)
            tokens = torch.cat([tokens, ids[:, t + 2 + j : t + 3 + j]], dim=1)
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)


def test_acceptance_stats_counts_leading_matches():
    cont = torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 1, 2, 3]])
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [0, 2, 3]])  # accepted 3, 1, 0
    s = acceptance_stats(drafts, cont)
    assert s["by_k"]["1"]["mean_accepted"] == pytest.approx(2 / 3)
    assert s["by_k"]["3"]["mean_accepted"] == pytest.approx(4 / 3)
    assert s["per_depth_conditional_acceptance"] == pytest.approx([2 / 3, 1 / 2, 1.0])


def test_draft_vocab_is_most_frequent_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert draft_vocab_from_counts(counts, 3).tolist() == [2, 3, 5]


def test_tiny_training_loops_reduce_loss():
    torch.manual_seed(0)
    vocab = 64
    pattern = torch.randint(0, vocab, (40,))
    windows = to_windows(pattern.repeat(40), 32)
    model = _tiny_target(vocab)
    cpu = torch.device("cpu")
    hist = train("t", list(model.parameters()), lambda b: (lm_loss(model, b), {}), batches(windows, 8, 0), 40, 3e-3, 5,
                 cpu, 10)
    assert hist[-1]["loss"] < 0.5 * hist[0]["loss"]
    model.eval().requires_grad_(False)
    head1, _ = _heads(vocab)
    head1.train()
    embed, lm_head = model.get_input_embeddings(), model.lm_head
    hist1 = train("e1", list(head1.parameters()),
                  lambda b: eagle1_loss(head1, embed, lm_head, b, target_features(model, b).final),
                  batches(windows, 8, 1), 30, 3e-3, 5, cpu, 10)
    assert hist1[-1]["loss"] < 0.7 * hist1[0]["loss"]
