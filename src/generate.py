"""Text generation with a KV cache: greedy at temperature 0, else top-k / top-p sampling."""
import numpy as np

from . import kernels
from .autodiff import without_autodiff
from .data.tokenize import prompt_ids
from .errors import ConfigError, DataError, ModelError, check_count
from .models.llama import KVCache


def _prompt_ids(tok, prompt, name):
    """A prompt's ids: a string as text, a list of {"role", "content"} dicts as a chat. `name`
    is what an error calls the prompt."""
    if isinstance(prompt, (list, tuple)):
        try:
            text = tok.apply_chat_template(list(prompt), add_generation_prompt=True)
        except DataError as e:  # the template refused it (raise_exception, a bad message)
            raise DataError(f"generation: {name}: {e}") from None
        return tok.encode(text, add_special_tokens=False)
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt is a string or a list of {{'role', 'content'}} messages, "
                        f"got {type(prompt).__name__}")
    return prompt_ids(tok, prompt)  # as a completion record's prompt is trained


def _check_not_empty(id_lists, names):
    """Each prompt needs a token to predict from (a padded empty row would attend to nothing)."""
    empty = [name for name, ids in zip(names, id_lists) if not len(ids)]
    if empty:
        raise ConfigError(f"generation: {empty[0]} has no tokens (an empty text, and the "
                          "tokenizer adds no BOS token); give it some text")


def check_settings(max_new_tokens, temperature, top_p, top_k, seed, batch_size=1):
    """One clear error naming the setting, before anything runs: a negative token count, a
    temperature below 0 or not a number, top_p outside [0, 1], a negative top_k or seed, or a
    batch size below 1 would otherwise fail deep inside decoding, or sample wrongly."""
    check_count("generation", "max_new_tokens", max_new_tokens, 0)
    check_count("generation", "top_k", top_k, 0, note=" (0: off)")
    check_count("generation", "seed", seed, 0, none_ok=True)
    check_count("generation", "batch_size", batch_size, 1)
    if not (_real(temperature) and temperature >= 0.0):
        raise ConfigError(f"generation: temperature must be a number >= 0 (0: greedy), got "
                          f"{temperature!r}")
    if not (_real(top_p) and 0.0 <= top_p <= 1.0):
        raise ConfigError(f"generation: top_p must be within [0, 1], got {top_p!r}")


def _real(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
        and bool(np.isfinite(v))


def _sample(logits, temperature, top_k, top_p, rng):
    """Next token id from (V,) float logits."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64)
    z = (z - z.max()) / temperature  # <= 0: a tiny temperature gives -inf, never inf - inf
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p
        keep[0] = True  # the most likely token always stays (top_p = 0: greedy)
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def _decode(model, id_lists, names, max_new_tokens, temperature, top_p, top_k, seed, eos_ids,
            stop, int8=True):
    """Generate after each prompt in `id_lists` together: one left-padded batch, one KV cache.
    Returns the new ids of each row (EOS excluded); `names` are what errors call the rows.
    `int8`: the one-token steps of a batch of one or two prompts round x to 8 bits in the
    packed products (kernels/activations.py), as llama.cpp decodes; larger batches keep float32
    x. Its callers check the settings."""
    tok = model.tokenizer
    rng = np.random.default_rng(seed)
    longest = max(len(ids) for ids in id_lists)
    max_new_tokens = _room(model, id_lists, names, max_new_tokens)
    pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
    pad = np.array([longest - len(ids) for ids in id_lists])
    batch = np.array([[pad_id] * p + list(ids) for p, ids in zip(pad, id_lists)], dtype=np.int64)
    cache = KVCache(model.config, model.device.inner(), len(id_lists), longest + max_new_tokens,
                    pad=pad)
    outs = [[] for _ in id_lists]
    done = [False] * len(id_lists)
    with model.evaluating(), kernels.int8_activations(int8):  # no dropout, no generator draws
        _decode_loop(model, batch, cache, outs, done, names, max_new_tokens, temperature, top_p,
                     top_k, rng, eos_ids, stop, pad_id)
    return outs


def _room(model, id_lists, names, max_new_tokens):
    """New tokens that fit the model's context (max_position_embeddings) after the prompts: a
    longer request stops at the end of the context, as llama.cpp does; a longer prompt is an
    error (its positions would be ones the model never saw)."""
    context = model.config.max_position_embeddings
    longest = max(len(ids) for ids in id_lists)
    if longest > context:
        name = next(n for n, ids in zip(names, id_lists) if len(ids) == longest)
        raise ModelError(f"generation: {name}: a prompt of {longest} tokens is longer than the "
                         f"context of {model.source or 'the model'} ({context} positions)")
    return min(max_new_tokens, context - longest)


def _decode_loop(model, batch, cache, outs, done, names, max_new_tokens, temperature, top_p,
                 top_k, rng, eos_ids, stop, pad_id):
    tok = model.tokenizer
    with without_autodiff():
        logits = model.next_logits(batch, cache)  # (B, V)
        for step in range(max_new_tokens):
            rows = logits.numpy()
            nxt = np.full((len(outs), 1), pad_id, dtype=np.int64)
            for i, out in enumerate(outs):
                if done[i]:
                    continue
                _check_finite(rows[i], step, names[i])
                nxt[i, 0] = tok_id = _sample(rows[i], temperature, top_k, top_p, rng)
                if tok_id in eos_ids:
                    done[i] = True
                    continue
                out.append(tok_id)
                if stop and tok is not None and any(s in tok.decode(out) for s in stop):
                    done[i] = True
            if all(done):
                break
            logits = model.next_logits(nxt, cache)


def _check_finite(row, step, name):
    """A NaN or inf logit would be sampled as some token, silently: say so instead."""
    if not np.isfinite(row).all():
        raise ModelError(f"generation: {name}: the logits of new token {step + 1} are not "
                         "finite; the model's weights or its adapter hold NaN or inf")


def generate_ids(model, ids, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0,
                 seed=None, eos_ids=(), stop=(), int8_activations=True):
    """Generated token ids after the prompt ids (a list), stopping at EOS or a stop string.
    int8_activations=False keeps float32 x in every product (slower, the training forward's
    numbers)."""
    check_settings(max_new_tokens, temperature, top_p, top_k, seed)
    _check_not_empty([ids], ["prompt 0"])
    return _decode(model, [list(ids)], ["prompt 0"], max_new_tokens, temperature, top_p, top_k,
                   seed, set(eos_ids), list(stop), int8_activations)[0]


def generate_batch(model, prompts, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0,
                   seed=None, stop=None, batch_size=32, int8_activations=True, names=None):
    """generate() for many prompts at once (left-padded batches of `batch_size`, similar
    lengths together); returns the texts in the order of `prompts`. int8_activations applies
    to batches of one or two prompts (see generate). `names`: what errors call each prompt
    (a record's file and line, say); by default "prompt i", its index in `prompts`."""
    tok = model.tokenizer
    if tok is None:
        raise ModelError(f"{model.source or 'this model'}: no tokenizer (a folder without "
                         "tokenizer.json, a GGUF without one): generate_ids() takes token ids")
    check_settings(max_new_tokens, temperature, top_p, top_k, seed, batch_size)
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], dict)):
        raise TypeError("generate_batch takes a list of prompts (strings or chats); "
                        "generate() takes one")
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    names = [f"prompt {i}" for i in range(len(prompts))] if names is None else list(names)
    if len(names) != len(prompts):
        raise ValueError(f"generate_batch: {len(names)} names for {len(prompts)} prompts")
    ids = [_prompt_ids(tok, p, name) for p, name in zip(prompts, names)]
    _check_not_empty(ids, names)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    texts = [None] * len(ids)
    for c in range(0, len(order), batch_size):
        chunk = order[c:c + batch_size]
        outs = _decode(model, [ids[i] for i in chunk], [names[i] for i in chunk], max_new_tokens,
                       temperature, top_p, top_k, seed, set(tok.eos_token_ids), stop,
                       int8_activations)
        for i, out in zip(chunk, outs):
            texts[i] = _cut(tok.decode(out, skip_special_tokens=True), stop)
    return texts


def _cut(text, stop):
    for s in stop:
        if s in text:
            text = text[:text.index(s)]
    return text


def generate(model, prompt_or_messages, max_new_tokens=128, temperature=0.0, top_p=1.0,
             top_k=0, seed=None, stop=None, int8_activations=True):
    """Generate text. A list of {"role", "content"} dicts is a chat (the chat template applies);
    a string is a plain prompt. Returns the generated text only (without the prompt).
    int8_activations: the one-token steps (of a batch of one or two prompts) round x to 8 bits
    in the products with packed ggml / K-quant / int8 / nf4 / fp4 weights, as llama.cpp does
    (1.3-2x faster products); False keeps float32 x (the training forward's numbers)."""
    return generate_batch(model, [prompt_or_messages], max_new_tokens, temperature, top_p,
                          top_k, seed, stop, int8_activations=int8_activations)[0]
