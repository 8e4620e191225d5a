"""Text generation with a KV cache: greedy at temperature 0, else top-k / top-p sampling."""
import numpy as np

from .autodiff import without_autodiff
from .models.llama import KVCache


def _prompt_ids(tok, prompt):
    if isinstance(prompt, (list, tuple)):
        text = tok.apply_chat_template(list(prompt), add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(prompt, add_special_tokens=True)


def _sample(logits, temperature, top_k, top_p, rng):
    """Next token id from (V,) float logits."""
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


def generate_ids(model, ids, max_new_tokens=128, temperature=0.0, top_p=1.0, top_k=0,
                 seed=None, eos_ids=(), stop=()):
    """Generated token ids after the prompt ids (a list), stopping at EOS or a stop string."""
    tok = model.tokenizer
    rng = np.random.default_rng(seed)
    cache = KVCache(model.config, model.device.inner(), 1, len(ids) + max_new_tokens)
    out = []
    with without_autodiff():
        logits = model.next_logits(np.asarray([ids], dtype=np.int64), cache)
        for _ in range(max_new_tokens):
            nxt = _sample(logits.numpy()[0], temperature, top_k, top_p, rng)
            if nxt in eos_ids:
                break
            out.append(nxt)
            if stop and tok is not None and any(s in tok.decode(out) for s in stop):
                break
            logits = model.next_logits(np.asarray([[nxt]], dtype=np.int64), cache)
    return out


def generate(model, prompt_or_messages, max_new_tokens=128, temperature=0.0, top_p=1.0,
             top_k=0, seed=None, stop=None):
    """Generate text. A list of {"role", "content"} dicts is a chat (the chat template applies);
    a string is a plain prompt. Returns the generated text only (without the prompt)."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("this model has no tokenizer; generate_ids() takes token ids")
    ids = _prompt_ids(tok, prompt_or_messages)
    stop = [stop] if isinstance(stop, str) else list(stop or ())
    out = generate_ids(model, ids, max_new_tokens, temperature, top_p, top_k, seed,
                       eos_ids=set(tok.eos_token_ids), stop=stop)
    text = tok.decode(out, skip_special_tokens=True)
    for s in stop:
        if s in text:
            text = text[:text.index(s)]
    return text
