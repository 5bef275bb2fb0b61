"""The per-step progress line printed by the master: rates and ETA."""

from __future__ import annotations

from dataclasses import dataclass, field


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


@dataclass
class Progress:
    """Tracks completed steps; rates are over the steps run in this process (resume-safe ETA)."""

    total_steps: int
    first_step: int = 0
    _seconds: list[float] = field(default_factory=list)

    def line(self, step: int, samples: int, tokens: int, step_seconds: float, extra: dict[str, float] | None = None) -> str:
        """``step`` is 1-based and complete; returns the line to print."""
        self._seconds.append(step_seconds)
        recent = self._seconds[-10:]
        mean_seconds = sum(recent) / len(recent)
        eta = mean_seconds * (self.total_steps - step)
        rate = f"{samples / step_seconds:.2f} samples/s, {tokens / step_seconds:.0f} tokens/s" if step_seconds > 0 else ""
        stats = "".join(f" | {k} {v:.4g}" for k, v in (extra or {}).items())
        return f"step {step}/{self.total_steps} | {step_seconds:.2f} s | {rate} | ETA {format_seconds(eta)}{stats}"
