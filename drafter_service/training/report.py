"""The training report (JSON + markdown) and the README.md model card of each model directory."""
import json
from pathlib import Path

from drafter_service.training.progress import fmt_seconds

LAYOUTS = {
    "target": "transformers LlamaForCausalLM (config.json, model.safetensors, generation_config.json) with a byte-level "
              "BPE tokenizer (tokenizer.json, tokenizer_config.json, special_tokens_map.json).",
    "eagle1": "EAGLE-1 head as yuhuili/EAGLE-llama2-chat-7B / vLLM llama_eagle.py: fc.weight [H, 2H] (no bias) applied to "
              "cat(embed(x[t+1]), h[t]) with h the target's final (post-norm) hidden state; layers.0.* is one Llama "
              "decoder layer without input_layernorm; no final norm; logits = target lm_head(output). embed_tokens and "
              "lm_head are NOT included: read them from ../target.",
    "eagle3": "EAGLE-3 head as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B / vLLM llama_eagle3.py: fc.weight [H, 3H] on the "
              "concatenated target states entering layers eagle_config.eagle_aux_hidden_state_layer_ids; midlayer.* "
              "(q/k/v take cat(input_layernorm(embed), hidden_norm(hidden)), 2H wide); norm; lm_head [draft_vocab, H]; "
              "d2t (target id = draft id + d2t[draft id]); t2d (bool mask over the target vocab). embed_tokens is NOT "
              "included: read it from ../target.",
}


def _acceptance_table(acc: dict) -> list[str]:
    k_max = len(acc["by_k"])
    lines = ["| k | mean accepted | acceptance rate | tokens per target step |", "|---|---|---|---|"]
    for k in range(1, k_max + 1):
        row = acc["by_k"][str(k)]
        lines.append(f"| {k} | {row['mean_accepted']:.3f} | {row['acceptance_rate']:.3f} | {row['tokens_per_target_step']:.3f} |")
    alpha = ", ".join(f"{a:.3f}" for a in acc["per_depth_conditional_acceptance"])
    lines.append("")
    lines.append(f"Per-depth conditional acceptance (depth 1..{k_max}): {alpha}; over {acc['prefixes']} held-out prefixes.")
    return lines


def _history_table(history: list[dict], max_rows: int = 12) -> list[str]:
    """Evenly spaced rows plus every row that carries a held-out number."""
    keys = list(dict.fromkeys(k for row in history for k in row if k not in ("step", "elapsed_s")))
    if len(history) > max_rows:
        idx = {round(i * (len(history) - 1) / (max_rows - 1)) for i in range(max_rows)}
        idx |= {i for i, row in enumerate(history) if any(k.startswith("heldout") for k in row)}
        history = [history[i] for i in sorted(idx)]
    lines = ["| step | elapsed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
    for row in history:
        cells = [f"{row[k]:.4f}" if k in row else "" for k in keys]
        lines.append(f"| {row['step']} | {fmt_seconds(row['elapsed_s'])} | " + " | ".join(cells) + " |")
    return lines


def _provenance(r: dict) -> list[str]:
    c = r["corpus"]
    return [
        f"- Command: `{r['command']}`",
        f"- Preset: `{r['preset']['name']}`, seed {r['seed']}",
        f"- Device: {r['device']}; python {r['versions']['python']}, torch {r['versions']['torch']}, "
        f"transformers {r['versions']['transformers']}, tokenizers {r['versions']['tokenizers']}",
        f"- Corpus: Python {c['python_version']} standard library ({c['root']}), {c['eligible_files']} eligible *.py files; "
        f"train {c['train_files']} files / {c['train_bytes']:,} bytes / {c['train_tokens']:,} tokens, held-out "
        f"{c['heldout_files']} files / {c['heldout_bytes']:,} bytes / {c['heldout_tokens']:,} tokens "
        f"(held out: {c['heldout_rule']})",
        f"- Total wall time: {fmt_seconds(r['total_seconds'])} ({r['total_seconds']:.1f} s)",
        "- Weights stored in bfloat16 (d2t int64, t2d bool).",
    ]


def write_report(out: Path, r: dict) -> tuple[Path, Path]:
    json_path, md_path = out / "training_report.json", out / "training_report.md"
    json_path.write_text(json.dumps(r, indent=2) + "\n")
    t = r["eval"]["target"]
    lines = ["# Demo model pair: training report", ""] + _provenance(r) + [
        "",
        "## Models",
        "",
        "| model | parameters | bytes on disk | train steps | train time |",
        "|---|---|---|---|---|",
    ]
    for name in ("target", "eagle1", "eagle3"):
        m, tr = r["models"][name], r["training"][name]
        lines.append(f"| {name} | {m['parameters']:,} | {r['artifacts']['bytes'][name]:,} | {tr['steps']} | "
                     f"{fmt_seconds(tr['seconds'])} |")
    lines += [
        "",
        f"Artifacts total {r['artifacts']['total_bytes']:,} bytes (budget {r['artifacts']['budget_bytes']:,}).",
        "",
        "## Held-out quality",
        "",
        f"Target: loss {t['loss']:.4f} nats/token, perplexity {t['perplexity']:.2f} over {t['tokens']:,} held-out tokens.",
        "",
    ]
    for name in ("eagle1", "eagle3"):
        lines += [f"### {name} greedy acceptance", ""] + _acceptance_table(r["eval"]["acceptance"][name]) + [""]
    lines += ["## Losses", ""]
    for name in ("target", "eagle1", "eagle3"):
        lines += [f"### {name}", ""] + _history_table(r["training"][name]["history"]) + [""]
    lines += ["## Stage times", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in r["timings_s"].items()]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path


def write_model_card(model_dir: Path, name: str, r: dict) -> None:
    m = r["models"][name]
    lines = [f"# {name} (demo model pair, drafter-sidecar)", "", "Trained by `drafter_service.training.train_demo`; "
             "a small demonstration model, not for production use.", "", "## Layout", "", LAYOUTS[name], ""]
    lines += ["## Architecture", ""] + [f"- {k}: {v}" for k, v in m.items()] + ["", "## Provenance", ""] + _provenance(r)
    lines += ["", f"Training: {r['training'][name]['steps']} steps in {r['training'][name]['seconds']:.1f} s; "
              f"final loss {r['training'][name]['history'][-1]['loss']:.4f}.", "", "## Measured quality (held-out)", ""]
    if name == "target":
        t = r["eval"]["target"]
        lines.append(f"Perplexity {t['perplexity']:.2f} (loss {t['loss']:.4f} nats/token) over {t['tokens']:,} held-out tokens.")
    else:
        lines += ["Greedy acceptance against the target (see training_report.md for the method):", ""]
        lines += _acceptance_table(r["eval"]["acceptance"][name])
    (model_dir / "README.md").write_text("\n".join(lines) + "\n")
