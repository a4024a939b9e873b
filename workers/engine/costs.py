"""What a pass costs: measured online (CostModel), and predicted from the hardware (the roofline prior).

The controller prices each step's offers with CostModel's measured cells; `specbatch plan` reads the same
cells from a pilot run and, for a machine it cannot run on, the roofline: a pass must read the weights
once and each row's KV, and must do 2 FLOPs per parameter per token, so it takes at least
max(bytes / bandwidth, FLOPs / peak). A small model on a GPU sits far above that floor (launch overhead:
`overhead_s`); a 7B+ model in bf16 stays near the bandwidth side until rows x width nears
peak / bandwidth x bytes per parameter / 2 (about a hundred tokens on an H100).
"""
from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np


@dataclass(frozen=True)
class Hardware:
    """An accelerator's published memory bandwidth and dense peak (bf16 tensor cores), and the fixed cost
    of one captured pass (graph launch, sampling)."""
    name: str
    bandwidth: float      # bytes/s
    peak_flops: float     # FLOP/s, dense bf16
    overhead_s: float = 1e-3


HARDWARE = {h.name: h for h in (
    Hardware("h100", 3.35e12, 989e12),   # H100 SXM5 80 GB datasheet
    Hardware("h200", 4.8e12, 989e12),    # H200 SXM 141 GB datasheet
    Hardware("a100", 2.04e12, 312e12),   # A100 SXM 80 GB datasheet
    Hardware("l4", 0.30e12, 121e12),     # L4 24 GB datasheet
)}

SHAPES = Path(__file__).resolve().parents[2] / "configs" / "shapes"  # model configs to simulate (plan --shape)


def load_shape(name: str, hardware: str | None) -> tuple[str, SimpleNamespace]:
    """A model shape to simulate on `hardware`: configs/shapes/NAME.json or a path to a model's config.json."""
    if not hardware:
        raise ValueError("--shape prices passes of another model's shape: it needs --hardware NAME")
    path = Path(name) if Path(name).is_file() else SHAPES / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SHAPES.glob("*.json")))
        raise ValueError(f"--shape {name}: no such file, and not one of the shapes in configs/shapes ({known})")
    try:
        return path.stem, SimpleNamespace(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"--shape {path}: not a model config JSON object ({exc})") from None


@dataclass(frozen=True)
class Shape:
    """What a pass of a decoder reads and computes, from its config: parameters a token multiplies by, and the
    bytes of keys and values each cached token holds."""
    params: int                   # multiplied by per token (embedding lookup excluded)
    kv_values_per_token: int      # keys + values across layers
    bytes_per_value: int = 2

    @classmethod
    def of(cls, config, bytes_per_value: int = 2) -> Shape:
        hidden, layers = config.hidden_size, config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
        mlp = 3 * hidden * config.intermediate_size
        return cls(layers * (attention + mlp) + hidden * config.vocab_size, 2 * layers * kv_heads * head_dim,
                   bytes_per_value)

    def pass_s(self, hardware: Hardware, rows: int, width: int, context: float) -> float:
        """Roofline time of one verify pass of rows x width tokens over `context` cached tokens per row."""
        weights = self.params * self.bytes_per_value
        kv = rows * (context + width) * self.kv_values_per_token * self.bytes_per_value
        flops = 2 * self.params * rows * width + 2 * rows * width * context * self.kv_values_per_token
        return hardware.overhead_s + max((weights + kv) / hardware.bandwidth, flops / hardware.peak_flops)


class CostModel:
    """Verify time by (rows, width) from measured cell means, interpolated between measured widths and
    extended past them along the last measured slope, except where that measured slope is cheap (a further column
    costs under `cheap_share` of the narrowest measured pass: a memory-bound pass, such as batch 1 on a CPU
    or a large model on a GPU): there a pass up to twice the widest measured width is priced as the widest,
    and one between two measured widths as the cheaper of them, so a controller tries it and measures the
    truth instead of assuming it grows (on this repo's CPU a pass of width 1-6 at batch 1 costs about the
    same, while widths 1 and 3 alone extrapolate to 1.4x at width 6; on an AVX2 one a width-5 pass cost 25.0
    ms against 25.7 at width 4, and a controller that had measured widths 4 and 9 never tried 5; `explore=False`
    interpolates instead, for a model of passes already run, such as the bench's trace oracle);
    a least-squares fit t = a + b*n + c*n*w covers
    row counts not measured yet. Until passes of more than one width have been measured, further columns are
    priced by the roofline of the device at hand: a pass takes the longer of reading the weights (`floor_s`, a
    one-row width-1 pass, measured when the model loads) and computing its rows x width tokens (`token_s`,
    seconds per token measured on the prefills that compute took longer than that read), so a batch of one
    drafts nearly free while a batch whose width-1 pass is already compute-bound (16 rows on a 2-core CPU) is
    known to pay a full column from its first plan, before a probe costs it a wide pass. Without those
    measurements a further column is taken to cost `column_share` of a width-1 pass: optimistic, so a
    controller whose rows would gain tries a wider pass and measures the truth, instead of never leaving
    k = 0 on a guess. A cell not measured in the last `stale_after` passes is left out
    of the prices and restarted when next measured: a width measured once under a passing load (another job,
    a test run) would otherwise be priced high for ever by a controller that then never tries it again (seen
    in a bench run: batch 1 held at k = 0 for ten cells). Draft time per drafted column is a running mean. A
    cell's mean weighs its last `memory` passes or so (older ones fade, so a controller follows the machine's load; the
    bench's trace oracle keeps every pass: None). A test may inject any object with the same observe / verify
    / draft methods (verify taking an array of widths).

    The controller prices every width each step, so `verify` takes all widths at once, and the fit is
    redone only when a price needs it (a row count or width not measured yet), not on every pass: after a new
    cell, or once `refit_every` passes have moved the cells' means since the last fit (a least-squares fit
    costs about as much as the rest of a plan, and a batch that holds one width asks for it at every plan)."""

    def __init__(self, column_share: float = 0.1, memory: int | None = 20, refit_every: int = 8,
                 cheap_share: float = 0.2, stale_after: int | None = 256, floor_s: float | None = None,
                 explore: bool = True):
        self.cells: dict[tuple[int, int], tuple[float, int]] = {}
        self.stale_after, self.passes = stale_after, 0
        self.seen: dict[tuple[int, int], int] = {}   # the pass at which each cell was last measured
        self.memory = math.inf if memory is None else memory
        self.widths: dict[int, list[int]] = {}    # the widths measured at each row count, ascending
        self.column_share, self.refit_every, self.cheap_share = column_share, refit_every, cheap_share
        self.explore = explore   # price unmeasured widths where cheap slopes say so to get them tried (a controller)
        self.draft_per_column = 0.0
        self.floor_s, self._prefilled = floor_s, [0.0, 0.0]   # decayed (tokens, seconds) of compute-bound prefills
        self._coef, self._fitted, self._since_fit = np.array([1.0, 0.0, 0.0]), True, 0

    def observe(self, n: int, width: int, verify_s: float, columns: int, draft_s: float) -> None:
        mean, count = self.cells.get((n, width), (0.0, 0))
        if not count:
            bisect.insort(self.widths.setdefault(n, []), width)
        elif not self._fresh((n, width)):
            count = 0    # measured long ago (perhaps under a load since gone): start the cell again
        self.passes += 1
        self.seen[(n, width)] = self.passes
        weight = 1.0 / min(count + 1, self.memory)
        self.cells[(n, width)] = (mean + weight * (verify_s - mean), count + 1)
        if columns:
            self.draft_per_column += 0.1 * (draft_s / columns - self.draft_per_column)
        self._since_fit += 1
        if not count or self._since_fit >= self.refit_every:
            self._fitted = len(self.cells) < 2

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of `tokens` computed tokens: its seconds per token, where computing them took longer than
        reading the weights (a shorter one says only that a token costs less than floor_s / tokens)."""
        if self.floor_s is not None and tokens and seconds >= 2 * self.floor_s:
            self._prefilled = [0.9 * self._prefilled[0] + tokens, 0.9 * self._prefilled[1] + seconds]

    @property
    def token_s(self) -> float | None:
        """Compute seconds per token, from the prefills (None until one was compute-bound)."""
        return self._prefilled[1] / self._prefilled[0] if self._prefilled[0] else None

    def _roofline(self, n: int, w: np.ndarray | int) -> np.ndarray:
        """A pass of n rows at width w: the longer of reading the weights and computing n x w tokens."""
        return np.maximum(self.floor_s, n * w * self.token_s)

    def _columns(self, n: int, w: np.ndarray, width_1_s: float) -> np.ndarray:
        """Seconds a pass of n rows at width w takes beyond one at width 1, before wider passes were measured:
        the roofline's difference, or without its rates `column_share` of a width-1 pass per column."""
        if self.token_s is None:
            return self.column_share * width_1_s * (w - 1)
        return self._roofline(n, w) - self._roofline(n, 1)

    @property
    def coef(self) -> np.ndarray:
        """(a, b, c) of t = a + b*n + c*n*w: weighted least squares over the cells (each worth its count, up to
        `memory`)."""
        if not self._fitted:
            keys = list(self.cells)
            x = np.array([[1.0, n, n * w] for n, w in keys])
            y = np.array([self.cells[key][0] for key in keys])
            sw = np.sqrt([min(self.cells[key][1], self.memory) for key in keys])
            coef, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
            self._coef, self._fitted, self._since_fit = np.maximum(coef, [1e-6, 0.0, 1e-9]), True, 0
        return self._coef

    def _fresh(self, cell: tuple[int, int]) -> bool:
        return self.stale_after is None or self.passes - self.seen[cell] <= self.stale_after

    def _widths_measured(self) -> bool:
        return len({w for n, w in self.cells if self._fresh((n, w))}) > 1

    def verify(self, n: int, width: int | np.ndarray) -> float | np.ndarray:
        """Seconds of a verify pass of n rows at `width` tokens each (an int, or an array of widths)."""
        w = np.asarray(width, float)
        measured = self.widths.get(n)
        if measured:   # a controller avoids a width it priced high: its cell, once stale, is not believed
            measured = [m for m in measured if self._fresh((n, m))] or measured
        if not self.cells and self.token_s is not None:   # nothing measured but the roofline's two rates
            t = self._roofline(n, w)
            return float(t) if t.ndim == 0 else t
        if not measured:
            a, b, c = self.coef
            if self._widths_measured():
                t = a + b * n + c * n * w
            else:
                t = a + b * n + c * n + self._columns(n, w, a + b * n + c * n)
            return float(t) if t.ndim == 0 else t
        widths = np.array(measured, float)
        times = np.array([self.cells[(n, m)][0] for m in measured])
        if len(measured) == 1 and not self._widths_measured():
            t = times[0] + self._columns(n, w, times[0]) - self._columns(n, widths[0], times[0])
            return float(t) if t.ndim == 0 else t
        if len(measured) == 1:
            low = high = self.coef[2] * n
        else:
            low, high = (max(0.0, float((times[j] - times[i]) / (widths[j] - widths[i]))) for i, j in ((0, 1), (-2, -1)))
        t = np.interp(w, *self._grid(measured, times.tolist()))
        ahead = w - widths[-1]
        if self.explore and len(measured) > 1 and high < self.cheap_share * times[0]:   # a measured slope, and a cheap one
            ahead = np.maximum(ahead - widths[-1], 0.0)   # flat up to twice the widest measured
        t = np.where(w > widths[-1], np.maximum(1e-9, times[-1] + high * ahead), t)
        t = np.where(w < widths[0], np.maximum(1e-9, times[0] + low * (w - widths[0])), t)
        return float(t) if t.ndim == 0 else t

    def _grid(self, widths: list[int], times: list[float]) -> tuple[list[float], list[float]]:
        """The points verify interpolates between: the measured widths, and in a gap whose slope is cheap the
        cheaper end's time on every width inside it (points half a width in from each end), so that those
        widths are tried. In plain Python: a handful of points, where each numpy call costs 10-20 us in a run."""
        xs, ys = [float(widths[0])], [times[0]]
        for (w0, t0), (w1, t1) in zip(zip(widths, times), zip(widths[1:], times[1:])):
            if self.explore and w1 - w0 > 1 and (t1 - t0) / (w1 - w0) < self.cheap_share * times[0]:
                xs += [w0 + 0.5, w1 - 0.5]
                ys += [min(t0, t1)] * 2
            xs.append(float(w1))
            ys.append(t1)
        return xs, ys

    def draft(self, n: int, columns: int) -> float:
        return self.draft_per_column * columns
