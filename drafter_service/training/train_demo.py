"""Train the demo model pair end to end and write it under --out.

    python -m drafter_service.training.train_demo --out models/ --device cuda [--preset demo|smoke] [--seed 0]

Stages: corpus (stdlib) -> BPE tokenizer -> target LM -> EAGLE-1 head -> EAGLE-3 head -> held-out evaluation ->
export (models/target, models/eagle1, models/eagle3, training_report.{json,md}).
"""
import argparse
import platform
import random
import shlex
import shutil
import sys
import time
from pathlib import Path

import safetensors
import tokenizers
import torch
import transformers

from drafter_service.training.corpus import load_corpus
from drafter_service.training.data import batches, steps_for_epochs, to_windows
from drafter_service.training.eagle1 import Eagle1Head, eagle1_loss
from drafter_service.training.eagle3 import Eagle3Head, draft_vocab_from_counts, eagle3_loss
from drafter_service.training.evaluate import eval_prefixes, greedy_acceptance, heldout_perplexity
from drafter_service.training.export import (SIZE_BUDGET_BYTES, check_size_budget, dir_bytes, estimate_bytes, round_to_bf16, save_eagle1,
                     save_eagle3, save_target)
from drafter_service.training.features import target_features
from drafter_service.training.loop import train
from drafter_service.training.presets import PRESETS, Preset
from drafter_service.training.progress import fmt_seconds, say
from drafter_service.training.report import write_model_card, write_report
from drafter_service.training.target import build_target, lm_loss, target_config
from drafter_service.training.tokenizer import EOS, encode_documents, save_tokenizer, train_tokenizer

MODEL_DIRS = ("target", "eagle1", "eagle3")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="drafter-train-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory (gets target/, eagle1/, eagle3/, reports)")
    ap.add_argument("--device", required=True, choices=["cuda", "cpu"])
    ap.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    ap.add_argument("--seed", default=0, type=int)
    ap.add_argument("--overwrite", action="store_true", help="replace existing target/, eagle1/, eagle3/ under --out")
    return ap.parse_args(argv)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False (use --device cpu)")
    return torch.device(name)


def prepare_out(out: Path, overwrite: bool) -> None:
    taken = [d for d in MODEL_DIRS if (out / d).exists() and any((out / d).iterdir())]
    if taken and not overwrite:
        raise SystemExit(f"error: {out} already holds {', '.join(taken)}; pass --overwrite to replace them")
    for d in taken:
        shutil.rmtree(out / d)
    out.mkdir(parents=True, exist_ok=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def build_heads(p: Preset, vocab: int, draft_ids: torch.Tensor, seed: int) -> tuple[Eagle1Head, Eagle3Head]:
    torch.manual_seed(seed + 1)
    head1 = Eagle1Head(p.hidden_size, p.intermediate_size, p.num_heads, p.num_kv_heads, p.rms_norm_eps, p.rope_theta)
    torch.manual_seed(seed + 2)
    head3 = Eagle3Head(p.hidden_size, p.intermediate_size, p.num_heads, p.num_kv_heads, p.rms_norm_eps, p.rope_theta,
                       draft_ids, vocab)
    return head1, head3


def run(args: argparse.Namespace, command: str) -> dict:
    """The whole pipeline; ``command`` is recorded in the report and model cards."""
    p = PRESETS[args.preset]
    device = resolve_device(args.device)
    prepare_out(args.out, args.overwrite)
    seed_everything(args.seed)
    transformers.utils.logging.disable_progress_bar()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    say(f"== drafter-train-demo: preset {p.name}, seed {args.seed}, device {device_name(device)}, python "
        f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")

    # 1. corpus
    t = time.perf_counter()
    corpus = load_corpus(p.max_corpus_bytes)
    stats = corpus.stats()
    say(f"== corpus: python {stats['python_version']} stdlib at {stats['root']}: {stats['eligible_files']} files, "
        f"train {stats['train_files']} ({stats['train_bytes']:,} B), held-out {stats['heldout_files']} ({stats['heldout_bytes']:,} B)")
    timings["corpus"] = time.perf_counter() - t

    # 2. tokenizer
    t = time.perf_counter()
    tok = train_tokenizer(corpus.train_texts, p.vocab_size)
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS)
    train_ids = torch.tensor(encode_documents(tok, corpus.train_texts), dtype=torch.long)
    heldout_ids = torch.tensor(encode_documents(tok, corpus.heldout_texts), dtype=torch.long)
    stats.update(train_tokens=train_ids.numel(), heldout_tokens=heldout_ids.numel())
    timings["tokenizer"] = time.perf_counter() - t
    say(f"== tokenizer: vocab {vocab}, train {train_ids.numel():,} tokens ({stats['train_bytes'] / train_ids.numel():.2f} "
        f"bytes/token), held-out {heldout_ids.numel():,} tokens [{timings['tokenizer']:.1f} s]")

    # models, and the size budget before any training time is spent
    target = build_target(target_config(p, vocab, eos_id), args.seed)
    counts = torch.bincount(train_ids, minlength=vocab)
    draft_ids = draft_vocab_from_counts(counts, p.draft_vocab_size)
    draft_coverage = counts[draft_ids].sum().item() / counts.sum().item()
    head1, head3 = build_heads(p, vocab, draft_ids, args.seed)
    estimate = estimate_bytes([num_params(target), num_params(head1), num_params(head3)])
    if estimate > SIZE_BUDGET_BYTES:
        raise SystemExit(f"error: preset {p.name} needs about {estimate / 1e6:.1f} MB of bf16 weights, over the "
                         f"{SIZE_BUDGET_BYTES / 1e6:.0f} MB budget")
    say(f"== parameters: target {num_params(target):,}, eagle1 {num_params(head1):,}, eagle3 {num_params(head3):,} "
        f"(~{estimate / 1e6:.1f} MB in bf16)")
    target.to(device)
    train_windows = to_windows(train_ids, p.seq_len)
    heldout_windows = to_windows(heldout_ids, p.seq_len)[: p.ppl_windows]

    # 3. target LM
    steps_t = steps_for_epochs(train_windows.size(0), p.target_batch, p.target_epochs)
    say(f"== target: {steps_t} steps of {p.target_batch}x{p.seq_len} tokens ({p.target_epochs} epochs)")
    t = time.perf_counter()
    target.train()

    def heldout_loss() -> dict[str, float]:
        target.eval()
        result = heldout_perplexity(target, heldout_windows, p.target_batch, device)
        target.train()
        return {"heldout_loss": result["loss"]}

    hist_t = train("target", list(target.parameters()), lambda b: (lm_loss(target, b), {}),
                   batches(train_windows, p.target_batch, args.seed), steps_t, p.target_lr, p.warmup_steps, device,
                   p.log_every, eval_fn=heldout_loss, eval_every=steps_for_epochs(train_windows.size(0), p.target_batch, 1))
    timings["target"] = time.perf_counter() - t
    round_to_bf16(target)
    target.eval().requires_grad_(False)
    t = time.perf_counter()
    ppl = heldout_perplexity(target, heldout_windows, p.target_batch, device)
    timings["eval_perplexity"] = time.perf_counter() - t
    say(f"== target held-out: loss {ppl['loss']:.4f}, perplexity {ppl['perplexity']:.2f} ({ppl['tokens']:,} tokens)")

    embed, lm_head = target.get_input_embeddings(), target.lm_head
    aux_ids = list(p.aux_layer_ids)
    if max(aux_ids) >= p.num_layers or len(set(aux_ids)) != 3:
        raise SystemExit(f"error: aux_layer_ids {aux_ids} must be 3 distinct layers < {p.num_layers}")

    # 4. EAGLE-1 head
    head1.to(device).train()
    steps_1 = steps_for_epochs(train_windows.size(0), p.head_batch, p.eagle1_epochs)
    say(f"== eagle1: {steps_1} steps of {p.head_batch}x{p.seq_len} tokens ({p.eagle1_epochs} epochs)")
    t = time.perf_counter()
    hist_1 = train("eagle1", list(head1.parameters()),
                   lambda b: eagle1_loss(head1, embed, lm_head, b, target_features(target, b).final),
                   batches(train_windows, p.head_batch, args.seed + 1), steps_1, p.head_lr, p.warmup_steps, device,
                   p.log_every)
    timings["eagle1"] = time.perf_counter() - t
    round_to_bf16(head1)

    # 5. EAGLE-3 head (lm_head and norm start from the target's rows for the draft vocab)
    with torch.no_grad():
        head3.lm_head.weight.copy_(lm_head.weight[draft_ids].cpu())
        head3.norm.weight.copy_(target.model.norm.weight.cpu())
    head3.to(device).train()
    steps_3 = steps_for_epochs(train_windows.size(0), p.head_batch, p.eagle3_epochs)
    say(f"== eagle3: {steps_3} steps of {p.head_batch}x{p.seq_len} tokens ({p.eagle3_epochs} epochs), "
        f"{p.ttt_steps} training-time-test steps, draft vocab {p.draft_vocab_size} "
        f"(covers {draft_coverage:.1%} of train tokens), aux layers {aux_ids}")

    def loss3(b):
        f = target_features(target, b, aux_ids)
        return eagle3_loss(head3, embed, b, f.aux, f.logits, p.ttt_steps)

    t = time.perf_counter()
    hist_3 = train("eagle3", list(head3.parameters()), loss3, batches(train_windows, p.head_batch, args.seed + 2),
                   steps_3, p.head_lr, p.warmup_steps, device, p.log_every)
    timings["eagle3"] = time.perf_counter() - t
    round_to_bf16(head3)

    # 6. held-out greedy acceptance
    t = time.perf_counter()
    prefixes = eval_prefixes(heldout_ids, p.eval_prefix_len, p.eval_prefixes, p.eval_k)
    acc = greedy_acceptance(target, {"eagle1": (head1, None), "eagle3": (head3, aux_ids)}, prefixes, p.eval_k,
                            min(128, prefixes.size(0)), device)
    timings["eval_acceptance"] = time.perf_counter() - t
    for name, a in acc.items():
        say(f"== {name} held-out greedy acceptance (mean accepted at k=1..{p.eval_k}): "
            + ", ".join(f"{a['by_k'][str(k)]['mean_accepted']:.3f}" for k in range(1, p.eval_k + 1)))

    # 7. export
    t = time.perf_counter()
    out = args.out
    save_target(target, out / "target", p.rope_theta)
    save_tokenizer(tok, out / "target", p.max_position_embeddings)
    save_eagle1(head1, out / "eagle1", p, vocab, eos_id)
    save_eagle3(head3, out / "eagle3", p, vocab, eos_id)
    timings["export"] = time.perf_counter() - t
    total = time.perf_counter() - t_start
    report = {
        "command": command,
        "preset": p.to_dict(),
        "seed": args.seed,
        "device": device_name(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                     "safetensors": safetensors.__version__},
        "platform": platform.platform(),
        "corpus": stats,
        "tokenizer": {"vocab_size": vocab, "bytes_per_token": stats["train_bytes"] / train_ids.numel()},
        "models": {
            "target": {"parameters": num_params(target), "hidden_size": p.hidden_size, "num_layers": p.num_layers,
                       "num_heads": p.num_heads, "num_kv_heads": p.num_kv_heads,
                       "intermediate_size": p.intermediate_size, "vocab_size": vocab},
            "eagle1": {"parameters": num_params(head1), "hidden_size": p.hidden_size, "embed_tokens": "from target"},
            "eagle3": {"parameters": num_params(head3), "hidden_size": p.hidden_size, "draft_vocab_size": p.draft_vocab_size,
                       "draft_vocab_train_token_coverage": round(draft_coverage, 4), "aux_layer_ids": aux_ids,
                       "ttt_steps": p.ttt_steps, "embed_tokens": "from target"},
        },
        "training": {
            "target": {"steps": steps_t, "epochs": p.target_epochs, "seconds": timings["target"], "history": hist_t},
            "eagle1": {"steps": steps_1, "epochs": p.eagle1_epochs, "seconds": timings["eagle1"], "history": hist_1},
            "eagle3": {"steps": steps_3, "epochs": p.eagle3_epochs, "seconds": timings["eagle3"], "history": hist_3},
        },
        "eval": {"target": ppl, "acceptance": acc,
                 "acceptance_method": f"{prefixes.size(0)} held-out prefixes of {p.eval_prefix_len} tokens; target "
                                      f"greedy continuation; head greedy drafts after the target's first token"},
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "total_seconds": round(total, 2),
    }
    for d in MODEL_DIRS:
        write_model_card(out / d, d, report)
    sizes = {d: dir_bytes(out / d) for d in MODEL_DIRS}
    report["artifacts"] = {"weights_dtype": "bfloat16", "bytes": sizes, "total_bytes": sum(sizes.values()),
                           "budget_bytes": SIZE_BUDGET_BYTES}
    json_path, md_path = write_report(out, report)
    total_bytes = check_size_budget([out / d for d in MODEL_DIRS] + [json_path, md_path])
    say(f"== done in {fmt_seconds(total)}: {out}/target, {out}/eagle1, {out}/eagle3, {md_path.name} "
        f"({total_bytes / 1e6:.1f} MB total, bf16 weights)")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    command = "python -m drafter_service.training.train_demo " + shlex.join(sys.argv[1:] if argv is None else argv)
    run(args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
