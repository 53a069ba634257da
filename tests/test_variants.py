"""qdflash.variants: the one place that builds and parses the sweep's names."""

import re

import pytest

from qdflash.variants import (TARGET_PATTERN, WINDOW_PATTERN, compressed_drafters, drafter_name, group_label, group_size,
                              parse_drafter, parse_target, parse_window, served_target, stack_name, target_name, window_label,
                              window_name)


@pytest.mark.parametrize("kind,method,bits,group,name", [
    ("ptq", "gptq", 4, 32, "ptq_gptq_w4g32"), ("qad", "gptq", 3, 128, "qad_gptq_w3g128"), ("ptq", "rtn", 4, -1, "ptq_rtn_w4gch")])
def test_target_names_round_trip(kind, method, bits, group, name):
    assert target_name(kind, method, bits, group) == name
    assert parse_target(name) == {"kind": kind, "method": method, "bits": bits, "group_size": group}
    assert re.fullmatch(TARGET_PATTERN, name)  # the gate rule's wildcard constraint takes it


@pytest.mark.parametrize("name", ["bf16", "ptq_gptq_w4g32.partial-20261201-1", "stage2", "qad_awq_w4g32"])
def test_other_names_are_not_targets(name):
    assert parse_target(name) is None


def test_drafters_windows_and_stacks():
    assert drafter_name("gptq", 4, 128) == "gptq_w4g128" and parse_drafter("gptq_w4g128") == ("gptq_w4g128", 4)
    assert parse_drafter("stage2") == ("stage2", 16)
    assert [window_label(w) for w in (None, "", -1, 256, "1024", 64.0)] == ["none", "none", "none", "256", "1024", "64"]
    assert window_name(None) == "winnone" and window_name(256) == "win256"
    assert parse_window("none") is None and parse_window("256") == 256
    assert all(re.fullmatch(WINDOW_PATTERN, window_label(w)) for w in (None, 256))
    assert stack_name("qad_gptq_w4g32", "gptq_w4g128", -1) == "qad_gptq_w4g32+gptq_w4g128+winnone"
    assert [group_label(g) for g in (-1, 32, "64")] == ["ch", "32", "64"] and group_size("ch") == -1


def test_the_rules_write_their_patterns_with_the_same_functions():
    """Snakemake wildcards go through the builders unchanged, so a rule's output pattern is the name."""
    assert target_name("ptq", "{method}", "{bits}", "{group}") == "ptq_{method}_w{bits}g{group}"
    assert drafter_name("{dmethod}", "{dbits}", "{dgroup}") == "{dmethod}_w{dbits}g{dgroup}"
    assert window_name("{window}") == "win{window}"


def test_a_profiles_served_target_and_compressed_drafters():
    """QAD from qad_from at the first target width; one compressed drafter per drafter width below 16."""
    profile = {"variants": {"qad_from": "gptq", "target_bits": [8, 4], "drafter_bits": [16, 8, 4]},
               "quant": {"group_size": 32}, "compress": {"method": "gptq", "group_size": -1}}
    assert served_target(profile) == "qad_gptq_w8g32"
    assert compressed_drafters(profile) == ["gptq_w8gch", "gptq_w4gch"]
    assert compressed_drafters({**profile, "variants": {**profile["variants"], "drafter_bits": [16]}}) == []
