"""The EAGLE-1 loader: published layouts load (fc.bias or not, embed_tokens or not, safetensors or .bin), and
every inconsistency fails at start-up naming the key or field."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import write_eagle1
from drafter_service.loader import ModelLoadError, load_head

CPU = torch.device("cpu")


def load(head, target=None, dtype=torch.float32):
    return load_head(str(head), None if target is None else str(target), CPU, dtype, max_positions=256).model


@pytest.mark.parametrize("fc_bias", [True, False])
@pytest.mark.parametrize("embed", [True, False])
@pytest.mark.parametrize("bin_format", [True, False])
def test_published_layouts_load(tmp_path, fc_bias, embed, bin_format):
    head, target = write_eagle1(tmp_path, fc_bias=fc_bias, embed=embed, bin_format=bin_format)
    m = load(head, target)
    assert (m.fc_b is not None) == fc_bias
    tgt = load_file(str(target / "model.safetensors"))
    if embed:
        src = torch.load(head / "pytorch_model.bin") if bin_format else load_file(str(head / "model.safetensors"))
        assert torch.equal(m.embed_tokens, src["embed_tokens.weight"])
    else:
        assert torch.equal(m.embed_tokens, tgt["model.embed_tokens.weight"])
    assert torch.equal(m.lm_head, tgt["lm_head.weight"])
    assert m.vocab_size == 512 and m.hidden_states_width == 64


def test_dtypes(tmp_path):
    head, target = write_eagle1(tmp_path)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        m = load(head, target, dt)
        assert m.fc_w.dtype == dt and m.lm_head.dtype == dt


def test_sharded_target_and_tied_embeddings(tmp_path):
    head, target = write_eagle1(tmp_path)
    tgt = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    save_file({"model.embed_tokens.weight": tgt["model.embed_tokens.weight"]}, str(target / "a.safetensors"))
    save_file({"model.norm.weight": tgt["model.norm.weight"]}, str(target / "b.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "a.safetensors", "model.norm.weight": "b.safetensors"}}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load(head, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    m = load(head, target)
    assert torch.equal(m.lm_head, tgt["model.embed_tokens.weight"])


def test_errors_name_the_problem(tmp_path):
    head, target = write_eagle1(tmp_path)
    with pytest.raises(ModelLoadError, match="--target-model"):
        load(head, None)
    state = load_file(str(head / "model.safetensors"))
    bad = dict(state)
    bad["layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(bad, str(head / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers.0.self_attn.k_proj.weight.*\(7, 64\).*\(32, 64\)"):
        load(head, target)
    bad = {k: v for k, v in state.items() if k != "layers.0.mlp.up_proj.weight"}
    save_file(bad, str(head / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="layers.0.mlp.up_proj.weight.*missing"):
        load(head, target)
    save_file(state, str(head / "model.safetensors"))
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "intermediate_size"}))
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        load(head, target)
    (head / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load(head, target)
    (head / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load(head, target)


def test_unknown_layout_is_refused(tmp_path):
    head, target = write_eagle1(tmp_path)
    save_file({"transformer.h.0.weight": torch.zeros(2, 2)}, str(head / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unknown head layout"):
        load(head, target)
