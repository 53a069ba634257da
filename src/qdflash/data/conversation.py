"""Multi-turn self-distillation: a conversation's user turns answered one after the other by the target.

Turn 1 is the single-turn data (same prompt tokens, same sampling key, so the same answer). Turn t > 1
continues the token sequence itself: the previous prompt, the answer exactly as generated, the tokens
that close it and open the next user turn (`chat.next_turn_ids`), and the target answers again from
there. The result is one training sequence per conversation, loss on every answer, long enough for
the contexts a drafter meets when serving (docs/recipe.md: whole conversations answered turn by turn).

All conversations that reach turn t are answered in one batched `generate` call, so a turn costs one
pass of the batch engine; each answer samples from noise keyed by (conversation id, turn), so sharded
and unsharded runs still write the same data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from .chat import next_turn_ids
from .generate import Generation, GenerationStats, Sampling

log = logging.getLogger(__name__)


@dataclass
class Conversation:
    id: str
    users: list[str]  # the user turns answered so far
    input_ids: list[int]  # the prompt of turn 1 ... the last answer, exactly as the target saw and wrote them
    loss_mask: list[int]  # 1 on generated tokens (every turn), 0 on prompts and template scaffolding
    prompt_tokens: int  # the first turn's prompt
    answers: list[Generation] = field(default_factory=list)
    stopped: str = ""  # why no further turn was answered: no_more_turns, max_turns, max_sequence_tokens, rejected


def answer_conversations(
    items, first_ids: dict[str, list[int]], generate: Callable, *, tokenizer, max_turns: int, max_sequence_tokens: int,
    max_new_tokens: int, sampling: Sampling, seed: int, key_of: Callable[[str, int], int],
    accept_user: Callable[[str], bool] = lambda text: True, template_kwargs: dict | None = None, desc: str = "train",
) -> tuple[list[Conversation], list[GenerationStats]]:
    """Answer up to `max_turns` user turns of every item (its prompt, then `item.followups`).

    A conversation stops before a turn when it has no further user turn, when that turn is rejected by
    `accept_user` (e.g. not English) or when prompt + next user turn + `max_new_tokens` would exceed
    `max_sequence_tokens`. `generate(prompts, sampling=, seed=, keys=, desc=)` answers one turn of many
    conversations (prepare_data's backend). Returns the conversations in item order and each turn's
    generation stats."""
    convs = [Conversation(it.id, [it.prompt], list(first_ids[it.id]), [0] * len(first_ids[it.id]), len(first_ids[it.id]))
             for it in items]
    followups = {it.id: list(it.followups) for it in items}
    stats: list[GenerationStats] = []
    active = list(range(len(convs)))
    for turn in range(1, max_turns + 1):
        if turn > 1:
            ready = []
            for i in active:
                conv, rest = convs[i], followups[convs[i].id]
                if len(conv.users) > len(rest):
                    conv.stopped = "no_more_turns"
                    continue
                user = rest[len(conv.users) - 1]
                if not accept_user(user):
                    conv.stopped = "rejected"
                    continue
                last = conv.answers[-1]
                opener = next_turn_ids(tokenizer, user, ended_by=last.token_ids[-1] if last.finish_reason == "stop" else None,
                                       template_kwargs=template_kwargs)
                if len(conv.input_ids) + len(opener) + max_new_tokens > max_sequence_tokens:
                    conv.stopped = "max_sequence_tokens"
                    continue
                conv.users.append(user)
                conv.input_ids += opener
                conv.loss_mask += [0] * len(opener)
                ready.append(i)
            active = ready
        if not active:
            break
        prompts = [convs[i].input_ids for i in active]
        gens, turn_stats = generate(prompts, sampling=sampling, seed=seed, keys=[key_of(convs[i].id, turn) for i in active],
                                    desc=f"{desc} turn {turn}")
        stats.append(turn_stats)
        for i, gen in zip(active, gens):
            conv = convs[i]
            conv.answers.append(gen)
            conv.input_ids = conv.input_ids + list(gen.token_ids)
            conv.loss_mask = conv.loss_mask + [1] * len(gen.token_ids)
        if turn > 1:
            log.info("turn %d: %d conversations continued (mean length now %.0f tokens)", turn, len(active),
                     sum(len(convs[i].input_ids) for i in active) / len(active))
    for i in active:
        convs[i].stopped = convs[i].stopped or ("max_turns" if followups[convs[i].id][len(convs[i].users) - 1:] else "no_more_turns")
    return convs, stats


__all__ = ["Conversation", "answer_conversations"]
