"""Does the cost model rank what a device measures? Measured candidates beside their modelled
times, per use: the rank correlation and whether the model's pick is within 5% of the measured
best, with the free parameters fitted on other uses than the ones scored (k folds).

Measurements are records (JSON, `save`/`load`): per use its kernel, key and launch sizes, and
per accepted candidate its measured µs and each dispatch's driver statistics (on NVIDIA with
its machine code's instructions by loop depth, which nvdisasm reads), grid and bytes, so that a
measurement taken once on a device can be replayed anywhere: the interpreter's work counts
(`work.py`) are recomputed from the kernel and the use's example.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from zdsl import toolchain
from zdsl.errors import ZdslError
from zdsl.kernels import all_kernels
from zdsl.lang.kernel import Launch

from . import cost_model, machine_code, tuner
from .work import work

WITHIN = 1.05  # a pick counts when its measured time is within 5% of the measured best
MIN_CANDIDATES = 3  # uses with fewer measured candidates rank nothing worth scoring
GRID = {  # the free parameters' values the fit tries, by their names in cost_model.Card
    "latency_ns": (50, 100, 200, 300, 400, 600, 800, 1200, 1600),
    "cpi": (0, 2, 4, 8, 12, 16, 24, 32, 48, 64),
    "issue_efficiency": (0.125, 0.25, 0.5, 1.0),
    "overlap": (1.0, 1.5, 2.0, 3.0, math.inf),
    "shared_efficiency": (0.5, 1.0),
    "l2_bytes_per_clock": (8, 16, 24, 32, 48, math.inf),
}


# -- records ---------------------------------------------------------------------------------------

def record(use: tuner.Use, where: str, result: tuner.Result, device) -> dict:
    """A use's measured candidates as a record, with the driver's statistics of each dispatch."""
    example = use.kernel.make_example(use.launch, np.random.default_rng(0), False)
    cands = []
    for c in result.ranked:
        variants = []
        for v in c.variants:
            groups, nbytes = tuner.launch_of(v, example)
            variants.append(dict(label=v.label, stats=statistics(v, device),
                                 groups=list(groups), nbytes=int(nbytes), workgroup=list(v.ir.workgroup),
                                 sg=v.ir.subgroup_size or device.info.subgroup_size))
        cands.append(dict(params=c.params, tuned=c.tuned, us=c.us, spread=c.spread, variants=variants))
    launch = use.launch
    return dict(where=where, kernel=use.kernel.name, key=use.key, fixed=launch.fixed, sizes=launch.sizes,
                buffers=launch.buffers, count=use.count, default=result.default.tuned, cands=cands)


def statistics(v, device) -> dict:
    """The driver's statistics of v's pipeline and, where its machine code can be read (NVIDIA),
    the code's instructions by loop depth."""
    nvidia = device.info.vendor == "NVIDIA"
    pipe = v.pipeline(device, statistics=True, isa=nvidia)
    stats = dict(pipe.statistics or {})
    if pipe.code:
        text = toolchain.nvdisasm(pipe.code, cost_model.card_of(device.info.name).sm)
        stats[cost_model.LOOP_DEPTHS] = machine_code.sass_loop_depths(text)
    return stats


def save(path: Path, device_name: str, records: list[dict]) -> None:
    path.write_text(json.dumps({"device": device_name, "uses": records}, default=str) + "\n")


def load(path: Path) -> tuple[str, list[dict]]:
    try:
        data = json.loads(Path(path).read_text())
        return data["device"], list(data["uses"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ZdslError(f"{path}: not a measurement file of `zdsl tune --check-model --record` ({e})") from None


# -- what the model sees -------------------------------------------------------------------------------

@dataclass
class Use:
    """One use's measured candidates and, for each, the dispatches the model estimates."""
    kernel: str
    label: str
    default: str          # the label of the variant that runs untuned
    labels: list[str]     # the candidates' labels ("ROWS=2 NSUB=1 ...")
    measured: np.ndarray
    dispatches: list[list[cost_model.Dispatch]]


def use_of(rec: dict) -> Use:
    """The model's view of a record: the work of each dispatch counted on the use's example."""
    kernel = all_kernels()[rec["kernel"]]
    launch = Launch(kernel, kernel.specialize(**rec["fixed"]), rec["fixed"], rec["key"], rec["sizes"],
                    rec["buffers"], (1, 1, 1), rec["where"])
    example = kernel.make_example(launch, np.random.default_rng(0), False)
    extra = tuner.Use(launch)
    labels, measured, dispatches = [], [], []
    for c in rec["cands"]:
        parts = []
        for v, saved in zip(tuner.variants(extra, example, c["params"]), c["variants"]):
            parts.append(cost_model.Dispatch(saved["stats"], math.prod(saved["groups"]), math.prod(saved["workgroup"]),
                                             saved["sg"], saved["nbytes"], work(v, example.args, saved["groups"])))
        labels.append(_label(c["tuned"]))
        measured.append(c["us"])
        dispatches.append(parts)
    label = " ".join(v if isinstance(v, str) else f"{k}={v}" for k, v in rec["key"].items() if v != "")
    return Use(rec["kernel"], label, _label(rec["default"]), labels, np.asarray(measured, float), dispatches)


def uses_of(records: list[dict]) -> tuple[list[Use], list[str]]:
    """The model's view of the records with enough candidates to rank, and the kernels of those
    measured on parameters the kernel no longer has (a variant space changed since: the
    measurement says nothing about today's variants). A use in more than one record (the type
    mixes' decode steps share their router, attention and output head) counts once, as first
    measured."""
    uses, stale, seen = [], [], set()
    for r in records:
        same = (r["kernel"], json.dumps(r["key"], sort_keys=True), json.dumps(r["sizes"], sort_keys=True))
        if len(r["cands"]) < MIN_CANDIDATES or same in seen:
            continue
        try:
            uses.append(use_of(r))
            seen.add(same)
        except ZdslError:
            stale.append(r["kernel"])
    return uses, stale


def _label(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


# -- scoring -------------------------------------------------------------------------------------------

def ranks(a) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank (along the last axis: of each row of a 2-D
    array)."""
    a = np.asarray(a, float)
    below = (a[..., None, :] < a[..., :, None]).sum(-1)
    same = (a[..., None, :] == a[..., :, None]).sum(-1)
    return below + (same - 1) / 2


def spearman(a, b):
    """Spearman's rank correlation of a and b (0 where either side is all ties); of each row of a
    2-D `a` with b, an array."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean()
    norm = np.sqrt((ra ** 2).sum(-1) * (rb ** 2).sum())
    rho = np.where(norm > 0, (ra * rb).sum(-1) / np.where(norm > 0, norm, 1.0), 0.0)
    return float(rho) if rho.ndim == 0 else rho


def picks(predicted, measured):
    """The candidate the model ranks first (of each row of a 2-D `predicted`): a tie is no
    choice, so of those it ties, the slowest measured."""
    predicted = np.asarray(predicted)
    return np.where(predicted == predicted.min(-1, keepdims=True), measured, -np.inf).argmax(-1)


def order(u: Use, s: "Score") -> list[float]:
    """The measured ranks (1 = fastest) of the candidates in the model's order."""
    measured = ranks(u.measured) + 1
    return [float(measured[i]) for i in np.argsort(s.predicted, kind="stable")]


@dataclass
class Score:
    rho: float
    pick: int            # the candidate the model ranks first (of those it ties, the slowest measured)
    ratio: float         # its measured time over the measured best
    predicted: np.ndarray
    bound: str           # the term that decided the pick's time

    @property
    def within(self) -> bool:
        return self.ratio <= WITHIN


def score(card: cost_model.Card, u: Use) -> Score:
    est = [cost_model.estimate_run(card, parts) for parts in u.dispatches]
    predicted = np.asarray([e["us"] for e in est])
    pick = int(picks(predicted, u.measured))
    return Score(spearman(predicted, u.measured), pick, float(u.measured[pick] / u.measured.min()), predicted,
                 est[pick]["bound"])


def merit(rho: np.ndarray, within: np.ndarray) -> np.ndarray:
    """What the fit maximizes, for each parameter set (a column of the uses × sets arrays): the
    share of picks within 5%, then the median ρ (half weight), then the mean ρ (a tenth, to break
    ties)."""
    return within.mean(0) + 0.5 * np.median(rho, 0) + 0.1 * rho.mean(0)


def grid(card: cost_model.Card) -> tuple[cost_model.Card, list[dict]]:
    """The card with each free parameter an array over GRID's points (the fit scores all 21,600 at
    once), and the points."""
    points = [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]
    return replace(card, **{k: np.asarray([p[k] for p in points], float) for k in GRID}), points


def grid_scores(card: cost_model.Card, u: Use) -> tuple[np.ndarray, np.ndarray]:
    """ρ and whether the pick is within 5%, at every point of the grid card (`grid`): `score`'s
    figures, all points at once."""
    predicted = np.stack([sum(cost_model.total(card, t, t["ahead"]) for t in (cost_model.terms(card, d) for d in parts))
                          for parts in u.dispatches], axis=1)  # points × candidates
    return spearman(predicted, u.measured), u.measured[picks(predicted, u.measured)] / u.measured.min() <= WITHIN


def fit(card: cost_model.Card, uses: list[Use]) -> cost_model.Card:
    """The card with the free parameters of GRID that rank `uses` best."""
    every, points = grid(card)
    return _fitted(card, points, [grid_scores(every, u) for u in uses])


def _fitted(card: cost_model.Card, points: list[dict], scores: list[tuple[np.ndarray, np.ndarray]]) -> cost_model.Card:
    """The card at the grid point of best merit over the uses' grid scores (the first of equals)."""
    m = merit(np.stack([r for r, _ in scores]), np.stack([w for _, w in scores]))
    return replace(card, **points[int(np.argmax(m))])


@dataclass
class Report:
    uses: list[Use]
    held_out: list[Score]            # each use scored with the parameters of the folds it was left out of
    fold_cards: list[cost_model.Card]
    fold_of: list[int]
    nominal: list[Score] = field(default_factory=list)   # the card's own figures, no fit

    def summary(self, scores: list[Score]) -> tuple[float, float]:
        """(median ρ, share of picks within 5%)."""
        return float(np.median([s.rho for s in scores])), float(np.mean([s.within for s in scores]))

    def defaults_within(self) -> float:
        """The share of uses whose default variant is within 5% of the best (the untuned baseline),
        over the uses where the default was measured."""
        ok = [u.measured[u.labels.index(u.default)] / u.measured.min() <= WITHIN
              for u in self.uses if u.default in u.labels]
        return float(np.mean(ok)) if ok else math.nan


def cross_validate(card: cost_model.Card, uses: list[Use], folds: int) -> Report:
    """Fold f holds out uses f, f + folds, ...; the others fit the free parameters it is scored with."""
    folds = max(2, min(folds, len(uses)))
    held: list[Score | None] = [None] * len(uses)
    cards, fold_of = [], [0] * len(uses)
    every, points = grid(card)
    scores = [grid_scores(every, u) for u in uses]
    for f in range(folds):
        out = list(range(f, len(uses), folds))
        fitted = _fitted(card, points, [s for i, s in enumerate(scores) if i not in out])
        cards.append(fitted)
        for i in out:
            held[i] = score(fitted, uses[i])
            fold_of[i] = f
    return Report(uses, held, cards, fold_of, [score(card, u) for u in uses])
