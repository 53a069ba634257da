"""Prompt sources, deterministic splitting, chat templating with loss masks, batched generation."""

from .chat import render_prompt_ids, tokenize_conversation, training_example
from .sources import PromptItem, SOURCES, load_source
from .split import content_key, select_prompts

__all__ = [
    "PromptItem",
    "SOURCES",
    "content_key",
    "load_source",
    "render_prompt_ids",
    "select_prompts",
    "tokenize_conversation",
    "training_example",
]
