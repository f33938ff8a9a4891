"""Progress lines on stdout: step, loss, tokens/s, elapsed and ETA, flushed so they show up under a pipe or in a log."""
import time


def fmt_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}:{s % 60:02d}"


def say(msg: str) -> None:
    print(msg, flush=True)


class Progress:
    def __init__(self, stage: str, total_steps: int, tokens_per_step: int):
        self.stage = stage
        self.total = total_steps
        self.tokens_per_step = tokens_per_step
        self.start = time.perf_counter()
        self.last_time = self.start
        self.last_step = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, step: int, loss: float, extra: dict[str, float] | None = None) -> None:
        now = time.perf_counter()
        rate = (step - self.last_step) / max(now - self.last_time, 1e-9)
        self.last_time, self.last_step = now, step
        eta = fmt_seconds((self.total - step) / max(rate, 1e-9)) if step > 1 else "?"  # step 1 includes warm-up
        parts = [f"[{self.stage}] step {step:>5}/{self.total}", f"loss {loss:.4f}"]
        parts += [f"{k} {v:.3f}" for k, v in (extra or {}).items()]
        parts += [f"tok/s {rate * self.tokens_per_step:,.0f}", f"elapsed {fmt_seconds(self.elapsed())}", f"eta {eta}"]
        say("  ".join(parts))
