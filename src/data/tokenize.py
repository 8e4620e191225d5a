"""Turning a checked record into token ids with a loss mask, then into an Example."""
from __future__ import annotations

from ..errors import DataError
from .example import Example, from_token_mask


def prompt_ids(tokenizer, text: str) -> list:
    """The ids a plain-text prompt starts a sequence with: BOS where the tokenizer's
    add_bos_token says so, and no EOS (a tokenizer whose add_eos_token is true puts one there,
    but the answer follows)."""
    ids = list(tokenizer.encode(text, add_special_tokens=True))
    eos = tokenizer.eos_token_id
    if getattr(tokenizer, "add_eos_token", False) and eos is not None and ids[-1:] == [eos]:
        ids = ids[:-1]
    return ids


def tokens_and_mask(item: tuple, tokenizer, train_on_inputs: bool,
                    where: str = "") -> tuple[list, list]:
    """(ids, in_loss) for a normalized record; prompts are masked unless train_on_inputs. Text
    and completions start as the tokenizer starts a sequence (BOS where its add_bos_token says
    so: Llama 2, Mistral, TinyLlama) and end with one EOS (which a tokenizer whose
    add_eos_token is true has put there itself); chat follows its template."""
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    adds_eos = bool(getattr(tokenizer, "add_eos_token", False))
    kind = item[0]
    if kind == "text":
        ids = list(tokenizer.encode(item[1], add_special_tokens=True))
        ids += [] if adds_eos else eos
        return ids, [True] * len(ids)
    if kind == "completion":
        prompt = prompt_ids(tokenizer, item[1])
        answer = list(tokenizer.encode(item[2], add_special_tokens=False)) + eos
        return prompt + answer, [train_on_inputs] * len(prompt) + [True] * len(answer)
    try:
        ids, is_response = tokenizer.chat_token_masks(item[1], item[2])  # weight 0: untrained
    except DataError as e:  # the template refused this record (raise_exception, a bad key)
        raise DataError(f"{where}: {e}" if where else str(e)) from None
    ids, is_response = list(ids), [bool(r) for r in is_response]
    if len(ids) != len(is_response):
        raise DataError(f"{where}: the tokenizer returned {len(ids)} ids but "
                        f"{len(is_response)} mask entries")
    return ids, ([True] * len(ids) if train_on_inputs else is_response)


def make_example(item: tuple, tokenizer, train_on_inputs: bool, max_seq_len: int,
                 where: str) -> tuple[Example | None, bool]:
    """(example or None when nothing is left to learn, was_truncated).

    Rows hold at most `max_seq_len` positions, so a sequence keeps `max_seq_len + 1` tokens.
    """
    ids, in_loss = tokens_and_mask(item, tokenizer, train_on_inputs, where)
    truncated = len(ids) > max_seq_len + 1
    ids, in_loss = ids[:max_seq_len + 1], in_loss[:max_seq_len + 1]
    if len(ids) < 2 or not any(in_loss[1:]):
        return None, truncated
    return from_token_mask(ids, in_loss, origin=where), truncated
