"""EAGLE-3 with the fc on the engine's side (--engine-applies-fc, drafter_client.EngineFc; docs/methods.md).

- EngineFc reads the head's fc.weight from every layout the server loads (pytorch_model.bin, model.safetensors,
  sharded safetensors, keys prefixed "model.") and refuses what is not an EAGLE-3 fc;
- the server takes [n, H] rows: GetInfo says so (engine_applies_fc, hidden_states_width = H), a request with the
  three layers' [n, 3 * H_target] rows is refused with INVALID_ARGUMENT naming the width, EAGLE-1 refuses the flag
  at load;
- the drafts are the same as the drafter's own fc gives (CPU, fp32), sequential and P-EAGLE heads, on the eager
  path, on the static first and decode steps that CUDA graphs capture (cuda_graphs.py run eagerly), and through the
  columnar step (Proposer.step_batch) of a batch of 12;
- the reference engine decodes the bundled EAGLE-3 head's way with the fc applied on its side: the same tokens as
  plain greedy decoding and the same acceptance as without the flag;
- pre-drafting: the same hits and drafts as with the drafter's own fc.
"""
import json

import grpc
import pytest
import torch
from safetensors.torch import save_file

from checkpoints import write_eagle3
from conftest import ServerThread, make_config
from drafter_client import DrafterClient, DrafterError, EngineFc, SequenceStep
from drafter_client.engine_fc import read_fc_weight
from drafter_service.engine.cuda_graphs import DecodeGraphs
from drafter_service.engine.step_io import StepInput
from drafter_service.loader import ModelLoadError
from drafter_service.runtime import build_runtime
from test_reference_engine import MODELS
from test_static_steps import mixed_batches
from test_step_batch import as_batch


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    """A tiny EAGLE-3 head whose hidden size (64) differs from its target's (48): fc is [64, 144]."""
    return write_eagle3(tmp_path_factory.mktemp("e3"), seed=5, target_hidden=48, embed=True)


def test_engine_fc_reads_the_heads_fc_in_every_layout(tmp_path, eagle3):
    head, _ = eagle3
    expected = torch.load(head / "pytorch_model.bin", weights_only=True)["fc.weight"]
    fc = EngineFc.from_head(head)  # pytorch_model.bin
    assert torch.equal(fc.weight, expected) and (fc.out_features, fc.in_features) == (64, 144)
    # safetensors, with every key prefixed "model."
    flat = tmp_path / "flat"
    flat.mkdir()
    save_file({"model.fc.weight": expected, "model.norm.weight": torch.ones(32)}, str(flat / "model.safetensors"))
    assert torch.equal(read_fc_weight(flat), expected)
    # sharded: only the shard the index names for fc.weight is opened
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"fc.weight": expected}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"fc.weight": "model-00002-of-00002.safetensors", "norm.weight": "missing-shard.safetensors"}}))
    got = EngineFc.from_head(sharded, dtype="bfloat16")  # (a name, as GetInfo.model_dtype gives it)
    assert got.weight.dtype == torch.bfloat16 and torch.equal(got.weight, expected.to(torch.bfloat16))


def test_engine_fc_refuses_what_is_not_an_eagle3_fc(tmp_path, eagle3):
    with pytest.raises(ValueError, match=r"\[H, 3 \* H_target\]"):
        EngineFc(torch.zeros(4, 5))
    fc = EngineFc.from_head(eagle3[0])
    with pytest.raises(ValueError, match="states have 96 columns; this fc takes 144"):
        fc(torch.zeros(2, 96))
    none = tmp_path / "none"
    none.mkdir()
    save_file({"norm.weight": torch.ones(4)}, str(none / "model.safetensors"))
    with pytest.raises(KeyError, match="no weight 'fc.weight'"):
        EngineFc.from_head(none)
    with pytest.raises(FileNotFoundError, match="no weights"):
        EngineFc.from_head(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype name 'bfloat17'"):
        EngineFc.from_head(eagle3[0], dtype="bfloat17")


def test_eagle1_refuses_the_flag(tiny_model, tmp_path):
    with pytest.raises(ModelLoadError, match="--engine-applies-fc is for EAGLE-3 heads.*'eagle'"):
        build_runtime(make_config(*tiny_model, tmp_path, engine_applies_fc=True))


def _runtime(head, target, tmp_path, engine_applies_fc: bool, static_steps: bool):
    rt = build_runtime(make_config(head, target, tmp_path, engine_applies_fc=engine_applies_fc,
                                   max_batch_seqs=16))
    if static_steps:  # the first and decode steps a CUDA graph captures, run eagerly (test_static_steps.py)
        p = rt.proposer
        p.decode_graphs = DecodeGraphs(p.model, p.kv_layers, rt.kv.block_size, rt.max_model_len, 16, rt.dtype,
                                       rt.device, first_step_tokens=4)
    return rt


@pytest.mark.parametrize("parallel,static_steps,columns", [(False, False, False), (False, True, False),
                                                           (False, True, True), (True, False, False)])
def test_drafts_equal_the_drafters_own_fc(tmp_path, eagle3, parallel, static_steps, columns):
    head, target = write_eagle3(tmp_path / "p", seed=7, target_hidden=48, embed=True, parallel_token_id=3) if parallel else eagle3
    raw = _runtime(head, target, tmp_path / "raw", False, static_steps)
    fc_rt = _runtime(head, target, tmp_path / "fc", True, static_steps)
    assert raw.limits.hidden_states_width == 144 and fc_rt.limits.hidden_states_width == 64
    assert fc_rt.model.fc_w is None  # (the engine holds it)
    fc = EngineFc.from_head(head)
    num_seqs = 12 if columns else 3
    compared = 0
    for batch in mixed_batches(num_seqs, seed=11 + parallel, width=144, vocab=raw.limits.vocab_size, max_m=3):
        applied = [StepInput(**{**s.__dict__, "hidden_states": fc(s.hidden_states)}) for s in batch]
        if columns and batch[0].start_position > 0:  # (a new sequence takes the per-sequence path)
            got_raw = raw.proposer.step_batch(as_batch(batch)).to_outputs()
            got_fc = fc_rt.proposer.step_batch(as_batch(applied)).to_outputs()
        else:
            got_raw, got_fc = raw.proposer.step(batch), fc_rt.proposer.step(applied)
        assert [o.code for o in got_fc] == [0] * num_seqs, [o.message for o in got_fc]
        assert [o.drafts for o in got_fc] == [o.drafts for o in got_raw]
        compared += sum(len(o.drafts) for o in got_fc)
    assert compared > 8 * num_seqs
    if static_steps:
        assert fc_rt.proposer.decode_graphs.first_steps_run > 0
    if columns:
        assert fc_rt.proposer.columns_steps_run > 0


async def test_server_tells_the_width_and_refuses_the_layers_states(tmp_path, eagle3):
    head, target = eagle3
    with ServerThread(make_config(head, target, tmp_path, engine_applies_fc=True)) as s:
        async with DrafterClient(s.uds, namespace="fc") as client:
            info = await client.get_info()
            assert info.engine_applies_fc and info.hidden_states_width == 64 and info.method == "eagle3"
            assert "applied by the engine" in info.hidden_states_source
            fc = EngineFc.from_head(head)
            states = torch.randn(4, 144)
            ok = await client.propose([SequenceStep("a", 0, torch.arange(4), fc(states), 7, 3)])
            assert ok.sequences[0].drafts.numel() == 3
            with pytest.raises(DrafterError) as e:
                await client.propose([SequenceStep("b", 0, torch.arange(4), states, 7, 3)])
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "144 columns; this model takes 64" in e.value.message
            assert "--engine-applies-fc" in e.value.message and "EngineFc" in e.value.message


async def test_reference_engine_with_the_fc_on_its_side(tmp_path):
    """The bundled EAGLE-3 head: plain greedy output, and the acceptance of the drafter's own fc."""
    from tokenizers import Tokenizer

    from drafter_client.benchmarks.prompts import DEMO
    from drafter_client.engine.reference_engine import ReferenceEngine, SpecConfig
    from drafter_client.engine.target import TargetModel

    target = TargetModel.load(str(MODELS / "target"))
    prompts = [Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json")).encode(t).ids for t in DEMO]
    cfg = SpecConfig(max_new_tokens=24, num_drafts=3)
    results = {}
    for flag in (False, True):
        with ServerThread(make_config(MODELS / "eagle3", MODELS / "target", tmp_path / str(flag),
                                      engine_applies_fc=flag)) as s:
            async with DrafterClient(s.uds, namespace="ref") as client:
                info = await client.get_info()
                if flag:
                    with pytest.raises(ValueError, match="pass the head's fc"):
                        ReferenceEngine(target, client, info)
                # (the head is stored in bf16 and served in fp32 here: the fc runs in the drafter's dtype)
                fc = EngineFc.from_head(MODELS / "eagle3", dtype=info.model_dtype) if flag else None
                engine = ReferenceEngine(target, client, info, engine_fc=fc)
                results[flag] = await engine.generate(prompts, cfg)
                plain = await engine.generate_plain(prompts, cfg)
        assert results[flag].tokens == plain.tokens
    assert results[True].acceptance.num_accepted_tokens == results[False].acceptance.num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.parametrize("columns", [False, True])
def test_drafts_equal_the_drafters_own_fc_on_cuda_graphs(tmp_path, eagle3, columns):
    """CUDA, fp32, first-step and decode graphs captured: the engine's fc (here on the CPU) gives the drafts of the
    drafter's own fc inside the first-step graph (as test_cuda_fast_path.py compares CPU and CUDA in fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    head, target = eagle3
    runtimes = [build_runtime(make_config(head, target, tmp_path / str(flag), device="cuda", dtype="float32",
                                          engine_applies_fc=flag, max_batch_seqs=16)) for flag in (False, True)]
    assert all(rt.proposer.decode_graphs is not None for rt in runtimes)
    fc = EngineFc.from_head(head)
    num_seqs = 12 if columns else 3
    for batch in mixed_batches(num_seqs, seed=21, width=144, vocab=runtimes[0].limits.vocab_size, max_m=3):
        applied = [StepInput(**{**s.__dict__, "hidden_states": fc(s.hidden_states)}) for s in batch]
        if columns and batch[0].start_position > 0:
            got_raw, got_fc = (rt.proposer.step_batch(as_batch(b)).to_outputs()
                               for rt, b in zip(runtimes, (batch, applied)))
        else:
            got_raw, got_fc = (rt.proposer.step(b) for rt, b in zip(runtimes, (batch, applied)))
        assert [o.code for o in got_fc] == [0] * num_seqs, [o.message for o in got_fc]
        assert [o.drafts for o in got_fc] == [o.drafts for o in got_raw]
    assert runtimes[1].proposer.decode_graphs.first_steps_run > 0


def test_predrafting_with_the_engines_fc(tmp_path, eagle3):
    """Pre-drafting (docs/predraft.md) under --engine-applies-fc: the same hits and the same drafts as with the
    drafter's own fc, over steps that follow prepared branches and steps that miss them."""
    import random

    head, target = eagle3
    raw, fc_rt = (build_runtime(make_config(head, target, tmp_path / str(flag), engine_applies_fc=flag,
                                            max_model_len=512)) for flag in (False, True))
    fc = EngineFc.from_head(head)
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    vocab, k = raw.limits.vocab_size, 3
    tokens = [rng.randrange(vocab) for _ in range(12)]  # x[0..11]
    hidden = torch.randn(11, 144, generator=gen)

    def step(p: int, states: torch.Tensor) -> StepInput:
        C = len(tokens) - 1
        return StepInput("ns", "s", p, torch.tensor(tokens[p:C]), states[p:C], tokens[C], k, predraft_branches=6)

    hits, committed = 0, 0  # (the sequence's committed length at the drafter)
    for _ in range(16):
        p = committed
        got_raw, got_fc = raw.proposer.step([step(p, hidden)])[0], fc_rt.proposer.step([step(p, fc(hidden))])[0]
        assert (got_fc.code, got_fc.drafts, got_fc.predrafted) == (got_raw.code, got_raw.drafts, got_raw.predrafted)
        hits += got_fc.predrafted
        assert raw.proposer.predraft.prepare(lambda: False) == fc_rt.proposer.predraft.prepare(lambda: False)
        st = raw.proposer.table.get("ns", "s").predraft
        outcomes = list(st.branches.outcomes) if st.branches is not None else []
        if outcomes and rng.random() < 0.7:
            a, b = rng.choice(outcomes)
        else:
            a, b = 0, rng.randrange(vocab)
        committed = got_raw.committed_length
        tokens += got_raw.drafts[:a] + [b]
        hidden = torch.cat([hidden, torch.randn(a + 1, 144, generator=gen)])
    assert hits >= 3, hits
