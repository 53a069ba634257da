"""Quality gates: is a quantized variant's score at least a ratio of the 16-bit target's, measured on
the same items in the same run? Pure functions, so the arithmetic is tested on its own.

Both models answer the same n items, so the comparison is paired: per item d_i = x_i - ratio * y_i
(x: the variant's per-item score, y: the 16-bit target's). The gate asks whether mean(d) >= 0, i.e.
score(variant) >= ratio * score(16-bit). With a 95% confidence interval of mean(d) (normal
approximation, the items' own variance):
- `pass`: the whole interval is >= 0 (the variant is shown to be at least `ratio` as good);
- `fail`: the whole interval is < 0 (shown to be worse);
- `inconclusive`: the interval contains 0; and `too_few` below the minimum sample count;
- `uninformative`: the 16-bit target itself is not shown to score above the task's floor (chance:
  0.25 on 4-way multiple choice, 0 on generation tasks), i.e. the lower end of the 95% interval of
  its own mean is at or below the floor. A model that cannot do the task cannot show a loss on it:
  a reference of all zeros and a variant of all zeros would otherwise "pass" with an interval of
  [0, 0], and a reference at chance would pass any variant at chance. (SmolLM2-135M scores 0 on
  GSM8K and chance on MMLU.)
That is `rule="interval"`, the default. `rule="point"` is the reference recipe's own rule (docs/recipe.md:
"IFEval inst-level strict >= 0.814 (95% of 0.857)"): `pass` where the variant's mean is at least `ratio`
times the reference's (margin >= 0), else `fail`, whatever the interval; `too_few` and `uninformative`
stay as they are. Every result also carries `point_verdict` and `interval_verdict`, both rules' verdicts, so a
table shows them side by side whichever one decides; `needed_difference` and `power_if_equal` (below) are those of
the rule that decides.
Only `pass` passes: a tiny or noisy sample can neither pass nor fail a variant by luck, a variant
that is not shown to be good enough is never selected, and neither is one judged on a task the
16-bit target cannot do. One exception, opted into per task (`when_uninformative: report`) for a
target measured unable to do a task: that task's `uninformative` verdict is reported and neither
passes nor blocks; every other verdict of it still counts, and at least one task must pass.

What a gate can resolve, reported beside its verdict (the same interval, read the other way):
- `needed_difference`: the variant - reference score difference that passing needs at the spread
  measured here, (interval half-width) - (1 - ratio) * reference. Negative: the variant may lose
  that much and still pass; positive: it must score *above* the 16-bit target to pass;
- `power_if_equal`: the probability that a variant of the reference's mean score, with this spread
  of per-item differences, passes. A gate whose power is low cannot certify even a lossless variant
  on this many items: more items, or fewer items on which the two models disagree, are what raise it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054
RULES = ("interval", "point")  # gates.rule (module docstring)


@dataclass(frozen=True)
class GateResult:
    task: str
    n: int
    reference: float      # the 16-bit target's mean score
    variant: float        # the variant's mean score
    ratio: float          # required variant / reference
    margin: float         # mean(x - ratio * y)
    low: float            # 95% interval of the margin
    high: float
    verdict: str          # pass | fail | inconclusive | too_few | uninformative
    floor: float = 0.0    # the task's chance score
    reference_low: float = math.nan  # lower end of the 95% interval of the 16-bit target's mean
    needed_difference: float = math.nan  # variant - reference that passing needs at this spread (module docstring)
    power_if_equal: float = math.nan     # chance that a variant of equal mean and this spread passes
    rule: str = "interval"               # which rule gave `verdict` (RULES)
    point_verdict: str = ""              # the point rule's verdict (variant >= ratio x reference), either way
    interval_verdict: str = ""           # the interval rule's verdict, either way

    @property
    def passes(self) -> bool:
        return self.verdict == "pass"


def mean_interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% interval): normal approximation, the values' own variance."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else math.inf
    return mean, Z95 * math.sqrt(var / n)


def judge(task: str, variant_scores: list[float], reference_scores: list[float], ratio: float,
          min_samples: int, floor: float = 0.0, rule: str = "interval") -> GateResult:
    """The gate for one task from per-item scores of the variant and the 16-bit target (same items,
    same order). `floor`: the task's chance score; `rule`: interval or point (see the module docstring)."""
    if rule not in RULES:
        raise ValueError(f"gates.rule={rule!r}: expected one of {', '.join(RULES)}")
    if len(variant_scores) != len(reference_scores):
        raise ValueError(f"{task}: {len(variant_scores)} variant scores but {len(reference_scores)} reference scores")
    n = len(variant_scores)
    if n == 0:
        return GateResult(task, 0, math.nan, math.nan, ratio, math.nan, math.nan, math.nan, "too_few", floor,
                          rule=rule, point_verdict="too_few", interval_verdict="too_few")
    mean, half = mean_interval([x - ratio * y for x, y in zip(variant_scores, reference_scores)])
    low, high = mean - half, mean + half
    reference, reference_half = mean_interval(reference_scores)
    reference_low = reference - reference_half
    if n < min_samples:
        point = interval = "too_few"
    elif reference_low <= floor:
        point = interval = "uninformative"
    else:
        point = "pass" if mean >= 0 else "fail"
        interval = "pass" if low >= 0 else "fail" if high < 0 else "inconclusive"
    verdict = point if rule == "point" else interval
    slack = (1.0 - ratio) * reference  # how far above ratio x reference a variant of equal mean sits
    # what the rule can resolve: the interval rule needs the whole interval >= 0, the point rule the estimate
    needed, power = ((half - slack, pass_probability(slack, half)) if rule == "interval"
                     else (-slack, pass_probability(slack, half, z=0.0)))
    return GateResult(task, n, reference, sum(variant_scores) / n, ratio, mean, low, high, verdict, floor, reference_low,
                      needed_difference=needed, power_if_equal=power, rule=rule, point_verdict=point,
                      interval_verdict=interval)


def pass_probability(margin: float, half: float, z: float = Z95) -> float:
    """Probability that a margin estimate of true value `margin`, whose 95% interval has half-width
    `half`, comes out with its whole interval >= 0 (normal approximation): Phi(margin / se - z); with
    z = 0, that the estimate itself comes out >= 0 (the point rule)."""
    if math.isnan(half) or math.isinf(half):  # one item: no spread to judge by
        return math.nan
    if half == 0:  # every item's difference is the same: the estimate is the margin itself
        return float(margin >= 0)
    return 0.5 * (1.0 + math.erf((margin / (half / Z95) - z) / math.sqrt(2.0)))


def passes_all(results: list[GateResult], report_uninformative: frozenset[str] | set[str] = frozenset()) -> bool:
    """Every task passes, except that a task in `report_uninformative` may be `uninformative` (the
    16-bit target cannot do it: it cannot show a loss there); at least one task must really pass."""
    excused = [r for r in results if r.verdict == "uninformative" and r.task in report_uninformative]
    return (any(r.passes for r in results)
            and all(r.passes or r in excused for r in results))
