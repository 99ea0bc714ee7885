"""Megatron-LM log text as its own code prints it, from known per-iteration values.

Why: the log reader must read what ``training_log`` really prints, including the window its means cover.
This models the accumulators of megatron/training/training.py (core 0.12 to main): every loss of an
advanced iteration is added in float32 to ``total_loss_dict``, a printed line divides the sum by the
advanced iterations and prints ``%.6E``; the interval timer's elapsed time is divided by the iterations of
the window; after each printed line the sums reset, except (core >= 0.16, ``keep_first``) after the first
iteration a process prints, which it prints whatever the log interval. The line and the arguments block
use the format strings of those files (``_print_args``: ``'  {} {} {}'.format(arg, '.' * (48 - len(arg)),
value)``, sorted case-insensitively).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: Arguments only core >= 0.16 prints (sources.megatron_log.SINCE_CORE_0_16), as a 0.16.1 run prints them.
CORE_0_16_ARGS: dict[str, Any] = {"save_wgrads_interval": None, "save_dgrads_interval": None,
                                  "log_max_attention_logit": False, "exit_signal": "Signals.SIGTERM",
                                  "mtp_standalone": False, "batch_invariant_mode": False}


def arguments_block(values: Mapping[str, Any], title: str = "arguments") -> str:
    """The block ``_print_args`` prints at start-up."""
    rows = sorted((f"  {k} {'.' * (48 - len(k))} {v}" for k, v in values.items()), key=lambda x: x.lower())
    return "\n".join([f"------------------------ {title} ------------------------", *rows,
                      f"-------------------- end of {title} ---------------------"]) + "\n"


def training_lines(losses: Sequence[float], times_ms: Sequence[float], *, interval: int = 1, start: int = 0,
                   keep_first: bool = True, skipped: Sequence[int] = (), train_iters: int | None = None,
                   gbs: int = 4, lr: float = 1e-3, grad_norms: Sequence[float] | None = None) -> list[str]:
    """The ``iteration N/ M | ...`` lines of iterations ``start + 1 ...`` (one loss and one time each)."""
    train_iters = train_iters or start + len(losses)
    total, advanced, skips, elapsed = np.float32(0.0), 0, 0, 0.0
    out = []
    for k, (loss, t) in enumerate(zip(losses, times_ms, strict=True)):
        it = start + k + 1
        first = k == 0
        if it in skipped:
            skips += 1
        else:
            total = np.float32(total + np.float32(loss))
            advanced += 1
        elapsed += t
        if it % interval != 0 and not (first and keep_first):
            continue
        line = f" [2026-11-25 10:00:{it % 60:02d}.{it:06d}] iteration {it:8d}/{train_iters:8d} |"
        line += f" consumed samples: {it * gbs:12d} |"
        line += f" elapsed time per iteration (ms): {elapsed / (advanced + skips):.1f} |"
        line += f" learning rate: {lr:.6E} |"
        line += f" global batch size: {gbs:5d} |"
        avg = float(total) / float(max(1, advanced))
        if avg > 0.0:
            line += f" lm loss: {avg:.6E} |"
        line += f" loss scale: {1.0:.1f} |"
        line += f" grad norm: {(grad_norms[k] if grad_norms else 1.0):.3f} |"
        line += f" number of skipped iterations: {skips:3d} |"
        line += f" number of nan iterations: {0:3d} |"
        out.append(line)
        if not (first and keep_first):
            total, advanced, skips, elapsed = np.float32(0.0), 0, 0, 0.0
    return out


def megatron_log(losses: Sequence[float], times_ms: Sequence[float], args: Mapping[str, Any] | None,
                 vocab: tuple[int, int] | None = None, **kwargs: Any) -> str:
    """A whole log: the arguments block (None: none printed), the tokenizer's lines when ``vocab`` is
    (its vocabulary, the padded one), then the iterations."""
    head = arguments_block(args) if args is not None else ""
    if vocab is not None:
        head += (f"> building NullTokenizer tokenizer ...\n > padded vocab (size: {vocab[0]}) with "
                 f"{vocab[1] - vocab[0]} dummy tokens (new size: {vocab[1]})\n")
    return head + "\n".join(training_lines(losses, times_ms, **kwargs)) + "\n"
