"""EAGLE-3, P-EAGLE and multi-layer layouts load from small checkpoints the test writes; inconsistent layouts fail at
start-up with a message naming the key or field (EAGLE-1 and unknown layouts: test_loader.py)."""
import json

import pytest
import torch

from checkpoints import write_eagle1, write_eagle3, write_multi_layer
from drafter_service.loader import ModelLoadError, load_head

CPU = torch.device("cpu")


def load(head, target):
    return load_head(str(head), None if target is None else str(target), CPU, torch.float32, max_positions=256)


def edit_config(head, **changes):
    path = head / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("architecture", [
    "LlamaForCausalLMEagle3",  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
    "Eagle3LlamaForCausalLM",
    "LlamaForCausalLM",  # detected by draft_vocab_size
])
@pytest.mark.parametrize("bin_format", [True, False])
def test_eagle3_published_layouts(tmp_path, architecture, bin_format):
    head, target = write_eagle3(tmp_path, architecture=architecture, bin_format=bin_format, target_layers=32)
    h = load(head, target)
    assert h.method == "eagle3" and h.model.drafting == "sequential"
    assert h.target_layer_ids == [2, 16, 29]  # (2, L//2, L-3) from the target's num_hidden_layers
    assert h.model.hidden_states_width == 3 * 64 and h.model.draft_vocab_size == 200 and h.model.vocab_size == 512
    d2t = h.model.d2t
    assert torch.equal(h.model.draft_to_target(torch.arange(200)), torch.arange(200) + d2t)


def test_eagle3_variants(tmp_path):
    # target hidden 48 != head hidden 64, own embed_tokens, full vocabulary (no d2t), vLLM naming layers.0.*
    head, target = write_eagle3(tmp_path / "a", target_hidden=48, embed=True, draft_vocab=None, layer_prefix="layers.0")
    h = load(head, target)
    assert h.model.hidden_states_width == 144 and h.model.d2t is None and h.model.draft_vocab_size == 512
    # layer ids from the head's eagle_config: no target directory needed when the head has embed_tokens
    head, _ = write_eagle3(tmp_path / "b", embed=True, aux_layer_ids=[1, 5, 9])
    assert load(head, None).target_layer_ids == [1, 5, 9]
    # P-EAGLE: ptd_token_id + mask_hidden
    head, target = write_eagle3(tmp_path / "c", parallel_token_id=3)
    h = load(head, target)
    assert h.model.drafting == "parallel" and h.model.parallel_token_id == 3 and h.model.mask_hidden.shape == (64,)


def test_multi_layer_layouts(tmp_path):
    head, target = write_multi_layer(tmp_path / "a", n_predict=2)
    h = load(head, target)
    assert h.method == "multi_layer_eagle" and h.model.num_kv_layers == 2 and h.model.drafting == "multi_layer"
    head, _ = write_multi_layer(tmp_path / "b", n_predict=3, own_heads=True, embed=True, bin_format=True)
    assert load(head, None).model.num_predict == 3


BAD = [
    # (writer kwargs, config edits, key or field the message must name)
    ("eagle3", dict(drop=("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                          "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                          "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                          "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
                          "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight")), {},
     "midlayer.hidden_norm.weight"),
    ("eagle3", dict(drop=("d2t",)), {}, "'d2t'"),
    ("eagle3", dict(drop=("norm.weight",)), {}, "'norm.weight'"),
    ("eagle3", dict(drop=("midlayer.self_attn.k_proj.weight",)), {}, "'midlayer.self_attn.k_proj.weight'"),
    ("eagle3", dict(drop=("lm_head.weight",)), {}, "'lm_head.weight'"),
    ("eagle3", dict(target_hidden=48), {}, "embed_tokens.weight"),  # target embed [V, 48] cannot serve H = 64
    ("eagle3", dict(), {"target_hidden_size": 80}, "target_hidden_size"),  # fc / target disagree
    ("eagle3", dict(), {"num_hidden_layers": 2}, "num_hidden_layers"),
    ("eagle3", dict(), {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 40]}},
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", dict(), {"ptd_token_id": 5}, "'mask_hidden'"),
    ("eagle3", dict(), {"vocab_size": 1000}, "vocab_size"),
    ("multi", dict(), {"n_predict": 4}, "n_predict"),
    ("multi", dict(drop=("layers.1.eh_proj.weight",)), {}, "'layers.1.eh_proj.weight'"),
    ("multi", dict(drop=("layers.0.shared_head.norm.weight",)), {}, "'layers.0.shared_head.norm.weight'"),
    ("multi", dict(), {"n_predict": None}, "n_predict"),
    ("eagle1", dict(), {"ptd_token_id": 5}, "ptd_token_id"),
    ("eagle1", dict(), {"draft_vocab_size": 100}, "draft_vocab_size"),
]


@pytest.mark.parametrize("kind,kwargs,edits,named", BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_bad_layouts_fail_naming_the_key(tmp_path, kind, kwargs, edits, named):
    writer = {"eagle3": write_eagle3, "multi": write_multi_layer, "eagle1": write_eagle1}[kind]
    head, target = writer(tmp_path, **kwargs)
    edit_config(head, **edits)
    with pytest.raises(ModelLoadError) as e:
        load(head, target)
    assert named in str(e.value)


def test_eagle3_without_layer_ids_or_target_fails(tmp_path):
    head, _ = write_eagle3(tmp_path, embed=True)
    with pytest.raises(ModelLoadError, match="eagle_aux_hidden_state_layer_ids"):
        load(head, None)


def test_eagle3_fc_inconsistent_with_config_names_fc(tmp_path):
    head, _ = write_eagle3(tmp_path, embed=True, aux_layer_ids=[1, 2, 3])
    edit_config(head, target_hidden_size=80)
    with pytest.raises(ModelLoadError, match="'fc.weight' has shape"):
        load(head, None)
