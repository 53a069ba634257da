"""The sweep's variant names, built and parsed in one place: result folders, the rules' wildcards and
log names, the report's rows, the figures and the README table all go through these functions.

    target   ptq_gptq_w4g32, qad_gptq_w4g32     (kind _ method _ w bits g group; group "ch": per channel)
    drafter  gptq_w4g128                        (a compressed stage-2 drafter; "stage2" is the uncompressed one)
    window   win256, winnone                    (the drafter's sliding window at inference; bench/speedup_<window>)
    stack    qad_gptq_w4g32+gptq_w4g128+win256  (what the report selects and the server serves)

The builders also take Snakemake wildcard placeholders ("{method}"), which is how the rules write
their output patterns with the same functions.
"""

from __future__ import annotations

import re

TARGET_KINDS = ("ptq", "qad")
METHODS = ("rtn", "gptq")
GROUP_PATTERN = r"\d+|ch"
METHOD_PATTERN = "|".join(METHODS)
_GROUP = rf"({GROUP_PATTERN})"
DRAFTER_PATTERN = rf"({METHOD_PATTERN})_w(\d+)g{_GROUP}"
TARGET_PATTERN = rf"({'|'.join(TARGET_KINDS)})_{DRAFTER_PATTERN}"  # a rule's wildcard constraint
WINDOW_PATTERN = r"none|\d+"


def group_label(group_size) -> str:
    """A group size as it stands in a name: "ch" for per-channel scales (-1); a placeholder stays."""
    return "ch" if str(group_size) == "-1" else str(group_size)


def group_size(label: str) -> int:
    return -1 if label == "ch" else int(label)


def _grid(method: str, bits, group) -> str:
    return f"{method}_w{bits}g{group_label(group)}"


def target_name(kind: str, method: str, bits, group) -> str:
    """ptq_gptq_w4g32: `group` is a group size (or a wildcard placeholder)."""
    return f"{kind}_{_grid(method, bits, group)}"


def parse_target(name: str) -> dict | None:
    """{kind, method, bits, group_size} of a target variant's name; None for any other name (the 16-bit
    target, a *.partial-* folder)."""
    match = re.fullmatch(TARGET_PATTERN, name)
    if not match:
        return None
    kind, method, bits, group = match.groups()
    return {"kind": kind, "method": method, "bits": int(bits), "group_size": group_size(group)}


def drafter_name(method: str, bits, group) -> str:
    """gptq_w4g128: a compressed drafter (16 bits is the uncompressed stage-2 drafter: `stage2`)."""
    return _grid(method, bits, group)


def parse_drafter(name: str) -> tuple[str, int]:
    """(name, bits) of a drafter variant: gptq_w4g64 -> ("gptq_w4g64", 4); stage2 (or any
    uncompressed drafter) -> ("stage2", 16)."""
    match = re.fullmatch(DRAFTER_PATTERN, name)
    return name, int(match.group(2)) if match else 16


def window_label(window) -> str:
    """The drafter window in names: "none" for no window (None, or a report's -1 / "")."""
    return "none" if window in (None, "", -1) else str(int(float(window)))


def parse_window(label: str) -> int | None:
    return None if label == "none" else int(label)


def window_name(window) -> str:
    """win256 / winnone: a benchmark job's name (bench/speedup_<this>)."""
    return f"win{window if str(window).startswith('{') else window_label(window)}"


def stack_name(target: str, drafter: str, window) -> str:
    return f"{target}+{drafter}+{window_name(window)}"


def served_target(profile: dict) -> str:
    """The target a profile's drafters adapt to, its benchmark measures and its server serves: QAD from
    `variants.qad_from` at the first width of `variants.target_bits`."""
    variants = profile["variants"]
    return target_name("qad", variants["qad_from"], variants["target_bits"][0], profile["quant"]["group_size"])


def compressed_drafters(profile: dict) -> list[str]:
    """The profile's compressed stage-2 drafters, one per `variants.drafter_bits` below 16."""
    compress = profile["compress"]
    return [drafter_name(compress["method"], bits, compress["group_size"])
            for bits in profile["variants"]["drafter_bits"] if bits != 16]


# the prompt kinds issue 21's targets are stated over (tau >= 3, 2x): a pooled row of their own in speed.csv
POOLED = ("chat", "math", "code")


def pooled_label(labels) -> str | None:
    """The pooled row's label over the POOLED kinds a job measured ("chat+math+code"; "chat+code" where
    a profile has no math prompts), or None where fewer than two were measured (nothing to pool)."""
    present = [kind for kind in POOLED if kind in set(labels)]
    return "+".join(present) if len(present) >= 2 else None


def is_pooled(label: str) -> bool:
    """A pooled row (pooled_label), which sums prompts that other rows hold too: leave it out of sums over rows."""
    return "+" in label and set(label.split("+")) <= set(POOLED)
