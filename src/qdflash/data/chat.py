"""Chat templating and assistant-only loss masks."""

from __future__ import annotations

from ..errors import QdflashError


# stands for an assistant answer when a template is rendered only to see what it writes around one
TURN_SENTINEL = "\x00qdflash-answer\x00"


def _render_text(tokenizer, messages: list[dict], *, add_generation_prompt: bool, template_kwargs: dict) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise QdflashError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; the data stage needs one")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs)


def _render(tokenizer, messages: list[dict], *, add_generation_prompt: bool, template_kwargs: dict) -> list[int]:
    text = _render_text(tokenizer, messages, add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs)
    # The template already writes the special tokens (BOS, <|im_start|>): do not add them twice.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_prompt_ids(tokenizer, prompt: str, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a one-turn user prompt, ending with the assistant generation prompt."""
    return _render(
        tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True, template_kwargs=template_kwargs or {}
    )


def next_turn_ids(tokenizer, user: str, *, ended_by: int | None, template_kwargs: dict | None = None) -> list[int]:
    """The tokens that follow an answer's generated ids to open the next turn: what the template
    writes after an assistant message (less the stop token the target generated itself), the next
    user message and the assistant generation prompt. Appended to the generated ids (never to a
    re-tokenized answer), they make a multi-turn sequence of exactly the tokens the target saw.

    `ended_by`: the answer's last token when it is a stop token, None for an answer cut at
    max_new_tokens (the template's closing is then written whole). The template is rendered with a
    placeholder answer; one that rewrites earlier turns (so that the rendered history is not a prefix
    of the longer conversation) cannot be continued turn by turn, and is an error."""
    template_kwargs = template_kwargs or {}
    first = [{"role": "user", "content": "?"}]
    opened = _render_text(tokenizer, first, add_generation_prompt=True, template_kwargs=template_kwargs)
    longer = first + [{"role": "assistant", "content": TURN_SENTINEL}, {"role": "user", "content": user}]
    text = _render_text(tokenizer, longer, add_generation_prompt=True, template_kwargs=template_kwargs)
    if not text.startswith(opened + TURN_SENTINEL):
        raise QdflashError(f"the chat template of {tokenizer.name_or_path!r} does not render a conversation as its first turn's "
                           "prompt followed by the answer; data.max_turns > 1 needs one that does (use data.max_turns: 1)")
    rest = text[len(opened) + len(TURN_SENTINEL):]
    if ended_by is not None:
        stop_text = tokenizer.decode([ended_by])
        if rest.startswith(stop_text):
            rest = rest[len(stop_text):]
    return tokenizer(rest, add_special_tokens=False)["input_ids"]


def training_example(prompt_ids: list[int], response_ids: list[int]) -> dict:
    """The exact tokens the target saw and produced, with loss only on the produced ones.

    Built from the generated ids (not by re-tokenizing the response text), so teacher forcing on it
    replays exactly what the target did.
    """
    return {
        "input_ids": list(prompt_ids) + list(response_ids),
        "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids),
    }


def tokenize_conversation(
    tokenizer, messages: list[dict], *, eos_token_ids: list[int], template_kwargs: dict | None = None
) -> dict:
    """Tokenize a multi-turn conversation; loss mask = 1 on assistant tokens up to and including the
    token that ends the turn, 0 elsewhere (system, user, template scaffolding)."""
    template_kwargs = template_kwargs or {}
    input_ids: list[int] = []
    loss_mask: list[int] = []
    for i, message in enumerate(messages):
        if message.get("role") not in ("system", "user", "assistant"):
            raise QdflashError(f"message {i} has role {message.get('role')!r}; expected system, user or assistant")
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True, template_kwargs=template_kwargs)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, template_kwargs=template_kwargs)
        if upto[: len(prefix)] != prefix or prefix[: len(input_ids)] != input_ids:
            raise QdflashError("the chat template does not render conversations incrementally; cannot mask by prefix")
        loss_mask += [0] * (len(prefix) - len(input_ids))
        turn = upto[len(prefix):]
        ends = [j for j, tok in enumerate(turn) if tok in eos_token_ids]
        cut = ends[0] + 1 if ends else len(turn)
        loss_mask += [1] * cut + [0] * (len(turn) - cut)
        input_ids = upto
    full = _render(tokenizer, messages, add_generation_prompt=False, template_kwargs=template_kwargs)
    if full[: len(input_ids)] != input_ids:
        raise QdflashError("the chat template does not render conversations incrementally; cannot mask by prefix")
    loss_mask += [0] * (len(full) - len(input_ids))
    return {"input_ids": full, "loss_mask": loss_mask}
