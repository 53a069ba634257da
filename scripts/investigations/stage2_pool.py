"""Whether a profile's prompt pools hold a second, disjoint set of training prompts for drafter stage 2
(`data.stage2_prompts: fresh`): how many prompts per source stage 1 takes and how many the fresh
selection finds, with the prepare_data node's own filters (English, max_prompt_tokens with the
profile's target tokenizer).

    python scripts/investigations/stage2_pool.py --profile gpu
"""

from __future__ import annotations

import argparse
from collections import Counter

from omegaconf import OmegaConf

from qdflash.config import load_config
from qdflash.data.chat import render_prompt_ids
from qdflash.data.split import mostly_ascii
from qdflash.models import load_target
from qdflash.paths import REPO_ROOT
from qdflash.stages.prepare_data import choose_prompts, load_sources


class Run:
    def __init__(self):
        self.metrics = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="gpu")
    args = parser.parse_args()
    profile = load_config()["profiles"][args.profile]
    data = OmegaConf.merge(OmegaConf.load(REPO_ROOT / "config" / "data" / "default.yaml"), OmegaConf.create(profile.get("data", {})))
    tokenizer = load_target(profile.get("model", "smollm2-135m"), device="cpu").tokenizer

    def accept(item) -> bool:
        if data.english_only and not mostly_ascii(item.prompt):
            return False
        return len(render_prompt_ids(tokenizer, item.prompt, {})) <= data.max_prompt_tokens

    loaded = load_sources(data, Run())
    first, held = choose_prompts(loaded, data, accept, Run())
    fresh, held_fresh = choose_prompts(loaded, data, accept, Run(), fresh=True)
    print("stage 1:", dict(Counter(i.source for i in first)))
    print("fresh:  ", dict(Counter(i.source for i in fresh)), "| shared with stage 1:",
          len({i.id for i in first} & {i.id for i in fresh}), "| same held-out:", [i.id for i in held] == [i.id for i in held_fresh])


if __name__ == "__main__":
    main()
