"""Confidence stops: end a model drafter's drafts where one more column no longer pays.

A drafter that knows its probability q of each token it proposes (a draft model, an MTP head) can
judge the next column before it is verified: row r's draft reaches an accepted position j with
probability P_r(j) = prod_{i <= j} min(1, kappa * q_r(i)), kappa calibrating q against measured
acceptance. A verify pass costs its widest row, so a column is paid once for the whole batch: it is
drafted while the rows offered it expect to gain more from it than it costs at the current rate,
sum_r P_r(j) >= threshold[j] = rate (tokens/s) * seconds the column adds (draft pass + verify width).
This is the goodput rule of DISCO (Mamou et al. 2024) and of vLLM's draft-length policy, summed over
the batch because the batch shares the pass. A drafter that reports a whole proposal's confidence at once
(prompt lookup) is cut at the width whose columns together pay the most, so a costly first column can be
paid for by the ones after it. While the batch drains, each row's P_r(j) counts by the
row's weight (workers/engine/offers.py: drain_weights), the same worth the rate was computed in.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DraftStop:
    threshold: np.ndarray       # (max_k,): expected accepted tokens column j must add to be drafted
    calibration: float = 1.0    # kappa: accepted drafts per unit of summed draft confidence
    weight: np.ndarray | None = None  # (n,): each row's worth, as in the rate (None: 1 each)

    def reach(self, before: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """P_r(j) from P_r(j - 1) and this column's confidence q_r(j) (both (n,))."""
        return before * (confidence.double() * self.calibration).clamp(max=1.0)

    def keep(self, column: int, reach: torch.Tensor, offered: torch.Tensor) -> bool:
        """Whether column `column` (0-based) is drafted, given each row's P_r(column) and whether it is offered:
        a drafter that drafts column by column cannot see the columns after it, so a column must pay alone."""
        worth = reach if self.weight is None else reach * torch.from_numpy(self.weight)
        return column < len(self.threshold) and float(worth[offered].sum()) >= self.threshold[column]

    def cut(self, confidence: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Draft lengths (n,) after the stop, for a proposal's per-position confidence (n, k): the width whose
        columns together add the most expected tokens net of their cost. With the whole proposal at hand, a
        column that does not pay alone is kept when those after it make up for it: a pass's first column may
        cost several later ones (on this repo's CPU a width-1 pass runs a GEMV kernel and a wider one does not),
        and a short match whose first token is a long shot may go on to copy a span."""
        rows, lens = confidence.tolist(), lengths.tolist()   # a few numbers: plain Python beats a tensor op each
        weight = [1.0] * len(lens) if self.weight is None else self.weight.tolist()
        reach, kappa = [1.0] * len(lens), self.calibration
        net = best = 0.0
        width = 0
        for column, threshold in enumerate(self.threshold[: confidence.shape[1]].tolist()):
            worth, offered = 0.0, False
            for r, row in enumerate(rows):
                if lens[r] > column:
                    q = row[column]
                    reach[r] *= 1.0 if q != q else min(1.0, kappa * q)   # NaN (unknown) counts as sure
                    worth, offered = worth + weight[r] * reach[r], True
            if not offered:
                break
            net += worth - threshold
            if net > best:
                best, width = net, column + 1
        return lengths.clamp(max=width)
