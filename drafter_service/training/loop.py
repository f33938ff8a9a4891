"""One training loop for all three models: AdamW, linear warmup then cosine decay to 10%, grad clipping,
bf16 autocast on CUDA (fp32 on CPU), progress lines and a loss history for the report."""
import math
from collections.abc import Callable, Iterator

import torch

from drafter_service.training.progress import Progress


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train(
    stage: str,
    params: list[torch.nn.Parameter],
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    batch_iter: Iterator[torch.Tensor],
    steps: int,
    lr: float,
    warmup: int,
    device: torch.device,
    log_every: int,
    weight_decay: float = 0.1,
    eval_fn: Callable[[], dict[str, float]] | None = None,
    eval_every: int = 0,
) -> list[dict]:
    """Run ``steps`` optimizer steps of ``loss_fn(batch)``; returns [{step, loss, **metrics, elapsed_s}] every log_every.

    ``eval_fn`` (e.g. held-out loss), if given, runs every ``eval_every`` steps and at the end; its numbers join that row.
    """
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # norms: no decay
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    history: list[dict] = []
    progress = None
    for step in range(1, steps + 1):
        batch = next(batch_iter).to(device, non_blocking=True)
        if progress is None:
            progress = Progress(stage, steps, batch.numel())
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, steps, lr, warmup)
        with autocast(device):
            loss, metrics = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        do_eval = eval_fn is not None and (step == steps or (eval_every and step % eval_every == 0))
        if step % log_every == 0 or step == steps or step == 1 or do_eval:
            row = {"step": step, "loss": loss.item(), **{k: float(v) for k, v in metrics.items()}}
            if do_eval:
                row.update(eval_fn())
            if not math.isfinite(row["loss"]):
                raise FloatingPointError(f"[{stage}] loss is {row['loss']} at step {step}: lower the learning rate")
            progress.log(step, row["loss"], {k: v for k, v in row.items() if k not in ("step", "loss")})
            row["elapsed_s"] = round(progress.elapsed(), 2)
            history.append(row)
    return history
