"""Autoregressive and DFlash speculative generation, batch 1 (docs/design.md contract).

    autoregressive_generate(target, input_ids, max_new_tokens, temperature=0.0, seed=None)
    speculative_generate(target, drafter, input_ids, max_new_tokens, temperature=0.0, seed=None,
                         verify_tokens=None)

One speculative round, with p the position of the last committed token x_p (not yet fed to the
target; the target's cache holds positions < p):
1. the drafter fills the block [x_p, MASK x (B-1)] at positions p..p+B-1 in one forward, reading the
   target's features of the context (positions < p) from its own incremental K/V cache;
2. the target verifies [x_p, d_1..d_{V-1}] in one forward: its logits at p+k-1 give the token at p+k.
   V (`verify_tokens`, 1 < V <= B; default B) is the verify length: drafts past d_{V-1} are not
   verified (a trained drafter's late drafts are rarely accepted, and every verified position costs
   target compute); everything below follows from the V-token block. `verify_adaptive`: after a round
   whose drafts were accepted at least as far as a V-token verify reaches, the next round verifies
   the whole block (a run of easy tokens, e.g. text being copied, is not capped at V per round);
   after one that stopped short, V again. Which length a round verifies never changes what is emitted
   (generation ends at the token that completes a stop string, as token-by-token decoding does);
3. greedy: d_k is accepted while it equals the target's argmax; sampling: while it equals the token
   the target samples there. The first target token that differs (or the one after the last draft)
   is the bonus, so every committed token is the target's own choice: the output equals
   autoregressive decoding (greedy) or follows the target's distribution exactly (sampling);
4. rollback of what was rejected: attention KV is cropped; Gated DeltaNet recurrent and conv states
   cannot be cropped (transformers' `crop` does not restore the recurrent state), so they are
   restored from a snapshot taken before the verify and the accepted tokens are fed again.

`tree_nodes` (greedy, attention-only targets): the target verifies a tree instead of the chain d_1..d_{V-1}: the
drafter's best `tree_nodes` paths through its top choices at each block position (`drafter.blocks.draft_tree`),
all in one forward, each node at position p + its depth and seeing the cache and its own ancestors only. The
accepted nodes are the longest path of the target's own greedy tokens (`accepted_path`); their KV is moved to
the positions after p, the rest dropped. The output is greedy decoding's, as with a chain.

The loop runs the target's lean engine (`target.engine`, qdflash.engine: a static KV cache, where a
rollback is a new length) where one is built, else transformers' forward (any model, any device).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .drafter.blocks import TREE_TOP_K, acceptance_lengths, accepted_path, distinct_drafts, draft_tree, tree_depths
from .drafter.model import Drafter
from .engine.base import tree_bits, tree_mask
from .errors import QdflashError
from .models import synchronize
from .ops import tap_features


@dataclass
class GenerationResult:
    tokens: list[int]                       # new tokens only (the stop token included, if one was hit)
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify round, bonus included
    verify_lengths: list[int] = field(default_factory=list)      # per speculative round: tokens it verified
    rejected: list[int] = field(default_factory=list)  # per speculative round: the draft the target overruled (-1: none)
    stop_reason: str = "length"             # "length" | "eos" | "stop_string"
    prefill_seconds: float = 0.0            # time to the first new token
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target forward after the prefill)."""
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None, top_p: float = 1.0) -> torch.Tensor:
    """Tokens [..] from logits [.., V]: argmax (temperature 0) or a sample at `temperature` from the
    smallest set of tokens whose probability reaches `top_p` (nucleus sampling; 1.0 = all)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p  # the top token is always kept
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat.cpu(), 1, generator=generator).reshape(probs.shape[:-1]).to(logits.device)


def accepted_prefix(draft: torch.Tensor, target_tokens: torch.Tensor) -> int:
    """How many leading draft tokens equal the target's tokens at the same positions (the rule the
    teacher-forced estimate uses: its acceptance length minus the bonus token)."""
    return int(acceptance_lengths(draft[None], target_tokens[None])[0]) - 1


def is_linear_attention_layer(layer) -> bool:
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


class TargetSession:
    """The target with its cache: feed tokens, read logits (and drafter features), snapshot/rollback."""

    def __init__(self, target, layer_ids: list[int] | None = None):
        self.model = target.model
        self.layer_ids = layer_ids
        self.cache = None
        self.length = 0  # positions held in the cache

    @torch.no_grad()
    def feed(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `ids` at positions length.. ; returns logits [n, V] and features [n, k*H] (or None)."""
        device = next(self.model.parameters()).device
        out = self.model(input_ids=torch.tensor([ids], device=device), cache=self.cache, use_cache=True,
                         output_hidden_states=self.layer_ids is not None)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.length += len(ids)
        features = None
        if self.layer_ids is not None:
            features = tap_features(out.hidden_states, self.layer_ids)[0]
        return out.logits[0], features

    @torch.no_grad()
    def feed_tree(self, ids: list[int], parents: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tree of tokens in one forward: `ids[i]` is a child of `ids[parents[i]]` (-1: of the cache's last
        token), at position length + its depth, seeing the cache and its own ancestors only. Returns `feed`'s
        logits and features per node; the cache then holds every node after `length` (`keep_nodes` next)."""
        model = self.model
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        t, start = len(ids), self.length
        visible = tree_mask(start + t, torch.tensor(start), torch.tensor(tree_bits(parents)))
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf")).to(device)
        depths = torch.tensor(tree_depths(parents)) - 1  # the first node sits at `length`
        out = model(input_ids=torch.tensor([ids], device=device), cache=self.cache, use_cache=True,
                    attention_mask=mask[None, None], position_ids=(start + depths)[None].to(device),
                    output_hidden_states=self.layer_ids is not None)
        self.cache = getattr(out, "cache", None) or out.past_key_values
        self.length += t
        features = tap_features(out.hidden_states, self.layer_ids)[0] if self.layer_ids is not None else None
        return out.logits[0], features

    def keep_nodes(self, start: int, nodes: list[int]) -> None:
        """After `feed_tree` at `start`: keep only `nodes` (a path, in order) as positions start.., drop the rest."""
        if self.has_recurrent_state():
            raise QdflashError("a tree cannot be verified on a target with recurrent (linear-attention) layers")
        index = torch.tensor(nodes) + start
        for layer in self.cache.layers:
            keys = layer.keys
            where = index.to(keys.device)
            layer.keys = torch.cat([keys[:, :, :start], keys.index_select(2, where)], dim=2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values.index_select(2, where)], dim=2)
        self.length = start + len(nodes)

    def has_recurrent_state(self) -> bool:
        return any(is_linear_attention_layer(layer) for layer in getattr(self.cache, "layers", []))

    def snapshot(self) -> list:
        """Copies of every recurrent / conv state (attention KV is cropped instead)."""
        saved = []
        for layer in getattr(self.cache, "layers", []):
            if is_linear_attention_layer(layer):
                saved.append(({k: None if v is None else v.clone() for k, v in layer.conv_states.items()},
                              {k: None if v is None else v.clone() for k, v in layer.recurrent_states.items()}))
            else:
                saved.append(None)
        return saved

    def rollback(self, keep: int, snapshot: list | None) -> None:
        """Back to `keep` positions: crop attention KV; restore recurrent layers from `snapshot`
        (which must have been taken at exactly `keep` positions)."""
        for layer, saved in zip(getattr(self.cache, "layers", []), snapshot or [None] * len(self.cache.layers)):
            if is_linear_attention_layer(layer):
                if saved is None:
                    raise RuntimeError("a recurrent layer cannot be rolled back without a snapshot")
                for states, copies in zip((layer.conv_states, layer.recurrent_states), saved):
                    for key, value in copies.items():
                        if value is not None:
                            states[key].copy_(value)
                # transformers >= 5.25 also counts the positions a linear-attention layer has seen, and reads the
                # cache's length (hence the next positions) from it: back to `keep` with the states
                length = getattr(layer, "cumulative_length_linear", None)
                if length is not None:
                    length.fill_(keep)
            elif layer.get_seq_length() > keep:
                layer.crop(keep - layer.get_seq_length())  # a negative count: tokens to remove
        self.length = keep


class EngineSession:
    """The same interface over a lean engine (qdflash.engine): static caches, so a rollback is a new
    length (attention positions past it are masked and later overwritten; Gated DeltaNet layers
    restore the state they kept for that position)."""

    def __init__(self, engine, layer_ids: list[int] | None = None):
        self.engine = engine
        self.engine.reset()  # one engine serves one generation at a time
        self.layer_ids = layer_ids
        self.length = 0

    def feed(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.engine.embed.device
        logits, features = self.engine.forward(torch.tensor(ids, device=device), self.length, self.layer_ids)
        self.length += len(ids)
        return logits, features

    def feed_tree(self, ids: list[int], parents: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.engine.embed.device
        logits, features = self.engine.forward_tree(torch.tensor(ids, device=device), self.length, parents, self.layer_ids)
        self.length += len(ids)
        return logits, features

    def keep_nodes(self, start: int, nodes: list[int]) -> None:
        self.engine.keep_nodes(start, nodes)
        self.length = start + len(nodes)

    def has_recurrent_state(self) -> bool:
        return False

    def snapshot(self) -> None:
        return None

    def rollback(self, keep: int, snapshot=None) -> None:
        self.engine.rollback(keep)  # hybrid engines restore the per-position recurrent state
        self.length = keep


def target_session(target, layer_ids: list[int] | None = None):
    """The target's lean engine where one is built (`target.engine`), else transformers' forward."""
    engine = getattr(target, "engine", None)
    return EngineSession(engine, layer_ids) if engine is not None else TargetSession(target, layer_ids)


class DrafterSession:
    """The drafter's incremental context: per layer, the K/V of every committed position's target
    features (grows as tokens are accepted), and the block forward over it."""

    def __init__(self, drafter: Drafter, window: int | None = None):
        self.drafter = drafter
        self.window = window
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions = torch.zeros(0, dtype=torch.long)

    @torch.no_grad()
    def append(self, features: torch.Tensor, start: int) -> None:
        """Target features [n, k*H] of positions start..start+n-1 become context K/V in every layer."""
        positions = torch.arange(start, start + features.shape[0], device=features.device)
        context = self.drafter.context_features(features[None].to(self.drafter.norm.weight.dtype))
        new = [layer.context_kv(context, positions[None]) for layer in self.drafter.layers]
        if not self.keys:
            self.keys, self.values = [k for k, _ in new], [v for _, v in new]
        else:
            self.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(self.keys, new)]
            self.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(self.values, new)]
        self.positions = torch.cat([self.positions.to(positions.device), positions])
        if self.window is not None and self.positions.numel() > self.window:  # older ones can never be seen
            keep = self.window
            self.keys = [k[:, :, -keep:] for k in self.keys]
            self.values = [v[:, :, -keep:] for v in self.values]
            self.positions = self.positions[-keep:]

    @torch.no_grad()
    def draft_logits(self, last_token: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, V], greedy drafts [B-1]) for positions position+1.. given the committed token
        at `position` (DrafterEngine.draft_logits, the static step, gives the same)."""
        d = self.drafter
        b = d.block_size
        device = d.norm.weight.device
        ids = torch.full((1, b), d.mask_id, device=device)
        ids[0, 0] = last_token
        q_pos = torch.arange(position, position + b, device=device)
        logits = d.forward_block(ids, q_pos[None], self.keys, self.values, self.positions[None], self.window)[0]
        return logits, logits[1:].argmax(-1)

    def draft(self, last_token: int, position: int) -> torch.Tensor:
        """Greedy drafts [B-1] for positions position+1.. given the committed token at `position`."""
        return self.draft_logits(last_token, position)[1]


def drafter_session(drafter: Drafter, window: int | None = None):
    """The drafter's static engine where one is attached (`drafter.engine`, qdflash.drafter.static:
    buffers in place, a CUDA graph per context bucket), else the eager DrafterSession."""
    engine = getattr(drafter, "engine", None)
    return engine.session(window) if engine is not None else DrafterSession(drafter, window)


def end_tokens(target, ignore_eos: bool = False) -> set[int]:
    """The tokens that end a generation: the target's end-of-sequence ids, none with `ignore_eos` (a latency
    protocol's fixed answer length: the harness's categories ask for exactly N new tokens)."""
    return set() if ignore_eos else set(target.eos_token_ids)


def _stop(tokens: list[int], eos: set[int], stop_strings, tokenizer, max_new_tokens: int,
          checked: int = 0) -> tuple[list[int], str | None]:
    """Cut `tokens` at the first stop (EOS kept) and say why; None when generation goes on.
    tokens[:checked] were checked by an earlier call (no stop there), so only the rest is scanned."""
    for i in range(checked, len(tokens)):
        token = tokens[i]
        if token in eos:
            return tokens[: i + 1], "eos"
        if i + 1 >= max_new_tokens:
            return tokens[: i + 1], "length"
    if stop_strings and tokenizer is not None:
        text = tokenizer.decode(tokens)
        if any(s in text for s in stop_strings):
            # cut at the token that completes the stop string, as token-by-token decoding stops: a round that
            # commits several tokens must not return (and count) the ones after it
            for end in range(checked + 1, len(tokens)):  # tokens[:checked] held none
                prefix = tokenizer.decode(tokens[:end])
                if any(s in prefix for s in stop_strings):
                    return tokens[:end], "stop_string"
            return tokens, "stop_string"
    return tokens, None


def prompt_ids(input_ids) -> list[int]:
    """A batch-1 prompt as a list: LongTensor [1, L] or [L], list[int] or [[...]]."""
    if torch.is_tensor(input_ids):
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"batch 1 only: input_ids has shape {tuple(input_ids.shape)}")
        return input_ids.reshape(-1).tolist()
    ids = list(input_ids)
    return list(ids[0]) if ids and isinstance(ids[0], (list, tuple)) else ids


def _emit(on_tokens, tokens: list[int], done: int) -> None:
    """Hand the tokens committed since `done` to `on_tokens` (none: nothing to do)."""
    if on_tokens is not None and len(tokens) > done:
        on_tokens(tokens[done:])


def _generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(0 if seed is None else seed)
    return g


def autoregressive_generate(target, input_ids, max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
                            stop_strings: list[str] | None = None, top_p: float = 1.0,
                            on_tokens=None, ignore_eos: bool = False) -> GenerationResult:
    """One token per target forward, with the KV / recurrent cache (the reference for speculative).
    `on_tokens(new)`: called with each step's committed tokens (a server streams them); `ignore_eos`:
    an end-of-sequence token is emitted and decoding goes on (vLLM's option of that name)."""
    ids = prompt_ids(input_ids)
    generator, eos = _generator(seed), end_tokens(target, ignore_eos)
    session = target_session(target)
    started = time.perf_counter()
    logits, _ = session.feed(ids)
    tokens = [int(choose(logits[-1], temperature, generator, top_p))]
    synchronize(target.device)
    prefill = time.perf_counter() - started
    tokens, reason = _stop(tokens, eos, stop_strings, target.tokenizer, max_new_tokens)
    _emit(on_tokens, tokens, 0)
    while reason is None:
        logits, _ = session.feed(tokens[-1:])
        done = len(tokens)
        tokens, reason = _stop(tokens + [int(choose(logits[-1], temperature, generator, top_p))], eos, stop_strings,
                               target.tokenizer, max_new_tokens, checked=done)
        _emit(on_tokens, tokens, done)
    synchronize(target.device)
    return GenerationResult(tokens, stop_reason=reason, prefill_seconds=prefill, seconds=time.perf_counter() - started)


def verify_length(drafter: Drafter, verify_tokens: int | None = None) -> int:
    """The verify length V of a speculative round: `verify_tokens` (None: the drafter's block size),
    checked to be 1 < V <= block size (the committed token and at least one draft, at most a block)."""
    b = drafter.block_size
    if verify_tokens is None:
        return b
    if isinstance(verify_tokens, bool) or not isinstance(verify_tokens, int) or not 1 < verify_tokens <= b:
        raise QdflashError(f"verify_tokens = {verify_tokens!r}: the verify length must be an integer with "
                           f"1 < verify_tokens <= the drafter's block size ({b}), or null for the whole block")
    return verify_tokens


def verify_sizes(drafter: Drafter, verify_tokens: int | None = None, adaptive: bool = False) -> list[int]:
    """Every verify length a round of `speculative_generate(..., verify_tokens, verify_adaptive=adaptive)`
    can feed: V, and the whole block where adaptive (the lean engine captures a step for each)."""
    return sorted({verify_length(drafter, verify_tokens), *([drafter.block_size] if adaptive else [])})


class RoundTimer:
    """Where a speculative round's time goes: `speculative_generate(..., phases=RoundTimer(device))`
    adds the synchronized wall time of each part of every round: draft (the drafter's block), verify
    (the target's forward of the block and its choice), append (a rollback and the drafter's context
    update; DrafterEngine only stores the features there, its next draft writes their K/V) and host (the stop checks and the rest). The synchronizations themselves cost time, so
    this is a profiling run beside the timed ones, never the timed one."""

    PARTS = ("draft", "verify", "append", "host")

    def __init__(self, device):
        self.device, self.rounds, self._last = device, 0, 0.0
        self.seconds = dict.fromkeys(self.PARTS, 0.0)

    def start(self) -> None:
        synchronize(self.device)
        self._last = time.perf_counter()

    def lap(self, part: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] += now - self._last
        self._last = now

    def end_round(self) -> None:
        self.lap("host")
        self.rounds += 1

    def ms_per_round(self) -> dict[str, float]:
        return {part: 1e3 * seconds / max(self.rounds, 1) for part, seconds in self.seconds.items()}


class _NoTimer:
    """What speculative_generate times with when no RoundTimer is given: nothing (no synchronization)."""

    def start(self) -> None:
        pass

    def lap(self, part: str) -> None:
        pass

    def end_round(self) -> None:
        pass


def speculative_generate(target, drafter: Drafter, input_ids, max_new_tokens: int, temperature: float = 0.0,
                         seed: int | None = None, stop_strings: list[str] | None = None,
                         window: int | None = None, top_p: float = 1.0, on_tokens=None,
                         verify_tokens: int | None = None, phases: RoundTimer | None = None,
                         verify_adaptive: bool = False, ignore_eos: bool = False,
                         no_repeat: bool = False, tree_nodes: int | None = None) -> GenerationResult:
    """DFlash speculative decoding (module docstring); `window`: the drafter's sliding window;
    `top_p`: nucleus sampling (the target's filtered distribution is what is kept exactly);
    `on_tokens(new)`: called with each round's committed tokens (a server streams them);
    `verify_tokens`: the target verifies the committed token + the first verify_tokens - 1 drafts
    (None: the whole block; `verify_length`); `verify_adaptive`: the whole block after a round that
    accepted as far as that reaches (module docstring). On the lean engine a verify replays the graph
    captured for that many tokens (`engine.capture([1, V, block], layer_ids)`), else runs the same step
    eagerly. `phases`: a RoundTimer that times each part of every round (a profiling run: it synchronizes).
    `ignore_eos`: as autoregressive_generate's. `no_repeat`: no draft repeats the draft before it (`distinct_drafts`).
    `tree_nodes`: verify a tree of that many drafts instead of a chain (module docstring; `verify_tokens` and
    `verify_adaptive` do not apply)."""
    if tree_nodes is not None:
        return _tree_generate(target, drafter, input_ids, max_new_tokens, tree_nodes, temperature=temperature,
                              stop_strings=stop_strings, window=window, on_tokens=on_tokens, phases=phases,
                              ignore_eos=ignore_eos, no_repeat=no_repeat)
    ids = prompt_ids(input_ids)
    generator, eos = _generator(seed), end_tokens(target, ignore_eos)
    short = verify_length(drafter, verify_tokens)
    v = short
    session = target_session(target, drafter.config.target_layer_ids)
    context = drafter_session(drafter, window)
    started = time.perf_counter()
    tokens, reason, prefill = _prefill(target, session, context, ids, lambda logits: choose(logits, temperature, generator, top_p),
                                       eos, stop_strings, max_new_tokens, on_tokens)
    lengths: list[int] = []
    verified: list[int] = []
    rejected: list[int] = []
    recurrent = session.has_recurrent_state()
    timer = phases if phases is not None else _NoTimer()
    timer.start()
    while reason is None:
        p = session.length  # position of tokens[-1], the committed token not yet fed
        # the drafter fills its whole block; V-1 are verified
        if no_repeat:  # the rule runs on the host, where the drafts go anyway (the block is fed from a list)
            logits = context.draft_logits(tokens[-1], p)[0]
            listed = distinct_drafts(logits[1:v].topk(2, dim=-1).indices.tolist())
            draft = torch.tensor(listed, device=logits.device)
        else:
            draft = context.draft(tokens[-1], p)[: v - 1]
            listed = None
        timer.lap("draft")
        snapshot = session.snapshot() if recurrent else None
        block = [tokens[-1], *(listed if listed is not None else draft.tolist())]
        logits, features = session.feed(block)
        chosen = choose(logits, temperature, generator, top_p)  # the target's token after each block position
        n = accepted_prefix(draft, chosen[: v - 1])
        timer.lap("verify")
        if n < v - 1:  # roll back what the target fed past the accepted drafts
            if recurrent:
                session.rollback(p, snapshot)
                _, features = session.feed(block[: n + 1])  # the recurrence over the accepted tokens only
            else:
                session.rollback(p + n + 1, None)
                features = features[: n + 1]
        context.append(features[: n + 1], p)
        timer.lap("append")
        drafts = block[1:]  # on the host already
        new = [*drafts[:n], int(chosen[n])]
        lengths.append(len(new))
        verified.append(v)
        rejected.append(drafts[n] if n < len(drafts) else -1)
        if verify_adaptive:  # the host knows n already: choosing the next length costs no synchronization
            v = drafter.block_size if n >= short - 1 else short
        done = len(tokens)
        tokens, reason = _stop(tokens + new, eos, stop_strings, target.tokenizer, max_new_tokens, checked=done)
        _emit(on_tokens, tokens, done)
        timer.end_round()  # host: the stop checks and the rest
    synchronize(target.device)
    return GenerationResult(tokens, lengths, verified, rejected, stop_reason=reason, prefill_seconds=prefill,
                            seconds=time.perf_counter() - started)


def _prefill(target, session, context, ids: list[int], pick, eos, stop_strings, max_new_tokens: int, on_tokens):
    """A speculative generation's start: the prompt through the target (its features into the drafter's context)
    and the first token, `pick(logits)`. Returns the tokens, the stop reason (None: go on) and the prefill's
    seconds."""
    started = time.perf_counter()
    logits, features = session.feed(ids)
    context.append(features, 0)
    tokens = [int(pick(logits[-1]))]
    synchronize(target.device)
    prefill = time.perf_counter() - started
    tokens, reason = _stop(tokens, eos, stop_strings, target.tokenizer, max_new_tokens)
    _emit(on_tokens, tokens, 0)
    return tokens, reason, prefill


def _tree_generate(target, drafter: Drafter, input_ids, max_new_tokens: int, tree_nodes: int, *, temperature: float,
                   stop_strings, window, on_tokens, phases, ignore_eos: bool, no_repeat: bool) -> GenerationResult:
    """`speculative_generate(..., tree_nodes=N)`: each round verifies a tree of N drafts (module docstring)."""
    if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
        raise QdflashError(f"tree_nodes = {tree_nodes!r}: expected a positive integer (drafts in a round's tree)")
    if temperature != 0:
        raise QdflashError(f"tree_nodes needs greedy decoding (temperature 0, got {temperature}): a sampled tree "
                           "needs a different acceptance rule, which is not built")
    session = target_session(target, drafter.config.target_layer_ids)
    context = drafter_session(drafter, window)
    eos = end_tokens(target, ignore_eos)
    started = time.perf_counter()
    tokens, reason, prefill = _prefill(target, session, context, prompt_ids(input_ids), lambda logits: logits.argmax(),
                                       eos, stop_strings, max_new_tokens, on_tokens)
    if session.has_recurrent_state():
        raise QdflashError("tree_nodes: the target has recurrent (linear-attention) layers, whose state cannot be "
                           "kept per branch of a tree")
    lengths: list[int] = []
    verified: list[int] = []
    rejected: list[int] = []
    timer = phases if phases is not None else _NoTimer()
    timer.start()
    while reason is None:
        p = session.length
        logits = context.draft_logits(tokens[-1], p)[0]
        top = logits[1:].float().log_softmax(-1).topk(min(TREE_TOP_K, logits.shape[-1]), dim=-1)
        if logits.shape[-1] <= 1 << 24:  # one copy to the host: the ids ride along as floats (exact up to 2^24)
            logp, ids = torch.stack([top.values, top.indices.float()]).tolist()
            ids = [[int(i) for i in row] for row in ids]
        else:
            logp, ids = top.values.tolist(), top.indices.tolist()
        drafts, parents = draft_tree(ids, logp, tree_nodes, skip_repeats=no_repeat)
        timer.lap("draft")
        logits, features = session.feed_tree([tokens[-1], *drafts], [-1, *(q + 1 for q in parents)])
        chosen = logits.argmax(-1).tolist()  # the target's token after each node ([0]: after x_p)
        path = accepted_path(drafts, parents, lambda node: chosen[node + 1])
        timer.lap("verify")
        keep = [0, *(i + 1 for i in path)]
        session.keep_nodes(p, keep)
        context.append(features[torch.tensor(keep, device=features.device)], p)
        timer.lap("append")
        new = [*(drafts[i] for i in path), chosen[keep[-1]]]
        lengths.append(len(new))
        verified.append(len(drafts) + 1)
        # the overruled draft: the best child of the last accepted node, where it has one
        last = path[-1] if path else -1
        rejected.append(next((tok for tok, parent in zip(drafts, parents) if parent == last), -1))
        done = len(tokens)
        tokens, reason = _stop(tokens + new, eos, stop_strings, target.tokenizer, max_new_tokens, checked=done)
        _emit(on_tokens, tokens, done)
        timer.end_round()
    synchronize(target.device)
    return GenerationResult(tokens, lengths, verified, rejected, stop_reason=reason, prefill_seconds=prefill,
                            seconds=time.perf_counter() - started)


__all__ = ["GenerationResult", "RoundTimer", "accepted_prefix", "autoregressive_generate", "choose",
           "speculative_generate", "verify_length", "verify_sizes"]
